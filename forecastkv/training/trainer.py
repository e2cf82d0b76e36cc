"""Fine-tune the Forecast heads of a frozen sparse base model (SparDA §3, shared/DESIGN.md "Training").

Read top to bottom:

1. the recipe (YAML or dict, `DEFAULTS` below) and the `accelerate` state (one or many processes);
2. the model: the frozen base (its own sparse config, or the recipe's), Forecast heads created and
   initialised (`apply_forecast_init`); only `forecast_proj` of layers 0..L-2 and `current_proj`
   train, everything else has requires_grad False;
3. rounds: every `train.steps_per_round` steps the next `global_batch` sequences come from the
   data stream (each process its slice) and the frozen model runs over them once
   (`features.build_features`, through the model's own decoder loop) to cache what the heads read
   at `data.cache_rows` query rows: post-norm inputs, next-layer compressed keys, teacher rows;
4. a step: per cached micro-batch, `rows_per_step` of the cached rows drawn by a generator seeded
   with (seed, step, micro-batch), every layer's loss on them (`objective.rows_kl`), one backward;
   gradients summed over processes (a manual all-reduce), clipped, AdamW step.  A step costs one
   projection and one [rows x C] softmax per layer: a small fraction of a forward;
5. the first round also calibrates the heads' output norm to the real queries' (`calibrate_init`);
6. the per-layer guard (`data.val_sequences` > 0): after the last step, each layer's recall is
   measured on validation windows of training text the run never visited
   (`data.unvisited_windows`), with the starting heads and with the trained ones; a layer whose
   trained head scores below its start gets the start back, so no layer ends below its init;
7. held-out forecast recall with the protocol of `selection.forecast_recall`, checkpoints
   (`checkpointing.py`), and at the end `forecast.safetensors` + `forecast_config.json`.
"""

from __future__ import annotations

import copy
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forecastkv.modeling import selection as sel
from forecastkv.modeling.forecast_init import apply_forecast_init, calibrate_forecast_scale

from . import checkpointing as ckpt
from .data import ByteTokenizer, build_sequences, unvisited_windows
from .features import Features, build_features, cached_rows, head_vectors
from .objective import ObjectiveConfig, rows_kl

DEFAULTS: dict = {
    "model": {
        "path": None,                 # checkpoint dir / hub id / "bundled:<name>"; or `config` below
        "config": None,               # ForecastKVConfig kwargs for a random model (tests)
        "seed": 0,                    # weights of a random `config` model
        "sparse_config": None,        # preset name or dict; None keeps the checkpoint's own
        "forecast": {"heads_per_group": 1, "init": "kaiming"},
        "forecast_weights": None,     # start from trained heads (a forecast.safetensors directory)
        "calibrate_init": True,       # scale each new head so its output norm matches the real queries'
        "backbone": "query",          # what the frozen model attends with: dense | query | forecast
        "dtype": "auto",              # auto: bfloat16 on CUDA, float32 on CPU
    },
    "data": {
        "source": "bundled",
        "split": "train",
        "text_field": "text",
        "token_field": None,
        "max_documents": None,
        "pack": True,                 # False: each pre-tokenised dataset row is one sequence (lazy)
        "tokenizer": None,            # None: the model's; "bytes": ByteTokenizer (tests)
        "seq_len": 1024,
        "shuffle_seed": 0,
        "row_start": 0,               # cached query rows come from [row_start, seq_len)
        "cache_rows": None,           # rows cached per sequence (None: all of [row_start, seq_len))
        "eval_source": "bundled",
        "eval_split": "heldout",
        "eval_sequences": 4,
        "eval_seq_len": None,         # None: seq_len.  Recall needs lengths well past the budget
        "eval_start": None,           # recall counts rows t >= eval_start (None: eval_seq_len // 2)
        "eval_backbone": "dense",
        "val_sequences": 0,           # > 0: per-layer guard on unseen training text (below)
        "val_seq_len": None,          # None: seq_len
        "val_start": None,            # None: val_seq_len // 2
    },
    "objective": ObjectiveConfig().to_dict(),
    "train": {
        "steps": 2000,
        "max_steps": None,            # stop (with a checkpoint) once this step is reached
        "global_batch": 32,           # sequences per round
        "micro_batch": 1,             # sequences per frozen forward
        "steps_per_round": 1,         # optimizer steps on one round's cached features
        "rows_per_step": None,        # cached rows drawn per sequence per step (None: all)
        "lr": 5e-4,
        "warmup_steps": 0,
        "betas": [0.9, 0.95],
        "eps": 1e-6,
        "weight_decay": 0.01,
        "grad_clip": 0.5,
        "seed": 0,
        "log_every": 1,
        "eval_every": 100,            # 0: only before and after; -1: never
        "eval_at_start": True,        # False: skip the step-0 evaluation (the init's recall)
        "save_every": 50,
        "keep_last": 5,
        "progress": True,
        "threads": None,              # torch intra-op threads (None: torch's default); 1 is faster on a busy CPU
    },
    "output_dir": "runs/forecast",
    "resume": None,
}


