"""modeling/cache.py: the host-side facts of a call (`CallInfo`), MiniCPM's dense rule at its
boundary, the cache-layer contract (`CacheLayer`) that both tiers keep, and `compiles_decode`."""

from __future__ import annotations

import inspect

import pytest
import torch

from forecastkv.inference import OffloadedRows, OffloadedSparseCache, RuntimePlan
from forecastkv.modeling import selection as sel
from forecastkv.modeling.cache import CacheLayer, CallInfo, KVStore, Plan, ResidentRows, SparseCache, SparseCacheLayer
from forecastkv.modeling.configuration import SparseConfig
from forecastkv.serving.paged import PagedRows
from tests.helpers import tiny_model, tiny_sparse

CONTRACT = ("append", "compressed", "decode_index", "plan", "decode_attention", "full")


@pytest.mark.parametrize("dense_len", [0, -1, 5])
def test_dense_rule_on_both_sides_of_dense_len(dense_len):
    """Dense while the key length is below dense_len (never when dense_len <= 0), for an int and a
    tensor alike; a dense model is dense everywhere."""
    sparse = SparseConfig(**tiny_sparse(dense_len=dense_len))
    lengths = torch.tensor([1, 4, 5, 6])
    expected = [dense_len > 0 and n < dense_len for n in lengths.tolist()]
    assert [sel.dense_at(n, sparse) for n in lengths.tolist()] == expected
    assert sel.dense_at(lengths, sparse).tolist() == expected
    assert sel.dense_at(3, None) is True and sel.dense_at(lengths, None).all()


def test_call_info_of_a_decode_step_reads_only_host_counters():
    """A decode step's facts come from the stored lengths: no positions, one token each, and the
    dense rule applied to the length after the step (5 -> 6 crosses dense_len = 6)."""
    sparse = SparseConfig(**tiny_sparse(dense_len=6))
    step = CallInfo.for_decode([4, 5], sparse)
    assert step.decode and step.positions is None
    assert step.lengths_after == (5, 6) and step.dense == (True, False)
    assert step.any_dense and not step.all_dense and step.bounds() == (4, 5)
    assert step.key_count == 6 and step.batch == 2


def test_call_info_of_a_padded_prefill():
    """A multi-token call reads its positions once: padding (-1) stores nothing, and a row of only
    padding keeps its stored length."""
    positions = torch.tensor([[-1, -1, 0, 1], [0, 1, 2, 3], [-1, -1, -1, -1]])
    step = CallInfo.from_positions(positions, None, SparseConfig(**tiny_sparse()))
    assert not step.decode and step.lengths_after == (2, 4, 0)
    assert step.stores == (True, True, False) and not step.any_dense
    assert step.bounds() == (-1, 3) and step.bounds(2, 3) == (-1, 2) and step.bounds(4) == (-1, -1)
    assert not step.contiguous()
    assert CallInfo.from_positions(torch.arange(2, 5).view(1, -1), [2], None).contiguous()


def test_the_cache_layer_implements_the_contract():
    """The six calls of `CacheLayer`, each a method of the one layer class with the contract's parameters."""
    for name in CONTRACT:
        mine = list(inspect.signature(getattr(CacheLayer, name)).parameters)
        theirs = list(inspect.signature(getattr(SparseCacheLayer, name)).parameters)
        assert theirs[: len(mine)] == mine, (name, theirs)


@pytest.mark.parametrize("store_type", [ResidentRows, OffloadedRows, PagedRows])
def test_every_store_implements_the_kv_store_protocol(store_type):
    """Every call of `KVStore`, a method of each store with the protocol's parameters: the one part of a
    layer that differs between tiers."""
    calls = [name for name, value in vars(KVStore).items() if callable(value) and not name.startswith("_")]
    assert {"append", "plan", "decode_attention", "full", "forked", "crop"} <= set(calls)
    for name in calls:
        mine = list(inspect.signature(getattr(KVStore, name)).parameters)
        theirs = list(inspect.signature(getattr(store_type, name)).parameters)
        assert theirs[: len(mine)] == mine, (store_type.__name__, name, theirs)


@pytest.mark.parametrize("mode", [None, "forecast-offload", "dense-offload"])
def test_plans_carry_the_selection_and_runtime_plans_their_fetch(mode):
    """A decode step's plan is a `Plan` of the resident cache and a `RuntimePlan` (slot map,
    counters) of the runtime's layers; both attend to the selection the plan carries."""
    model = tiny_model({"policy": "infllmv2", "selector": "forecast"}, seed=3)
    cache = SparseCache(model.config) if mode is None else OffloadedSparseCache.for_model(model, mode=mode)
    plans = []
    for layer in cache.layers:
        attend = layer.decode_attention
        layer.decode_attention = lambda q, plan, attend=attend: (plans.append(plan), attend(q, plan))[1]
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids, past_key_values=cache)
        model(ids[:, :1], past_key_values=cache)
    assert len(plans) == model.config.num_hidden_layers
    budget = model.config.sparse.budget_blocks
    for layer, plan in zip(cache.layers, plans):
        assert isinstance(plan, Plan) and plan.selection.shape == (1, 2, budget)
        assert isinstance(plan, RuntimePlan) == layer.offloaded and (plan.counts is not None) == (mode is not None)
        if mode is not None:  # wanted: complete blocks (a resident layer's are all hits); never the tail
            selected = int((plan.selection >= 0).sum())
            wanted, hits = int(plan.counts[0]), int(plan.counts[1])
            assert (wanted == hits == selected) if not layer.offloaded else wanted <= selected


def test_compiles_decode_is_the_cache_s_call():
    """Decode steps with no dense row are compiled; dense-offload's grow, so its cache says no."""
    model = tiny_model({"policy": "infllmv2", "selector": "forecast"})
    sparse = model.config.sparse
    decode, dense_row = (
        CallInfo.for_decode([40], sparse),
        CallInfo.for_decode([3], SparseConfig(**tiny_sparse(dense_len=8))),
    )
    prefill = CallInfo.from_positions(torch.arange(4).view(1, -1), None, sparse)
    resident = SparseCache(model.config)
    assert (
        resident.compiles_decode(decode)
        and not resident.compiles_decode(dense_row)
        and not resident.compiles_decode(prefill)
    )
    assert OffloadedSparseCache.for_model(model, mode="forecast-offload").compiles_decode(decode)
    assert not OffloadedSparseCache.for_model(model, mode="dense-offload").compiles_decode(decode)


def test_the_model_check_runs_again_when_the_sparse_config_is_reassigned():
    """`check_model` keeps the (config, SparseConfig) objects it last passed, so a decode step skips it;
    a sparse_config reassigned between calls is a new object and is checked again."""
    model = tiny_model({"policy": "infllmv2"})
    cache = SparseCache(model.config)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, past_key_values=cache)
        model(ids[:, :1], past_key_values=cache)  # the same objects: passes
        model.config.sparse_config = tiny_sparse(block_size=16, window_size=16)
        with pytest.raises(ValueError, match="built for another model .*block_size: cache 8 vs model 16"):
            model(ids[:, :1], past_key_values=cache)
