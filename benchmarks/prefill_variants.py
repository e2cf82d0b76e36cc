"""Block-sparse prefill attention on the CPU: the union path against an exact per-row alternative.

The model's CPU path (`prefill.chunked_sparse_attention`) gathers, per 64-row tile, the union of
its rows' blocks and masks each row to its own set, so it computes scores for ~19 blocks per row
where a row selects ~11.5 (SmolLM2 preset at 8K).  `key_block_major_attention` below does exactly
the selected work: every KV block attends only the rows that chose it, and the per-block partial
results are merged by log-sum-exp.  It is kept here, not in the package, because it measured level
with the union path, not faster (the note in `modeling/prefill.py` says why).

    python benchmarks/prefill_variants.py --length 8192 --layer 10

captures one layer's prefill inputs on the bundled SmolLM2 and prints, per repeat, the seconds of
both variants on the same inputs (alternating) and their largest difference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prefill import prompt_ids, smollm2  # noqa: E402


def key_block_major_attention(q, keys, values, bias, positions, masks, block_size):
    """Same contract as `prefill.chunked_sparse_attention` (q [B, R, Hq, d], keys/values [B, S, H, d],
    bias [B, S, H] or None, positions [B, R], masks bool [B, H, R, NB]) -> [B, R, Hq, d]; rows
    with no block give 0.  Work: one [rows x G, d] x [d, block_size] product per (KV head, block)."""
    batch, rows, heads, dim = q.shape
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    n_blocks = masks.shape[-1]
    current = torch.div(positions, block_size, rounding_mode="floor")[:, None, :, None]
    masks = masks & (torch.arange(n_blocks) <= current)
    scaled = (q * (1.0 / math.sqrt(dim))).view(batch, rows, kv_heads, group, dim)
    offsets = torch.arange(block_size)
    out = q.new_zeros(batch, rows, kv_heads, group, dim)
    for b in range(batch):
        for h in range(kv_heads):
            block_of_pair, row_of_pair = masks[b, h].t().nonzero(as_tuple=True)  # by block, rows ascending
            pairs = row_of_pair.numel()
            partial = q.new_empty(pairs, group, dim)  # per (row, block): unnormalised output,
            peak = q.new_empty(pairs, group)  # its max logit
            mass = q.new_empty(pairs, group)  # and its sum of exp(logit - max)
            pair_pos = positions[b].index_select(0, row_of_pair)
            start = 0
            for j, n in enumerate(torch.bincount(block_of_pair, minlength=n_blocks).tolist()):
                if n == 0:
                    continue
                end = start + n
                keys_j = keys[b, j * block_size : (j + 1) * block_size, h]
                width = keys_j.shape[0]
                s = torch.mm(scaled[b, :, h].index_select(0, row_of_pair[start:end]).view(n * group, dim), keys_j.t())
                if bias is not None:
                    s += bias[b, j * block_size : j * block_size + width, h]
                pos = pair_pos[start:end]
                inside = int(torch.searchsorted(pos, j * block_size + width - 1))  # rows inside block j come first
                if inside:
                    future = j * block_size + offsets[:width] > pos[:inside, None]
                    s.view(n, group, width)[:inside].masked_fill_(future[:, None, :], float("-inf"))
                top = peak[start:end].view(n * group, 1)
                torch.amax(s, 1, keepdim=True, out=top)
                s.sub_(top).exp_()
                torch.sum(s, 1, keepdim=True, out=mass[start:end].view(n * group, 1))
                torch.mm(
                    s,
                    values[b, j * block_size : j * block_size + width, h],
                    out=partial[start:end].view(n * group, dim),
                )
                start = end
            row_peak = torch.full((rows, group), float("-inf")).scatter_reduce_(
                0, row_of_pair[:, None].expand(-1, group), peak, "amax"
            )
            weight = (peak - row_peak.index_select(0, row_of_pair)).exp_()
            denom = torch.zeros(rows, group).index_add_(0, row_of_pair, weight * mass)
            total = torch.zeros(rows, group, dim).index_add_(0, row_of_pair, partial.mul_(weight.unsqueeze(-1)))
            out[b, :, h] = total / denom.clamp_min(1e-30).unsqueeze(-1)
    return out.view(batch, rows, heads, dim)


def capture_layer(length: int, layer: int) -> dict:
    """One layer's prefill attention inputs (all rows, the row masks of every query chunk)."""
    from transformers import AutoTokenizer

    from forecastkv.modeling import attention

    path, model = smollm2("sparse")
    ids = prompt_ids(AutoTokenizer.from_pretrained(path), length)
    captured, original = [], attention.chunked_sparse_attention
    current = {}

    def recording(*args, **kwargs):
        if current.get("layer") == layer:
            captured.append(args[:6])
        return original(*args, **kwargs)

    original_attend = attention.SparseAttention._attend_chunks

    def attend(self, *args, **kwargs):
        current["layer"] = self.layer_idx
        return original_attend(self, *args, **kwargs)

    attention.chunked_sparse_attention, attention.SparseAttention._attend_chunks = recording, attend
    try:
        with torch.no_grad():
            model(ids, logits_to_keep=1, use_cache=False)
    finally:
        attention.chunked_sparse_attention, attention.SparseAttention._attend_chunks = original, original_attend
    first = captured[0]
    return {
        "q": torch.cat([c[0] for c in captured], 1),
        "keys": first[1],
        "values": first[2],
        "bias": first[3],
        "positions": torch.cat([c[4] for c in captured], 1),
        "masks": torch.cat([c[5] for c in captured], 2),
        "block_size": model.config.sparse.block_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from forecastkv.modeling import prefill

    c = capture_layer(args.length, args.layer)
    q, keys, values, bias, positions, masks, bs = (
        c[k] for k in ("q", "keys", "values", "bias", "positions", "masks", "block_size")
    )
    blocks = prefill.BlockSource.laid_out(keys, values, bias, bs)
    visible = masks & (torch.arange(masks.shape[-1]) <= (positions // bs)[:, None, :, None])
    tiles = visible[:, :, : visible.shape[2] // bs * bs].unflatten(2, (-1, bs))  # [B, H, tiles, bs, NB]
    print(
        json.dumps(
            {
                "blocks_per_row": round(visible.sum(-1).float().mean().item(), 2),
                "tile_union": round(tiles.any(3).sum(-1).float().mean().item(), 2),
                "tile_shared": round(tiles.all(3).sum(-1).float().mean().item(), 2),
            }
        )
    )

    def union():  # as the model calls it: CHUNKED_ATTENTION_ROWS rows per call
        step, parts = prefill.CHUNKED_ATTENTION_ROWS, []
        for first in range(0, q.shape[1], step):
            r = slice(first, first + step)
            parts.append(
                prefill.chunked_sparse_attention(
                    q[:, r], keys, values, bias, positions[:, r], masks[:, :, r], bs, blocks
                )
            )
        return torch.cat(parts, 1)

    def exact():
        return key_block_major_attention(q, keys, values, bias, positions, masks, bs)

    for _ in range(args.repeats):
        row, outputs = {}, []
        for name, fn in (("union_s", union), ("key_block_major_s", exact)):
            start = time.perf_counter()
            outputs.append(fn())
            row[name] = round(time.perf_counter() - start, 3)
        row["max_abs_diff"] = float((outputs[0] - outputs[1]).abs().max())
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
