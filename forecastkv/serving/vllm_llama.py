"""forecastkv's dense mode served by vLLM's own Llama: its fused QKV and gate/up projections, fused
RMSNorm and SiluAndMul, rotary embedding, attention backend, batched prefill and tensor parallelism.

A forecastkv checkpoint is a Llama-family checkpoint with a few extra tensors (the Forecast heads,
NOSA's CIS projection), so when nothing sparse runs (`forecastkv_mode` "dense", or a checkpoint
without a sparse_config) and the geometry is one vLLM's `LlamaForCausalLM` computes exactly (no muP
scales, a rotary embedding of the plain kind), vLLM's own model serves it and the extra tensors are
skipped at load: a user who serves a forecastkv checkpoint densely pays nothing for it
(`benchmarks/vllm_throughput.py`: dense against vllm-native).  Every other case runs forecastkv's
decoder over the pages (`serving/vllm_model.py`).

Imports vLLM: loaded by `serving/vllm_model.py` only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.model_executor.models.llama import LlamaForCausalLM

# the attention projections vLLM's Llama has; a checkpoint's other attention tensors are forecastkv's own
LLAMA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def served_by_vllm_llama(config) -> bool:
    """Whether vLLM's `LlamaForCausalLM` computes this (mode-applied) config's dense model exactly:
    no sparse attention, no muP scales, the default rotary embedding."""
    rope = getattr(config, "rope_parameters", None) or {}
    return config.sparse is None and config.mup_config is None and rope.get("rope_type", "default") == "default"


def llama_tensor(name: str) -> bool:
    """Whether checkpoint tensor `name` is one vLLM's Llama loads (not a Forecast head, NOSA's A or delta)."""
    parts = name.split(".")
    if "self_attn" not in parts:
        return True
    attention = parts.index("self_attn")
    return attention + 1 < len(parts) and parts[attention + 1] in LLAMA_ATTENTION


class ForecastKVDenseLlama(LlamaForCausalLM):
    """vLLM's `LlamaForCausalLM` over a forecastkv checkpoint in dense mode; `load_weights` skips the
    tensors only forecastkv's sparse modes read."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((name, tensor) for name, tensor in weights if llama_tensor(name))
