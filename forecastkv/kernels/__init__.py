"""Triton kernels, each beside its plain-PyTorch reference, and the dispatch between them.

    block_gather(...)            host KV blocks -> device slots (persistent UVA gather)
    row_store(...)               one new token row per sequence -> the host store (UVA write-back)
    sparse_decode_slots(...)     decode attention over device slot buffers
    sparse_decode_blocks(...)    decode attention over selected blocks of a resident cache
    block_scores(...)            decode-time block selection scores, ready for top-k
    agnostic_scores(...)         NOSA's query-agnostic block scores from the pooled CIS
    stage1_block_scores_triton   prefill stage-1 block scores of many rows (fused scoring,
                                 pooling, forcing, NOSA's agnostic score); its reference is
                                 selection.score_blocks, `use_stage1_kernel` says where it runs

The backend setting, one for the whole package, with three parts (each "auto" by default):

    kernels   triton | reference   which implementation a kernel call runs; auto: Triton when the
                                   tensors are on CUDA, or anywhere under TRITON_INTERPRET=1 (the
                                   tests), the reference otherwise
    decode    kernels | gather     decode attention through the sparse_decode kernels (reading the
                                   blocks in place) or a gather + SDPA; auto: kernels on CUDA
    prefill   flex | chunked       block-sparse prefill through FlexAttention or the chunked
                                   PyTorch path; auto: flex on CUDA (where torch has it)

Set it with `FORECASTKV_BACKEND="kernels=reference,decode=gather"` (the environment), `set_backend(...)`,
or `with use_backend(decode="kernels"): ...` (restores the previous choice); a positional name sets
the kernels part.  Triton is imported guarded: without it every call runs the reference (and forcing
"triton" is an error).

`kernel_set(device)` resolves the setting once, for tensors on one device type, into a `KernelSet`:
the chosen kernel functions and the decode/prefill choices.  A model or cache keeps one and calls its
fields; the package-level functions above look theirs up at each call (memoized on the setting), for
direct callers and tests.  The `*_reference`, `*_triton` and `block_gather_copy_engine` variants are
exported too, with the same signatures, for tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import types
from typing import Callable

import torch

from ._common import interpreting, triton_available
from .block_scores import agnostic_scores_reference, agnostic_scores_triton, block_scores_reference, block_scores_triton
from .sparse_decode import (
    sparse_decode_blocks_reference,
    sparse_decode_blocks_triton,
    sparse_decode_slots_reference,
    sparse_decode_slots_triton,
)
from .stage1 import stage1_block_scores_triton
from .transfer import (
    block_gather_copy_engine,
    block_gather_reference,
    block_gather_triton,
    row_store_reference,
    row_store_triton,
)

BACKEND_CHOICES = {
    "kernels": ("auto", "triton", "reference"),
    "decode": ("auto", "kernels", "gather"),
    "prefill": ("auto", "flex", "chunked"),
}
BACKENDS = BACKEND_CHOICES["kernels"]
ENV_VAR = "FORECASTKV_BACKEND"
_overrides: dict[str, str] = {}
_override_key: tuple = ()  # _overrides as a hashable snapshot: part of kernel_set's memo key


def _checked(part: str, name, source: str) -> str:
    if part not in BACKEND_CHOICES:
        raise ValueError(f"unknown backend part {part!r} ({source}); the parts are {tuple(BACKEND_CHOICES)}")
    name = (name or "auto").strip().lower()
    if name not in BACKEND_CHOICES[part]:
        raise ValueError(f"unknown {part} backend {name!r} ({source}); choose one of {BACKEND_CHOICES[part]}")
    return name


@functools.lru_cache(maxsize=None)
def _parse_environment(text: str) -> types.MappingProxyType:
    """$FORECASTKV_BACKEND's text as {part: choice}: comma-separated `part=choice` items.  Parsed
    once per distinct text (a bad text raises each time: errors are not memoized)."""
    parts = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        part, sep, name = item.partition("=")
        if not sep:
            raise ValueError(f"${ENV_VAR} item {item!r} is not part=choice (parts: {tuple(BACKEND_CHOICES)})")
        parts[part.strip()] = _checked(part.strip(), name, f"${ENV_VAR}")
    return types.MappingProxyType(parts)


def _environment_text() -> str:
    return os.environ.get(ENV_VAR, "").strip()


def get_backend(part: str = "kernels") -> str:
    """The choice for `part`: `set_backend` / `use_backend`'s if any, else $FORECASTKV_BACKEND's,
    else "auto"."""
    if part not in BACKEND_CHOICES:
        _checked(part, "auto", "get_backend")  # raises, naming the parts
    if part in _overrides:
        return _overrides[part]
    return _parse_environment(_environment_text()).get(part, "auto")


def _replace_overrides(choices: dict[str, str]) -> None:
    global _override_key
    _overrides.clear()
    _overrides.update(choices)
    _override_key = tuple(sorted(_overrides.items()))


_NOT_GIVEN = object()


def set_backend(name=_NOT_GIVEN, **parts: str | None) -> None:
    """Force choices: `set_backend("reference")` (the kernels part), `set_backend(decode="gather")`;
    None for a part (`set_backend(None)`: the kernels part) goes back to the environment's choice."""
    if name is not _NOT_GIVEN:
        parts = {"kernels": name, **parts}
    choices = dict(_overrides)
    for part, choice in parts.items():
        if choice is None:
            _checked(part, "auto", "set_backend")
            choices.pop(part, None)
        else:
            choices[part] = _checked(part, choice, "set_backend")
    _replace_overrides(choices)


