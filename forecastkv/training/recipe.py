"""The Forecast trainer's recipe: `DEFAULTS`, merging, checks and the defaults that depend on
other settings.

    recipe = load_recipe("configs/train/smollm2-135m.yaml", train={"steps": 4})

A recipe is `DEFAULTS` <- a YAML file or dict <- keyword overrides, merged section by section
(`forecastkv.merge.deep_merge`, strict: an unknown key is an error naming its dotted path).
`model.config` and `model.sparse_config` are single values, replaced whole.  `check_recipe`
validates what needs no model, `check_against_model` what does; the helpers below resolve the
settings whose None means "derived from another one" (eval / validation windows, the last step).
"""

from __future__ import annotations

import os

from forecastkv.errors import ConfigError, read_yaml_mapping
from forecastkv.merge import deep_merge

from .objective import ObjectiveConfig

DEFAULTS: dict = {
    "model": {
        "path": None,  # checkpoint dir / hub id / "bundled:<name>"; or `config` below
        "config": None,  # ForecastKVConfig kwargs for a random model (tests)
        "seed": 0,  # weights of a random `config` model
        "sparse_config": None,  # preset name or dict; None keeps the checkpoint's own
        "forecast": {"heads_per_group": 1, "init": "kaiming"},
        "forecast_weights": None,  # start from trained heads (a forecast.safetensors directory)
        "calibrate_init": True,  # scale each new head so its output norm matches the real queries'
        "backbone": "query",  # what the frozen model attends with: dense | query | forecast
        "dtype": "auto",  # auto: bfloat16 on CUDA, float32 on CPU
    },
    "data": {
        "source": "bundled",
        "split": "train",
        "text_field": "text",
        "token_field": None,
        "max_documents": None,
        "pack": True,  # False: each pre-tokenised dataset row is one sequence (lazy)
        "tokenizer": None,  # None: the model's; "bytes": ByteTokenizer (tests)
        "seq_len": 1024,
        "shuffle_seed": 0,
        "row_start": 0,  # cached query rows come from [row_start, seq_len)
        "cache_rows": None,  # rows cached per sequence (None: all of [row_start, seq_len))
        "eval_source": "bundled",
        "eval_split": "heldout",
        "eval_sequences": 4,
        "eval_seq_len": None,  # None: seq_len.  Recall needs lengths well past the budget
        "eval_start": None,  # recall counts rows t >= eval_start (None: eval_seq_len // 2)
        "eval_backbone": "dense",
        "val_sequences": 0,  # > 0: per-layer guard on unseen training text (step.guard_layers)
        "val_seq_len": None,  # None: seq_len
        "val_start": None,  # None: val_seq_len // 2
    },
    "objective": ObjectiveConfig().to_dict(),
    "train": {
        "steps": 2000,
        "max_steps": None,  # stop (with a checkpoint) once this step is reached
        "global_batch": 32,  # sequences per round
        "micro_batch": 1,  # sequences per frozen forward
        "steps_per_round": 1,  # optimizer steps on one round's cached features
        "rows_per_step": None,  # cached rows drawn per sequence per step (None: all)
        "lr": 5e-4,
        "warmup_steps": 0,
        "betas": [0.9, 0.95],
        "eps": 1e-6,
        "weight_decay": 0.01,
        "grad_clip": 0.5,
        "seed": 0,
        "log_every": 1,
        "eval_every": 100,  # 0: only before and after; -1: never
        "eval_at_start": True,  # False: skip the step-0 evaluation (the init's recall)
        "save_every": 50,
        "keep_last": 5,
        "progress": True,
        "threads": None,  # torch intra-op threads (None: torch's default); 1 is faster on a busy CPU
    },
    "output_dir": "runs/forecast",
    "resume": None,
}

OPAQUE = ("config", "sparse_config")  # dict values that replace the default whole
SHORTCUTS = {"max_steps": "train", "steps": "train"}  # load_recipe(max_steps=3) = train={"max_steps": 3}


# ----------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------


def _merge(base: dict, override: dict) -> dict:
    """`deep_merge`, strict: its one refusal (an unknown key, named by its dotted path) is a ConfigError."""
    if not isinstance(override, dict):
        raise ConfigError(f"a recipe must be a mapping, got a {type(override).__name__}")
    return _config_error(lambda: deep_merge(base, override, strict=True, opaque=OPAQUE))


def load_recipe(config_path_or_dict, **overrides) -> dict:
    """The full recipe: `DEFAULTS` <- the YAML file / dict <- overrides.

    Overrides: any top-level section as a dict (`train={"steps": 4}`), `output_dir`, `resume`, and
    the shortcuts `max_steps`, `steps`; None values are ignored.
    """
    if isinstance(config_path_or_dict, (str, os.PathLike)):
        given = read_yaml_mapping(config_path_or_dict, "recipe")
    else:
        given = dict(config_path_or_dict or {})
    recipe = _merge(DEFAULTS, given)
    for key, value in overrides.items():
        if value is None:
            continue
        if key in SHORTCUTS:
            recipe[SHORTCUTS[key]][key] = value
        else:
            recipe = _merge(recipe, {key: value})
    _config_error(ObjectiveConfig.from_dict, recipe["objective"])  # its values, checked now: one line, not a traceback
    return recipe


