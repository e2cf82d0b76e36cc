"""Benchmark helpers: fill a cache without running the model, and a plain greedy decode loop.

Several runtime modes are compared on one long prompt by prefilling once (any cache) and copying
every layer's stored K/V/CIS into each mode's cache through its own `append`, exactly what its
prefill would have stored, so an 8K-128K prompt is not re-run per mode.
"""

from __future__ import annotations

import time

import torch


def stored_positions(lengths: torch.Tensor, rows: int) -> torch.Tensor:
    """[B, rows] positions 0..length-1 per sequence, -1 past its length (trailing padding)."""
    pos = torch.arange(rows, device=lengths.device).expand(lengths.shape[0], -1)
    return pos.masked_fill(pos >= lengths.view(-1, 1), -1)


def copy_into(source, target) -> None:
    """Store every layer of `source` (a filled SparseCache or OffloadedSparseCache) into `target`."""
    for src, dst in zip(source.layers, target.layers):
        keys, values, cis, rows = src.full()
        dst.append(keys, values, cis, stored_positions(src.lengths, rows))
        dst.pinned = getattr(src, "pinned", None)  # what the source's prompt pinned (`modeling/pins.py`)
        dst.pin_rows = getattr(src, "pin_rows", None)  # and the rows it pinned from
    for layer in target.layers:
        layer.columns = source.layers[0].columns


@torch.no_grad()
def greedy_steps(model, cache, first_tokens: torch.Tensor, steps: int, sync=None):
    """Decode `steps` tokens greedily from `first_tokens` [B, 1] with `cache`.
    Returns (tokens [B, steps], logits of each step [B, steps, V] (fp32), seconds per step)."""
    from ..modeling.modeling import CACHE_KWARG

    tokens, logits, seconds = [], [], []
    current = first_tokens
    for _ in range(steps):
        start = time.perf_counter()
        out = model(input_ids=current, **{CACHE_KWARG: cache})
        step_logits = out.logits[:, -1].float()
        current = step_logits.argmax(-1, keepdim=True)
        if sync is not None:
            sync()
        seconds.append(time.perf_counter() - start)
        tokens.append(current)
        logits.append(step_logits)
    return torch.cat(tokens, 1), torch.stack(logits, 1), seconds
