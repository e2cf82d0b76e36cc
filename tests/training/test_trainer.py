"""The trainer on a tiny random model: frozen base, multi-process equality, exact resume, outputs,
checkpoints without pickle, bad-input errors."""

import json
import math
import os
import pathlib
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from forecastkv.modeling.forecast_init import apply_forecast_init
from forecastkv.training import train_forecast
from forecastkv.training.checkpointing import find_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from tests.helpers import free_port

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
    apply_forecast_init(before, "kaiming", seed=0)  # what the trainer starts from (train.seed = 0)
    before = {k: v.clone() for k, v in before.state_dict().items()}
    result = train_forecast(recipe)
    after = result.model.state_dict()
    assert set(after) == set(before)
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == HEADS  # the last layer's forecast_proj has no consumer
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
    last = list_checkpoints(out)[-1]
    state = load_checkpoint(last)
    assert last.name == "step-000003.safetensors"
    assert set(state["trainable"]) == HEADS and state["step"] == 3
    assert {"optimizer", "scheduler", "rng", "data", "recipe", "fingerprint"} <= set(state)
    assert not any(key.startswith("model.") for key in state if key != "trainable")
    assert {"torch", "python", "numpy"} <= set(state["rng"]) and isinstance(state["rng"]["python"], tuple)
    assert set(state["optimizer"]["state"]) == {0, 1, 2}  # integer keys survive the JSON
    assert state["data"]["cursor"] == 12 % state["data"]["num_sequences"] and state["recipe"]["train"]["steps"] == 3
    with safe_open(str(last), "pt") as f:  # the tensors: heads, optimizer moments, RNG
        assert {name.split("/")[0] for name in f.keys()} == {"trainable", "optimizer", "rng"}


def test_resume_matches_uninterrupted_run(tmp_path, uninterrupted):
    full = uninterrupted(steps=5, save_every=2)
    stopped = train_forecast(tiny_recipe(tmp_path / "data", tmp_path / "cut", steps=5, save_every=2), max_steps=3)
    assert stopped.step == 3
    assert [p.name for p in list_checkpoints(tmp_path / "cut")] == [
        "step-000002.safetensors",
        "step-000003.safetensors",
    ]
    resumed = train_forecast(
        tiny_recipe(tmp_path / "data", tmp_path / "other", steps=5, save_every=2), resume=str(tmp_path / "cut")
    )
    assert resumed.step == 5 and resumed.output_dir == tmp_path / "cut"
    a, b = full.heads, heads_of(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in HEADS)  # exact
    assert [loss for _, loss in full.losses] == [loss for _, loss in resumed.losses]
    steps = [json.loads(line)["step"] for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps)  # the killed run's tail was dropped
    # speed counts the optimizer steps this call ran (4 and 5), over the time they took
    assert resumed.speed["steps_per_s"] * resumed.speed["step_s"] == pytest.approx(2, rel=1e-9)


# ----------------------------------------------------------------------------------------------
# checkpoints: tensors + JSON, no pickle
# ----------------------------------------------------------------------------------------------


