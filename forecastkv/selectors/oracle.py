"""``oracle``: the exact top-k blocks by the current query's true attention mass over every visible key,
averaged over the query heads of a KV group.  The upper bound the other selectors are measured against
(`modeling/selection.py:selection_recall`); never deployable, since it needs every key before choosing
which to fetch, so the offloaded runtime refuses it.  With a top-p budget, the fewest blocks holding p of
the mass (`selection.top_p_blocks`); nothing is forced.  `oracle_block_mass` and `oracle_blocks` are the
ops, `Oracle` the rule.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..modeling import selection as sel
from ..modeling.selection import NEG_INF, check_group_heads, fit_blocks, grouped_heads, row_blocks, topk_blocks
from .base import KeyScoringSelector


def oracle_block_mass(
    q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, block_size: int, n_blocks: int
) -> torch.Tensor:
    """The true attention mass per block, fp32 [B, H, Tq, n_blocks].

    q [B, Tq, Hq, d] post-RoPE queries, keys [B, S, H, d] post-RoPE (key s at position s), positions
    [B, Tq] (-1 = padding).  A row at t sees keys s <= t.  Per query head the exact softmax of
    q.k / sqrt(d) over the visible keys is summed over each block's keys [j*bs, (j+1)*bs), then
    averaged over the G heads of the KV group, so a row that sees a key sums to 1 over blocks
    (blocks >= n_blocks are dropped: the caller sizes n_blocks to the rows' positions).  Padding rows
    and blocks with no visible key are 0.  Memory O(Tq x S) per head: the caller chunks long prefills.
    """
    check_group_heads(q, keys, positions, "keys")
    batch, length, heads, dim = keys.shape
    logits = torch.matmul(grouped_heads(q, heads) / math.sqrt(dim), keys.float().permute(0, 2, 3, 1).unsqueeze(2))
    visible = torch.arange(length, device=keys.device).view(1, 1, -1) <= positions.unsqueeze(-1)  # [B, Tq, S]
    hidden = ~visible[:, None, None]
    # a row that sees nothing softmaxes all -inf to NaN; the masked_fill below zeroes it
    probs = torch.softmax(logits.masked_fill(hidden, NEG_INF), dim=-1).masked_fill(hidden, 0.0)
    mass = probs.mean(dim=2)  # [B, H, Tq, S]
    whole = -(-length // block_size)
    mass = F.pad(mass, (0, whole * block_size - length)).view(*mass.shape[:-1], whole, block_size).sum(-1)
    return fit_blocks(mass, n_blocks, 0.0)


def oracle_blocks(mass: torch.Tensor, positions: torch.Tensor, k: int, block_size: int) -> torch.Tensor:
    """The exact top-k blocks by true attention mass, int64 [B, H, Tq, k], canonical rows.

    mass [B, H, Tq, NB] (`oracle_block_mass`), positions [B, Tq].  Only the row's visible blocks
    (j <= t // bs) compete, nothing is forced, ties go to the lower id (`selection.topk_blocks`).
    """
    blocks = torch.arange(mass.shape[-1], device=mass.device).view(1, 1, 1, -1)
    scores = mass.float().masked_fill(blocks > row_blocks(positions, block_size), NEG_INF)
    return topk_blocks(scores, positions, k, block_size)


class Oracle(KeyScoringSelector):
    name = "oracle"
    deployable = False

    def selection(self, q, positions, cache_layer, sparse, n_blocks: int):
        """The oracle's selection int64 [B, H, Tq, budget] of queries q [B, Tq, Hq, d] over n_blocks blocks."""
        keys = cache_layer.full()[0]
        mass = oracle_block_mass(q, keys, positions, sparse.block_size, n_blocks)
        if not sparse.top_p:
            return oracle_blocks(mass, positions, sparse.budget_blocks, sparse.block_size)
        blocks = torch.arange(n_blocks, device=mass.device).view(1, 1, -1)
        future = (blocks > torch.div(positions, sparse.block_size, rounding_mode="floor").unsqueeze(-1))[:, None]
        return sel.top_p_blocks(
            mass.masked_fill(future, NEG_INF), positions, sparse.top_p, sparse.budget_blocks, sparse.block_size,
            logits=False,
        )


SELECTOR = Oracle()
