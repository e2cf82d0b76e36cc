"""Initialisation of the Forecast heads (`forecast_proj` on every layer, `current_proj` on layer 0).

Two schemes (`forecast.init`):

* ``kaiming``: SparDA's indexer init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (fan_in = hidden size).
* ``next_query``: a warm start from the query projection the head has to imitate.

  - `forecast_proj` of layer l (which predicts layer l+1's blocks) starts from layer l+1's
    `q_proj`, averaged over each forecast vector's query heads (the G query heads of a KV group are
    split into `heads_per_group` contiguous parts, one per vector), and corrected for the two
    layers' input norms: the forecast reads layer l's normed state w^l * x_hat while q^{l+1} reads
    w^{l+1} * x_hat', so  W_f = mean_heads(W_q^{l+1}) . diag(r),  r = w^{l+1} / w^l.
  - `current_proj` of layer 0 starts from layer 0's own `q_proj` (same input, no correction).
  - the last layer's `forecast_proj` has no consumer: it is zero (as in a SparDA checkpoint,
    which leaves it out), under either scheme.

  Created heads are deterministic: Kaiming draws come from a private CPU generator seeded with
  `seed` (`DEFAULT_SEED` when none is given), never from the global RNG, so two loads of one base
  with `forecast={"init": ...}` give bit-identical heads (and one weights digest, which the context
  store keys on).

  Keeping the scale sane.  Where a norm weight of layer l is tiny the ratio explodes (SmolLM2's
  layer-0 input-norm weights go down to 2e-4 while layer 1's are ~0.16, ratios up to ~3000), and
  copied columns would be hundreds of times larger than any other weight: AdamW (whose steps are
  ~lr in absolute size) would barely move them.  Two steps keep every layer at the scale of the
  query projection it copies:

    1. clamp |r| per channel to [median|r| / RATIO_SPREAD, median|r| * RATIO_SPREAD] (sign kept;
       RATIO_SPREAD = 8), so a few outlier channels cannot dominate;
    2. rescale the whole matrix so its RMS row norm equals that of the head-averaged q_proj rows
       it was copied from.

  Step 2 changes only a per-layer constant: the forecast's top-k (a raw dot product, SparDA §2.4)
  is unchanged by it, only the training softmax's temperature.

* Calibration (`calibrate_forecast_scale`, any init): the student is a softmax of f . Kc / sqrt(d),
  so a head whose outputs are 40x shorter than the real queries starts far too flat, and
  fixed-size Adam steps then rewrite its direction before they fix its length (SmolLM2's heads
  0->1 and 1->2 after step 2 above).  Measured on real rows, each vector is rescaled so its mean
  squared output norm equals that of the real queries it imitates: its own query head when there
  is one vector per query head (n = G), else the mean of its group's heads.  A per-vector
  constant: one-vector selections are unchanged, only the softmax temperature moves.
"""

from __future__ import annotations

import math

import torch

from .heads import scoring_head_weight

RATIO_SPREAD = 8.0
DEFAULT_SEED = 0  # the Kaiming draws when no seed is given
INITS = ("kaiming", "next_query")


def _layers(model):
    """The decoder layers of a ForecastKVForCausalLM or ForecastKVModel."""
    inner = getattr(model, "model", model)
    return inner.layers


