"""The backends a runtime parity test runs under (every edge on both sides, in every backend):

    auto               the backend setting's defaults (here: decode by gather + SDPA, the
                       kernels part Triton in the interpreter where TRITON_INTERPRET=1)
    cpu-default        what `auto` is on a CPU without the interpreter: gather + SDPA decode with
                       the block gather on its PyTorch reference
    kernels-reference  decode=kernels with every kernel call on its PyTorch reference: what a
                       CPU without Triton runs (the kernels part "reference" is the dispatch's
                       own switch, so no interpreter is involved even though the suite sets it)
    kernels-triton     decode=kernels with the Triton kernels (the interpreter without CUDA)

The suite's own default without CUDA is cpu-default ($FORECASTKV_BACKEND=kernels=reference, set in
tests/conftest.py).  Parametrize a grid with `@pytest.mark.parametrize("runtime_backend",
RUNTIME_BACKENDS, indirect=True)`, and add one or two named cases over INTERPRETED_BACKENDS;
the fixture forces the choice for the test (the environment's $FORECASTKV_BACKEND included) and
checks that the dispatch really takes it.
"""

from __future__ import annotations

import pytest
import torch

from forecastkv import kernels
from forecastkv.kernels._common import interpreting, triton_available

_PARTS = {
    "auto": dict(kernels="auto", decode="auto", prefill="auto"),
    "cpu-default": dict(kernels="reference", decode="auto", prefill="auto"),
    "kernels-reference": dict(kernels="reference", decode="kernels", prefill="auto"),
    "kernels-triton": dict(kernels="auto", decode="kernels", prefill="auto"),
}
_TRITON_RUNS = triton_available() and (interpreting() or torch.cuda.is_available())

_NEEDS_TRITON = pytest.mark.skipif(not _TRITON_RUNS, reason="needs triton (CUDA or TRITON_INTERPRET=1)")
# the grids: the two backends without the interpreter (its per-token cost buys nothing a kernel
# test on tiny shapes does not check)
RUNTIME_BACKENDS = ["cpu-default", "kernels-reference"]
# the named cases that go through the interpreted kernels end to end: the block gather (auto) and
# every decode kernel (kernels-triton).  Seconds a token in the interpreter: they are end-to-end
# runs of the kernels, in the slow tier (the kernels' own tests on tiny shapes are unit tests).
INTERPRETED = [_NEEDS_TRITON, pytest.mark.slow]
INTERPRETED_BACKENDS = [pytest.param("auto", marks=INTERPRETED), pytest.param("kernels-triton", marks=INTERPRETED)]


@pytest.fixture
def one_thread():
    """Tiny models on one intra-op thread: on a shared 2-core machine a second OpenMP thread makes
    their many small ops ~10x slower (it waits on the busy core); the values do not change."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def runtime_backend(request):
    """Run the test under `request.param`'s backend; yields its name."""
    name = request.param
    with kernels.use_backend(**_PARTS[name]):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if name in ("kernels-reference", "cpu-default"):
            assert not kernels.use_triton(device)
        elif name == "kernels-triton":
            assert kernels.use_triton(device)
        yield name
