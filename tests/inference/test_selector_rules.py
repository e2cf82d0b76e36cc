"""The selectors as one rule (`sparse_config.selector`, `top_p`, `reuse_anchors`) wired through the model and
both caches: each selector's decode selection against a plain loop of its paper's rule, offloaded tokens equal
resident tokens, top-p's bytes equal the missing selected blocks' bytes, and clear errors at every boundary."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from forecastkv import SparseCache, kernels
from forecastkv.errors import ConfigError
from forecastkv.inference import OffloadedSparseCache
from forecastkv.modeling.configuration import SparseConfig
from forecastkv.modeling.modeling import CACHE_KWARG
from tests.helpers import left_padded, rel, tiny_model
from tests.inference.conftest import INTERPRETED_BACKENDS, RUNTIME_BACKENDS
from tests.inference.test_offloaded import generate, replay_slot_cache

# topk 4 + 1 local = 5 of the 9-10 blocks a 70-token prompt holds: every selector has a choice to make
GEOMETRY = {"policy": "infllmv2", "topk": 4}
NEW_SELECTORS = ("quest", "oracle", "reuse", "speculate")


@pytest.fixture(autouse=True)
def _tiny_models_on_one_thread(one_thread):
    """Every test here runs tiny models: one intra-op thread (see tests/inference/conftest.py)."""
    yield


def model_with(selector: str, top_p: float = 0.0, policy: str = "infllmv2", seed: int = 8, **extra):
    model = tiny_model({**GEOMETRY, "policy": policy, "selector": selector, "top_p": top_p, **extra}, seed=seed)
    return model


def decode_steps(model, cache, ids, mask, steps: int):
    """Prefill ids, then `steps` greedy decode steps by hand; returns per step the per-layer records
    (collect_selections) and the hidden state entering every layer (forward pre-hooks)."""
    entering: list[list[torch.Tensor]] = []
    hooks = [
        layer.register_forward_pre_hook(lambda module, args: entering[-1].append(args[0]))
        for layer in model.model.layers
    ]
    records = []
    try:
        with torch.no_grad():
            entering.append([])
            out = model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: cache})
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(steps):
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
                entering.append([])
                out = model(input_ids=token, attention_mask=mask, collect_selections=True, **{CACHE_KWARG: cache})
                records.append((out.selections, entering[-1], cache.sequence_lengths().clone() - 1))
                token = out.logits[:, -1:].argmax(-1)
    finally:
        for hook in hooks:
            hook.remove()
    return records


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"top_p": 1.5}, r"top_p must be a number in \[0, 1\].*got 1.5"),
        ({"top_p": -0.1}, r"top_p must be a number in \[0, 1\].*got -0.1"),
        ({"top_p": True}, r"top_p must be a number"),
        ({"top_p": 0.9, "policy": "nosa"}, r"top_p=0.9 needs policy 'infllmv2'"),
        ({"reuse_anchors": [1, 2]}, r"reuse_anchors must hold layer 0"),
        ({"reuse_anchors": [0, 0]}, r"no id twice"),
        ({"reuse_anchors": [0, -1]}, r"non-negative layer ids"),
        ({"reuse_anchors": "0"}, r"must be a list of layer ids"),
        ({"selector": "random"}, r"selector='random' is not one of"),
    ],
)
def test_bad_selector_settings_name_the_value(changes, message):
    with pytest.raises(ConfigError, match=message):
        SparseConfig(**changes)


def test_settings_at_their_boundaries_are_accepted_and_round_trip():
    for p in (0.0, 1.0, 0.5):
        assert SparseConfig(top_p=p).top_p == p
    config = SparseConfig(selector="reuse", reuse_anchors=[3, 0])
    assert config.reuse_anchors == (0, 3)
    assert SparseConfig.from_dict(config.to_dict()) == config
    assert config.to_dict()["reuse_anchors"] == [0, 3]


def test_reuse_anchor_past_the_last_layer_is_an_error():
    model = model_with("reuse", reuse_anchors=[0, 3])  # tiny model: 3 layers
    ids, mask = left_padded([20])
    with pytest.raises(ConfigError, match=r"reuse_anchors=\[0, 3\] names a layer past the model's 3 layers"):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)


def test_offloaded_runtime_refuses_what_it_cannot_run():
    oracle = model_with("oracle")
    for mode in ("sparse-offload", "forecast-sync", "forecast-offload", "dense-offload"):
        with pytest.raises(ValueError, match=r"oracle selector reads every key.*cannot run it in mode"):
            OffloadedSparseCache.for_model(oracle, mode=mode)
    assert OffloadedSparseCache.for_model(oracle, mode="no-offload").selector == "oracle"
    quest = model_with("quest")
    with pytest.raises(ValueError, match=r"'quest' selector only knows them at the consuming layer"):
        OffloadedSparseCache.for_model(quest, mode="forecast-offload")
    assert OffloadedSparseCache.for_model(quest).mode == "sparse-offload"  # for_model picks a mode it can run
    assert OffloadedSparseCache.for_model(model_with("speculate")).mode == "forecast-offload"
    with pytest.raises(ValueError, match=r"selector='nope' is not None or one of"):
        OffloadedSparseCache.for_model(quest, selector="nope")


def test_a_quest_call_on_a_cache_built_for_another_selector_says_so():
    model = model_with("quest")
    ids, mask = left_padded([40])
    cache = SparseCache(model.config, selector="query")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: cache})  # the query selector: fine
        cache.selector = None  # now the model's quest selector, on a cache that kept no bounds
        with pytest.raises(ValueError, match=r"keeps no block key bounds.*selector is 'quest'"):
            model(input_ids=ids[:, :1], attention_mask=torch.cat([mask, mask[:, :1]], 1), **{CACHE_KWARG: cache})


# -- each selector against a plain loop of its rule -----------------------------------------------


def loop_topk(scores: list[float], forced: set[int], visible: int, k: int) -> list[int]:
    """InfLLM-v2's top-k as a loop: forced blocks first, then the highest scores (ties: lower id),
    over blocks 0..visible-1 whose score is not -inf."""
    order = sorted(range(visible), key=lambda j: (j not in forced, -scores[j], j))
    chosen = [j for j in order if j in forced or scores[j] != -math.inf][:k]
    return sorted(chosen)


def selected_row(ids: torch.Tensor) -> list[int]:
    return sorted(int(j) for j in ids if int(j) >= 0)


def layer_queries(model, layer_idx: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Post-RoPE queries [B, 1, Hq, d] of layer `layer_idx` from the hidden state entering it."""
    layer = model.model.layers[layer_idx]
    cos, sin = model.model.rotary_emb(positions, hidden.dtype)
    return layer.self_attn.queries(layer.input_layernorm(hidden), cos, sin)


