"""The offload runtime's worker: it executes transfer specs between a host block pool and the device
(the worker half of the split vLLM v1's kv_offload draws; `host_pool` is the manager half, which
decides what moves and holds no buffer).

`TransferWorker` is the one transfer path of both runtimes: `generate()`'s `OffloadedRows` and vLLM's
`ForecastLookaheadConnector` (`serving/page_offload.py`) each hold one, and through it
* store new rows into the pool's pinned buffers with the `row_store` kernel (UVA writes on CUDA, no
  host index, no sync; the pool records the write event that CPU touches wait on);
* gather missed blocks out of the pool with the persistent UVA `block_gather` kernel, into the
  offloaded layer's slots or (`dest_table`) straight into vLLM's pages;
* run a gather on its CUDA side stream when it overlaps (forecast-offload: the Forecast plan of layer
  m starts layer m+1's load) and hand back the event only the consuming layer waits on;
* read and write whole blocks of a pool: what a `ContextStore` (`context/transfer.py`) and a cache
  attached to its blocks (`staging.OffloadedStaging.attach`) move.

On a machine without CUDA the kernels are the PyTorch references (or the interpreter) over the same
buffers and the "side stream" runs each gather at once: the same calls, the same bytes.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from .. import kernels

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



def record_write(pool, device: torch.device) -> None:
    """After an asynchronous device write into `pool` (a `HostBlockPool`): the event that CPU
    touches of its buffers wait on (`HostBlockPool.wait_writes`)."""
    if pool.pin and device.type == "cuda":
        pool.written = torch.cuda.Event()
        pool.written.record(torch.cuda.current_stream(device))


def gather_programs_for(device: torch.device, batch: int) -> int:
    """Persistent programs of the block gather: about one per 8 SMs (16 on an H100/H200, what
    SparDA runs for batch <= 16), twice that above batch 16; 16 where there is no CUDA."""
    device = torch.device(device)
    base = 16
    if device.type == "cuda" and torch.cuda.is_available():
        base = max(1, torch.cuda.get_device_properties(device).multi_processor_count // 8)
    return base if batch <= 16 else 2 * base


class TransferWorker:
    """Executes transfers for tensors on `device` with the kernels of `ops` (a `KernelSet`; default:
    the current backend's for the device).  overlap: run `gather(..., side=True)` on a CUDA side
    stream (only where CUDA exists; elsewhere, and without overlap, it runs at once)."""

    def __init__(self, device: torch.device | str, overlap: bool, ops: kernels.KernelSet | None = None) -> None:
        self.device = torch.device(device)
        self.ops = kernels.kernel_set(self.device) if ops is None else ops
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(device=self.device) if overlap and cuda else None

    # -- D2H --------------------------------------------------------------------------------------
    def store_rows(
        self,
        pool,
        block_table: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        cis: torch.Tensor | None,
    ) -> None:
        """Row n of keys/values [N, H, d] (cis [N, H]) to position positions[n] (device int64 [N], -1
        skips) of sequence n of block_table [N, NB] in `pool` (a `host_store.HostBlockPool`) with
        `row_store` (ids not checked: the kernel skips bad ones)."""
        # inside host_transfer(), entered inline: a decode step's write-back calls no context manager
        state = _transfer_state
        state.depth = getattr(state, "depth", 0) + 1
        try:
            self.ops.row_store(
                keys.to(pool.dtype),
                values.to(pool.dtype),
                positions,
                pool.keys,
                pool.values,
                None if cis is None else cis.to(pool.cis_dtype),
                pool.cis,
                block_table=block_table,
                check_ids=False,
            )
        finally:
            state.depth -= 1
        record_write(pool, keys.device)

    # -- H2D --------------------------------------------------------------------------------------
    def gather(
        self,
        pool,
        block_table: torch.Tensor,
        load_ids: torch.Tensor,
        k_slots: torch.Tensor,
        v_slots: torch.Tensor,
        bias_slots: torch.Tensor | None,
        programs: int,
        dest_table: torch.Tensor | None = None,
        side: bool = False,
    ):
        """The blocks load_ids [H, B, M] (logical ids through block_table [B, NB], -1 skips) of `pool`
        into slots [B, M*block, H, d], or with dest_table into the device pool k_slots
        [Q, block, H, d] (`kernels.block_gather`, ids not checked: the kernel skips bad ones).

        side: run on the side stream, after the work already queued on the current stream (the plan
        that named the blocks), and return the event it records, which only the reader waits on
        (`wait`).  Without a side stream (no CUDA, or no overlap) the gather runs at once: None."""
        stream = self.stream if side else None
        if stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        state = _transfer_state  # host_transfer(), entered inline as in `store_rows`
        state.depth = getattr(state, "depth", 0) + 1
        try:
            with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
                if stream is not None:
                    stream.wait_event(ready)
                    for tensor in (load_ids, block_table, dest_table):  # made on the current stream
                        if tensor is not None:
                            tensor.record_stream(stream)
                self.ops.block_gather(
                    pool.keys,
                    pool.values,
                    load_ids,
                    k_slots,
                    v_slots,
                    pool.block_size,
                    pool.cis,
                    bias_slots,
                    programs,
                    False,
                    block_table=block_table,
                    dest_table=dest_table,
                )
        finally:
            state.depth -= 1
        if stream is None:
            return None
        done = torch.cuda.Event()
        done.record(stream)
        return done

    # -- whole blocks (a context store's, an attached cache's) -----------------------------------------
    def read_blocks(self, pool, blocks: list[int], length: int, device=None) -> tuple:
        """The first `length` rows stored in `pool`'s `blocks` (in order), after the device's pending
        writes into the pool: keys, values [length, H, d], cis [length, H] or None, fresh host tensors,
        or with `device` there as [1, length, ...] (a sequence of one)."""
        with host_transfer():
            pool.wait_writes()
            rows = pool.read_rows(blocks, length)
            if device is None:
                return rows
            return tuple(None if t is None else t.unsqueeze(0).to(device) for t in rows)

    def write_blocks(self, pool, blocks: list[int], rows: tuple) -> None:
        """rows (keys, values [n, H, d], cis [n, H] or None, on any device; n = len(blocks) x block
        size) into `pool`'s `blocks`, one block's rows each, in order."""
        size = pool.block_size
        with host_transfer():
            for position, block in enumerate(blocks):
                for target, source in zip(pool.block(block), rows):
                    if target is not None and source is not None:
                        target.copy_(source[position * size : (position + 1) * size])

    # -- the side stream ------------------------------------------------------------------------------
    def wait(self, handle) -> None:
        """The current stream waits for a gather run on the side stream (`handle`: its event; None:
        nothing to wait for)."""
        if handle is not None:
            torch.cuda.current_stream(self.device).wait_event(handle)
