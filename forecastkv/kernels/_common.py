"""Shared helpers for the kernels: input validation, launch-mode checks and lazy `triton.jit`.

Every Triton kernel validates shapes, dtypes, devices and index ranges here *before* it launches,
so no input can make a kernel read or write outside its buffers (check_ids=False skips only the
range checks, whose device sync a decode step avoids; the kernels clamp indices anyway).  The
references run the same checks under check_ids=True, the default; with check_ids=False they trust
the caller, since PyTorch's own indexing cannot leave a buffer.  Errors name the offending value and
the limit it broke.
"""

from __future__ import annotations

import os
import types
from typing import Callable, Iterable

import torch

try:  # triton is optional: the references and the dispatch work without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def triton_available() -> bool:
    return triton is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


class LazyKernel:
    """A plain Python kernel function, handed to `triton.jit` on first launch.

    `triton.jit` decides between the compiler and the interpreter when it runs, from
    `TRITON_INTERPRET`; jitting lazily (once per mode) means the kernel modules can be imported in
    any order relative to setting that variable.  `helpers` are plain functions the kernel calls by
    their global names (device functions such as `lse.online_lse`): they are jitted with it, in the
    same mode, and the kernel sees them through a copy of its globals (`source`).
    """

    def __init__(self, fn: Callable, helpers: tuple[Callable, ...] = ()) -> None:
        self.fn = fn
        self.helpers = helpers
        self._jitted: dict[bool, object] = {}

    def source(self, jit: Callable) -> Callable:
        """The kernel function to hand to `jit`: `fn` itself, or with helpers a copy of it whose
        globals map each helper's name to `jit(helper)`."""
        if not self.helpers:
            return self.fn
        scope = dict(self.fn.__globals__)
        scope.update({helper.__name__: jit(helper) for helper in self.helpers})
        clone = types.FunctionType(self.fn.__code__, scope, self.fn.__name__, self.fn.__defaults__, self.fn.__closure__)
        clone.__qualname__, clone.__module__, clone.__doc__ = self.fn.__qualname__, self.fn.__module__, self.fn.__doc__
        return clone

    def __getitem__(self, grid):
        if triton is None:
            raise RuntimeError(
                "triton is not installed; use the reference backend (FORECASTKV_BACKEND=kernels=reference)"
            )
        mode = interpreting()
        if mode not in self._jitted:
            self._jitted[mode] = triton.jit(self.source(triton.jit))
        return self._jitted[mode][grid]


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------


def check_tensor(name: str, tensor, ndim: int | None = None, dtypes: Iterable[torch.dtype] | None = None) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(tensor.shape)}")
    if dtypes is not None and tensor.dtype not in tuple(dtypes):
        raise TypeError(f"{name} has dtype {tensor.dtype}; allowed dtypes are {tuple(dtypes)}")


def check_shape(name: str, tensor: torch.Tensor, shape: tuple, what: str = "") -> None:
    if tuple(tensor.shape) != tuple(shape):
        suffix = f" ({what})" if what else ""
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}{suffix}")


def check_same_dtype(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        listing = ", ".join(f"{n}={t.dtype}" for n, t in zip(names, tensors))
        raise TypeError(f"dtypes must be equal: {listing}")


def check_same_device(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        listing = ", ".join(f"{n} on {t.device}" for n, t in zip(names, tensors))
        raise ValueError(f"tensors must be on one device: {listing}")


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_range(name: str, tensor: torch.Tensor, low: int, high: int, what: str = "") -> None:
    """Every entry of integer `tensor` must lie in [low, high).  Syncs once on CUDA."""
    if tensor.numel() == 0:
        return
    lo, hi = (int(x) for x in torch.aminmax(tensor.long()))
    suffix = f" ({what})" if what else ""
    if lo < low:
        raise ValueError(f"{name} has value {lo} < {low}, the lowest allowed{suffix}")
    if hi >= high:
        raise ValueError(f"{name} has value {hi} >= {high}, the limit{suffix}")


def check_pinned(name: str, host: torch.Tensor, target: torch.Tensor) -> None:
    """A CPU tensor read by a CUDA kernel through UVA must be pinned (page-locked)."""
    if target.device.type == "cuda" and host.device.type == "cpu":
        if not torch.cuda.is_available() or not host.is_pinned():
            raise ValueError(
                f"{name} is pageable host memory; the UVA gather reads it from the GPU, so it must be "
                f"pinned: allocate it with pin_memory=True or call .pin_memory()"
            )
    elif host.device != target.device:
        raise ValueError(f"{name} is on {host.device} but the destination is on {target.device}")


def check_bias_pair(
    names: tuple[str, str], tensors: tuple, shapes: tuple[tuple, tuple], whats: tuple[str, str]
) -> bool:
    """An optional pair of bias tensors (one per side of a transfer): both or neither, each of its
    shape, one dtype.  Returns whether the pair is given."""
    if (tensors[0] is None) != (tensors[1] is None):
        raise ValueError(f"{names[0]} and {names[1]} must be given together (or both None)")
    if tensors[0] is None:
        return False
    for name, tensor, shape, what in zip(names, tensors, shapes, whats):
        check_tensor(name, tensor, ndim=len(shape), dtypes=FLOAT_DTYPES)
        check_shape(name, tensor, shape, what)
    check_same_dtype(names, tensors)
    return True


def check_transfer_sides(device_side: list, host_side: list, target: torch.Tensor) -> None:
    """(name, tensor) lists of a host <-> device transfer: each side on one device, and host-side
    tensors pinned where a CUDA kernel reads or writes them through UVA."""
    check_same_device(*zip(*device_side))
    check_same_device(*zip(*host_side))
    for name, tensor in host_side:
        check_pinned(name, tensor, target)


def cuda_device_guard(tensor: torch.Tensor):
    """`torch.cuda.device(tensor.device)` for CUDA tensors, a no-op otherwise."""
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    import contextlib

    return contextlib.nullcontext()
