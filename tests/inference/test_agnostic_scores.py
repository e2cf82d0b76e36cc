"""NOSA's query-agnostic block scores from the CIS the cache pools incrementally equal the
reference that re-pools every token (selection.agnostic_block_scores), and decode never re-reads
the raw CIS of an offloaded layer."""

from __future__ import annotations

import pytest
import torch

from forecastkv.inference import OffloadedSparseCache
from forecastkv.modeling import selection as sel
from forecastkv.modeling.cache import SparseCacheLayer
from forecastkv.modeling.configuration import SparseConfig
from tests.helpers import TINY_SPARSE, left_padded, tiny_model
from tests.inference.test_offloaded import generate


@pytest.mark.parametrize("lag", [0, 1])
def test_pooled_cis_scores_equal_the_reference(lag):
    sparse = SparseConfig.from_dict({**TINY_SPARSE, "policy": "nosa"})
    layer = SparseCacheLayer(sparse.kernel_size, sparse.kernel_stride)
    lengths = torch.tensor([0, 0])
    gen = torch.Generator().manual_seed(0)
    # a left-padded prompt, then single-token and multi-token appends
    for step, (new, pad) in enumerate([(23, [0, 6]), (1, [0, 0]), (5, [0, 0]), (1, [0, 0]), (9, [0, 0])]):
        positions = lengths.view(-1, 1) + torch.arange(new) - torch.tensor(pad).view(-1, 1)
        positions = positions.masked_fill(positions < lengths.view(-1, 1), -1)
        keys = torch.randn(2, new, 2, 16, generator=gen)
        layer.append(keys, torch.randn(2, new, 2, 16, generator=gen), torch.randn(2, new, 2, generator=gen), positions)
        lengths = layer.lengths.clone()
        query_pos = (lengths - 1 + lag).view(-1, 1)
        n_blocks = sel.num_blocks(int(query_pos.max()) + 1, sparse.block_size)
        cis = layer.full()[2]
        expected = sel.agnostic_block_scores(cis, query_pos, sparse, n_blocks, lag=lag)
        got = sel.pooled_agnostic_scores(layer.compressed()[2], query_pos, sparse, n_blocks, lag=lag)
        assert torch.equal(got, expected), step


def test_offloaded_nosa_decode_moves_no_whole_layer():
    """Only the prompt is staged (prefill); decode steps read blocks, never the whole CIS or KV."""
    model = tiny_model({"policy": "nosa", "selector": "query"}, seed=4)
    ids, mask = left_padded([50, 41])
    cache = OffloadedSparseCache.for_model(model, mode="sparse-offload")
    staged = []
    original = type(cache.layers[1]).full

    def spy(layer):
        staged.append(layer.columns)
        return original(layer)

    type(cache.layers[1]).full = spy
    try:
        generate(model, ids, mask, cache, new_tokens=6)
    finally:
        type(cache.layers[1]).full = original
    assert staged and all(columns == 50 for columns in staged)  # prefill calls only
