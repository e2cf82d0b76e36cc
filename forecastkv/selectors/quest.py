"""``quest``: Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
ICML 2024).  Per block and channel the min and max of the keys (a window index the cache keeps:
`modeling/cache.py`, `block_lo` / `block_hi`); the upper bound of q.k over the block they imply is the
block's score, softmaxed per query head and summed per KV group as InfLLM-v2 does; init and local blocks
forced, NOSA's query-agnostic share filled from the pooled CIS.  `block_key_bounds` and
`quest_block_scores` are the ops (the reference of what the caches keep incrementally); `Quest` the rule.
"""

from __future__ import annotations

import math

import torch

from ..modeling import selection as sel
from ..modeling.selection import NEG_INF, check_group_heads, fit_blocks, grouped_heads
from .base import KeyScoringSelector


def block_key_bounds(keys: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's per-block key bounds: (lo, hi), each [B, NBc, H, d] in the keys' dtype.

    keys [B, S, H, d]; NBc = S // bs: only complete blocks have bounds.  lo / hi are the per-channel
    min / max of block j's keys [j*bs, (j+1)*bs).  The reference of what the caches keep incrementally.
    """
    batch, length, heads, dim = keys.shape
    complete = length // block_size
    blocks = keys[:, : complete * block_size].reshape(batch, complete, block_size, heads, dim)
    return blocks.amin(dim=2), blocks.amax(dim=2)


def quest_block_scores(
    q: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    n_blocks: int,
    lag: int = 0,
) -> torch.Tensor:
    """Quest block scores with InfLLM-v2's group aggregation, fp32 [B, H, Tq, n_blocks].

    q [B, Tq, Hq, d], lo / hi [B, NBc, H, d] (`block_key_bounds`), positions [B, Tq].  Per query
    head and block j the upper bound of q.k over the block, u = sum_c max(q_c lo_c, q_c hi_c) / sqrt(d)
    (Quest, ICML'24); a row at t can score block j iff it is complete at t ((j+1)*bs - 1 + lag <= t;
    lag 1: before the row's token is appended, what a layer-ahead plan sees) and j < NBc.  Per query
    head a softmax of u over the row's scoreable blocks, summed over the G heads of the KV group (one
    selection per KV head).  Blocks not scoreable are -inf; a row that scores
    none (t < bs, padding) is all -inf, without NaN.  Init / local forcing is the caller's
    (`selection.force_blocks`).
    """
    check_group_heads(q, lo, positions, "lo")
    if lo.shape != hi.shape:
        raise ValueError(f"lo {tuple(lo.shape)} and hi {tuple(hi.shape)} must have the same shape")
    batch, complete, heads, dim = lo.shape
    grouped = grouped_heads(q, heads) / math.sqrt(dim)  # [B, H, G, Tq, d]
    # max(q lo, q hi) per channel = q+ hi + q- lo (q+ = max(q, 0), q- = min(q, 0)): two matmuls
    upper = torch.matmul(grouped.clamp(min=0), hi.float().permute(0, 2, 3, 1).unsqueeze(2))
    upper = upper + torch.matmul(grouped.clamp(max=0), lo.float().permute(0, 2, 3, 1).unsqueeze(2))
    ends = (torch.arange(complete, device=lo.device) + 1) * block_size - 1
    hidden = ~(ends.view(1, 1, -1) + lag <= positions.unsqueeze(-1))[:, None]  # [B, 1, Tq, NBc]
    probs = torch.softmax(upper.masked_fill(hidden[:, :, None], NEG_INF), dim=-1)
    scores = probs.sum(dim=2).masked_fill(hidden, NEG_INF)  # NaN rows (nothing scoreable) become -inf
    return fit_blocks(scores, n_blocks, NEG_INF)


class Quest(KeyScoringSelector):
    name = "quest"
    key_bounds = True

    def bounds(self, cache_layer) -> tuple[torch.Tensor, torch.Tensor]:
        """The (lo, hi) [B, NBc, H, d] the scores bound q.k with: the cache's per-block key min and max."""
        return cache_layer.key_bounds()

    def selection(self, vectors, positions, cache_layer, sparse, n_blocks: int):
        """Quest's selection int64 [B, H, Tq, budget] of `vectors` [B, Tq, H*n, d] over n_blocks blocks,
        scored with this rule's visibility lag."""
        low, high = self.bounds(cache_layer)
        scores = quest_block_scores(vectors, low, high, positions, sparse.block_size, n_blocks, self.lag)
        scores = sel.force_blocks(scores, positions, sparse.block_size, sparse.init_blocks, sparse.local_blocks)
        scores = self.carry_into(scores, cache_layer)
        agnostic = None
        if sparse.policy == "nosa":
            pooled = cache_layer.decode_index()[2]
            agnostic = sel.pooled_agnostic_scores(pooled, positions, sparse, n_blocks, self.lag)
        return sel.select_blocks(scores, positions, sparse, agnostic)


SELECTOR = Quest()
