"""The paged host tier's buffers and its multi-token copies (the worker half of the split vLLM v1's
kv_offload draws, with `worker.TransferWorker`; `host_pool` is the manager half: who holds each
block, which block holds each position).

* `HostBlockPool` (per layer) owns the buffers: keys, values [P, block, H, d] and cis [P, block, H]
  in host memory (RAM, never a file on some disk: a store's blocks are read into it when a lookup
  needs them), their growth, and the block copies (copy on write, reads of stored blocks).  Who
  holds which block is its `allocator`'s (`host_pool.BlockAllocator`, the manager's).
* `HostKVStore` (per cache and layer) moves a batch's rows through its `blocks` (a
  `host_pool.BlockTables`, the manager's: which block holds each position) outside a decode
  step: a prompt's span and scattered rows to the host, the H2D staging of a multi-token call and
  a crop's refill.

On a machine with CUDA the pool's buffers are page-locked with `cudaHostRegister` at their exact
size (the caching pinned allocator would round each up to a power of two and keep it after the
cache is gone), so the UVA kernels can read and write them from the GPU and copies run
asynchronously; on CPU they are plain memory.  `nbytes()` is what is pinned.

A decode step's transfers (the row write-back and the block gather) are `worker.TransferWorker`'s;
this module keeps the multi-token copies (staging, spans, scattered rows) and the copies on the
host (growth, copy on write).  Only transfer functions touch host tensors: they run inside
`worker.host_transfer()`, a thread-local counter (nearly free) that only the tests' strict-device
harness (tests/strict_device.py) reads: there, host tensors (made by `allocate_host`, which the
harness wraps in this module) raise when any op outside `host_transfer()` touches them.  Every CPU
touch of host rows that the GPU may still be writing waits on the pool's write event.
"""

from __future__ import annotations

import weakref

import torch