# ----------------------------------------------------------------------------------------------
# recipe
# ----------------------------------------------------------------------------------------------


def _merge(base: dict, override: dict, where: str = "") -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if key not in base:
            raise ValueError(f"unknown recipe key {where + key!r}; allowed: {sorted(base)}")
        if isinstance(base[key], dict) and isinstance(value, dict) and key not in ("config", "sparse_config"):
            out[key] = _merge(base[key], value, f"{where}{key}.")
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_recipe(config_path_or_dict, **overrides) -> dict:
    """The full recipe: `DEFAULTS` <- the YAML file / dict <- overrides.

    Overrides: any top-level section as a dict (`train={"steps": 4}`), `output_dir`, `resume`, and
    the shortcuts `max_steps`, `steps`.
    """
    if isinstance(config_path_or_dict, (str, os.PathLike)):
        import yaml

        with open(config_path_or_dict) as f:
            given = yaml.safe_load(f) or {}
    else:
        given = dict(config_path_or_dict or {})
    recipe = _merge(DEFAULTS, given)
    shortcuts = {"max_steps": "train", "steps": "train"}
    for key, value in overrides.items():
        if value is None:
            continue
        if key in shortcuts:
            recipe[shortcuts[key]][key] = value
        else:
            recipe = _merge(recipe, {key: value})
    return recipe


# ----------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------


def build_model(model_cfg: dict, device: torch.device):
    """(model, base name).  The base is frozen; Forecast heads exist (created when the checkpoint
    lacks them) and are float32."""
    from forecastkv import ForecastKVConfig, ForecastKVForCausalLM

    forecast = {**model_cfg["forecast"], "enabled": True}
    sparse = model_cfg["sparse_config"]
    cuda = device.type == "cuda"
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32, "bfloat16": torch.bfloat16, "float32": torch.float32}[model_cfg["dtype"]]
    if model_cfg["path"] is not None:
        path = str(model_cfg["path"])
        if path.startswith("bundled:"):
            from forecastkv.bundled import bundled_model_path

            path = bundled_model_path(path.split(":", 1)[1])
        kwargs = {"forecast_weights": model_cfg["forecast_weights"]} if model_cfg["forecast_weights"] else {"forecast": forecast}
        model = ForecastKVForCausalLM.from_pretrained(path, sparse_config=sparse, **kwargs)
        base = path  # what from_pretrained read (bundled names resolved to their directory)
    elif model_cfg["config"] is not None:
        settings = {**model_cfg["config"], "forecast": forecast}
        if sparse is not None:
            settings["sparse_config"] = sparse
        torch.manual_seed(model_cfg["seed"])
        model = ForecastKVForCausalLM(ForecastKVConfig(**settings))
        base = f"random:{model_cfg['seed']}"
    else:
        raise ValueError("the recipe needs model.path (a checkpoint) or model.config (a random model)")
    if model.config.sparse is None:
        from forecastkv.modeling.configuration import list_presets

        raise ValueError(
            f"base model {base!r} has no sparse_config and the recipe gives none: set model.sparse_config "
            f"to a preset name {list_presets()} or a dict of sparse_config keys"
        )
    model.to(device=device, dtype=dtype)
    for _, param in forecast_heads(model):
        param.data = param.data.float()
    return model.eval(), base


