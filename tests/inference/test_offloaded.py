"""OffloadedSparseCache: token/logit parity with SparseCache in every mode, O(budget) device bytes,
counters against an independent replay of the slot cache, and clear errors."""

from __future__ import annotations

import itertools

import pytest
import torch

from forecastkv import SparseCache
from forecastkv.inference import OffloadedSparseCache, diff_block_map
from forecastkv.modeling.modeling import CACHE_KWARG
from tests.helpers import left_padded, rel, tiny_model
from tests.inference.conftest import INTERPRETED_BACKENDS, RUNTIME_BACKENDS

POLICIES = ("infllmv2", "nosa")
SELECTORS = ("query", "forecast")


def modes_for(selector: str) -> list[str]:
    """The modes whose selector is `selector` (no-offload and dense-offload keep the model's)."""
    own = {"query": ["sparse-offload"], "forecast": ["forecast-sync", "forecast-offload"]}[selector]
    return ["no-offload", "dense-offload", *own]


def generate(model, ids, mask, cache, new_tokens=10):
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
            **{CACHE_KWARG: cache},
        )


def assert_parity(model, ids, mask, modes, new_tokens=10, reference_selector=None, **options):
    """Every mode gives SparseCache's tokens and logits (within 1e-5 relative, fp32)."""
    ref = generate(model, ids, mask, SparseCache(model.config, selector=reference_selector), new_tokens)
    ref_logits = torch.stack(ref.logits, 1)
    caches = {}
    for mode in modes:
        cache = OffloadedSparseCache.for_model(model, mode=mode, **options)
        out = generate(model, ids, mask, cache, new_tokens)
        assert torch.equal(out.sequences, ref.sequences), mode
        assert rel(torch.stack(out.logits, 1), ref_logits) < 1e-5, mode
        caches[mode] = cache
    return caches


# -- parity ---------------------------------------------------------------------------------------


# The grid in the backends without the interpreter.  Through the block gather in Triton (auto) the
# two cases that differ most: the query selector alone, and NOSA's bias with the forecast selector
# over a left-padded batch; through every decode kernel in Triton (kernels-triton, 20 s a mode in
# the interpreter) the first (NOSA's bias over a left-padded batch there: test_short_prompts.py).
INTERPRETED_CASES = {
    "auto": (("infllmv2", "query", "single"), ("nosa", "forecast", "left-padded")),
    "kernels-triton": (("infllmv2", "query", "single"),),
}
EVERY_MODE_GRID = [
    *(
        (policy, selector, batch, backend)
        for policy, selector in itertools.product(POLICIES, SELECTORS)
        for batch in ("single", "left-padded")
        for backend in RUNTIME_BACKENDS
    ),
    *(
        pytest.param(*case, backend.values[0], marks=backend.marks)
        for backend in INTERPRETED_BACKENDS
        for case in INTERPRETED_CASES[backend.values[0]]
    ),
]


@pytest.mark.parametrize("policy,selector,batch,runtime_backend", EVERY_MODE_GRID, indirect=["runtime_backend"])
def test_every_mode_matches_sparse_cache_tiny(policy, selector, batch, runtime_backend, one_thread):
    model = tiny_model({"policy": policy, "selector": selector}, seed=3)
    ids, mask = left_padded([45] if batch == "single" else [45, 26, 37])
    # batch 1: the selector's own modes
    modes = modes_for(selector) if batch == "left-padded" else modes_for(selector)[2:]
    caches = assert_parity(model, ids, mask, modes, new_tokens=9)
    moved = caches[modes_for(selector)[-1]].stats()
    assert moved["decode_steps"] == 8 and moved["h2d_bytes_per_step_mean"] > 0  # blocks really moved


@pytest.mark.parametrize("runtime_backend", RUNTIME_BACKENDS, indirect=True)
def test_cache_selector_overrides_the_model_selector(runtime_backend, one_thread):
    """sparse-offload on a forecast model selects with queries: the tokens of SparseCache(selector='query')."""
    model = tiny_model({"policy": "infllmv2", "selector": "forecast"}, seed=4)
    ids, mask = left_padded([41, 30])
    assert_parity(model, ids, mask, ["sparse-offload"], reference_selector="query")
    with torch.no_grad():
        forecast_tokens = generate(model, ids, mask, SparseCache(model.config)).sequences
        query_tokens = generate(model, ids, mask, SparseCache(model.config, selector="query")).sequences
    assert not torch.equal(forecast_tokens, query_tokens)  # the override changes what is attended


@pytest.mark.parametrize("runtime_backend", RUNTIME_BACKENDS, indirect=True)
def test_first_layer_offloaded_too(runtime_backend, one_thread):
    model = tiny_model({"policy": "nosa", "selector": "forecast"}, seed=5)
    ids, mask = left_padded([40, 33])
    assert_parity(model, ids, mask, ["forecast-offload", "dense-offload"], first_layer_resident=False)


