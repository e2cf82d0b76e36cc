"""Trained heads saved alone load onto MiniCPM-format, NOSA-format and plain-Llama bases, turn the
forecast selector on and change the selection; SparDA indexer checkpoints (no base) load too."""

import pytest
import torch

from forecastkv import ForecastKVForCausalLM
from forecastkv.errors import CheckpointError
from tests.helpers import TINY_SPARSE
from tests.modeling.test_checkpoints import HEAD_DIM, MINICPM_SPARSE, minicpm_dir, nosa_dir, random_llama

IDS = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(5))


def llama_dir(tmp_path):
    random_llama().save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def saved_heads(tmp_path, base, name, seed, per_group=1, **load):
    """Random heads (as training would leave them) saved alone from `base`."""
    model = ForecastKVForCausalLM.from_pretrained(base, forecast={"heads_per_group": per_group}, **load)
    torch.manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.forecast_proj.weight.normal_()
        model.model.layers[0].self_attn.current_proj.weight.normal_()
    model.save_forecast_weights(tmp_path / name)
    return tmp_path / name, model


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("kind", ["minicpm", "nosa", "llama"])
def test_loaded_heads_turn_the_forecast_selector_on_and_route(tmp_path, kind):
    if kind == "minicpm":
        base = minicpm_dir(tmp_path, MINICPM_SPARSE)[0]
        load = {}
    elif kind == "nosa":
        base, load = (
            nosa_dir(tmp_path)[0],
            {"sparse_config": {**TINY_SPARSE, "policy": "nosa", "topk": 4, "query_blocks": 2}},
        )
    else:
        base, load = llama_dir(tmp_path), {"sparse_config": dict(TINY_SPARSE)}
    plain = ForecastKVForCausalLM.from_pretrained(base, **load)
    assert plain.config.sparse.selector == "query"  # the base's own sparse_config routes by queries
    first, trained = saved_heads(tmp_path, base, "a", seed=1, **load)
    second, _ = saved_heads(tmp_path, base, "b", seed=2, **load)
    a = ForecastKVForCausalLM.from_pretrained(base, forecast_weights=first, **load)
    b = ForecastKVForCausalLM.from_pretrained(base, forecast_weights=second, **load)
    assert a.config.sparse.selector == "forecast" and b.config.sparse.selector == "forecast"
    for key, value in trained.state_dict().items():
        if "forecast_proj" in key or "current_proj" in key:
            assert torch.equal(value, a.state_dict()[key]), key
    # the heads route: other heads -> other blocks -> other logits; and not the query selection
    assert not torch.equal(logits(a), logits(b))
    assert not torch.equal(logits(a), logits(plain))
    # a caller who names the selector keeps it
    kept = ForecastKVForCausalLM.from_pretrained(
        base, forecast_weights=first, sparse_config={**a.config.sparse_config, "selector": "query"}
    )
    assert kept.config.sparse.selector == "query"


def test_sparda_indexer_checkpoint_loads_onto_a_base(tmp_path):
    base = llama_dir(tmp_path)
    per_group, kv, layers = 2, 2, 3
    g = torch.Generator().manual_seed(3)
    # SparDA saves only the indexer weights (+ optimizer, sparse_config, base path); the last
    # layer's q_future_proj has no consumer and may be left out
    heads = {
        f"model.layers.{i}.self_attn.q_future_proj.weight": torch.randn(kv * per_group * HEAD_DIM, 96, generator=g)
        for i in range(layers - 1)
    }
    heads["model.layers.0.self_attn.q_curr_proj.weight"] = torch.randn(kv * per_group * HEAD_DIM, 96, generator=g)
    blob = {
        "indexer_state_dict": heads,
        "step": 50,
        "sparse_config": {**TINY_SPARSE, "training_kernel_size": 2},
        "base_model_path": "x",
    }
    torch.save(blob, tmp_path / "ckpt.pt")
    for where in (tmp_path / "ckpt.pt", tmp_path):
        model = ForecastKVForCausalLM.from_pretrained(base, forecast_weights=where)
        assert model.config.forecast_config.heads_per_group == per_group
        assert model.config.sparse.selector == "forecast" and model.config.sparse.topk == TINY_SPARSE["topk"]
        torch.testing.assert_close(
            model.model.layers[1].self_attn.forecast_proj.weight, heads["model.layers.1.self_attn.q_future_proj.weight"]
        )
        torch.testing.assert_close(
            model.model.layers[0].self_attn.current_proj.weight, heads["model.layers.0.self_attn.q_curr_proj.weight"]
        )
        assert torch.equal(
            model.model.layers[2].self_attn.forecast_proj.weight, torch.zeros(kv * per_group * HEAD_DIM, 96)
        )
        assert logits(model).isfinite().all()
    torch.save({"step": 1}, tmp_path / "empty.pt")
    with pytest.raises(CheckpointError, match=r"holds no q_future_proj / q_curr_proj"):
        ForecastKVForCausalLM.from_pretrained(base, forecast_weights=tmp_path / "empty.pt")
    with pytest.raises(CheckpointError, match=r"no forecast.safetensors \(ours\) or SparDA indexer checkpoint"):
        ForecastKVForCausalLM.from_pretrained(base, forecast_weights=tmp_path / "nowhere")
