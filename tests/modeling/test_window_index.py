"""`WindowIndex` (forecastkv/modeling/cache.py): one window index's append, grow, fork, reorder and view,
against the plain reference `selection.compress_keys` and the exact per-block min / max, and the one list of
indexes every tier builds (`window_indexes`)."""

from __future__ import annotations

import pytest
import torch

from forecastkv.modeling.cache import WindowIndex, window_geometry, window_indexes
from forecastkv.modeling.selection import compress_keys, num_compressed

BATCH, HEADS, DIM = 2, 2, 4


def rows(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(BATCH, length, HEADS, DIM, generator=torch.Generator().manual_seed(seed))


def reference(index: WindowIndex, source: torch.Tensor) -> torch.Tensor:
    """Every complete window of source [B, S, H, d] pooled as `index` pools it, by a plain unfold."""
    if index.reduce == "mean":
        return compress_keys(source, index.size, index.stride)
    windows = source.unfold(1, index.size, index.stride)  # [B, C, H, d, size]
    return getattr(windows, index.reduce)(dim=-1)


@pytest.mark.parametrize(("size", "stride", "reduce"), [(4, 2, "mean"), (8, 8, "amin"), (8, 8, "amax"), (6, 3, "mean")])
def test_appends_one_token_at_a_time_equal_one_append_and_the_reference(size, stride, reduce):
    source = rows(37)
    whole, stepped = WindowIndex("w", size, stride, reduce=reduce), WindowIndex("w", size, stride, reduce=reduce)
    lengths = torch.full((BATCH,), 37)
    whole.extend(torch.zeros(BATCH, dtype=torch.long), lengths, source, 37, None, None)
    stepped.extend(torch.zeros(BATCH, dtype=torch.long), torch.full((BATCH,), 20), source, 20, None, 64)
    for n in range(20, 37):  # decode steps into a reserved buffer: fixed shapes, one window at most each
        stepped.extend_one(torch.full((BATCH,), n), torch.full((BATCH,), n + 1), source)
    count = num_compressed(37, size, stride)
    expected = reference(whole, source)
    assert torch.equal(whole.view(37), expected) and torch.equal(stepped.view(37), expected)
    assert whole.view(37).shape[1] == count


def test_sequences_of_different_lengths_write_only_their_own_windows():
    index = WindowIndex("ckeys", 4, 2)
    source = rows(30, seed=1)
    index.extend(torch.zeros(BATCH, dtype=torch.long), torch.tensor([30, 9]), source, 30, None, None)
    short = num_compressed(9, 4, 2)
    assert torch.equal(index.buffer[1, :short], compress_keys(source[1:, :9], 4, 2)[0])
    assert not index.buffer[1, short:].any()  # windows the short sequence has not completed stay empty


def test_a_fork_owns_its_buffer_and_repeats_each_sequence():
    index = WindowIndex("ckeys", 4, 2)
    index.extend(torch.zeros(BATCH, dtype=torch.long), torch.full((BATCH,), 16), rows(16), 16, None, None)
    twice = index.forked(2)
    assert torch.equal(twice.buffer[::2], index.buffer) and torch.equal(twice.buffer[1::2], index.buffer)
    copy = index.forked()
    copy.buffer.zero_()
    assert index.buffer.abs().sum() > 0
    assert index.emptied().buffer is None and index.emptied().size == 4


def test_reorder_and_grow_keep_the_windows():
    index = WindowIndex("ckeys", 4, 2)
    index.extend(torch.zeros(BATCH, dtype=torch.long), torch.full((BATCH,), 16), rows(16), 16, None, None)
    before = index.buffer.clone()
    index.reordered(torch.tensor([1, 0]))
    assert torch.equal(index.buffer, before.flip(0))
    assert not index.fits(5000)
    index.grow_for(5000, None, None)
    assert index.fits(5000) and torch.equal(index.buffer[:, : before.shape[1]], before.flip(0))


def test_the_one_list_of_indexes_per_geometry():
    names = lambda indexes: [(i.name, i.size, i.stride, i.source, i.reduce) for i in indexes]  # noqa: E731
    assert window_indexes(None) == []
    assert names(window_indexes((4, 2), (8, 8), (16, 16))) == [
        ("ckeys", 4, 2, "keys", "mean"),
        ("pooled_cis", 4, 2, "cis", "mean"),
        ("coarse_keys", 8, 8, "keys", "mean"),
        ("block_lo", 16, 16, "keys", "amin"),
        ("block_hi", 16, 16, "keys", "amax"),
    ]
    assert [i.name for i in window_indexes((4, 2), cis=False)] == ["ckeys"]
    assert window_indexes((4, 2))[1].dtype == torch.float32  # the pooled CIS in fp32, as selection pools it
    assert window_geometry(None) == (None, None)