@contextlib.contextmanager
def use_backend(name=_NOT_GIVEN, **parts: str):
    """`with use_backend("reference"): ...`, `with use_backend(prefill="flex"): ...`: force choices
    inside the block, restore the previous ones after."""
    previous = dict(_overrides)
    set_backend(name, **parts)
    try:
        yield
    finally:
        _replace_overrides(previous)


@dataclasses.dataclass(frozen=True)
class KernelSet:
    """The kernels and paths for tensors on one device type, chosen once from the backend setting.

    The six kernel fields are the chosen `*_triton` or `*_reference` functions themselves, with
    the signatures of the package-level functions of the same names (`kernels.block_gather`, ...).
        triton                 the kernel fields run Triton (else the PyTorch references)
        stage1                 prefill stage-1 selection runs the fused kernel (`use_stage1_kernel`)
        decode_kernels         decode attention runs the sparse_decode kernels (decode part
                               "kernels", or "auto" on CUDA), else a gather + SDPA
        flex_prefill_allowed   block-sparse prefill may use FlexAttention (prefill part "flex", or
                               "auto" on CUDA; "chunked" refuses); the prefill applies its own
                               fallbacks on top (FlexAttention missing, short calls)
    """

    block_gather: Callable
    row_store: Callable
    sparse_decode_slots: Callable
    sparse_decode_blocks: Callable
    block_scores: Callable
    agnostic_scores: Callable
    triton: bool
    stage1: bool
    decode_kernels: bool
    flex_prefill_allowed: bool


_KERNELS = {  # name: (Triton kernel, reference), one signature each
    "block_gather": (block_gather_triton, block_gather_reference),
    "row_store": (row_store_triton, row_store_reference),
    "sparse_decode_slots": (sparse_decode_slots_triton, sparse_decode_slots_reference),
    "sparse_decode_blocks": (sparse_decode_blocks_triton, sparse_decode_blocks_reference),
    "block_scores": (block_scores_triton, block_scores_reference),
    "agnostic_scores": (agnostic_scores_triton, agnostic_scores_reference),
}


def kernel_set(device: torch.device | str) -> KernelSet:
    """The `KernelSet` for tensors on `device` under the current backend setting (memoized on the
    setting, $TRITON_INTERPRET and the device type).  Raises RuntimeError where "triton" is forced
    but cannot run there."""
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    environ = os.environ  # read inline, not through helpers: a decode step may call this per kernel
    return _kernel_set(device_type, environ.get(ENV_VAR, ""), environ.get("TRITON_INTERPRET", ""), _override_key)


@functools.lru_cache(maxsize=64)
def _kernel_set(device_type: str, environment: str, interpret_flag: str, override_key: tuple) -> KernelSet:
    # interpret_flag is only part of the key: interpreting() reads the same variable
    choice = {**_parse_environment(environment.strip()), **dict(override_key)}
    backend = choice.get("kernels", "auto")
    triton = _runs_triton(backend, device_type)
    if backend == "auto":  # the fused stage-1 kernel is slow in the interpreter: auto keeps it to CUDA
        stage1 = device_type == "cuda" and triton_available()
    else:
        stage1 = backend == "triton" and triton
    decode, prefill = choice.get("decode", "auto"), choice.get("prefill", "auto")
    return KernelSet(
        **{name: pair[0] if triton else pair[1] for name, pair in _KERNELS.items()},
        triton=triton,
        stage1=stage1,
        decode_kernels=decode == "kernels" or (decode == "auto" and device_type == "cuda"),
        flex_prefill_allowed=prefill == "flex" or (prefill == "auto" and device_type == "cuda"),
    )


