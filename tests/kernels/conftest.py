"""Kernel tests: Triton kernels against their references.

Without CUDA the kernels run in Triton's CPU interpreter; TRITON_INTERPRET must be set before any
kernel is jitted, so it is set here, at import time (the root conftest may already have done so).
"""

from __future__ import annotations

import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from forecastkv.kernels._common import interpreting, triton_available  # noqa: E402
from tests.helpers import rel  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

needs_triton = pytest.mark.skipif(
    not triton_available() or not (CUDA or interpreting()),
    reason="needs triton and either CUDA or TRITON_INTERPRET=1",
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random inputs per test, reproducible from the test id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def host(x: torch.Tensor) -> torch.Tensor:
    """A host-side tensor for the gather: pinned CPU memory where CUDA exists."""
    x = x.cpu()
    return x.pin_memory() if CUDA else x


def assert_close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Non-finite entries must match exactly, finite ones to the dtype's relative tolerance."""
    assert a.shape == b.shape, (a.shape, b.shape)
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    assert torch.equal(fa, fb), "finite patterns differ"
    assert torch.equal(a[~fa], b[~fb]), "non-finite entries differ"
    if fa.any():
        err = rel(a[fa], b[fb])
        assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]}"


# ----------------------------------------------------------------------------------------------
# ahead-of-time compile for an H100/H200 (sm_90) without a GPU: catches compiled-mode errors that
# the interpreter lets through (types, tl.dot shapes, constexpr branches) on CPU-only machines
# ----------------------------------------------------------------------------------------------


def _nvidia_backend() -> bool:
    try:
        from triton.backends import backends
    except Exception:
        return False
    return "nvidia" in backends


_AOT_SM90_RUNS = pytest.mark.skipif(
    CUDA or not triton_available() or not _nvidia_backend(),
    reason="ahead-of-time sm_90 compile: runs on CPU-only machines with triton's nvidia backend "
    "(CUDA runs compile for real)",
)


def aot_sm90(test):
    """Mark a test that compiles its kernels for sm_90 in a fresh interpreter (`compile_sm90`):
    ~10 s of compiler a test, so in the slow tier."""
    return pytest.mark.slow(_AOT_SM90_RUNS(test))

_POINTER = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int32: "*i32",
    torch.int64: "*i64",
}


def compile_sm90(module: str, function: str, timeout: int = 300) -> int:
    """Run `module.function()` in a fresh Python with every kernel launch replaced by
    `triton.compile(...)` for sm_90; returns the number of kernels compiled.

    A subprocess, because triton imported under TRITON_INTERPRET=1 (as here) cannot compile: its
    own helpers (tl.sum's combine functions, ...) were created as interpreter objects.
    """
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    code = (
        "import importlib, sys\n"
        "from tests.kernels.conftest import compile_in_process\n"
        "launch = getattr(importlib.import_module(sys.argv[1]), sys.argv[2])\n"
        "print('compiled', len(compile_in_process(launch)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, module, function],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"sm_90 compile failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return int(proc.stdout.strip().splitlines()[-1].split()[-1])


def compile_in_process(launch) -> list:
    """Call `launch()` with every kernel launch replaced by `triton.compile(...)` for sm_90.

    Nothing runs and no output is written; returns the compiled kernels (one per launch).  Needs a
    process where triton was imported without TRITON_INTERPRET (see `compile_sm90`).
    """
    from unittest import mock

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from forecastkv.kernels._common import LazyKernel

    compiled = []

    def fake_getitem(self, grid):
        def compile_call(*args, **kwargs):
            jit = JITFunction(self.source(triton.jit))  # with its device-function helpers, compiled
            options = {"num_warps": kwargs.pop("num_warps", 4)}
            signature, constexprs = {}, {}
            for name, value in zip(jit.arg_names, args):
                if isinstance(value, torch.Tensor):
                    signature[name] = _POINTER[value.dtype]
                elif isinstance(value, bool):
                    signature[name] = "i1"
                elif isinstance(value, int):
                    signature[name] = "i64" if abs(value) >= 2**31 else "i32"
                else:
                    signature[name] = "fp32"
            for name, value in kwargs.items():
                signature[name], constexprs[name] = "constexpr", value
            src = ASTSource(jit, signature, constexprs=constexprs)
            compiled.append(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options))

        return compile_call

    with mock.patch.object(LazyKernel, "__getitem__", fake_getitem):
        launch()
    return compiled
