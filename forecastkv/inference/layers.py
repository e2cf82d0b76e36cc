"""The offloaded runtime's `KVStore`, its decode-step half: what one decode step runs.

* `OffloadedRows`: the full KV of a layer in a `HostKVStore` (pinned host memory, paged blocks),
  and on the device a slot buffer [B, (M + 1) * bs, H, d] of M = budget regular slots (complete
  blocks) and one tail slot (the block being written), a block map [B, H, M], and a ring of the
  latest rows from which a decode step pools the compression windows it completes.  A decode
  step writes its row through to the host (`row_store`), `plan(selection)` has the manager diff the
  selection against the block map (`host_pool.plan_loads`: hits stay, misses go to free slots) and
  the store's `worker.TransferWorker` fetch the misses with the block gather, at once (sync modes)
  or on its side stream (forecast-offload on CUDA); `decode_attention(q, plan)` waits for this
  layer's fetch only and attends over the slots.  Its multi-token half (staging, crop, attach, fork) is
  `inference/staging.py`.
* `RuntimePlan`: the `Plan` of an offloaded store, with its slot map and fetch.

A runtime layer is a `modeling/cache.py:SparseCacheLayer` over this store (or over a counted
`ResidentRows`: layer 0, or every layer in no-offload): the window indexes and the contract are the
layer's, whatever store holds the rows.

Nothing in a decode step reads the host store's rows or the device back: the host counters of
`CallInfo` decide every number, and host memory is touched only by the transfer kernels inside
`host_transfer()` (tests/strict_device.py checks both on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..modeling.cache import CallInfo, Plan, ResidentRows, StepLog, attend_gathered, gather_blocks, put_rows
from .host_pool import complete_wanted, plan_loads
from .host_store import HostBlockPool, HostKVStore
from .staging import OffloadedStaging, Staging
from .worker import TransferWorker, gather_programs_for


@dataclass
class RuntimePlan(Plan):
    """An offloaded store's `Plan`.  slot_of [B, H, K]: the slot serving each selected block (-1 none);
    load_ids [H, B, M + 1]: the host block fetched into each slot (-1 nothing; the gather's layout, the
    tail slot M skipped); done: the side stream's
    event or None; fetched: the fetch was launched; dense: dense-offload (the whole layer is copied
    instead).  `counts` (blocks wanted / hit / missed) and `h2d_extra` are the step log's row."""

    slot_of: torch.Tensor | None = None
    load_ids: torch.Tensor | None = None
    done: object = None
    fetched: bool = True
    dense: bool = False


