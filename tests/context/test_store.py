"""ContextStore in memory: a cache rebuilt from blocks is the cache a prefill makes, prefix hits
give the tokens of independent prefills in every mode, LRU under a byte cap, references, counters."""

from __future__ import annotations

import gc

import pytest
import torch

from forecastkv.context import ContextStore, ContextStoreError
from tests.context.common import MODES, POLICIES, document_and_questions, fresh_cache, generate, model_for
from tests.helpers import tiny_model


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", list(MODES))
def test_rebuilt_cache_equals_a_prefill(policy, name):
    """A cache a lookup builds from stored blocks (offloaded layers attached to the store's host
    blocks, resident layers given the rows) has every layer's rows, compressed keys and pooled CIS
    of a prefill of the same tokens, and gives the same tokens after it."""
    mode, selector = MODES[name]
    model = model_for(policy)
    ids = torch.randint(3, 128, (43,), generator=torch.Generator().manual_seed(2))
    source, prefix = fresh_cache(model, mode, selector), fresh_cache(model, mode, selector)
    with torch.no_grad():
        model(ids[None], cache=source)
        model(ids[None, :40], cache=prefix)
    store = ContextStore(model, selector=selector)
    assert store.insert(source, ids) == 5
    rebuilt, matched = store.lookup(ids, mode=mode)
    assert matched == 40
    for mine, theirs in zip(rebuilt.layers, prefix.layers):
        for a, b in zip(mine.full(), theirs.full()):
            assert (a is None and b is None) or torch.equal(torch.as_tensor(a), torch.as_tensor(b))
        for a, b in zip(mine.compressed(), theirs.compressed()):  # compressed keys, coarse keys, pooled CIS
            assert (a is None and b is None) or torch.equal(a, b)
        assert (mine.compressed()[2] is not None) == (policy == "nosa")
    assert rebuilt.get_seq_length() == 40
    assert torch.equal(generate(model, ids, rebuilt), generate(model, ids, prefix))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", list(MODES))
def test_document_then_four_questions(policy, name):
    """Four questions about one document, answered one after another through lookups: the
    tokens of an independent prefill of each prompt; the document's blocks are prefilled once."""
    mode, selector = MODES[name]
    model = model_for(policy)
    doc, questions = document_and_questions()
    store = ContextStore(model, selector=selector)
    matched_per_question, total = [], 0
    for question in questions:
        prompt = torch.cat([doc, question])
        cache, matched = store.lookup(prompt, mode=mode)
        assert cache.get_seq_length() == matched
        assert torch.equal(
            generate(model, prompt, cache), generate(model, prompt, fresh_cache(model, mode, selector))
        ), matched
        store.insert(cache, prompt)
        matched_per_question.append(matched)
        total += prompt.shape[0]
    assert matched_per_question == [0, 40, 40, 40]  # the document's 5 full blocks of 8
    stats = store.stats()
    assert stats["hit_tokens"] == 120 and stats["miss_tokens"] == total - 120 and stats["evictions"] == 0


def test_full_hit_leaves_one_token_to_prefill():
    model = model_for("infllmv2")
    ids = torch.randint(3, 128, (32,), generator=torch.Generator().manual_seed(4))
    store = ContextStore(model)
    cache, matched = store.lookup(ids)
    generate(model, ids, cache)
    store.insert(cache, ids)
    assert store.stats()["blocks"] == 4
    cache, matched = store.lookup(ids)
    assert matched == 24  # a whole-block prompt keeps its last block to prefill: generate needs logits
    cache, matched = store.lookup(torch.cat([ids, ids[:1]]))
    assert matched == 32


def _filled(model, store, seed: int, length: int = 32):
    """A prompt of `length` tokens prefilled and inserted; returns (ids, the cache)."""
    ids = torch.randint(3, 128, (length,), generator=torch.Generator().manual_seed(seed))
    cache, _ = store.lookup(ids)
    generate(model, ids, cache, new_tokens=1)
    store.insert(cache, ids)
    return ids, cache


def test_lru_respects_the_cap_and_never_evicts_a_referenced_block():
    model = model_for("nosa")
    block = ContextStore(model).block_shapes()
    per_block = sum(torch.empty(shape, dtype=dtype).nbytes for shape, dtype in block.values())
    store = ContextStore(model, max_bytes=6 * per_block)
    first, held = _filled(model, store, seed=1)  # 4 blocks, referenced by `held`
    _, other = _filled(model, store, seed=2)  # 2 of its 4 blocks fit
    assert store.stats()["blocks"] == 6 and store.nbytes <= store.max_bytes and store.stats()["rejected_blocks"] == 2
    del other
    gc.collect()
    _filled(model, store, seed=3)  # evicts the released chain, tip first, never `held`'s
    stats = store.stats()
    assert store.nbytes <= store.max_bytes and stats["evictions"] == 2 and stats["blocks"] == 6
    probe, matched = store.lookup(torch.cat([first, first[:1]]))
    assert matched == 32  # the referenced chain is whole
    assert (
        store.stats()["referenced_blocks"] == 4
    )  # `held` and `probe` share 4 blocks; the third cache is gone, so are its references
    store.release(held)
    store.release(probe)
    _filled(model, store, seed=4)
    _filled(model, store, seed=5)
    _, matched = store.lookup(torch.cat([first, first[:1]]))
    assert matched < 32 and store.nbytes <= store.max_bytes


