"""The offloaded store's multi-token half: staging, crop, attach and fork (`OffloadedStaging`,
the base of `inference/layers.py:OffloadedRows`).

A multi-token call (prefill, draft verification) stages one layer's KV on the device for the
chunked attention and drops it when the next layer stages (`Staging`), so peak device memory is
one layer's KV plus the slots.  A crop refills the tail slot and the ring from the host; `attach`
builds an empty layer over host blocks another owner holds (a ContextStore's); `forked` copies the
device state and shares every full host block.  `layer`: the `SparseCacheLayer` that owns the store
(its lengths, host counters and window indexes).
"""

from __future__ import annotations

import torch

from ..modeling.cache import CallInfo, new_rows
from .host_store import HostBlockPool
from .worker import TransferWorker


class Staging:
    """The one store whose layer's KV is staged on the device for a multi-token call."""

    def __init__(self) -> None:
        self.holder = None

    def hold(self, store) -> None:
        if self.holder is not None and self.holder is not store:
            self.holder.release_staged()
        self.holder = store

    def release(self) -> None:
        if self.holder is not None:
            self.holder.release_staged()
        self.holder = None


class OffloadedStaging:
    """`OffloadedRows`' methods for multi-token calls, crops, attach and fork (see the module)."""

    def _append_tokens(self, layer, keys, values, cis, positions, step: CallInfo) -> None:
        """A multi-token call (prefill, draft verification): the positions were read once
        (`step.positions`); the layer's rows so far are staged on the device for its attention."""
        new = new_rows(layer.lengths, positions)
        if new is None:
            return
        batch_idx, col_idx, pos, new_lengths, rows = new
        new_k, new_v = keys[batch_idx, col_idx], values[batch_idx, col_idx]
        new_cis = None if cis is None else cis[batch_idx, col_idx]
        host_pos = step.positions
        start = int(host_pos[0, 0])
        if start >= 0 and torch.equal(host_pos, (start + torch.arange(host_pos.shape[1])).expand_as(host_pos)):
            # every sequence stores the same contiguous positions (an unpadded prompt): slice copies
            self.d2h_bytes += self.host.write_span(start, keys, values, cis)
        else:
            self.d2h_bytes += self.host.write(batch_idx, pos, new_k, new_v, new_cis)
        old_lengths, layer.lengths = layer.lengths, new_lengths
        source = self._stage(
            rows, max(step.lengths_before, default=0), old_lengths, batch_idx, pos, new_k, new_v, new_cis
        )
        layer.extend_windows(old_lengths, source[0], source[2])
        self._refill_from(layer, source[0], source[1], source[2])

    def _stage(self, rows, old_rows, old_lengths, batch_idx, pos, new_k, new_v, new_cis):
        """Device copies of positions [0, rows) for the chunked attention of a multi-token call:
        the stored rows from the host (old_lengths [B] of them, <= old_rows), the call's new rows
        (at batch_idx [N], pos [N]) from the device."""
        self.staging.hold(self)
        staged = self.host.device_rows(old_rows, old_lengths, self.k_slots.device, rows=rows)
        for buffer, new in zip(staged, (new_k, new_v, new_cis)):
            if buffer is not None:
                buffer[batch_idx, pos] = new.to(buffer.dtype)
        self.staged = staged
        self.h2d_other += old_rows * self.host.row_bytes() * self.host.shape[0]
        return self.staged

    def release_staged(self) -> None:
        self.staged = None

    def _refill_from(self, layer, keys: torch.Tensor, values: torch.Tensor, cis: torch.Tensor | None) -> None:
        """Tail slot and ring from device rows by position [B, S, H, ...] (a staged layer)."""
        block_size, lengths = layer.block_size, layer.lengths
        batch = torch.arange(keys.shape[0], device=keys.device).view(-1, 1)
        last = (lengths - 1).clamp(min=0).view(-1, 1)
        tail_rows = torch.div(last, block_size, rounding_mode="floor") * block_size + torch.arange(
            block_size, device=keys.device
        )
        # ring slot r holds the latest position p <= last with p % R == r
        ring_rows = last - (last - torch.arange(self.ring_rows, device=keys.device)) % self.ring_rows
        start = self.budget * block_size
        for rows, targets in (
            (
                tail_rows,
                (self.k_slots[:, start:], self.v_slots[:, start:], None if cis is None else self.bias_slots[:, start:]),
            ),
            (ring_rows, (self.k_ring, None, self.cis_ring)),
        ):
            keep = (rows >= 0) & (rows < lengths.view(-1, 1))
            index = rows.clamp(0, keys.shape[1] - 1)
            for source, target in zip((keys, values, cis), targets):
                if source is not None and target is not None:
                    picked = source[batch, index]
                    target.copy_(picked.masked_fill(~keep.view(*keep.shape, *([1] * (picked.dim() - 2))), 0))

    # -- crop ---------------------------------------------------------------------------------
    def crop(self, layer) -> None:
        """After the layer dropped trailing positions: no staged copy, the block map forgets the
        blocks that are partial again, and the tail slot and ring are refilled from the host."""
        self.staging.release()
        complete = torch.div(layer.lengths, layer.block_size, rounding_mode="floor").view(-1, 1, 1)
        self.block_map = self.block_map.masked_fill(self.block_map >= complete, -1)  # now partial blocks
        self.host.blocks.make_writable(layer.host_lengths)  # copy on write: blocks this cache writes again are its own
        self._refill_from_host(layer)

    def _refill_from_host(self, layer) -> None:
        """Tail slot and ring from the host store after a crop: per sequence, slice copies of its
        tail block and latest rows (host counters give the bounds: no read), the rest zeroed."""
        block_size = layer.block_size
        start, ring = self.budget * block_size, self.ring_rows
        slots = (self.k_slots, self.v_slots, self.bias_slots)
        for buffer in (*(None if t is None else t[:, start:] for t in slots), self.k_ring, self.cis_ring):
            if buffer is not None:
                buffer.zero_()  # the tail slot and the ring only: regular slots keep their blocks
        for b, length in enumerate(layer.host_lengths):
            if length == 0:
                continue
            first = (length - 1) // block_size * block_size
            self.host.copy_span_to(b, first, length, slots, start)
            low = max(0, length - ring)
            # positions low..length-1 land at p % R: at most two contiguous runs of the ring
            split = min(length, (low // ring + 1) * ring)
            for lo, hi in ((low, split), (split, length)):
                self.host.copy_span_to(b, lo, hi, (self.k_ring, None, self.cis_ring), lo % ring)
            self.h2d_other += (length - first + length - low) * self.host.row_bytes()

    # -- full views (multi-token calls, dense rows) -------------------------------------------
    def full(self, layer, rows: int):
        """K, V [B, rows, H, d], CIS or None on the device: the staged copy of this call, else (a
        dense decode row) a fresh copy of the whole layer."""
        if self.staged is None or self.staged[0].shape[1] < rows:
            self.staging.hold(self)
            self.staged = self.host.device_rows(rows, layer.lengths, self.k_slots.device)
            copied = rows * self.host.row_bytes() * self.host.shape[0]
            if self.decoding:  # a decode step's dense row (a dense model, or below dense_len): its step's bytes
                self.step_h2d += copied
            else:
                self.h2d_other += copied
        keys, values, cis = self.staged
        return keys[:, :rows], values[:, :rows], None if cis is None else cis[:, :rows]

    def full_keys(self, layer, rows: int) -> torch.Tensor:
        """The staged keys (`full`: staged once per call)."""
        return self.full(layer, rows)[0]

    def block_source(self, layer) -> None:
        """None: a multi-token call reads the staged copy (`full`)."""
        return None

    # -- sharing ------------------------------------------------------------------------------
    def attach(self, layer, pool: HostBlockPool, blocks: list[int], length: int, device: torch.device | str) -> None:
        """An empty `layer` holds one sequence of `length` positions whose rows are in `pool`'s
        `blocks` (ceil(length / block_size) of them, in order; another owner's, e.g. a
        ContextStore's): its block table points at them (one more holder each, a partial last
        block copied), and its device state (compressed keys, pooled CIS, tail slot, ring) is
        built from one staging of those rows on `device`: what a prefill of them would leave."""
        if layer.is_initialized:
            raise ValueError("attach() fills an empty layer; this one holds tokens already")
        keys, values, cis = TransferWorker(device, overlap=False).read_blocks(pool, blocks, length, device)
        self.given_pool = pool
        layer.lazy_initialization(keys, values)
        self.allocate(layer, keys, cis)
        self.host.blocks.adopt(0, blocks, length)
        layer.columns, layer.host_lengths = length, [length]
        # no `ensure` here: the next call sizes the capacity (generate()'s reserve), so a cache
        # attached to a store's blocks allocates only the private blocks it will write
        old_lengths, layer.lengths = layer.lengths, torch.full_like(layer.lengths, length)
        self.h2d_other += length * self.host.row_bytes()
        layer.extend_windows(old_lengths, keys, cis)
        self._refill_from(layer, keys, values, cis)

    def forked(self, layer, repeats: int = 1):
        """An independent copy: the device state copied (or repeated), the host store forked (full
        blocks shared, tail blocks copied), fresh counters; the caller sets `staging`."""
        other = self.emptied()
        other.ring_rows, other.block_size = self.ring_rows, self.block_size
        for name in ("k_slots", "v_slots", "bias_slots", "block_map", "k_ring", "cis_ring"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(other, name, tensor.repeat_interleave(repeats, dim=0) if repeats > 1 else tensor.clone())
        if self.host is not None:
            other.host = self.host.forked(layer.host_lengths, repeats)
            other.worker = other.new_worker(layer)
        return other
