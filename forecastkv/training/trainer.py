"""Fine-tune the Forecast heads of a frozen sparse base model (SparDA §3, shared/DESIGN.md "Training").

Read top to bottom:

1. the recipe (`recipe.py`: YAML or dict over `DEFAULTS`) and the `accelerate` state (one or many
   processes);
2. the model: the frozen base (its own sparse config, or the recipe's), Forecast heads created and
   initialised (`apply_forecast_init`); only the heads that score some layer train
   (`modeling.heads.trainable_head_names`: current_proj of layer 0, forecast_proj of layers
   0..L-2), everything else has requires_grad False;
3. rounds: every `train.steps_per_round` steps the next `global_batch` sequences come from the
   data stream (each process its slice) and the frozen model runs over them once
   (`features.build_features`, through the model's own decoder loop) to cache what the heads read
   at `data.cache_rows` query rows: post-norm inputs, next-layer compressed keys, teacher rows and
   their top-k targets;
4. a step: `rows_per_step` of the cached rows per sequence, drawn by a generator seeded with
   (seed, `ROW_DRAW_SALT`, step, micro-batch), every layer's loss on them (`objective.rows_kl`),
   one backward; gradients summed over processes (a manual all-reduce), clipped, AdamW step.  A
   step costs one projection and one [rows x C] softmax per layer: a small fraction of a forward;
5. the first round also calibrates the heads' output norm to the real queries' (`calibrate_init`);
6. the per-layer guard (`data.val_sequences` > 0): after the last step, each layer's recall is
   measured on validation windows of training text the run never visited
   (`data.unvisited_windows`), with the starting heads and with the trained ones; a layer whose
   trained head scores below its start gets the start back, so no layer ends below its init;
7. held-out forecast recall with the protocol of `recall.forecast_recall`, checkpoints
   (`checkpointing.py`), and at the end `forecast.safetensors` + `forecast_config.json`.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forecastkv.atomic import write_text_atomic
from forecastkv.bundled import resolve_model_path
from forecastkv.modeling import selection as sel
from forecastkv.modeling.forecast_init import apply_forecast_init, calibrate_forecast_scale
from forecastkv.modeling.heads import scoring_head_name, trainable_head_names

from . import checkpointing as ckpt
from .data import ByteTokenizer, build_sequences, unvisited_windows
from .features import Features, build_features, cached_rows, head_vectors
from .objective import ObjectiveConfig, rows_kl
from .recall import measure_recall_counts
from .recipe import (  # noqa: F401  (DEFAULTS, load_recipe, rows_per_sequence: importable from here too)
    DEFAULTS,
    check_against_model,
    check_recipe,
    eval_window,
    last_step,
    load_recipe,
    resolve_recipe,
    rows_per_sequence,
    val_window,
    visited_sequences,
)

# Salt of the per-step row draws, seeded (train.seed, ROW_DRAW_SALT, step, micro-batch): it keeps
# that stream apart from the per-round cached-row draws, seeded (train.seed, round, micro-batch).
# Changing it changes which rows every step trains on (and so every result).
ROW_DRAW_SALT = 7

# The head whose vectors select layer m's blocks, by state-dict name (the index of
# `RecallReport.recall`); `modeling.heads` holds the rule.
recall_head_name = scoring_head_name


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
    dtypes = {"auto": torch.bfloat16 if cuda else torch.float32, "bfloat16": torch.bfloat16, "float32": torch.float32}
    if model_cfg["dtype"] not in dtypes:
        raise ValueError(f"model.dtype={model_cfg['dtype']!r} is not one of {sorted(dtypes)}")
    if model_cfg["path"] is not None:
        base = resolve_model_path(model_cfg["path"])  # what from_pretrained reads (bundled names resolved)
        kwargs = {"forecast_weights": model_cfg["forecast_weights"]} if model_cfg["forecast_weights"] else {"forecast": forecast}
        model = ForecastKVForCausalLM.from_pretrained(base, sparse_config=sparse, **kwargs)
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
    model.to(device=device, dtype=dtypes[model_cfg["dtype"]])
    for _, param in forecast_heads(model):
        param.data = param.data.float()
    return model.eval(), base


def forecast_heads(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable tensors in state-dict order: the heads that score some layer
    (`modeling.heads.trainable_head_names`; the last layer's forecast_proj has no consumer and
    stays frozen)."""
    names = set(trainable_head_names(model.config.num_hidden_layers))
    return [(name, p) for name, p in model.named_parameters() if name in names]


