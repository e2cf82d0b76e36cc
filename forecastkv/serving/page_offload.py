"""Forecast-offload over an engine's pages: `generate()`'s offload runtime under vLLM's KV pages.

The engine's page pools stand for device memory.  `PageOffload` adds no tier and no copy path of
its own; it runs the runtime's parts over the pages:
* the host tier is one `inference/host_store.py:HostBlockPool` per layer (pinned at its exact size
  on CUDA), one host block per device page with the same id, so the engine's block table addresses
  both;
* every stored row is written through to it by the `inference/worker.py:TransferWorker`'s
  `row_store` (UVA writes on CUDA);
* at a decode step the plan of an offloaded layer (made one layer ahead by the Forecast heads, or
  at the layer by the query selector) goes to the manager (`inference/host_pool.py:plan_loads`)
  against that request's slot map of `budget` blocks per KV head (the HF runtime's policy), and
  the worker loads only the misses, with the persistent UVA `block_gather` straight into the
  pages (`dest_table`), on its side stream on CUDA;
* `wait(layer)` is where the layer's attention starts: the current stream waits for that layer's
  load only, and it records whether the load was requested before it.

Layer 0 (`resident`) stays whole, as in the HF runtime; so do the current block and the last `ring`
rows (the HF runtime's tail slot and ring).

With `evict=True` the pool rows of complete blocks a decode request's slot map does not hold are
overwritten with NaN after each call, so attention that read a block it did not load shows at once
(a test and a CPU stand-in for device memory that is not there; never with prefix caching, whose
shared pages another request may still read whole).

A request's slot maps are filed under the page holding its last stored token: the engine owns
that page alone while the request decodes, so no request id has to cross from the scheduler; a
prefill chunk drops whatever was filed under its pages (left by a request that freed them).  They
live on the device, one row per page ([P + 1, L, H, budget]; the last row a scratch row), and each
call's counts stay there until they are read (`StepBytes`): a decode call reads nothing back to the
host (on CUDA a read would wait for the layers queued before it and stall the side-stream loads).
"""

from __future__ import annotations

import torch

from ..inference.host_pool import plan_loads
from ..inference.host_store import HostBlockPool
from ..inference.worker import TransferWorker, gather_programs_for
from .paged import LayerPages, page_slots


class StepBytes:
    """Per decode call (all layers and requests summed): H2D bytes, and the blocks the offloaded
    layers' plans wanted and found already in their slot maps ((request, KV head, block) triples of
    complete blocks, as the HF runtime's `stats()` counts them); and the order of requests and
    waits: (call, "request" | "wait", layer), calls numbered from 1.

    A call's counts are one device tensor [3] (wanted, hits, bytes) until `per_step`, `wanted` or
    `hits` is read: one host read for every call pending, after the calls, not inside one."""

    def __init__(self) -> None:
        self.events: list[tuple[int, str, int]] = []
        self.calls = 0  # decode calls begun
        self._pending: list[torch.Tensor] = []
        self._read: tuple[list[int], list[int], list[int]] = ([], [], [])  # wanted, hits, bytes

    def add(self, counts: torch.Tensor) -> None:
        """One finished call's counts [3] (wanted, hits, bytes), left on the device."""
        self._pending.append(counts)

    def _taken(self, column: int) -> list[int]:
        if self._pending:
            rows = torch.stack(self._pending).tolist()  # the one host read
            self._pending.clear()
            for records, values in zip(self._read, zip(*rows)):
                records.extend(values)
        return self._read[column]

    @property
    def wanted(self) -> list[int]:
        return self._taken(0)

    @property
    def hits(self) -> list[int]:
        return self._taken(1)

    @property
    def per_step(self) -> list[int]:
        return self._taken(2)

    def clear(self) -> None:
        """Forget every call counted so far (a reader that has taken them: a server's counts stay bounded)."""
        self._pending.clear()
        for records in (*self._read, self.events):
            records.clear()


def host_pool_for(pages: LayerPages) -> HostBlockPool:
    """A host block per page of `pages` (ids equal to the page ids), pinned on CUDA."""
    count, heads, page, dim = pages.keys.shape
    cis_dtype = None if pages.cis is None else pages.cis.dtype
    pin = pages.keys.device.type == "cuda"
    pool = HostBlockPool(page, heads, dim, pages.keys.dtype, pages.cis is not None, cis_dtype, pin)
    pool.allocator.allocate(count)  # ids 0..count-1 in order: host block i mirrors page i
    return pool


