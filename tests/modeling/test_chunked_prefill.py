"""Chunked prefill (`ForecastKVModel.forward_chunked`): a prompt prefilled `prefill_chunk` rows
per forward call, each chunk attending to the cache so far, gives one call's logits (1e-5, fp32)
and selections, in every attention mode, on the resident SparseCache and in every mode of the
offloaded cache, with left padding longer than a chunk and with MiniCPM's dense_len rule."""

from __future__ import annotations

import contextlib

import pytest
import torch

from forecastkv import SparseCache
from forecastkv.modeling.modeling import CACHE_KWARG
from tests.helpers import left_padded, rel, tiny_model

ATTENTION = {  # attention mode -> tiny_model's sparse changes (None: dense)
    "dense": None,
    "infllmv2-query": {"policy": "infllmv2", "selector": "query"},
    "infllmv2-forecast": {"policy": "infllmv2", "selector": "forecast"},
    "nosa": {"policy": "nosa", "selector": "query"},
    "nosa-forecast": {"policy": "nosa", "selector": "forecast"},
}
LENGTHS = [61, 12, 40]  # the second sequence's 49 padding columns span three 16-row chunks


@contextlib.contextmanager
def chunked(model, chunk: int):
    """model.config.prefill_chunk = chunk inside the block (what the causal LM and generate() read)."""
    model.config.prefill_chunk = chunk
    try:
        yield
    finally:
        del model.config.prefill_chunk


def prefill(model, ids, mask, cache=None, chunk=0):
    with torch.no_grad(), chunked(model, chunk):
        return model(
            ids,
            attention_mask=mask,
            collect_selections=model.config.sparse is not None,
            use_cache=True,
            **({} if cache is None else {CACHE_KWARG: cache}),
        )


def assert_same_prefill(one, chunked):
    real = one.logits.abs().sum(-1) > 0  # every column (padding columns too) is compared
    assert real.all()
    assert rel(chunked.logits, one.logits) < 1e-5
    if one.selections is not None:
        assert len(chunked.selections) == len(one.selections)
        for a, b in zip(one.selections, chunked.selections):
            assert a.keys() == b.keys() and a
            for key in a:
                assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("mode", list(ATTENTION))
@pytest.mark.parametrize("chunk", [16, 13])
def test_resident_chunked_equals_one_call(mode, chunk, monkeypatch):
    from forecastkv.modeling import modeling

    model = tiny_model(ATTENTION[mode], seed=51)
    ids, mask = left_padded(LENGTHS, seed=52)
    one = prefill(model, ids, mask)
    calls = []
    real_forward = modeling.ForecastKVModel.forward

    def counting(self, *args, **kwargs):
        calls.append(kwargs.get("prefill_chunk"))
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(modeling.ForecastKVModel, "forward", counting)
    chunked = prefill(model, ids, mask, chunk=chunk)
    assert len(calls) == 1 + -(-61 // chunk)  # the outer call, then one per chunk
    assert_same_prefill(one, chunked)
    # the caches hold the same keys: the next decode step agrees too
    step = torch.randint(3, 128, (3, 1), generator=torch.Generator().manual_seed(53))
    full_mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        a = model(step, attention_mask=full_mask, cache=one[CACHE_KWARG]).logits
        b = model(step, attention_mask=full_mask, cache=chunked[CACHE_KWARG]).logits
    assert rel(b, a) < 1e-5


def test_dense_len_decided_as_in_one_call():
    """MiniCPM's rule: a sequence shorter than dense_len attends densely, a longer one sparsely,
    decided from its key length.  The first chunk reaches dense_len for the long sequence, so the
    short one stays dense and the long one sparse in every chunk, as in one call."""
    model = tiny_model({"policy": "infllmv2", "dense_len": 56}, seed=54)
    ids, mask = left_padded([61, 30], seed=55)
    one = prefill(model, ids, mask)
    chunked = prefill(model, ids, mask, chunk=16)
    assert_same_prefill(one, chunked)
    # and the stretch matters: plain 16-column calls decide dense for the long sequence's rows
    # 32..47 (key length 48 < 56), which one call attends sparsely (past the 4-block budget)
    cache, parts = SparseCache(model.config), []
    with torch.no_grad():
        for start in range(0, 61, 16):
            stop = min(start + 16, 61)
            parts.append(model(ids[:, start:stop], attention_mask=mask[:, :stop], cache=cache).logits)
    plain = torch.cat(parts, dim=1)
    assert rel(plain[1], one.logits[1]) < 1e-5  # the short sequence is dense either way
    assert rel(plain[0], one.logits[0]) > 1e-4


def test_generate_uses_chunks_for_long_prompts(monkeypatch):
    """config.prefill_chunk: generate() prefills a prompt longer than it in chunks, same tokens."""
    model = tiny_model(ATTENTION["infllmv2-forecast"], seed=56)
    ids, mask = left_padded(LENGTHS, seed=57)
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        rows = []
        real = model.model.forward_chunked
        monkeypatch.setattr(model.model, "forward_chunked", lambda *a: rows.append(a[-1]) or real(*a))
        with chunked(model, 16):
            out = model.generate(ids, **kwargs)
    assert rows == [16]  # the prompt, once; the decode steps are single rows
    assert torch.equal(out.sequences, ref.sequences)
    assert rel(torch.stack(out.logits, 1), torch.stack(ref.logits, 1)) < 1e-5


def offloaded_modes(selector: str) -> list[str]:
    own = {"query": ["sparse-offload"], "forecast": ["forecast-sync", "forecast-offload"]}[selector]
    return ["no-offload", "dense-offload", *own]


@pytest.mark.parametrize("mode", ["infllmv2-query", "infllmv2-forecast", "nosa", "nosa-forecast"])
def test_offloaded_chunked_equals_one_call(mode):
    """Every offloaded cache mode: a chunked prefill into it equals one call into SparseCache
    (logits and selections), and the decode that follows gives the same tokens."""
    from forecastkv.inference import OffloadedSparseCache

    model = tiny_model(ATTENTION[mode], seed=58)
    ids, mask = left_padded(LENGTHS, seed=59)
    one = prefill(model, ids, mask, SparseCache(model.config))
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        ref = model.generate(ids, **kwargs, **{CACHE_KWARG: SparseCache(model.config)})
    for cache_mode in offloaded_modes(ATTENTION[mode]["selector"]):
        cache = OffloadedSparseCache.for_model(model, mode=cache_mode)
        assert_same_prefill(one, prefill(model, ids, mask, cache, chunk=16))
        with torch.no_grad(), chunked(model, 16):
            out = model.generate(ids, **kwargs, **{CACHE_KWARG: OffloadedSparseCache.for_model(model, mode=cache_mode)})
        assert torch.equal(out.sequences, ref.sequences), cache_mode
        assert rel(torch.stack(out.logits, 1), torch.stack(ref.logits, 1)) < 1e-5, cache_mode


def test_bad_chunk_is_named():
    model = tiny_model(None, seed=60)
    with pytest.raises(ValueError, match="prefill_chunk must be a non-negative integer .* got -4"):
        model.model(torch.zeros(1, 8, dtype=torch.long), prefill_chunk=-4)
