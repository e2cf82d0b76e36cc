"""What a run leaves behind and what a rerun does (issue 25 items 11-13, issue 26 items 11-13):
signals write a checkpoint, a resume reads the cached features, a finished directory is never
retrained silently, a killed one resumes without duplicated metrics, checkpoints are checksummed
and a damaged newest one falls back to the previous, stale temporaries are removed."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from forecastkv.cli import main as forecastkv_main
from forecastkv.training import train_forecast
from forecastkv.training import trainer as trainer_module
from forecastkv.training.checkpointing import (
    CHECKSUM_KEY,
    CheckpointCorrupt,
    CheckpointUnchecked,
    list_checkpoints,
    load_checkpoint,
    load_intact,
)
from forecastkv.training.trainer import RunExists, TrainingInterrupted, recall_change

from .common import tiny_recipe
from .conftest import Uninterrupted, head_tensors

ROOT = Path(__file__).resolve().parents[2]
HEAD = "model.layers.1.self_attn.forecast_proj.weight"


def assert_same_heads(full, result):
    """`result`'s heads equal those of the uninterrupted run `full` (the session's `Uninterrupted`,
    or a TrainResult), bit for bit."""
    expected = full.heads if isinstance(full, Uninterrupted) else head_tensors(full.model)
    got = head_tensors(result.model)
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in got)


def metric_steps(out: Path, key: str = "loss") -> list[int]:
    return [row["step"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if key in row]


def write_config(tmp_path: Path, name: str = "tiny.yaml", **train) -> Path:
    config = tmp_path / name
    config.write_text(yaml.safe_dump(tiny_recipe(tmp_path / "data", tmp_path / "unused", **train)))
    return config


# ----------------------------------------------------------------------------------------------
# issue 26 item 11: temporaries a kill left behind
# ----------------------------------------------------------------------------------------------


def test_stale_temporaries_are_removed_at_start(tmp_path):
    """Issue 26 item 11: `.step-*.safetensors.*.tmp` (and the run files' temporaries) left by a
    kill inside an atomic write are deleted when the next run starts; other files stay."""
    out = tmp_path / "run"
    stale = [
        out / "checkpoints" / ".step-000002.safetensors.k3x9a1b2.tmp",
        out / ".forecast.safetensors.q1w2e3r4.tmp",
        out / ".metrics.jsonl.a8b7c6d5.tmp",
    ]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * 1024)
    mine = out / ".notes.txt.abcdefgh.tmp"  # not a file the run writes: left alone
    mine.write_text("user file")
    train_forecast(tiny_recipe(tmp_path / "data", out, steps=2))
    assert [p for p in stale if p.exists()] == []
    assert mine.exists()


# ----------------------------------------------------------------------------------------------
# issue 26 item 12 / issue 25 item 12: reruns into a run's directory
# ----------------------------------------------------------------------------------------------


def test_fresh_run_into_a_killed_runs_directory_resumes_without_duplicates(tmp_path, capsys, uninterrupted):
    """Issue 26 item 12: the same command rerun into the directory of a killed run resumes from its
    newest checkpoint, metrics.jsonl truncated to that step: every step logged once, heads
    bit-identical to an uninterrupted run."""
    full = uninterrupted(steps=5, save_every=2)
    out = tmp_path / "killed"
    train_forecast(tiny_recipe(tmp_path / "data", out, steps=5, save_every=2), max_steps=3)
    (out / "checkpoints" / "step-000003.safetensors").unlink()  # killed after logging step 3, before its checkpoint
    assert metric_steps(out) == [1, 2, 3]
    rerun = train_forecast(tiny_recipe(tmp_path / "data", out, steps=5, save_every=2))
    assert "resuming the interrupted run" in capsys.readouterr().err
    assert metric_steps(out) == [1, 2, 3, 4, 5]
    assert metric_steps(out, "eval") == [0, 5]
    assert_same_heads(full, rerun)


def test_killed_before_the_first_checkpoint_starts_again(tmp_path, capsys):
    """Issue 26 item 12: metrics rows but no checkpoint: a fresh start that drops the old rows."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0, "eval": {}}\n{"step": 1, "loss": 1.0}\n')
    train_forecast(tiny_recipe(tmp_path / "data", out, steps=2))
    assert "left no checkpoint" in capsys.readouterr().err
    assert metric_steps(out) == [1, 2] and metric_steps(out, "eval") == [0, 2]


def test_rerun_into_a_finished_directory_is_refused(tmp_path, capsys):
    """Issue 25 item 12: a rerun into a finished run's directory is refused in one line (exit 2,
    saying how to resume or overwrite), nothing retrained or appended; --overwrite starts again."""
    config = write_config(tmp_path, steps=2)
    out = tmp_path / "run"
    argv = ["train-forecast", "--config", str(config), "--output", str(out), "--no-progress"]
    assert forecastkv_main(argv) == 0
    before = (out / "metrics.jsonl").read_text()
    weights = (out / "forecast.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert forecastkv_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a finished run (step 2 of 2)" in err[0]
    assert f"--resume {out}" in err[0] and "--overwrite" in err[0] and "Traceback" not in err[0]
    assert (out / "metrics.jsonl").read_text() == before and (
        out / "forecast.safetensors"
    ).stat().st_mtime_ns == weights
    with pytest.raises(RunExists):
        train_forecast(tiny_recipe(tmp_path / "data", out, steps=2))
    assert forecastkv_main([*argv, "--overwrite"]) == 0
    assert "--overwrite: deleted the previous run" in capsys.readouterr().err
    assert metric_steps(out) == [1, 2]  # one history, not two


def test_last_line_says_when_recall_fell(tmp_path, capsys, monkeypatch):
    """Issue 25 item 12: a run whose held-out recall falls (step 0 -> last) says so in its last line."""
    real = trainer_module.evaluate

    def falling(model, sequences, start, backbone, accelerator, *args):
        report = real(model, sequences, start, backbone, accelerator, *args)
        falling.calls += 1
        return {**report, "mean_recall": 0.9 if falling.calls == 1 else 0.8}

    falling.calls = 0
    monkeypatch.setattr(trainer_module, "evaluate", falling)
    config = write_config(tmp_path, steps=2)
    assert (
        forecastkv_main(["train-forecast", "--config", str(config), "--output", str(tmp_path / "run"), "--no-progress"])
        == 0
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("WARNING: mean forecast recall FELL 0.9000 (step 0) -> 0.8000 (step 2)")
    assert (
        recall_change([{"step": 0, "mean_recall": 0.5}, {"step": 9, "mean_recall": 0.6}])
        == "mean forecast recall rose 0.5000 (step 0) -> 0.6000 (step 9)"
    )
    assert (
        recall_change([{"step": 3, "mean_recall": 0.5}, {"step": 9, "mean_recall": 0.4}]) is None
    )  # no start to compare with


# ----------------------------------------------------------------------------------------------
# issue 26 item 13: checksums, fallback
# ----------------------------------------------------------------------------------------------


def _tensor_offset(path: Path, name: str) -> int:
    """Byte offset in the file of tensor `name`'s first byte."""
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    return 8 + header_len + header[name]["data_offsets"][0]


@pytest.mark.parametrize("damage", ["flipped", "truncated", "flipped, format edited to 1", "checksum removed"])
def test_damaged_newest_checkpoint_falls_back(tmp_path, damage, uninterrupted):
    """Issue 26 item 13: a flipped byte in a trainable tensor (or a truncated file) of the newest
    checkpoint is caught by its checksum; resuming the directory warns and falls back to the
    previous checkpoint, and ends bit-identical to an uninterrupted run.  Issue 39: editing the
    header's format to 1 does not switch the checksum off, and a checkpoint whose checksum was
    removed is refused (not loaded unverified)."""
    full = uninterrupted(steps=4, save_every=2)
    out = tmp_path / "cut"
    train_forecast(tiny_recipe(tmp_path / "data", out, steps=4, save_every=2), max_steps=3)
    newest = out / "checkpoints" / "step-000003.safetensors"
    raw = bytearray(newest.read_bytes())
    if damage.startswith("flipped"):
        raw[_tensor_offset(newest, f"trainable/{HEAD}") + 5] ^= 0x10
    if damage == "truncated":
        raw = raw[: len(raw) // 2]
    edits = {  # same-length edits of the header: the state's format, the checksum's metadata key
        "flipped, format edited to 1": (b'\\"format\\": 2', b'\\"format\\": 1'),
        "checksum removed": (CHECKSUM_KEY.encode(), CHECKSUM_KEY[:-1].encode() + b"X"),
    }
    if damage in edits:
        before, after = edits[damage]
        assert raw.count(before) == 1, damage
        raw = raw.replace(before, after)
    newest.write_bytes(bytes(raw))
    refusal = CheckpointUnchecked if damage == "checksum removed" else CheckpointCorrupt
    with pytest.raises(refusal, match=r"step-000003.safetensors"):
        load_checkpoint(newest)
    with pytest.warns(UserWarning, match=r"skipping a damaged checkpoint, resuming from step-000002.safetensors"):
        path, state = load_intact(out)
    assert path.name == "step-000002.safetensors" and state["step"] == 2
    with pytest.warns(UserWarning, match=r"skipping a damaged checkpoint"):
        resumed = train_forecast(tiny_recipe(tmp_path / "data", out, steps=4, save_every=2), resume=str(out))
    assert resumed.step == 4
    assert_same_heads(full, resumed)


def test_checkpoint_holds_its_checksum(tmp_path):
    """Issue 26 item 13: every checkpoint carries a sha256 of its state in its metadata."""
    train_forecast(tiny_recipe(tmp_path / "data", tmp_path / "run", steps=2))
    with safe_open(str(list_checkpoints(tmp_path / "run")[-1]), "pt") as f:
        assert len(f.metadata()["forecastkv.sha256"]) == 64


# ----------------------------------------------------------------------------------------------
# issue 25 item 11: feature cache, progress, signals
# ----------------------------------------------------------------------------------------------


def test_resume_reuses_the_cached_features(tmp_path, monkeypatch):
    """Issue 25 item 11: a run keeps its round's features in the run directory; --resume reads them
    (no frozen forward at all) instead of rebuilding them, reports the build time it saved, and
    still ends bit-identical to an uninterrupted run.  A damaged cache file is rebuilt."""
    recipe = lambda out: tiny_recipe(tmp_path / "data", out, steps=6, save_every=2, steps_per_round=6, rows_per_step=8)  # noqa: E731
    full = train_forecast(recipe(tmp_path / "full"))
    assert not (tmp_path / "full" / "features").exists()  # a finished run keeps no cache
    out = tmp_path / "cut"
    first = train_forecast(recipe(out), max_steps=3)
    assert first.speed["features_built"] == 4 and first.speed["features_read"] == 0
    cached = sorted((out / "features").glob("round-000000-chunk-*.safetensors"))
    assert len(cached) == 4

    built = []
    from forecastkv.training import rounds as rounds_module  # where a round's features are built

    real = rounds_module.build_features
    monkeypatch.setattr(rounds_module, "build_features", lambda *a, **k: built.append(1) or real(*a, **k))
    started = time.perf_counter()
    resumed = train_forecast(recipe(out), resume=str(out))
    assert built == [] and resumed.speed["features_read"] == 4 and resumed.speed["features_built"] == 0
    assert resumed.speed["feature_saved_s"] == pytest.approx(first.speed["feature_s"], rel=0.5)
    assert resumed.speed["feature_read_s"] < time.perf_counter() - started
    assert_same_heads(full, resumed)

    # a damaged cache file is a miss (with a warning), rebuilt, and the result is the same
    train_forecast(recipe(tmp_path / "cut2"), max_steps=3)
    victim = sorted((tmp_path / "cut2" / "features").glob("*.safetensors"))[1]
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0xFF
    victim.write_bytes(bytes(raw))
    built.clear()
    with pytest.warns(UserWarning, match=r"does not match its checksum; rebuilding it"):
        again = train_forecast(recipe(tmp_path / "cut2"), resume=str(tmp_path / "cut2"))
    assert len(built) == 1 and again.speed["features_read"] == 3
    assert_same_heads(full, again)


def test_feature_key_covers_what_features_depend_on(tmp_path):
    """Another seq_len / row_start / objective / model means another key: never a stale read."""
    from forecastkv.training.trainer import build_model, feature_identity, feature_key, load_recipe

    recipe = load_recipe(tiny_recipe(tmp_path / "data", tmp_path / "run"))
    model, _ = build_model(recipe["model"], torch.device("cpu"))
    ids = torch.arange(64).view(1, 64)
    key = lambda r, ids=ids, rnd=0, chunk=0: feature_key(
        feature_identity(r, model, "fp", "cpu", "no"), ids, rnd, chunk, model
    )  # noqa: E731
    base = key(recipe)
    changed = [
        {**recipe, "data": {**recipe["data"], "row_start": 8}},
        {**recipe, "objective": {**recipe["objective"], "chunk_size": 7}},
        {**recipe, "model": {**recipe["model"], "seed": 1}},
        {**recipe, "model": {**recipe["model"], "backbone": "dense"}},
    ]
    assert (
        len({base, *(key(r) for r in changed), key(recipe, ids=ids + 1), key(recipe, rnd=1), key(recipe, chunk=1)}) == 8
    )
    assert key(recipe) == base


def test_progress_shows_features_and_the_end(tmp_path, capsys):
    """Issue 25 item 11: the feature build has its own bar, and the guard and the final evaluation
    after the last step show theirs (stderr)."""
    recipe = tiny_recipe(tmp_path / "data", tmp_path / "run", steps=2, progress=True, eval_at_start=False)
    recipe["data"]["val_sequences"] = 1
    train_forecast(recipe)
    err = capsys.readouterr().err
    assert "features, round 0 (4 sequences x 3 layers)" in err
    assert "features, round 0: 4 micro-batches of this process: built 4 in" in err
    assert "forecast" in err and "2/2" in err
    assert "guard (1 unseen windows), starting heads" in err and "guard (1 unseen windows), trained heads" in err
    assert "recall at step 2 (2 held-out sequences)" in err
    assert "writing the last checkpoint" in err


def test_forecast_recall_bar_moves_per_layer(capsys):
    """Issue 25 item 11: forecast-recall's bar counts layers, not whole sequences."""
    from forecastkv.training.recall import forecast_recall
    from tests.helpers import tiny_model

    model = tiny_model(mode={"topk": 4})
    forecast_recall(model, torch.randint(0, 128, (2, 64)), 32, progress=True)
    err = capsys.readouterr().err
    assert "recall (2 sequences x 3 layers)" in err and "6/6" in err


def test_interrupt_in_process_writes_a_checkpoint(tmp_path, monkeypatch, uninterrupted):
    """Issue 25 item 11: a stop signal during a step saves a checkpoint at that step, raises
    TrainingInterrupted (exit status 130), and a resume ends bit-identical to an uninterrupted run."""
    full = uninterrupted(steps=5, save_every=10)
    real = trainer_module.backward_step
    # what the run must restore: Python's default, or SIG_IGN where a shell started pytest in the
    # background without job control
    before = signal.getsignal(signal.SIGINT)

    def interrupted(*args):
        loss = real(*args)
        if args[4] == 2:  # the step that makes step 3
            os.kill(os.getpid(), signal.SIGINT)
        return loss

    monkeypatch.setattr(trainer_module, "backward_step", interrupted)
    out = tmp_path / "cut"
    with pytest.raises(TrainingInterrupted) as stop:
        train_forecast(tiny_recipe(tmp_path / "data", out, steps=5, save_every=10))
    assert stop.value.exit_status == 130 and stop.value.step == 3
    assert [p.name for p in list_checkpoints(out)] == ["step-000003.safetensors"]
    assert f"resume with: forecastkv train-forecast --resume {out}" in stop.value.message()
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored
    monkeypatch.setattr(trainer_module, "backward_step", real)
    assert_same_heads(
        full, train_forecast(tiny_recipe(tmp_path / "data", out, steps=5, save_every=10), resume=str(out))
    )


@pytest.mark.slow  # the console script in a subprocess, signalled mid-run
@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_at_a_random_step_leaves_a_checkpoint(tmp_path, signum, status):
    """Issue 25 item 11: `forecastkv train-forecast` gets SIGINT (or SIGTERM) at a random step after
    the first is logged: it writes a checkpoint, says in one line how to resume, exits 130 (143)
    without a traceback; the resume finishes the run."""
    config = write_config(tmp_path, steps=100000, save_every=100000, log_every=1, eval_every=-1, threads=1)
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-c",
        "import sys; from forecastkv.cli import main; sys.exit(main())",
        "train-forecast",
        "--config",
        str(config),
        "--output",
        str(out),
        "--no-progress",
    ]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "metrics.jsonl").is_file() and metric_steps(out)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    time.sleep(random.uniform(0, 0.5))
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == status, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"forecastkv train-forecast: {signal.Signals(signum).name}: stopped at step ")
    assert last.endswith(f"resume with: forecastkv train-forecast --resume {out}")
    step = int(last.split("stopped at step ")[1].split(",")[0])
    assert step >= 1 and [p.name for p in list_checkpoints(out)][-1] == f"step-{step:06d}.safetensors"
    assert metric_steps(out)[-1] == step
    state = load_checkpoint(list_checkpoints(out)[-1])
    assert state["step"] == step
    # the resume continues from there (here: to step + 2)
    assert forecastkv_main(["train-forecast", "--resume", str(out), "--steps", str(step + 2), "--no-progress"]) == 0
    assert metric_steps(out) == list(range(1, step + 3))


# ----------------------------------------------------------------------------------------------
# issue 25 item 13: --data / --seq-len / --steps
# ----------------------------------------------------------------------------------------------


def test_data_seq_len_and_steps_overrides(tmp_path, capsys):
    """Issue 25 item 13: train-forecast --data DIR --seq-len T --steps N overrides the recipe;
    bad values are one line and exit 2; a resume may not change its data."""
    config = write_config(tmp_path, steps=9)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("my own corpus " * 300)
    (corpus / "b.jsonl").write_text(
        "\n".join(json.dumps({"text": "line %d of mine " % i * 20}) for i in range(20)) + "\n"
    )
    out = tmp_path / "run"
    assert (
        forecastkv_main(
            [
                "train-forecast",
                "--config",
                str(config),
                "--output",
                str(out),
                "--data",
                str(corpus),
                "--seq-len",
                "32",
                "--steps",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    recipe = json.loads((out / "recipe.json").read_text())
    assert (recipe["data"]["source"], recipe["data"]["seq_len"], recipe["train"]["steps"]) == (str(corpus), 32, 2)
    assert metric_steps(out) == [1, 2]
    capsys.readouterr()
    for bad, says in (
        (["--seq-len", "0"], "must be at least 1"),
        (["--steps", "x"], "expected a positive integer"),
        (["--data", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["--data", str(config)], "neither a .txt nor a .jsonl"),
    ):
        with pytest.raises(SystemExit) as exit_:
            forecastkv_main(["train-forecast", "--config", str(config), "--output", str(tmp_path / "bad"), *bad])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err
    assert forecastkv_main(["train-forecast", "--resume", str(out), "--seq-len", "48"]) == 2
    assert "--seq-len 48 differs from the resumed run's data.seq_len=32" in capsys.readouterr().err


def test_a_full_disk_at_a_checkpoint_names_where_the_run_resumes(tmp_path, full_disk, uninterrupted):
    """Issue 39: the second checkpoint's write hits a full disk (ENOSPC at its fsync).  The run stops
    with one DiskFullError line that names the step it reached, its last intact checkpoint and the
    --resume command; nothing else is left; with room again the resume ends bit-identical."""
    from forecastkv.errors import DiskFullError

    full = uninterrupted(steps=4, save_every=2)
    out = tmp_path / "run"
    full_disk("step-000004")  # the second checkpoint and its temporary
    with pytest.raises(DiskFullError) as stop:
        train_forecast(tiny_recipe(tmp_path / "data", out, steps=4, save_every=2))
    assert (
        f"training stopped at step 4, its last intact checkpoint: step 2's (--resume {out} continues once "
        "there is room)" in str(stop.value)
    )
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000002.safetensors"]  # no temporary
    full_disk(None)
    assert_same_heads(full, train_forecast(tiny_recipe(tmp_path / "data", out, steps=4, save_every=2), resume=str(out)))