def _config_error(check, *args):
    """`check(*args)`, whose ValueError (a value it refuses) becomes a ConfigError."""
    try:
        return check(*args)
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(str(error)) from None


def resolve_recipe(config_path_or_dict, **overrides) -> dict:
    """`load_recipe`, and a resumed run continues in the interrupted run's directory unless
    `output_dir=` says otherwise (the run directory above the checkpoint `resume` names)."""
    from .checkpointing import find_checkpoint

    recipe = load_recipe(config_path_or_dict, **overrides)
    if recipe["resume"] and overrides.get("output_dir") is None:
        recipe["output_dir"] = str(find_checkpoint(recipe["resume"]).parent.parent)
    return recipe


# ----------------------------------------------------------------------------------------------
# derived settings
# ----------------------------------------------------------------------------------------------


def eval_window(data: dict) -> tuple[int, int]:
    """(length, first counted row) of the held-out recall sequences."""
    length = data["eval_seq_len"] or data["seq_len"]
    return length, data["eval_start"] if data["eval_start"] is not None else length // 2


def val_window(data: dict) -> tuple[int, int]:
    """(length, first counted row) of the guard's validation windows."""
    length = data["val_seq_len"] or data["seq_len"]
    return length, data["val_start"] if data["val_start"] is not None else length // 2


def last_step(train: dict) -> int:
    """The step this run stops at: train.steps, or train.max_steps when that comes first."""
    return train["steps"] if train["max_steps"] is None else min(train["steps"], train["max_steps"])


def visited_sequences(train: dict) -> int:
    """Training sequences a whole run (train.steps) takes from the data stream: one global batch per round."""
    return -(-train["steps"] // train["steps_per_round"]) * train["global_batch"]


def rows_per_sequence(recipe: dict) -> int:
    """Query rows one sequence contributes to a step."""
    data, train = recipe["data"], recipe["train"]
    cached = data["seq_len"] - data["row_start"]
    if data["cache_rows"] is not None:
        cached = min(cached, data["cache_rows"])
    return cached if train["rows_per_step"] is None else min(cached, train["rows_per_step"])


# ----------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------


def _positive_int(section: dict, where: str, key: str, allow_none: bool = False, least: int = 1) -> None:
    value = section[key]
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        kind = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise ConfigError(f"{where}.{key} must be {kind}, got {value!r}")


def check_recipe(recipe: dict, world: int) -> None:
    """What can be checked before the model loads; `world` is the number of processes."""
    for section, default in DEFAULTS.items():
        if isinstance(default, dict) and not isinstance(recipe[section], dict):
            raise ConfigError(f"recipe section {section!r} must be a mapping, got {recipe[section]!r}")
    train, data = recipe["train"], recipe["data"]
    for key in ("lr", "grad_clip"):
        value = train[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"train.{key} must be a positive number, got {value!r}")
    _positive_int(data, "data", "row_start", least=0)
    _positive_int(data, "data", "eval_sequences")
    for key in ("global_batch", "micro_batch", "steps_per_round", "log_every", "save_every"):
        _positive_int(train, "train", key)
    _positive_int(train, "train", "rows_per_step", allow_none=True)
    _positive_int(train, "train", "steps", least=0)
    _positive_int(train, "train", "max_steps", allow_none=True, least=0)
    _positive_int(train, "train", "keep_last", least=0)
    _positive_int(train, "train", "eval_every", least=-1)
    _positive_int(data, "data", "seq_len")
    _positive_int(data, "data", "val_sequences", least=0)
    _positive_int(data, "data", "cache_rows", allow_none=True)
    if not 0 <= data["row_start"] < data["seq_len"]:
        raise ConfigError(f"data.row_start={data['row_start']} must lie in [0, data.seq_len={data['seq_len']})")
    eval_len, _ = eval_window(data)
    if data["eval_start"] is not None and not 0 <= data["eval_start"] < eval_len:
        raise ConfigError(f"data.eval_start={data['eval_start']} must lie in [0, eval length {eval_len})")
    val_len, _ = val_window(data)
    if data["val_start"] is not None and not 0 <= data["val_start"] < val_len:
        raise ConfigError(f"data.val_start={data['val_start']} must lie in [0, validation length {val_len})")
    per_step = world * train["micro_batch"]
    if train["global_batch"] % per_step:
        raise ConfigError(
            f"train.global_batch={train['global_batch']} must be a multiple of processes x micro_batch = "
            f"{world} x {train['micro_batch']}"
        )


def check_against_model(recipe: dict, model, objective: ObjectiveConfig) -> None:
    """The recipe's lengths against the model's context and sparse geometry, and the objective's
    teacher grid against the deployed one."""
    config, sparse = model.config, model.config.sparse
    _config_error(objective.check_against, sparse)
    for key in ("seq_len", "eval_seq_len", "val_seq_len"):
        length = recipe["data"][key]
        if length is None:
            continue
        if length > config.max_position_embeddings:
            raise ConfigError(
                f"data.{key}={length} exceeds the model's max_position_embeddings={config.max_position_embeddings}"
            )
        if length < sparse.kernel_size:
            raise ConfigError(
                f"data.{key}={length} is shorter than sparse_config.kernel_size={sparse.kernel_size}: "
                "no compressed key to select"
            )
