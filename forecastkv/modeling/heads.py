"""Which Forecast head scores which layer: the one rule, used by the model, training and recall.

Layer 0 is scored by its own `current_proj` (there is no previous layer to forecast it); every
other layer m by layer m-1's `forecast_proj`, computed one layer ahead so its blocks can be
fetched while layer m-1 still runs.  The last layer's `forecast_proj` has no consumer.
"""

from __future__ import annotations

import torch


def scoring_head(layer: int) -> tuple[int, str]:
    """(owning layer, projection name) of the head whose vectors score layer `layer`'s blocks."""
    if layer < 0:
        raise ValueError(f"layer index must be >= 0, got {layer}")
    return (0, "current_proj") if layer == 0 else (layer - 1, "forecast_proj")


def scoring_head_name(layer: int) -> str:
    """The state-dict name of that head's weight (a `ForecastKVForCausalLM` parameter)."""
    owner, projection = scoring_head(layer)
    return f"model.layers.{owner}.self_attn.{projection}.weight"


def scoring_head_weight(layers, layer: int) -> torch.Tensor:
    """The weight [H*n*d, hidden] of that head, from the decoder `layers`."""
    owner, projection = scoring_head(layer)
    return getattr(layers[owner].self_attn, projection).weight


def scoring_vectors(layers, scored: int, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Forecast vectors [B, T, H*n, d] that score layer `scored`'s blocks, from the post-norm input
    normed [B, T, hidden] of the head's owning layer and RoPE cos/sin [B, T, d] (training and the
    recall protocol; the model's own loop hands each layer's vectors to the next)."""
    owner, projection = scoring_head(scored)
    return layers[owner].self_attn.project_forecast(normed, cos, sin, projection)


def trainable_head_names(num_layers: int) -> list[str]:
    """The heads that score some layer, in layer order: what forecast training fits."""
    return [scoring_head_name(m) for m in range(num_layers)]
