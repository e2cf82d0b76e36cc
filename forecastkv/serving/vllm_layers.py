"""vLLM's linear layers inside forecastkv's decoder, for the modes vLLM's own Llama cannot compute.

`use_vllm_layers(model, quant_config, prefix)` swaps a `ForecastKVForCausalLM`'s projections for
vLLM's: one `QKVParallelLinear` per attention (three matmuls become one), `RowParallelLinear` for
o_proj, a `MergedColumnParallelLinear` gate/up with vLLM's fused `SiluAndMul` and a
`RowParallelLinear` down projection per MLP, `ColumnParallelLinear` Forecast heads (sharded like
q_proj) and a `ReplicatedLinear` lm_head.  vLLM's loader then packs each weight for its CPU GEMM
(oneDNN) after `load_weights`, as it does for its own models.  Everything else (norms, rotary tables,
selection, the Forecast handoff, NOSA's CIS) stays forecastkv's, so the sparse rules are the ones
`generate()` runs.

Tensor parallelism shards attention by KV group: each of the T ranks holds H / T KV heads, their
query heads and their Forecast vectors, so a group's selection (which sums its query heads) and the
Forecast handoff (layer m's vectors for layer m+1's heads) stay on one rank, and o_proj / down_proj
sum the ranks' parts.  NOSA's CIS bias reads every KV head's values (`delta` mixes them): each rank
gathers the values, computes the bias of all heads and keeps its own (`sharded_cis`).

`load_weights` maps a checkpoint's q/k/v and gate/up tensors onto the fused parameters through
their vLLM weight loaders (`STACKED`), and a tied lm_head onto the embedding's tensor.

Imports vLLM: loaded by `serving/vllm_model.py` only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    tensor_model_parallel_all_gather,
)
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
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


def check_tensor_parallel(config, ranks: int) -> None:
    """A ConfigError unless every one of `ranks` tensor-parallel ranks can hold whole KV groups:
    num_key_value_heads must divide by it (vLLM would replicate KV heads instead, splitting a group's
    query heads, whose summed scores select its blocks, over ranks)."""
    if ranks > 1 and config.num_key_value_heads % ranks:
        raise ConfigError(
            f"tensor_parallel_size={ranks} must divide num_key_value_heads={config.num_key_value_heads}: "
            "forecastkv shards attention by KV group (its selection sums a group's query heads)"
        )


def sharded_cis(attn, ranks: int, rank: int):
    """NOSA's `compute_cis` on one tensor-parallel rank: values [..., H/T, d] of this rank's heads ->
    bias [..., H/T].  `delta` reads all H heads' values, so they are gathered from the ranks first
    (rank order is head order); A and delta are whole on every rank (H + H*H*d numbers)."""
    heads = slice(rank * attn.num_kv_heads, (rank + 1) * attn.num_kv_heads)

    def compute_cis(values: torch.Tensor) -> torch.Tensor:
        local = values.flatten(-2).contiguous()
        every = tensor_model_parallel_all_gather(local, dim=-1) if ranks > 1 else local
        return (attn.A * F.softplus(attn.delta(every)))[..., heads]

    return compute_cis


def max_over_ranks():
    """The in-place max of a tensor over the tensor-parallel ranks, or None on one rank: a decode step's
    heat under a selector that carries blocks (`modeling/carry.py`), each rank having weighed only its
    own KV heads, so every rank carries the blocks one rank holding all heads would."""
    if get_tensor_model_parallel_world_size() == 1:
        return None
    group = get_tp_group().device_group

    def reduce(tensor: torch.Tensor) -> None:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group)

    return reduce


def use_vllm_layers(model, quant_config=None, prefix: str = "") -> None:
    """Swap `model`'s (a `ForecastKVForCausalLM`) projections for vLLM's linear layers, in place,
    before its weights are loaded (`load_weights`); under tensor parallelism each attention keeps
    this rank's KV groups (`check_tensor_parallel`)."""
    config = model.config
    hidden, d = config.hidden_size, config.head_dim
    ranks, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    check_tensor_parallel(config, ranks)
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
            if hasattr(attn, head):  # [H * n * d] rows, KV head outermost: a contiguous shard is H / T heads'
                width = getattr(attn, head).out_features
                setattr(attn, head, ColumnParallelLinear(hidden, width, bias=False, gather_output=False,
                                                         prefix=f"{name}.self_attn.{head}", return_bias=False))
        attn.num_heads, attn.num_kv_heads = attn.num_heads // ranks, attn.num_kv_heads // ranks
        if attn.nosa_bias and ranks > 1:
            attn.compute_cis = sharded_cis(attn, ranks, rank)  # an instance attribute: it shadows the method
        layer.mlp = FusedMLP(config, quant_config, f"{name}.mlp")
    model.lm_head = ReplicatedLinear(hidden, config.vocab_size, bias=False, prefix=f"{prefix}lm_head",
                                     return_bias=False)


def checkpoint_shape(model, name: str, param: torch.Tensor) -> tuple[int, ...]:
    """The whole checkpoint tensor's shape for `model`'s parameter `name`, which on a
    tensor-parallel rank holds one shard: a column-parallel layer's output rows, a row-parallel
    layer's weight columns (vLLM's `output_dim` / `input_dim` attributes)."""
    shape = list(param.shape)
    layer = model.get_submodule(name.rpartition(".")[0])
    if isinstance(layer, ColumnParallelLinear):
        dim = getattr(param, "output_dim", None)
    elif isinstance(layer, RowParallelLinear):
        dim = getattr(param, "input_dim", None)
    else:
        dim = None
    if dim is not None:
        shape[dim] *= get_tensor_model_parallel_world_size()
    return tuple(shape)


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
            if shard is None and checkpoint_shape(model, target, param) != tuple(tensor.shape):
                raise ConfigError(
                    f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the model needs "
                    f"{checkpoint_shape(model, target, param)} (weights from another geometry?)"
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
