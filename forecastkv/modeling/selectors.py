"""The study's extra selectors as pure tensor ops (notation and id conventions: `selection`).

`oracle` (`oracle_block_mass`, `oracle_blocks`): the exact top-k blocks by the current query's true
attention mass over every visible key, averaged over the query heads of a KV group; it is the upper
bound the other selectors are measured against (`selection_recall`) and is never deployable, since
it needs every key before choosing which to fetch.  `quest` (`block_key_bounds`,
`quest_block_scores`; Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", ICML 2024): per block and channel the min and max of the keys, scored by the upper bound
of q.k they imply, softmaxed per query head and summed per KV group as InfLLM-v2 does.  Top-p budgets
(`block_mass`, `top_p_blocks`; Twilight, Lin et al. 2025): the forced blocks plus the fewest
highest-scoring blocks whose normalised score mass reaches p, capped at a fixed width so a decode
step keeps one shape.  Query head h*G + i belongs to KV head h (consecutive heads share a KV head),
as in `selection.group_softmax_scores`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .selection import NEG_INF, row_blocks, selection_mask, topk_blocks


def _check_heads(q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, keys_name: str) -> int:
    """The group size G = Hq // H of q [B, Tq, Hq, d] against keys [B, *, H, d] and positions
    [B, Tq]; a ValueError naming the shapes when they do not fit."""
    if q.dim() != 4 or keys.dim() != 4:
        raise ValueError(f"q {tuple(q.shape)} and {keys_name} {tuple(keys.shape)} must both be 4-d [B, *, heads, d]")
    if q.shape[0] != keys.shape[0] or q.shape[-1] != keys.shape[-1]:
        raise ValueError(
            f"q {tuple(q.shape)} and {keys_name} {tuple(keys.shape)} differ in batch or head dim (dims 0 and 3)"
        )
    heads_q, heads = q.shape[2], keys.shape[2]
    if heads == 0 or heads_q % heads != 0:
        raise ValueError(f"q has {heads_q} heads, not a multiple of the {heads} KV heads of {keys_name}")
    if tuple(positions.shape) != tuple(q.shape[:2]):
        raise ValueError(f"positions {tuple(positions.shape)} must be [B, Tq] = {tuple(q.shape[:2])}")
    return heads_q // heads


def _grouped(q: torch.Tensor, heads: int) -> torch.Tensor:
    """q [B, Tq, H*G, d] -> fp32 [B, H, G, Tq, d] (query head h*G + i is group h, member i)."""
    batch, rows, heads_q, dim = q.shape
    return q.float().view(batch, rows, heads, heads_q // heads, dim).permute(0, 2, 3, 1, 4)


def _fit_blocks(scores: torch.Tensor, n_blocks: int, fill: float) -> torch.Tensor:
    """[..., N] -> [..., n_blocks]: truncated, or padded with `fill`."""
    width = scores.shape[-1]
    if width >= n_blocks:
        return scores[..., :n_blocks]
    return F.pad(scores, (0, n_blocks - width), value=fill)


# ----------------------------------------------------------------------------------------------
# oracle
# ----------------------------------------------------------------------------------------------


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
    _check_heads(q, keys, positions, "keys")
    batch, length, heads, dim = keys.shape
    logits = torch.matmul(_grouped(q, heads) / math.sqrt(dim), keys.float().permute(0, 2, 3, 1).unsqueeze(2))
    visible = torch.arange(length, device=keys.device).view(1, 1, -1) <= positions.unsqueeze(-1)  # [B, Tq, S]
    hidden = ~visible[:, None, None]
    # a row that sees nothing softmaxes all -inf to NaN; the masked_fill below zeroes it
    probs = torch.softmax(logits.masked_fill(hidden, NEG_INF), dim=-1).masked_fill(hidden, 0.0)
    mass = probs.mean(dim=2)  # [B, H, Tq, S]
    whole = -(-length // block_size)
    mass = F.pad(mass, (0, whole * block_size - length)).view(*mass.shape[:-1], whole, block_size).sum(-1)
    return _fit_blocks(mass, n_blocks, 0.0)


def oracle_blocks(mass: torch.Tensor, positions: torch.Tensor, k: int, block_size: int) -> torch.Tensor:
    """The exact top-k blocks by true attention mass, int64 [B, H, Tq, k], canonical rows.

    mass [B, H, Tq, NB] (`oracle_block_mass`), positions [B, Tq].  Only the row's visible blocks
    (j <= t // bs) compete, nothing is forced, ties go to the lower id (`selection.topk_blocks`).
    """
    blocks = torch.arange(mass.shape[-1], device=mass.device).view(1, 1, 1, -1)
    scores = mass.float().masked_fill(blocks > row_blocks(positions, block_size), NEG_INF)
    return topk_blocks(scores, positions, k, block_size)


# ----------------------------------------------------------------------------------------------
# quest
# ----------------------------------------------------------------------------------------------


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
    q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, positions: torch.Tensor, block_size: int, n_blocks: int
) -> torch.Tensor:
    """Quest block scores with InfLLM-v2's group aggregation, fp32 [B, H, Tq, n_blocks].

    q [B, Tq, Hq, d], lo / hi [B, NBc, H, d] (`block_key_bounds`), positions [B, Tq].  Per query
    head and block j the upper bound of q.k over the block, u = sum_c max(q_c lo_c, q_c hi_c) / sqrt(d)
    (Quest, ICML'24); a row at t can score block j iff it is complete at t ((j+1)*bs - 1 <= t) and
    j < NBc.  Per query head a softmax of u over the row's scoreable blocks, summed over the G heads
    of the KV group (one selection per KV head).  Blocks not scoreable are -inf; a row that scores
    none (t < bs, padding) is all -inf, without NaN.  Init / local forcing is the caller's
    (`selection.force_blocks`).
    """
    _check_heads(q, lo, positions, "lo")
    if lo.shape != hi.shape:
        raise ValueError(f"lo {tuple(lo.shape)} and hi {tuple(hi.shape)} must have the same shape")
    batch, complete, heads, dim = lo.shape
    grouped = _grouped(q, heads) / math.sqrt(dim)  # [B, H, G, Tq, d]
    # max(q lo, q hi) per channel = q+ hi + q- lo (q+ = max(q, 0), q- = min(q, 0)): two matmuls
    upper = torch.matmul(grouped.clamp(min=0), hi.float().permute(0, 2, 3, 1).unsqueeze(2))
    upper = upper + torch.matmul(grouped.clamp(max=0), lo.float().permute(0, 2, 3, 1).unsqueeze(2))
    ends = (torch.arange(complete, device=lo.device) + 1) * block_size - 1
    hidden = ~(ends.view(1, 1, -1) <= positions.unsqueeze(-1))[:, None]  # [B, 1, Tq, NBc]
    probs = torch.softmax(upper.masked_fill(hidden[:, :, None], NEG_INF), dim=-1)
    scores = probs.sum(dim=2).masked_fill(hidden, NEG_INF)  # NaN rows (nothing scoreable) become -inf
    return _fit_blocks(scores, n_blocks, NEG_INF)


# ----------------------------------------------------------------------------------------------
# top-p budgets
# ----------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------
# recall against the oracle
# ----------------------------------------------------------------------------------------------


def selection_recall(
    ids: torch.Tensor, mass: torch.Tensor, oracle_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """How much of the oracle a selection holds: (mass_recall, overlap), each fp32 [B, H, Tq].

    ids [B, H, Tq, K] and oracle_ids [B, H, Tq, K2] (-1 = none), mass [B, H, Tq, NB]
    (`oracle_block_mass`).  mass_recall = the mass of ids' blocks / the mass of oracle_ids' blocks
    (1 where the oracle holds none; above 1 when ids hold more blocks than the oracle's k);
    overlap = |ids ∩ oracle_ids| / |valid oracle_ids| (1 where the oracle has none).
    """
    if ids.shape[:-1] != mass.shape[:-1] or oracle_ids.shape[:-1] != mass.shape[:-1]:
        raise ValueError(
            f"ids {tuple(ids.shape)}, oracle_ids {tuple(oracle_ids.shape)} and mass {tuple(mass.shape)} "
            "must share their leading [B, H, Tq] dims"
        )
    n_blocks = mass.shape[-1]
    chosen, best = selection_mask(ids, n_blocks), selection_mask(oracle_ids, n_blocks)
    mass = mass.float()
    held, best_held = (mass * chosen).sum(-1), (mass * best).sum(-1)
    mass_recall = torch.where(best_held > 0, held / best_held.clamp(min=torch.finfo(torch.float32).tiny), 1.0)
    wanted = best.sum(-1).float()
    overlap = torch.where(wanted > 0, (chosen & best).sum(-1).float() / wanted.clamp(min=1), 1.0)
    return mass_recall, overlap
