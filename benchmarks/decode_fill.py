"""A synthetic long context for decode benchmarks: random post-RoPE keys/values stored through each
layer's `append`, no model forward (speeds, not quality)."""

from __future__ import annotations

import torch


def fill_random(
    cache,
    batch: int,
    length: int,
    heads: int,
    dim: int,
    dtype: torch.dtype,
    device,
    with_cis: bool = False,
    seed: int = 0,
) -> None:
    """Store `length` random positions per sequence in every layer of `cache`: keys, values
    [batch, length, heads, dim] (standard normal, drawn in fp32 then cast to `dtype`) and, if
    `with_cis`, cis [batch, length, heads] (uniform), at positions 0..length-1."""
    gen = torch.Generator(device=device).manual_seed(seed)
    positions = torch.arange(length, device=device).expand(batch, -1)
    for layer in cache.layers:
        keys = torch.randn((batch, length, heads, dim), generator=gen, device=device, dtype=torch.float32).to(dtype)
        values = torch.randn((batch, length, heads, dim), generator=gen, device=device, dtype=torch.float32).to(dtype)
        cis = torch.rand((batch, length, heads), generator=gen, device=device).to(dtype) if with_cis else None
        layer.append(keys, values, cis, positions)
        del keys, values, cis  # freed before the next layer's are drawn: one layer's rows at a time
