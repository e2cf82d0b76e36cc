"""The feature cache against a direct computation, init calibration, and the recall protocol
against the model's own recorded selections (tiny random model)."""

import torch

from forecastkv import ForecastKVConfig, ForecastKVForCausalLM
from forecastkv.modeling import selection as sel
from forecastkv.modeling.attention import apply_rope
from forecastkv.modeling.forecast_init import apply_forecast_init
from forecastkv.training.features import build_features, cached_rows, head_vectors
from forecastkv.training.objective import ObjectiveConfig, layer_loss, rows_kl
from forecastkv.training.recall import forecast_recall, measure_recall_counts
from tests.helpers import TINY_MODEL
from tests.helpers import TRAINING_SPARSE as TINY_SPARSE


def tiny(per_group=1, sparse=None, seed=0):
    torch.manual_seed(seed)
    config = ForecastKVConfig(
        **TINY_MODEL, sparse_config=sparse or TINY_SPARSE, forecast={"enabled": True, "heads_per_group": per_group}
    )
    model = ForecastKVForCausalLM(config).eval()
    apply_forecast_init(model, "kaiming", seed=seed)
    return model


def direct_layer_inputs(model, ids):
    """Per layer: post-norm input, post-RoPE queries, keys, cos/sin (a plain loop, dense backbone)."""
    inner = model.model
    hidden = inner.embed_tokens(ids)
    positions = torch.arange(ids.shape[1]).view(1, -1)
    cos, sin = inner.rotary_emb(positions, hidden.dtype)
    out = []
    for layer in inner.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        b, t, _ = x.shape
        q = apply_rope(attn.q_proj(x).view(b, t, attn.num_heads, attn.head_dim), cos, sin)
        k = apply_rope(attn.k_proj(x).view(b, t, attn.num_kv_heads, attn.head_dim), cos, sin)
        v = attn.v_proj(x).view(b, t, attn.num_kv_heads, attn.head_dim)
        ctx = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2).repeat_interleave(attn.group, 1),
            v.transpose(1, 2).repeat_interleave(attn.group, 1),
            is_causal=True,
        )
        hidden = hidden + attn.o_proj(ctx.transpose(1, 2).reshape(b, t, -1))
        out.append((x, q, k, cos, sin))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return out


@torch.no_grad()
def test_cached_loss_equals_layer_loss_on_the_direct_inputs():
    """Cached rows (all rows) + rows_kl per layer == `layer_loss` (itself equal to the loops
    reference, test_objective.py) on inputs from an independent plain loop."""
    model = tiny(per_group=2)
    sparse = model.config.sparse
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    for objective in (ObjectiveConfig(chunk_size=16), ObjectiveConfig(loss="full", chunk_size=7)):
        rows = cached_rows(48, 0, None, None)
        feats = build_features(model, ids, rows, sparse, objective, backbone="dense")
        assert (feats.targets is None) == (objective.loss == "full")
        direct = direct_layer_inputs(model, ids)
        positions = torch.arange(48).expand(2, -1)
        for m in range(3):
            x_prev = direct[m - 1][0] if m else direct[0][0]
            name = "forecast_proj" if m else "current_proj"
            attn = model.model.layers[m - 1 if m else 0].self_attn
            forecast = attn.project_forecast(x_prev, direct[m][3], direct[m][4], name)
            _, q, k, _, _ = direct[m]
            ckeys = sel.compress_keys(k, sparse.kernel_size, sparse.kernel_stride)
            expected = layer_loss(q, k, ckeys, forecast, positions, sparse, objective)
            targets = None if feats.targets is None else feats.targets[m]  # cached top-k targets ("topk" only)
            cached = rows_kl(
                head_vectors(model, feats, m),
                feats.ckeys[m],
                feats.positions,
                feats.teachers[m],
                sparse,
                objective.loss,
                targets,
            )
            assert abs(cached.item() / (2 * 2 * 48) - expected.item()) <= 1e-4 * expected.item(), (m, objective.loss)