def forecast_heads(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable tensors in state-dict order: forecast_proj of layers 0..L-2, current_proj of
    layer 0 (the last layer's forecast_proj has no consumer and stays frozen)."""
    last = model.config.num_hidden_layers - 1
    names = {"model.layers.0.self_attn.current_proj.weight"}
    names |= {f"model.layers.{i}.self_attn.forecast_proj.weight" for i in range(last)}
    return [(name, p) for name, p in model.named_parameters() if name in names]


def freeze_base(model) -> list[torch.nn.Parameter]:
    model.requires_grad_(False)
    params = [p for _, p in forecast_heads(model)]
    for p in params:
        p.requires_grad_(True)
    return params


# ----------------------------------------------------------------------------------------------
# one round, one step
# ----------------------------------------------------------------------------------------------


def _seeded(*parts: int) -> torch.Generator:
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part)) % (2**63 - 1)
    return torch.Generator().manual_seed(value)


def build_round(model, batch: torch.Tensor, first_chunk: int, round_index: int, recipe: dict, objective: ObjectiveConfig, device) -> Features:
    """Cached features of this process's sequences batch [n, T], built one micro-batch at a time
    and merged; micro-batch k (global index first_chunk + k) caches rows drawn with seed
    (seed, round, chunk)."""
    data, train = recipe["data"], recipe["train"]
    sparse = model.config.sparse
    micro, out = train["micro_batch"], []
    for k, start in enumerate(range(0, batch.shape[0], micro)):
        rows = cached_rows(batch.shape[1], data["row_start"], data["cache_rows"], _seeded(train["seed"], round_index, first_chunk + k))
        ids = batch[start : start + micro].to(device)
        out.append(build_features(model, ids, rows, sparse, objective, recipe["model"]["backbone"]))
    return Features.merge(out)


