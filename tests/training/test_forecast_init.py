"""`apply_forecast_init`: Kaiming bounds and seeding, the next_query copy and its scale control."""

import math

import pytest
import torch

from forecastkv import ForecastKVConfig, ForecastKVForCausalLM
from forecastkv.modeling.forecast_init import RATIO_SPREAD, apply_forecast_init, head_averaged_query
from tests.helpers import TINY_MODEL, TRAINING_SPARSE


def tiny(heads_per_group=1, seed=0, forecast=True):
    torch.manual_seed(seed)
    config = ForecastKVConfig(
        **TINY_MODEL, sparse_config=TRAINING_SPARSE, forecast={"enabled": forecast, "heads_per_group": heads_per_group}
    )
    return ForecastKVForCausalLM(config)


def heads(model):
    return {k: v.clone() for k, v in model.state_dict().items() if "forecast_proj" in k or "current_proj" in k}


def test_kaiming_bounds_and_seed():
    a, b = tiny(), tiny(seed=5)
    apply_forecast_init(a, "kaiming", seed=3)
    apply_forecast_init(b, "kaiming", seed=3)
    ha, hb = heads(a), heads(b)
    bound = 1 / math.sqrt(TINY_MODEL["hidden_size"])
    unused = "model.layers.2.self_attn.forecast_proj.weight"  # the last layer's: no consumer
    assert not ha.pop(unused).any() and not hb.pop(unused).any()
    for key, value in ha.items():
        assert torch.equal(value, hb[key])  # the seed alone fixes the weights
        assert value.abs().max() <= bound
        assert abs(value.std().item() - bound / math.sqrt(3)) < 0.15 * bound
    apply_forecast_init(b, "kaiming", seed=4)
    assert not torch.equal(
        heads(b)["model.layers.0.self_attn.forecast_proj.weight"], ha["model.layers.0.self_attn.forecast_proj.weight"]
    )


@pytest.mark.parametrize("n, split", [(1, [[0, 1, 2]]), (2, [[0, 1], [2]]), (3, [[0], [1], [2]])])
def test_next_query_copies_head_averaged_queries(n, split):
    """Equal norm weights (ratio 1): forecast_proj^l = head-averaged q_proj^{l+1}, current_proj =
    head-averaged q_proj^0; the last layer's head (no consumer) is zero."""
    model = tiny(heads_per_group=n)
    apply_forecast_init(model, "next_query", seed=0)
    layers = model.model.layers
    d, h_kv, hidden = 16, 2, TINY_MODEL["hidden_size"]

    def averaged(q_weight):
        q = q_weight.view(h_kv, 3, d, hidden)
        return torch.stack([q[:, part].mean(dim=1) for part in split], dim=1).reshape(-1, hidden)

    for l in range(2):
        torch.testing.assert_close(
            layers[l].self_attn.forecast_proj.weight,
            averaged(layers[l + 1].self_attn.q_proj.weight),
            rtol=1e-5,
            atol=1e-6,
        )
    torch.testing.assert_close(layers[0].self_attn.current_proj.weight, averaged(layers[0].self_attn.q_proj.weight))
    assert not layers[2].self_attn.forecast_proj.weight.any()


def test_next_query_norm_ratio_and_sane_scale():
    """Layer 0's norm weights ~1e-3 with outliers at 1e-6 (SmolLM2-like), layer 1's ~0.2: the copy
    keeps the per-channel correction where it is moderate, clamps the outliers, and its RMS row norm
    equals that of the head-averaged q_proj it copies."""
    model = tiny()
    layers = model.model.layers
    g = torch.Generator().manual_seed(0)
    hidden = TINY_MODEL["hidden_size"]
    with torch.no_grad():
        layers[0].input_layernorm.weight.copy_(1e-3 * (1 + torch.rand(hidden, generator=g)))
        layers[0].input_layernorm.weight[:3] = 1e-6
        layers[1].input_layernorm.weight.copy_(0.2 * (1 + torch.rand(hidden, generator=g)))
    apply_forecast_init(model, "next_query")
    source = layers[1].self_attn.q_proj.weight.view(2, 3, 16, hidden).mean(dim=1).reshape(-1, hidden)
    weight = layers[0].self_attn.forecast_proj.weight
    rms = lambda w: w.norm(dim=1).pow(2).mean().sqrt()  # noqa: E731
    torch.testing.assert_close(rms(weight), rms(source))
    # per-channel scale = ratio up to one constant: compare columns 10.. (unclamped) by their scale
    ratio = layers[1].input_layernorm.weight / layers[0].input_layernorm.weight
    column_scale = weight.norm(dim=0) / source.norm(dim=0)
    constant = column_scale[10:] / ratio[10:]
    assert (constant.max() - constant.min()) / constant.mean() < 1e-4
    # the three outlier channels (ratio ~2e5 x the median) are clamped to RATIO_SPREAD x median
    median = ratio.median()
    assert torch.allclose(column_scale[:3] / constant.mean(), (median * RATIO_SPREAD).expand(3), rtol=1e-4)
    assert weight.abs().max() < 20 * source.abs().max()


def test_errors():
    with pytest.raises(ValueError, match=r"forecast init 'xavier' is not one of \('kaiming', 'next_query'\)"):
        apply_forecast_init(tiny(), "xavier")
    with pytest.raises(ValueError, match="the model has no forecast heads"):
        apply_forecast_init(tiny(forecast=False), "kaiming")


@pytest.mark.bundled
def test_next_query_scale_on_smollm2(bundled_path):
    """On the real SmolLM2 the copied heads stay at the q_proj scale on every layer (max |w| within
    4x of the copied q_proj's, measured <= 3.0), where the plain ratio-corrected copy of layer 0 is
    ~290x larger (layer-0 norm weights down to 2e-4)."""
    model = ForecastKVForCausalLM.from_pretrained(
        bundled_path, sparse_config="smollm2-135m", forecast={"init": "kaiming"}
    )
    apply_forecast_init(model, "next_query")
    layers = model.model.layers
    q_max = [layers[l + 1].self_attn.q_proj.weight.abs().max().item() for l in range(29)]
    scales = [layers[l].self_attn.forecast_proj.weight.abs().max().item() / q_max[l] for l in range(29)]
    assert max(scales) < 4.0, scales
    raw = head_averaged_query(layers[1].self_attn.q_proj.weight, 3, 1, 64) * (
        layers[1].input_layernorm.weight / layers[0].input_layernorm.weight
    )
    assert raw.abs().max().item() / q_max[0] > 50


@pytest.mark.parametrize("init", ["next_query", "kaiming"])
def test_created_heads_are_deterministic(tmp_path, init):
    """Issue 26 item 14: two loads of one base with forecast={"init": ...} give bit-identical heads,
    whatever the global RNG holds (the unused last-layer head used to come from it, so every
    process had another weights digest and `--forecast-init --context-cache` never hit)."""
    tiny(forecast=False).save_pretrained(tmp_path / "base")
    loads = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        model = ForecastKVForCausalLM.from_pretrained(tmp_path / "base", forecast={"init": init, "heads_per_group": 1})
        loads.append(heads(model))
    assert set(loads[0]) == set(loads[1]) and len(loads[0]) == 4
    for key, value in loads[0].items():
        assert torch.equal(value, loads[1][key]), key
    assert not loads[0]["model.layers.2.self_attn.forecast_proj.weight"].any()  # no consumer: zero
