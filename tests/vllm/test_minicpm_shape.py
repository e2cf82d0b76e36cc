"""A MiniCPM4-shaped forecastkv checkpoint in vLLM: muP scales, LongRoPE, InfLLM-v2 with the coarse LSE
and dense attention below `dense_len`, tiny random weights.  Its q/k/v and gate/up tensors load into
vLLM's fused linear layers through vLLM's loader (`serving/vllm_layers.py`), and its greedy tokens and
logprobs equal forecastkv's generate() for a prompt below dense_len and one well above it."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.vllm.engines import PAGE, TINY_VLLM_SHAPE, engine, hf_greedy, vllm_greedy

HEAD_DIM = 32
# the tests' tiny model with heads of 32 (vLLM-CPU's smallest) and MiniCPM4.1's extras
MINICPM_SHAPE = dict(
    TINY_VLLM_SHAPE,
    mup={"scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": 32},
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "long_factor": [1.0 + 0.5 * i for i in range(HEAD_DIM // 2)],
        "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
        "original_max_position_embeddings": 256,
    },
    # MiniCPM4.1's rules at a tiny scale: blocks of one page, 2 chosen + init + local, dense below 256
    sparse_config={
        "kernel_size": 32, "kernel_stride": 16, "block_size": PAGE, "init_blocks": 1, "window_size": PAGE,
        "topk": 2, "dense_len": 256, "lse": "coarse", "policy": "infllmv2", "selector": "query",
    },
)


@pytest.mark.slow
def test_minicpm_shaped_checkpoint_equals_generate(tmp_path):
    from forecastkv import ForecastKVConfig, ForecastKVForCausalLM

    torch.manual_seed(0)
    model = ForecastKVForCausalLM(ForecastKVConfig(**MINICPM_SHAPE)).eval()
    assert model.config.mup_config is not None and model.config.sparse.dense_len == 256
    model.save_pretrained(tmp_path / "minicpm-shaped")
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (100, 700)]
    expected = [hf_greedy(model, "infllmv2-query", p, 8) for p in prompts]
    del model
    llm = engine(str(tmp_path / "minicpm-shaped"), None, skip_tokenizer_init=True, max_model_len=1024)
    assert llm.apply_model(lambda served: type(served).__name__)[0] == "ForecastKVForVLLM"
    got = vllm_greedy(llm, prompts, 8)
    del llm
    gc.collect()
    for n, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(zip(got, expected)):
        assert tokens == ref_tokens, f"prompt {n} ({len(prompts[n])} tokens)"
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-3, f"prompt {n}"