def _runs_triton(backend: str, device_type: str) -> bool:
    """Whether kernels for tensors on `device_type` run in Triton under kernels part `backend`."""
    if backend == "reference":
        return False
    runnable = device_type == "cuda" or interpreting()
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("kernel backend 'triton' was forced but triton is not installed")
        if not runnable:
            raise RuntimeError(
                f"kernel backend 'triton' was forced for {device_type} tensors; Triton needs CUDA tensors "
                f"or TRITON_INTERPRET=1 (set before the first kernel launch)"
            )
        return True
    return runnable and triton_available()


def use_triton(device: torch.device | str) -> bool:
    """Whether a kernel whose outputs live on `device` runs in Triton under the current backend."""
    return kernel_set(device).triton


def use_stage1_kernel(device: torch.device | str) -> bool:
    """Whether prefill stage-1 selection runs the fused kernel: on CUDA unless the kernels part
    is "reference"; elsewhere only when it is forced to "triton" (tests, under TRITON_INTERPRET=1).
    Unlike `use_triton`, auto keeps the eager path on the CPU even in the interpreter, where the
    kernel is slow: the model tests stay eager unless they ask for it."""
    return kernel_set(device).stage1


# -- the package-level kernel functions: each looks up its implementation at the call ------------


def block_gather(
    k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host=None, bias_slots=None, num_programs=16,
    check_ids=True, block_table=None, dest_table=None,
):
    return kernel_set(k_slots.device).block_gather(
        k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host, bias_slots, num_programs, check_ids,
        block_table=block_table, dest_table=dest_table,
    )  # fmt: skip


def row_store(k_new, v_new, positions, k_host, v_host, bias_new=None, bias_host=None, block_table=None, check_ids=True):
    return kernel_set(k_new.device).row_store(
        k_new, v_new, positions, k_host, v_host, bias_new, bias_host, block_table=block_table, check_ids=check_ids
    )


def sparse_decode_slots(
    q, k_slots, v_slots, slot_lens, block_size, scale=None, bias_slots=None, out=None, lse=None, check_ids=True
):
    fn = kernel_set(q.device).sparse_decode_slots
    return fn(q, k_slots, v_slots, slot_lens, block_size, scale, bias_slots, out, lse, check_ids)


def sparse_decode_blocks(
    q, k_cache, v_cache, block_ids, lengths, block_size, scale=None, bias=None, out=None, lse=None, check_ids=True
):
    fn = kernel_set(q.device).sparse_decode_blocks
    return fn(q, k_cache, v_cache, block_ids, lengths, block_size, scale, bias, out, lse, check_ids)


def block_scores(
    vectors, ckeys, positions, sparse, n_blocks, kind="query", lag=None, out=None, lse_keys=None, check_ids=True
):
    fn = kernel_set(vectors.device).block_scores
    return fn(vectors, ckeys, positions, sparse, n_blocks, kind, lag, out, lse_keys, check_ids)


def agnostic_scores(pooled_cis, positions, sparse, n_blocks, lag=0, out=None, check_ids=True):
    return kernel_set(pooled_cis.device).agnostic_scores(pooled_cis, positions, sparse, n_blocks, lag, out, check_ids)


block_gather.__doc__ = block_gather_reference.__doc__
row_store.__doc__ = row_store_reference.__doc__
sparse_decode_slots.__doc__ = sparse_decode_slots_reference.__doc__
sparse_decode_blocks.__doc__ = sparse_decode_blocks_reference.__doc__
block_scores.__doc__ = block_scores_reference.__doc__
agnostic_scores.__doc__ = agnostic_scores_reference.__doc__

__all__ = [
    "BACKENDS",
    "BACKEND_CHOICES",
    "KernelSet",
    "agnostic_scores",
    "agnostic_scores_reference",
    "agnostic_scores_triton",
    "block_gather",
    "block_gather_copy_engine",
    "block_gather_reference",
    "block_gather_triton",
    "block_scores",
    "block_scores_reference",
    "block_scores_triton",
    "get_backend",
    "kernel_set",
    "row_store",
    "row_store_reference",
    "row_store_triton",
    "set_backend",
    "sparse_decode_blocks",
    "sparse_decode_blocks_reference",
    "sparse_decode_blocks_triton",
    "sparse_decode_slots",
    "sparse_decode_slots_reference",
    "sparse_decode_slots_triton",
    "stage1_block_scores_triton",
    "use_backend",
    "use_stage1_kernel",
    "use_triton",
]