class OffloadedRows(OffloadedStaging):
    """One offloaded layer's rows: host store, device slots + block map, a ring of the latest rows,
    the fetch of its misses.

    Device state: slots [B, (M + 1) * bs, H, d] (M = budget regular slots, then the tail slot of
    the block being written), block map [B, H, M], and a ring [B, R, H, d] (+ CIS [B, R, H]) of
    the latest R = the widest window index's rows, from which a decode step pools the windows it
    completes: nothing in a decode step reads the host store, and nothing reads the device back
    (the layer's `host_lengths` decide every number).  budget: M; fetch: "prefetch" (a layer ahead,
    on the side stream), "sync" or "dense" (`modes.MODE_FETCH`); staging: the cache's one staged
    layer (`Staging`); given_pool: build the host store on this pool (shared), else a new one.
    """

    offloaded = True
    shared = None

    def __init__(
        self,
        *,
        budget: int,
        fetch: str,
        staging: Staging,
        gather_programs: int | None = None,
        given_pool: HostBlockPool | None = None,
        recording: bool = False,
    ) -> None:
        self.budget, self.fetch = budget, fetch
        self.staging = staging
        self.gather_programs = gather_programs
        self.given_pool = given_pool
        self.ring_rows, self.block_size = 1, None  # set by `allocate`
        self.host: HostKVStore | None = None
        self.k_slots = self.v_slots = self.bias_slots = self.block_map = None
        self.k_ring = self.cis_ring = None
        self.staged = None  # (keys, values, cis) on the device during a multi-token call
        self.worker: TransferWorker | None = None
        self.log = StepLog(recording)
        self.d2h_bytes = 0
        self.h2d_other = 0  # staging and tail refills (prefill, verification, crop)
        self.decoding = False  # the current call is a decode step (set by `make_room`)
        self.step_h2d = 0  # this decode step's whole-layer copies (a dense row), booked by `record`

    def emptied(self) -> "OffloadedRows":
        """The same settings holding nothing (a reset layer's); a recording log keeps recording."""
        return OffloadedRows(
            budget=self.budget,
            fetch=self.fetch,
            staging=self.staging,
            gather_programs=self.gather_programs,
            given_pool=self.given_pool,
            recording=self.log.selections is not None,
        )

    def reorder(self, beam_idx):
        raise NotImplementedError("OffloadedSparseCache does not support beam search (reorder_cache)")

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, layer, keys: torch.Tensor, cis: torch.Tensor | None) -> None:
        """The host store and the device slots, ring and block map, for the batch of the first rows."""
        batch, _, heads, dim = keys.shape
        device, block_size = keys.device, layer.block_size
        self.block_size = block_size
        # R: rows of the widest window an index pools (kernel, MiniCPM4.1's coarse one, Quest's block)
        self.ring_rows = max([window.size for window in layer.windows], default=1)
        self.host = HostKVStore(
            batch, heads, dim, keys.dtype, cis is not None, None if cis is None else cis.dtype, layer.max_length,
            device.type == "cuda", layer.reserved, block_size=block_size, device=device, pool=self.given_pool,
        )  # fmt: skip
        rows = (self.budget + 1) * block_size
        # NaN, not zeros: a slot row read before it was written shows up at once in tests
        nan = float("nan")
        self.k_slots = torch.full((batch, rows, heads, dim), nan, dtype=keys.dtype, device=device)
        self.v_slots = torch.full((batch, rows, heads, dim), nan, dtype=keys.dtype, device=device)
        self.k_ring = torch.full((batch, self.ring_rows, heads, dim), nan, dtype=keys.dtype, device=device)
        if cis is not None:
            self.bias_slots = torch.full((batch, rows, heads), nan, dtype=cis.dtype, device=device)
            self.cis_ring = torch.full((batch, self.ring_rows, heads), nan, dtype=cis.dtype, device=device)
        self.block_map = torch.full((batch, heads, self.budget), -1, dtype=torch.long, device=device)
        self.worker = self.new_worker(layer)
        if self.gather_programs is None:
            self.gather_programs = gather_programs_for(device, batch)

    def new_worker(self, layer) -> TransferWorker:
        """What moves this layer's rows and blocks: its fetches on a CUDA side stream in
        forecast-offload, else at once."""
        return TransferWorker(self.k_slots.device, overlap=self.fetch == "prefetch", ops=layer.kernels)

    # -- append -------------------------------------------------------------------------------
    def append(self, layer, keys, values, cis, positions, step: CallInfo) -> None:
        """Store new tokens on the host (write-through), in the tail slot and the ring;
        keys/values [B, n, H, d], cis [B, n, H] or None, positions [B, n] (-1 = padding).  A
        multi-token call stages the layer (`OffloadedStaging._append_tokens`)."""
        if keys.shape[0] != self.k_slots.shape[0]:
            raise ValueError(
                f"this cache holds a batch of {self.k_slots.shape[0]} sequences, got {keys.shape[0]}; "
                "build a new cache per batch"
            )
        if not step.decode:
            self._append_tokens(layer, keys, values, cis, positions, step)
            return
        # a decode step: the row goes to the host through the `row_store` kernel (its bytes were
        # counted by `make_room`); the tail slot, the ring and the compressed keys are updated on the
        # device from the ring.  Fixed shapes, no host read, no host-store read.
        keys, values, cis, pos = keys[:, 0], values[:, 0], None if cis is None else cis[:, 0], positions[:, 0]
        self.worker.store_rows(self.host.pool, self.host.blocks.block_table, pos, keys, values, cis)
        valid, index = pos >= 0, pos.clamp(min=0)
        tail = self.budget * layer.block_size + index % layer.block_size
        ring = index % self.ring_rows
        put_rows(
            (
                (self.k_slots, tail, keys),
                (self.v_slots, tail, values),
                (self.bias_slots, tail, cis),
                (self.k_ring, ring, keys),
                (self.cis_ring, ring, cis),
            ),
            valid,
        )
        layer.advance(pos, valid, self.k_ring, self.cis_ring, ring=True)

    def make_room(self, layer, step: CallInfo) -> None:
        """Host capacity for the call; for a decode step room for its compression windows, and
        its write-back's bytes."""
        host, blocks = self.host, self.host.blocks
        blocks.reserved = layer.reserved  # a reserve() after the store was made (an attached cache) counts
        if step.key_count > blocks.capacity or not blocks.complete:  # else nothing to assign: no call per step
            blocks.ensure(step.key_count)
        self.decoding = step.decode
        if step.decode:
            if self.staging.holder is not None:
                self.staging.release()  # a decode step reads no staged layer
            layer.grow_windows_for(layer.columns)
            self.d2h_bytes += host.shape[0] * host.row_nbytes

    def capacity_rows(self, layer) -> int:
        return 0 if self.host is None else self.host.blocks.capacity

    # -- plan and blocks ----------------------------------------------------------------------
    def plan(self, layer, selection: torch.Tensor) -> RuntimePlan:
        """The manager diffs `selection` [B, H, K] against the block map (`plan_loads`); the worker
        fetches the misses now (prefetch, on the side stream) or when the layer reads them (sync
        modes).  Blocks not complete on the host (the current one) come from the tail slot and are
        not fetched."""
        lengths, block_size = layer.lengths, layer.block_size
        if self.log.selections is not None:
            self.log.record(selection, lengths, block_size)
        if self.fetch == "dense":
            count = (complete_wanted(selection, lengths, block_size) >= 0).sum()
            zero = torch.zeros_like(count)
            return RuntimePlan(selection, dense=True, counts=torch.stack([count, zero, zero]))
        spec = plan_loads(self.block_map, selection, lengths, block_size)
        self.block_map.copy_(spec.block_map)  # in place: a fixed address
        # the gather's ids [H, B, M + 1]: the blocks per slot, the tail slot (M) skipped
        load_ids = spec.load_ids
        ids = torch.cat([load_ids, load_ids.new_full((*load_ids.shape[:2], 1), -1)], -1).permute(1, 0, 2).contiguous()
        plan = RuntimePlan(selection, slot_of=spec.slot_of, load_ids=ids, fetched=False, counts=spec.counts)
        if self.fetch == "prefetch":
            plan.done = self.worker.gather(*self._gather_args(ids), side=True)
            plan.fetched = True
        return plan

    def _gather_args(self, ids: torch.Tensor) -> tuple:
        """The worker's `gather` of the host blocks ids [H, B, M + 1] into this layer's slots through
        the block table: the UVA kernel on CUDA (no sync, skips bad ids), its reference elsewhere."""
        host = self.host
        return (host.pool, host.blocks.block_table, ids, self.k_slots, self.v_slots, self.bias_slots,
                self.gather_programs)  # fmt: skip

    def _ready(self, plan: RuntimePlan) -> RuntimePlan:
        """`plan` with its blocks in place (waits for this layer's fetch only)."""
        if plan.dense:
            return plan
        if plan.fetched:
            self.worker.wait(plan.done)
        else:
            self.worker.gather(*self._gather_args(plan.load_ids))
            plan.fetched = True
        return plan

    def _dense_copy(self, layer, plan: RuntimePlan):
        """dense-offload: the whole layer copied to the device (counted against this step)."""
        rows = layer._longest(None)
        plan.h2d_extra += rows * self.host.row_bytes() * self.host.shape[0]
        return self.host.device_rows(rows, layer.lengths, self.k_slots.device)

    def _slot_of_selected(self, layer, plan: RuntimePlan) -> torch.Tensor:
        """[B, H, K] slot serving each selected block: its regular slot, the tail slot (M) for the
        block being written, -1 for none."""
        current = torch.div((layer.lengths - 1).clamp(min=0), layer.block_size, rounding_mode="floor").view(-1, 1, 1)
        tail = (plan.selection == current) & (plan.selection >= 0)
        return torch.where(plan.slot_of >= 0, plan.slot_of, torch.where(tail, self.budget, -1))

    def blocks(self, layer, plan: RuntimePlan, with_values: bool = True):
        """The planned blocks from the slots (same layout and values as `ResidentRows.blocks`)."""
        plan = self._ready(plan)
        if plan.dense:
            return gather_blocks(*self._dense_copy(layer, plan), plan.selection, layer.lengths, layer.block_size,
                                 with_values=with_values)
        slot = self._slot_of_selected(layer, plan)
        offsets = torch.arange(layer.block_size, device=slot.device)
        rows = (slot.clamp(min=0).unsqueeze(-1) * layer.block_size + offsets).flatten(-2)
        return gather_blocks(
            self.k_slots, self.v_slots, self.bias_slots, plan.selection, layer.lengths, layer.block_size, rows=rows,
            with_values=with_values,
        )

    def decode_attention(self, layer, q: torch.Tensor, plan: RuntimePlan) -> torch.Tensor:
        """One decode token per sequence, q [B, 1, Hq, d] -> [B, 1, Hq, d], straight over the slots with
        the `sparse_decode_slots` kernel, or a gather of the slots + masked SDPA
        (`kernels.decode_kernels` decides); dense-offload attends the whole layer's copy."""
        ops, lengths = layer.kernels, layer.lengths
        if not ops.decode_kernels:
            return attend_gathered(q, *self.blocks(layer, plan), lengths)
        plan = self._ready(plan)
        selection, block_size = plan.selection, layer.block_size
        if plan.dense:
            keys, values, cis = self._dense_copy(layer, plan)
            return ops.sparse_decode_blocks(
                q[:, 0], keys, values, selection, lengths, block_size, bias=cis, check_ids=False
            )[0].unsqueeze(1)
        slot = self._slot_of_selected(layer, plan)
        batch, heads, _ = selection.shape
        slot_lens = torch.zeros((batch, heads, self.budget + 2), dtype=torch.long, device=slot.device)
        # rows of each selected block that are stored keys (a full block, or the tail's filled part)
        stored = (lengths.view(-1, 1, 1) - selection.clamp(min=0) * block_size).clamp(0, block_size)
        slot_lens.scatter_(-1, torch.where(slot >= 0, slot, self.budget + 1), torch.where(slot >= 0, stored, 0))
        return ops.sparse_decode_slots(
            q[:, 0],
            self.k_slots,
            self.v_slots,
            slot_lens[..., : self.budget + 1],
            block_size,
            bias_slots=self.bias_slots,
            check_ids=False,
        )[0].unsqueeze(1)

    def record(self, layer, plan: RuntimePlan | None) -> None:
        """The step's plan counters into the step log, plus the whole-layer copies of a dense row
        (a step with no plan, e.g. a dense model's, is logged with zero blocks and those bytes)."""
        copied, self.step_h2d = self.step_h2d, 0
        if plan is not None:
            plan.h2d_extra += copied
            self.log.add(plan.counts, plan.h2d_extra)
        elif copied:
            self.log.add(torch.zeros(3, dtype=torch.long, device=self.k_slots.device), copied)

    # -- bytes --------------------------------------------------------------------------------
    def device_tensors(self) -> dict:
        tensors = {
            "k_slots": self.k_slots,
            "v_slots": self.v_slots,
            "bias_slots": self.bias_slots,
            "block_map": self.block_map,
            "k_ring": self.k_ring,
            "cis_ring": self.cis_ring,
        }
        if self.staged is not None:
            tensors.update(staged_keys=self.staged[0], staged_values=self.staged[1], staged_cis=self.staged[2])
        return {name: t for name, t in tensors.items() if t is not None}

    def host_nbytes(self) -> int:
        return 0 if self.host is None else self.host.nbytes()

    def host_pool(self) -> HostBlockPool | None:
        """The pool this layer's host blocks live in (None before the first token without a given pool)."""
        return self.given_pool if self.host is None else self.host.pool

    def block_bytes(self) -> int:
        """Bytes one (sequence, head) block moves: K + V (+ CIS) rows of one head."""
        if self.host is None:
            return 0
        return self.block_size * self.host.row_bytes() // self.host.shape[1]

    missing_bounds = ResidentRows.missing_bounds
