"""Pinned blocks: per layer and KV head, the blocks the prompt's last rows attended most, forced into every
decode step's selection of that layer and head (SnapKV's observation window, at block level).

Why: at 8K on the quality suite's needle task (`benchmarks/results/quality/`) the selectors that plan a
layer ahead lose the answer at its first token ("1." where dense says "4498828."): at the first decode step
no layer's layer-ahead selection held the needle's block, so carrying (`carry.py`) had nothing to carry.
The prompt's own last rows, the question, do attend it: its key words point at the needle.  Seeding the
carried blocks from those rows (max over layers and heads) put the needle's block in every seed but made only
3-5 of 14 misses whole; pinning each layer's and head's own 2 hottest blocks made 9 of the 13 that dense found
whole (a throwaway probe; then on the suite's 50 examples at 8K and 16 blocks forecast-carry went from 0.22 to
0.44, dense 0.48: `benchmarks/results/quality/README.md`).  The pins are known when the prompt ends and never
change while decoding, so a rule that plans a layer ahead still does, and a runtime fetches them once.

`window_pins` is computed by each layer at the end of every multi-token call (`SparseCacheLayer.pin_window`),
from the sequence's last `PIN_ROWS` query rows over every key the layer holds: the call that ends the prompt
leaves the pins its decode steps keep.  Those rows may come from several calls (a prompt prefilled in chunks,
as a serving engine does): each layer keeps the last `PIN_ROWS` rows of the multi-token calls since the last
decode step (`SparseCacheLayer.pin_rows`; between an engine's calls `serving/paged.py` keeps them), so a prompt
pins the same blocks however it was cut, unless its last chunk is one token (a decode step, which keeps the
pins the chunk before it left).  A row's attention over the blocks depends only on the keys before it, so it
is the same in whichever call it was computed.  A multi-token call drops the pins first; a decode step ends
the window; a crop or a reset drops both; a reorder (beam search) and a fork take them along.
"""

from __future__ import annotations

import torch

from . import selection as sel

PIN_ROWS = 32  # the observation window: the prompt's last rows (SnapKV's default window)
PINNED = 2  # blocks pinned per layer and KV head (2 and 4 fixed the same misses in the probe)
ROWS_AT_ONCE = 8  # window rows scored together: the softmax holds [B, Hq, rows, S]


def last_rows(q: torch.Tensor, positions: torch.Tensor, rows: int = PIN_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's last `rows` query rows, wherever its padding is (left in `generate()`, right in a serving
    engine's chunk batch): q [B, T, Hq, d], positions [B, T] (-1: padding) -> q [B, R, Hq, d], positions [B, R]
    in column order, R = min(rows, T); a sequence with fewer real rows keeps padding rows (-1)."""
    if q.shape[1] <= rows:
        return q, positions
    columns = positions.topk(rows, dim=1).indices.sort(dim=1).values  # the largest positions: the last rows
    picked = q.gather(1, columns.view(*columns.shape, 1, 1).expand(-1, -1, *q.shape[2:]))
    return picked, positions.gather(1, columns)


def window_block_mass(q: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, block_size: int,
                      rows: int = PIN_ROWS) -> torch.Tensor:
    """The attention mass per block of each sequence's last `rows` query rows (`last_rows`), summed over them
    and over the G query heads of each KV head, fp32 [B, H, NB].  q [B, T, Hq, d] post-RoPE, positions [B, T]
    (-1: padding, no mass), keys [B, S, H, d] post-RoPE (key s at position s); NB = ceil(S / block_size)."""
    from ..selectors.oracle import oracle_block_mass

    q, positions = last_rows(q, positions, rows)
    n = sel.num_blocks(keys.shape[1], block_size)
    mass = keys.new_zeros((keys.shape[0], keys.shape[2], n), dtype=torch.float32)
    for start in range(0, q.shape[1], ROWS_AT_ONCE):
        part = slice(start, start + ROWS_AT_ONCE)
        mass += oracle_block_mass(q[:, part], keys, positions[:, part], block_size, n).sum(2)
    return mass * (q.shape[2] // keys.shape[2])  # oracle_block_mass averages the group: a sum, as the rows


def window_pins(mass: torch.Tensor, lengths: torch.Tensor, sparse, count: int = PINNED) -> torch.Tensor:
    """The `count` blocks of each KV head with the most mass (`window_block_mass` [B, H, NB]), int64 [B, H, count]
    (-1: none), leaving out the blocks every decode step selects anyway (init and local, from the last stored
    position lengths[b] - 1) and blocks with no mass."""
    n = mass.shape[-1]
    last = (lengths - 1).view(-1, 1)
    forced = sel.forced_blocks(last, n, sparse.block_size, sparse.init_blocks, sparse.local_blocks)  # [B, 1, NB]
    top = mass.masked_fill(forced, 0.0).topk(min(count, n), dim=-1)
    ids = torch.where(top.values > 0, top.indices, -1)
    return torch.nn.functional.pad(ids, (0, count - ids.shape[-1]), value=-1)
