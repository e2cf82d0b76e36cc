"""The trained Forecast heads shipped as package data (`forecastkv/presets/heads/`), named
`bundled:NAME` wherever heads are loaded: their files fit the bundled model and its geometry, the name
resolves (and a wrong one says what is shipped), `forecastkv generate` picks them for a forecast mode
on the bundled model, and on held-out text they recall more of the query selector's blocks than the
untrained heads they started from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forecastkv.bundled import bundled_heads_path, resolve_heads_path, shipped_heads_for
from forecastkv.errors import ConfigError
from forecastkv.modeling.head_files import GEOMETRY_KEYS
from forecastkv.modeling.lazy_weights import read_safetensors_header
from forecastkv.usage import UsageError, check_offload_needs

# SmolLM2-135M: 30 layers, hidden 576, 3 KV heads of 64 channels
LAYERS, HIDDEN, KV_HEADS, HEAD_DIM = 30, 576, 3, 64


def test_the_shipped_smollm2_heads_fit_the_bundled_model_and_its_preset():
    directory = Path(bundled_heads_path("smollm2-135m"))
    side = json.loads((directory / "forecast_config.json").read_text())
    header, _ = read_safetensors_header(directory / "forecast.safetensors")
    vectors = side["forecast"]["heads_per_group"]
    shapes = {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
    # every layer's forecast_proj (the next layer's blocks) and layer 0's current_proj (its own)
    want = {f"model.layers.{i}.self_attn.forecast_proj.weight" for i in range(LAYERS)}
    assert set(shapes) == want | {"model.layers.0.self_attn.current_proj.weight"}
    assert all(shape == (vectors * KV_HEADS * HEAD_DIM, HIDDEN) for shape in shapes.values())
    preset = json.loads((directory.parents[1] / "smollm2-135m.json").read_text())["sparse_config"]
    assert {k: side["sparse_config"][k] for k in GEOMETRY_KEYS} == {k: preset[k] for k in GEOMETRY_KEYS}
    assert side["sparse_config"]["selector"] == "forecast"
    assert (directory / "forecast.safetensors").stat().st_size < 8 * 2**20  # package data stays small
    assert "forecastkv train-forecast --config configs/train/smollm2-135m.yaml" in (directory / "README.md").read_text()


def test_bundled_names_resolve_and_a_wrong_one_lists_what_is_shipped():
    assert resolve_heads_path("bundled:smollm2-135m") == bundled_heads_path()
    assert resolve_heads_path("runs/mine") == "runs/mine" and resolve_heads_path(None) is None
    with pytest.raises(ConfigError, match=r"no shipped Forecast heads named 'nope'; shipped: \['smollm2-135m'\]"):
        resolve_heads_path("bundled:nope")
    assert shipped_heads_for("smollm2-135m") == shipped_heads_for("bundled:smollm2-135m") == "bundled:smollm2-135m"
    assert shipped_heads_for("/ckpt/llama") is None and shipped_heads_for("bundled:other") is None


def test_a_forecast_mode_on_the_bundled_model_takes_the_shipped_heads(monkeypatch):
    import forecastkv.modeling.head_files as head_files

    monkeypatch.setattr(head_files, "has_forecast_heads", lambda path: False)
    assert check_offload_needs("forecast-offload", "--model", "smollm2-135m", "/x", False) == "bundled:smollm2-135m"
    # heads given, a mode without heads, or a checkpoint of its own: nothing added
    assert check_offload_needs("forecast-offload", "--model", "smollm2-135m", "/x", True) is None
    assert check_offload_needs("sparse-offload", "--model", "smollm2-135m", "/x", False) is None
    with pytest.raises(UsageError, match="--model /ckpt/llama has none: add --forecast-init next_query"):
        check_offload_needs("forecast-offload", "--model", "/ckpt/llama", "/ckpt/llama", False)
    monkeypatch.setattr(head_files, "has_forecast_heads", lambda path: True)
    assert check_offload_needs("forecast-offload", "--model", "smollm2-135m", "/x", False) is None


@pytest.mark.slow  # two loads of the bundled model and two recalls of one 2K held-out sequence
@pytest.mark.bundled
def test_the_shipped_heads_recall_more_than_their_untrained_init(bundled_path):
    from forecastkv.training.recall import RecallProtocol, evaluate_recall, load_for_recall, resolve_geometry

    protocol = RecallProtocol(length=2048, start=1024, sequences=1)
    geometry = resolve_geometry(None, "bundled:smollm2-135m")  # the heads' own, as forecast-recall takes it
    recall = {}
    for name, weights in (("shipped", "bundled:smollm2-135m"), ("init", None)):
        model, tokenizer, _ = load_for_recall("bundled:smollm2-135m", weights, geometry, init="next_query")
        recall[name] = evaluate_recall(model, tokenizer, protocol).mean_recall
        del model
    assert recall["shipped"] > recall["init"] + 0.01, recall
