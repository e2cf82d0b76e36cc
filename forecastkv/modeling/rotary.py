"""Rotary position embeddings: the cos/sin tables of a config's `rope_parameters` (default, linear,
llama3, yarn, longrope).  Apart from the model classes, so that loading a checkpoint
(`checkpoints.py`, which recomputes the tables on their device) needs no model module."""

from __future__ import annotations

import math

import torch
from torch import nn

STATIC_HF_TYPES = ("linear", "llama3", "yarn")


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float()


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions.  Supports rope_type default, linear, llama3, yarn and longrope.

    LongRoPE (MiniCPM / Phi-3): inverse frequencies are divided by `short_factor`, or by
    `long_factor` when a sequence's length in the call, max(position)+1, exceeds
    `original_max_position_embeddings` (decided per sequence, so a sequence's tables do not depend on
    the batch it runs in, as in a serving engine's; MiniCPM's reference decides once per batch);
    cos and sin are multiplied by sqrt(1 + ln(max_pos / original_max) / ln(original_max)).
    """

    def __init__(self, config) -> None:
        super().__init__()
        params = dict(config.rope_parameters or {})
        self.rope_type = params.get("rope_type", params.get("type", "default"))
        dim = config.head_dim
        theta = float(params.get("rope_theta", 10000.0))
        self.original_max = None
        self.attention_scaling = 1.0
        if self.rope_type == "default":
            inv_freq = default_inv_freq(theta, dim)
        elif self.rope_type == "longrope":
            base = default_inv_freq(theta, dim)
            short = torch.tensor(params["short_factor"], dtype=torch.float32)
            long = torch.tensor(params["long_factor"], dtype=torch.float32)
            if short.numel() != dim // 2 or long.numel() != dim // 2:
                raise ValueError(
                    f"longrope factors need head_dim/2 = {dim // 2} entries, got "
                    f"{short.numel()} (short) and {long.numel()} (long)"
                )
            self.original_max = int(params.get("original_max_position_embeddings", config.max_position_embeddings))
            inv_freq = base / short
            self.register_buffer("long_inv_freq", base / long, persistent=False)
            ratio = config.max_position_embeddings / self.original_max
            default_factor = 1.0 if ratio <= 1.0 else math.sqrt(1 + math.log(ratio) / math.log(self.original_max))
            self.attention_scaling = float(params.get("attention_factor") or default_factor)
        elif self.rope_type in STATIC_HF_TYPES:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config, None)
        else:
            raise ValueError(
                f"rope_type {self.rope_type!r} is not supported; use one of default, longrope, {STATIC_HF_TYPES}"
            )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] (int; -1 padding is clamped to 0) -> cos, sin [B, T, head_dim] in `dtype`."""
        inv_freq = self.inv_freq.to(positions.device)
        if self.original_max is not None:  # per sequence: a batch gives each row its own factors
            past = (positions.amax(dim=-1, keepdim=True) + 1 > self.original_max).unsqueeze(-1)  # [B, 1, 1]
            inv_freq = torch.where(past, self.long_inv_freq.to(positions.device), inv_freq)
        freqs = positions.clamp(min=0).float().unsqueeze(-1) * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)
