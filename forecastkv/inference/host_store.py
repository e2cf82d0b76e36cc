"""`HostKVStore`: one layer's full K/V (and NOSA's CIS) in host memory, indexed by position.

On a machine with CUDA the buffers are page-locked with `cudaHostRegister` at their exact size (the
caching pinned allocator would round each up to a power of two and keep it after the cache is
gone), so the UVA kernels can read and write them from the GPU and copies run asynchronously; on
CPU they are plain memory.  `nbytes()` is what is pinned.  Capacity is the cache's `max_length`
(derived inside `generate()`), else it grows in chunks (`modeling.cache.GROWTH_CHUNK`).

Only the transfer functions touch host tensors: the H2D block gather and staging, and the D2H
write-back.  They run inside `host_transfer()`, a thread-local counter (nearly free) that only
the tests' strict-device harness (tests/strict_device.py) reads: there, host tensors (made by
`allocate_host`, which the harness wraps) raise when any op outside `host_transfer()` touches them.
Every CPU touch of host rows that the GPU may still be writing waits on the store's write event.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch

from .. import kernels
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


def transfer_function(fn):
    """Mark `fn` as a transfer function: it runs inside `host_transfer()`.  Under torch.compile the
    marker is skipped (Dynamo cannot enter a user context manager, and the harness that reads it
    never runs compiled), so a compiled step traces straight through."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        with host_transfer():
            return fn(*args, **kwargs)

    return wrapper


def in_host_transfer() -> bool:
    """Whether this thread is inside `host_transfer()`."""
    return getattr(_transfer_state, "depth", 0) > 0


def _unregister(address: int) -> None:
    """Unpin host memory once nothing reads it: the device may still run a kernel on it."""
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # noqa: BLE001 - interpreter shutdown: the CUDA context may be gone already
        pass


