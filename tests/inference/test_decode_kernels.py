"""Decode through the kernels (what CUDA runs): `sparse_decode_blocks` on the resident cache and
`sparse_decode_slots` on the offloaded slots give the tokens and logits of the gather + SDPA path.
Here the kernels run in Triton's interpreter (the backend setting's decode part forced to "kernels")."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forecastkv import SparseCache, kernels
from forecastkv.inference import OffloadedSparseCache
from forecastkv.kernels._common import interpreting, triton_available
from tests.helpers import left_padded, rel, tiny_model
from tests.inference.test_offloaded import generate

needs_interpreter = pytest.mark.skipif(
    not (triton_available() and (interpreting() or torch.cuda.is_available())),
    reason="needs triton (CUDA or TRITON_INTERPRET=1)",
)


@needs_interpreter
@pytest.mark.slow  # every decode kernel in Triton, end to end (the interpreter without CUDA)
def test_kernel_decode_matches_gather_decode(monkeypatch):
    """NOSA (a CIS bias), forecast selector (prefetched slots), a left-padded batch."""
    model = tiny_model({"policy": "nosa", "selector": "forecast"}, seed=13)
    ids, mask = left_padded([36, 25])
    makers = {
        "sparse-cache": lambda: SparseCache(model.config),
        "forecast-offload": lambda: OffloadedSparseCache.for_model(model, mode="forecast-offload"),
    }
    monkeypatch.setenv("FORECASTKV_BACKEND", "decode=gather")
    ref = generate(model, ids, mask, SparseCache(model.config), new_tokens=4)
    monkeypatch.setenv("FORECASTKV_BACKEND", "decode=kernels")
    scored, choose = [], kernels.kernel_set
    spies = {}  # the decode-time scoring kernels of the chosen KernelSet select the blocks
    for name in ("block_scores", "agnostic_scores"):
        original = getattr(choose("cpu"), name)
        spies[name] = lambda *a, _f=original, _n=name, **k: (scored.append(_n), _f(*a, **k))[1]
    monkeypatch.setattr(kernels, "kernel_set", lambda device: dataclasses.replace(choose(device), **spies))
    calls = []
    for name, make in makers.items():
        cache = make()
        for layer in cache.layers:
            original = layer.decode_attention
            layer.decode_attention = lambda *a, _f=original, **k: (calls.append(1), _f(*a, **k))[1]
        out = generate(model, ids, mask, cache, new_tokens=4)
        assert torch.equal(out.sequences, ref.sequences), name
        assert rel(torch.stack(out.logits, 1), torch.stack(ref.logits, 1)) < 1e-5, name
    assert len(calls) == 2 * 3 * model.config.num_hidden_layers  # every decode step of every layer
    # NOSA: both, once per layer and step
    assert scored.count("block_scores") == scored.count("agnostic_scores") == len(calls)
