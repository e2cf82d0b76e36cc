"""Pinned blocks (`modeling/pins.py`, the `*-carry-pin` selectors): the window's block mass against a plain
loop, what is pinned and what never is, the pins in every decode step's selection of their layer and head, a
fork, a crop and a new prompt, short prompts, and the quality suite's shared dense prefill handing its pins to
each cell.  Offloaded tokens equal resident ones and a decode step reads nothing back: `test_carry.py`, which
runs the pinning selectors beside the carrying ones."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from forecastkv import SparseCache
from forecastkv.inference import OffloadedSparseCache
from forecastkv.inference.fill import copy_into
from forecastkv.modeling.modeling import CACHE_KWARG
from forecastkv.modeling.pins import window_block_mass, window_pins
from tests.helpers import left_padded, tiny_model
from tests.inference.test_offloaded import generate

PINNING = ("forecast-carry-pin", "quest-forecast-carry-pin")
# 9 of the 19-20 blocks of a 150-token prompt (blocks of 8): init, window and current forced, 4 carried and
# 2 pinned still fit, so every pin must be in every selection
GEOMETRY = {"policy": "infllmv2", "topk": 8}
LENGTHS = [150, 131]


@pytest.fixture(autouse=True)
def _tiny_models_on_one_thread(one_thread):
    yield


def test_window_block_mass_equals_a_plain_loop():
    torch.manual_seed(0)
    batch, heads, group, dim, block, rows = 2, 2, 3, 4, 4, 5
    keys = torch.randn(batch, 14, heads, dim)
    q = torch.randn(batch, 7, heads * group, dim)
    positions = torch.tensor([[7, 8, 9, 10, 11, 12, 13], [-1, -1, 3, 4, 5, 6, 7]])  # row 1: padding first
    got = window_block_mass(q, positions, keys, block, rows=rows)
    want = torch.zeros(batch, heads, 4)
    for b in range(batch):
        for t in range(7 - rows, 7):
            pos = int(positions[b, t])
            if pos < 0:
                continue
            for hq in range(heads * group):
                h = hq // group
                logits = torch.stack([q[b, t, hq] @ keys[b, s, h] / math.sqrt(dim) for s in range(pos + 1)])
                probs = torch.softmax(logits, 0)
                for s in range(pos + 1):
                    want[b, h, s // block] += probs[s]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # each counted row sums to 1 in each of the G heads of a KV head
    torch.testing.assert_close(got.sum(-1), torch.tensor([[15.0, 15.0], [15.0, 15.0]]))
    # right padding (a serving engine's chunk batch): a sequence's last rows are its largest positions
    right = torch.tensor([[7, 8, 9, 10, 11, 12, 13], [3, 4, 5, 6, 7, -1, -1]])
    q_right = torch.cat([q[:1], torch.cat([q[1:, 2:], q[1:, :2]], dim=1)])
    torch.testing.assert_close(window_block_mass(q_right, right, keys, block, rows=rows), want, rtol=1e-5, atol=1e-5)


def test_pins_leave_out_forced_blocks_and_blocks_with_no_mass():
    sparse = SimpleNamespace(block_size=4, init_blocks=1, local_blocks=1)
    mass = torch.tensor([[[9.0, 0.1, 0.0, 0.3, 5.0, 7.0]]])  # [1, 1, 6]: 0 is init, 4 and 5 are local / current
    assert window_pins(mass, torch.tensor([24]), sparse, 2).tolist() == [[[3, 1]]]
    assert window_pins(mass, torch.tensor([24]), sparse, 4).tolist() == [[[3, 1, -1, -1]]]  # block 2: no mass
    assert window_pins(mass[..., :2], torch.tensor([8]), sparse, 3).tolist() == [[[-1, -1, -1]]]  # all forced


def decode(model, cache, steps: int, lengths=LENGTHS):
    """Greedy steps after a left-padded prompt: each step's selections [B, H, K] per layer, and the pins after it."""
    ids, mask = left_padded(lengths)
    records, pins = [], []
    with torch.no_grad():
        token = model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)
        pins.append([None if layer.pinned is None else layer.pinned.clone() for layer in cache.layers])
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            out = model(input_ids=token, attention_mask=mask, collect_selections=True, **{CACHE_KWARG: cache})
            records.append([record["selected"][:, :, 0] for record in out.selections])
            pins.append([None if layer.pinned is None else layer.pinned.clone() for layer in cache.layers])
            token = out.logits[:, -1:].argmax(-1)
    return records, pins


@pytest.mark.parametrize("selector", PINNING)
def test_every_decode_step_selects_its_layers_pinned_blocks(selector):
    model = tiny_model({**GEOMETRY, "selector": selector}, seed=8)
    records, pins = decode(model, SparseCache(model.config), 4)
    first = pins[0]
    assert all(p is not None and p.shape == (2, 2, 2) for p in first)  # [B, H, 2] in every layer
    assert all(torch.equal(p, q) for step in pins[1:] for p, q in zip(step, first))  # decode steps keep them
    checked = 0
    for step in records:
        for layer, selection in enumerate(step):
            for b in range(2):
                for h in range(2):
                    for block in first[layer][b, h].tolist():
                        if block >= 0:
                            assert (selection[b, h] == block).any(), (layer, b, h, block)
                            checked += 1
    assert checked >= 4 * 2 * 2 * 2 * len(first) * 3 // 4  # nearly every head pinned two blocks


