"""Carried blocks: the blocks one decode step attended most, forced into every layer's selection at the next.

Why: on the quality suite's needle task (`benchmarks/results/quality/`), every deployable selector at a
16-block budget starts the answer right and then loses it after a digit or two ("6." for 6775041).  A
probe of the misses found the copying heads (SmolLM2 layers 7, 17 and 18) putting 0.2-0.5 of their
attention on the needle's block while their compressed-key (or Quest) scores rank it 20th to 50th: a
copy head attends one token, and a window's pooled key (or a block's key bounds) does not show it.
Other layers (20-23) do select that block at every step.  So the block a step attended most, in any
layer, is carried into every layer at the next step: known a whole step ahead (a runtime can fetch it
with the step's other blocks), no host read, fixed shapes.

`CarriedBlocks` is one cache's state, shared by its layers (`SparseCacheLayer.carry`):
  * `force(scores)`: a selector's block scores [B, H, Tq, NB] with the carried blocks at +inf (where visible);
  * `observe(layer, q, plan)`: after a layer's decode attention, the share of its attention mass each
    selected block held (`selected_block_mass`), max over layers and heads into the step's heat [B, NB];
  * `roll()`: after the step, the `count` hottest blocks (init, local and current excluded: they are in
    every selection anyway) become the carried ids [B, count] (-1: none).
A multi-token call, a crop, a reorder or a reset forgets them (`forget`): nothing is carried across a
change of what the cache holds.
"""

from __future__ import annotations

import math

import torch

from . import selection as sel

# blocks the carrying selectors carry: in a probe of 8 needle misses (4K, 16 blocks) 4 fixed 8 and 2 fixed 6
CARRIED = 4


