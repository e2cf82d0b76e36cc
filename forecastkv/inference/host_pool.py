"""The offload runtime's manager: who holds each physical block of the host tier, which block holds
each position, and which blocks a decode step must load (the manager half of the split vLLM v1's
kv_offload draws; the worker half, `host_store`'s buffers and `worker.TransferWorker`, moves the bytes).

* `BlockAllocator` (`host_store.HostBlockPool.allocator`, one per layer, shared by every cache
  built on it: forks, a batch over one prefix, a ContextStore): a reference count per physical
  block and a heap of the free ones.  A full block is immutable, so caches share it; a block is
  free again when its last holder lets go.
* `BlockTables` (`host_store.HostKVStore.blocks`, one per cache and layer): a block table per
  sequence (logical block -> physical block, vLLM's layout), on the host (lists, what multi-token
  calls and forks decide by) and on the device (`block_table` [B, NB], what the decode step's
  kernels read: the block gather and the row write-back go through it, no host sync).  A sequence
  writes only its own blocks: forking copies its tail block, and a crop that makes a shared block
  writable again copies it first (copy on write).

A sequence's capacity is the cache's `max_length` (derived inside `generate()`), else it grows in
chunks (`modeling.cache.GROWTH_CHUNK`); its blocks up to the capacity are assigned when the
capacity is set (so a decode step never changes the table), and the pool grows by exactly the
blocks assigned.

* `plan_loads` (`generate()`'s offloaded layers and vLLM's `ForecastLookaheadConnector` alike):
  a selection diffed against a slot map (`diff_block_map`), giving the transfer spec (`LoadSpec`:
  the blocks to load into which slots, and the wanted / hit / missed counts) that a worker runs.

Nothing here reads or writes a host buffer: these classes are members of the buffers' owners, not
their bases.  The buffers and every copy are `host_store`'s, handed in as two callables: the pool's
`grow` (buffers for more blocks) and `copy_block` (copy on write).
"""

from __future__ import annotations

import collections
import heapq
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..modeling.cache import capacity_for


class BlockAllocator:
    """Reference counts of a pool's P physical blocks (ids 0..P-1, P = `capacity`) and a min-heap of
    the free ones: fresh blocks come out in ascending order (long contiguous runs).  The pool grows
    by exactly the blocks asked for (`reserve`), after `grow(capacity)`, the buffers' owner's
    callable, has made room for them (it keeps the `capacity` blocks stored so far)."""

    def __init__(self, grow: Callable[[int], None]) -> None:
        self.grow = grow
        self.refs: list[int] = []  # holders per physical block (0 = free)
        self._free: list[int] = []  # a min-heap of the free block ids

    @property
    def capacity(self) -> int:
        """P: physical blocks allocated."""
        return len(self.refs)

    def free_blocks(self) -> int:
        return len(self._free)

    def used_blocks(self) -> int:
        return self.capacity - len(self._free)

    def refcount(self, block: int) -> int:
        """Holders of physical block `block` (0 = free)."""
        self.check_ids([block])
        return self.refs[block]

    def reserve(self, free: int) -> None:
        """Grow the pool (exactly) until `free` blocks are free: the buffers first (they copy the
        stored blocks), then the new ids, free."""
        missing = free - len(self._free)
        if missing <= 0:
            return
        old, capacity = self.capacity, self.capacity + missing
        self.grow(capacity)
        self.refs.extend([0] * missing)
        for block in range(old, capacity):
            heapq.heappush(self._free, block)

    def allocate(self, count: int) -> list[int]:
        """`count` free blocks (lowest ids first), each with one holder: the caller."""
        self.reserve(count)
        blocks = [heapq.heappop(self._free) for _ in range(count)]
        for block in blocks:
            self.refs[block] = 1
        return blocks

    def retain(self, blocks) -> None:
        """One more holder for each of `blocks` (allocated ones)."""
        blocks = [int(b) for b in blocks]
        self.check_ids(blocks)
        for block in blocks:
            if self.refs[block] <= 0:
                raise ValueError(f"block {block} is free; only an allocated block can be retained")
        for block in blocks:
            self.refs[block] += 1

    def release(self, blocks) -> None:
        """One holder fewer for each of `blocks`; a block with none left is free again."""
        blocks = [int(b) for b in blocks]
        self.check_ids(blocks)
        for block, count in collections.Counter(blocks).items():
            if self.refs[block] < count:
                raise ValueError(
                    f"block {block} is already free"
                    if self.refs[block] == 0
                    else f"block {block} has {self.refs[block]} holders, fewer than the {count} releases asked"
                )
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                heapq.heappush(self._free, block)

    def release_tables(self, tables: list[list[int]]) -> None:
        """A holder's finalizer: release every block named in `tables` (lists of ids, -1 = none)."""
        held = [block for table in tables for block in table if block >= 0]
        if held:
            self.release(held)
        for table in tables:
            table.clear()

    def check_ids(self, blocks) -> None:
        for block in blocks:
            if not 0 <= block < self.capacity:
                raise ValueError(f"block id {block} is outside the pool's {self.capacity} blocks")