@torch.no_grad()
def test_row_subsets_and_calibration():
    model = tiny()
    sparse = model.config.sparse
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(2))
    rows = cached_rows(64, 16, 20, torch.Generator().manual_seed(0))
    assert (
        rows.numel() == 20
        and rows.min() >= 16
        and torch.equal(rows, rows.sort().values)
        and rows.unique().numel() == 20
    )
    feats = build_features(model, ids, rows, sparse, ObjectiveConfig(chunk_size=8), backbone="query")
    assert torch.equal(feats.positions[0], rows)
    full = build_features(
        model, ids, cached_rows(64, 0, None, None), sparse, ObjectiveConfig(chunk_size=64), backbone="query"
    )
    for m in range(3):  # a row's teacher does not depend on which other rows are cached
        torch.testing.assert_close(feats.teachers[m], full.teachers[m][:, :, rows], rtol=1e-5, atol=1e-7)
    from forecastkv.modeling.forecast_init import calibrate_forecast_scale

    head_sq = torch.stack([head_vectors(model, feats, m).pow(2).sum(-1).mean((0, 1)) for m in range(3)])
    factors = calibrate_forecast_scale(model, head_sq, feats.query_sq)
    after = torch.stack([head_vectors(model, feats, m).pow(2).sum(-1).mean((0, 1)) for m in range(3)])
    kv_heads = model.config.num_key_value_heads  # one vector per group: the group's mean query norm
    torch.testing.assert_close(after, feats.query_sq.view(3, kv_heads, -1).mean(-1), rtol=1e-4, atol=0)
    assert not torch.allclose(factors, torch.ones_like(factors), rtol=0.1)  # kaiming heads start at another scale


@torch.no_grad()
def test_calibration_keeps_query_copies_exact_with_one_vector_per_query_head():
    """With n = G, `next_query` current_proj copies layer 0's q_proj: calibration must leave each
    vector at its own query head's norm (factor 1), so layer 0's forecast stays the query selection;
    group-mean targets would equalise the heads and change the group softmax."""
    from forecastkv.modeling.forecast_init import apply_forecast_init, calibrate_forecast_scale

    model = tiny(per_group=3)  # TINY_MODEL: 6 query heads, 2 KV heads, G = 3
    apply_forecast_init(model, "next_query", seed=0)
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(2))
    feats = build_features(
        model,
        ids,
        cached_rows(64, 16, None, None),
        model.config.sparse,
        ObjectiveConfig(chunk_size=64),
        backbone="query",
    )
    head_sq = torch.stack([head_vectors(model, feats, m).pow(2).sum(-1).mean((0, 1)) for m in range(3)])
    factors = calibrate_forecast_scale(model, head_sq, feats.query_sq)
    torch.testing.assert_close(factors[0], torch.ones_like(factors[0]), rtol=1e-5, atol=0)
    torch.testing.assert_close(
        model.model.layers[0].self_attn.current_proj.weight, model.model.layers[0].self_attn.q_proj.weight
    )


@torch.no_grad()
def test_recall_protocol_matches_the_model_recorded_selections():
    """`measure_recall_counts` (query backbone) == the selections the model itself records while
    routing by queries (collect_selections), summed over rows t >= start."""
    model = tiny(per_group=1, sparse={**TINY_SPARSE, "topk": 5})
    sparse = model.config.sparse
    ids = torch.randint(0, 128, (2, 96), generator=torch.Generator().manual_seed(3))
    start = 40
    counts = measure_recall_counts(model, ids, start, backbone="query")
    out = model(ids, collect_selections=True)
    positions = torch.arange(96).expand(2, -1)
    for layer, record in enumerate(out.selections):
        expected = sel.recall_row_sums(record["query"], record["forecast"], positions, sparse, start)
        torch.testing.assert_close(counts[layer], expected, rtol=1e-9, atol=1e-6)
    assert counts[:, 1].min() > 0 and (counts[:, 0] < counts[:, 1]).any()  # not trivially perfect
    report = forecast_recall(model, ids, start, backbone="query")
    assert report.rows == 2 * (96 - start) and abs(report.mean_recall - sum(report.recall[1:]) / 2) < 1e-12
