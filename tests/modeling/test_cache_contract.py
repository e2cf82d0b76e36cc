"""The cache-layer contract is exactly what its users touch: every member that attention, the decoder
loop and the selectors read of a cache layer is declared by `modeling/cache.py:CacheLayer`, and every
cache layer class (resident, offloaded, paged) provides each of them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from forecastkv.inference import OffloadedSparseCache
from forecastkv.modeling.cache import CacheLayer, SparseCache, SparseCacheLayer
from forecastkv.serving.paged import LayerPages, paged_layer
from tests.helpers import tiny_model

ROOT = Path(__file__).resolve().parents[2] / "forecastkv"
SELECTORS = [f"selectors/{path.name}" for path in (ROOT / "selectors").glob("*.py")]
USERS = ["modeling/attention.py", "modeling/modeling.py", *SELECTORS]
# the names a cache layer goes by where it is used
ACCESS = re.compile(r"\b(?:cache_layer|next_cache_layer|layer_cache)\.([A-Za-z_]\w*)")


def contract() -> set[str]:
    members = set(getattr(CacheLayer, "__annotations__", {}))
    return members | {name for name, value in vars(CacheLayer).items() if callable(value) and not name.startswith("_")}


def used() -> dict[str, set[str]]:
    return {path: set(ACCESS.findall((ROOT / path).read_text())) for path in USERS}


def test_users_touch_only_the_contract():
    declared = contract()
    outside = {path: sorted(names - declared) for path, names in used().items() if names - declared}
    assert not outside, f"cache-layer members used but not declared by CacheLayer: {outside}"
    assert {"append", "plan", "decode_attention", "kernels", "key_bounds"} <= set().union(*used().values())


def test_the_check_sees_an_undeclared_member():
    assert ACCESS.findall("x = cache_layer.ring_rows + next_cache_layer.block_map") == ["ring_rows", "block_map"]
    assert "ring_rows" not in contract() and "key_bounds" in contract()


def built_layer(store: str):
    """Layer 1 of a tiny sparse model's cache of each tier."""
    config = tiny_model({"policy": "infllmv2", "selector": "query"}).config
    if store == "resident":
        return SparseCache(config).layers[1]
    if store == "offloaded":
        return OffloadedSparseCache(config, mode="sparse-offload").layers[1]
    pages = torch.zeros(4, config.num_key_value_heads, config.sparse.block_size, config.head_dim)
    layer_pages = LayerPages.around(pages, pages.clone(), config.sparse, False)
    return paged_layer(layer_pages, torch.zeros(1, 4), [0], config.sparse)


@pytest.mark.parametrize("store", ["resident", "offloaded", "paged"])
def test_every_cache_layer_provides_the_contract(store):
    """Every tier's layer is the one `SparseCacheLayer`, composed with its tier's store."""
    layer = built_layer(store)
    assert type(layer) is SparseCacheLayer
    methods = {n for n, v in vars(CacheLayer).items() if callable(v) and not n.startswith("_")}
    assert all(callable(getattr(layer, method, None)) for method in methods), sorted(
        m for m in methods if not callable(getattr(layer, m, None))
    )