class Payload:
    """Unpickling this creates `marker`: what a malicious checkpoint could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def test_pickled_checkpoint_is_refused_unread(tmp_path):
    run = tmp_path / "run"
    marker = tmp_path / "unpickled"
    (run / "checkpoints").mkdir(parents=True)
    bad = run / "checkpoints" / "step-000004.safetensors"  # named like a checkpoint
    torch.save({"step": 4, "trainable": {}, "payload": Payload(marker)}, bad)
    with pytest.raises(
        ValueError, match=r"step-000004.safetensors is not a forecastkv checkpoint .* unpickling can run arbitrary code"
    ):
        load_checkpoint(bad)
    with pytest.raises(ValueError, match=r"not a forecastkv checkpoint"):
        train_forecast(tiny_recipe(tmp_path / "data", tmp_path / "other", steps=2), resume=str(run))
    assert not marker.exists()
    # an older run's pickled .pt checkpoints are not picked up, and the error says why
    bad.rename(run / "checkpoints" / "step-000004.pt")
    with pytest.raises(
        FileNotFoundError,
        match=r"holds no checkpoints .* 1 pickled .pt checkpoint\(s\) of an older version are not loaded",
    ):
        find_checkpoint(run)
    assert not marker.exists()


def test_no_pickle_loading_in_the_package():
    """No torch.load in forecastkv/ unpickles freely; checkpoints use no torch.load at all."""
    package = ROOT / "forecastkv"
    assert [str(p.relative_to(ROOT)) for p in package.rglob("*.py") if "weights_only=False" in p.read_text()] == []
    assert "torch.load" not in (package / "training" / "checkpointing.py").read_text()


def test_checkpoint_state_round_trips(tmp_path):
    """Tuples, integer keys, numpy arrays, 0-d and empty tensors, NaN come back as they were."""
    rng = numpy.random.RandomState(3).get_state()
    state = {
        "python": random.Random(1).getstate(),
        "numpy": rng,
        "ints": {0: {"t": torch.tensor(2.5)}, 7: None},
        "empty": torch.zeros(0, 3),
        "pairs": [(1, 0.1), (2, float("nan"))],
        "path": pathlib.Path("a/b"),
        "flag": True,
    }
    loaded = load_checkpoint(save_checkpoint(tmp_path, 1, state))
    assert loaded["python"] == state["python"]
    assert (
        loaded["numpy"][0] == "MT19937"
        and loaded["numpy"][1].dtype == rng[1].dtype
        and (loaded["numpy"][1] == rng[1]).all()
    )
    assert loaded["numpy"][2:] == rng[2:]
    assert (
        set(loaded["ints"]) == {0, 7}
        and torch.equal(loaded["ints"][0]["t"], torch.tensor(2.5))
        and loaded["ints"][7] is None
    )
    assert loaded["empty"].shape == (0, 3) and loaded["pairs"][0] == (1, 0.1) and math.isnan(loaded["pairs"][1][1])
    assert loaded["path"] == "a/b" and loaded["flag"] is True
    with pytest.raises(TypeError, match=r"checkpoint state at 'bad/0' is a builtins.set; a checkpoint holds tensors"):
        save_checkpoint(tmp_path, 2, {"bad": [{1, 2}]})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000001.safetensors"]  # the failed write left nothing


# ----------------------------------------------------------------------------------------------
# one process vs two
# ----------------------------------------------------------------------------------------------



def test_a_checkpoint_without_a_checksum_loads_only_when_allowed(tmp_path):
    """Issue 39: an older format-1 checkpoint (no checksum) is refused by default, naming the way
    out (--allow-unchecked), and loads with allow_unchecked=True."""
    from safetensors.torch import save_file

    from forecastkv.training.checkpointing import STATE_KEY, CheckpointUnchecked

    path = tmp_path / "step-000001.safetensors"
    state = json.dumps({"format": 1, "state": {"step": 1, "w": {"__tensor__": "w"}}})
    save_file({"w": torch.ones(2)}, str(path), metadata={STATE_KEY: state})
    with pytest.raises(CheckpointUnchecked, match=r"step-000001.safetensors carries no checksum .*--allow-unchecked"):
        load_checkpoint(path)
    with pytest.raises(CheckpointUnchecked):
        load_checkpoint(path, allow_unchecked=False)
    loaded = load_checkpoint(path, allow_unchecked=True)
    assert loaded["step"] == 1

def _cli_run(tmp_path: Path, processes: int) -> Path:
    """Train the 3-step tiny recipe through the CLI under torch.distributed.run with `processes`
    CPU processes, one thread each whatever the caller's OMP_NUM_THREADS; returns the run directory."""
    out = tmp_path / f"procs{processes}"
    config = tmp_path / f"procs{processes}.yaml"
    config.write_text(yaml.safe_dump(tiny_recipe(tmp_path / "data", out, steps=3, threads=1)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(processes),
        "--master_port",
        str(free_port()),
        "-m",
        "forecastkv.training.cli",
        "--config",
        str(config),
        "--no-progress",
    ]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((out / "recipe.json").read_text())["processes"] == processes
    return out


def _logged(out: Path, key: str) -> list[float]:
    return [row[key] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if key in row]


@pytest.mark.serial  # two training processes (torch.distributed), one per core
def test_two_processes_match_one(tmp_path):
    """Global batch 4: one process (4 micro-batches) vs two processes (2 each, gradients summed
    with gloo), both launched the same way (CLI, torch.distributed.run, one thread per process).

    The calibration sums are gathered per micro-batch and added in one global order, so both
    runs start from bitwise equal heads; what may still differ is the order in which the
    micro-batches' gradients are summed (in one matmul over 4 sequences' rows, or two over 2 and an
    all-reduce).  Measured: none at all -- weights, grad norms bitwise equal after 3 steps; the
    logged loss (reported only, summed per process) within 4e-8 relative.

    Tolerances, for machines whose BLAS groups that sum differently: a regrouped float32 sum of
    n = 4 terms errs by at most n u sum|g_k| (u = 2^-24), about 1e-8 at this recipe's |g| <~ 0.04
    per element; AdamW divides by sqrt(v) + eps (eps = 1e-6), so an element whose |g| is below eps
    moves up to lr 1e-8 / eps = 1e-4 further per step: 3e-4 after 3 steps, tolerance 5e-4.  A real
    mismatch (other rows, a missing all-reduce) moves weights by about lr = 1e-2 per step.  Grad
    norms and losses are sums over ~1e4 terms: relative error <= log2(n) u ~ 1e-6, tolerance 5e-6;
    they catch a wrong loss scale, which AdamW's weights would hide."""
    one, two = _cli_run(tmp_path, 1), _cli_run(tmp_path, 2)
    a, b = load_file(one / "forecast.safetensors"), load_file(two / "forecast.safetensors")
    for key in HEADS:
        assert (a[key] - b[key]).abs().max().item() <= 5e-4, key
    for key in ("grad_norm", "loss"):
        assert len(_logged(one, key)) == 3 and _logged(one, key) == pytest.approx(_logged(two, key), rel=5e-6, abs=0), (
            key
        )


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
    recipe["data"]["source"] = str(tmp_path / "data" / "doc0.txt")  # 1550 bytes = 24 sequences of 64
    recipe["train"]["global_batch"] = 64
    with pytest.raises(ValueError, match=r"yields 24 sequences of seq_len=64 .* need at least 64"):
        train_forecast(recipe)


def test_resume_from_another_model(tmp_path):
    train_forecast(tiny_recipe(tmp_path / "data", tmp_path / "run", steps=2))
    other = tiny_recipe(tmp_path / "data", tmp_path / "run2", steps=4, seed=1)
    with pytest.raises(
        ValueError,
        match=r"was written for base model 'random:0' \(fingerprint [0-9a-f]+\), but this run uses 'random:1'",
    ):
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


def test_multi_vector_heads_train_and_save(tmp_path):
    """heads_per_group = G = 3: trained (the loss falls), saved with their vector count."""
    recipe = tiny_recipe(
        tmp_path / "data", tmp_path / "run", steps=4, eval_every=-1, steps_per_round=4, rows_per_step=16
    )
    recipe["model"]["forecast"] = {"heads_per_group": 3, "init": "next_query"}
    recipe["data"]["row_start"] = 8
    started = time.perf_counter()
    result = train_forecast(recipe)
    wall = time.perf_counter() - started
    saved = load_file(Path(result.output_dir) / "forecast.safetensors")
    assert saved["model.layers.1.self_attn.forecast_proj.weight"].shape == (2 * 3 * 16, 96)
    assert (
        json.loads((Path(result.output_dir) / "forecast_config.json").read_text())["forecast"]["heads_per_group"] == 3
    )
    losses = [loss for _, loss in result.losses]
    assert losses[-1] < losses[0]
    # speed: the 4 optimizer steps over their own time; the one round's feature time apart; both
    # inside the call's wall time, and what the last metrics row logged
    speed = result.speed
    assert speed["steps_per_s"] * speed["step_s"] == pytest.approx(4, rel=1e-9)
    assert 0 < speed["step_s"] and 0 < speed["feature_s"] and speed["step_s"] + speed["feature_s"] < wall
    logged = [
        row
        for row in map(json.loads, (Path(result.output_dir) / "metrics.jsonl").read_text().splitlines())
        if "loss" in row
    ][-1]
    assert logged["step"] == 4 and (logged["steps_per_s"], logged["feature_s"]) == (
        speed["steps_per_s"],
        speed["feature_s"],
    )


def test_the_attention_teacher_reaches_the_trainer(tmp_path):
    """`objective.teacher: attention` from a recipe: the run trains, its recipe.json names the teacher,
    and its heads differ from a run of the same seed with the selector teacher (other targets, and
    other cached features: the feature key covers the objective)."""
    heads = {}
    for teacher in ("selector", "attention"):
        recipe = tiny_recipe(tmp_path / "data", tmp_path / teacher, steps=2)
        recipe["objective"] = {"chunk_size": 24, "teacher": teacher, "loss": "topk"}
        result = train_forecast(recipe)
        heads[teacher] = heads_of(result.model)
        saved = json.loads((Path(result.output_dir) / "recipe.json").read_text())
        assert saved["objective"]["teacher"] == teacher
        # its evaluations count the blocks the teacher stands for: the query selector's, or the oracle's
        reference = {"selector": "query", "attention": "oracle"}[teacher]
        assert {entry["reference"] for entry in result.history} == {reference}
        assert ("oracle's blocks" in (Path(result.output_dir) / "recall.md").read_text()) == (teacher == "attention")
    assert heads["selector"].keys() == heads["attention"].keys() == HEADS
    assert any(not torch.equal(heads["selector"][k], heads["attention"][k]) for k in HEADS)
