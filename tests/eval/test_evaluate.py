"""One example under one mode, checked against independent computations on the tiny model:
chunked perplexity = one full forward, recall = selection.py's counts on one full forward, bytes per
step = the count by hand, mode switching = a model loaded in that mode, offloaded = resident."""

import math

import pytest
import torch
import torch.nn.functional as F

from forecastkv import ForecastKVConfig, ForecastKVForCausalLM
from forecastkv.eval.codec import ByteCodec
from forecastkv.eval.evaluate import evaluate_example
from forecastkv.eval.modes import attending_with, parse_mode
from forecastkv.eval.tasks import generate_example
from forecastkv.modeling import selection as sel
from tests.helpers import TINY_SPARSE

from .common import EVAL_MODEL

ESSAYS = ["Rivers carry silt to the sea. Farmers plant rice in spring. Markets open early. " * 40]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = ForecastKVConfig(
        **EVAL_MODEL, sparse_config=dict(TINY_SPARSE), forecast={"enabled": True, "heads_per_group": 1}
    )
    return ForecastKVForCausalLM(config).eval()


def test_chunked_perplexity_equals_one_forward(model):
    codec = ByteCodec(128)
    ex = generate_example("perplexity", codec, 300, essays=ESSAYS)
    mode = parse_mode("infllmv2-query")
    with attending_with(model, mode):
        got = evaluate_example(model, ex, mode, codec, prefill_chunk=64, bucket_tokens=100)
        ids = torch.tensor([ex.input_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, :-1]
    nll = F.cross_entropy(logits.float(), ids[0, 1:], reduction="none").double()
    assert got["score"] == pytest.approx(math.exp(nll.mean().item()), rel=1e-5)
    assert [b["tokens"] for b in got["buckets"]] == [100, 100, 99]
    assert got["buckets"][1]["nll_sum"] == pytest.approx(nll[100:200].sum().item(), rel=1e-5)


def test_recall_equals_selection_counts_on_one_forward(model):
    codec = ByteCodec(128)
    ex = generate_example("passkey", codec, 400, essays=ESSAYS, max_new_tokens=2)
    mode = parse_mode("infllmv2-forecast")
    start = 48
    with attending_with(model, mode):
        got = evaluate_example(model, ex, mode, codec, prefill_chunk=96, recall_start=start)
        ids = torch.tensor([ex.input_ids])
        with torch.no_grad():
            records = model(ids, collect_selections=True).selections
    positions = torch.arange(ids.shape[1]).view(1, -1)
    sparse = model.config.sparse
    assert got["recall"]["start"] == start
    for layer, record in enumerate(records):
        rows = slice(start, None)  # the rows counted: position >= start
        hits, wanted, chance = sel.forecast_recall_counts(
            record["query"][:, :, rows], record["forecast"][:, :, rows], positions[:, rows], sparse
        )
        assert got["recall"]["counts"][layer] == pytest.approx(
            [hits.sum().item(), wanted.sum().item(), chance.sum().item()], rel=1e-6
        )
    assert 0.0 <= min(got["recall"]["per_layer"]) and max(got["recall"]["per_layer"]) <= 1.0


def test_bytes_per_decode_step(model):
    codec = ByteCodec(128)
    ex = generate_example("passkey", codec, 400, essays=ESSAYS, max_new_tokens=4)
    c, sparse = model.config, model.config.sparse
    per_head_token = 2 * c.head_dim * 4  # K and V, fp32
    prompt = len(ex.input_ids)
    keys = [prompt + s for s in (1, 2, 3)]  # stored tokens at the 3 decode steps (incl. the decoded one)
    dense_mode = parse_mode("dense")
    with attending_with(model, dense_mode):
        dense = evaluate_example(model, ex, dense_mode, codec)
    assert dense["decode_steps"] == 3
    assert dense["kv_read_bytes_per_step"] == pytest.approx(
        sum(k * c.num_key_value_heads * per_head_token * c.num_hidden_layers for k in keys) / 3
    )
    query_mode = parse_mode("infllmv2-query")
    with attending_with(model, query_mode):
        sparse_run = evaluate_example(model, ex, query_mode, codec)
    # deep in the sequence every head reads the full budget: budget - 1 complete blocks + the current partial block
    bs, budget = sparse.block_size, sparse.budget_blocks
    expect = [
        ((budget - 1) * bs + (k - (k - 1) // bs * bs)) * c.num_key_value_heads * per_head_token * c.num_hidden_layers
        for k in keys
    ]
    assert sparse_run["kv_read_bytes_per_step"] == pytest.approx(sum(expect) / 3)
    assert sparse_run["h2d_bytes_per_step"] is None and sparse_run["offload_stats"] is None


def test_switched_modes_match_models_loaded_in_that_mode(model):
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(1))
    state = model.state_dict()
    saved = dict(model.config.sparse_config)
    for name, sparse in (
        ("dense", None),
        ("infllmv2-query", {**TINY_SPARSE, "selector": "query"}),
        ("infllmv2-forecast", {**TINY_SPARSE, "selector": "forecast"}),
    ):
        config = ForecastKVConfig(**EVAL_MODEL, sparse_config=sparse, forecast={"enabled": True, "heads_per_group": 1})
        loaded = ForecastKVForCausalLM(config).eval()
        loaded.load_state_dict(state)
        with torch.no_grad(), attending_with(model, parse_mode(name)):
            switched = model(ids).logits
        with torch.no_grad():
            reference = loaded(ids).logits
        torch.testing.assert_close(switched, reference, rtol=0, atol=0)
    assert model.config.sparse_config == saved  # restored after each switch


def test_offloaded_cache_modes_give_resident_results(model):
    pytest.importorskip("forecastkv.inference")
    codec = ByteCodec(128)
    ex = generate_example("passkey", codec, 320, essays=ESSAYS, max_new_tokens=4)
    for resident_name, offloaded_name in (
        ("infllmv2-query", "infllmv2-query@sparse-offload"),
        ("infllmv2-forecast", "infllmv2-forecast@forecast-offload"),
    ):
        runs = {}
        for name in (resident_name, offloaded_name):
            mode = parse_mode(name)
            with attending_with(model, mode):
                runs[name] = evaluate_example(model, ex, mode, codec)
        a, b = runs[resident_name], runs[offloaded_name]
        assert a["prediction"] == b["prediction"] and sum(a["recall"]["counts"], []) == pytest.approx(
            sum(b["recall"]["counts"], [])
        )
        assert b["h2d_bytes_per_step"] is not None and 0 < b["h2d_bytes_per_step"] <= b["kv_read_bytes_per_step"]
        assert b["offload_stats"]["mode"] == offloaded_name.split("@")[1]


def test_mode_names_and_pairs():
    assert parse_mode("infllmv2-forecast").name == "infllmv2-forecast"
    with pytest.raises(ValueError, match="unknown attention mode 'sparse'"):
        parse_mode("sparse")
    pytest.importorskip("forecastkv.inference")
    assert parse_mode("infllmv2-forecast@forecast-offload").cache == "forecast-offload"
    with pytest.raises(ValueError, match="selects blocks with the query selector"):
        parse_mode("infllmv2-forecast@sparse-offload")


def test_dense_offload_moves_the_whole_kv_each_step(model):
    pytest.importorskip("forecastkv.inference")
    codec = ByteCodec(128)
    ex = generate_example("passkey", codec, 320, essays=ESSAYS, max_new_tokens=3)
    mode = parse_mode("dense@dense-offload")
    with attending_with(model, mode):
        got = evaluate_example(model, ex, mode, codec)
    # layer 0 stays resident; every other layer's whole K/V crosses once per step
    c = model.config
    keys = [len(ex.input_ids) + s for s in (1, 2)]
    whole = [k * c.num_key_value_heads * 2 * c.head_dim * 4 * (c.num_hidden_layers - 1) for k in keys]
    assert got["h2d_bytes_per_step"] == pytest.approx(sum(whole) / 2, rel=0.02)


def test_nosa_modes_on_a_model_with_a_delta():
    torch.manual_seed(0)
    nosa = {**TINY_SPARSE, "policy": "nosa"}
    config = ForecastKVConfig(**EVAL_MODEL, sparse_config=nosa, forecast={"enabled": True, "heads_per_group": 1})
    model = ForecastKVForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.A.normal_()  # a non-zero CIS bias, so NOSA differs from InfLLM-v2
    codec = ByteCodec(128)
    ex = generate_example("passkey", codec, 320, essays=ESSAYS, max_new_tokens=2)
    ids = torch.tensor([ex.input_ids])
    for name, selector in (("nosa", "query"), ("nosa-forecast", "forecast")):
        mode = parse_mode(name)
        loaded = ForecastKVForCausalLM(
            ForecastKVConfig(
                **EVAL_MODEL,
                sparse_config={**nosa, "selector": selector},
                forecast={"enabled": True, "heads_per_group": 1},
            )
        ).eval()
        loaded.load_state_dict(model.state_dict())
        with torch.no_grad(), attending_with(model, mode):
            torch.testing.assert_close(model(ids).logits, loaded(ids).logits, rtol=0, atol=0)
            got = evaluate_example(model, ex, mode, codec)
        assert got["decode_steps"] == 1 and got["kv_read_bytes_per_step"] > 0
    with torch.no_grad(), attending_with(model, parse_mode("infllmv2-query")):
        assert not torch.equal(model(ids).logits, loaded(ids).logits)
