"""vLLM's linear layers inside forecastkv's decoder, for the modes vLLM's own Llama cannot compute.

`use_vllm_layers(model, quant_config, prefix)` swaps a `ForecastKVForCausalLM`'s projections for
vLLM's: one `QKVParallelLinear` per attention (three matmuls become one), `RowParallelLinear` for
o_proj, a `MergedColumnParallelLinear` gate/up with vLLM's fused `SiluAndMul` and a
`RowParallelLinear` down projection per MLP, `ReplicatedLinear` Forecast heads and lm_head.  vLLM's
loader then packs each weight for its CPU GEMM (oneDNN) after `load_weights`, as it does for its own
models.  Everything else (norms, rotary tables, selection, the Forecast handoff, NOSA's CIS) stays
forecastkv's, so the sparse rules are the ones `generate()` runs.

`load_weights` maps a checkpoint's q/k/v and gate/up tensors onto the fused parameters through
their vLLM weight loaders (`STACKED`), and a tied lm_head onto the embedding's tensor.

Imports vLLM: loaded by `serving/vllm_model.py` only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from ..errors import ConfigError

# (fused parameter, checkpoint projection, shard id): the tensors one vLLM parameter is loaded from
STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class FusedMLP(nn.Module):
    """Llama's MLP as vLLM runs it: x [..., hidden] -> down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, config, quant_config, prefix: str) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ConfigError(f"forecastkv's vLLM model runs hidden_act 'silu' only, got {config.hidden_act!r}")
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inner] * 2, bias=bias, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj",
            return_bias=False,
        )
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(
            inner, hidden, bias=bias, quant_config=quant_config, prefix=f"{prefix}.down_proj", return_bias=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def use_vllm_layers(model, quant_config=None, prefix: str = "") -> None:
    """Swap `model`'s (a `ForecastKVForCausalLM`) projections for vLLM's linear layers, in place,
    before its weights are loaded (`load_weights`)."""
    config = model.config
    hidden, d = config.hidden_size, config.head_dim
    for idx, layer in enumerate(model.model.layers):
        attn, name = layer.self_attn, f"{prefix}model.layers.{idx}"
        bias = config.attention_bias
        del attn.q_proj, attn.k_proj, attn.v_proj
        attn.qkv_proj = QKVParallelLinear(
            hidden, d, attn.num_heads, attn.num_kv_heads, bias=bias, quant_config=quant_config,
            prefix=f"{name}.self_attn.qkv_proj", return_bias=False,
        )
        attn.fused_qkv = True
        attn.o_proj = RowParallelLinear(
            attn.num_heads * d, hidden, bias=bias, quant_config=quant_config, prefix=f"{name}.self_attn.o_proj",
            return_bias=False,
        )
        for head in ("forecast_proj", "current_proj"):
            if hasattr(attn, head):
                width = getattr(attn, head).out_features
                setattr(attn, head, ReplicatedLinear(hidden, width, bias=False, prefix=f"{name}.self_attn.{head}",
                                                     return_bias=False))
        layer.mlp = FusedMLP(config, quant_config, f"{name}.mlp")
    model.lm_head = ReplicatedLinear(hidden, config.vocab_size, bias=False, prefix=f"{prefix}lm_head",
                                     return_bias=False)


def load_weights(model, weights: Iterable[tuple[str, torch.Tensor]], mode: str) -> set[str]:
    """Load checkpoint tensors into `model` after `use_vllm_layers`; returns the parameter names
    loaded.  A ConfigError names a tensor of another shape and every parameter the checkpoint lacks."""
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {}  # parameter -> the shards (None: the whole tensor) loaded into it
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, tensor in weights:
        targets = [(name, None)]
        for fused, part, shard in STACKED:
            if f".{part}." in name:
                targets = [(name.replace(f".{part}.", f".{fused}."), shard)]
                break
        if tied and name == "model.embed_tokens.weight":
            targets.append(("lm_head.weight", None))
        for target, shard in targets:
            if target not in params:
                continue  # an untied lm_head under tie_word_embeddings, or buffers the model recomputes
            param = params[target]
            if shard is None and param.shape != tensor.shape:
                raise ConfigError(
                    f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the model needs "
                    f"{tuple(param.shape)} (weights from another geometry?)"
                )
            loader = getattr(param, "weight_loader", default_weight_loader)
            with torch.no_grad():
                if shard is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard)
            loaded.setdefault(target, set()).add(shard)
    missing = sorted(set(params) - set(loaded))
    for fused, part, shard in STACKED:  # a fused parameter needs every one of its tensors
        missing += [name.replace(f".{fused}.", f".{part}.") for name, shards in loaded.items()
                    if f".{fused}." in name and shard not in shards]
    if missing:
        raise ConfigError(
            f"mode {mode!r}: the checkpoint has no {', '.join(missing[:6])}"
            + (f" (and {len(missing) - 6} more)" if len(missing) > 6 else "")
        )
    return set(loaded)
