"""`HostKVStore`: one layer's full K/V (and NOSA's CIS) in host memory, indexed by position.

On a machine with CUDA the buffers are pinned (page-locked), so the UVA gather kernel can read them
from the GPU and copies can run asynchronously; on CPU they are plain memory.  Capacity is the
cache's `max_length` when given, else it grows in fixed chunks (`modeling.cache.GROWTH_CHUNK`).

Only the transfer functions touch host tensors: the H2D block gather and staging, and the D2H
write-back.  They run inside `host_transfer()`, a thread-local counter (nearly free) that only
the tests' strict-device harness (tests/strict_device.py) reads: there, host tensors (made by
`allocate_host`, which the harness wraps) raise when any op outside `host_transfer()` touches them.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ..modeling.cache import capacity_for

_transfer_state = threading.local()


class host_transfer(contextlib.ContextDecorator):
    """`with host_transfer(): ...` (or `@host_transfer()`): the enclosed code is a transfer function,
    allowed to touch host-store tensors.  Re-entrant, per thread; production code never reads it."""

    def __enter__(self) -> "host_transfer":
        _transfer_state.depth = getattr(_transfer_state, "depth", 0) + 1
        return self

    def __exit__(self, *exc) -> bool:
        _transfer_state.depth -= 1
        return False


def in_host_transfer() -> bool:
    """Whether this thread is inside `host_transfer()`."""
    return getattr(_transfer_state, "depth", 0) > 0


def allocate_host(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A zeroed host tensor, pinned if asked; a pinning failure names the bytes and what to do.
    Every host-store buffer comes from here (the one allocation the strict-device harness wraps)."""
    if not pin:
        return torch.zeros(shape, dtype=dtype)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    try:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    except RuntimeError as error:
        raise MemoryError(
            f"could not pin {nbytes / 2**30:.2f} GiB of host memory for the offloaded KV cache ({error}); "
            f"lower max_length or the batch, raise the locked-memory limit (ulimit -l), or free host memory"
        ) from error


class HostKVStore:
    """keys, values [B, capacity, H, d] and cis [B, capacity, H] (or None) on the host."""

    def __init__(self, batch: int, heads: int, dim: int, dtype: torch.dtype, with_cis: bool, cis_dtype: torch.dtype | None, max_length: int | None, pin: bool) -> None:
        self.shape = (batch, heads, dim)
        self.dtype, self.cis_dtype = dtype, cis_dtype
        self.with_cis, self.max_length, self.pin = with_cis, max_length, pin
        self.keys = self.values = self.cis = None
        self.capacity = 0

    def ensure(self, rows: int) -> None:
        """Make room for `rows` positions per sequence (raises past max_length)."""
        if rows <= self.capacity:
            return
        capacity = capacity_for(rows, self.max_length)
        batch, heads, dim = self.shape
        keys = allocate_host((batch, capacity, heads, dim), self.dtype, self.pin)
        values = allocate_host((batch, capacity, heads, dim), self.dtype, self.pin)
        cis = allocate_host((batch, capacity, heads), self.cis_dtype, self.pin) if self.with_cis else None
        if self.capacity:
            with host_transfer():
                keys[:, : self.capacity] = self.keys
                values[:, : self.capacity] = self.values
                if cis is not None:
                    cis[:, : self.capacity] = self.cis
        self.keys, self.values, self.cis, self.capacity = keys, values, cis, capacity

    @host_transfer()
    def write(self, batch_idx: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cis: torch.Tensor | None) -> int:
        """Store rows: keys/values [N, H, d] (any device) at (batch_idx[N], pos[N]).  Returns bytes moved."""
        batch_idx, pos = batch_idx.cpu(), pos.cpu()
        self.keys[batch_idx, pos] = keys.to("cpu", self.dtype)
        self.values[batch_idx, pos] = values.to("cpu", self.dtype)
        moved = keys.numel() * keys.element_size() * 2
        if cis is not None:
            self.cis[batch_idx, pos] = cis.to("cpu", self.cis_dtype)
            moved += cis.numel() * cis.element_size()
        return moved

    @host_transfer()
    def write_span(self, start: int, keys: torch.Tensor, values: torch.Tensor, cis: torch.Tensor | None) -> int:
        """Store keys/values [B, n, H, d] (and cis [B, n, H]) at positions start..start+n-1 of every
        sequence: one slice copy per tensor (a DMA from the device, asynchronous into pinned
        memory, ordered before later work on the same stream).  Returns bytes moved."""
        count = keys.shape[1]
        pinned = self.pin and keys.device.type == "cuda"
        self.keys[:, start : start + count].copy_(keys, non_blocking=pinned)
        self.values[:, start : start + count].copy_(values, non_blocking=pinned)
        moved = keys.numel() * keys.element_size() * 2
        if cis is not None:
            self.cis[:, start : start + count].copy_(cis, non_blocking=pinned)
            moved += cis.numel() * cis.element_size()
        return moved

    @host_transfer()
    def rows(self, count: int):
        """Views of the first `count` positions: keys, values [B, count, H, d], cis or None."""
        cis = None if self.cis is None else self.cis[:, :count]
        return self.keys[:, :count], self.values[:, :count], cis

    def row_bytes(self) -> int:
        """Bytes of one position of one sequence, all heads (K + V + CIS)."""
        batch, heads, dim = self.shape
        size = heads * dim * 2 * torch.empty((), dtype=self.dtype).element_size()
        if self.with_cis:
            size += heads * torch.empty((), dtype=self.cis_dtype).element_size()
        return size

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.cis) if t is not None)
