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

Set it with `FORECASTKV_BACKEND="kernels=reference,decode=gather"` (the environment, read at each
call), `set_backend(...)`, or `with use_backend(decode="kernels"): ...` (restores the previous
choice); a positional name sets the kernels part.  Triton is imported guarded: without it every
call runs the reference (and forcing "triton" is an error).

The `*_reference`, `*_triton` and `block_gather_copy_engine` variants are exported too, with the
same signatures, for tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import os

import torch

from ._common import interpreting, triton_available
from .block_gather import block_gather_copy_engine, block_gather_reference, block_gather_triton
from .block_scores import agnostic_scores_reference, agnostic_scores_triton, block_scores_reference, block_scores_triton
from .row_store import row_store_reference, row_store_triton
from .sparse_decode import (
    sparse_decode_blocks_reference,
    sparse_decode_blocks_triton,
    sparse_decode_slots_reference,
    sparse_decode_slots_triton,
)
from .stage1 import stage1_block_scores_triton

BACKEND_CHOICES = {
    "kernels": ("auto", "triton", "reference"),
    "decode": ("auto", "kernels", "gather"),
    "prefill": ("auto", "flex", "chunked"),
}
BACKENDS = BACKEND_CHOICES["kernels"]
ENV_VAR = "FORECASTKV_BACKEND"
_overrides: dict[str, str] = {}


def _checked(part: str, name, source: str) -> str:
    if part not in BACKEND_CHOICES:
        raise ValueError(f"unknown backend part {part!r} ({source}); the parts are {tuple(BACKEND_CHOICES)}")
    name = (name or "auto").strip().lower()
    if name not in BACKEND_CHOICES[part]:
        raise ValueError(f"unknown {part} backend {name!r} ({source}); choose one of {BACKEND_CHOICES[part]}")
    return name


def _from_environment() -> dict[str, str]:
    """$FORECASTKV_BACKEND as {part: choice}: comma-separated `part=choice` items."""
    text = os.environ.get(ENV_VAR, "").strip()
    parts = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        part, sep, name = item.partition("=")
        if not sep:
            raise ValueError(f"${ENV_VAR} item {item!r} is not part=choice (parts: {tuple(BACKEND_CHOICES)})")
        parts[part.strip()] = _checked(part.strip(), name, f"${ENV_VAR}")
    return parts


def get_backend(part: str = "kernels") -> str:
    """The choice for `part`: `set_backend` / `use_backend`'s if any, else $FORECASTKV_BACKEND's,
    else "auto"."""
    _checked(part, "auto", "get_backend")
    if part in _overrides:
        return _overrides[part]
    return _from_environment().get(part, "auto")


_NOT_GIVEN = object()


def set_backend(name=_NOT_GIVEN, **parts: str | None) -> None:
    """Force choices: `set_backend("reference")` (the kernels part), `set_backend(decode="gather")`;
    None for a part (`set_backend(None)`: the kernels part) goes back to the environment's choice."""
    if name is not _NOT_GIVEN:
        parts = {"kernels": name, **parts}
    for part, choice in parts.items():
        if choice is None:
            _checked(part, "auto", "set_backend")
            _overrides.pop(part, None)
        else:
            _overrides[part] = _checked(part, choice, "set_backend")


@contextlib.contextmanager
def use_backend(name=_NOT_GIVEN, **parts: str):
    """`with use_backend("reference"): ...`, `with use_backend(prefill="flex"): ...`: force choices
    inside the block, restore the previous ones after."""
    previous = dict(_overrides)
    set_backend(name, **parts)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(previous)


def use_triton(device: torch.device | str) -> bool:
    """Whether a kernel whose outputs live on `device` runs in Triton under the current backend."""
    device = torch.device(device)
    backend = get_backend()
    if backend == "reference":
        return False
    runnable = device.type == "cuda" or interpreting()
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("kernel backend 'triton' was forced but triton is not installed")
        if not runnable:
            raise RuntimeError(
                f"kernel backend 'triton' was forced for {device} tensors; Triton needs CUDA tensors "
                f"or TRITON_INTERPRET=1 (set before the first kernel launch)"
            )
        return True
    return runnable and triton_available()


def use_stage1_kernel(device: torch.device | str) -> bool:
    """Whether prefill stage-1 selection runs the fused kernel: on CUDA unless the kernels part
    is "reference"; elsewhere only when it is forced to "triton" (tests, under TRITON_INTERPRET=1).
    Unlike `use_triton`, auto keeps the eager path on the CPU even in the interpreter, where the
    kernel is slow: the model tests stay eager unless they ask for it."""
    device = torch.device(device)
    backend = get_backend()
    if backend == "auto":
        return device.type == "cuda" and triton_available()
    return backend == "triton" and use_triton(device)


def block_gather(k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host=None, bias_slots=None, num_programs=16, check_ids=True, block_table=None):
    fn = block_gather_triton if use_triton(k_slots.device) else block_gather_reference
    return fn(k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host, bias_slots, num_programs, check_ids, block_table=block_table)


def row_store(k_new, v_new, positions, k_host, v_host, bias_new=None, bias_host=None, block_table=None):
    fn = row_store_triton if use_triton(k_new.device) else row_store_reference
    return fn(k_new, v_new, positions, k_host, v_host, bias_new, bias_host, block_table=block_table)


def sparse_decode_slots(q, k_slots, v_slots, slot_lens, block_size, scale=None, bias_slots=None, out=None, lse=None, check_ids=True):
    fn = sparse_decode_slots_triton if use_triton(q.device) else sparse_decode_slots_reference
    return fn(q, k_slots, v_slots, slot_lens, block_size, scale, bias_slots, out, lse, check_ids)


def sparse_decode_blocks(q, k_cache, v_cache, block_ids, lengths, block_size, scale=None, bias=None, out=None, lse=None, check_ids=True):
    fn = sparse_decode_blocks_triton if use_triton(q.device) else sparse_decode_blocks_reference
    return fn(q, k_cache, v_cache, block_ids, lengths, block_size, scale, bias, out, lse, check_ids)


def block_scores(vectors, ckeys, positions, sparse, n_blocks, kind="query", lag=None, out=None, lse_keys=None):
    fn = block_scores_triton if use_triton(vectors.device) else block_scores_reference
    return fn(vectors, ckeys, positions, sparse, n_blocks, kind, lag, out, lse_keys)


def agnostic_scores(pooled_cis, positions, sparse, n_blocks, lag=0, out=None):
    fn = agnostic_scores_triton if use_triton(pooled_cis.device) else agnostic_scores_reference
    return fn(pooled_cis, positions, sparse, n_blocks, lag, out)


block_gather.__doc__ = block_gather_reference.__doc__
row_store.__doc__ = row_store_reference.__doc__
sparse_decode_slots.__doc__ = sparse_decode_slots_reference.__doc__
sparse_decode_blocks.__doc__ = sparse_decode_blocks_reference.__doc__
block_scores.__doc__ = block_scores_reference.__doc__
agnostic_scores.__doc__ = agnostic_scores_reference.__doc__

__all__ = [
    "BACKENDS",
    "BACKEND_CHOICES",
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
