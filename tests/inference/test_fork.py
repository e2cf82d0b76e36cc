"""fork(), copy.deepcopy and fork_batch(): one prefill of a document answers several questions, one
after another or as one batch over the shared prefix, with the tokens of independent prefills, in
the resident cache and the offload modes (InfLLM-v2 and NOSA).  Forks share the full host blocks,
copy the tail, and never change one another (also across a crop into a shared block)."""

from __future__ import annotations

import copy

import pytest
import torch

from forecastkv import SparseCache
from forecastkv.inference import OffloadedSparseCache
from forecastkv.modeling.modeling import CACHE_KWARG
from tests.helpers import tiny_model

POLICIES = ("infllmv2", "nosa")
MODES = ("resident", "sparse-offload", "forecast-offload")
DOC = 45  # 5 full blocks of 8 and a partial tail of 5: the tail is copied, the rest shared
QUESTIONS = (3, 7, 12, 5)
NEW_TOKENS = 8


def make_cache(model, mode: str):
    if mode == "resident":
        return SparseCache(model.config)
    return OffloadedSparseCache.for_model(model, mode=mode)


def reference_selector(mode: str):
    """The selector of the cache `make_cache` builds (sparse-offload selects with queries)."""
    return "query" if mode == "sparse-offload" else None


def texts(seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    doc = torch.randint(3, 128, (1, DOC), generator=gen)
    questions = [torch.randint(3, 128, (1, n), generator=gen) for n in QUESTIONS]
    return doc, questions


def generate(model, ids, cache, mask=None):
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask if mask is not None else torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            **{CACHE_KWARG: cache},
        )[:, ids.shape[1] :]


def prefilled(model, mode, doc):
    cache = make_cache(model, mode)
    with torch.no_grad():
        model(input_ids=doc, **{CACHE_KWARG: cache})
    return cache


def independent(model, mode, doc, questions):
    """Each question's answer from its own cache and one prefill of document + question."""
    return [
        generate(model, torch.cat([doc, q], 1), SparseCache(model.config, selector=reference_selector(mode)))
        for q in questions
    ]