def freeze_base(model) -> list[torch.nn.Parameter]:
    """requires_grad False everywhere but the trainable heads; returns those."""
    model.requires_grad_(False)
    params = [p for _, p in forecast_heads(model)]
    for p in params:
        p.requires_grad_(True)
    return params


def _head_copy(model) -> dict:
    """{name: CPU copy} of the trainable heads."""
    return {n: p.detach().cpu().clone() for n, p in forecast_heads(model)}


# ----------------------------------------------------------------------------------------------
# one round, one step
# ----------------------------------------------------------------------------------------------


def _seeded(*parts: int) -> torch.Generator:
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part)) % (2**63 - 1)
    return torch.Generator().manual_seed(value)


def build_round(model, batch: torch.Tensor, first_chunk: int, round_index: int, recipe: dict, objective: ObjectiveConfig, device) -> list[Features]:
    """Cached features of this process's sequences batch [n, T], one `Features` per micro-batch
    (`Features.merge` joins them); micro-batch k (global index first_chunk + k) caches rows drawn
    with seed (seed, round, chunk)."""
    data, train = recipe["data"], recipe["train"]
    sparse = model.config.sparse
    micro, parts = train["micro_batch"], []
    for k, start in enumerate(range(0, batch.shape[0], micro)):
        rows = cached_rows(batch.shape[1], data["row_start"], data["cache_rows"], _seeded(train["seed"], round_index, first_chunk + k))
        ids = batch[start : start + micro].to(device)
        parts.append(build_features(model, ids, rows, sparse, objective, recipe["model"]["backbone"]))
    return parts


