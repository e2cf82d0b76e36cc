"""A training run's directory and its stop signals: the metrics log (`append_metrics`,
`truncate_metrics`), what a run does with a directory that holds another (`prepare_run_dir`: resume an
interrupted one, refuse a finished one, `--overwrite`), and SIGINT / SIGTERM turned into a checkpoint
at the next safe point (`Signals`, `TrainingInterrupted`).
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import threading
from pathlib import Path

from forecastkv.atomic import append_line, write_text_atomic
from forecastkv.errors import UserInputError

from . import checkpointing as ckpt
from .rounds import FEATURE_DIR


def append_metrics(path: Path, row: dict) -> None:
    append_line(path, json.dumps(row) + "\n")  # a full disk cuts the row off whole


def truncate_metrics(path: Path, step: int) -> None:
    """After a resume, drop rows the interrupted run logged beyond the checkpoint."""
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step))


class RunExists(UserInputError):
    """A fresh run into the directory of a finished one: refused (nothing is retrained)."""


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT / SIGTERM stopped the run; `checkpoint` holds its last step (None: no step was done).
    `exit_status` is 128 + the signal's number (130 for SIGINT), as a shell reports it."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, output_dir: Path) -> None:
        self.signum, self.step, self.checkpoint, self.output_dir = signum, step, checkpoint, output_dir
        self.exit_status = 128 + int(signum)
        super().__init__(self.message())

    def message(self) -> str:
        name = signal.Signals(self.signum).name
        if self.checkpoint is None:
            return (
                f"{name}: stopped before the first step; nothing to save (features built so far are kept in "
                f"{self.output_dir / FEATURE_DIR}); run the same command again to start"
            )
        return (
            f"{name}: stopped at step {self.step}, saved {self.checkpoint}; resume with: "
            f"forecastkv train-forecast --resume {self.output_dir}"
        )


class Stop(Exception):
    """Raised at a safe point once a stop signal arrived (caught by `train_forecast`)."""


class Signals:
    """SIGINT / SIGTERM set a flag that the run reads at safe points (after a step, between layers
    of a feature build, between evaluated sequences); a second signal stops at once.  Installed
    only in the main thread; the previous handlers come back on exit."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without a checkpoint")
        self.received = signum

    def __enter__(self) -> "Signals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def say(main: bool, text: str) -> None:
    """One line on stderr from the main process (through tqdm, so an open bar is not torn)."""
    if main:
        from tqdm.auto import tqdm

        tqdm.write(text, file=sys.stderr)


def finished(state: dict) -> bool:
    return state["step"] >= state["recipe"]["train"]["steps"]


def prepare_run_dir(out_dir: Path, overwrite: bool, main: bool, allow_unchecked: bool = False) -> str | None:
    """Decide what a run without `resume` does with `out_dir`; returns the directory to resume
    from, or None for a fresh start.

    * empty / new: a fresh start;
    * a finished run (its newest intact checkpoint reached its recipe's train.steps, and its
      forecast.safetensors is written): refused with `RunExists` -- it is never retrained silently;
    * an interrupted run (a checkpoint short of its steps, or a finished one killed before its
      weights were written): resumed from its newest intact checkpoint;
    * rows in metrics.jsonl but no checkpoint (killed before the first save): a fresh start, the
      old rows dropped.
    overwrite: delete the previous run's checkpoints and outputs (not its feature cache, whose
    files are keyed by what they depend on) and start fresh.  Each choice is said in one line.
    """
    found = ckpt.list_checkpoints(out_dir)
    if overwrite:
        if main and (found or (out_dir / "metrics.jsonl").exists()):
            shutil.rmtree(out_dir / ckpt.CHECKPOINT_DIR, ignore_errors=True)
            for name in ckpt.RUN_FILES:
                (out_dir / name).unlink(missing_ok=True)
            say(main, f"--overwrite: deleted the previous run's checkpoints and outputs in {out_dir}; starting again")
        return None
    if found:
        path, state = ckpt.load_intact(out_dir, allow_unchecked)
        steps = state["recipe"]["train"]["steps"]
        if finished(state) and (out_dir / "forecast.safetensors").is_file():
            raise RunExists(
                f"{out_dir} holds a finished run (step {state['step']} of {steps}); nothing was retrained: pass "
                f"--resume {out_dir} --steps N to train it further, --overwrite to start again, or another --output"
            )
        say(
            main,
            f"resuming the interrupted run in {out_dir} from step {state['step']} of {steps} ({path.name}); "
            "--overwrite starts it again instead",
        )
        return str(path)
    if (out_dir / "metrics.jsonl").exists():
        say(
            main,
            f"starting again in {out_dir}: the interrupted run there left no checkpoint (its metrics.jsonl is dropped)",
        )
    return None
