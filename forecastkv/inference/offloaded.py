"""`OffloadedSparseCache`: full KV in (pinned) host memory, only the selected blocks on the device.

Per offloaded layer (the README's "Offloaded runtime"):

* a `HostKVStore` holds every position's K/V (and NOSA's CIS) in blocks of a shared, paged
  `HostBlockPool` through a block table; new tokens are written through to it (a decode step's row
  by the `row_store` kernel through the device block table, straight into pinned memory);
* a device slot buffer [B, (M + 1) * bs, H, d] holds M = budget regular slots (complete blocks)
  and one tail slot (the block being written), with a block map [B, H, M], and a ring of the
  latest rows from which a decode step pools the compression windows it completes;
* `plan(selection)` diffs the selection against the map (`slots.diff_block_map`) and returns the
  step's `Plan`: hits stay, misses are fetched into free slots by the block gather, at once (sync
  modes) or on a side stream (forecast-offload, CUDA); `blocks(plan)` waits for this layer's fetch
  only and reads the slots;
* a multi-token call (prefill, draft verification) stages one layer's KV on the device for the
  chunked attention and drops it when the next layer stages, so peak device memory is one layer's
  KV plus the slots;
* compressed keys (and NOSA's pooled CIS) stay on the device: they are what selection scores.

`fork()` / `copy.deepcopy` / `fork_batch(n)` make independent caches (or one batch of n per
sequence) that share every full host block and copy only the tail blocks and the device state.

A decode step reads nothing back from the device (the host counters of `CallInfo` decide every
number) and touches host memory only through the transfer functions (`transfer_function`: the
gather, the staging, the write-back); tests/strict_device.py checks both on the CPU.

Modes (`MODES`): `no-offload` (every layer resident, the `SparseCache` behaviour), `sparse-offload`
(query selector, fetched at the consuming layer), `forecast-sync` (forecast selector, fetched at the
consuming layer), `forecast-offload` (forecast selector, fetched one layer ahead), `dense-offload`
(every offloaded layer's whole KV copied to the device each step; attention as the model's own).
All modes give the tokens of `SparseCache` with the same selector.  On a machine without CUDA the
"device" tensors are CPU tensors and the side stream is synchronous; the counters are the same.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..modeling.cache import Plan, SparseCache, SparseCacheLayer, gather_blocks, new_rows, put_rows
from ..modeling.step import CallInfo
from .host_store import HostBlockPool, HostKVStore, host_transfer
from .prefetch import make_prefetcher
from .slots import diff_block_map

MODES = ("no-offload", "sparse-offload", "forecast-sync", "forecast-offload", "dense-offload")
MODE_SELECTOR = {"sparse-offload": "query", "forecast-sync": "forecast", "forecast-offload": "forecast"}
MODE_FETCH = {"sparse-offload": "sync", "forecast-sync": "sync", "forecast-offload": "prefetch", "dense-offload": "dense"}


class StepLog:
    """Per decode step of one layer: blocks wanted / hit / missed (device int64 [3], summed over
    sequences and heads: no host sync) and bytes moved that the host already knows."""

    def __init__(self) -> None:
        self.counts: list[torch.Tensor] = []
        self.h2d_extra: list[int] = []  # bytes outside the block gather (dense-offload's whole-layer copy)
        self.selections: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # (selection, complete blocks) if recording

    def add(self, counts: torch.Tensor, h2d_extra: int = 0) -> None:
        self.counts.append(counts)
        self.h2d_extra.append(h2d_extra)

    def table(self) -> torch.Tensor:
        """int64 [steps, 3] on the CPU (one sync)."""
        if not self.counts:
            return torch.zeros(0, 3, dtype=torch.long)
        return torch.stack(self.counts).cpu()


class Staging:
    """The one layer whose KV is staged on the device for a multi-token call."""

    def __init__(self) -> None:
        self.holder = None

    def hold(self, layer) -> None:
        if self.holder is not None and self.holder is not layer:
            self.holder.release_staged()
        self.holder = layer

    def release(self) -> None:
        if self.holder is not None:
            self.holder.release_staged()
        self.holder = None


class ResidentLayer(SparseCacheLayer):
    """A layer kept whole on the device (layer 0, or every layer in no-offload), with the counters."""

    offloaded = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log = StepLog()
        self.d2h_bytes = 0
        self.h2d_other = 0

    def reset(self) -> None:
        super().reset()
        self.log, self.d2h_bytes, self.h2d_other = StepLog(), 0, 0

    def plan(self, selection: torch.Tensor, block_size: int | None = None) -> Plan:
        plan = super().plan(selection, block_size)
        wanted = (selection >= 0).sum()
        plan.counts = torch.stack([wanted, wanted, torch.zeros_like(wanted)])
        if self.log.selections is not None:
            self.log.selections.append((selection.clone(), torch.div(self.lengths, block_size, rounding_mode="floor").clone()))
        return plan

    def device_tensors(self) -> dict:
        names = ("keys", "values", "cis")
        return {name: getattr(self, name) for name in names if getattr(self, name, None) is not None}

    def index_tensors(self) -> dict:
        names = ("ckeys", "coarse_keys", "pooled_cis", "lengths")
        return {name: getattr(self, name) for name in names if getattr(self, name, None) is not None}

    def host_nbytes(self) -> int:
        return 0

    def host_pool(self) -> None:
        return None

    def forked(self, repeats: int = 1) -> "ResidentLayer":
        """`SparseCacheLayer.forked` with fresh counters."""
        other = super().forked(repeats)
        recording = self.log.selections is not None
        other.log, other.d2h_bytes, other.h2d_other = StepLog(), 0, 0
        other.log.selections = [] if recording else None
        return other


class OffloadedLayer(SparseCacheLayer):
    """One offloaded layer: host store, device slots + block map, a ring of the latest rows, the
    fetch of its misses.

    Device state: slots [B, (M + 1) * bs, H, d] (M = budget regular slots, then the tail slot of
    the block being written), block map [B, H, M], and a ring [B, R, H, d] (+ CIS [B, R, H]) of
    the latest R = the widest compression window's rows, from which a decode step pools the
    windows it completes: nothing in a decode step reads the host store, and nothing reads the
    device back (`host_lengths` decides every number).
    """

    offloaded = True

    def __init__(self, kernel_size, kernel_stride, coarse, max_length, *, block_size: int, budget: int, fetch: str, staging: Staging,
                 gather_programs: int | None = None) -> None:
        super().__init__(kernel_size, kernel_stride, coarse=coarse, max_length=max_length)
        self.block_size, self.budget, self.fetch = block_size, budget, fetch
        self.staging = staging
        self.gather_programs = gather_programs
        self.given_pool: HostBlockPool | None = None  # build the host store on this pool (shared), else a new one
        self._fresh()

    def _fresh(self) -> None:
        self.host: HostKVStore | None = None
        self.k_slots = self.v_slots = self.bias_slots = self.block_map = None
        self.k_ring = self.cis_ring = None
        self.staged = None  # (keys, values, cis) on the device during a multi-token call
        self.prefetcher = None
        self.log = StepLog()
        self.d2h_bytes = 0
        self.h2d_other = 0  # staging and tail refills (prefill, verification, crop)
        self.decoding = False  # the current call is a decode step (set by `prepare`)
        self.step_h2d = 0  # this decode step's whole-layer copies (a dense row), booked by `record_plan`

    def reset(self) -> None:
        recording, reserved = self.log.selections is not None, self.reserved
        SparseCacheLayer.__init__(self, *(self.kernel or (None, None)), coarse=self.coarse, max_length=self.max_length)
        self.reserved = reserved
        self._fresh()
        self.log.selections = [] if recording else None

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("OffloadedSparseCache does not support beam search (reorder_cache)")

    # -- allocation ---------------------------------------------------------------------------
    @property
    def ring_rows(self) -> int:
        """R: rows of the widest compression window (kernel, or MiniCPM4.1's coarse one)."""
        if self.kernel is None:
            return 1
        return max(self.kernel[0], self.coarse[0] if self.coarse else 0)

    def _allocate(self, keys: torch.Tensor, cis: torch.Tensor | None) -> None:
        batch, _, heads, dim = keys.shape
        device = keys.device
        pin = device.type == "cuda"
        cis_dtype = None if cis is None else cis.dtype
        self.host = HostKVStore(batch, heads, dim, keys.dtype, cis is not None, cis_dtype, self.max_length, pin, self.reserved,
                                block_size=self.block_size, device=device, pool=self.given_pool)
        rows = (self.budget + 1) * self.block_size
        # NaN, not zeros: a slot row read before it was written shows up at once in tests
        nan = float("nan")
        self.k_slots = torch.full((batch, rows, heads, dim), nan, dtype=keys.dtype, device=device)
        self.v_slots = torch.full((batch, rows, heads, dim), nan, dtype=keys.dtype, device=device)
        self.k_ring = torch.full((batch, self.ring_rows, heads, dim), nan, dtype=keys.dtype, device=device)
        if cis is not None:
            self.bias_slots = torch.full((batch, rows, heads), nan, dtype=cis.dtype, device=device)
            self.cis_ring = torch.full((batch, self.ring_rows, heads), nan, dtype=cis.dtype, device=device)
        self.block_map = torch.full((batch, heads, self.budget), -1, dtype=torch.long, device=device)
        self.prefetcher = make_prefetcher(device, overlap=self.fetch == "prefetch")
        if self.gather_programs is None:
            self.gather_programs = gather_programs_for(device, batch)

    def _check_batch(self, keys: torch.Tensor) -> None:
        if keys.shape[0] != self.k_slots.shape[0]:
            raise ValueError(f"this cache holds a batch of {self.k_slots.shape[0]} sequences, got {keys.shape[0]}; build a new cache per batch")

    # -- append -------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor, cis: torch.Tensor | None, positions: torch.Tensor, step: CallInfo | None = None) -> None:
        """Store new tokens on the host (write-through), in the tail slot and the ring;
        keys/values [B, n, H, d], cis [B, n, H] or None, positions [B, n] (-1 = padding)."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
            self._allocate(keys, cis)
        self._check_batch(keys)
        step = self.step_for(positions) if step is None else step
        if not step.prepared:
            self.prepare(step, positions.shape[1])
        if step.decode:
            self._append_token(keys[:, 0], values[:, 0], None if cis is None else cis[:, 0], positions[:, 0])
        else:
            self._append_tokens(keys, values, cis, positions, step)

    def _make_room(self, step: CallInfo) -> None:
        """Host capacity for the call; for a decode step room for its compression windows, and
        its write-back's bytes (`SparseCacheLayer.prepare`)."""
        self.host.reserved = self.reserved  # a reserve() after the store was made (an attached cache) counts
        self.host.ensure(step.key_count)
        self.decoding = step.decode
        if step.decode:
            self.staging.release()  # a decode step reads no staged layer
            self._grow_windows_for(self.columns)
            self.d2h_bytes += self.host.shape[0] * self.host.row_bytes()

    def _append_token(self, keys: torch.Tensor, values: torch.Tensor, cis: torch.Tensor | None, pos: torch.Tensor) -> None:
        """A decode step: keys/values [B, H, d], cis [B, H] or None, pos [B].  The row goes to the
        host through the `row_store` kernel; the tail slot, the ring and the compressed keys are
        updated on the device from the ring.  Fixed shapes, no host read, no host-store read."""
        self.host.write_rows(pos, keys, values, cis)  # its bytes were counted by `prepare`
        valid, index = pos >= 0, pos.clamp(min=0)
        tail = self.budget * self.block_size + index % self.block_size
        ring = index % self.ring_rows
        for buffer, rows, new in ((self.k_slots, tail, keys), (self.v_slots, tail, values), (self.bias_slots, tail, cis),
                                  (self.k_ring, ring, keys), (self.cis_ring, ring, cis)):
            if new is not None:
                put_rows(buffer, rows, new, valid)
        self._advance(pos, valid, self.k_ring, self.cis_ring, ring=True)

    def _append_tokens(self, keys, values, cis, positions, step: CallInfo) -> None:
        """A multi-token call (prefill, draft verification): the positions were read once
        (`step.positions`); the layer's rows so far are staged on the device for its attention."""
        new = new_rows(self.lengths, positions)
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
        old_lengths, self.lengths = self.lengths, new_lengths
        source = self._stage(rows, max(step.lengths_before, default=0), old_lengths, batch_idx, pos, new_k, new_v, new_cis)
        self._extend_compressed(old_lengths, source[0], source[2])
        self._refill_from(source[0], source[1], source[2])

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

    def _refill_from(self, keys: torch.Tensor, values: torch.Tensor, cis: torch.Tensor | None) -> None:
        """Tail slot and ring from device rows by position [B, S, H, ...] (a staged layer)."""
        batch = torch.arange(keys.shape[0], device=keys.device).view(-1, 1)
        last = (self.lengths - 1).clamp(min=0).view(-1, 1)
        tail_rows = torch.div(last, self.block_size, rounding_mode="floor") * self.block_size + torch.arange(self.block_size, device=keys.device)
        # ring slot r holds the latest position p <= last with p % R == r
        ring_rows = last - (last - torch.arange(self.ring_rows, device=keys.device)) % self.ring_rows
        start = self.budget * self.block_size
        for rows, targets in ((tail_rows, (self.k_slots[:, start:], self.v_slots[:, start:], None if cis is None else self.bias_slots[:, start:])),
                              (ring_rows, (self.k_ring, None, self.cis_ring))):
            keep = (rows >= 0) & (rows < self.lengths.view(-1, 1))
            index = rows.clamp(0, keys.shape[1] - 1)
            for source, target in zip((keys, values, cis), targets):
                if source is not None and target is not None:
                    picked = source[batch, index]
                    target.copy_(picked.masked_fill(~keep.view(*keep.shape, *([1] * (picked.dim() - 2))), 0))

    # -- crop ---------------------------------------------------------------------------------
    def crop(self, tokens: int) -> None:
        before = self.columns
        super().crop(tokens)
        if not self.is_initialized or self.columns == before:
            return
        self.staging.release()
        complete = torch.div(self.lengths, self.block_size, rounding_mode="floor").view(-1, 1, 1)
        self.block_map = self.block_map.masked_fill(self.block_map >= complete, -1)  # now partial blocks
        self.host.make_writable(self.host_lengths)  # copy on write: blocks this cache writes again are its own
        self._refill_from_host()

    def _refill_from_host(self) -> None:
        """Tail slot and ring from the host store after a crop: per sequence, slice copies of its
        tail block and latest rows (host counters give the bounds: no read), the rest zeroed."""
        start, ring = self.budget * self.block_size, self.ring_rows
        slots = (self.k_slots, self.v_slots, self.bias_slots)
        for buffer in (*(None if t is None else t[:, start:] for t in slots), self.k_ring, self.cis_ring):
            if buffer is not None:
                buffer.zero_()  # the tail slot and the ring only: regular slots keep their blocks
        for b, length in enumerate(self.host_lengths):
            if length == 0:
                continue
            first = (length - 1) // self.block_size * self.block_size
            self.host.copy_span_to(b, first, length, slots, start)
            low = max(0, length - ring)
            # positions low..length-1 land at p % R: at most two contiguous runs of the ring
            split = min(length, (low // ring + 1) * ring)
            for lo, hi in ((low, split), (split, length)):
                self.host.copy_span_to(b, lo, hi, (self.k_ring, None, self.cis_ring), lo % ring)
            self.h2d_other += (length - first + length - low) * self.host.row_bytes()

    def capacity_rows(self) -> int:
        return 0 if self.host is None else self.host.capacity

    # -- plan and blocks ----------------------------------------------------------------------
    def plan(self, selection: torch.Tensor, block_size: int | None = None) -> Plan:
        """Diff `selection` [B, H, K] against the block map and return the `Plan`; fetch the misses
        now (prefetch, on the side stream) or when the layer reads them (sync modes).  Blocks not
        complete on the host (the current one) come from the tail slot and are not fetched."""
        self.planned = selection
        complete = torch.div(self.lengths, self.block_size, rounding_mode="floor")
        if self.log.selections is not None:
            self.log.selections.append((selection.clone(), complete.clone()))
        wanted = selection.masked_fill((selection < 0) | (selection >= complete.view(-1, 1, 1)), -1)
        if self.fetch == "dense":
            count = (wanted >= 0).sum()
            self.last_plan = Plan(selection, dense=True, counts=torch.stack([count, torch.zeros_like(count), torch.zeros_like(count)]))
            return self.last_plan
        new_map, load_ids, slot_of, hits, misses = diff_block_map(self.block_map, wanted)
        self.block_map.copy_(new_map)  # in place: a fixed address
        plan = Plan(selection, slot_of=slot_of, load_ids=load_ids, fetched=False, counts=torch.stack([(wanted >= 0).sum(), hits.sum(), misses.sum()]))
        self.last_plan = plan
        if self.fetch == "prefetch":
            plan.done = self.prefetcher.launch(lambda: self._gather(load_ids), keep_alive=(load_ids,))
            plan.fetched = True
        return plan

    def _gather(self, load_ids: torch.Tensor) -> None:
        """Copy the host blocks named by load_ids [B, H, M] into their slots (tail column skipped)
        through the block table: the UVA kernel on CUDA (no sync, skips bad ids), its reference elsewhere."""
        ids = torch.cat([load_ids, load_ids.new_full((*load_ids.shape[:2], 1), -1)], dim=-1).permute(1, 0, 2).contiguous()
        self.host.gather(ids, self.k_slots, self.v_slots, self.bias_slots, self.gather_programs)

    def _ready(self, plan: "Plan | torch.Tensor", block_size: int) -> Plan:
        """`plan` with its blocks in place (waits for this layer's fetch only); a bare selection
        (a direct caller) is planned here."""
        if not isinstance(plan, Plan):
            plan = self.plan(plan, block_size)
        if plan.dense:
            return plan
        if plan.fetched:
            self.prefetcher.wait(plan.done)
        else:
            self._gather(plan.load_ids)
            plan.fetched = True
        return plan

    def _dense_copy(self, plan: Plan):
        """dense-offload: the whole layer copied to the device (counted against this step)."""
        rows = self._longest(None)
        plan.h2d_extra += rows * self.host.row_bytes() * self.host.shape[0]
        return self.host.device_rows(rows, self.lengths, self.k_slots.device)

    def _slot_of_selected(self, plan: Plan) -> torch.Tensor:
        """[B, H, K] slot serving each selected block: its regular slot, the tail slot (M) for the
        block being written, -1 for none."""
        current = torch.div((self.lengths - 1).clamp(min=0), self.block_size, rounding_mode="floor").view(-1, 1, 1)
        tail = (plan.selection == current) & (plan.selection >= 0)
        return torch.where(plan.slot_of >= 0, plan.slot_of, torch.where(tail, self.budget, -1))

    def blocks(self, plan: "Plan | torch.Tensor", block_size: int):
        """The planned blocks from the slots (same layout and values as `SparseCacheLayer.blocks`)."""
        plan = self._ready(plan, block_size)
        if plan.dense:
            return gather_blocks(*self._dense_copy(plan), plan.selection, self.lengths, block_size)
        slot = self._slot_of_selected(plan)
        offsets = torch.arange(block_size, device=slot.device)
        rows = (slot.clamp(min=0).unsqueeze(-1) * block_size + offsets).flatten(-2)
        return gather_blocks(self.k_slots, self.v_slots, self.bias_slots, plan.selection, self.lengths, block_size, rows=rows)

    def decode_attention(self, q: torch.Tensor, plan: "Plan | torch.Tensor", block_size: int) -> torch.Tensor:
        """Decode attention straight over the slots with the `sparse_decode_slots` kernel.
        q [B, Hq, d] -> [B, Hq, d]."""
        plan = self._ready(plan, block_size)
        selection = plan.selection
        if plan.dense:
            keys, values, cis = self._dense_copy(plan)
            return kernels.sparse_decode_blocks(q, keys, values, selection, self.lengths, block_size, bias=cis, check_ids=False)[0]
        slot = self._slot_of_selected(plan)
        batch, heads, _ = selection.shape
        slot_lens = torch.zeros((batch, heads, self.budget + 2), dtype=torch.long, device=slot.device)
        # rows of each selected block that are stored keys (a full block, or the tail's filled part)
        stored = (self.lengths.view(-1, 1, 1) - selection.clamp(min=0) * block_size).clamp(0, block_size)
        slot_lens.scatter_(-1, torch.where(slot >= 0, slot, self.budget + 1), torch.where(slot >= 0, stored, 0))
        return kernels.sparse_decode_slots(q, self.k_slots, self.v_slots, slot_lens[..., : self.budget + 1], block_size, bias_slots=self.bias_slots, check_ids=False)[0]

    # -- full views (multi-token calls, dense rows) -------------------------------------------
    def full(self):
        """K, V [B, S, H, d], CIS or None on the device, S = the longest sequence: the staged copy
        of this call, else (a dense decode row) a fresh copy of the whole layer."""
        rows = self._longest(None)
        if self.staged is None or self.staged[0].shape[1] < rows:
            self.staging.hold(self)
            self.staged = self.host.device_rows(rows, self.lengths, self.k_slots.device)
            copied = rows * self.host.row_bytes() * self.host.shape[0]
            if self.decoding:  # a decode step's dense row (a dense model, or below dense_len): its step's bytes
                self.step_h2d += copied
            else:
                self.h2d_other += copied
        keys, values, cis = self.staged
        return keys[:, :rows], values[:, :rows], None if cis is None else cis[:, :rows], rows

    def record_plan(self) -> None:
        """The step's plan counters into the step log, plus the whole-layer copies of a dense row
        (a step with no plan, e.g. a dense model's, is logged with zero blocks and those bytes)."""
        copied, self.step_h2d = self.step_h2d, 0
        if copied and (self.last_plan is None or self.last_plan.counts is None):
            self.log.add(torch.zeros(3, dtype=torch.long, device=self.k_slots.device), copied)
        elif copied:
            self.last_plan.h2d_extra += copied
        super().record_plan()

    # -- bytes --------------------------------------------------------------------------------
    def device_tensors(self) -> dict:
        tensors = {"k_slots": self.k_slots, "v_slots": self.v_slots, "bias_slots": self.bias_slots, "block_map": self.block_map,
                   "k_ring": self.k_ring, "cis_ring": self.cis_ring}
        if self.staged is not None:
            tensors.update(staged_keys=self.staged[0], staged_values=self.staged[1], staged_cis=self.staged[2])
        return {name: t for name, t in tensors.items() if t is not None}

    def index_tensors(self) -> dict:
        names = ("ckeys", "coarse_keys", "pooled_cis", "lengths")
        return {name: getattr(self, name) for name in names if getattr(self, name, None) is not None}

    def host_nbytes(self) -> int:
        return 0 if self.host is None else self.host.nbytes()

    def host_pool(self) -> HostBlockPool | None:
        """The pool this layer's host blocks live in (None before the first token without a given pool)."""
        return self.given_pool if self.host is None else self.host.pool

    # -- sharing ------------------------------------------------------------------------------
    def attach(self, pool: HostBlockPool, blocks: list[int], length: int, device: torch.device | str) -> None:
        """An empty layer holds one sequence of `length` positions whose rows are in `pool`'s
        `blocks` (ceil(length / block_size) of them, in order; another owner's, e.g. a
        ContextStore's): its block table points at them (one more holder each, a partial last
        block copied), and its device state (compressed keys, pooled CIS, tail slot, ring) is
        built from one staging of those rows on `device`: what a prefill of them would leave."""
        if self.is_initialized:
            raise ValueError("attach() fills an empty layer; this one holds tokens already")
        with host_transfer():
            pool.wait_writes()
            keys, values, cis = (None if t is None else t.unsqueeze(0).to(device) for t in pool.read_rows(blocks, length))
        self.given_pool = pool
        self.lazy_initialization(keys, values)
        self._allocate(keys, cis)
        self.host.adopt(0, blocks, length)
        self.columns, self.host_lengths = length, [length]
        # no `ensure` here: the next call sizes the capacity (generate()'s reserve), so a cache
        # attached to a store's blocks allocates only the private blocks it will write
        old_lengths, self.lengths = self.lengths, torch.full_like(self.lengths, length)
        self.h2d_other += length * self.host.row_bytes()
        self._extend_compressed(old_lengths, keys, cis)
        self._refill_from(keys, values, cis)

    def forked(self, repeats: int = 1) -> "OffloadedLayer":
        """`SparseCacheLayer.forked`: the device state copied (or repeated), the host store forked
        (full blocks shared, tail blocks copied), fresh counters; the caller sets `staging`."""
        other = super().forked(repeats)
        if self.host is not None:
            other.host = self.host.forked(self.host_lengths, repeats)
            other.prefetcher = make_prefetcher(self.k_slots.device, overlap=self.fetch == "prefetch")
        other.staged = None
        other.log = StepLog()
        other.log.selections = None if self.log.selections is None else []
        other.d2h_bytes = other.h2d_other = 0
        return other

    def block_bytes(self) -> int:
        """Bytes one (sequence, head) block moves: K + V (+ CIS) rows of one head."""
        if self.host is None:
            return 0
        return self.block_size * self.host.row_bytes() // self.host.shape[1]


def gather_programs_for(device: torch.device, batch: int) -> int:
    """Persistent programs of the block gather: about one per 8 SMs (16 on an H100/H200, what
    SparDA runs for batch <= 16), twice that above batch 16; 16 where there is no CUDA."""
    device = torch.device(device)
    base = 16
    if device.type == "cuda" and torch.cuda.is_available():
        base = max(1, torch.cuda.get_device_properties(device).multi_processor_count // 8)
    return base if batch <= 16 else 2 * base


def _nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class OffloadedSparseCache(SparseCache):
    """A transformers `Cache` with the full KV on the host and the selected blocks on the device.

    Build it with `OffloadedSparseCache.for_model(model, mode=..., max_length=None)` and pass it to
    `model.generate(ids, cache=cache)` (`past_key_values=` on transformers 5.17).
    """

    def __init__(self, config, mode: str = "forecast-offload", max_length: int | None = None, first_layer_resident: bool = True, record_selections: bool = False,
                 gather_programs: int | None = None, pools: "list[HostBlockPool | None] | None" = None) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown offload mode {mode!r}; choose one of {MODES}")
        if gather_programs is not None and (isinstance(gather_programs, bool) or not isinstance(gather_programs, int) or gather_programs < 1):
            raise ValueError(f"gather_programs must be a positive integer or None (sized from the SM count and batch), got {gather_programs!r}")
        self.gather_programs = gather_programs
        if max_length is not None and (not isinstance(max_length, int) or max_length <= 0):
            raise ValueError(f"max_length must be a positive integer or None, got {max_length!r}")
        sparse = config.sparse
        selector = MODE_SELECTOR.get(mode)
        if selector == "forecast" and not config.forecast_config.enabled:
            raise ValueError(f"mode {mode!r} selects with Forecast heads, but this model has none; load it with forecast={{...}} or use 'sparse-offload'")
        if selector is not None and sparse is None:
            raise ValueError(f"mode {mode!r} needs a sparse model (sparse_config is None); use 'dense-offload' or 'no-offload'")
        self.mode = mode
        self.first_layer_resident = first_layer_resident
        self.staging = Staging()
        self._build = (mode, max_length, first_layer_resident)
        super().__init__(config, max_length=max_length, selector=selector)
        if record_selections:
            for layer in self.layers:
                layer.log.selections = []
        if pools is not None:
            self.use_pools(pools)

    # -- the paged host tier, forks -----------------------------------------------------------
    def use_pools(self, pools: "list[HostBlockPool | None]") -> None:
        """Build each offloaded layer's host store on pools[layer] (one per layer, None for a
        resident layer or to keep a new pool): the blocks live in pools shared with other caches
        (a ContextStore, other forks).  Only before the first token."""
        if len(pools) != len(self.layers):
            raise ValueError(f"pools has {len(pools)} entries, expected one per layer ({len(self.layers)})")
        for idx, (layer, pool) in enumerate(zip(self.layers, pools)):
            if pool is None:
                continue
            if not layer.offloaded:
                raise ValueError(f"layer {idx} is resident in mode {self.mode!r}: it has no host pool (give None)")
            if layer.is_initialized:
                raise ValueError("use_pools() must come before the first token is stored")
            layer.given_pool = pool

    def attach(self, layers: list, length: int) -> None:
        """An empty cache of one sequence holding `length` stored positions, per layer either
        layers[l] = (pool, block ids): an offloaded layer's host blocks, held where they are
        (shared with their owner, `OffloadedLayer.attach`), or layers[l] = (keys, values, cis):
        a resident layer's rows [1, length, H, d] (cis [1, length, H] or None), appended to it.
        Device state goes where each layer's tensors are (the rows' device, or `device` of the
        pool entry: (pool, ids, device))."""
        if len(layers) != len(self.layers):
            raise ValueError(f"attach() takes one entry per layer ({len(self.layers)}), got {len(layers)}")
        for idx, (layer, entry) in enumerate(zip(self.layers, layers)):
            if layer.offloaded:
                if not isinstance(entry[0], HostBlockPool):
                    raise ValueError(f"layer {idx} is offloaded: give (pool, block ids, device), not rows")
                pool, blocks, device = entry
                layer.attach(pool, list(blocks), length, device)
            else:
                keys, values, cis = entry
                if keys.shape[:2] != (1, length):
                    raise ValueError(f"layer {idx} is resident: rows must be [1, {length}, H, d], got {tuple(keys.shape)}")
                layer.append(keys, values, cis, torch.arange(length, device=keys.device).unsqueeze(0))

    def host_pools(self) -> "list[HostBlockPool | None]":
        """Per layer, the `HostBlockPool` its host blocks live in (None: resident, or no token yet)."""
        return [layer.host_pool() for layer in self.layers]

    def _forked(self, repeats: int) -> "OffloadedSparseCache":
        self.staging.release()  # a staged layer is this cache's, and device memory
        other = super()._forked(repeats)
        other.staging = Staging()
        for layer in other.layers:
            if layer.offloaded:
                layer.staging = other.staging
                if self.gather_programs is None and layer.k_slots is not None:
                    layer.gather_programs = gather_programs_for(layer.k_slots.device, layer.k_slots.shape[0])
        return other

    def _make_layer(self, config, sparse, idx: int, max_length: int | None):
        kernel = (sparse.kernel_size, sparse.kernel_stride) if sparse is not None else (None, None)
        coarse = sparse.coarse_kernel if sparse is not None and sparse.lse == "coarse" else None
        mode, _, first_resident = self._build
        if mode == "no-offload" or (idx == 0 and first_resident):
            return ResidentLayer(*kernel, coarse=coarse, max_length=max_length)
        block_size = sparse.block_size if sparse is not None else 64
        budget = sparse.budget_blocks if sparse is not None else 1
        return OffloadedLayer(*kernel, coarse, max_length, block_size=block_size, budget=budget, fetch=MODE_FETCH.get(mode, "sync"), staging=self.staging,
                              gather_programs=self.gather_programs)

    @classmethod
    def for_model(cls, model, mode: str | None = None, max_length: int | None = None, **options) -> "OffloadedSparseCache":
        """A cache for `model`.  mode: one of `MODES`; None picks forecast-offload for a model whose
        selector is forecast, else sparse-offload.  max_length preallocates that many positions per
        sequence (prompt + new tokens); past it the cache raises (None: generate() reserves its own
        length).  options: first_layer_resident (default True), record_selections (default False:
        keep every plan for replay tests), gather_programs (persistent programs of the block gather;
        default: about one per 8 SMs, twice that above batch 16)."""
        config = model.config
        if mode is None:
            sparse = config.sparse
            mode = "forecast-offload" if sparse is not None and sparse.selector == "forecast" else "sparse-offload"
        return cls(config, mode=mode, max_length=max_length, **options)

    # -- bytes and counters -------------------------------------------------------------------
    def device_nbytes(self) -> int:
        """Bytes of the KV tier on the device: slots, block maps, resident layers' KV and any
        staged layer.  Compressed keys are counted apart, in `index_nbytes()`."""
        return sum(_nbytes(layer.device_tensors()) for layer in self.layers)

    def index_nbytes(self) -> int:
        """Bytes of the selection index on the device (compressed keys, pooled CIS, lengths)."""
        return sum(_nbytes(layer.index_tensors()) for layer in self.layers)

    def host_nbytes(self) -> int:
        """Bytes of the host tier: what the pools of the offloaded layers pin (each pool once; a
        pool shared with forks or a ContextStore counts every block in it once, whoever holds it)."""
        pools = {id(pool): pool for pool in self.host_pools() if pool is not None}
        return sum(pool.nbytes() for pool in pools.values())

    def host_blocks(self) -> dict:
        """Physical host blocks this cache holds, all layers: `held` (distinct), `shared` (held by
        another cache or store too), and the pools' `allocated` / `free` blocks."""
        held = shared = 0
        for layer in self.layers:
            if layer.offloaded and layer.host is not None:
                blocks = layer.host.distinct_blocks()
                held += len(blocks)
                shared += sum(1 for block in blocks if layer.host.pool.refs[block] > 1)
        pools = {id(pool): pool for pool in self.host_pools() if pool is not None}.values()
        return {"held": held, "shared": shared, "allocated": sum(p.capacity for p in pools), "free": sum(p.free_blocks() for p in pools)}

    def stats(self) -> dict:
        """Counters per layer and decode step (one host sync here, none while decoding).

        Blocks count (sequence, KV head, block) triples of complete blocks, the tail excluded.
        h2d_bytes_per_step: bytes moved host -> device at each decode step, all layers summed
        (block fetches, or dense-offload's whole-layer copies).  prefill/other H2D (staging for
        multi-token calls, tail refills after crop) and D2H (write-through) are totals.
        """
        steps_per_layer, fetched, hits, wanted, layer_h2d = [], [], [], [], []
        per_step: list[int] = []
        for layer in self.layers:
            table = layer.log.table()
            block_bytes = layer.block_bytes() if layer.offloaded else 0
            step_bytes = (table[:, 2] * block_bytes).tolist() if len(table) else []
            step_bytes = [a + b for a, b in zip(step_bytes, layer.log.h2d_extra)]
            steps_per_layer.append(len(table))
            wanted.append(int(table[:, 0].sum()))
            hits.append(int(table[:, 1].sum()))
            fetched.append(int(table[:, 2].sum()))
            layer_h2d.append(sum(step_bytes))
            for k, value in enumerate(step_bytes):
                if k == len(per_step):
                    per_step.append(0)
                per_step[k] += value
        dense = self.mode == "dense-offload"
        hit_rate = [None if (dense and layer.offloaded) or not w else h / w for layer, h, w in zip(self.layers, hits, wanted)]
        offloaded_wanted = sum(w for layer, w in zip(self.layers, wanted) if layer.offloaded)
        offloaded_hits = sum(h for layer, h in zip(self.layers, hits) if layer.offloaded)
        return {
            "mode": self.mode,
            "decode_steps": max(steps_per_layer, default=0),
            "h2d_bytes_per_step": per_step,
            "h2d_bytes_per_step_mean": sum(per_step) / len(per_step) if per_step else 0.0,
            "h2d_bytes_per_layer": layer_h2d,
            "blocks_wanted_per_layer": wanted,
            "blocks_fetched_per_layer": fetched,
            "hits_per_layer": hits,
            "misses_per_layer": fetched,
            "hit_rate_per_layer": hit_rate,
            "hit_rate": None if dense or not offloaded_wanted else offloaded_hits / offloaded_wanted,
            "h2d_other_bytes": sum(layer.h2d_other for layer in self.layers),
            "d2h_bytes": sum(layer.d2h_bytes for layer in self.layers),
            "device_nbytes": self.device_nbytes(),
            "index_nbytes": self.index_nbytes(),
            "host_nbytes": self.host_nbytes(),
        }