def test_pinning_changes_what_is_selected():
    """Not forecast-carry under another name: on one prompt some layer selects other blocks."""
    chosen = {}
    for selector in ("forecast-carry", "forecast-carry-pin"):
        model = tiny_model({**GEOMETRY, "selector": selector}, seed=8)
        records, _ = decode(model, SparseCache(model.config), 4)
        chosen[selector] = torch.stack([torch.stack(step) for step in records])
    assert not torch.equal(chosen["forecast-carry"], chosen["forecast-carry-pin"])


def test_a_fork_or_a_reorder_keeps_the_pins_and_a_new_prompt_or_a_crop_drops_them():
    model = tiny_model({**GEOMETRY, "selector": "forecast-carry-pin"}, seed=8)
    cache = SparseCache(model.config)
    _, pins = decode(model, cache, 2)
    twice = cache.fork(2)
    assert all(torch.equal(layer.pinned, mine.pinned) for one in twice for layer, mine in zip(one.layers, cache.layers))
    (wide,) = [cache.layers[0].forked(3)]
    assert torch.equal(wide.pinned, cache.layers[0].pinned.repeat_interleave(3, dim=0))
    swapped = cache.fork()
    swapped.reorder_cache(torch.tensor([1, 0]))  # beam search: each beam keeps its prompt's pins
    assert all(torch.equal(layer.pinned, mine.pinned.flip(0)) for layer, mine in zip(swapped.layers, cache.layers))
    with torch.no_grad():  # a two-token call pins anew from its own last rows
        model(input_ids=torch.tensor([[5, 6], [7, 8]]), attention_mask=torch.ones(2, LENGTHS[0] + 4, dtype=torch.long),
              cache=cache)
    assert any(not torch.equal(layer.pinned, old) for layer, old in zip(cache.layers, pins[-1]))
    cache.crop(-1)
    assert all(layer.pinned is None for layer in cache.layers)


@pytest.mark.parametrize("cuts", [(140,), (120, 135, 145), (148,)])
def test_a_prompt_in_chunks_pins_what_it_pins_whole(cuts):
    """The pins read the prompt's last 32 rows, which calls shorter than that leave to the next one
    (`SparseCacheLayer.pin_rows`): a left-padded batch prefilled in calls cut at `cuts` pins what one call
    pins, and a crop drops the rows kept."""
    model = tiny_model({**GEOMETRY, "selector": "forecast-carry-pin"}, seed=8)
    ids, mask = left_padded(LENGTHS)
    whole, cut = SparseCache(model.config), SparseCache(model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=whole)
        for start, end in zip((0, *cuts), (*cuts, ids.shape[1])):
            model(input_ids=ids[:, start:end], attention_mask=mask[:, :end], cache=cut)
    assert all(torch.equal(a.pinned, b.pinned) for a, b in zip(whole.layers, cut.layers))
    assert sum(int((layer.pinned >= 0).sum()) for layer in whole.layers) >= len(whole.layers) * 4
    assert all(layer.pin_rows[0].shape[1] == 32 for layer in cut.layers)
    cut.crop(-1)
    assert all(layer.pin_rows is None for layer in cut.layers)


@pytest.mark.parametrize("lengths", [[1, 3], [5, 12]])
def test_prompts_shorter_than_the_forced_blocks_pin_nothing_and_decode_alike(lengths):
    """A 1-token prompt is a decode step (no pins); prompts within the init, window and current blocks have no
    block to pin (all -1).  Offloaded tokens equal resident ones, every logit finite."""
    model = tiny_model({**GEOMETRY, "selector": "forecast-carry-pin"}, seed=8)
    ids, mask = left_padded(lengths)
    cache = SparseCache(model.config)
    ref = generate(model, ids, mask, cache, 12)
    assert torch.isfinite(torch.stack(ref.logits)).all()
    out = generate(model, ids, mask, OffloadedSparseCache.for_model(model, mode="forecast-offload"), 12)
    assert torch.equal(out.sequences, ref.sequences)


def test_a_shared_dense_prefill_hands_its_pins_to_each_cell():
    """The quality suite's protocol (`eval/study.py:dense_prefill`, then `copy_into`): a dense prefill pins in
    the model's geometry, and a cell decoding from a copy of it selects as the pinning selector's own prefill."""
    from forecastkv.eval.study import ScoredSequence, dense_prefill
    from forecastkv.modeling.routing import attending_with

    model = tiny_model({**GEOMETRY, "selector": "forecast-carry-pin"}, seed=8)
    ids = left_padded([150])[0]
    prefilled = dense_prefill(model, ScoredSequence(ids, 0))  # all but the last token
    own = SparseCache(model.config)
    with torch.no_grad(), attending_with(model, {**model.config.sparse.to_dict(), "dense_len": 1000}):
        model(input_ids=ids[:, :149], cache=own)  # the selector's own prefill, its rows dense: the same keys
    for shared, mine in zip(prefilled.layers, own.layers):
        assert torch.equal(shared.pinned, mine.pinned)
    cell = SparseCache(model.config)
    copy_into(prefilled, cell)
    with torch.no_grad():
        a = model(input_ids=ids[:, 149:], cache=cell).logits
        b = model(input_ids=ids[:, 149:], cache=own).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