class BlockTables:
    """Where a batch's positions live in a pool: sequence b's position t is row t % block of physical
    block tables[b][t // block] (-1: none yet).

    block_table [B, NB] int64 (on `device`, -1 = none) is the same table for the kernels.
    `capacity`: positions per sequence with blocks assigned; `complete`: every logical block below
    it has one (a fast path per step).  `allocator` counts the holders; `copy_block(source,
    target, rows)` (the buffers' owner's) copies a block's first rows for copy on write.  The blocks
    held are released when the tables are freed.
    """

    def __init__(
        self,
        batch: int,
        allocator: BlockAllocator,
        copy_block: Callable[[int, int, int], None],
        block_size: int,
        max_length: int | None,
        reserved: int | None,
        device: torch.device | str,
    ) -> None:
        self.allocator, self.copy_block = allocator, copy_block
        self.block_size, self.max_length, self.device = block_size, max_length, torch.device(device)
        self.reserved = reserved  # rows to allocate at once while they fit (`capacity_for`)
        self.tables: list[list[int]] = [[] for _ in range(batch)]
        self.capacity = 0
        self.complete = True
        self.block_table: torch.Tensor | None = None
        self._finalizer = weakref.finalize(self, allocator.release_tables, self.tables)

    # -- capacity and block assignment --------------------------------------------------------
    def blocks_for(self, rows: int) -> int:
        return -(-rows // self.block_size)

    def ensure(self, rows: int) -> None:
        """Make room for `rows` positions per sequence (raises past max_length): the capacity
        (max_length, reserved or GROWTH_CHUNK multiples, `capacity_for`), and a private block for
        every logical block below it that has none, from the pool (which grows by exactly those)."""
        if rows <= self.capacity and self.complete:
            return
        if rows > self.capacity:
            self.capacity = capacity_for(rows, self.max_length, reserved=self.reserved)
        self._assign(self.blocks_for(self.capacity))

    def _assign(self, count: int) -> None:
        """Blocks for logical blocks [0, count) of every sequence; the device table follows."""
        width = max(count, *(len(table) for table in self.tables)) if self.tables else count
        for table in self.tables:
            table.extend([-1] * (width - len(table)))
        missing = [(b, i) for b, table in enumerate(self.tables) for i in range(count) if table[i] < 0]
        for (b, i), block in zip(missing, self.allocator.allocate(len(missing))):
            self.tables[b][i] = block
        self.complete = True
        self._push_table()

    def _push_table(self) -> None:
        """The host tables to the device table (in place while its shape holds: a fixed address)."""
        width = max((len(table) for table in self.tables), default=0)
        rows = [table + [-1] * (width - len(table)) for table in self.tables]
        host = torch.tensor(rows, dtype=torch.long).view(len(self.tables), width)
        if self.block_table is not None and self.block_table.shape == host.shape:
            self.block_table.copy_(host)
        else:
            self.block_table = host.to(self.device)

    # -- sharing ------------------------------------------------------------------------------
    def forked(self, lengths: list[int], repeats: int = 1) -> BlockTables:
        """New tables over the same pool with each sequence b (lengths[b] positions stored)
        repeated `repeats` times (sequence b*repeats + j): its full blocks shared (one more
        holder each), its partial tail block copied; blocks past the tail are assigned at the
        next `ensure`.  Neither side's later writes reach the other."""
        settings = (self.block_size, self.max_length, self.reserved, self.device)
        other = BlockTables(len(self.tables) * repeats, self.allocator, self.copy_block, *settings)
        for b, length in enumerate(lengths):
            full, partial = divmod(length, self.block_size)
            shared = self.tables[b][:full]
            for j in range(repeats):
                table = other.tables[b * repeats + j]
                self.allocator.retain(shared)
                table.extend(shared)
                if partial:
                    (copy,) = self.allocator.allocate(1)
                    self.copy_block(self.tables[b][full], copy, partial)
                    table.append(copy)
        other.capacity = max(lengths, default=0)  # recomputed (max_length / reserved) at the next ensure
        other.complete = False
        other._push_table()
        return other

    def adopt(self, batch: int, blocks: list[int], length: int) -> None:
        """Sequence `batch` (holding nothing yet) holds `length` positions stored in the pool's
        `blocks` (ceil(length / block) of them, in order): one more holder for each full one, a
        copy of a partial last one (it will be written).  The blocks stay their owner's too."""
        full, partial = divmod(length, self.block_size)
        if len(blocks) != full + (1 if partial else 0):
            needed = full + (1 if partial else 0)
            raise ValueError(
                f"{length} positions in blocks of {self.block_size} need {needed} blocks, got {len(blocks)}"
            )
        if any(block >= 0 for block in self.tables[batch]):
            raise ValueError(f"sequence {batch} holds blocks already; adopt() fills an empty sequence")
        self.allocator.retain(blocks[:full])
        table = list(blocks[:full])
        if partial:
            (copy,) = self.allocator.allocate(1)
            self.copy_block(blocks[full], copy, partial)
            table.append(copy)
        self.tables[batch][:] = table
        self.capacity = max(self.capacity, length)
        self.complete = False
        self._push_table()

    def make_writable(self, lengths: list[int]) -> None:
        """After a crop to lengths[b] positions: every block a sequence will write again (its tail
        block and those past it) becomes private: a shared tail is copied, shared blocks past it
        are let go (assigned afresh at the next `ensure`)."""
        changed = False
        for table, length in zip(self.tables, lengths):
            full, partial = divmod(length, self.block_size)
            for i in range(full, len(table)):
                block = table[i]
                if block < 0 or self.allocator.refs[block] == 1:
                    continue
                if i == full and partial:
                    (copy,) = self.allocator.allocate(1)
                    self.copy_block(block, copy, partial)
                    table[i] = copy
                else:
                    table[i] = -1
                self.allocator.release([block])
                changed = True
        if changed:
            self.complete = False
            self._push_table()

    def sequence_blocks(self, batch: int, length: int | None = None) -> list[int]:
        """Physical ids of sequence `batch`'s logical blocks (the first ceil(length / block) of
        them if `length` is given: its stored blocks).  Read them with the pool's `block(id)`."""
        table = self.tables[batch]
        return list(table if length is None else table[: self.blocks_for(length)])

    def distinct_blocks(self) -> set[int]:
        """Physical blocks these tables hold (each counted once)."""
        return {block for table in self.tables for block in table if block >= 0}

    # -- where positions live -----------------------------------------------------------------
    def runs(self, batch: int, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Positions [start, stop) of sequence `batch` as contiguous runs of pool rows:
        (first position, end position, first flat row of the pool), unassigned blocks skipped."""
        runs: list[list[int]] = []
        table, size = self.tables[batch], self.block_size
        pos = start
        while pos < stop:
            index = pos // size
            end = min(stop, (index + 1) * size)
            block = table[index] if index < len(table) else -1
            if block >= 0:
                row = block * size + pos % size
                if runs and runs[-1][1] == pos and runs[-1][2] + (pos - runs[-1][0]) == row:
                    runs[-1][1] = end
                else:
                    runs.append([pos, end, row])
            pos = end
        return [tuple(run) for run in runs]

    def flat_rows(self, batch_idx: list[int], pos: list[int]) -> torch.Tensor:
        """Flat pool rows [N] int64 (host) of positions pos[n] of sequences batch_idx[n]."""
        size = self.block_size
        rows = [self.tables[b][p // size] * size + p % size for b, p in zip(batch_idx, pos)]
        return torch.tensor(rows, dtype=torch.long)


# -- which blocks a decode step loads -------------------------------------------------------------


@dataclass
class LoadSpec:
    """A transfer spec: what a worker loads for one layer's decode plan.  block_map [B, H, M]: the slot
    map after the step; load_ids [B, H, M]: the logical block to fetch into each slot (-1 nothing);
    slot_of [B, H, K]: the slot serving each wanted block (-1 none); counts: device int64 [3], the
    complete blocks wanted, found in the map (hits) and fetched (misses), summed over the batch."""

    block_map: torch.Tensor
    load_ids: torch.Tensor
    slot_of: torch.Tensor
    counts: torch.Tensor


def complete_wanted(selection: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """selection [B, H, K] with -1 for every block not complete among lengths [B] stored positions:
    what a host tier can load (the block being written is served from the device)."""
    complete = torch.div(lengths, block_size, rounding_mode="floor")
    return selection.masked_fill((selection < 0) | (selection >= complete.view(-1, 1, 1)), -1)


def plan_loads(block_map: torch.Tensor, selection: torch.Tensor, lengths: torch.Tensor, block_size: int) -> LoadSpec:
    """The `LoadSpec` of selection [B, H, K] against slot map block_map [B, H, M] for sequences of
    lengths [B] (device tensors: no host read)."""
    wanted = complete_wanted(selection, lengths, block_size)
    new_map, load_ids, slot_of, hits, misses = diff_block_map(block_map, wanted)
    return LoadSpec(new_map, load_ids, slot_of, torch.stack([(wanted >= 0).sum(), hits.sum(), misses.sum()]))


def diff_block_map(block_map: torch.Tensor, wanted: torch.Tensor):
    """Hits keep their slots; misses fill free slots, empty ones first, then the lowest-numbered
    slots whose block is no longer wanted.  A stale block stays mapped (and can hit again) until
    its slot is reused, so ties always go to blocks already resident.

    block_map [B, H, M] int64 (-1 = empty), wanted [B, H, K] int64 (-1 = none; distinct ids per row,
    at most M valid).  Returns (new_map [B, H, M], load_ids [B, H, M] (host block per slot to fetch,
    -1 = nothing), slot_of [B, H, K] (the slot serving each wanted block, -1 for none),
    hits [B, H], misses [B, H]).
    """
    slots = block_map.shape[-1]
    valid = wanted >= 0
    same = (
        (block_map.unsqueeze(-1) == wanted.unsqueeze(-2)) & valid.unsqueeze(-2) & (block_map >= 0).unsqueeze(-1)
    )  # [B, H, M, K]
    kept = same.any(dim=-1)
    hit = same.any(dim=-2)
    miss = valid & ~hit
    order_key = torch.arange(slots, device=block_map.device) + torch.where(block_map < 0, 0, slots)
    order_key = order_key.masked_fill(kept, 3 * slots)
    free_order = order_key.argsort(dim=-1)  # free slots first
    rank = (miss.long().cumsum(dim=-1) - 1).clamp(min=0)
    target = torch.gather(free_order, -1, rank)  # [B, H, K]
    scatter_at = torch.where(miss, target, slots)
    load_ids = torch.full((*block_map.shape[:-1], slots + 1), -1, dtype=block_map.dtype, device=block_map.device)
    load_ids.scatter_(-1, scatter_at, torch.where(miss, wanted, -1))
    load_ids = load_ids[..., :slots]
    new_map = torch.where(load_ids >= 0, load_ids, block_map)
    hit_slot = (same.long() * torch.arange(slots, device=block_map.device).view(-1, 1)).sum(dim=-2)
    slot_of = torch.where(hit, hit_slot, torch.where(miss, target, -1))
    return new_map, load_ids, slot_of, hit.sum(dim=-1), miss.sum(dim=-1)