# the coarse LSE also through the Triton decode kernels (slow in the interpreter)
@pytest.mark.parametrize("runtime_backend", [*RUNTIME_BACKENDS, INTERPRETED_BACKENDS[-1]], indirect=True)
def test_minicpm_format_coarse_lse_and_dense_len(tmp_path, runtime_backend, one_thread):
    """A tiny MiniCPM4.1-format checkpoint (muP, LongRoPE, coarse LSE), dense below dense_len."""
    from forecastkv import ForecastKVForCausalLM
    from tests.modeling.test_checkpoints import DENSE_MINICPM, minicpm_dir

    heads = {f"model.layers.{i}.self_attn.q_future_proj.weight": torch.randn(2 * 16, 96) for i in range(3)}
    heads["model.layers.0.self_attn.q_curr_proj.weight"] = torch.randn(2 * 16, 96)
    directory, _ = minicpm_dir(tmp_path, {**DENSE_MINICPM, "dense_len": 48}, heads)
    for selector in SELECTORS:
        model = ForecastKVForCausalLM.from_pretrained(
            directory, sparse_config={**DENSE_MINICPM, "dense_len": 48, "lse": "coarse", "selector": selector}
        )
        assert model.config.sparse.lse == "coarse"
        ids, mask = left_padded([40, 29])  # crosses dense_len while decoding
        assert_parity(model, ids, mask, modes_for(selector), new_tokens=14)


@pytest.mark.bundled
def test_bundled_smollm2_offloaded_matches_sparse_cache(bundled_path):
    """Real weights (InfLLM-v2; the checkpoint has no NOSA parameters), prefetched forecast blocks,
    left padding.  (The query selector and NOSA are covered on the tiny models.)"""
    from transformers import AutoTokenizer

    from forecastkv import ForecastKVForCausalLM, bundled_texts

    tokenizer = AutoTokenizer.from_pretrained(bundled_path)
    sparse = {
        "policy": "infllmv2",
        "selector": "forecast",
        "block_size": 16,
        "kernel_size": 8,
        "kernel_stride": 4,
        "window_size": 16,
        "topk": 4,
        "init_blocks": 1,
        "dense_len": 0,
        "query_blocks": 2,
    }
    model = ForecastKVForCausalLM.from_pretrained(
        bundled_path, sparse_config=sparse, forecast={"init": "next_query", "heads_per_group": 1}
    )
    text = bundled_texts("heldout")[0]
    rows = [
        tokenizer(part, return_tensors="pt").input_ids[0][:n] for part, n in ((text[:1200], 72), (text[2000:3200], 57))
    ]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    caches = assert_parity(model, ids, mask, ["forecast-offload"], new_tokens=4)
    assert caches["forecast-offload"].stats()["blocks_fetched_per_layer"][1] > 0


# -- bytes ----------------------------------------------------------------------------------------


def test_device_bytes_are_o_budget():
    model = tiny_model({"policy": "nosa", "selector": "forecast"}, seed=6)
    sparse, config = model.config.sparse, model.config
    measured = []
    for length in (40, 150):
        ids, mask = left_padded([length, length - 7])
        cache = OffloadedSparseCache.for_model(model, mode="forecast-offload", first_layer_resident=False)
        generate(model, ids, mask, cache, new_tokens=4)
        # the device-role tensors, summed here from their shapes
        d, heads, rows = config.head_dim, config.num_key_value_heads, (sparse.budget_blocks + 1) * sparse.block_size
        ring = sparse.kernel_size  # the ring of the latest rows: the widest window (exact LSE)
        per_layer = (
            2 * 2 * rows * heads * d * 4
            + 2 * rows * heads * 4
            + 2 * heads * sparse.budget_blocks * 8
            + 2 * ring * heads * (d + 1) * 4
        )
        own_sum = 0
        for layer in cache.layers:
            store = layer.store
            assert (
                store.k_slots.shape == (2, rows, heads, d)
                and store.k_ring.shape == (2, ring, heads, d)
                and store.staged is None
            )
            own_sum += sum(
                t.numel() * t.element_size()
                for t in (store.k_slots, store.v_slots, store.bias_slots, store.block_map, store.k_ring, store.cis_ring)
            )
        assert own_sum == per_layer * config.num_hidden_layers == cache.device_nbytes()
        assert cache.host_nbytes() >= 2 * length * heads * d * 2 * 4 * config.num_hidden_layers
        measured.append(cache.device_nbytes())
    assert measured[0] == measured[1]


