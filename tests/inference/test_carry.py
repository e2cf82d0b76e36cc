"""Carried blocks (`modeling/carry.py`, the `*-carry` selectors): the attention share of each selected block
against a plain loop, what is forced and what is carried, the carried blocks in every layer's next
selection, offloaded tokens equal resident tokens (the pinning selectors too), fork and forget, and no host read
added."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from forecastkv import SparseCache
from forecastkv.inference import OffloadedSparseCache
from forecastkv.modeling.carry import CarriedBlocks, selected_block_mass
from forecastkv.modeling.modeling import CACHE_KWARG
from forecastkv.selectors import get_selector
from tests.helpers import left_padded, tiny_model
from tests.inference.test_offloaded import generate
from tests.strict_device import count_host_reads

CARRYING = ("query-carry", "forecast-carry", "quest-forecast-carry")
PINNING = ("forecast-carry-pin", "quest-forecast-carry-pin")  # carrying, and pinning (`modeling/pins.py`)
GEOMETRY = {"policy": "infllmv2", "topk": 4}  # 5 of the 9-10 blocks of a 70-token prompt: a choice to make


@pytest.fixture(autouse=True)
def _tiny_models_on_one_thread(one_thread):
    yield


def test_selected_block_mass_equals_a_plain_loop():
    torch.manual_seed(0)
    batch, kv_heads, group, dim, block, width = 2, 2, 3, 8, 4, 3
    q = torch.randn(batch, 1, kv_heads * group, dim)
    keys = torch.randn(batch, kv_heads, width * block, dim)
    bias = torch.randn(batch, kv_heads, width * block)
    key_pos = torch.arange(width * block).repeat(batch, kv_heads, 1)
    key_pos[0, 1, block : 2 * block] = -1  # a block not selected
    lengths = torch.tensor([10, 12])  # row 0's last two keys are not stored yet
    got = selected_block_mass(q, keys, key_pos, bias, lengths, block)
    want = torch.zeros(batch, kv_heads, width)
    for b in range(batch):
        for h in range(kv_heads):
            for g in range(group):
                logits = [
                    float(q[b, 0, h * group + g] @ keys[b, h, i]) / math.sqrt(dim) + float(bias[b, h, i])
                    if 0 <= key_pos[b, h, i] < lengths[b] else -math.inf
                    for i in range(width * block)
                ]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                for i, w in enumerate(weights):
                    want[b, h, i // block] += w / sum(weights) / group
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got[0, 1, 1] == 0 and torch.allclose(got.sum(-1), torch.ones(batch, kv_heads))


def carry_of(count=2, block=4, init=1, local=1):
    return CarriedBlocks(count, SimpleNamespace(block_size=block, init_blocks=init, local_blocks=local))


def test_force_sets_carried_visible_blocks_only():
    carry = carry_of()
    scores = torch.tensor([[[[0.125, 0.25, float("-inf"), 0.375, 0.5]]]])  # [1, 1, 1, 5]
    assert torch.equal(carry.force(scores), scores)  # nothing carried before a decode step
    carry.ids = torch.tensor([[1, 2]])  # block 2 is invisible (-inf): it stays so
    forced = carry.force(scores)
    assert forced[0, 0, 0].tolist() == [0.125, float("inf"), float("-inf"), 0.375, 0.5]
    carry.ids = torch.tensor([[-1, 7]])  # none, and a block past the scores
    assert torch.equal(carry.force(scores), scores)


def test_roll_carries_the_hottest_blocks_but_never_a_forced_one(monkeypatch):
    """Blocks of 4, init 1, local 1: at position 21 (block 5) blocks 0, 4 and 5 are forced; of the rest the
    two that held the largest share in any layer and head are carried, and a block no layer attended is not."""
    import forecastkv.modeling.carry as module

    carry = carry_of()
    carry.begin(1, "cpu")
    store = SimpleNamespace(blocks=lambda layer, plan, with_values: (None, None, None, None))
    layer = SimpleNamespace(lengths=torch.tensor([22]), capacity_rows=lambda: 24, store=store)
    plan = SimpleNamespace(selection=torch.tensor([[[0, 1, 3, 4]]]))
    for mass in ([0.5, 0.1, 0.3, 0.1], [0.6, 0.05, 0.05, 0.3]):  # two layers' shares of blocks 0, 1, 3, 4
        monkeypatch.setattr(module, "selected_block_mass", lambda *args, mass=mass: torch.tensor([[mass]]))
        carry.observe(layer, None, plan)
    wider = SimpleNamespace(lengths=torch.tensor([22]), capacity_rows=lambda: 40, store=store)  # 10 blocks
    monkeypatch.setattr(module, "selected_block_mass", lambda *args: torch.tensor([[[0.05, 0.05, 0.05, 0.05]]]))
    carry.observe(wider, None, plan)  # a layer holding more blocks keeps what the others put in
    carry.roll()
    assert carry.ids.tolist() == [[3, 1]]  # 3 held 0.3 at most, 1 held 0.1; 0 and 4 are forced
    assert float(carry.heat.sum()) == 0  # the next step starts cold
    carry.roll()
    assert carry.ids.tolist() == [[-1, -1]]  # a step that attended nothing carries nothing


def test_ranks_carry_the_blocks_hottest_over_all_of_them():
    """Under tensor parallelism each rank weighs only its own KV heads: with `reduce` taking the max over
    the ranks before the hottest are picked, both carry what one rank holding every head would."""
    heats = [torch.tensor([[0.0, 0.4, 0.1, 0.0, 0.0]]), torch.tensor([[0.0, 0.1, 0.0, 0.3, 0.0]])]  # 4 blocks + spare
    whole = carry_of()
    whole.heat = torch.maximum(*heats)
    whole.roll()
    ranks = [carry_of(), carry_of()]
    for rank, heat in zip(ranks, heats):
        rank.heat = heat.clone()
        rank.reduce = lambda tensor: torch.maximum(tensor, torch.maximum(*heats), out=tensor)
    for rank in ranks:
        rank.roll()
        assert rank.ids.tolist() == whole.ids.tolist() == [[1, 3]]
    alone = carry_of()
    alone.heat = heats[0].clone()
    alone.roll()
    assert alone.ids.tolist() == [[1, 2]]  # without it rank 0 would carry its own second block


def decode(model, cache, steps: int):
    ids, mask = left_padded([70, 52])
    records, carried = [], []
    with torch.no_grad():
        token = model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            out = model(input_ids=token, attention_mask=mask, collect_selections=True, **{CACHE_KWARG: cache})
            records.append([record["selected"][:, :, 0] for record in out.selections])
            carry = cache.layers[0].carry
            carried.append(None if carry is None else carry.ids.clone())
            token = out.logits[:, -1:].argmax(-1)
    return records, carried


@pytest.mark.parametrize("selector", CARRYING)
def test_every_layer_selects_the_blocks_the_last_step_carried(selector):
    model = tiny_model({**GEOMETRY, "selector": selector}, seed=8)
    cache = SparseCache(model.config)
    records, carried = decode(model, cache, 4)
    assert all(layer.carry is cache.layers[0].carry for layer in cache.layers)  # one per cache
    checked = 0
    for step in range(1, 4):
        for b in range(2):
            for block in carried[step - 1][b].tolist():
                if block < 0:
                    continue
                for selection in records[step]:
                    assert (selection[b] == block).any(-1).all(), (step, b, block)
                checked += 1
    assert checked >= 6  # the steps carried something


def test_carrying_changes_what_is_selected():
    """Not the query rule under another name: on one prompt some layer selects other blocks."""
    chosen = {}
    for selector in ("query", "query-carry"):
        model = tiny_model({**GEOMETRY, "selector": selector}, seed=8)
        records, _ = decode(model, SparseCache(model.config), 4)
        chosen[selector] = torch.stack([torch.stack(step) for step in records])
    assert not torch.equal(chosen["query"], chosen["query-carry"])


@pytest.mark.parametrize("selector", CARRYING + PINNING)
def test_offloaded_tokens_equal_resident_tokens(selector):
    model = tiny_model({**GEOMETRY, "selector": selector}, seed=8)
    ids, mask = left_padded([70, 52])
    ref = generate(model, ids, mask, SparseCache(model.config), 6)
    modes = ["sparse-offload"] + (["forecast-offload"] if get_selector(selector).plans_ahead else [])
    for mode in modes:
        out = generate(model, ids, mask, OffloadedSparseCache.for_model(model, mode=mode), 6)
        assert torch.equal(out.sequences, ref.sequences), mode
        torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(ref.logits, 1), rtol=1e-5, atol=1e-5)


def test_a_fork_carries_its_own_blocks():
    """fork() copies what is carried: the fork and the original decode alike, and a step on one does not
    change what the other carries."""
    model = tiny_model({**GEOMETRY, "selector": "query-carry"}, seed=8)
    cache = SparseCache(model.config)
    decode(model, cache, 2)
    other = cache.fork()
    assert other.layers[0].carry is not cache.layers[0].carry
    assert all(layer.carry is other.layers[0].carry for layer in other.layers)
    before = cache.layers[0].carry.ids.clone()
    token = torch.tensor([[5], [6]])
    mask = torch.ones(2, 73, dtype=torch.long)
    with torch.no_grad():
        a = model(input_ids=token, attention_mask=mask, cache=other).logits
        assert torch.equal(cache.layers[0].carry.ids, before)
        b = model(input_ids=token, attention_mask=mask, cache=cache).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_multi_token_call_forgets_what_was_carried():
    model = tiny_model({**GEOMETRY, "selector": "query-carry"}, seed=8)
    cache = SparseCache(model.config)
    decode(model, cache, 2)
    assert (cache.layers[0].carry.ids >= 0).any()
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6], [7, 8]]), attention_mask=torch.ones(2, 74, dtype=torch.long),
              cache=cache)
    assert (cache.layers[0].carry.ids == -1).all()


@pytest.mark.parametrize("selector", ["query-carry", "forecast-carry-pin"])
def test_carrying_adds_no_host_read_to_a_decode_step(selector):
    """A decode step of the resident cache reads nothing back (as the query rule's): what is carried is
    forced, observed and rolled on the device, and what the prompt pinned (`modeling/pins.py`) is forced."""
    model = tiny_model({**GEOMETRY, "selector": selector}, seed=8)
    cache = SparseCache(model.config)
    ids, mask = left_padded([70, 52])
    cache.reserve(ids.shape[1] + 4)
    with torch.no_grad():
        token = model(input_ids=ids, attention_mask=mask, cache=cache).logits[:, -1:].argmax(-1)
        for _ in range(3):
            mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
            with count_host_reads() as counter:
                logits = model(input_ids=token, attention_mask=mask, cache=cache).logits
            assert counter.reads == 0, counter.report()
            token = logits[:, -1:].argmax(-1)
    assert (cache.layers[0].carry.ids >= 0).any()


def test_a_row_with_no_key_has_no_share():
    q, keys = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 8, 4)
    key_pos = torch.full((1, 1, 8), -1)
    assert torch.equal(selected_block_mass(q, keys, key_pos, None, torch.tensor([0]), 4), torch.zeros(1, 1, 2))


@pytest.mark.parametrize("selector", ["query-carry", "forecast-carry"])
def test_prompts_shorter_than_a_block_carry_alike_resident_and_offloaded(selector):
    """Prompts of 1 and 3 tokens (blocks of 8): the first steps carry nothing but forced blocks, later ones
    carry; offloaded tokens equal resident ones and every logit is finite."""
    model = tiny_model({**GEOMETRY, "selector": selector}, seed=8)
    ids, mask = left_padded([1, 3])
    ref = generate(model, ids, mask, SparseCache(model.config), 12)
    assert torch.isfinite(torch.stack(ref.logits)).all()
    mode = "forecast-offload" if get_selector(selector).plans_ahead else "sparse-offload"
    out = generate(model, ids, mask, OffloadedSparseCache.for_model(model, mode=mode), 12)
    assert torch.equal(out.sequences, ref.sequences)


@pytest.mark.parametrize("selector", ["query-carry", "forecast-carry", "quest-forecast-carry", "forecast-carry-pin"])
def test_a_batch_beside_a_sequence_below_dense_len_carries_as_each_sequence_alone(selector):
    """A batch holding a sequence below dense_len (which attends densely) and one above it: the sparse
    sequence's decode steps carry (and pin) what it would alone, and the dense one carries nothing into its
    first sparse step: every sequence's greedy tokens equal its own run, resident and offloaded.  (Before,
    such a step forgot every sequence's carried blocks.)"""
    model = tiny_model({**GEOMETRY, "selector": selector, "dense_len": 56}, seed=8)
    lengths = [40, 70]  # the first crosses dense_len on its 17th token
    ids, mask = left_padded(lengths)
    batch = generate(model, ids, mask, SparseCache(model.config), 20).sequences[:, ids.shape[1]:]
    for row, length in enumerate(lengths):
        alone = generate(model, ids[row : row + 1, -length:], mask[row : row + 1, -length:],
                         SparseCache(model.config), 20).sequences[:, length:]
        assert torch.equal(batch[row : row + 1], alone), f"{selector}: sequence {row} of {length} tokens"
    mode = "forecast-offload" if get_selector(selector).plans_ahead else "sparse-offload"
    offloaded = generate(model, ids, mask, OffloadedSparseCache.for_model(model, mode=mode), 20).sequences
    assert torch.equal(offloaded[:, ids.shape[1]:], batch), mode
