"""Prompts shorter than (or about) one block: every offload mode gives the resident SparseCache's
tokens, with no NaN logit, in all three backends.

A prompt under one block has no complete block: every selection entry but the current block is
-1, and the device slots it would read were never filled (they start as NaN).  Attention must treat
those rows as absent, never multiply them by a zero weight.
"""

from __future__ import annotations

import pytest
import torch

from forecastkv import SparseCache
from forecastkv.inference import OffloadedSparseCache
from tests.helpers import left_padded, rel, tiny_model
from tests.inference.conftest import INTERPRETED_BACKENDS, RUNTIME_BACKENDS
from tests.inference.test_offloaded import generate, modes_for

# block 64 (the presets' size) around 0, 1 and 2 blocks; block 16 at every length up to 17
GEOMETRIES = {
    64: (dict(block_size=64, kernel_size=16, kernel_stride=8, window_size=64), [1, 2, 15, 16, 17, 63, 64, 65]),
    16: (dict(block_size=16, kernel_size=8, kernel_stride=4, window_size=16), list(range(1, 18))),
}
# decode steps at positions n .. n+2: across a block boundary from prompts of 15/16 (block 16) and 63/64 (block 64)
NEW_TOKENS = 4
POLICIES = ("infllmv2", "nosa")


def reference(model, ids, mask):
    """The resident SparseCache's output under the auto backend (gather + SDPA)."""
    from forecastkv import kernels

    with kernels.use_backend(kernels="auto", decode="gather"):
        return generate(model, ids, mask, SparseCache(model.config), NEW_TOKENS)


def check(model, ids, mask, modes, ref, label):
    """SparseCache (under the current backend) and every offload mode in `modes`: the reference's
    tokens, logits within 1e-5 relative, and no NaN anywhere."""
    ref_logits = torch.stack(ref.logits, 1)
    assert torch.isfinite(ref_logits).all(), label
    makers = {"resident": lambda: SparseCache(model.config)}
    makers.update({mode: (lambda m=mode: OffloadedSparseCache.for_model(model, mode=m)) for mode in modes})
    for name, make in makers.items():
        out = generate(model, ids, mask, make(), NEW_TOKENS)
        logits = torch.stack(out.logits, 1)
        assert not logits.isnan().any(), f"{label} {name}: NaN logits"
        assert torch.equal(out.sequences, ref.sequences), f"{label} {name}"
        assert rel(logits, ref_logits) < 1e-5, f"{label} {name}"


def models(block: int, policy: str):
    """One tiny model per selector: the query selector's modes and the forecast selector's."""
    geometry = GEOMETRIES[block][0]
    return {
        selector: tiny_model({"policy": policy, "selector": selector, **geometry}, seed=21)
        for selector in ("query", "forecast")
    }


def left_padded_batch(block, policy, lengths=None, selectors=("query", "forecast"), modes=None):
    """One left-padded batch holding every length of the geometry (or `lengths`), in all five
    modes (or `modes`)."""
    ids, mask = left_padded(lengths or GEOMETRIES[block][1], seed=block)
    for selector, model in models(block, policy).items():
        if selector in selectors:
            own = modes_for(selector) if modes is None else [m for m in modes if m in modes_for(selector)]
            check(model, ids, mask, own, reference(model, ids, mask), f"{selector} batch")


def batch_1(block, policy):
    """Each length alone, in the modes of each selector (sparse-offload, forecast-sync, forecast-offload)."""
    for selector, model in models(block, policy).items():
        for length in GEOMETRIES[block][1]:
            ids, mask = left_padded([length], seed=length)
            check(model, ids, mask, modes_for(selector)[2:], reference(model, ids, mask), f"{selector} length {length}")


# The whole grid runs unmarked in the two backends that run no Triton: what a CPU user gets by
# default (cpu-default: gather + SDPA decode, reference gather) and decode=kernels on the
# references.  In the two backends that run Triton in the interpreter here (auto: the block gather;
# kernels-triton: every decode kernel) a few seconds per generated token allow one batch each.


@pytest.mark.parametrize("runtime_backend", RUNTIME_BACKENDS, indirect=True)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("block", sorted(GEOMETRIES))
def test_short_prompts(block, policy, runtime_backend, one_thread):
    left_padded_batch(block, policy)
    batch_1(block, policy)


@pytest.mark.parametrize("runtime_backend", INTERPRETED_BACKENDS, indirect=True)
def test_short_prompts_interpreted_backends(runtime_backend, one_thread):
    """Block 16, NOSA (a CIS bias in every slot): auto: prompts of 1, 16 and 17 tokens (no, one
    whole and one partial block) in sparse-offload and forecast-offload; kernels-triton, the
    slowest: prompts of 1 and 17 tokens in forecast-offload."""
    if runtime_backend == "auto":
        left_padded_batch(16, "nosa", lengths=[1, 16, 17], modes=["sparse-offload", "forecast-offload"])
    else:
        left_padded_batch(16, "nosa", lengths=[1, 17], selectors=("forecast",), modes=["forecast-offload"])


ISSUE_CASE = """
import dataclasses, os, torch
from forecastkv import SparseCache, kernels
from forecastkv.inference import OffloadedSparseCache
from forecastkv.kernels._common import interpreting
from tests.helpers import left_padded, rel, tiny_model
from tests.inference.test_offloaded import generate

torch.set_num_threads(1)
assert not interpreting() and kernels.get_backend("decode") == "kernels" and not kernels.use_triton("cpu")
calls = []
original, choose = kernels.sparse_decode_slots_reference, kernels.kernel_set
assert choose("cpu").sparse_decode_slots is original  # the chosen kernels: the references
counting = lambda *a, **k: (calls.append(1), original(*a, **k))[1]  # noqa: E731
kernels.kernel_set = lambda device: dataclasses.replace(choose(device), sparse_decode_slots=counting)
model = tiny_model({"policy": "infllmv2", "selector": "query", "block_size": 16, "kernel_size": 8, "kernel_stride": 4,
                    "window_size": 32, "topk": 3}, seed=0)
ids, mask = left_padded([200])
with kernels.use_backend(decode="gather"):
    ref = generate(model, ids, mask, SparseCache(model.config), 8)
out = generate(model, ids, mask, OffloadedSparseCache.for_model(model, mode="sparse-offload"), 8)
logits, ref_logits = torch.stack(out.logits, 1), torch.stack(ref.logits, 1)
assert not logits.isnan().any(), "NaN logits"
assert torch.equal(out.sequences, ref.sequences), (out.sequences[0, -8:].tolist(), ref.sequences[0, -8:].tolist())
assert rel(logits, ref_logits) < 1e-5
assert len(calls) == 7 * 2  # every decode step of the two offloaded layers ran the reference
print("ok", out.sequences[0, -8:].tolist())
"""


@pytest.mark.slow  # a fresh interpreter without TRITON_INTERPRET
def test_issue_case_kernel_references_without_interpreter():
    """The issue's case as a serving engine on a CPU runs it: a 3-layer Llama (hidden 96, 6 heads,
    2 KV heads), block 16, top-k 3, window 32, a 200-token prompt, sparse-offload, decode through
    the kernels' PyTorch references in a process without TRITON_INTERPRET (set for this suite
    before any import, so it takes a fresh interpreter)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(FORECASTKV_BACKEND="decode=kernels", PYTHONPATH=os.pathsep.join([root, env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", ISSUE_CASE], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.startswith("ok")