def test_max_length_preallocates_and_limits():
    model = tiny_model({"policy": "infllmv2", "selector": "forecast"}, seed=7)
    ids, mask = left_padded([40])
    cache = OffloadedSparseCache.for_model(model, max_length=60)
    generate(model, ids, mask, cache, new_tokens=5)
    assert all(layer.store.host.blocks.capacity == 60 for layer in cache.layers if layer.offloaded)
    with pytest.raises(ValueError, match="sequence of 61 tokens exceeds this cache's max_length=60"):
        generate(model, ids, mask, OffloadedSparseCache.for_model(model, max_length=60), new_tokens=30)


# -- counters against an independent replay ----------------------------------------------------------


def replay_slot_cache(records, slots: int):
    """A plain set/list model of one layer's slot cache: per (sequence, head) a list of `slots`
    block ids; wanted = selected complete blocks; hits stay; misses go to empty slots first, then
    to the lowest-numbered slots whose block is not wanted.  Returns (wanted, hits, misses) per step."""
    table = {}
    counts = []
    for selection, complete in records:
        wanted_n = hits_n = misses_n = 0
        batch, heads, _ = selection.shape
        for b, h in itertools.product(range(batch), range(heads)):
            resident = table.setdefault((b, h), [None] * slots)
            wanted = sorted({int(j) for j in selection[b, h] if 0 <= int(j) < int(complete[b])})
            hit = [j for j in wanted if j in resident]
            miss = [j for j in wanted if j not in resident]
            free = [m for m in range(slots) if resident[m] is None] + [
                m for m in range(slots) if resident[m] is not None and resident[m] not in wanted
            ]
            for block, slot in zip(miss, free):
                resident[slot] = block
            wanted_n, hits_n, misses_n = wanted_n + len(wanted), hits_n + len(hit), misses_n + len(miss)
        counts.append((wanted_n, hits_n, misses_n))
    return counts


@pytest.mark.parametrize("mode", ["sparse-offload", "forecast-offload"])
def test_counters_equal_a_set_based_replay(mode):
    selector = "query" if mode == "sparse-offload" else "forecast"
    model = tiny_model({"policy": "infllmv2", "selector": selector, "topk": 4}, seed=8)
    ids, mask = left_padded([70, 52])
    cache = OffloadedSparseCache.for_model(model, mode=mode, record_selections=True)
    generate(model, ids, mask, cache, new_tokens=16)
    stats = cache.stats()
    per_step = [0] * stats["decode_steps"]
    for idx, layer in enumerate(cache.layers):
        if not layer.offloaded:
            continue
        expected = replay_slot_cache(layer.store.log.selections, layer.store.budget)
        assert layer.store.log.table().tolist() == [list(row) for row in expected]
        misses = sum(row[2] for row in expected)
        assert stats["blocks_fetched_per_layer"][idx] == misses
        assert stats["hit_rate_per_layer"][idx] == pytest.approx(
            sum(r[1] for r in expected) / sum(r[0] for r in expected)
        )
        block_bytes = layer.block_size * model.config.head_dim * 2 * 4
        for step, row in enumerate(expected):
            per_step[step] += row[2] * block_bytes
    assert stats["h2d_bytes_per_step"] == per_step
    assert 0 < stats["hit_rate"] < 1


def test_diff_block_map_keeps_hits_and_fills_empty_slots_first():
    block_map = torch.tensor([[[5, -1, 2, 7]]])
    wanted = torch.tensor([[[2, 3, 9, -1]]])
    new_map, load_ids, slot_of, hits, misses = diff_block_map(block_map, wanted)
    assert new_map.tolist() == [[[9, 3, 2, 7]]]  # 3 -> the empty slot 1, then 9 -> slot 0 (lowest stale)
    assert load_ids.tolist() == [[[9, 3, -1, -1]]]
    assert slot_of.tolist() == [[[2, 1, 0, -1]]]
    assert hits.tolist() == [[1]] and misses.tolist() == [[2]]


# -- errors -----------------------------------------------------------------------------------------


def test_bad_input_is_rejected_clearly():
    model = tiny_model({"policy": "infllmv2", "selector": "forecast"}, seed=1)
    with pytest.raises(ValueError, match=r"unknown offload mode 'fast'; choose one of \('no-offload'"):
        OffloadedSparseCache.for_model(model, mode="fast")
    other = tiny_model({"policy": "infllmv2", "selector": "forecast"}, num_hidden_layers=2)
    ids, mask = left_padded([30])
    with pytest.raises(ValueError, match="built for another model .*num_hidden_layers: cache 2 vs model 3"):
        generate(model, ids, mask, OffloadedSparseCache.for_model(other), new_tokens=2)
    query_only = tiny_model({"policy": "infllmv2"}, seed=1)
    query_only.config.forecast = {"enabled": False}
    with pytest.raises(
        ValueError, match="mode 'forecast-offload' selects with Forecast heads, but this model has none"
    ):
        OffloadedSparseCache.for_model(query_only, mode="forecast-offload")
