"""inference/host_pool.py: `diff_block_map` (the slot cache's bookkeeping) against a per-row
pure-Python reference: hits keep their slots, misses fill empty slots first and then the
lowest-numbered stale ones, stale blocks stay mapped and can hit again, -1 pads, and every
(sequence, KV head) row is independent."""

from __future__ import annotations

import random

import pytest
import torch

from forecastkv.inference.host_pool import diff_block_map


def reference_row(block_map: list[int], wanted: list[int]):
    """One row, written from the rule: returns (new_map, load_ids, slot_of, hits, misses) as lists/ints."""
    slot_of_block = {block: slot for slot, block in enumerate(block_map) if block >= 0}
    kept = {slot_of_block[w] for w in wanted if w >= 0 and w in slot_of_block}
    free = [s for s, b in enumerate(block_map) if b < 0] + [
        s for s, b in enumerate(block_map) if b >= 0 and s not in kept
    ]
    new_map, load_ids, slot_of = list(block_map), [-1] * len(block_map), [-1] * len(wanted)
    hits = misses = 0
    for k, block in enumerate(wanted):
        if block < 0:
            continue
        if block in slot_of_block:
            slot_of[k], hits = slot_of_block[block], hits + 1
        else:
            slot = free.pop(0)
            new_map[slot], load_ids[slot], slot_of[k] = block, block, slot
            misses += 1
    return new_map, load_ids, slot_of, hits, misses


def reference(block_map: torch.Tensor, wanted: torch.Tensor):
    """`reference_row` over every (b, h) row, stacked like `diff_block_map`'s outputs."""
    rows = [
        [reference_row(block_map[b, h].tolist(), wanted[b, h].tolist()) for h in range(block_map.shape[1])]
        for b in range(block_map.shape[0])
    ]
    return tuple(torch.tensor([[row[i] for row in per_b] for per_b in rows], dtype=torch.long) for i in range(5))


def assert_matches_reference(block_map, wanted):
    got = diff_block_map(block_map, wanted)
    expected = reference(block_map, wanted)
    names = ("new_map", "load_ids", "slot_of", "hits", "misses")
    for name, g, e in zip(names, got, expected):
        assert g.shape == e.shape and g.dtype == torch.long, (name, g.shape, e.shape, g.dtype)
        assert torch.equal(g, e), (name, block_map.tolist(), wanted.tolist(), g.tolist(), e.tolist())
    new_map, _, slot_of, _, _ = got
    valid = wanted >= 0
    served = torch.gather(new_map, -1, slot_of.clamp(min=0))
    assert torch.equal(served[valid], wanted[valid])  # every wanted block sits in the slot named for it
    return got


def test_worked_example():
    """M = 4 slots: map [5, -, 7, 2], wanted [7, 9, 3, -]: 7 hits in slot 2; 9 takes the empty slot
    1, then 3 the lowest stale slot 0; block 2 stays in slot 3 (stale) and hits next step."""
    block_map = torch.tensor([[[5, -1, 7, 2]]])
    new_map, load_ids, slot_of, hits, misses = diff_block_map(block_map, torch.tensor([[[7, 9, 3, -1]]]))
    assert new_map.tolist() == [[[3, 9, 7, 2]]]
    assert load_ids.tolist() == [[[3, 9, -1, -1]]]
    assert slot_of.tolist() == [[[2, 1, 0, -1]]]
    assert (hits.tolist(), misses.tolist()) == ([[1]], [[2]])
    new_map, load_ids, slot_of, hits, misses = diff_block_map(new_map, torch.tensor([[[2, -1, 9, -1]]]))
    assert new_map.tolist() == [[[3, 9, 7, 2]]] and load_ids.tolist() == [[[-1, -1, -1, -1]]]
    assert slot_of.tolist() == [[[3, -1, 1, -1]]]
    assert (hits.tolist(), misses.tolist()) == ([[2]], [[0]])


def test_empty_map_fills_slots_in_order_and_padding_loads_nothing():
    block_map = torch.full((1, 2, 5), -1, dtype=torch.long)
    wanted = torch.tensor([[[4, -1, 0, 11, -1], [-1, -1, -1, -1, -1]]])
    new_map, load_ids, slot_of, hits, misses = assert_matches_reference(block_map, wanted)
    assert new_map[0, 0].tolist() == [4, 0, 11, -1, -1] and slot_of[0, 0].tolist() == [0, -1, 1, 2, -1]
    assert torch.equal(new_map[0, 1], block_map[0, 1]) and (load_ids[0, 1] == -1).all() and (slot_of[0, 1] == -1).all()
    assert hits.tolist() == [[0, 0]] and misses.tolist() == [[3, 0]]


@pytest.mark.parametrize("slots, take", [(6, 6), (6, 4), (3, 3), (1, 1)])
def test_random_steps_match_the_reference(slots, take):
    """Many decode steps per row (the map fed back each step), blocks drawn from a small pool so
    blocks come back after going stale, -1 anywhere in the wanted list, some rows wanting nothing."""
    rng = random.Random(100 * slots + take)
    batch, heads, pool = 3, 2, slots + 4
    block_map = torch.full((batch, heads, slots), -1, dtype=torch.long)
    previous = torch.full((batch, heads, take), -1, dtype=torch.long)
    stale_hits = 0
    for step in range(40):
        wanted = torch.full((batch, heads, take), -1, dtype=torch.long)
        for b in range(batch):
            for h in range(heads):
                count = rng.randint(0, take) if (b, h) != (2, 1) or step % 5 else 0
                blocks = rng.sample(range(pool), count)
                places = sorted(rng.sample(range(take), count))
                for place, block in zip(places, blocks):
                    wanted[b, h, place] = block
        new_map, _, slot_of, _, _ = assert_matches_reference(block_map, wanted)
        for b in range(batch):  # blocks mapped but not wanted last step (stale), wanted again now
            for h in range(heads):
                stale = set(block_map[b, h].tolist()) - set(previous[b, h].tolist()) - {-1}
                again = [k for k, w in enumerate(wanted[b, h].tolist()) if w in stale]
                assert all(block_map[b, h, slot_of[b, h, k]] == wanted[b, h, k] for k in again)  # served where it was
                stale_hits += len(again)
        block_map, previous = new_map, wanted
    assert stale_hits > 0 or slots == take == 1


def test_rows_are_independent():
    """Each (sequence, head) row's result depends on that row alone: a row computed in a batch equals
    it computed alone, and permuting the rows permutes the results."""
    rng = torch.Generator().manual_seed(3)
    slots = 5
    block_map = torch.stack([torch.randperm(12, generator=rng)[:slots] for _ in range(8)]).view(4, 2, slots)
    block_map[0, 1, 2] = -1
    block_map[3, 0, :] = -1
    wanted = torch.stack([torch.randperm(12, generator=rng)[:4] for _ in range(8)]).view(4, 2, 4)
    wanted[1, 0, 1:] = -1
    together = diff_block_map(block_map, wanted)
    for b in range(4):
        for h in range(2):
            alone = diff_block_map(block_map[b : b + 1, h : h + 1], wanted[b : b + 1, h : h + 1])
            for whole, one in zip(together, alone):
                assert torch.equal(whole[b : b + 1, h : h + 1], one), (b, h)
    order = torch.tensor([2, 0, 3, 1])
    permuted = diff_block_map(block_map[order].flip(1), wanted[order].flip(1))
    for whole, moved in zip(together, permuted):
        assert torch.equal(whole[order].flip(1), moved)
    assert_matches_reference(block_map, wanted)
