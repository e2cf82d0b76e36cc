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

from ..errors import ConfigError, read_yaml_mapping
from . import longbench
from .modes import parse_mode
from .tasks import TASKS

DEFAULTS = {
    "model": {
        "path": None,
        "config": None,
        "seed": 0,
        "sparse_config": None,
        "forecast": None,
        "forecast_weights": None,
        "dtype": None,
    },
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
DTYPES = ("float32", "bfloat16", "float16", "float64")
TASK_KEYS = {"name", "lengths", "examples", "depths", "max_new_tokens", "options"}
LONGBENCH_KEYS = {"dir", "tasks", "lengths", "examples", "e", "max_new_tokens"}


def _check_keys(where: str, given, allowed) -> None:
    if not isinstance(given, dict):
        raise ConfigError(f"{where} must be a mapping, got {given!r}")
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown {where} key(s) {unknown}; allowed: {sorted(allowed)}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_ints(where: str, values) -> list[int]:
    if not isinstance(values, list) or not values or not all(_is_int(v) and v > 0 for v in values):
        raise ConfigError(f"{where} must be a non-empty list of positive integers, got {values!r}")
    return values


def _integer(where: str, value, least: int = 1, optional: bool = False) -> None:
    """`value` is an integer >= least (None allowed when `optional`), as recipes check theirs."""
    if value is None and optional:
        return
    if not _is_int(value) or value < least:
        kind = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise ConfigError(f"{where} must be {kind}{' or null' if optional else ''}, got {value!r}")


def _one_of(where: str, value, kinds: tuple, optional: bool = True) -> None:
    if (value is None and optional) or isinstance(value, kinds):
        return
    names = " or ".join(kind.__name__ for kind in kinds) + (" or null" if optional else "")
    raise ConfigError(f"{where} must be a {names}, got {value!r}")


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
    if isinstance(source, dict):
        return _validated(source, overrides)
    raw = read_yaml_mapping(Path(source), "eval config")
    try:
        return _validated(raw, overrides)
    except ConfigError as error:  # name the file the user gave
        raise ConfigError(f"eval config {str(source)!r}: {error}") from None


def _validated(raw: dict, overrides: dict | None) -> dict:
    raw = copy.deepcopy(raw)
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    _check_keys("eval config", raw, DEFAULTS)
    config = {**copy.deepcopy(DEFAULTS), **raw}
    if not isinstance(raw.get("model") or {}, dict):
        raise ConfigError(f"model must be a mapping (path:, sparse_config:, ...), got {raw['model']!r}")
    model = {**DEFAULTS["model"], **(raw.get("model") or {})}
    _check_keys("model", model, DEFAULTS["model"])
    config["model"] = model
    _check_model(model)
    if not isinstance(config["modes"], list):
        raise ConfigError(f"modes must be a list of mode names, got {config['modes']!r}")
    config["modes"] = [parse_mode(m).name for m in config["modes"]]  # a ConfigError names a bad one
    if not config["modes"] or len(set(config["modes"])) != len(config["modes"]):
        raise ConfigError(f"modes must be a non-empty list without repeats, got {config['modes']}")
    if not isinstance(config["tasks"], list):
        raise ConfigError(f"tasks must be a list of task entries, got {config['tasks']!r}")
    for i, task in enumerate(config["tasks"]):
        _check_task(f"tasks[{i}]", task)
    bench = config["longbench"]
    if bench is not None:
        _check_keys("longbench", bench, LONGBENCH_KEYS)
        if not isinstance(bench.get("tasks"), list) or not bench["tasks"]:
            raise ConfigError(
                f"longbench.tasks must be a non-empty list of LongBench task names, got {bench.get('tasks')!r}"
            )
        for name in bench["tasks"]:
            if name not in longbench.PROMPTS:
                raise ConfigError(f"unknown LongBench task {name!r}; known: {sorted(longbench.PROMPTS)}")
        _positive_ints("longbench.lengths", bench.get("lengths"))
        _integer("longbench.examples", bench.get("examples"), optional=True)
        _integer("longbench.max_new_tokens", bench.get("max_new_tokens"), optional=True)
        _one_of("longbench.dir", bench.get("dir"), (str,))
        _one_of("longbench.e", bench.get("e"), (bool,))
    if not config["tasks"] and bench is None:
        raise ConfigError("the eval config has no tasks and no longbench section")
    if config["recall"] not in ("forecast", "all", "none"):
        raise ConfigError(f"recall must be one of ('forecast', 'all', 'none'), got {config['recall']!r}")
    for name in ("prefill_chunk", "bucket_tokens"):
        _integer(name, config[name])
    _integer("seed", config["seed"], least=0)
    _integer("recall_start", config["recall_start"], least=0, optional=True)
    _one_of("tokenizer", config["tokenizer"], (str,))
    _one_of("output_dir", config["output_dir"], (str, Path), optional=False)
    _one_of("progress", config["progress"], (bool,))
    return config


def _check_model(model: dict) -> None:
    if (model["path"] is None) == (model["config"] is None):
        raise ConfigError("model needs exactly one of path (a checkpoint) and config (a random model for tests)")
    _one_of("model.path", model["path"], (str, Path))
    _one_of("model.config", model["config"], (dict,))
    _one_of("model.sparse_config", model["sparse_config"], (str, dict))
    _one_of("model.forecast", model["forecast"], (dict,))
    _one_of("model.forecast_weights", model["forecast_weights"], (str, Path))
    if model["dtype"] is not None and model["dtype"] not in DTYPES:
        raise ConfigError(f"model.dtype must be one of {DTYPES} or null, got {model['dtype']!r}")
    _integer("model.seed", model["seed"], least=0)


def _check_task(where: str, task) -> None:
    """One `tasks:` entry: a known task, lengths, and counts that are positive integers."""
    _check_keys(where, task, TASK_KEYS)
    if task.get("name") not in TASKS:
        raise ConfigError(f"unknown task {task.get('name')!r} in {where}; known: {sorted(TASKS)}")
    _positive_ints(f"{where}.lengths", task.get("lengths"))
    _integer(f"{where}.examples", task.get("examples"), optional=True)
    _integer(f"{where}.max_new_tokens", task.get("max_new_tokens"), optional=True)
    _one_of(f"{where}.options", task.get("options"), (dict,))
    depths = task.get("depths")
    if depths is not None and not (
        isinstance(depths, list)
        and depths
        and all(isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d <= 1 for d in depths)
    ):
        raise ConfigError(f"{where}.depths must be a non-empty list of numbers in [0, 1], got {depths!r}")


def work_units(config: dict, limit: int | None = None, longbench_rows: dict | None = None) -> list[Unit]:
    """Every example of the suite in its canonical order (tasks in order, then lengths, then index);
    `limit` caps the examples per (task, length); `longbench_rows`: rows per LongBench task."""
    units: list[Unit] = []
    for spec, task in enumerate(config["tasks"]):
        count = task.get("examples") or 1
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
