"""The device slot cache's bookkeeping: diff a new selection against the block map.

Per (sequence, KV head) row, a layer owns M regular slots (one block each) and a tail slot for the
block being written.  `diff_block_map` is the one place that decides hits, misses and where each
miss goes; it runs on the device as a few tensor ops (no host sync, no per-row loop).
"""

from __future__ import annotations

import torch


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
    same = (block_map.unsqueeze(-1) == wanted.unsqueeze(-2)) & valid.unsqueeze(-2) & (block_map >= 0).unsqueeze(-1)  # [B, H, M, K]
    kept = same.any(dim=-1)
    hit = same.any(dim=-2)
    miss = valid & ~hit
    order_key = torch.arange(slots, device=block_map.device) + torch.where(block_map < 0, 0, slots)
    order_key = order_key.masked_fill(kept, 3 * slots)
    free_order = order_key.argsort(dim=-1)                                   # free slots first
    rank = (miss.long().cumsum(dim=-1) - 1).clamp(min=0)
    target = torch.gather(free_order, -1, rank)                              # [B, H, K]
    scatter_at = torch.where(miss, target, slots)
    load_ids = torch.full((*block_map.shape[:-1], slots + 1), -1, dtype=block_map.dtype, device=block_map.device)
    load_ids.scatter_(-1, scatter_at, torch.where(miss, wanted, -1))
    load_ids = load_ids[..., :slots]
    new_map = torch.where(load_ids >= 0, load_ids, block_map)
    hit_slot = (same.long() * torch.arange(slots, device=block_map.device).view(-1, 1)).sum(dim=-2)
    slot_of = torch.where(hit, hit_slot, torch.where(miss, target, -1))
    return new_map, load_ids, slot_of, hit.sum(dim=-1), miss.sum(dim=-1)
