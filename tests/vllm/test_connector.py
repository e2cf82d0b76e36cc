"""Forecast-offload in vLLM through `ForecastLookaheadConnector`: with the pool rows of every block a
request's slot maps do not hold poisoned (NaN), greedy tokens still equal generate() with the
SparseCache (attention read only blocks the connector loaded); H2D bytes per decode step equal the
HF runtime's forecast-offload count for the same prompt within one block per layer; and every
`wait_for_layer_load(m + 1)` found layer m+1's blocks already requested."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.vllm.engines import engine, essay_prompts, hf_greedy, hf_model, record

MODE = "infllmv2-forecast"
NEW_TOKENS = 16
CONNECTOR = {
    "kv_connector": "ForecastLookaheadConnector",
    "kv_connector_module_path": "forecastkv.serving.vllm_connector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"evict": True},
}


def hf_runtime_bytes(model, prompt: list[int], tokens: list[int]) -> tuple[list[int], int]:
    """(H2D bytes per decode step, bytes of one block of one KV head) of the HF runtime's forecast-offload."""
    from forecastkv.eval.modes import attending_with, parse_mode
    from forecastkv.inference import OffloadedSparseCache

    with torch.no_grad(), attending_with(model, parse_mode(MODE)):
        cache = OffloadedSparseCache.for_model(model, mode="forecast-offload")
        model(torch.tensor([prompt]), cache=cache)
        for token in tokens[:-1]:
            model(torch.tensor([[token]]), cache=cache)
    return cache.stats()["h2d_bytes_per_step"], cache.layers[1].block_bytes()


@pytest.mark.slow
def test_connector_loads_what_the_forecast_plans(checkpoints):
    path = checkpoints["demo"]
    (prompt,) = essay_prompts([2000])
    model = hf_model(path)
    expected, _ = hf_greedy(model, MODE, prompt, NEW_TOKENS)
    hf_bytes, block = hf_runtime_bytes(model, prompt, expected)
    layers = model.config.num_hidden_layers
    del model

    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    llm = engine(path, MODE, enable_prefix_caching=False, kv_transfer_config=CONNECTOR)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    output = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    connector = get_kv_transfer_group()
    vllm_bytes = list(connector.tier.stats.per_step)
    found = list(connector.found_requested)
    del llm
    gc.collect()

    assert list(output.outputs[0].token_ids) == expected
    assert len(vllm_bytes) == len(hf_bytes) == NEW_TOKENS - 1
    slack = block * (layers - 1)  # one block per offloaded layer
    worst = max(abs(a - b) for a, b in zip(vllm_bytes, hf_bytes))
    assert worst <= slack, (vllm_bytes, hf_bytes)
    waits = [name for name, _ in found]
    assert len(waits) == (NEW_TOKENS - 1) * layers and all(ok for _, ok in found)
    record("connector", {
        "what": "H2D bytes per decode step, forecast-offload: vLLM's ForecastLookaheadConnector vs the HF runtime",
        "prompt_tokens": len(prompt), "decode_steps": len(vllm_bytes), "vllm": vllm_bytes, "hf_runtime": hf_bytes,
        "max_abs_difference": worst, "one_block_per_layer": slack,
        "waits_that_found_their_blocks_requested": f"{sum(ok for _, ok in found)}/{len(found)}",
    })
