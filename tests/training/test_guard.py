"""The per-layer guard: validation windows of unseen training text, and layers whose trained head
scores below its starting head get the starting head back."""

import json

import pytest
import torch
from accelerate import Accelerator

from forecastkv.training import train_forecast
from forecastkv.training.data import PackedSequences, unvisited_windows
from forecastkv.training.trainer import build_model, forecast_heads, guard_layers, load_recipe, recall_head_name

from .common import tiny_recipe


def test_unvisited_windows_share_no_token_with_visited_sequences():
    tokens = torch.arange(40 * 8)
    data = PackedSequences(tokens, seq_len=8, seed=3)
    visits = 12
    seen = set(data.take(visits).flatten().tolist())
    windows = unvisited_windows(data, visits, length=16, count=5)
    assert windows.shape == (5, 16)
    assert not seen & set(windows.flatten().tolist())
    assert all(torch.equal(w, torch.arange(int(w[0]), int(w[0]) + 16)) for w in windows)  # contiguous text
    with pytest.raises(ValueError, match="no unseen text"):
        unvisited_windows(data, 40, 16, 1)
    with pytest.raises(ValueError, match="need 50"):
        unvisited_windows(data, visits, 16, 50)


def test_guard_restores_only_layers_that_fell(tmp_path):
    recipe = load_recipe(tiny_recipe(tmp_path / "data", tmp_path / "run"))
    model, _ = build_model(recipe["model"], torch.device("cpu"))
    from forecastkv.modeling.forecast_init import apply_forecast_init

    apply_forecast_init(model, "next_query", seed=0)
    start = {n: p.detach().clone() for n, p in forecast_heads(model)}
    spoiled = recall_head_name(2)
    with torch.no_grad():
        dict(forecast_heads(model))[spoiled].mul_(-1.0)  # the opposite ranking: recall falls
    sequences = torch.randint(0, 128, (2, 96), generator=torch.Generator().manual_seed(0))
    guard = guard_layers(model, start, sequences, 48, "dense", Accelerator(cpu=True))
    assert guard["trained"][2] < guard["start"][2]
    assert guard["restored"] == [2]
    heads = dict(forecast_heads(model))
    assert all(torch.equal(heads[n], start[n]) for n in heads)  # the unspoiled heads were the start already


def test_trainer_guard_runs_once_and_resumes(tmp_path):
    extra = {"val_sequences": 2, "val_seq_len": 96}
    recipe = lambda out: {
        **tiny_recipe(tmp_path / "data", out, steps=4, save_every=2),
        "data": {**tiny_recipe(tmp_path / "data", out)["data"], **extra},
    }
    full = train_forecast(recipe(tmp_path / "full"))
    assert full.guard is not None and len(full.guard["start"]) == 3 and full.guard["length"] == 96
    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert sum("guard" in row for row in rows) == 1 and "guard" in (tmp_path / "full" / "recall.md").read_text()
    heads = dict(forecast_heads(full.model))
    for layer in full.guard["restored"]:  # a restored layer scores its start again in the final eval
        assert layer in range(3) and recall_head_name(layer) in heads
    train_forecast(recipe(tmp_path / "cut"), max_steps=2)
    resumed = train_forecast(recipe(tmp_path / "other"), resume=str(tmp_path / "cut"))
    assert resumed.guard == full.guard
    a, b = dict(forecast_heads(full.model)), dict(forecast_heads(resumed.model))
    assert all(torch.equal(a[k], b[k]) for k in a)