def step_rows(features: Features, first_chunk: int, step: int, recipe: dict) -> torch.Tensor | None:
    """Row indices [B, r] into the cached rows for this step (None: all rows).  Sequence b belongs
    to micro-batch first_chunk + b // micro_batch, whose draw is seeded with (seed, step, chunk),
    so the draw does not depend on how the sequences are split over processes."""
    train = recipe["train"]
    batch, count = features.positions.shape
    take = train["rows_per_step"]
    if take is None or take >= count:
        return None
    micro = train["micro_batch"]
    draws = {}
    for b in range(batch):
        chunk = first_chunk + b // micro
        if chunk not in draws:
            draws[chunk] = torch.randperm(count, generator=_seeded(train["seed"], 7, step, chunk))[:take].sort().values
    return torch.stack([draws[first_chunk + b // micro] for b in range(batch)]).to(features.positions.device)


def step_loss(model, features: Features, first_chunk: int, step: int, recipe: dict, objective: ObjectiveConfig, denominator: float) -> list[float]:
    """Back-propagate one step's loss over this process's cached rows; returns the per-layer
    losses (this process's share of the global mean)."""
    sparse = model.config.sparse
    index = step_rows(features, first_chunk, step, recipe)
    feats = features if index is None else features.take(index)
    per_layer, total = [], 0.0
    for layer in range(model.config.num_hidden_layers):
        vectors = head_vectors(model, feats, layer)
        loss = rows_kl(vectors, feats.ckeys[layer], feats.positions, feats.teachers[layer], sparse, objective.loss) / denominator
        per_layer.append(float(loss.detach()))
        total = total + loss
    total.backward()
    return per_layer


def rows_per_sequence(recipe: dict) -> int:
    """Query rows one sequence contributes to a step."""
    data, train = recipe["data"], recipe["train"]
    cached = data["seq_len"] - data["row_start"]
    if data["cache_rows"] is not None:
        cached = min(cached, data["cache_rows"])
    return cached if train["rows_per_step"] is None else min(cached, train["rows_per_step"])


@torch.no_grad()
def calibrate_from_features(model, features: Features, accelerator) -> None:
    """Scale every head so its mean squared output norm equals the real queries' it imitates,
    measured on the cached rows of all processes (`forecast_init.calibrate_forecast_scale`)."""
    layers = model.config.num_hidden_layers
    head_sq = torch.stack([head_vectors(model, features, m).float().pow(2).sum(-1).sum(dim=(0, 1)).cpu() for m in range(layers)])
    rows = features.positions.numel()
    query_sq = features.query_sq * rows
    stacked = torch.cat([head_sq.flatten(), query_sq.flatten(), torch.tensor([float(rows)])]).double()
    if accelerator.num_processes > 1:
        stacked = accelerator.reduce(stacked.to(accelerator.device), reduction="sum").cpu()
    count = stacked[-1]
    head_sq = (stacked[: head_sq.numel()] / count).view_as(head_sq)
    query_sq = (stacked[head_sq.numel() : -1] / count).view_as(query_sq)
    calibrate_forecast_scale(model, head_sq.float(), query_sq.float())


def evaluate(model, sequences: torch.Tensor, start: int, backbone: str, accelerator) -> dict:
    """Held-out forecast recall (`selection.measure_recall_counts`), sequences split over
    processes, counts summed; returns `RecallReport.to_dict()`."""
    rank, world = accelerator.process_index, accelerator.num_processes
    counts = torch.zeros(model.config.num_hidden_layers, 3, dtype=torch.float64)
    with accelerator.autocast():
        for row in range(rank, sequences.shape[0], world):
            counts += sel.measure_recall_counts(model, sequences[row : row + 1].to(accelerator.device), start, backbone)
    if world > 1:
        counts = accelerator.reduce(counts.to(accelerator.device), reduction="sum").cpu()
    length = sequences.shape[1]
    return sel.summarise_recall(counts, start, length, sequences.shape[0] * (length - start), backbone).to_dict()


def recall_head_name(layer: int) -> str:
    """The head whose vectors select layer `layer`'s blocks: layer 0's current_proj, else the
    previous layer's forecast_proj (the index of `RecallReport.recall`)."""
    if layer == 0:
        return "model.layers.0.self_attn.current_proj.weight"
    return f"model.layers.{layer - 1}.self_attn.forecast_proj.weight"


@torch.no_grad()
def guard_layers(model, start_heads: dict, sequences: torch.Tensor, start: int, backbone: str, accelerator) -> dict:
    """Give each layer whose validation recall fell below its starting head's the starting head back.

    start_heads: {name: tensor} as `forecast_heads` before training; sequences [N, T] validation
    windows.  Returns {"start": recall per layer, "trained": recall per layer, "restored": [layers]}.
    """
    heads = dict(forecast_heads(model))
    trained = {name: p.detach().clone() for name, p in heads.items()}
    for name, p in heads.items():
        p.copy_(start_heads[name].to(p.device))
    before = evaluate(model, sequences, start, backbone, accelerator)
    for name, p in heads.items():
        p.copy_(trained[name])
    after = evaluate(model, sequences, start, backbone, accelerator)
    restored = []
    for layer, (old, new) in enumerate(zip(before["recall"], after["recall"])):
        name = recall_head_name(layer)
        if new < old and name in heads:
            heads[name].copy_(start_heads[name].to(heads[name].device))
            restored.append(layer)
    return {"start": before["recall"], "trained": after["recall"], "restored": restored,
            "length": sequences.shape[1], "rows_from": start, "sequences": sequences.shape[0]}


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------


def sum_over_processes(params: list[torch.nn.Parameter], accelerator) -> None:
    """All-reduce (sum) the gradients of `params` in one flat buffer.  Each micro-batch loss was
    scaled by its share of the global batch, so the sum is the global-batch mean gradient."""
    grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
    grads = accelerator.reduce(grads, reduction="sum")
    offset = 0
    for p in params:
        p.grad = grads[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


@dataclass
class TrainResult:
    output_dir: Path
    step: int
    model: object
    history: list = field(default_factory=list)   # eval dicts, each with its "step"
    losses: list = field(default_factory=list)     # (step, loss summed over layers)
    speed: dict = field(default_factory=dict)      # steps_per_s (optimizer steps only), feature_s, step_s
    guard: dict | None = None                      # `guard_layers`' result (data.val_sequences > 0)


def _tokenizer(data_cfg: dict, model, path: str | None):
    if data_cfg["tokenizer"] == "bytes":
        return ByteTokenizer(model.config.vocab_size)
    source = data_cfg["tokenizer"] or path
    if source is None:
        raise ValueError("data.tokenizer is needed for a random model (use 'bytes' or a tokenizer path)")
    if source.startswith("bundled:"):
        from forecastkv.bundled import bundled_model_path

        source = bundled_model_path(source.split(":", 1)[1])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.model_max_length = int(1e12)  # we pack; silence the length warning
    return tokenizer


def _check_lengths(recipe: dict, model, world: int) -> None:
    config, sparse = model.config, model.config.sparse
    for key in ("seq_len", "eval_seq_len", "val_seq_len"):
        length = recipe["data"][key]
        if length is None:
            continue
        if length > config.max_position_embeddings:
            raise ValueError(f"data.{key}={length} exceeds the model's max_position_embeddings={config.max_position_embeddings}")
        if length < sparse.kernel_size:
            raise ValueError(f"data.{key}={length} is shorter than sparse_config.kernel_size={sparse.kernel_size}: no compressed key to select")
    train, data = recipe["train"], recipe["data"]
    val_len = data["val_seq_len"] or data["seq_len"]
    if not isinstance(data["val_sequences"], int) or data["val_sequences"] < 0:
        raise ValueError(f"data.val_sequences must be a non-negative integer, got {data['val_sequences']!r}")
    if data["val_start"] is not None and not 0 <= data["val_start"] < val_len:
        raise ValueError(f"data.val_start={data['val_start']} must lie in [0, validation length {val_len})")
    if not 0 <= data["row_start"] < data["seq_len"]:
        raise ValueError(f"data.row_start={data['row_start']} must lie in [0, data.seq_len={data['seq_len']})")
    eval_len = data["eval_seq_len"] or data["seq_len"]
    if data["eval_start"] is not None and not 0 <= data["eval_start"] < eval_len:
        raise ValueError(f"data.eval_start={data['eval_start']} must lie in [0, eval length {eval_len})")
    for key in ("steps_per_round", "rows_per_step"):
        if train[key] is not None and (not isinstance(train[key], int) or train[key] < 1):
            raise ValueError(f"train.{key} must be a positive integer, got {train[key]!r}")
    per_step = world * train["micro_batch"]
    if train["global_batch"] % per_step:
        raise ValueError(
            f"train.global_batch={train['global_batch']} must be a multiple of processes x micro_batch = {world} x {train['micro_batch']}"
        )


def _append_metrics(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _truncate_metrics(path: Path, step: int) -> None:
    """After a resume, drop rows the interrupted run logged beyond the checkpoint."""
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step))


def _recall_table(history: list) -> str:
    """Per-layer recall at the first and the last evaluation (one column when there was one)."""
    if not history:
        return ""
    evals = [history[0], history[-1]] if len(history) > 1 else [history[-1]]
    final = history[-1]
    lines = ["| layer | " + " | ".join(f"recall @ step {e['step']}" for e in evals) + " | chance |", "|---" * (len(evals) + 2) + "|"]
    for i in range(len(final["recall"])):
        lines.append(f"| {i} | " + " | ".join(f"{e['recall'][i]:.3f}" for e in evals) + f" | {final['chance'][i]:.3f} |")
    lines.append("| mean (>= 1) | " + " | ".join(f"{e['mean_recall']:.3f}" for e in evals) + f" | {final['mean_chance']:.3f} |")
    note = f"\nT = {final['length']}, rows t >= {final['start']}, {final['backbone']} backbone, {final['rows']} rows per layer.\n"
    return "\n".join(lines) + "\n" + note


def _guard_note(guard: dict | None) -> str:
    if guard is None:
        return ""
    restored = ", ".join(str(i) for i in guard["restored"]) or "none"
    return (
        f"\nPer-layer guard on {guard['sequences']} unseen training window{'s' if guard['sequences'] != 1 else ''} of {guard['length']} tokens "
        f"(rows t >= {guard['rows_from']}): layers given their starting head back: {restored}.\n"
    )


def train_forecast(config_path_or_dict, **overrides) -> TrainResult:
    """Train the Forecast heads with the recipe `config_path_or_dict` (a YAML path or a dict).

    overrides: `output_dir=`, `resume=` (a run directory or checkpoint file), `max_steps=`,
    `steps=`, or whole sections (`train={...}`, `data={...}`, ...).  Returns a `TrainResult`.
    """
    from accelerate import Accelerator

    recipe = load_recipe(config_path_or_dict, **overrides)
    if recipe["resume"] and overrides.get("output_dir") is None:
        # continue in the interrupted run's directory unless told otherwise
        recipe["output_dir"] = str(ckpt.find_checkpoint(recipe["resume"]).parent.parent)
    train, data_cfg = recipe["train"], recipe["data"]
    objective = ObjectiveConfig.from_dict(recipe["objective"])

    cuda = torch.cuda.is_available()
    accelerator = Accelerator(cpu=not cuda, mixed_precision="bf16" if cuda and recipe["model"]["dtype"] != "float32" else "no")
    rank, world, main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    torch.manual_seed(train["seed"])
    random.seed(train["seed"])
    if train["threads"] is not None:
        torch.set_num_threads(train["threads"])

    # -- model ---------------------------------------------------------------------------------
    model, base = build_model(recipe["model"], accelerator.device)
    objective.check_against(model.config.sparse)
    _check_lengths(recipe, model, world)
    fresh_heads = not recipe["model"]["forecast_weights"]
    if fresh_heads:
        apply_forecast_init(model, recipe["model"]["forecast"]["init"], seed=train["seed"])
    params = freeze_base(model)
    fingerprint = ckpt.model_fingerprint(model)

    # -- data ----------------------------------------------------------------------------------
    tokenizer = _tokenizer(data_cfg, model, recipe["model"]["path"])
    seq_len = data_cfg["seq_len"]
    data = build_sequences(
        data_cfg["source"], tokenizer, seq_len, split=data_cfg["split"], text_field=data_cfg["text_field"],
        token_field=data_cfg["token_field"], max_documents=data_cfg["max_documents"], seed=data_cfg["shuffle_seed"],
        min_sequences=train["global_batch"], name="training data", pack=data_cfg["pack"],
    )
    eval_seqs = None
    if data_cfg["eval_source"] and data_cfg["eval_sequences"] > 0:
        held = build_sequences(
            data_cfg["eval_source"], tokenizer, data_cfg["eval_seq_len"] or seq_len, split=data_cfg["eval_split"], text_field=data_cfg["text_field"],
            token_field=data_cfg["token_field"], shuffle=False, name="eval data",
        )
        eval_seqs = held.first(data_cfg["eval_sequences"])
    eval_start = data_cfg["eval_start"] if data_cfg["eval_start"] is not None else (data_cfg["eval_seq_len"] or seq_len) // 2
    val_seqs = None
    if data_cfg["val_sequences"] > 0:
        visits = -(-train["steps"] // train["steps_per_round"]) * train["global_batch"]
        val_len = data_cfg["val_seq_len"] or seq_len
        val_seqs = unvisited_windows(data, visits, val_len, data_cfg["val_sequences"])
        val_start = data_cfg["val_start"] if data_cfg["val_start"] is not None else val_len // 2

    # -- optimizer -----------------------------------------------------------------------------
    optimizer = torch.optim.AdamW(params, lr=train["lr"], betas=tuple(train["betas"]), eps=train["eps"], weight_decay=train["weight_decay"])
    warmup = train["warmup_steps"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0)

    # -- resume --------------------------------------------------------------------------------
    out_dir = Path(recipe["output_dir"])
    metrics_path = out_dir / "metrics.jsonl"
    step, history, losses = 0, [], []
    start_heads = None  # the heads before the first step (after calibration): the guard's fallback
    guard = None        # the guard's result, once it ran
    if recipe["resume"]:
        path = ckpt.find_checkpoint(recipe["resume"])
        state = ckpt.load_checkpoint(path)
        if state["fingerprint"] != fingerprint:
            raise ValueError(
                f"resume checkpoint {path} was written for base model {state['base_model']!r} "
                f"(fingerprint {state['fingerprint']}), but this run uses {base!r} (fingerprint {fingerprint})"
            )
        names = dict(forecast_heads(model))
        if set(state["trainable"]) != set(names):
            raise ValueError(f"resume checkpoint {path} holds tensors {sorted(state['trainable'])[:3]}..., this model trains {sorted(names)[:3]}...")
        with torch.no_grad():
            for name, tensor in state["trainable"].items():
                names[name].copy_(tensor.to(names[name].device))
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        data.load_state_dict(state["data"])   # the position at the start of the step's round
        ckpt.set_rng_state(state["rng"])
        step, history, losses = state["step"], state["history"], state["losses"]
        start_heads, guard = state.get("start_heads"), state.get("guard")
        if main:
            _truncate_metrics(metrics_path, step)
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "recipe.json").write_text(json.dumps({**recipe, "processes": world}, indent=2, default=str))

    per_round = train["steps_per_round"]
    round_start = data.state_dict()

    def save(step: int) -> None:
        if main:
            # mid-round: the round's start, so a resume rebuilds the same cached features
            position = round_start if step % per_round else data.state_dict()
            state = {
                "step": step, "trainable": {n: p.detach().cpu().clone() for n, p in forecast_heads(model)},
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": ckpt.rng_state(),
                "data": position, "recipe": recipe, "fingerprint": fingerprint, "base_model": base,
                "sparse_config": model.config.sparse_config, "forecast": model.config.forecast,
                "history": history, "losses": losses, "start_heads": start_heads, "guard": guard,
            }
            ckpt.save_checkpoint(out_dir, step, state, train["keep_last"])
        accelerator.wait_for_everyone()

    def run_eval(step: int) -> None:
        if eval_seqs is None:
            return
        result = {"step": step, **evaluate(model, eval_seqs, eval_start, data_cfg["eval_backbone"], accelerator)}
        history.append(result)
        if main:
            _append_metrics(metrics_path, {"step": step, "eval": result})

    # -- loop ----------------------------------------------------------------------------------
    end = train["steps"] if train["max_steps"] is None else min(train["steps"], train["max_steps"])
    per_rank = train["global_batch"] // world
    micro = train["micro_batch"]
    first_chunk = rank * per_rank // micro
    heads = model.config.num_key_value_heads
    denominator = float(train["global_batch"] * heads * rows_per_sequence(recipe))
    from tqdm.auto import tqdm

    bar = tqdm(total=train["steps"], initial=step, disable=not (main and train["progress"]), desc="forecast", dynamic_ncols=True)
    evals = train["eval_every"] >= 0  # -1: no evaluation at all; 0: before and after only
    if step == 0 and evals and train["eval_at_start"]:
        run_eval(0)
    features, feature_seconds, step_seconds, steps_run = None, 0.0, 0.0, 0
    while step < end:
        if features is None or step % per_round == 0:
            round_start = data.state_dict()
            batch = data.take(train["global_batch"])[rank * per_rank : (rank + 1) * per_rank]
            features = None  # free the previous round first
            started = time.time()
            with accelerator.autocast():
                features = build_round(model, batch, first_chunk, step // per_round, recipe, objective, accelerator.device)
            if step == 0 and fresh_heads and recipe["model"]["calibrate_init"]:
                calibrate_from_features(model, features, accelerator)
            if step == 0 and val_seqs is not None:
                start_heads = {n: p.detach().cpu().clone() for n, p in forecast_heads(model)}
            feature_seconds += time.time() - started
        started = time.time()
        optimizer.zero_grad(set_to_none=True)
        layer_losses = step_loss(model, features, first_chunk, step, recipe, objective, denominator)
        step_loss_value = torch.tensor([sum(layer_losses)], dtype=torch.float64)
        if world > 1:
            sum_over_processes(params, accelerator)
            step_loss_value = accelerator.reduce(step_loss_value.to(accelerator.device), reduction="sum").cpu()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, train["grad_clip"]))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        step += 1
        step_seconds += time.time() - started
        steps_run += 1
        loss_value = float(step_loss_value)
        losses.append((step, loss_value))
        if main and (step % train["log_every"] == 0 or step == end):
            _append_metrics(metrics_path, {
                "step": step, "loss": loss_value, "grad_norm": grad_norm, "lr": lr,
                "steps_per_s": steps_run / max(step_seconds, 1e-9), "feature_s": feature_seconds,
            })
        if train["eval_every"] > 0 and step % train["eval_every"] == 0 and step < end:
            run_eval(step)
        postfix = {"loss": f"{loss_value:.4f}"}
        if history:
            postfix["recall"] = f"{history[-1]['mean_recall']:.3f}"
        bar.set_postfix(postfix)
        bar.update(1)
        if step % train["save_every"] == 0 and step < end:
            save(step)
    bar.close()
    if val_seqs is not None and guard is None and step >= train["steps"]:  # not when max_steps cut the run short
        if start_heads is None:
            raise ValueError("data.val_sequences > 0, but the resumed checkpoint holds no starting heads to guard with")
        guard = guard_layers(model, start_heads, val_seqs, val_start, data_cfg["eval_backbone"], accelerator)
        if main:
            _append_metrics(metrics_path, {"step": step, "guard": guard})
        if history and history[-1]["step"] == step:
            history.pop()  # measured before the guard gave layers their starting heads back
    if evals and (not history or history[-1]["step"] != step):
        run_eval(step)
    save(step)
    if main:
        model.save_forecast_weights(out_dir, base_model=base)
        (out_dir / "recall.md").write_text(_recall_table(history) + _guard_note(guard))
    accelerator.wait_for_everyone()
    speed = {"steps_per_s": steps_run / max(step_seconds, 1e-9), "feature_s": feature_seconds, "step_s": step_seconds}
    return TrainResult(output_dir=out_dir, step=step, model=model, history=history, losses=losses, speed=speed, guard=guard)