@pytest.fixture(scope="module", params=POLICIES)
def setup(request):
    model = tiny_model({"policy": request.param, "selector": "forecast"}, seed=3)
    doc, questions = texts()
    return model, doc, questions, {mode: independent(model, mode, doc, questions) for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_questions_one_after_another_from_one_prefill(setup, mode):
    """fork(), fork(n) and copy.deepcopy each answer a question; the last one is answered by the
    prefilled cache itself, so an earlier fork that changed it would show."""
    model, doc, questions, expected = setup
    cache = prefilled(model, mode, doc)
    first, second = cache.fork(2)
    forks = [first, copy.deepcopy(cache), second, cache]
    for question, fork, want in zip(questions, forks, expected[mode]):
        assert torch.equal(generate(model, torch.cat([doc, question], 1), fork), want)
    assert cache.get_seq_length() > DOC and first.get_seq_length() == DOC + QUESTIONS[0] + NEW_TOKENS - 1


@pytest.mark.parametrize("mode", MODES)
def test_questions_as_one_batch_over_the_shared_prefix(setup, mode):
    """fork_batch(4): one left-aligned document, each question right-aligned after padding (mask 0)."""
    model, doc, questions, expected = setup
    cache = prefilled(model, mode, doc)
    width = max(QUESTIONS)
    ids = torch.zeros(len(questions), DOC + width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[:, :DOC], mask[:, :DOC] = doc, 1
    for row, q in enumerate(questions):
        ids[row, DOC + width - q.shape[1] :], mask[row, DOC + width - q.shape[1] :] = q, 1
    batch = cache.fork_batch(len(questions))
    assert torch.equal(generate(model, ids, batch, mask), torch.cat(expected[mode]))
    assert cache.sequence_lengths().tolist() == [DOC] and cache.get_seq_length() == DOC  # the source is unchanged
    if mode != "resident":
        assert_batch_shares_full_blocks(cache, batch, len(questions))


def assert_batch_shares_full_blocks(source, batch, n):
    """Every sequence of the batch maps the document's full blocks to the source's physical
    blocks (held once more per sequence) and owns every block from its tail on."""
    full = DOC // model_block(source)
    for layer, mine in zip(source.layers, batch.layers):
        if not layer.offloaded:
            continue
        shared = layer.store.host.blocks.sequence_blocks(0, DOC)[:full]
        assert all(layer.store.host.pool.allocator.refs[block] == 1 + n for block in shared)
        private = set()
        for b in range(n):
            table = mine.store.host.blocks.sequence_blocks(b)
            assert table[:full] == shared
            private.update(table[full:])
        assert all(
            mine.store.host.pool.allocator.refs[block] == 1 for block in private if block >= 0
        ) and not private & set(layer.store.host.blocks.sequence_blocks(0))


def model_block(cache) -> int:
    return next(layer.block_size for layer in cache.layers if layer.offloaded)


def greedy_from(model, cache, ids):
    """Feed ids [1, n] (one call), then return the next token and a stepper for more."""
    with torch.no_grad():
        token = model(input_ids=ids, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)

    def step():
        nonlocal token
        with torch.no_grad():
            token = model(input_ids=token, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)
        return token

    return token, step


@pytest.mark.parametrize("mode", MODES)
def test_interleaved_forks_never_touch_one_another(setup, mode):
    """Two forks decode different continuations step by step in turn (each write lands in its
    own tail block) and give the tokens of independent prefills."""
    model, doc, questions, expected = setup
    a, b = prefilled(model, mode, doc).fork(2)
    first_a, step_a = greedy_from(model, a, questions[0])
    first_b, step_b = greedy_from(model, b, questions[1])
    tokens_a, tokens_b = [first_a], [first_b]
    for _ in range(NEW_TOKENS - 1):
        tokens_a.append(step_a())
        tokens_b.append(step_b())
    assert torch.equal(torch.cat(tokens_a, 1), expected[mode][0])
    assert torch.equal(torch.cat(tokens_b, 1), expected[mode][1])


@pytest.mark.parametrize("mode", ["resident", "forecast-offload"])
def test_crop_into_a_shared_block_copies_it(setup, mode):
    """A fork cropped back into the shared document (block 2, which its source still holds as
    full) and extended with other tokens: the source answers as before, the fork as a fresh
    prefill of the kept prefix and the new tokens."""
    model, doc, questions, expected = setup
    source = prefilled(model, mode, doc)
    fork = source.fork()
    fork.crop(20)
    other = questions[2]
    got = generate(model, torch.cat([doc[:, :20], other], 1), fork)
    fresh = generate(
        model, torch.cat([doc[:, :20], other], 1), SparseCache(model.config, selector=reference_selector(mode))
    )
    assert torch.equal(got, fresh)
    assert torch.equal(generate(model, torch.cat([doc, questions[0]], 1), source), expected[mode][0])


def test_fork_arguments_and_pool_accounting():
    model = tiny_model({"policy": "nosa", "selector": "forecast"}, seed=3)
    doc, _ = texts()
    cache = prefilled(model, "forecast-offload", doc)
    with pytest.raises(ValueError, match=r"fork\(n\): n must be a positive integer or None, got 0"):
        cache.fork(0)
    with pytest.raises(ValueError, match=r"fork_batch\(n\): n must be a positive integer, got True"):
        cache.fork_batch(True)
    before = cache.host_blocks()
    assert before["shared"] == 0 and before["held"] == before["allocated"] - before["free"]
    batch = cache.fork_batch(3)
    after = cache.host_blocks()
    layers = sum(layer.offloaded for layer in cache.layers)
    full = DOC // model_block(cache)
    assert after["shared"] == layers * full  # the document's full blocks, now held 4 times
    # the batch holds the shared blocks once each and a copied tail per sequence
    assert batch.host_blocks()["held"] == layers * (full + 3) and batch.host_nbytes() == cache.host_nbytes()
    del batch
    assert cache.host_blocks()["shared"] == 0  # the batch's holds end with it
    assert cache.host_blocks()["free"] == after["free"] + layers * 3


@pytest.mark.parametrize("mode", ["sparse-offload", "forecast-offload"])
def test_attach_holds_another_owners_blocks(setup, mode):
    """A new cache attached to the host blocks of a prefilled one (as a ContextStore would hand
    them out: pool and block ids per offloaded layer, rows for the resident layer 0) answers as an
    independent prefill, holds the full blocks where they are, and leaves the owner intact."""
    model, doc, questions, expected = setup
    owner = prefilled(model, mode, doc)
    entries = []
    for layer in owner.layers:
        if layer.offloaded:
            entries.append(
                (layer.store.host.pool, layer.store.host.blocks.sequence_blocks(0, DOC), torch.device("cpu"))
            )
        else:
            entries.append(layer.full()[:3])
    cache = OffloadedSparseCache.for_model(model, mode=mode)
    cache.attach(entries, DOC)
    assert cache.get_seq_length() == DOC and cache.host_pools() == owner.host_pools()
    full = DOC // model_block(owner)
    for layer, mine in zip(owner.layers, cache.layers):
        if layer.offloaded:
            assert (
                mine.store.host.blocks.sequence_blocks(0, DOC)[:full]
                == layer.store.host.blocks.sequence_blocks(0, DOC)[:full]
            )
            # the partial tail: a copy
            assert (
                mine.store.host.blocks.sequence_blocks(0, DOC)[full]
                != layer.store.host.blocks.sequence_blocks(0, DOC)[full]
            )
    assert torch.equal(generate(model, torch.cat([doc, questions[0]], 1), cache), expected[mode][0])
    assert torch.equal(generate(model, torch.cat([doc, questions[1]], 1), owner), expected[mode][1])
    with pytest.raises(ValueError, match="attach\\(\\) fills an empty layer"):
        cache.attach(entries, DOC)
