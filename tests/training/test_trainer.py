"""The trainer on a tiny random model: frozen base, multi-process equality, exact resume, outputs,
bad-input errors."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from forecastkv.modeling.forecast_init import apply_forecast_init
from forecastkv.training import train_forecast
from forecastkv.training.checkpointing import list_checkpoints, load_checkpoint

from .common import tiny_recipe

ROOT = Path(__file__).resolve().parents[2]
HEADS = {
    "model.layers.0.self_attn.current_proj.weight",
    "model.layers.0.self_attn.forecast_proj.weight",
    "model.layers.1.self_attn.forecast_proj.weight",
}


def heads_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k in HEADS}


def test_only_forecast_heads_change(tmp_path):
    from forecastkv.training.trainer import build_model, load_recipe

    recipe = tiny_recipe(tmp_path / "data", tmp_path / "run", steps=3)
    before, _ = build_model(load_recipe(recipe)["model"], torch.device("cpu"))
    apply_forecast_init(before, "kaiming", seed=0)   # what the trainer starts from (train.seed = 0)
    before = {k: v.clone() for k, v in before.state_dict().items()}
    result = train_forecast(recipe)
    after = result.model.state_dict()
    assert set(after) == set(before)
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == HEADS                      # the last layer's forecast_proj has no consumer
    assert not any(p.requires_grad for n, p in result.model.named_parameters() if n not in HEADS)

    # outputs: forecast weights under their state-dict names, the loader's side config, a recall table
    out = Path(result.output_dir)
    saved = load_file(out / "forecast.safetensors")
    assert HEADS <= set(saved)
    assert all(torch.equal(saved[k], after[k]) for k in HEADS)
    meta = json.loads((out / "forecast_config.json").read_text())
    assert meta["base_model"] == "random:0" and meta["sparse_config"]["kernel_size"] == 4
    assert meta["forecast"]["heads_per_group"] == 1
    assert [h["step"] for h in result.history] == [0, 3]
    assert "mean (>= 1)" in (out / "recall.md").read_text()
    # checkpoints hold only the trainable tensors (+ optimizer etc.), the last `keep_last`
    state = load_checkpoint(list_checkpoints(out)[-1])
    assert set(state["trainable"]) == HEADS and state["step"] == 3
    assert {"optimizer", "scheduler", "rng", "data", "recipe", "fingerprint"} <= set(state)
    assert not any(key.startswith("model.") for key in state if key != "trainable")


def test_resume_matches_uninterrupted_run(tmp_path):
    full = train_forecast(tiny_recipe(tmp_path / "data", tmp_path / "full", steps=5, save_every=2))
    stopped = train_forecast(tiny_recipe(tmp_path / "data", tmp_path / "cut", steps=5, save_every=2), max_steps=3)
    assert stopped.step == 3
    assert [p.name for p in list_checkpoints(tmp_path / "cut")] == ["step-000002.pt", "step-000003.pt"]
    resumed = train_forecast(tiny_recipe(tmp_path / "data", tmp_path / "other", steps=5, save_every=2), resume=str(tmp_path / "cut"))
    assert resumed.step == 5 and resumed.output_dir == tmp_path / "cut"
    a, b = heads_of(full.model), heads_of(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in HEADS)          # exact
    assert [loss for _, loss in full.losses] == [loss for _, loss in resumed.losses]
    steps = [json.loads(line)["step"] for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps)                                  # the killed run's tail was dropped


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    """Global batch 4: one process (4 micro-batches) vs two processes (2 each, gradients summed over
    processes with gloo).  Only the summation order differs: weights agree to 1e-5 (abs; weights
    are ~0.1), measured ~4e-7 after 3 steps."""
    single = train_forecast(tiny_recipe(tmp_path / "data", tmp_path / "one", steps=3))
    recipe = tiny_recipe(tmp_path / "data", tmp_path / "two", steps=3)
    config = tmp_path / "two.yaml"
    config.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           "-m", "forecastkv.training.cli", "--config", str(config), "--no-progress"]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "two" / "recipe.json").read_text())["processes"] == 2
    two = load_file(tmp_path / "two" / "forecast.safetensors")
    one = heads_of(single.model)
    for key in HEADS:
        assert (two[key] - one[key]).abs().max().item() < 1e-5, key


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------


def test_base_without_sparse_config(tmp_path):
    recipe = tiny_recipe(tmp_path / "data", tmp_path / "run")
    recipe["model"]["sparse_config"] = None
    with pytest.raises(ValueError, match=r"base model 'random:0' has no sparse_config and the recipe gives none"):
        train_forecast(recipe)


def test_sequence_longer_than_the_model_allows(tmp_path):
    recipe = tiny_recipe(tmp_path / "data", tmp_path / "run")
    recipe["data"]["seq_len"] = 600
    with pytest.raises(ValueError, match=r"data.seq_len=600 exceeds the model's max_position_embeddings=512"):
        train_forecast(recipe)


def test_empty_and_too_short_datasets(tmp_path):
    recipe = tiny_recipe(tmp_path / "data", tmp_path / "run")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    recipe["data"]["source"] = str(empty)
    with pytest.raises(ValueError, match=r"training data .*empty.jsonl' \(split 'train'\) is empty"):
        train_forecast(recipe)
    short = tmp_path / "short.txt"
    short.write_text("a few words")
    recipe["data"]["source"] = str(short)
    with pytest.raises(ValueError, match=r"has 12 tokens, fewer than one sequence of seq_len=64"):
        train_forecast(recipe)
    recipe["data"]["source"] = str(tmp_path / "data" / "doc0.txt")   # 1550 bytes = 24 sequences of 64
    recipe["train"]["global_batch"] = 64
    with pytest.raises(ValueError, match=r"yields 24 sequences of seq_len=64 .* need at least 64"):
        train_forecast(recipe)


def test_resume_from_another_model(tmp_path):
    train_forecast(tiny_recipe(tmp_path / "data", tmp_path / "run", steps=2))
    other = tiny_recipe(tmp_path / "data", tmp_path / "run2", steps=4, seed=1)
    with pytest.raises(ValueError, match=r"was written for base model 'random:0' \(fingerprint [0-9a-f]+\), but this run uses 'random:1'"):
        train_forecast(other, resume=str(tmp_path / "run"))
    with pytest.raises(FileNotFoundError, match=r"holds no checkpoints"):
        train_forecast(other, resume=str(tmp_path / "data"))


def test_recipe_errors(tmp_path):
    recipe = tiny_recipe(tmp_path / "data", tmp_path / "run")
    recipe["train"]["stepz"] = 3
    with pytest.raises(ValueError, match=r"unknown recipe key 'train.stepz'"):
        train_forecast(recipe)
    recipe = tiny_recipe(tmp_path / "data", tmp_path / "run")
    recipe["train"]["global_batch"] = 3
    recipe["train"]["micro_batch"] = 2
    with pytest.raises(ValueError, match=r"train.global_batch=3 must be a multiple of processes x micro_batch = 1 x 2"):
        train_forecast(recipe)


@pytest.mark.slow
@pytest.mark.bundled
def test_smollm2_smoke(tmp_path, bundled_path):
    """One step on the bundled SmolLM2-135M with the shipped recipe (short sequences)."""
    result = train_forecast(
        ROOT / "configs" / "train" / "smollm2-135m.yaml", output_dir=str(tmp_path / "run"), steps=1,
        data={"seq_len": 384, "row_start": 128, "eval_seq_len": 512, "eval_start": 256, "eval_sequences": 1},
        train={"global_batch": 1, "progress": False},
    )
    assert result.step == 1 and len(result.history[-1]["recall"]) == 30
    assert (tmp_path / "run" / "forecast.safetensors").is_file()


def test_multi_vector_heads_train_and_save(tmp_path):
    """heads_per_group = G = 3: trained (the loss falls), saved with their vector count."""
    recipe = tiny_recipe(tmp_path / "data", tmp_path / "run", steps=4, eval_every=-1, steps_per_round=4, rows_per_step=16)
    recipe["model"]["forecast"] = {"heads_per_group": 3, "init": "next_query"}
    recipe["data"]["row_start"] = 8
    result = train_forecast(recipe)
    saved = load_file(Path(result.output_dir) / "forecast.safetensors")
    assert saved["model.layers.1.self_attn.forecast_proj.weight"].shape == (2 * 3 * 16, 96)
    assert json.loads((Path(result.output_dir) / "forecast_config.json").read_text())["forecast"]["heads_per_group"] == 3
    losses = [loss for _, loss in result.losses]
    assert losses[-1] < losses[0]
    assert result.speed["steps_per_s"] > 0 and result.speed["feature_s"] > 0
