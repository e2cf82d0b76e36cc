"""The context store's rows: copies between its per-layer host pools and caches or block files.

The worker half of the store (the index, `context/index.py`, decides which blocks; these
functions move their rows).  A chain is a list of blocks, each its block id per layer; pools are
the store's `HostBlockPool` per layer; rows are keys, values [n, H, d] and cis [n, H] or None.
"""

from __future__ import annotations

import torch

from ..inference.host_store import HostBlockPool
from ..inference.worker import host_transfer
from .blocks import BlockRows, layer_rows


def fill(
    cache, pools: list[HostBlockPool], devices: list[torch.device], chain: list[list[int]], block_size: int
) -> int:
    """Give an empty `cache` the positions stored in `chain`: offloaded layers attach to the
    pools' blocks (one more holder each, no copy) and take their new blocks from the pools;
    resident layers get the rows appended on their device.  Returns the positions given."""
    length = len(chain) * block_size
    offloaded = [getattr(layer, "offloaded", False) for layer in cache.layers]
    if any(offloaded):
        cache.use_pools([pool if off else None for pool, off in zip(pools, offloaded)])
    if not chain:
        return 0
    entries = []
    with host_transfer():
        for index, (pool, device, off) in enumerate(zip(pools, devices, offloaded)):
            ids = [blocks[index] for blocks in chain]
            if off:
                entries.append((pool, ids, device))
            else:
                rows = pool.read_rows(ids, length)
                entries.append(tuple(None if t is None else t.unsqueeze(0).to(device) for t in rows))
    if any(offloaded):
        cache.attach(entries, length)
    else:
        for layer, (keys, values, cis) in zip(cache.layers, entries):
            layer.append(keys, values, cis, torch.arange(length, device=keys.device).unsqueeze(0))
    return length


def take_blocks(cache, pools: list[HostBlockPool], first: int, count: int, block_size: int) -> list[list[int]]:
    """Blocks first..first+count-1 of the one sequence of `cache` into the pools, per block its id
    per layer: an offloaded layer on the pool gives its full blocks by reference (one more holder:
    the store's); any other layer's rows are copied into new blocks."""
    per_layer = []
    for layer, pool in zip(cache.layers, pools):
        host = getattr(layer, "host", None)
        if host is not None and host.pool is pool:
            ids = host.sequence_blocks(0)[first : first + count]
            pool.retain(ids)
        else:
            rows = layer_rows(layer, first * block_size, (first + count) * block_size) if count else ()
            pool.reserve(count)
            ids = pool.allocate(count)
            with host_transfer():
                for position, block in enumerate(ids):
                    for target, source in zip(pool.block(block), rows):
                        if target is not None:
                            target.copy_(source[position * block_size : (position + 1) * block_size])
        per_layer.append(ids)
    return [list(blocks) for blocks in zip(*per_layer)] if count else []


def copy_in(pools: list[HostBlockPool], block) -> list[int]:
    """A new block per pool holding `block`'s rows (a `disk.DiskBlock`, read a layer at a time);
    returns their ids.  The pools must have a free block each (`reserve`)."""
    ids = []
    for index, pool in enumerate(pools):
        (target,) = pool.allocate(1)
        with host_transfer():
            for view, rows in zip(pool.block(target), block.layer(index)):
                if view is not None:
                    view.copy_(rows)
        ids.append(target)
    return ids


def copy_out(pools: list[HostBlockPool], blocks: list[int], block_size: int) -> BlockRows:
    """A copy of one stored block's rows, every layer (block id per layer in `blocks`)."""
    with host_transfer():
        parts = [pool.read_rows([block], block_size) for pool, block in zip(pools, blocks)]
    return BlockRows(*(None if parts[0][i] is None else torch.stack([p[i] for p in parts]) for i in range(3)))