from .host_pool import BlockAllocator, BlockTables
from .worker import record_write, transfer_function


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
            f"could not pin {nbytes / 2**30:.2f} GiB of host memory for the offloaded KV cache "
            f"(cudaHostRegister: {error}); lower max_length or the batch, raise the locked-memory limit "
            f"(ulimit -l), or free host memory"
        )
    weakref.finalize(tensor, _unregister, tensor.data_ptr())
    return tensor


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class HostBlockPool:
    """Physical blocks of one layer's host tier; `allocator` (a `BlockAllocator`) counts their
    holders and hands them out.

    keys, values [P, block_size, H, d] (dtype) and cis [P, block_size, H] (cis_dtype) or None,
    allocated by `allocate_host` (pinned at their exact size if `pin`); P = `capacity` grows by
    exactly the blocks the allocator is asked for (`allocator.reserve`), copying the stored blocks.
    Block ids are indices into dim 0.  Rows of a block past what its holder stored hold whatever
    the memory held.
    """

    def __init__(
        self,
        block_size: int,
        heads: int,
        dim: int,
        dtype: torch.dtype,
        with_cis: bool,
        cis_dtype: torch.dtype | None,
        pin: bool,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.allocator = BlockAllocator(grow=self._grow_buffers)
        self.block_size, self.heads, self.dim = block_size, heads, dim
        self.dtype, self.with_cis, self.cis_dtype, self.pin = dtype, with_cis, cis_dtype if with_cis else None, pin
        self.keys = self.values = self.cis = None
        self.written = None  # CUDA event after the last asynchronous write from the device

    @property
    def capacity(self) -> int:
        """P: physical blocks in the buffers."""
        return self.allocator.capacity

    # -- geometry -----------------------------------------------------------------------------
    def matches(
        self, block_size: int, heads: int, dim: int, dtype: torch.dtype, cis_dtype: torch.dtype | None
    ) -> str | None:
        """None if a layer of this geometry can use the pool, else what differs."""
        mine = dict(
            block_size=self.block_size, heads=self.heads, dim=self.dim, dtype=self.dtype, cis_dtype=self.cis_dtype
        )
        theirs = dict(block_size=block_size, heads=heads, dim=dim, dtype=dtype, cis_dtype=cis_dtype)
        diff = [f"{key}: pool {mine[key]} vs layer {theirs[key]}" for key in mine if mine[key] != theirs[key]]
        return "; ".join(diff) or None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.keys, self.values, self.cis) if t is not None)

    def row_bytes(self) -> int:
        """Bytes of one row of one block, all heads (K + V + CIS)."""
        size = self.heads * self.dim * 2 * _dtype_bytes(self.dtype)
        return size + (self.heads * _dtype_bytes(self.cis_dtype) if self.with_cis else 0)

    def block_nbytes(self) -> int:
        """Bytes of one physical block (K + V + CIS)."""
        return self.block_size * self.row_bytes()

    def nbytes(self) -> int:
        """Bytes allocated (and, with CUDA, pinned) for the pool: exactly its buffers."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors())

    # -- buffers ------------------------------------------------------------------------------
    def _grow_buffers(self, capacity: int) -> None:
        """Buffers of `capacity` blocks from `allocate_host` (this module's name, which the
        strict-device harness rebinds), the stored blocks copied in on the CPU after the device's
        pending writes to them."""
        shape = (capacity, self.block_size, self.heads, self.dim)
        keys = allocate_host(shape, self.dtype, self.pin)
        values = allocate_host(shape, self.dtype, self.pin)
        cis = allocate_host(shape[:3], self.cis_dtype, self.pin) if self.with_cis else None
        if self.capacity:
            self.wait_writes()
            self._copy_stored(keys, values, cis)
        self.keys, self.values, self.cis = keys, values, cis

    @transfer_function
    def _copy_stored(self, keys: torch.Tensor, values: torch.Tensor, cis: torch.Tensor | None) -> None:
        """Growth: the stored blocks into the new, larger buffers (a CPU copy)."""
        old = self.capacity
        keys[:old] = self.keys
        values[:old] = self.values
        if cis is not None:
            cis[:old] = self.cis

    # -- block reads and copies -----------------------------------------------------------------
    def wait_writes(self) -> None:
        """Block the CPU until the device's writes into the pool are done (a CPU touch)."""
        if self.written is not None:
            self.written.synchronize()
            self.written = None

    def block(self, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Views (no copy) of physical block `block`: keys, values [block_size, H, d], cis
        [block_size, H] or None.  Host tensors: touch them inside `host_transfer()`, after
        `wait_writes()`."""
        self.allocator.check_ids([block])
        return self.keys[block], self.values[block], None if self.cis is None else self.cis[block]

    @transfer_function
    def copy_block(self, source: int, target: int, rows: int | None = None) -> None:
        """Rows [0, rows) (default all) of block `source` into block `target` (a CPU copy, after
        the device's pending writes)."""
        self.wait_writes()
        rows = self.block_size if rows is None else rows
        for tensor in self.tensors():
            tensor[target, :rows] = tensor[source, :rows]

    def read_rows(self, blocks: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Copies of the first `length` rows stored in `blocks` (in order): keys, values
        [length, H, d], cis [length, H] or None (fresh host tensors).  Touch inside `host_transfer()`."""
        self.allocator.check_ids(blocks)
        picked = torch.tensor(blocks, dtype=torch.long)
        buffers = (self.keys, self.values, self.cis)
        return tuple(None if t is None else t[picked].flatten(0, 1)[:length] for t in buffers)

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (one of the pool's) as [P * block_size, ...] rows (a view)."""
        return tensor.view(self.capacity * self.block_size, *tensor.shape[2:])


class HostKVStore:
    """One layer of a batch on the paged host tier: sequence b's position t is row t % block of
    physical block blocks.tables[b][t // block] of the pool (`blocks`: a `BlockTables`, which
    assigns, shares and copies on write); this class moves the rows.

    keys, values [P, block, H, d] and cis [P, block, H] (or None) are the pool's buffers.  Rows past
    a sequence's stored length hold whatever the memory held (the pool is allocated
    uninitialised): readers mask them by length (`device_rows` zeroes them on the way in).
    `pool`: build on an existing pool (shared with other caches), else a new one; `blocks`: tables
    over it to adopt (a fork's), else empty ones.
    """

    def __init__(
        self,
        batch: int,
        heads: int,
        dim: int,
        dtype: torch.dtype,
        with_cis: bool,
        cis_dtype: torch.dtype | None,
        max_length: int | None,
        pin: bool,
        reserved: int | None = None,
        block_size: int = 64,
        device: torch.device | str = "cpu",
        pool: HostBlockPool | None = None,
        blocks: BlockTables | None = None,
    ) -> None:
        self.shape = (batch, heads, dim)
        self.dtype, self.cis_dtype = dtype, cis_dtype if with_cis else None
        self.with_cis, self.pin = with_cis, pin
        if pool is None:
            pool = HostBlockPool(block_size, heads, dim, dtype, with_cis, self.cis_dtype, pin)
        problem = pool.matches(block_size, heads, dim, dtype, self.cis_dtype)
        if problem:
            raise ValueError(f"this host block pool holds blocks of another geometry ({problem})")
        self.pool = pool
        if blocks is None:
            blocks = BlockTables(batch, pool.allocator, pool.copy_block, block_size, max_length, reserved, device)
        self.blocks = blocks
        self.row_nbytes = self.row_bytes()  # what a decode step's write-back moves per sequence

    def forked(self, lengths: list[int], repeats: int = 1) -> HostKVStore:
        """A store over the same pool with each sequence b (lengths[b] positions stored) repeated
        `repeats` times: full blocks shared, tails copied (`BlockTables.forked`)."""
        _, heads, dim = self.shape
        tables = self.blocks
        settings = (self.dtype, self.with_cis, self.cis_dtype, tables.max_length, self.pin, tables.reserved)
        forked = tables.forked(lengths, repeats)
        return HostKVStore(
            len(forked.tables), heads, dim, *settings, tables.block_size, tables.device, self.pool, forked
        )

    # -- the pool's buffers -------------------------------------------------------------------
    keys = property(lambda self: self.pool.keys)
    values = property(lambda self: self.pool.values)
    cis = property(lambda self: self.pool.cis)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.pool.tensors()

    def wait_writes(self) -> None:
        self.pool.wait_writes()

    # -- D2H write-back -----------------------------------------------------------------------
    @transfer_function
    def write(
        self,
        batch_idx: torch.Tensor,
        pos: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        cis: torch.Tensor | None,
    ) -> int:
        """A multi-token call's write-back of scattered rows (a padded prompt, draft tokens):
        keys/values [N, H, d] (any device) at (batch_idx[N], pos[N]).  Reads the indices and rows
        to the host (one sync, outside the decode step).  Returns bytes moved."""
        rows = self.blocks.flat_rows(batch_idx.cpu().tolist(), pos.cpu().tolist())
        pool = self.pool
        pool.flat(pool.keys)[rows] = keys.to("cpu", self.dtype)
        pool.flat(pool.values)[rows] = values.to("cpu", self.dtype)
        moved = keys.numel() * keys.element_size() * 2
        if cis is not None:
            pool.flat(pool.cis)[rows] = cis.to("cpu", self.cis_dtype)
            moved += cis.numel() * cis.element_size()
        return moved

    @transfer_function
    def write_span(self, start: int, keys: torch.Tensor, values: torch.Tensor, cis: torch.Tensor | None) -> int:
        """Store keys/values [B, n, H, d] (and cis [B, n, H]) at positions start..start+n-1 of every
        sequence: one slice copy per tensor and contiguous run of blocks (a DMA from the device,
        asynchronous into pinned memory, ordered before later work on the same stream).  Returns
        bytes moved."""
        count = keys.shape[1]
        pinned = self.pin and keys.device.type == "cuda"
        pool = self.pool
        targets = [(pool.flat(pool.keys), keys), (pool.flat(pool.values), values)]
        if cis is not None:
            targets.append((pool.flat(pool.cis), cis))
        for b in range(keys.shape[0]):
            for first, end, row in self.blocks.runs(b, start, start + count):
                for flat, source in targets:
                    flat[row : row + end - first].copy_(source[b, first - start : end - start], non_blocking=pinned)
        moved = keys.numel() * keys.element_size() * 2 + (0 if cis is None else cis.numel() * cis.element_size())
        record_write(pool, keys.device)
        return moved

    # -- H2D ----------------------------------------------------------------------------------
    @transfer_function
    def device_rows(
        self, count: int, lengths: torch.Tensor, device: torch.device, rows: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Device copies of positions [0, count) of every sequence in buffers of `rows` (>= count,
        default count) rows: keys, values [B, rows, H, d], cis [B, rows, H] or None.  Rows at or
        past a sequence's length (device lengths [B], <= count) are zeros, not whatever the host
        memory held.  Asynchronous H2D copies from pinned memory, one per contiguous run."""
        rows = count if rows is None else rows
        pinned = self.pin and torch.device(device).type == "cuda"
        keep = torch.arange(rows, device=lengths.device).view(1, -1) < lengths.view(-1, 1)  # [B, rows]
        batch = len(self.blocks.tables)
        runs = [self.blocks.runs(b, 0, count) for b in range(batch)]
        out = []
        for host in (self.keys, self.values, self.cis):
            if host is None:
                out.append(None)
                continue
            buffer = torch.empty((batch, rows, *host.shape[2:]), dtype=host.dtype, device=device)
            flat = self.pool.flat(host)
            for b, sequence_runs in enumerate(runs):
                for first, end, row in sequence_runs:
                    buffer[b, first:end].copy_(flat[row : row + end - first], non_blocking=pinned)
            out.append(buffer.masked_fill_(~keep.view(*keep.shape, *([1] * (buffer.dim() - 2))), 0))
        return out[0], out[1], out[2]

    @transfer_function
    def copy_span_to(self, batch: int, start: int, stop: int, targets: tuple, offset: int) -> None:
        """Copy host rows [start, stop) of sequence `batch` into rows offset.. of each target
        (device tensors [B, R, ...], in key / value / cis order, None to skip).  H2D, async."""
        for host, target in zip((self.keys, self.values, self.cis), targets):
            if host is None or target is None or stop <= start:
                continue
            flat = self.pool.flat(host)
            for first, end, row in self.blocks.runs(batch, start, stop):
                target[batch, offset + first - start : offset + end - start].copy_(
                    flat[row : row + end - first], non_blocking=self.pin and target.is_cuda
                )

    # -- sizes --------------------------------------------------------------------------------
    def row_bytes(self) -> int:
        """Bytes of one position of one sequence, all heads (K + V + CIS)."""
        return self.pool.row_bytes()

    def nbytes(self) -> int:
        """Bytes allocated (and, with CUDA, pinned) for the pool this store lives in: exactly its
        buffers (shared blocks once, other holders' blocks included)."""
        return self.pool.nbytes()