def test_insert_rejects_a_foreign_cache_and_a_token_mismatch():
    model = model_for("infllmv2")
    store = ContextStore(model, selector="query")
    ids = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(6))
    cache = fresh_cache(model, None, "query")
    with torch.no_grad():
        model(ids[None], cache=cache)
    with pytest.raises(ContextStoreError, match="token mismatch: ids has 21 tokens but the cache holds 20"):
        store.insert(cache, torch.cat([ids, ids[:1]]))
    other = tiny_model({"policy": "infllmv2", "selector": "forecast", "block_size": 16, "window_size": 16}, seed=5)
    foreign = fresh_cache(other, None, "query")
    with torch.no_grad():
        other(ids[None], cache=foreign)
    with pytest.raises(ValueError, match="block_size: cache 16 vs model 8"):
        store.insert(foreign, ids)
    half = model_for("infllmv2").to(torch.bfloat16)
    bf16 = fresh_cache(half, None, "query")
    with torch.no_grad():
        half(ids[None], cache=bf16)
    with pytest.raises(ContextStoreError, match="the cache holds bfloat16 K/V, this store keeps float32"):
        store.insert(bf16, ids)
    forecast = fresh_cache(model, "forecast-offload", "forecast")
    with torch.no_grad():
        model(ids[None], cache=forecast)
    with pytest.raises(ContextStoreError, match="prefilled with the forecast selector"):
        store.insert(forecast, ids)
    with pytest.raises(ValueError, match="mode 'forecast-offload' selects with the forecast selector"):
        store.lookup(ids, mode="forecast-offload")
    assert store.stats()["blocks"] == 0
    assert store.insert(cache, ids) == 2


@pytest.mark.parametrize("name", ["sparse-offload", "forecast-offload"])
def test_lookups_share_the_stored_host_blocks(name):
    """Four lookups of one stored prefix point at the store's host blocks (no copy) and answer as
    independent prefills; what is counted is each offloaded layer's pool once: its allocated (on
    CUDA pinned) bytes, `HostBlockPool.nbytes()`, which holds the store's blocks and every cache's
    own blocks (question, answer).  Four caches hold S + p1..p4 blocks against S + p1 for one, with
    S the prefix's blocks and p_i <= 3 each cache's own: <= 1.3x here (S = 32; at S = 8 the floor is
    (8 + 4) / (8 + 1) = 1.33, one own block per cache)."""
    mode, selector = MODES[name]
    model = model_for("nosa")
    gen = torch.Generator().manual_seed(11)
    doc = torch.randint(3, 128, (256,), generator=gen)  # 32 full blocks of 8
    questions = [torch.randint(3, 128, (n,), generator=gen) for n in (5, 11, 7, 9)]
    store = ContextStore(model, selector=selector)
    seed = torch.cat([doc, questions[0]])
    source = fresh_cache(model, mode, selector)  # its own pools: insert copies its rows into the store's
    generate(model, seed, source, new_tokens=1)
    assert store.insert(source, seed) == 32
    del source
    gc.collect()
    pools = [pool for pool, layer in zip(store.pools, fresh_cache(model, mode, selector).layers) if layer.offloaded]
    stored = [store.entries[n].blocks for n in store.entries]  # LRU order; the chain's blocks as a set per layer

    def host_bytes() -> int:
        return sum(pool.nbytes() for pool in pools)

    assert all(pool.capacity == 32 for pool in pools) and host_bytes() == 32 * sum(p.block_nbytes() for p in pools)
    caches, sizes, own = [], [], []
    for question in questions:
        prompt = torch.cat([doc, question])
        cache, matched = store.lookup(prompt, mode=mode)
        assert matched == 256 and cache.host_pools()[1] is store.pools[1]
        assert torch.equal(generate(model, prompt, cache), generate(model, prompt, fresh_cache(model, mode, selector)))
        for index, layer in enumerate(cache.layers):
            if layer.offloaded:  # the prefix's blocks are the store's own, held once more
                assert set(layer.store.host.blocks.sequence_blocks(0)[:32]) == {blocks[index] for blocks in stored}
        own.append(len(cache.layers[1].store.host.blocks.sequence_blocks(0)) - 32)
        caches.append(cache)
        sizes.append(host_bytes())
    per_layer_block = sum(p.block_nbytes() for p in pools)
    assert sizes == [
        (32 + sum(own[: k + 1])) * per_layer_block for k in range(4)
    ]  # exactly the store's blocks + each cache's own
    assert max(own) <= 3 and sizes[3] <= 1.3 * sizes[0], (own, sizes[3] / sizes[0])
    assert store.stats()["referenced_blocks"] == 32
    store.release(caches[0])
    assert store.stats()["referenced_blocks"] == 32  # the block tables of the live caches still hold them
    del caches, cache, layer  # `layer` is the last cache's: its block table holds blocks too
    gc.collect()
    assert store.stats()["referenced_blocks"] == 0 and all(pool.allocator.used_blocks() == 32 for pool in pools)