def step_rows(features: Features, first_chunk: int, step: int, recipe: dict) -> torch.Tensor | None:
    """Row indices [B, r] into the cached rows for this step (None: all rows).  Sequence b belongs
    to micro-batch first_chunk + b // micro_batch, whose draw is seeded with (seed, salt, step,
    chunk), so the draw does not depend on how the sequences are split over processes."""
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
            draws[chunk] = torch.randperm(count, generator=_seeded(train["seed"], ROW_DRAW_SALT, step, chunk))[:take].sort().values
    return torch.stack([draws[first_chunk + b // micro] for b in range(batch)]).to(features.positions.device)


def step_loss(model, features: Features, first_chunk: int, step: int, recipe: dict, objective: ObjectiveConfig, denominator: float) -> list[float]:
    """Back-propagate one step's loss over this process's cached rows; returns the per-layer
    losses (this process's share of the global mean)."""
    sparse = model.config.sparse
    index = step_rows(features, first_chunk, step, recipe)
    feats = features if index is None else features.take(index)
    per_layer, total = [], 0.0
    for layer in range(model.config.num_hidden_layers):
        targets = None if feats.targets is None else feats.targets[layer]
        loss = rows_kl(head_vectors(model, feats, layer), feats.ckeys[layer], feats.positions, feats.teachers[layer], sparse, objective.loss, targets)
        loss = loss / denominator
        per_layer.append(float(loss.detach()))
        total = total + loss
    total.backward()
    return per_layer


def sum_over_processes(params: list[torch.nn.Parameter], accelerator) -> None:
    """All-reduce (sum) the gradients of `params` in one flat buffer.  Each micro-batch loss was
    scaled by its share of the global batch, so the sum is the global-batch mean gradient."""
    grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
    grads = accelerator.reduce(grads, reduction="sum")
    offset = 0
    for p in params:
        p.grad = grads[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def backward_step(model, params, features: Features, first_chunk: int, step: int, recipe: dict, objective, denominator: float, accelerator) -> float:
    """Gradients of the global-batch loss in `params` (this process's share, summed over
    processes); returns that loss (summed over layers)."""
    layer_losses = step_loss(model, features, first_chunk, step, recipe, objective, denominator)
    loss = torch.tensor([sum(layer_losses)], dtype=torch.float64)
    if accelerator.num_processes > 1:
        sum_over_processes(params, accelerator)
        loss = accelerator.reduce(loss.to(accelerator.device), reduction="sum").cpu()
    return float(loss)


@torch.no_grad()
def _calibration_sums(model, part: Features) -> torch.Tensor:
    """One micro-batch's calibration sums, float64 [L*H*n + L*Hq + 1]: squared head-output norms
    summed over its rows, squared real-query norms summed over its rows, the row count."""
    layers = model.config.num_hidden_layers
    head_sq = torch.stack([head_vectors(model, part, m).double().pow(2).sum(-1).sum(dim=(0, 1)).cpu() for m in range(layers)])
    rows = part.positions.numel()
    query_sq = part.query_sq.double().cpu() * rows
    return torch.cat([head_sq.flatten(), query_sq.flatten(), torch.tensor([float(rows)], dtype=torch.float64)])


@torch.no_grad()
def calibrate_from_features(model, parts: list[Features], accelerator) -> None:
    """Scale every head so its mean squared output norm equals the real queries' it imitates,
    measured on the cached rows of all processes (`forecast_init.calibrate_forecast_scale`).

    parts: this process's micro-batches (`build_round`).  Each micro-batch's sums are gathered
    from every process and added in global micro-batch order, so the factors are bitwise the same
    however the batch is split over processes (a sum over processes would round differently).
    """
    sums = torch.stack([_calibration_sums(model, part) for part in parts])           # [micro-batches, S]
    if accelerator.num_processes > 1:
        sums = accelerator.gather(sums.to(accelerator.device)).cpu()                  # rank order = global order
    total = sums.sum(dim=0)
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    head_sq, query_sq = total[:-1].split([total.numel() - 1 - layers * heads, layers * heads])
    count = total[-1]
    calibrate_forecast_scale(model, (head_sq / count).view(layers, -1).float(), (query_sq / count).view(layers, heads).float())


# ----------------------------------------------------------------------------------------------
# evaluation, guard
# ----------------------------------------------------------------------------------------------


def evaluate(model, sequences: torch.Tensor, start: int, backbone: str, accelerator) -> dict:
    """Held-out forecast recall (`recall.measure_recall_counts`), sequences split over
    processes, counts summed; returns `RecallReport.to_dict()`."""
    rank, world = accelerator.process_index, accelerator.num_processes
    counts = torch.zeros(model.config.num_hidden_layers, 3, dtype=torch.float64)
    with accelerator.autocast():
        for row in range(rank, sequences.shape[0], world):
            counts += measure_recall_counts(model, sequences[row : row + 1].to(accelerator.device), start, backbone)
    if world > 1:
        counts = accelerator.reduce(counts.to(accelerator.device), reduction="sum").cpu()
    length = sequences.shape[1]
    return sel.summarise_recall(counts, start, length, sequences.shape[0] * (length - start), backbone).to_dict()


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
        name = scoring_head_name(layer)
        if new < old and name in heads:
            heads[name].copy_(start_heads[name].to(heads[name].device))
            restored.append(layer)
    return {"start": before["recall"], "trained": after["recall"], "restored": restored,
            "length": sequences.shape[1], "rows_from": start, "sequences": sequences.shape[0]}


# ----------------------------------------------------------------------------------------------
# set-up pieces
# ----------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    output_dir: Path
    step: int
    model: object
    history: list = field(default_factory=list)   # eval dicts, each with its "step"
    losses: list = field(default_factory=list)     # (step, loss summed over layers)
    speed: dict = field(default_factory=dict)      # steps_per_s (optimizer steps only), feature_s, step_s
    guard: dict | None = None                      # `guard_layers`' result (data.val_sequences > 0)


@dataclass
class Progress:
    """What a run has done so far, and what a checkpoint carries of it besides the tensors."""

    step: int = 0
    history: list = field(default_factory=list)    # eval dicts
    losses: list = field(default_factory=list)     # (step, loss)
    start_heads: dict | None = None                # the heads after calibration, before step 1: the guard's fallback
    guard: dict | None = None                      # the guard's result, once it ran


def _tokenizer(data_cfg: dict, model, path: str | None):
    """The recipe's tokenizer: bytes (`ByteTokenizer`), data.tokenizer, or the model's own."""
    if data_cfg["tokenizer"] == "bytes":
        return ByteTokenizer(model.config.vocab_size)
    source = data_cfg["tokenizer"] or path
    if source is None:
        raise ValueError("data.tokenizer is needed for a random model (use 'bytes' or a tokenizer path)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(source))
    tokenizer.model_max_length = int(1e12)  # we pack; silence the length warning
    return tokenizer


def _datasets(recipe: dict, tokenizer):
    """(training stream, held-out eval sequences [N, T] or None, validation windows or None)."""
    data_cfg, train = recipe["data"], recipe["train"]
    fields = {"text_field": data_cfg["text_field"], "token_field": data_cfg["token_field"]}
    data = build_sequences(
        data_cfg["source"], tokenizer, data_cfg["seq_len"], split=data_cfg["split"], max_documents=data_cfg["max_documents"],
        seed=data_cfg["shuffle_seed"], min_sequences=train["global_batch"], name="training data", pack=data_cfg["pack"], **fields,
    )
    eval_seqs = None
    if data_cfg["eval_source"] and data_cfg["eval_sequences"] > 0:
        held = build_sequences(
            data_cfg["eval_source"], tokenizer, eval_window(data_cfg)[0], split=data_cfg["eval_split"], shuffle=False, name="eval data", **fields,
        )
        eval_seqs = held.first(data_cfg["eval_sequences"])
    val_seqs = None
    if data_cfg["val_sequences"] > 0:
        val_seqs = unvisited_windows(data, visited_sequences(train), val_window(data_cfg)[0], data_cfg["val_sequences"])
    return data, eval_seqs, val_seqs


def _optimizer(params: list, train: dict):
    """AdamW with the recipe's settings and a linear warm-up (constant after)."""
    optimizer = torch.optim.AdamW(params, lr=train["lr"], betas=tuple(train["betas"]), eps=train["eps"], weight_decay=train["weight_decay"])
    warmup = train["warmup_steps"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0)
    return optimizer, scheduler


def _resume(resume, model, optimizer, scheduler, data, fingerprint: str, base: str) -> Progress:
    """Load the checkpoint `resume` names (a file or a run directory) into the heads, optimizer,
    scheduler, data stream and RNGs; returns the run's progress at its step.  A checkpoint of
    another base model, or of other heads, is refused."""
    path = ckpt.find_checkpoint(resume)
    state = ckpt.load_checkpoint(path)
    if state["fingerprint"] != fingerprint:
        raise ValueError(
            f"resume checkpoint {path} was written for base model {state['base_model']!r} "
            f"(fingerprint {state['fingerprint']}), but this run uses {base!r} (fingerprint {fingerprint})"
        )
    heads = dict(forecast_heads(model))
    if set(state["trainable"]) != set(heads):
        raise ValueError(f"resume checkpoint {path} holds tensors {sorted(state['trainable'])[:3]}..., this model trains {sorted(heads)[:3]}...")
    with torch.no_grad():
        for name, tensor in state["trainable"].items():
            heads[name].copy_(tensor.to(heads[name].device))
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    data.load_state_dict(state["data"])   # the position at the start of the step's round
    ckpt.set_rng_state(state["rng"])
    return Progress(state["step"], state["history"], state["losses"], state["start_heads"], state["guard"])


def _append_metrics(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _truncate_metrics(path: Path, step: int) -> None:
    """After a resume, drop rows the interrupted run logged beyond the checkpoint."""
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step))


def _recall_table(history: list) -> str:
    """Per-layer recall at the first and the last evaluation (one column when there was one)."""
    if not history:
        return ""
    evals = [history[0], history[-1]] if len(history) > 1 else [history[-1]]
    final = history[-1]
    table = sel.recall_table({f"recall @ step {e['step']}": (e["recall"], e["mean_recall"]) for e in evals}, final["chance"], final["mean_chance"])
    return table + f"\nT = {final['length']}, rows t >= {final['start']}, {final['backbone']} backbone, {final['rows']} rows per layer.\n"


def _guard_note(guard: dict | None) -> str:
    if guard is None:
        return ""
    restored = ", ".join(str(i) for i in guard["restored"]) or "none"
    return (
        f"\nPer-layer guard on {guard['sequences']} unseen training window{'s' if guard['sequences'] != 1 else ''} of {guard['length']} tokens "
        f"(rows t >= {guard['rows_from']}): layers given their starting head back: {restored}.\n"
    )


def _speed(steps: int, step_seconds: float, feature_seconds: float) -> dict:
    """steps_per_s counts optimizer steps over the time spent in them (cached features excluded)."""
    return {"steps_per_s": steps / max(step_seconds, 1e-9), "feature_s": feature_seconds, "step_s": step_seconds}


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------


def train_forecast(config_path_or_dict, **overrides) -> TrainResult:
    """Train the Forecast heads with the recipe `config_path_or_dict` (a YAML path or a dict).

    overrides: `output_dir=`, `resume=` (a run directory or checkpoint file), `max_steps=`,
    `steps=`, or whole sections (`train={...}`, `data={...}`, ...).  Returns a `TrainResult`.
    """
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    # -- recipe, processes, model, data, optimizer ---------------------------------------------
    recipe = resolve_recipe(config_path_or_dict, **overrides)
    ckpt.check_storable(recipe, "recipe")   # fail now, not at the first checkpoint
    train, data_cfg = recipe["train"], recipe["data"]
    objective = ObjectiveConfig.from_dict(recipe["objective"])
    cuda = torch.cuda.is_available()
    accelerator = Accelerator(cpu=not cuda, mixed_precision="bf16" if cuda and recipe["model"]["dtype"] != "float32" else "no")
    rank, world, main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    check_recipe(recipe, world)
    torch.manual_seed(train["seed"])
    random.seed(train["seed"])
    if train["threads"] is not None:
        torch.set_num_threads(train["threads"])

    model, base = build_model(recipe["model"], accelerator.device)
    check_against_model(recipe, model, objective)
    fresh_heads = not recipe["model"]["forecast_weights"]
    if fresh_heads:
        apply_forecast_init(model, recipe["model"]["forecast"]["init"], seed=train["seed"])
    params = freeze_base(model)
    fingerprint = ckpt.model_fingerprint(model)
    data, eval_seqs, val_seqs = _datasets(recipe, _tokenizer(data_cfg, model, recipe["model"]["path"]))
    optimizer, scheduler = _optimizer(params, train)

    # -- resume, outputs -----------------------------------------------------------------------
    out_dir = Path(recipe["output_dir"])
    metrics_path = out_dir / "metrics.jsonl"
    run = _resume(recipe["resume"], model, optimizer, scheduler, data, fingerprint, base) if recipe["resume"] else Progress()
    if main:
        if recipe["resume"]:
            _truncate_metrics(metrics_path, run.step)
        out_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out_dir / "recipe.json", json.dumps({**recipe, "processes": world}, indent=2, default=str))

    # -- this process's share of a global batch ------------------------------------------------
    end, per_round, micro = last_step(train), train["steps_per_round"], train["micro_batch"]
    per_rank = train["global_batch"] // world
    first_chunk = rank * per_rank // micro   # global index of this process's first micro-batch
    denominator = float(train["global_batch"] * model.config.num_key_value_heads * rows_per_sequence(recipe))
    round_start = data.state_dict()          # the data position the current round was taken at

    def next_round(step: int) -> Features:
        """Cache the next global batch's features (this process's slice); the first round also
        calibrates fresh heads and keeps the starting heads for the guard."""
        batch = data.take(train["global_batch"])[rank * per_rank : (rank + 1) * per_rank]
        with accelerator.autocast():
            parts = build_round(model, batch, first_chunk, step // per_round, recipe, objective, accelerator.device)
        if step == 0 and fresh_heads and recipe["model"]["calibrate_init"]:
            calibrate_from_features(model, parts, accelerator)
        if step == 0 and val_seqs is not None:
            run.start_heads = _head_copy(model)
        return Features.merge(parts)

    def run_eval(step: int) -> None:
        if eval_seqs is not None:
            result = {"step": step, **evaluate(model, eval_seqs, eval_window(data_cfg)[1], data_cfg["eval_backbone"], accelerator)}
            run.history.append(result)
            if main:
                _append_metrics(metrics_path, {"step": step, "eval": result})

    def save(step: int) -> None:
        if main:
            # mid-round: the round's start, so a resume rebuilds the same cached features
            position = round_start if step % per_round else data.state_dict()
            ckpt.save_checkpoint(out_dir, step, {
                "step": step, "trainable": _head_copy(model), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": ckpt.rng_state(), "data": position, "recipe": recipe, "fingerprint": fingerprint, "base_model": base,
                "sparse_config": model.config.sparse.to_dict(), "forecast": model.config.forecast_config.to_dict(),
                "history": run.history, "losses": run.losses, "start_heads": run.start_heads, "guard": run.guard,
            }, train["keep_last"])
        accelerator.wait_for_everyone()

    # -- the loop ------------------------------------------------------------------------------
    bar = tqdm(total=train["steps"], initial=run.step, disable=not (main and train["progress"]), desc="forecast", dynamic_ncols=True)
    if run.step == 0 and train["eval_every"] >= 0 and train["eval_at_start"]:
        run_eval(0)
    features, feature_seconds, step_seconds, steps_run = None, 0.0, 0.0, 0
    for step in range(run.step, end):        # `step` optimizer steps are done; this one makes step + 1
        if features is None or step % per_round == 0:
            round_start, features = data.state_dict(), None   # free the previous round first
            started = time.time()
            features = next_round(step)
            feature_seconds += time.time() - started
        started = time.time()
        optimizer.zero_grad(set_to_none=True)
        loss = backward_step(model, params, features, first_chunk, step, recipe, objective, denominator, accelerator)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, train["grad_clip"]))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        step_seconds += time.time() - started
        steps_run += 1
        run.step = done = step + 1
        run.losses.append((done, loss))
        if main and (done % train["log_every"] == 0 or done == end):
            _append_metrics(metrics_path, {"step": done, "loss": loss, "grad_norm": grad_norm, "lr": lr, **_speed(steps_run, step_seconds, feature_seconds)})
        if train["eval_every"] > 0 and done % train["eval_every"] == 0 and done < end:
            run_eval(done)
        bar.set_postfix({"loss": f"{loss:.4f}", **({"recall": f"{run.history[-1]['mean_recall']:.3f}"} if run.history else {})})
        bar.update(1)
        if done % train["save_every"] == 0 and done < end:
            save(done)
    bar.close()

    # -- the end: guard, last evaluation, checkpoint, weights ----------------------------------
    if val_seqs is not None and run.guard is None and run.step >= train["steps"]:  # not when max_steps cut the run short
        if run.start_heads is None:
            raise ValueError("data.val_sequences > 0, but the resumed checkpoint holds no starting heads to guard with")
        run.guard = guard_layers(model, run.start_heads, val_seqs, val_window(data_cfg)[1], data_cfg["eval_backbone"], accelerator)
        if main:
            _append_metrics(metrics_path, {"step": run.step, "guard": run.guard})
        if run.history and run.history[-1]["step"] == run.step:
            run.history.pop()  # measured before the guard gave layers their starting heads back
    if train["eval_every"] >= 0 and (not run.history or run.history[-1]["step"] != run.step):
        run_eval(run.step)
    save(run.step)
    if main:
        model.save_forecast_weights(out_dir, base_model=base)
        write_text_atomic(out_dir / "recall.md", _recall_table(run.history) + _guard_note(run.guard))
    accelerator.wait_for_everyone()
    return TrainResult(out_dir, run.step, model, run.history, run.losses, _speed(steps_run, step_seconds, feature_seconds), run.guard)
