"""The model family: dense parity with transformers' Llama, sparse modes, cache, padding, generate."""

import itertools

import pytest
import torch
from transformers import AttentionInterface, AttentionMaskInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import sdpa_mask

from forecastkv import ForecastKVForCausalLM, SparseCache
from forecastkv.modeling import selection as sel
from tests.helpers import TINY_SPARSE, left_padded, rel, tiny_config, tiny_model

MODES = [
    dict(policy=policy, selector=selector, lse=lse)
    for policy, selector, lse in itertools.product(("infllmv2", "nosa"), ("query", "forecast"), ("exact", "coarse"))
]


def llama_twin(model):
    cfg = model.config
    twin = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            max_position_embeddings=cfg.max_position_embeddings,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_parameters=cfg.rope_parameters,
        )
    ).eval()
    missing, unexpected = twin.load_state_dict(model.state_dict(), strict=False)
    assert not missing
    return twin


# -- 1. dense parity --------------------------------------------------------------------------


def test_dense_matches_llama_tiny():
    model = tiny_model()
    twin = llama_twin(model)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel(model(ids).logits, twin(ids).logits) < 1e-5
    assert torch.equal(
        model.generate(ids, max_new_tokens=8, do_sample=False), twin.generate(ids, max_new_tokens=8, do_sample=False)
    )


@pytest.mark.bundled
def test_dense_matches_llama_on_bundled_smollm2(bundled_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundled_path)
    model = ForecastKVForCausalLM.from_pretrained(bundled_path)
    twin = LlamaForCausalLM.from_pretrained(bundled_path).eval()
    ids = tokenizer(["The first thing to know about startups is that"], return_tensors="pt").input_ids
    with torch.no_grad():
        assert rel(model(ids).logits, twin(ids).logits) < 1e-4
    ours = model.generate(ids, max_new_tokens=12, do_sample=False)
    theirs = twin.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(ours, theirs)


# -- 2. a budget covering every block equals dense -----------------------------------------


@pytest.mark.parametrize("mode", MODES[:2] + MODES[4:6], ids=lambda m: f"{m['policy']}-{m['lse']}")
def test_full_budget_equals_dense(mode):
    dense = tiny_model()
    full = tiny_model({**mode, "topk": 64, "query_blocks": 64})
    full.load_state_dict(dense.state_dict(), strict=False)
    if mode["policy"] == "nosa":  # CIS bias off: it is a different model otherwise
        for layer in full.model.layers:
            layer.self_attn.A.data.zero_()
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel(full(ids).logits, dense(ids).logits) < 1e-5
    assert torch.equal(
        full.generate(ids, max_new_tokens=6, do_sample=False), dense.generate(ids, max_new_tokens=6, do_sample=False)
    )


def test_tight_budget_changes_logits():
    dense = tiny_model()
    sparse = tiny_model({"policy": "infllmv2"})
    sparse.load_state_dict(dense.state_dict(), strict=False)
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel(sparse(ids).logits, dense(ids).logits) > 1e-2


# -- 4. incremental decode equals recomputing --------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(m.values()))
def test_incremental_decode_equals_recompute(mode):
    model = tiny_model(mode, seed=3)
    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=14, do_sample=False, output_logits=True, return_dict_in_generate=True)
        full = model(out.sequences).logits
    steps = torch.stack(out.logits, dim=1)
    assert rel(steps, full[:, ids.shape[1] - 1 : -1]) < 1e-4
    assert torch.equal(full[:, ids.shape[1] - 1 : -1].argmax(-1), out.sequences[:, ids.shape[1] :])


def test_forecast_decode_uses_plan_from_previous_layer():
    """Layer l plans layer l+1 before layer l stores its token, and layer l+1 reads exactly that plan;
    only layer 0 plans itself.  A model whose layers planned themselves would fail both checks."""
    model = tiny_model({"policy": "infllmv2", "selector": "forecast"}, seed=5)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    cache = SparseCache(model.config)
    events = []

    def spy(idx, layer):
        append, plan, attend = layer.append, layer.plan, layer.decode_attention
        layer.append = lambda *a, **k: (events.append(("append", idx, None)), append(*a, **k))[1]
        layer.plan = lambda sel: (events.append(("plan", idx, sel)), plan(sel))[1]
        layer.decode_attention = lambda q, p: (events.append(("attend", idx, p)), attend(q, p))[1]

    for idx, layer in enumerate(cache.layers):
        spy(idx, layer)
    with torch.no_grad():
        model(ids, past_key_values=cache)
        events.clear()
        model(torch.randint(0, 128, (1, 1)), past_key_values=cache)
    order = [(kind, idx) for kind, idx, _ in events]
    layers = model.config.num_hidden_layers
    assert order.index(("append", 0)) < order.index(("plan", 0))  # layer 0 selects its own blocks
    for idx in range(1, layers):
        assert order.count(("plan", idx)) == 1
        assert order.index(("plan", idx)) < order.index(("append", idx - 1)), idx
        planned = next(sel for kind, i, sel in events if kind == "plan" and i == idx)
        read = next(sel for kind, i, sel in events if kind == "attend" and i == idx)
        # the Plan handed over
        assert read.selection is planned and planned.shape == (1, 2, model.config.sparse.budget_blocks)


