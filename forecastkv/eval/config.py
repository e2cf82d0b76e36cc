"""The suite file (`configs/eval/<suite>.yaml`): defaults, validation and the work list.

    model:      path (dir / hub id / bundled:<name>) or config (a dict: a random model, for tests);
                sparse_config (preset name or dict), forecast (creates heads), forecast_weights, dtype
    tokenizer:  a path (default: the model's) or "bytes"
    modes:      ["dense", "infllmv2-query", "infllmv2-forecast@forecast-offload", ...]
    tasks:      [{name, lengths, examples, depths, max_new_tokens, options}]   (see tasks.TASKS)
    longbench:  {dir (official JSONL files; null = `datasets`), tasks, lengths, examples, e}
    seed, prefill_chunk, bucket_tokens, output_dir
    recall:     "forecast" (measure forecast recall in forecast-selector modes), "all" (every sparse
                mode with heads: costs a second selection per layer), or "none";
                recall_start: first prefill row counted (null: budget blocks x block size)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import yaml

from . import longbench
from .modes import parse_mode
from .tasks import TASKS

DEFAULTS = {
    "model": {"path": None, "config": None, "seed": 0, "sparse_config": None, "forecast": None,
              "forecast_weights": None, "dtype": None},
    "tokenizer": None,
    "modes": ["dense", "infllmv2-query"],
    "tasks": [],
    "longbench": None,
    "seed": 0,
    "prefill_chunk": 1024,
    "recall_start": None,
    "recall": "forecast",
    "bucket_tokens": 1024,
    "output_dir": "runs/eval",
    "progress": True,
}
TASK_KEYS = {"name", "lengths", "examples", "depths", "max_new_tokens", "options"}
LONGBENCH_KEYS = {"dir", "tasks", "lengths", "examples", "e", "max_new_tokens"}


def _check_keys(where: str, given: dict, allowed) -> None:
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {where} key(s) {unknown}; allowed: {sorted(allowed)}")


def _positive_ints(where: str, values) -> list[int]:
    if not isinstance(values, list) or not values or not all(isinstance(v, int) and v > 0 for v in values):
        raise ValueError(f"{where} must be a non-empty list of positive integers, got {values!r}")
    return values


@dataclass(frozen=True)
class Unit:
    """One example to build: a generated task or a LongBench row, at one length."""

    task: str
    length: int
    index: int
    spec: int  # position of its entry in tasks (or -1 for LongBench)
    depth: float | None = None

    @property
    def key(self) -> str:
        return f"{self.task}/{self.length}/{self.index}"


def load_config(source: str | Path | dict, overrides: dict | None = None) -> dict:
    """Read a suite (a YAML path or a dict), apply `overrides`, fill defaults, validate statically
    (names and shapes; the model-dependent checks are in `runner.validate_against_model`)."""
    raw = source if isinstance(source, dict) else yaml.safe_load(Path(source).read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"eval config {source!r} must be a mapping")
    raw = copy.deepcopy(raw)
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    _check_keys("eval config", raw, DEFAULTS)
    config = {**copy.deepcopy(DEFAULTS), **raw}
    model = {**DEFAULTS["model"], **(raw.get("model") or {})}
    _check_keys("model", model, DEFAULTS["model"])
    if (model["path"] is None) == (model["config"] is None):
        raise ValueError("model needs exactly one of path (a checkpoint) and config (a random model for tests)")
    config["model"] = model
    config["modes"] = [parse_mode(m).name for m in config["modes"]]
    if not config["modes"] or len(set(config["modes"])) != len(config["modes"]):
        raise ValueError(f"modes must be a non-empty list without repeats, got {config['modes']}")
    for i, task in enumerate(config["tasks"]):
        _check_keys(f"tasks[{i}]", task, TASK_KEYS)
        if task.get("name") not in TASKS:
            raise ValueError(f"unknown task {task.get('name')!r} in tasks[{i}]; known: {sorted(TASKS)}")
        _positive_ints(f"tasks[{i}].lengths", task.get("lengths"))
        depths = task.get("depths")
        if depths is not None and not (isinstance(depths, list) and depths and all(0 <= d <= 1 for d in depths)):
            raise ValueError(f"tasks[{i}].depths must be a non-empty list of numbers in [0, 1], got {depths!r}")
    bench = config["longbench"]
    if bench is not None:
        _check_keys("longbench", bench, LONGBENCH_KEYS)
        for name in bench.get("tasks") or []:
            if name not in longbench.PROMPTS:
                raise ValueError(f"unknown LongBench task {name!r}; known: {sorted(longbench.PROMPTS)}")
        _positive_ints("longbench.lengths", bench.get("lengths"))
        if not bench.get("tasks"):
            raise ValueError("longbench.tasks must name at least one task")
    if not config["tasks"] and bench is None:
        raise ValueError("the eval config has no tasks and no longbench section")
    if config["recall"] not in ("forecast", "all", "none"):
        raise ValueError(f"recall must be one of ('forecast', 'all', 'none'), got {config['recall']!r}")
    for name in ("prefill_chunk", "bucket_tokens"):
        if not isinstance(config[name], int) or config[name] < 1:
            raise ValueError(f"{name} must be a positive integer, got {config[name]!r}")
    return config


def work_units(config: dict, limit: int | None = None, longbench_rows: dict | None = None) -> list[Unit]:
    """Every example of the suite in its canonical order (tasks in order, then lengths, then index);
    `limit` caps the examples per (task, length); `longbench_rows`: rows per LongBench task."""
    units: list[Unit] = []
    for spec, task in enumerate(config["tasks"]):
        count = task.get("examples", 1)
        count = min(count, limit) if limit is not None else count
        depths = task.get("depths")
        for length in task["lengths"]:
            for index in range(count):
                depth = depths[index % len(depths)] if depths else None
                units.append(Unit(task["name"], length, index, spec, depth))
    bench = config["longbench"]
    if bench is not None:
        for name in bench["tasks"]:
            rows = len(longbench_rows[name]) if longbench_rows is not None else 0
            count = min(rows, bench.get("examples") or rows)
            count = min(count, limit) if limit is not None else count
            for length in bench["lengths"]:
                for index in range(count):
                    units.append(Unit(f"longbench:{name}", length, index, -1))
    return units


def max_new_tokens(config: dict, unit: Unit) -> int:
    if unit.spec >= 0:
        task = config["tasks"][unit.spec]
        return task["max_new_tokens"] if task.get("max_new_tokens") is not None else TASKS[unit.task][1]
    bench = config["longbench"]
    name = unit.task.split(":", 1)[1]
    return bench["max_new_tokens"] if bench.get("max_new_tokens") is not None else longbench.MAX_NEW_TOKENS[name]