class PageOffload:
    """The host tier and the slot maps of `pools` (one `LayerPages` per layer).

    budget: slots per (request, layer, KV head), the HF runtime's `budget_blocks`; block_size: the
    selection block (whole pages); ring: rows kept resident behind the newest token (the widest
    window index)."""

    def __init__(
        self,
        pools: list[LayerPages],
        budget: int,
        block_size: int,
        ring: int,
        resident: tuple[int, ...] = (0,),
        evict: bool = False,
    ) -> None:
        self.pools, self.budget, self.block_size, self.ring = pools, budget, block_size, ring
        self.resident, self.evict = set(resident), evict
        self.host = [None if layer in self.resident else host_pool_for(p) for layer, p in enumerate(pools)]
        device = pools[0].keys.device
        self.worker = TransferWorker(device, overlap=True)
        self.programs = gather_programs_for(device, 1)
        pages, heads = pools[0].keys.shape[:2]
        # the page of a request's last stored token -> its slot maps of every layer; row `pages` is scratch
        self.maps = torch.full((pages + 1, len(pools), heads, budget), -1, dtype=torch.long, device=device)
        # what one layer's plan counts add to the call's (wanted, hits, bytes): its misses' bytes
        self._weights = [torch.tensor([1, 1, self.block_bytes(layer)], device=device) for layer in range(len(pools))]
        self.stats = StepBytes()
        self._requested: dict[int, object] = {}  # layer -> the worker's handle of its load this call
        self._call: torch.Tensor | None = None  # this decode call's counts [3]
        self._keys_before: torch.Tensor | None = None  # this decode call's rows' last pages [B]

    # -- what one call does -----------------------------------------------------------------------
    def begin_decode(self) -> None:
        """A decode call starts: a new step of the byte count."""
        self.stats.calls += 1
        self._call = torch.zeros(3, dtype=torch.long, device=self.maps.device)
        self._requested, self._keys_before = {}, None

    def forget(self, table: torch.Tensor, lengths: torch.Tensor) -> None:
        """A multi-token call (a prefill chunk, or a preempted request's recompute) of rows table [B, nb]
        up to lengths [B]: any slot maps filed under their pages belonged to a request that freed them."""
        lengths = lengths.to(table.device).view(-1, 1)
        used = torch.arange(table.shape[1], device=table.device) < -(-lengths // self.pools[0].page)
        self.maps[torch.where(used, table.long(), self.maps.shape[0] - 1).reshape(-1)] = -1

    def write_through(self, layer: int, page_ids, offsets, keys, values, cis) -> None:
        """The rows keys/values [N, H, d] (cis [N, H]) just stored at pages page_ids [N], offsets [N] of
        `layer`, to the host (the worker's `row_store`; a resident layer keeps none)."""
        pool = self.host[layer]
        if pool is not None:
            self.worker.store_rows(pool, page_ids.view(-1, 1), offsets, keys, values, cis)

    def request(
        self, layer: int, table: torch.Tensor, before: torch.Tensor, lengths: torch.Tensor, selection: torch.Tensor
    ) -> None:
        """Load layer `layer`'s misses for selection [B, H, K] (block ids, -1 none) of the decode rows
        whose block tables are table [B, nb], stored lengths before [B] at the call's start and
        lengths [B] now (the same when planned a layer ahead, one more at the layer itself): complete
        blocks only, as the HF runtime fetches them."""
        self.stats.events.append((self.stats.calls, "request", layer))
        if layer in self.resident:
            self._requested[layer] = None
            return
        if self._keys_before is None:  # the same rows in every layer of the call
            self._keys_before = self._keys(table, before)
        keys = self._keys_before
        spec = plan_loads(self.maps[keys, layer], selection, lengths, self.block_size)
        self.maps[keys, layer] = spec.block_map
        self._requested[layer] = self._load(layer, table, spec.load_ids)
        self._call += spec.counts * self._weights[layer]  # (wanted, hits, misses' bytes), on the device

    def wait(self, layer: int) -> bool:
        """Where `layer`'s decode attention starts (vLLM's `wait_for_layer_load`): the current stream
        waits for this layer's load; returns whether it was requested before this wait."""
        self.stats.events.append((self.stats.calls, "wait", layer))
        if layer not in self._requested:
            return False
        self.worker.wait(self._requested[layer])
        return True

    def end_decode(self, table: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> None:
        """After a decode call of rows table [B, nb] that went from lengths before [B] to after [B]:
        file each row's slot maps under its new last page (the old page's emptied: a full page another
        request may reach through the prefix cache), then (evict) poison what they do not hold."""
        old, new = self._keys(table, before), self._keys(table, after)
        moved = self.maps[old]
        self.maps[old] = -1
        self.maps[new] = moved
        self.stats.add(self._call)
        if self.evict:
            for layer in range(len(self.pools)):
                if layer not in self.resident:
                    self._poison(layer, table, after)

    # -- pieces ---------------------------------------------------------------------------------------
    def block_bytes(self, layer: int) -> int:
        """Bytes of one block of one KV head: K, V and NOSA's CIS rows (`OffloadedRows.block_bytes`)."""
        pool = self.pools[layer]
        row = sum(x.shape[-1] * x.element_size() for x in (pool.keys, pool.values))
        if pool.cis is not None:
            row += pool.cis.element_size()
        return self.block_size * row

    def _keys(self, table: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The page of each row's last stored token [B] (device), where its slot maps are filed."""
        last = (lengths - 1).clamp(min=0).view(-1, 1)
        return page_slots(table, last, self.pools[0].page)[0].view(-1)

    def _load(self, layer: int, table: torch.Tensor, load_ids: torch.Tensor):
        """Launch the load of the blocks load_ids [B, H, M] (-1 nothing) from the host into their pages:
        each block is block_size / page pages, gathered through the block table on both sides (the
        host block of a page has its id).  Returns the worker's handle."""
        per_block = self.block_size // self.pools[0].page
        pages = load_ids.unsqueeze(-1) * per_block + torch.arange(per_block, device=load_ids.device)
        ids = pages.masked_fill(load_ids.unsqueeze(-1) < 0, -1).flatten(-2).permute(1, 0, 2).contiguous()
        device = self.pools[layer]
        # the pages are [P, H, page, ...]: the kernel reads them as [P, page, H, ...] through strides
        targets = [None if t is None else t.transpose(1, 2) for t in (device.keys, device.values, device.cis)]
        return self.worker.gather(self.host[layer], table, ids, *targets, self.programs, dest_table=table, side=True)

    def _block_rows(self, table, rows, heads, blocks):
        """(page ids, heads, offsets) [M, bs] of blocks [M] of sequences rows [M] (their KV heads [M])."""
        positions = blocks.view(-1, 1) * self.block_size + torch.arange(self.block_size, device=blocks.device)
        page_ids, offsets = page_slots(table[rows], positions, self.pools[0].page)
        return page_ids, heads.view(-1, 1), offsets

    def _poison(self, layer: int, table: torch.Tensor, lengths: torch.Tensor) -> None:
        """NaN into the pool rows of the complete blocks each row's slot map of `layer` does not
        hold, sparing the current block and the ring."""
        keys = self._keys(table, lengths).tolist()  # a test's stand-in for missing memory: host reads allowed
        heads = self.pools[layer].keys.shape[1]
        complete = torch.div(lengths, self.block_size, rounding_mode="floor")
        for row, key in enumerate(keys):
            held = self.maps[key, layer]
            count = int(complete[row])
            spared = int((lengths[row] - self.ring).clamp(min=0)) // self.block_size  # blocks touching the ring
            for head in range(heads):
                blocks = torch.arange(min(count, spared), device=lengths.device)
                blocks = blocks[~torch.isin(blocks, held[head])]  # an empty slot holds -1
                if not blocks.numel():
                    continue
                index = self._block_rows(table, torch.full_like(blocks, row), torch.full_like(blocks, head), blocks)
                pool = self.pools[layer]
                for target in (pool.keys, pool.values, pool.cis):
                    if target is not None:
                        target[index] = float("nan")