def test_multiple_forecast_vectors_per_group_run():
    model = tiny_model({"policy": "infllmv2", "selector": "forecast"}, heads_per_group=3)
    ids = torch.randint(0, 128, (1, 33), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
        full = model(out.sequences).logits
    assert rel(torch.stack(out.logits, 1), full[:, 32:-1]) < 1e-4


def test_dense_len_is_decided_per_sequence_per_call():
    """MiniCPM's rule: one decision per forward call from the key length (dense below dense_len),
    checked against a reference that runs the dense or the always-sparse model by that rule."""
    dense = tiny_model()
    mixed = tiny_model({"policy": "infllmv2", "dense_len": 40})
    always = tiny_model({"policy": "infllmv2", "dense_len": 0})
    for model in (mixed, always):
        model.load_state_dict(dense.state_dict(), strict=False)
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        long_call, long_sparse, long_dense = mixed(ids).logits, always(ids).logits, dense(ids).logits
        short_call, short_dense = mixed(ids[:, :30]).logits, dense(ids[:, :30]).logits
    assert rel(long_call, long_sparse) < 1e-6  # 60 keys: every row sparse, rows below dense_len too
    assert rel(long_call[:, 32:40], long_dense[:, 32:40]) > 1e-3  # rows 32..39 see 5 blocks > budget 4
    assert rel(short_call, short_dense) < 1e-6  # 30 keys: the whole call is dense
    # decode across the switch: a 30-token prompt (one dense call), then one call per token, dense
    # while its key length is below 40.  The reference recomputes everything at once with each
    # row attending as the call that produced it did.
    with torch.no_grad():
        out = mixed.generate(
            ids[:, :30], max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        twin = llama_twin(mixed)
        AttentionInterface.register(
            "sparse_reference", reference_sparse_attention(mixed.config.sparse, dense_row=lambda p: p + 1 < 40)
        )
        AttentionMaskInterface.register("sparse_reference", sdpa_mask)
        twin.set_attn_implementation("sparse_reference")
        reference = twin(out.sequences).logits[:, 29:-1]
    steps = torch.stack(out.logits, dim=1)
    assert rel(steps, reference) < 1e-4
    assert rel(steps[:, :10], dense(out.sequences).logits[:, 29:39]) < 1e-5  # below the switch: dense


def test_dense_len_batch_decides_per_sequence():
    """A left-padded batch with one sequence below dense_len and one above: each row as alone."""
    mixed = tiny_model({"policy": "infllmv2", "dense_len": 40}, seed=11)
    ids, mask = left_padded([30, 60], seed=12)
    with torch.no_grad():
        batched = mixed(ids, attention_mask=mask).logits
        for row, n in enumerate((30, 60)):
            alone = mixed(ids[row : row + 1, 60 - n :]).logits[0]
            assert rel(batched[row, 60 - n :], alone) < 1e-5, row


def reference_sparse_attention(sparse, dense_row=lambda positions: torch.zeros_like(positions, dtype=torch.bool)):
    """transformers' attention interface function for InfLLM-v2 attention, written from the
    definition on a full recompute (one sequence, no padding): per row the selection of
    `selection.py` from the layer's keys, a [T, S] mask of its blocks (rows where `dense_row(t)`:
    every earlier key), eager softmax with repeated KV heads."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        batch, heads, length, _ = query.shape
        group = heads // key.shape[1]
        positions = torch.arange(length).expand(batch, -1)
        keys = key.transpose(1, 2)  # [B, S, H, d]
        ckeys = sel.compress_keys(keys, sparse.kernel_size, sparse.kernel_stride)
        coarse = sel.compress_keys(keys, *sparse.coarse_kernel) if sparse.lse == "coarse" else None
        n_blocks = sel.num_blocks(length, sparse.block_size)
        scores = sel.score_blocks(
            query.transpose(1, 2), ckeys, positions, sparse, n_blocks, kind="query", lse_keys=coarse
        )
        ids = sel.select_blocks(scores, positions, sparse)
        # [B, H, T, S]
        blocks = sel.selection_mask(ids, n_blocks).repeat_interleave(sparse.block_size, dim=-1)[..., :length]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        allowed = causal & (blocks | dense_row(torch.arange(length)).view(1, 1, -1, 1))
        allowed = allowed.repeat_interleave(group, dim=1)
        logits = (query @ key.repeat_interleave(group, dim=1).transpose(-1, -2) * scaling).masked_fill(
            ~allowed, float("-inf")
        )
        return (torch.softmax(logits, dim=-1) @ value.repeat_interleave(group, dim=1)).transpose(1, 2), None

    return attention


@pytest.mark.parametrize("lse", ["exact", "coarse"])
def test_sparse_prefill_matches_masked_reference(lse):
    """A tight budget (4 of up to 13 blocks): block-sparse prefill (tiles gathering the union of
    their rows' blocks) equals full-mask attention over each row's own selection."""
    model = tiny_model({"policy": "infllmv2", "lse": lse}, seed=15)
    twin = llama_twin(model)
    AttentionInterface.register("sparse_reference", reference_sparse_attention(model.config.sparse))
    AttentionMaskInterface.register("sparse_reference", sdpa_mask)
    twin.set_attn_implementation("sparse_reference")
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(16))
    with torch.no_grad():
        assert rel(model(ids).logits, twin(ids).logits) < 1e-5


def nosa_reference_attention(model):
    """transformers' attention interface function adding NOSA's CIS bias A * softplus(delta(v))
    to the scaled logits, written from the definition (eager softmax, GQA by repeating heads)."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        ours = model.model.layers[module.layer_idx].self_attn
        heads, kv_heads = query.shape[1], key.shape[1]
        cis = ours.A * torch.nn.functional.softplus(ours.delta(value.transpose(1, 2).flatten(-2)))  # [B, S, H]
        bias = cis.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)[:, :, None, :]
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
        rows, count = query.shape[2], key.shape[2]
        # causal, right-aligned
        allowed = torch.arange(count).view(1, -1) <= torch.arange(count - rows, count).view(-1, 1)
        logits = (query @ key.transpose(-1, -2) * scaling + bias).masked_fill(~allowed, float("-inf"))
        return (torch.softmax(logits.float(), dim=-1).to(value.dtype) @ value).transpose(1, 2), None

    return attention


def test_nosa_cis_bias_matches_reference():
    """NOSA with A != 0 and a budget covering every block equals Llama attention plus the CIS bias."""
    model = tiny_model({"policy": "nosa", "topk": 64, "query_blocks": 64}, seed=13)
    assert all(layer.self_attn.A.abs().min() > 0 for layer in model.model.layers)
    twin = llama_twin(model)
    AttentionInterface.register("nosa_reference", nosa_reference_attention(model))
    AttentionMaskInterface.register("nosa_reference", sdpa_mask)
    ids = torch.randint(0, 128, (2, 50), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        plain = twin(ids).logits
        twin.set_attn_implementation("nosa_reference")
        reference = twin(ids).logits
        ours = model(ids).logits
        assert rel(reference, plain) > 1e-2  # the bias is on
        assert rel(ours, reference) < 1e-5
        assert torch.equal(
            model.generate(ids, max_new_tokens=6, do_sample=False),
            twin.generate(ids, max_new_tokens=6, do_sample=False),
        )


# -- 5. left padding ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [None] + MODES[::2], ids=lambda m: "dense" if m is None else "-".join(m.values()))
def test_left_padded_batch_matches_each_sequence_alone(mode):
    model = tiny_model(mode, seed=8)
    lengths = (37, 22, 30)
    ids, mask = left_padded(lengths, seed=9)
    width = max(lengths)
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
        for row, n in enumerate(lengths):
            alone = model.generate(ids[row : row + 1, width - n :], max_new_tokens=10, do_sample=False, pad_token_id=0)
            assert batched[row, width:].tolist() == alone[0, n:].tolist(), row


def test_sampled_generation_is_seeded():
    model = tiny_model({"policy": "infllmv2"})
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    a = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=20)
    torch.manual_seed(0)
    b = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=20)
    assert torch.equal(a, b) and a.shape == (2, 28)


# -- 8. errors ---------------------------------------------------------------------------------


def test_sequence_beyond_max_positions_is_rejected():
    model = tiny_model(max_position_embeddings=32)
    with pytest.raises(ValueError, match="sequence length 33 exceeds max_position_embeddings=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_bad_sparse_configs_are_rejected():
    with pytest.raises(ValueError, match="block_size=10 must be a multiple of kernel_stride=4"):
        tiny_config(sparse_config={**TINY_SPARSE, "kernel_stride": 4, "kernel_size": 8, "block_size": 10})
    with pytest.raises(ValueError, match="unknown sparse_config preset 'nope'"):
        tiny_config(sparse_config="nope")
    with pytest.raises(ValueError, match="unknown sparse_config key"):
        tiny_config(sparse_config={**TINY_SPARSE, "top_k": 3})
    with pytest.raises(ValueError, match="forecast.heads_per_group=4 exceeds the GQA group size 3"):
        tiny_config(forecast={"enabled": True, "heads_per_group": 4})
    with pytest.raises(ValueError, match="selector='forecast' needs forecast heads"):
        tiny_config(sparse_config={**TINY_SPARSE, "selector": "forecast"})
