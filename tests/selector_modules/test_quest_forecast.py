"""quest-forecast (`forecastkv/selectors/quest_forecast.py`): Quest's block bounds scored with the Forecast
vectors of the layer before, against a plain loop of that rule; planned a layer ahead, so the offloaded
runtime's forecast-offload runs it and its tokens equal the resident cache's."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from forecastkv import SparseCache
from forecastkv.inference import OffloadedSparseCache
from forecastkv.selectors import get_selector
from tests.helpers import left_padded, rel, tiny_model
from tests.inference.conftest import INTERPRETED_BACKENDS, RUNTIME_BACKENDS
from tests.inference.test_offloaded import generate
from tests.inference.test_selector_rules import decode_steps, loop_topk, selected_row

GEOMETRY = {"policy": "infllmv2", "topk": 4, "selector": "quest-forecast"}


@pytest.fixture(autouse=True)
def _tiny_models_on_one_thread(one_thread):
    """One intra-op thread for tiny models (why: tests/inference/conftest.py:one_thread)."""
    yield


def forecast_vectors(model, layer_idx: int, entering: list[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
    """The vectors [B, 1, H*n, d] scoring layer `layer_idx`: layer l-1's forecast_proj of its normed input,
    or layer 0's current_proj of its own."""
    source = max(layer_idx - 1, 0)
    layer = model.model.layers[source]
    cos, sin = model.model.rotary_emb(positions, entering[source].dtype)
    which = "current_proj" if layer_idx == 0 else "forecast_proj"
    return layer.self_attn.project_forecast(layer.input_layernorm(entering[source]), cos, sin, which)


def quest_bound(v, lo, hi):
    return torch.maximum(v * lo, v * hi)