def _kaiming_(weight: torch.Tensor, generator: torch.Generator) -> None:
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)) in place; drawn on the CPU so a seed gives the same
    weights on every device."""
    bound = 1.0 / math.sqrt(weight.shape[1])
    values = torch.empty(weight.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
    weight.copy_(values.to(device=weight.device, dtype=weight.dtype))


def head_averaged_query(q_weight: torch.Tensor, num_kv_heads: int, heads_per_group: int, head_dim: int) -> torch.Tensor:
    """q_proj weight [Hq*d, hidden] -> [H_kv*n*d, hidden]: per KV group, the G query heads split into
    n contiguous parts (sizes differ by at most one when n does not divide G), each averaged."""
    hidden = q_weight.shape[1]
    heads = q_weight.float().view(num_kv_heads, -1, head_dim, hidden)  # [H, G, d, hidden]
    parts = torch.tensor_split(heads, heads_per_group, dim=1)
    return torch.stack([p.mean(dim=1) for p in parts], dim=1).reshape(-1, hidden)


def norm_ratio(w_next: torch.Tensor, w_this: torch.Tensor, spread: float = RATIO_SPREAD) -> torch.Tensor:
    """Per-channel r = w_next / w_this [hidden], |r| clamped to [median/spread, median*spread]."""
    w_this = w_this.float()
    safe = torch.where(w_this.abs() < 1e-12, torch.full_like(w_this, 1e-12), w_this)
    ratio = w_next.float() / safe
    median = ratio.abs().median().clamp(min=1e-12)
    magnitude = ratio.abs().clamp(min=median / spread, max=median * spread)
    sign = torch.where(ratio < 0, -1.0, 1.0)
    return sign * magnitude


def _rms_row_norm(weight: torch.Tensor) -> torch.Tensor:
    return weight.float().norm(dim=1).pow(2).mean().sqrt()


def next_query_weight(
    q_weight: torch.Tensor,
    w_norm_next: torch.Tensor,
    w_norm_this: torch.Tensor,
    num_kv_heads: int,
    heads_per_group: int,
    head_dim: int,
) -> torch.Tensor:
    """The `next_query` forecast weight [H_kv*n*d, hidden] (fp32) for one layer (see module doc)."""
    source = head_averaged_query(q_weight, num_kv_heads, heads_per_group, head_dim)
    weight = source * norm_ratio(w_norm_next, w_norm_this).view(1, -1)
    return weight * (_rms_row_norm(source) / _rms_row_norm(weight).clamp(min=1e-12))


@torch.no_grad()
def apply_forecast_init(model, init: str, seed: int | None = None) -> None:
    """Initialise every Forecast head of `model` in place.

    model: a ForecastKVForCausalLM / ForecastKVModel with forecast heads; init: "kaiming" |
    "next_query"; seed: draws the Kaiming weights from a private CPU generator (None:
    `DEFAULT_SEED`; the global RNG is never used, so the heads are a function of the base and the
    seed).  The last layer's `forecast_proj` (no consumer) is zero.  Weights keep their dtype and device.
    """
    if init not in INITS:
        raise ValueError(f"forecast init {init!r} is not one of {INITS}")
    layers = _layers(model)
    if not hasattr(layers[0].self_attn, "forecast_proj"):
        raise ValueError("the model has no forecast heads: build it with forecast={'enabled': True, ...}")
    generator = torch.Generator().manual_seed(DEFAULT_SEED if seed is None else seed)
    config = layers[0].self_attn.config
    n = config.forecast_config.heads_per_group
    h_kv, d = config.num_key_value_heads, config.head_dim
    last = len(layers) - 1
    for idx, layer in enumerate(layers):
        attn = layer.self_attn
        heads = [("forecast_proj", idx + 1)] + ([("current_proj", 0)] if idx == 0 else [])
        for name, source_idx in heads:
            weight = getattr(attn, name).weight
            if name == "forecast_proj" and idx == last:
                weight.zero_()  # no consumer: nothing to initialise, nothing random
                continue
            if init == "kaiming":
                _kaiming_(weight, generator)
                continue
            source = layers[source_idx]
            if name == "current_proj":
                new = head_averaged_query(source.self_attn.q_proj.weight, h_kv, n, d)
            else:
                new = next_query_weight(
                    source.self_attn.q_proj.weight,
                    source.input_layernorm.weight,
                    layer.input_layernorm.weight,
                    h_kv,
                    n,
                    d,
                )
            weight.copy_(new.to(device=weight.device, dtype=weight.dtype))


@torch.no_grad()
def calibrate_forecast_scale(model, head_sq: torch.Tensor, query_sq: torch.Tensor) -> torch.Tensor:
    """Rescale every head in place so its output norm matches the real queries'.

    head_sq fp32 [L, H*n]: mean squared norm of the vectors scoring layer m (measured on real rows);
    query_sq fp32 [L, Hq]: mean squared norm of layer m's real queries per query head.  Vector v of
    group h targets query head h*G + v when n = G (each vector stands for one query head: equal
    norms would change its group softmax), else the mean over the group's G heads; it is
    multiplied by sqrt(target / head_sq[m, h*n + v]).  Returns the factors [L, H*n].
    """
    layers = _layers(model)
    config = layers[0].self_attn.config
    n, d = config.forecast_config.heads_per_group, config.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if head_sq.shape != (len(layers), kv_heads * n) or query_sq.shape != (len(layers), heads):
        raise ValueError(
            f"head_sq {tuple(head_sq.shape)} / query_sq {tuple(query_sq.shape)} must be "
            f"[{len(layers)}, {kv_heads * n}] / [{len(layers)}, {heads}]"
        )
    group = heads // kv_heads
    target = (
        query_sq if n == group else query_sq.view(len(layers), kv_heads, group).mean(-1).repeat_interleave(n, dim=1)
    )
    factors = (target / head_sq.clamp(min=1e-20)).sqrt()
    for layer in range(len(layers)):
        weight = scoring_head_weight(layers, layer)
        scale = factors[layer].repeat_interleave(d).to(device=weight.device, dtype=torch.float32)
        weight.copy_((weight.float() * scale[:, None]).to(weight.dtype))
    return factors
