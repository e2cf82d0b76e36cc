"""The context store's rows: copies between its per-layer host pools and caches or block files.

The worker half of the store (the index, `context/index.py`, decides which blocks; these
functions move their rows, through the offload runtime's worker, `inference/worker.py`).  A
chain is a list of blocks, each its block id per layer; pools are the store's `HostBlockPool`
per layer; rows are keys, values [n, H, d] and cis [n, H] or None.
"""

from __future__ import annotations

import torch

from ..inference.host_store import HostBlockPool
from ..inference.worker import TransferWorker
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
    for index, (pool, device, off) in enumerate(zip(pools, devices, offloaded)):
        ids = [blocks[index] for blocks in chain]
        if off:
            entries.append((pool, ids, device))
        else:
            entries.append(TransferWorker(device, overlap=False).read_blocks(pool, ids, length, device))
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
            ids = host.blocks.sequence_blocks(0)[first : first + count]
            pool.allocator.retain(ids)
        else:
            rows = layer_rows(layer, first * block_size, (first + count) * block_size) if count else ()
            pool.allocator.reserve(count)
            ids = pool.allocator.allocate(count)
            if count:
                TransferWorker(rows[0].device, overlap=False).write_blocks(pool, ids, rows)
        per_layer.append(ids)
    return [list(blocks) for blocks in zip(*per_layer)] if count else []


def copy_in(pools: list[HostBlockPool], block) -> list[int]:
    """A new block per pool holding `block`'s rows (a `disk.DiskBlock`, read a layer at a time);
    returns their ids.  The pools must have a free block each (`reserve`)."""
    ids, worker = [], TransferWorker("cpu", overlap=False)  # disk -> host: no device on either side
    for index, pool in enumerate(pools):
        (target,) = pool.allocator.allocate(1)
        worker.write_blocks(pool, [target], block.layer(index))
        ids.append(target)
    return ids


def copy_out(pools: list[HostBlockPool], blocks: list[int], block_size: int) -> BlockRows:
    """A copy of one stored block's rows, every layer (block id per layer in `blocks`)."""
    worker = TransferWorker("cpu", overlap=False)
    parts = [worker.read_blocks(pool, [block], block_size) for pool, block in zip(pools, blocks)]
    return BlockRows(*(None if parts[0][i] is None else torch.stack([p[i] for p in parts]) for i in range(3)))