def allocate_host(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor of exactly `shape` (callers write before they read), page-locked
    at its exact size if `pin`, and unpinned when the tensor is freed.  A pinning failure names the
    bytes and what to do.  Every host-store buffer comes from here (the one allocation the
    strict-device harness wraps)."""
    tensor = torch.empty(shape, dtype=dtype)
    if not pin or tensor.numel() == 0:
        return tensor
    nbytes = tensor.numel() * tensor.element_size()
    # cudaHostRegisterPortable (1): pinned for every CUDA context (a device_map over several GPUs)
    error = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 1))
    if error != 0:
        raise MemoryError(
            f"could not pin {nbytes / 2**30:.2f} GiB of host memory for the offloaded KV cache (cudaHostRegister: {error}); "
            f"lower max_length or the batch, raise the locked-memory limit (ulimit -l), or free host memory"
        )
    weakref.finalize(tensor, _unregister, tensor.data_ptr())
    return tensor


class HostKVStore:
    """keys, values [B, capacity, H, d] and cis [B, capacity, H] (or None) on the host.

    Rows past a sequence's stored length hold whatever the memory held (the store is allocated
    uninitialised): readers mask them by length (`device_rows` zeroes them on the way in).
    """

    def __init__(self, batch: int, heads: int, dim: int, dtype: torch.dtype, with_cis: bool, cis_dtype: torch.dtype | None, max_length: int | None, pin: bool,
                 reserved: int | None = None) -> None:
        self.shape = (batch, heads, dim)
        self.reserved = reserved  # rows to allocate at once while they fit (`capacity_for`)
        self.dtype, self.cis_dtype = dtype, cis_dtype
        self.with_cis, self.max_length, self.pin = with_cis, max_length, pin
        self.keys = self.values = self.cis = None
        self.capacity = 0
        self.written = None  # CUDA event after the last asynchronous write from the device

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.keys, self.values, self.cis) if t is not None)

    # -- capacity -----------------------------------------------------------------------------
    def ensure(self, rows: int) -> None:
        """Make room for `rows` positions per sequence (raises past max_length).  With max_length
        known this allocates once; growth (no max_length) copies the stored rows on the CPU,
        after the device's pending writes to them."""
        if rows <= self.capacity:
            return
        capacity = capacity_for(rows, self.max_length, reserved=self.reserved)
        batch, heads, dim = self.shape
        keys = allocate_host((batch, capacity, heads, dim), self.dtype, self.pin)
        values = allocate_host((batch, capacity, heads, dim), self.dtype, self.pin)
        cis = allocate_host((batch, capacity, heads), self.cis_dtype, self.pin) if self.with_cis else None
        if self.capacity:
            self.wait_writes()
            self._copy_stored(keys, values, cis)
        self.keys, self.values, self.cis, self.capacity = keys, values, cis, capacity

    @transfer_function
    def _copy_stored(self, keys: torch.Tensor, values: torch.Tensor, cis: torch.Tensor | None) -> None:
        """Growth: the stored rows into the new, larger buffers (a CPU copy)."""
        keys[:, : self.capacity] = self.keys
        values[:, : self.capacity] = self.values
        if cis is not None:
            cis[:, : self.capacity] = self.cis

    def wait_writes(self) -> None:
        """Block the CPU until the device's writes into these buffers are done (a CPU touch)."""
        if self.written is not None:
            self.written.synchronize()
            self.written = None

    def _record_write(self, device: torch.device) -> None:
        if self.pin and device.type == "cuda":
            self.written = torch.cuda.Event()
            self.written.record(torch.cuda.current_stream(device))

    # -- D2H write-back -----------------------------------------------------------------------
    @transfer_function
    def write_rows(self, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cis: torch.Tensor | None) -> int:
        """A decode step's write-back: row b of keys/values [B, H, d] (cis [B, H]) at position
        positions[b] (device int64 [B], -1 = skip), through the `row_store` kernel (UVA writes into
        pinned memory on CUDA: no host index, no sync).  Returns bytes moved."""
        kernels.row_store(keys.to(self.dtype), values.to(self.dtype), positions, self.keys, self.values,
                          None if cis is None else cis.to(self.cis_dtype), self.cis)
        self._record_write(keys.device)
        moved = keys.numel() * keys.element_size() * 2
        return moved + (0 if cis is None else cis.numel() * cis.element_size())

    @transfer_function
    def write(self, batch_idx: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cis: torch.Tensor | None) -> int:
        """A multi-token call's write-back of scattered rows (a padded prompt, draft tokens):
        keys/values [N, H, d] (any device) at (batch_idx[N], pos[N]).  Reads the indices and rows
        to the host (one sync, outside the decode step).  Returns bytes moved."""
        batch_idx, pos = batch_idx.cpu(), pos.cpu()
        self.keys[batch_idx, pos] = keys.to("cpu", self.dtype)
        self.values[batch_idx, pos] = values.to("cpu", self.dtype)
        moved = keys.numel() * keys.element_size() * 2
        if cis is not None:
            self.cis[batch_idx, pos] = cis.to("cpu", self.cis_dtype)
            moved += cis.numel() * cis.element_size()
        return moved

    @transfer_function
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
        self._record_write(keys.device)
        return moved

    # -- H2D ----------------------------------------------------------------------------------
    @transfer_function
    def device_rows(self, count: int, lengths: torch.Tensor, device: torch.device, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Device copies of positions [0, count) of every sequence in buffers of `rows` (>= count,
        default count) rows: keys, values [B, rows, H, d], cis [B, rows, H] or None.  Rows at or
        past a sequence's length (device lengths [B], <= count) are zeros, not whatever the host
        memory held.  Asynchronous H2D copies from pinned memory."""
        rows = count if rows is None else rows
        pinned = self.pin and torch.device(device).type == "cuda"
        keep = torch.arange(rows, device=lengths.device).view(1, -1) < lengths.view(-1, 1)  # [B, rows]
        out = []
        for host in (self.keys, self.values, self.cis):
            if host is None:
                out.append(None)
                continue
            buffer = torch.empty((host.shape[0], rows, *host.shape[2:]), dtype=host.dtype, device=device)
            if count:
                buffer[:, :count].copy_(host[:, :count], non_blocking=pinned)
            out.append(buffer.masked_fill_(~keep.view(*keep.shape, *([1] * (buffer.dim() - 2))), 0))
        return out[0], out[1], out[2]

    @transfer_function
    def copy_span_to(self, batch: int, start: int, stop: int, targets: tuple, offset: int) -> None:
        """Copy host rows [start, stop) of sequence `batch` into rows offset.. of each target
        (device tensors [B, R, ...], in key / value / cis order, None to skip).  H2D, async."""
        for host, target in zip((self.keys, self.values, self.cis), targets):
            if host is None or target is None or stop <= start:
                continue
            target[batch, offset : offset + stop - start].copy_(host[batch, start:stop], non_blocking=self.pin and target.is_cuda)

    # -- sizes --------------------------------------------------------------------------------
    def row_bytes(self) -> int:
        """Bytes of one position of one sequence, all heads (K + V + CIS)."""
        batch, heads, dim = self.shape
        size = heads * dim * 2 * torch.empty((), dtype=self.dtype).element_size()
        if self.with_cis:
            size += heads * torch.empty((), dtype=self.cis_dtype).element_size()
        return size

    def nbytes(self) -> int:
        """Bytes allocated (and, with CUDA, pinned) for this store: exactly its buffers."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors())