def loop_quest_forecast(vectors, keys, t: int, sparse, heads: int, bound=quest_bound) -> dict[int, list[int]]:
    """Per KV head h, the blocks the rule picks for a row at t: the upper bound
    u_j = sum_c max(v_c lo_c, v_c hi_c) / sqrt(d) of each vector of h's group over block j's keys (or the
    sum of another per-channel `bound`), for the blocks complete before the row's token is stored
    ((j+1)*bs <= t), softmaxed per vector and summed over the group; init and local blocks forced; the
    top budget_blocks (ties to the lower id)."""
    bs, per = sparse.block_size, vectors.shape[0] // heads
    complete, visible = t // bs, t // bs + 1
    picked = {}
    for h in range(heads):
        total = [0.0] * visible
        for i in range(per):
            v = vectors[h * per + i].double()
            bounds = []
            for j in range(complete):
                block = keys[j * bs : (j + 1) * bs, h].double()
                lo, hi = block.min(0).values, block.max(0).values
                bounds.append(float(bound(v, lo, hi).sum()) / math.sqrt(v.shape[-1]))
            if not bounds:
                continue
            top = max(bounds)
            norm = sum(math.exp(u - top) for u in bounds)
            for j, u in enumerate(bounds):
                total[j] += math.exp(u - top) / norm
        scores = [total[j] if j < complete else -math.inf for j in range(visible)]
        forced = set(range(sparse.init_blocks)) | set(range(t // bs - sparse.local_blocks, visible))
        picked[h] = loop_topk(scores, forced, visible, sparse.budget_blocks)
    return picked


def test_it_is_registered_as_a_layer_ahead_quest_rule():
    rule = get_selector("quest-forecast")
    assert (rule.name, rule.scores_with, rule.lag) == ("quest-forecast", "forecast", 1)
    assert rule.plans_ahead and rule.key_bounds and rule.needs_forecast_heads and rule.deployable
    quest = get_selector("quest")
    assert (quest.lag, quest.plans_ahead, quest.needs_forecast_heads) == (0, False, False)


def check_every_layer_against_the_loop(model, cache, bound=quest_bound) -> None:
    """Every layer's decode selection in `cache` over 3 steps of two left-padded prompts equals the loop's
    (`loop_quest_forecast` with `bound`)."""
    sparse = model.config.sparse
    ids, mask = left_padded([70, 55])  # crosses the block boundaries 72 and 56 while decoding
    keys_cache = SparseCache(model.config)
    steps = decode_steps(model, cache, ids, mask, 3)
    decode_steps(model, keys_cache, ids, mask, 3)
    heads = model.config.num_key_value_heads
    checked = 0
    for records, entering, positions in steps:
        for layer_idx in range(len(model.model.layers)):
            vectors = forecast_vectors(model, layer_idx, entering, positions.view(-1, 1))
            keys = keys_cache.layers[layer_idx].store.keys
            for b in range(ids.shape[0]):
                t = int(positions[b])
                expected = loop_quest_forecast(vectors[b, 0].detach(), keys[b], t, sparse, heads, bound)
                for h in range(heads):
                    got = selected_row(records[layer_idx]["selected"][b, h, 0])
                    assert got == expected[h], (layer_idx, b, h, t)
                    checked += 1
    assert checked == 3 * len(model.model.layers) * ids.shape[0] * heads


def new_cache(model, cache_kind: str):
    """A resident SparseCache, or an offloaded cache of mode `cache_kind`."""
    if cache_kind == "resident":
        return SparseCache(model.config)
    return OffloadedSparseCache.for_model(model, mode=cache_kind)


def selections_differ(first: str, second: str) -> bool:
    """Whether the two selectors select differently somewhere on one prompt (2 decode steps, seed 8)."""
    chosen = {}
    for selector in (first, second):
        model = tiny_model({**GEOMETRY, "selector": selector}, seed=8)
        ids, mask = left_padded([70, 55])
        steps = decode_steps(model, SparseCache(model.config), ids, mask, 2)
        chosen[selector] = [record["selected"] for records, _, _ in steps for record in records]
    return any(not torch.equal(a, b) for a, b in zip(chosen[first], chosen[second]))


@pytest.mark.parametrize(("heads_per_group", "cache_kind"), [(1, "resident"), (3, "resident"), (1, "forecast-offload")])
def test_each_layer_selects_quests_blocks_for_the_forecast_vectors(heads_per_group, cache_kind):
    """Every layer's decode selection equals the loop, for one and for three vectors per KV head, and when
    the layer before plans it (forecast-offload fetches it a layer ahead)."""
    model = tiny_model(GEOMETRY, seed=8, heads_per_group=heads_per_group)
    check_every_layer_against_the_loop(model, new_cache(model, cache_kind))


def test_it_chooses_otherwise_than_quest_on_its_own_queries():
    """The vectors matter: on one prompt quest-forecast and quest select differently somewhere."""
    assert selections_differ("quest", "quest-forecast")


# both offload modes and budgets in both backends without the interpreter; the block gather (auto) and every
# decode kernel (kernels-triton) through the interpreter once each, a layer ahead with a top-p budget
PARITY_GRID = [
    *itertools.product(["sparse-offload", "forecast-offload"], [0.0, 0.8], RUNTIME_BACKENDS),
    *(
        pytest.param("forecast-offload", 0.8, backend.values[0], marks=backend.marks)
        for backend in INTERPRETED_BACKENDS
    ),
]


@pytest.mark.parametrize(("mode", "top_p", "runtime_backend"), PARITY_GRID, indirect=["runtime_backend"])
def test_offloaded_tokens_and_logits_equal_the_resident_caches(mode, top_p, runtime_backend):
    model = tiny_model({**GEOMETRY, "top_p": top_p}, seed=8)
    ids, mask = left_padded([70, 52])
    ref = generate(model, ids, mask, SparseCache(model.config), 6)
    cache = OffloadedSparseCache.for_model(model, mode=mode)
    out = generate(model, ids, mask, cache, 6)
    assert torch.equal(out.sequences, ref.sequences)
    got, want = torch.stack(out.logits, 1), torch.stack(ref.logits, 1)
    if runtime_backend == "cpu-default":  # the same ops on both sides: bit for bit
        assert torch.equal(got, want)
    else:  # the offloaded layers attend through the slots kernel, the resident ones the blocks kernel
        assert rel(got, want) < 1e-5
    assert cache.stats()["decode_steps"] == 5


def test_a_model_without_forecast_heads_is_refused_by_name():
    from forecastkv import ForecastKVConfig
    from forecastkv.errors import ConfigError
    from tests.helpers import TINY_MODEL, tiny_sparse

    with pytest.raises(ConfigError, match=r"selector='quest-forecast' needs forecast heads"):
        ForecastKVConfig(**TINY_MODEL, sparse_config=tiny_sparse(selector="quest-forecast"))


def test_a_prompt_shorter_than_a_block_attends_and_decodes():
    """Nothing is complete before the first block ends: only forced blocks, no NaN, in both caches."""
    model = tiny_model(GEOMETRY, seed=8)
    ids, mask = left_padded([5, 3])
    ref = generate(model, ids, mask, SparseCache(model.config), 6)
    out = generate(model, ids, mask, OffloadedSparseCache.for_model(model, mode="forecast-offload"), 6)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.isfinite(step).all() for step in ref.logits)


def test_a_row_scores_only_the_blocks_complete_before_its_token_is_stored():
    """Lag 1: a row at t = 15 (blocks of 8) cannot score block 1, whose last key is its own token and not yet
    stored when the layer before plans it; Quest on its own queries (lag 0) can.  At t = 16 both can."""
    from forecastkv.selectors.quest import block_key_bounds, quest_block_scores

    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 24, 2, 16, generator=generator)
    vectors = torch.randn(1, 2, 2, 16, generator=generator)  # one vector per KV head, rows at t = 15 and 16
    lo, hi = block_key_bounds(keys, 8)
    positions = torch.tensor([[15, 16]])
    ahead, own = (quest_block_scores(vectors, lo, hi, positions, 8, 3, get_selector(name).lag)
                  for name in ("quest-forecast", "quest"))
    assert torch.isfinite(ahead[0, :, 0, 0]).all() and torch.isinf(ahead[0, :, 0, 1]).all()
    assert torch.isfinite(own[0, :, 0, :2]).all()
    assert torch.isfinite(ahead[0, :, 1, :2]).all() and torch.isinf(ahead[0, :, :, 2]).all()