@pytest.mark.parametrize("cache_kind", ["resident", "sparse-offload"])
def test_quest_selects_the_blocks_of_the_largest_key_upper_bounds(cache_kind):
    """Quest (Tang et al. 2024): per block and channel the min and max key; a query head's bound is
    sum_c max(q_c lo_c, q_c hi_c) / sqrt(d); softmax per head over complete blocks, summed per group."""
    model = model_with("quest")
    sparse = model.config.sparse
    bs = sparse.block_size
    ids, mask = left_padded([70, 55])
    cache = SparseCache(model.config) if cache_kind == "resident" else OffloadedSparseCache.for_model(model)
    keys_cache = SparseCache(model.config)  # the same run's keys, resident, for the loop
    steps = decode_steps(model, cache, ids, mask, 3)
    decode_steps(model, keys_cache, ids, mask, 3)
    heads, group = (
        model.config.num_key_value_heads,
        model.config.num_attention_heads // model.config.num_key_value_heads,
    )
    checked = 0
    for layer_idx in range(len(model.model.layers)):
        keys = keys_cache.layers[layer_idx].store.keys
        for records, entering, positions in steps[-1:]:
            q = layer_queries(model, layer_idx, entering[layer_idx], positions.view(-1, 1))
            ids_now = records[layer_idx]["selected"]
            for b, h in itertools.product(range(ids.shape[0]), range(heads)):
                t = int(positions[b])
                complete = (t + 1) // bs
                total = [0.0] * (t // bs + 1)
                for i in range(group):
                    qh = q[b, 0, h * group + i].detach().double()
                    bounds = []
                    for j in range(complete):
                        block = keys[b, j * bs : (j + 1) * bs, h].double()
                        lo, hi = block.min(0).values, block.max(0).values
                        bounds.append(float(torch.maximum(qh * lo, qh * hi).sum()) / math.sqrt(q.shape[-1]))
                    top = max(bounds)
                    norm = sum(math.exp(u - top) for u in bounds)
                    for j, u in enumerate(bounds):
                        total[j] += math.exp(u - top) / norm
                scores = [total[j] if j < complete else -math.inf for j in range(t // bs + 1)]
                forced = set(range(sparse.init_blocks)) | set(range(t // bs - sparse.local_blocks, t // bs + 1))
                expected = loop_topk(scores, forced, t // bs + 1, sparse.budget_blocks)
                assert selected_row(ids_now[b, h, 0]) == expected, (layer_idx, b, h)
                checked += 1
    assert checked == len(model.model.layers) * ids.shape[0] * heads


def test_quest_bounds_kept_incrementally_equal_the_bounds_of_the_stored_keys():
    from forecastkv.selectors.quest import block_key_bounds

    model = model_with("quest")
    ids, mask = left_padded([70, 55])
    resident, offloaded = SparseCache(model.config), OffloadedSparseCache.for_model(model)
    decode_steps(model, resident, ids, mask, 3)  # crosses a block boundary (72, 56) while decoding
    decode_steps(model, offloaded, ids, mask, 3)
    for layer, off in zip(resident.layers, offloaded.layers):
        for b, length in enumerate(layer.host_lengths):
            lo, hi = block_key_bounds(layer.store.keys[b : b + 1, :length], model.config.sparse.block_size)
            blocks = lo.shape[1]
            for cache_layer in (layer, off):
                low, high = cache_layer.key_bounds()
                assert torch.equal(low[b : b + 1, :blocks], lo) and torch.equal(high[b : b + 1, :blocks], hi)


def test_oracle_selects_the_blocks_of_the_most_true_attention_mass():
    model = model_with("oracle")
    sparse = model.config.sparse
    bs, k = sparse.block_size, sparse.budget_blocks
    ids, mask = left_padded([70, 55])
    cache = SparseCache(model.config)
    steps = decode_steps(model, cache, ids, mask, 3)
    heads, group = (
        model.config.num_key_value_heads,
        model.config.num_attention_heads // model.config.num_key_value_heads,
    )
    for layer_idx in range(len(model.model.layers)):
        keys = cache.layers[layer_idx].store.keys
        records, entering, positions = steps[-1]
        q = layer_queries(model, layer_idx, entering[layer_idx], positions.view(-1, 1))
        for b, h in itertools.product(range(ids.shape[0]), range(heads)):
            t = int(positions[b])
            mass = [0.0] * (t // bs + 1)
            for i in range(group):
                logits = [
                    float(q[b, 0, h * group + i].detach().double() @ keys[b, s, h].double()) / math.sqrt(q.shape[-1])
                    for s in range(t + 1)
                ]
                top = max(logits)
                norm = sum(math.exp(x - top) for x in logits)
                for s, x in enumerate(logits):
                    mass[s // bs] += math.exp(x - top) / norm / group
            best = max(
                itertools.combinations(range(len(mass)), min(k, len(mass))), key=lambda c: sum(mass[j] for j in c)
            )
            got = selected_row(records[layer_idx]["selected"][b, h, 0])
            assert sum(mass[j] for j in got) == pytest.approx(sum(mass[j] for j in best), abs=1e-6)


@pytest.mark.parametrize("anchors", [[0], [0, 1]])
def test_reuse_layers_attend_their_anchors_blocks(anchors):
    model = model_with("reuse", reuse_anchors=anchors)
    ids, mask = left_padded([70, 55])
    steps = decode_steps(model, OffloadedSparseCache.for_model(model), ids, mask, 4)
    for records, _, _ in steps:
        for layer_idx, record in enumerate(records):
            anchor = max(a for a in anchors if a <= layer_idx)
            assert torch.equal(record["selected"], records[anchor]["selected"])
            if layer_idx in anchors:  # an anchor selects with its own queries
                assert torch.equal(record["selected"], record["query"])


def test_speculate_scores_the_next_layers_keys_with_its_guessed_queries():
    """InfiniGen-style: layer l's blocks are chosen by layer l's input norm and q_proj applied to the
    residual entering layer l-1, scored against layer l's compressed keys as the query selector scores
    (group softmax), before layer l stores its token (lag 1); layer 0 selects with its own queries."""
    from forecastkv.modeling import selection as sel

    model = model_with("speculate")
    sparse = model.config.sparse
    ids, mask = left_padded([70, 55])
    cache = SparseCache(model.config)
    steps = decode_steps(model, cache, ids, mask, 3)
    records, entering, positions = steps[-1]
    assert torch.equal(records[0]["selected"], records[0]["query"])
    pos = positions.view(-1, 1)
    guess = layer_queries(model, 1, entering[0], pos)
    ckeys = cache.layers[1].compressed()[0]
    expected = sel.layer_selection(guess, ckeys, pos, sparse, "speculate")
    assert torch.equal(records[1]["selected"], expected)


# -- offloaded tokens equal resident tokens, for every selector -------------------------------------


# every selector in both backends without the interpreter; the block gather (auto) and every decode
# kernel (kernels-triton, seconds a token in the interpreter) with the top-p budget only
PARITY_GRID = [
    *((selector, top_p, backend) for selector in NEW_SELECTORS for top_p in (0.0, 0.8) for backend in RUNTIME_BACKENDS),
    *(
        pytest.param(selector, 0.8, backend.values[0], marks=backend.marks)
        for selector in NEW_SELECTORS
        for backend in INTERPRETED_BACKENDS
    ),
]


@pytest.mark.parametrize(("selector", "top_p", "runtime_backend"), PARITY_GRID, indirect=["runtime_backend"])
def test_offloaded_tokens_equal_resident_tokens(selector, top_p, runtime_backend):
    model = model_with(selector, top_p, reuse_anchors=[0, 1] if selector == "reuse" else [0])
    ids, mask = left_padded([70, 52])
    ref = generate(model, ids, mask, SparseCache(model.config), 6)
    modes = {"oracle": ["no-offload"], "quest": ["no-offload", "sparse-offload"]}.get(
        selector,
        ["sparse-offload", "forecast-offload"],  # reuse and speculate plan a layer ahead
    )
    for mode in modes:
        out = generate(model, ids, mask, OffloadedSparseCache.for_model(model, mode=mode), 6)
        assert torch.equal(out.sequences, ref.sequences), mode
        assert rel(torch.stack(out.logits, 1), torch.stack(ref.logits, 1)) < 1e-5, mode


def test_selectors_choose_differently_on_one_prompt():
    """The wiring is not one rule under six names: on one prompt the selectors pick different blocks."""
    ids, mask = left_padded([70, 52])
    chosen = {}
    for selector in ("query", "forecast", *NEW_SELECTORS):
        model = model_with(selector)
        steps = decode_steps(model, SparseCache(model.config), ids, mask, 2)
        chosen[selector] = torch.cat([record["selected"].flatten() for record in steps[-1][0]])
    distinct = {tuple(ids.tolist()) for ids in chosen.values()}
    assert len(distinct) >= 4, {name: ids.tolist() for name, ids in chosen.items()}


# -- top-p ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("selector", "mode"), [("query", "sparse-offload"), ("forecast", "forecast-offload")])
def test_top_p_bytes_are_the_missing_selected_blocks_bytes(selector, mode):
    """With a top-p budget the blocks per step vary; the runtime counts exactly the selected blocks
    missing from the slots (a set-based replay), and top-p selects fewer than the cap somewhere."""
    model = model_with(selector, top_p=0.6, seed=8)
    ids, mask = left_padded([70, 52])
    cache = OffloadedSparseCache.for_model(model, mode=mode, record_selections=True)
    generate(model, ids, mask, cache, new_tokens=16)
    stats = cache.stats()
    per_step = [0] * stats["decode_steps"]
    widths = set()
    for layer in cache.layers:
        if not layer.offloaded:
            continue
        expected = replay_slot_cache(layer.store.log.selections, layer.store.budget)
        assert layer.store.log.table().tolist() == [list(row) for row in expected]
        block_bytes = layer.block_size * model.config.head_dim * 2 * 4
        for step, row in enumerate(expected):
            per_step[step] += row[2] * block_bytes
        for selection, _ in layer.store.log.selections:
            assert selection.shape[-1] == model.config.sparse.budget_blocks  # the cap is the shape
            widths.update((selection >= 0).sum(-1).flatten().tolist())
    assert stats["h2d_bytes_per_step"] == per_step
    assert min(widths) < model.config.sparse.budget_blocks  # top-p took fewer blocks than the cap somewhere


@pytest.mark.parametrize("selector", ["forecast", "reuse", "speculate", "quest"])
def test_collecting_selections_changes_no_logit(selector):
    """collect_selections also projects the Forecast heads for the records; what a layer is planned and
    attends with must not change (a reuse anchor after layer 0 once got the forecast vectors' plan)."""
    model = model_with(selector, reuse_anchors=[0, 2])
    ids, mask = left_padded([70, 52])
    logits = []
    for collect in (False, True):
        cache = OffloadedSparseCache.for_model(model)
        with torch.no_grad():
            token = model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)
            step_mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
            out = model(input_ids=token, attention_mask=step_mask, collect_selections=collect, **{CACHE_KWARG: cache})
        logits.append(out.logits)
    assert torch.equal(logits[0], logits[1])


@pytest.mark.slow  # the model's prefill through the fused stage-1 kernel, end to end in the interpreter
@pytest.mark.parametrize("selector", ["speculate", "quest", "reuse"])
def test_prefill_with_the_fused_stage1_kernel_selects_as_the_reference(selector):
    """A sparse prefill (every row selects) through the fused stage-1 kernel (speculate scores with the
    query rule at the forecast's lag; the kernel is told both) and through the PyTorch path: the same
    selections and logits.  The interpreter runs the kernel here, as CUDA would."""
    model = model_with(selector, reuse_anchors=[0, 2])
    ids, mask = left_padded([48, 40])
    out = {}
    with torch.no_grad():
        for backend in ("triton", "reference"):
            with kernels.use_backend(backend, prefill="chunked"):
                out[backend] = model(ids, attention_mask=mask, collect_selections=True)
    assert rel(out["triton"].logits, out["reference"].logits) < 1e-5
    for fused, eager in zip(out["triton"].selections, out["reference"].selections):
        assert torch.equal(fused["selected"], eager["selected"])
