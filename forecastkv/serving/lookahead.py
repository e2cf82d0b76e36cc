"""Forecast-offload over pages: a host tier holding every full block, and per request and layer the
device working set the HF runtime keeps (`inference/layers.py:OffloadedLayer`).

The engine's page pool stands for device memory.  Every stored row is written through to the host
tier (a separate buffer on the CPU, so every byte that moves is counted; pinned memory on CUDA).
At a decode step, the plan of an offloaded layer (made one layer ahead by the Forecast heads, or at
the layer by the query selector) is diffed against that request's slot map of `budget` blocks per
KV head (`inference/layers.py:diff_block_map`, the HF runtime's policy), and only the misses are
copied host -> pool and counted.  `wait(layer)` is where the layer's attention starts: it records
whether its blocks were requested before it.  Layer 0 (`resident`) stays whole, as in the HF
runtime; so do the current block and the last `ring` rows (the HF runtime's tail slot and ring).

With `evict=True` the pool rows of complete blocks a decode request's slot map does not hold are
overwritten with NaN after each call, so attention that read a block it did not load shows at once
(a test and a CPU stand-in for device memory that is not there; never with prefix caching, whose
shared pages another request may still read whole).

A request's slot maps are filed under the page holding its last stored token: the engine owns
that page alone while the request decodes, so no request id has to cross from the scheduler; a
prefill chunk drops whatever was filed under its pages (left by a request that freed them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..inference.layers import diff_block_map
from .paged import LayerPages, page_slots


@dataclass
class StepBytes:
    """Per decode call (all layers and requests summed): H2D bytes, and the blocks the offloaded
    layers' plans wanted and found already in their slot maps ((request, KV head, block) triples of
    complete blocks, as the HF runtime's `stats()` counts them); and the order of requests and
    waits: (step, "request" | "wait", layer)."""

    per_step: list[int] = field(default_factory=list)
    wanted: list[int] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    events: list[tuple[int, str, int]] = field(default_factory=list)

    def clear(self) -> None:
        """Forget every call counted so far (a reader that has taken them: a server's counts stay bounded)."""
        for records in (self.per_step, self.wanted, self.hits, self.events):
            records.clear()


class LookaheadTier:
    """The host tier and the slot maps of `pools` (one `LayerPages` per layer).

    budget: slots per (request, layer, KV head), the HF runtime's `budget_blocks`; block_size: the
    selection block; ring: rows kept resident behind the newest token (the widest window index)."""

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
        pin = pools[0].keys.device.type == "cuda"
        host = lambda x: None if x is None else torch.empty(x.shape, dtype=x.dtype, pin_memory=pin)  # noqa: E731
        self.host = [[host(p.keys), host(p.values), host(p.cis)] for p in pools]
        self.maps: dict[int, dict[int, torch.Tensor]] = {}  # page of the last stored token -> layer -> [H, budget]
        self.stats = StepBytes()
        self._requested: set[int] = set()

    # -- what one call does -----------------------------------------------------------------------
    def begin_decode(self) -> None:
        """A decode call starts: a new step of the byte count."""
        for records in (self.stats.per_step, self.stats.wanted, self.stats.hits):
            records.append(0)
        self._requested = set()

    def forget(self, table: torch.Tensor, lengths: torch.Tensor) -> None:
        """A multi-token call (a prefill chunk, or a preempted request's recompute) of rows table [B, nb]
        up to lengths [B]: any slot maps filed under their pages belonged to a request that freed them."""
        for row, length in enumerate(lengths.tolist()):
            pages = table[row, : -(-int(length) // self.pools[0].page)].tolist()
            for page in pages:
                self.maps.pop(page, None)

    def write_through(self, layer: int, page_ids, heads, offsets) -> None:
        """The rows just stored at (page_ids [N, 1], heads [1, H], offsets [N, 1]) of `layer`, copied to the host."""
        for pool, host in zip(
            (self.pools[layer].keys, self.pools[layer].values, self.pools[layer].cis), self.host[layer]
        ):
            if pool is not None:
                host[page_ids, heads, offsets] = pool[page_ids, heads, offsets].to("cpu")

    def request(
        self, layer: int, table: torch.Tensor, before: torch.Tensor, lengths: torch.Tensor, selection: torch.Tensor
    ) -> None:
        """Load layer `layer`'s misses for selection [B, H, K] (block ids, -1 none) of the decode rows
        whose block tables are table [B, nb], stored lengths before [B] at the call's start and
        lengths [B] now (the same when planned a layer ahead, one more at the layer itself): complete
        blocks only, as the HF runtime fetches them."""
        self.stats.events.append((len(self.stats.per_step), "request", layer))
        self._requested.add(layer)
        if layer in self.resident:
            return
        complete = torch.div(lengths, self.block_size, rounding_mode="floor")
        wanted = selection.masked_fill((selection < 0) | (selection >= complete.view(-1, 1, 1)), -1)
        keys = self._keys(table, before)
        maps = torch.stack([self.maps.setdefault(key, {}).get(layer, self._empty(selection)) for key in keys])
        new_map, load_ids, _, hits, misses = diff_block_map(maps, wanted)
        for row, key in enumerate(keys):
            self.maps[key][layer] = new_map[row]
        self._load(layer, table, load_ids)
        missed, asked, held = torch.stack([misses.sum(), (wanted >= 0).sum(), hits.sum()]).tolist()  # one read
        self.stats.per_step[-1] += missed * self.block_bytes(layer)
        self.stats.wanted[-1] += asked
        self.stats.hits[-1] += held

    def wait(self, layer: int) -> bool:
        """Where `layer`'s decode attention starts (vLLM's `wait_for_layer_load`): on the CPU every
        load already ran; returns whether this layer's blocks were requested before it."""
        self.stats.events.append((len(self.stats.per_step), "wait", layer))
        return layer in self._requested

    def end_decode(self, table: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> None:
        """After a decode call of rows table [B, nb] that went from lengths before [B] to after [B]:
        file each row's slot maps under its new last page, then (evict) poison what they do not hold."""
        for old, new in zip(self._keys(table, before), self._keys(table, after)):
            if old in self.maps and old != new:
                self.maps[new] = self.maps.pop(old)
        if self.evict:
            for layer in range(len(self.pools)):
                if layer not in self.resident:
                    self._poison(layer, table, after)

    # -- pieces ---------------------------------------------------------------------------------------
    def block_bytes(self, layer: int) -> int:
        """Bytes of one block of one KV head: K, V and NOSA's CIS rows (`OffloadedLayer.block_bytes`)."""
        pool = self.pools[layer]
        row = sum(x.shape[-1] * x.element_size() for x in (pool.keys, pool.values))
        if pool.cis is not None:
            row += pool.cis.element_size()
        return self.block_size * row

    def _keys(self, table: torch.Tensor, lengths: torch.Tensor) -> list[int]:
        last = (lengths - 1).clamp(min=0).view(-1, 1)
        return page_slots(table, last, self.pools[0].page)[0].view(-1).tolist()

    def _empty(self, selection: torch.Tensor) -> torch.Tensor:
        return torch.full((selection.shape[1], self.budget), -1, dtype=torch.long, device=selection.device)

    def _block_rows(self, table, rows, heads, blocks):
        """(page ids, heads, offsets) [M, bs] of blocks [M] of sequences rows [M] (their KV heads [M])."""
        positions = blocks.view(-1, 1) * self.block_size + torch.arange(self.block_size, device=blocks.device)
        page_ids, offsets = page_slots(table[rows], positions, self.pools[0].page)
        return page_ids, heads.view(-1, 1), offsets

    def _load(self, layer: int, table: torch.Tensor, load_ids: torch.Tensor) -> None:
        """Copy the host blocks named by load_ids [B, H, M] (-1 nothing) into the pool."""
        rows, heads, slots = (load_ids >= 0).nonzero(as_tuple=True)
        if not rows.numel():
            return
        index = self._block_rows(table, rows, heads, load_ids[rows, heads, slots])
        pool = self.pools[layer]
        for target, host in zip((pool.keys, pool.values, pool.cis), self.host[layer]):
            if target is not None:
                target[index] = host[tuple(i.cpu() for i in index)].to(target.device)

    def _poison(self, layer: int, table: torch.Tensor, lengths: torch.Tensor) -> None:
        """NaN into the pool rows of the complete blocks each row's slot map of `layer` does not
        hold, sparing the current block and the ring."""
        keys = self._keys(table, lengths)
        heads = self.pools[layer].keys.shape[1]
        complete = torch.div(lengths, self.block_size, rounding_mode="floor")
        for row, key in enumerate(keys):
            held = self.maps.get(key, {}).get(layer)
            count = int(complete[row])
            spared = int((lengths[row] - self.ring).clamp(min=0)) // self.block_size  # blocks touching the ring
            for head in range(heads):
                blocks = torch.arange(min(count, spared), device=lengths.device)
                if held is not None:
                    blocks = blocks[~torch.isin(blocks, held[head])]
                if not blocks.numel():
                    continue
                index = self._block_rows(table, torch.full_like(blocks, row), torch.full_like(blocks, head), blocks)
                pool = self.pools[layer]
                for target in (pool.keys, pool.values, pool.cis):
                    if target is not None:
                        target[index] = float("nan")
