"""Forecast-offload in vLLM through `ForecastLookaheadConnector`: with the pool rows of every block a
request's slot maps do not hold poisoned (NaN), greedy tokens still equal generate() with the
SparseCache (attention read only blocks the connector loaded); H2D bytes per decode step equal the
HF runtime's forecast-offload count for the same prompt within one block per layer; and every
`wait_for_layer_load(m + 1)` found layer m+1's blocks already requested.  The connector runs generate()'s
offload runtime: the same `TransferWorker` type over the same `HostBlockPool` type."""

from __future__ import annotations

import gc

import pytest

from tests.vllm.engines import engine, essay_prompts, hf_greedy, hf_model, hf_runtime_counts, record

MODE = "infllmv2-forecast"
NEW_TOKENS = 16
CONNECTOR = {
    "kv_connector": "ForecastLookaheadConnector",
    "kv_connector_module_path": "forecastkv.serving.vllm_connector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"evict": True},
}


@pytest.mark.slow
def test_connector_loads_what_the_forecast_plans(checkpoints):
    path = checkpoints["demo"]
    (prompt,) = essay_prompts([2000])
    model = hf_model(path)
    expected, _ = hf_greedy(model, MODE, prompt, NEW_TOKENS)
    counts, cache = hf_runtime_counts(model, MODE, prompt, expected)
    hf_bytes, block = counts["per_step"], cache.layers[1].store.block_bytes()
    layers = model.config.num_hidden_layers
    del model

    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    llm = engine(path, MODE, enable_prefix_caching=False, kv_transfer_config=CONNECTOR)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    output = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    connector = get_kv_transfer_group()
    vllm_bytes = list(connector.recent_h2d)  # what get_kv_connector_stats handed vLLM, call by call
    waits, found = connector.waits, connector.waits_found
    # generate()'s offload runtime under the pages: its worker and its pinned-pool host tier
    from forecastkv.inference import HostBlockPool, TransferWorker

    assert type(connector.tier.worker) is type(cache.layers[1].store.worker) is TransferWorker
    pool_types = {type(pool) for pool in connector.tier.host[1:]}
    assert pool_types == {type(cache.layers[1].store.host.pool)} == {HostBlockPool}
    del llm
    gc.collect()

    assert list(output.outputs[0].token_ids) == expected
    assert len(vllm_bytes) == len(hf_bytes) == NEW_TOKENS - 1
    slack = block * (layers - 1)  # one block per offloaded layer
    worst = max(abs(a - b) for a, b in zip(vllm_bytes, hf_bytes))
    assert worst <= slack, (vllm_bytes, hf_bytes)
    assert waits == found == (NEW_TOKENS - 1) * layers, (waits, found)
    record(
        "connector",
        {
            "what": "H2D bytes per decode step, forecast-offload: vLLM's ForecastLookaheadConnector vs the HF runtime",
            "prompt_tokens": len(prompt),
            "decode_steps": len(vllm_bytes),
            "vllm": vllm_bytes,
            "hf_runtime": hf_bytes,
            "max_abs_difference": worst,
            "one_block_per_layer": slack,
            "waits_that_found_their_blocks_requested": f"{found}/{waits}",
        },
    )


def test_stats_aggregate_and_reach_prometheus():
    """`LookaheadStats` as vLLM's loggers use it: rebuilt from the worker's dict (a copy: the same dict
    goes to each logger), aggregated over calls, reduced to the log line's fields, and observed into
    the connector's Prometheus series (a private registry here)."""
    import functools
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from forecastkv.serving.vllm_connector import ForecastLookaheadConnector

    shipped = {"h2d_bytes": [4096, 0], "blocks_wanted": 10, "block_hits": 7}
    total = ForecastLookaheadConnector.build_kv_connector_stats(shipped)
    total.aggregate(
        ForecastLookaheadConnector.build_kv_connector_stats({"h2d_bytes": [8192], "blocks_wanted": 6, "block_hits": 1})
    )
    assert shipped == {"h2d_bytes": [4096, 0], "blocks_wanted": 10, "block_hits": 7}
    assert total.reduce() == {
        "forecastkv_decode_steps": 3,
        "h2d_bytes": 12288,
        "h2d_bytes_per_step": 4096,
        "block_hit_rate": 0.5,
    }
    assert ForecastLookaheadConnector.build_kv_connector_stats(None).is_empty()
    nothing_wanted = ForecastLookaheadConnector.build_kv_connector_stats({"h2d_bytes": [0]})
    assert not nothing_wanted.is_empty() and "block_hit_rate" not in nothing_wanted.reduce()

    registry = CollectorRegistry()
    types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    prom = ForecastLookaheadConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    prom.observe(shipped, 0)
    prom.observe(total.data, 0)
    labels = {"model_name": "m", "engine": "0"}
    value = functools.partial(registry.get_sample_value, labels=labels)
    assert value("vllm:forecastkv_h2d_bytes_per_step_sum") == 4096 + 12288
    assert value("vllm:forecastkv_h2d_bytes_per_step_count") == 2 + 3
    assert value("vllm:forecastkv_blocks_wanted_total") == 10 + 16
    assert value("vllm:forecastkv_block_hits_total") == 7 + 8