def selected_block_mass(
    q: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor, bias: torch.Tensor | None, lengths: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """The share of a decode token's attention each selected block holds, fp32 [B, H, K]: the softmax of the
    decode attention over the gathered blocks (`cache.gather_blocks`' keys [B, H, K*bs, d], key positions
    [B, H, K*bs] (-1: not a key), NOSA's bias [B, H, K*bs] or None) summed per block, averaged over the G
    query heads of q [B, 1, G*H, d].  lengths [B]: keys at positions >= lengths are not keys.  A row with
    no key gives zeros."""
    batch, _, heads, dim = q.shape
    kv_heads = keys.shape[1]
    logits = torch.matmul(q.view(batch, kv_heads, heads // kv_heads, dim).float(), keys.float().transpose(-1, -2))
    logits = logits / math.sqrt(dim)  # [B, H, G, L], the scaling of `prefill.masked_attention`
    if bias is not None:
        logits = logits + bias.float().unsqueeze(2)
    allowed = ((key_pos >= 0) & (key_pos < lengths.view(-1, 1, 1))).unsqueeze(2)
    probs = torch.softmax(logits.masked_fill(~allowed, sel.NEG_INF), dim=-1).nan_to_num(0.0)
    return probs.view(batch, kv_heads, -1, keys.shape[2] // block_size, block_size).sum(-1).mean(2)


def force_ids(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """scores [B, H, Tq, NB] with blocks `ids` set to +inf where a row can see them (score above -inf): ids
    [B, P] for every head (carried blocks) or [B, H, P] per KV head (pinned blocks, `pins.py`); -1 or an id past
    NB: none.  Fixed shapes: the ids out of range go to a spare column."""
    n = scores.shape[-1]
    ids = ids if ids.dim() == 3 else ids[:, None]
    ids = torch.where((ids >= 0) & (ids < n), ids, n)
    index = ids[:, :, None, :].expand(*scores.shape[:3], -1)
    padded = torch.cat([scores, scores.new_full((*scores.shape[:3], 1), sel.NEG_INF)], dim=-1)
    current = padded.gather(-1, index)
    padded = padded.scatter(-1, index, torch.where(current > sel.NEG_INF, sel.POS_INF, current))
    return padded[..., :n]


class CarriedBlocks:
    """One cache's carried blocks (see the module docstring).  count: blocks carried; sparse: the geometry
    (block size, init and local blocks).  ids [B, count] int64 (-1: none) once a decode step began; heat
    [B, NB + 1] fp32 (the last column takes what is not counted)."""

    def __init__(self, count: int, sparse) -> None:
        self.count, self.block_size = count, sparse.block_size
        self.init_blocks, self.local_blocks = sparse.init_blocks, sparse.local_blocks
        self.ids: torch.Tensor | None = None
        self.heat: torch.Tensor | None = None
        # reduce(heat) in place before the hottest are taken: the max over the ranks of a tensor-parallel
        # engine, each of which weighed only its own KV heads (None: one rank)
        self.reduce = None

    def begin(self, batch: int, device) -> None:
        """A sparse decode step starts: nothing carried yet is all -1 (the same ops as a step that carries)."""
        if self.ids is None or self.ids.shape[0] != batch:
            self.ids = torch.full((batch, self.count), -1, dtype=torch.long, device=device)
            self.heat = None

    def ready(self, batch: int, blocks: int, device) -> None:
        """After a call that was not a sparse decode step (a prefill): nothing carried, and the heat of
        `blocks` blocks allocated, so the next decode steps allocate nothing (fixed steps)."""
        self.ids = torch.full((batch, self.count), -1, dtype=torch.long, device=device)
        self.heat = torch.zeros((batch, blocks + 1), dtype=torch.float32, device=device)

    def forget(self) -> None:
        self.ids = self.heat = None

    def forked(self, repeats: int) -> "CarriedBlocks":
        other = CarriedBlocks.__new__(CarriedBlocks)
        other.__dict__.update(self.__dict__)
        other.ids = None if self.ids is None else self.ids.repeat_interleave(repeats, dim=0)
        other.heat = None if self.heat is None else self.heat.repeat_interleave(repeats, dim=0)
        return other

    def force(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [B, H, Tq, NB] with the carried blocks a row can see (score above -inf) set to +inf."""
        return scores if self.ids is None else force_ids(scores, self.ids)

    def observe(self, layer, q: torch.Tensor, plan) -> None:
        """After `layer`'s decode attention of q [B, 1, Hq, d] over plan.selection [B, H, K]: its blocks' share
        of the attention into the step's heat (max), init, local and current blocks left out."""
        keys, _, key_pos, bias = layer.store.blocks(layer, plan, with_values=False)  # the mass needs no values
        self.weigh(layer, q, plan.selection, keys, key_pos, bias)

    def weigh(self, layer, q: torch.Tensor, selection: torch.Tensor, keys, key_pos, bias) -> None:
        """`observe` with the blocks of selection [B, H, K] already gathered (`cache.gather_blocks`' keys
        [B, H, K*bs, d], key positions, bias or None)."""
        mass = selected_block_mass(q, keys, key_pos, bias, layer.lengths, self.block_size)  # [B, H, K]
        n = sel.num_blocks(layer.capacity_rows(), self.block_size)
        if self.heat is None or self.heat.shape[0] != selection.shape[0]:
            self.heat = torch.zeros((selection.shape[0], n + 1), dtype=torch.float32, device=selection.device)
        elif self.heat.shape[1] < n + 1:  # a layer holding more blocks (an offloaded one): widen, keep the heat
            wider = self.heat.new_zeros((selection.shape[0], n + 1))
            wider[:, : self.heat.shape[1] - 1] = self.heat[:, :-1]
            self.heat = wider
        n = self.heat.shape[1] - 1
        position = (layer.lengths - 1).view(-1, 1)
        forced = sel.forced_blocks(position, n, self.block_size, self.init_blocks, self.local_blocks)[:, 0]  # [B, NB]
        ids = selection.clamp(min=0, max=n - 1)
        counted = (selection >= 0) & (selection < n) & ~forced.gather(1, ids.view(ids.shape[0], -1)).view_as(ids)
        flat = torch.where(counted, selection, n).view(selection.shape[0], -1)
        self.heat.scatter_reduce_(1, flat, mass.view(selection.shape[0], -1), reduce="amax")

    def roll(self) -> None:
        """After a sparse decode step: its `count` hottest blocks are carried into the next."""
        if self.heat is None:
            return
        if self.reduce is not None:
            self.reduce(self.heat)
        heat = self.heat[:, :-1]
        top = heat.topk(min(self.count, heat.shape[1]), dim=-1)
        ids = torch.where(top.values > 0, top.indices, -1)
        self.ids = torch.nn.functional.pad(ids, (0, self.count - ids.shape[1]), value=-1)
        self.heat.zero_()
