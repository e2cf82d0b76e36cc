"""Fine-tune the Forecast heads of a frozen sparse base model (SparDA §3; the README's "Training Forecast heads").

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
   their top-k targets (`rounds.py`: kept on disk under a key, so a resumed run reads them back);
4. a step: `rows_per_step` of the cached rows per sequence, drawn by a generator seeded with
   (seed, `ROW_DRAW_SALT`, step, micro-batch), every layer's loss on them (`objective.rows_kl`),
   one backward; gradients summed over processes (a manual all-reduce), clipped, AdamW step.  A
   step costs one projection and one [rows x C] softmax per layer: a small fraction of a forward
   (`step.py`, with the calibration, evaluation and guard of 5-7);
5. the first round also calibrates the heads' output norm to the real queries' (`calibrate_init`);
6. the per-layer guard (`data.val_sequences` > 0): after the last step, each layer's recall is
   measured on validation windows of training text the run never visited
   (`data.unvisited_windows`), with the starting heads and with the trained ones; a layer whose
   trained head scores below its start gets the start back, so no layer ends below its init;
7. held-out forecast recall with the protocol of `recall.forecast_recall`, checkpoints
   (`checkpointing.py`), and at the end `forecast.safetensors` + `forecast_config.json`; the run
   directory (resume, refuse, `--overwrite`) and the stop signals are `run_dir.py`'s.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forecastkv.atomic import write_text_atomic
from forecastkv.bundled import resolve_model_path
from forecastkv.errors import ConfigError, DiskFullError, UserInputError
from forecastkv.modeling import selection as sel
from forecastkv.modeling.forecast_init import apply_forecast_init
from forecastkv.modeling.heads import scoring_head_name

from . import checkpointing as ckpt
from .data import ByteTokenizer, build_sequences, unvisited_windows
from .features import Features
from .objective import ObjectiveConfig
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
from .rounds import FEATURE_DIR, RoundCache, build_round, feature_identity, feature_key  # noqa: F401
from .run_dir import (  # noqa: F401  (RunExists, TrainingInterrupted: importable from here too)
    RunExists,
    Signals,
    Stop,
    TrainingInterrupted,
    append_metrics,
    finished,
    prepare_run_dir,
    say,
    truncate_metrics,
)
from .step import (  # noqa: F401  (the step's parts: importable from here too)
    ROW_DRAW_SALT,
    backward_step,
    calibrate_from_features,
    evaluate,
    forecast_heads,
    guard_layers,
    progress_bar,
    step_loss,
    step_rows,
)

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
        raise ConfigError(f"model.dtype={model_cfg['dtype']!r} is not one of {sorted(dtypes)}")
    if model_cfg["path"] is not None:
        base = resolve_model_path(model_cfg["path"])  # what from_pretrained reads (bundled names resolved)
        kwargs = (
            {"forecast_weights": model_cfg["forecast_weights"]}
            if model_cfg["forecast_weights"]
            else {"forecast": forecast}
        )
        model = ForecastKVForCausalLM.from_pretrained(base, sparse_config=sparse, **kwargs)
    elif model_cfg["config"] is not None:
        settings = {**model_cfg["config"], "forecast": forecast}
        if sparse is not None:
            settings["sparse_config"] = sparse
        torch.manual_seed(model_cfg["seed"])
        model = ForecastKVForCausalLM(ForecastKVConfig(**settings))
        base = f"random:{model_cfg['seed']}"
    else:
        raise ConfigError("the recipe needs model.path (a checkpoint) or model.config (a random model)")
    if model.config.sparse is None:
        from forecastkv.modeling.configuration import list_presets

        raise ConfigError(
            f"base model {base!r} has no sparse_config and the recipe gives none: set model.sparse_config "
            f"to a preset name {list_presets()} or a dict of sparse_config keys"
        )
    model.to(device=device, dtype=dtypes[model_cfg["dtype"]])
    for _, param in forecast_heads(model):
        param.data = param.data.float()
    return model.eval(), base


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
# set-up pieces
# ----------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    output_dir: Path
    step: int
    model: object
    history: list = field(default_factory=list)  # eval dicts, each with its "step"
    losses: list = field(default_factory=list)  # (step, loss summed over layers)
    speed: dict = field(default_factory=dict)  # steps_per_s (optimizer steps only), feature_s, step_s
    guard: dict | None = None  # `guard_layers`' result (data.val_sequences > 0)


@dataclass
class Progress:
    """What a run has done so far, and what a checkpoint carries of it besides the tensors."""

    step: int = 0
    history: list = field(default_factory=list)  # eval dicts
    losses: list = field(default_factory=list)  # (step, loss)
    start_heads: dict | None = None  # the heads after calibration, before step 1: the guard's fallback
    guard: dict | None = None  # the guard's result, once it ran


def _tokenizer(data_cfg: dict, model, path: str | None):
    """The recipe's tokenizer: bytes (`ByteTokenizer`), data.tokenizer, or the model's own."""
    if data_cfg["tokenizer"] == "bytes":
        return ByteTokenizer(model.config.vocab_size)
    source = data_cfg["tokenizer"] or path
    if source is None:
        raise ConfigError("data.tokenizer is needed for a random model (use 'bytes' or a tokenizer path)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(source))
    tokenizer.model_max_length = int(1e12)  # we pack; silence the length warning
    return tokenizer


def _datasets(recipe: dict, tokenizer):
    """(training stream, held-out eval sequences [N, T] or None, validation windows or None)."""
    data_cfg, train = recipe["data"], recipe["train"]
    fields = {"text_field": data_cfg["text_field"], "token_field": data_cfg["token_field"]}
    data = build_sequences(
        data_cfg["source"],
        tokenizer,
        data_cfg["seq_len"],
        split=data_cfg["split"],
        max_documents=data_cfg["max_documents"],
        seed=data_cfg["shuffle_seed"],
        min_sequences=train["global_batch"],
        name="training data",
        pack=data_cfg["pack"],
        **fields,
    )
    eval_seqs = None
    if data_cfg["eval_source"] and data_cfg["eval_sequences"] > 0:
        held = build_sequences(
            data_cfg["eval_source"],
            tokenizer,
            eval_window(data_cfg)[0],
            split=data_cfg["eval_split"],
            shuffle=False,
            name="eval data",
            **fields,
        )
        eval_seqs = held.first(data_cfg["eval_sequences"])
    val_seqs = None
    if data_cfg["val_sequences"] > 0:
        val_seqs = unvisited_windows(data, visited_sequences(train), val_window(data_cfg)[0], data_cfg["val_sequences"])
    return data, eval_seqs, val_seqs


def _optimizer(params: list, train: dict):
    """AdamW with the recipe's settings and a linear warm-up (constant after)."""
    optimizer = torch.optim.AdamW(
        params, lr=train["lr"], betas=tuple(train["betas"]), eps=train["eps"], weight_decay=train["weight_decay"]
    )
    warmup = train["warmup_steps"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0
    )
    return optimizer, scheduler


def _resume(
    resume, model, optimizer, scheduler, data, fingerprint: str, base: str, allow_unchecked: bool = False
) -> Progress:
    """Load the checkpoint `resume` names (a file, or a run directory's newest intact one:
    `checkpointing.load_intact`) into the heads, optimizer, scheduler, data stream and RNGs;
    returns the run's progress at its step.  A checkpoint of another base model, or of other
    heads, is refused."""
    path, state = ckpt.load_intact(resume, allow_unchecked)
    if state["fingerprint"] != fingerprint:
        raise UserInputError(
            f"resume checkpoint {path} was written for base model {state['base_model']!r} "
            f"(fingerprint {state['fingerprint']}), but this run uses {base!r} (fingerprint {fingerprint})"
        )
    heads = dict(forecast_heads(model))
    if set(state["trainable"]) != set(heads):
        raise UserInputError(
            f"resume checkpoint {path} holds tensors {sorted(state['trainable'])[:3]}..., "
            f"this model trains {sorted(heads)[:3]}..."
        )
    with torch.no_grad():
        for name, tensor in state["trainable"].items():
            heads[name].copy_(tensor.to(heads[name].device))
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    data.load_state_dict(state["data"])  # the position at the start of the step's round
    ckpt.set_rng_state(state["rng"])
    return Progress(state["step"], state["history"], state["losses"], state["start_heads"], state["guard"])


def _recall_table(history: list) -> str:
    """Per-layer recall at the first and the last evaluation (one column when there was one)."""
    if not history:
        return ""
    evals = [history[0], history[-1]] if len(history) > 1 else [history[-1]]
    final = history[-1]
    table = sel.recall_table(
        {f"recall @ step {e['step']}": (e["recall"], e["mean_recall"]) for e in evals},
        final["chance"],
        final["mean_chance"],
    )
    setting = f"T = {final['length']}, rows t >= {final['start']}, {final['backbone']} backbone"
    oracle = final.get("reference") == "oracle"
    of = "the oracle's blocks (true attention mass)" if oracle else "the query selector's blocks"
    return table + f"\n{setting}, {final['rows']} rows per layer; recall of {of}.\n"


def _guard_note(guard: dict | None) -> str:
    if guard is None:
        return ""
    restored = ", ".join(str(i) for i in guard["restored"]) or "none"
    return (
        f"\nPer-layer guard on {guard['sequences']} unseen training window{'s' if guard['sequences'] != 1 else ''} "
        f"of {guard['length']} tokens "
        f"(rows t >= {guard['rows_from']}): layers given their starting head back: {restored}.\n"
    )


def recall_change(history: list) -> str | None:
    """One line comparing the first evaluation (step 0: the starting heads) with the last, or None
    when the run has no step-0 evaluation.  A fall says so first."""
    if len(history) < 2 or history[0]["step"] != 0:
        return None
    before, after = history[0]["mean_recall"], history[-1]["mean_recall"]
    change = f"{before:.4f} (step 0) -> {after:.4f} (step {history[-1]['step']})"
    if after < before:
        return (
            f"WARNING: mean forecast recall FELL {change}: the trained heads select worse than their start on the "
            f"held-out text; the starting heads, or fewer steps / a lower lr, may serve better"
        )
    return f"mean forecast recall rose {change}" if after > before else f"mean forecast recall unchanged: {change}"


def _speed(steps: int, step_seconds: float, feature_seconds: float) -> dict:
    """steps_per_s counts optimizer steps over the time spent in them (cached features excluded)."""
    return {"steps_per_s": steps / max(step_seconds, 1e-9), "feature_s": feature_seconds, "step_s": step_seconds}


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------


def train_forecast(
    config_path_or_dict, overwrite: bool = False, allow_unchecked: bool = False, **overrides
) -> TrainResult:
    """Train the Forecast heads with the recipe `config_path_or_dict` (a YAML path or a dict).

    overrides: `output_dir=`, `resume=` (a run directory or checkpoint file), `max_steps=`,
    `steps=`, or whole sections (`train={...}`, `data={...}`, ...).  Without `resume`, a directory
    holding an interrupted run resumes it, one holding a finished run is refused (`RunExists`),
    unless overwrite (`prepare_run_dir`).  SIGINT / SIGTERM (from the start of the call) save a
    checkpoint at the next safe point and raise `TrainingInterrupted`.  allow_unchecked: resume
    from a checkpoint without a checksum (an older format 1; refused otherwise).  Returns a
    `TrainResult`.
    """
    with Signals() as signals:
        return _train(config_path_or_dict, overwrite, overrides, signals, allow_unchecked)


def _train(
    config_path_or_dict, overwrite: bool, overrides: dict, signals: "Signals", allow_unchecked: bool = False
) -> TrainResult:
    """`train_forecast`'s body, under its signal handlers: set up, the loop, the guard, the outputs."""
    recipe = resolve_recipe(config_path_or_dict, **overrides)
    ckpt.check_storable(recipe, "recipe")  # fail now, not at the first checkpoint
    session = _Session(recipe, overwrite, signals, allow_unchecked)
    try:
        session.loop()
        session.guard_and_last_eval()
    except Stop:
        session.interrupted()  # raises TrainingInterrupted
    return session.finish()


class _Session:
    """One `train_forecast` run: what it set up (processes, run directory, model, data, optimizer,
    progress) and its parts as methods, in the order they run: `loop`, `guard_and_last_eval`,
    `finish` (or `interrupted` after a stop signal)."""

    def __init__(self, recipe: dict, overwrite: bool, signals: "Signals", allow_unchecked: bool = False) -> None:
        self.recipe, self.signals, self.allow_unchecked = recipe, signals, allow_unchecked
        self.train, self.data_cfg = recipe["train"], recipe["data"]
        self.objective = ObjectiveConfig.from_dict(recipe["objective"])
        # recall (evaluations and the guard) counts the blocks the teacher stands for
        self.recall_reference = "oracle" if self.objective.teacher == "attention" else "query"
        self._start_processes()
        self._prepare_directory(overwrite)
        self._build()
        self._resume_or_start()
        self._plan_rounds()

    # -- set-up ---------------------------------------------------------------------------------

    def _start_processes(self) -> None:
        """The `accelerate` state (one or many processes) and the recipe checked against it."""
        from accelerate import Accelerator

        cuda = torch.cuda.is_available()
        self.mixed = "bf16" if cuda and self.recipe["model"]["dtype"] != "float32" else "no"
        self.accelerator = accelerator = Accelerator(cpu=not cuda, mixed_precision=self.mixed)
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.main = accelerator.is_main_process
        check_recipe(self.recipe, self.world)
        self.out_dir = Path(self.recipe["output_dir"])

    def _prepare_directory(self, overwrite: bool) -> None:
        """Clean up after killed writes, decide fresh start or resume (`prepare_run_dir`), seed."""
        if self.main:
            for stale in ckpt.remove_stale_temporaries(self.out_dir):
                say(self.main, f"removed {stale}, left by a write a kill interrupted")
        if not self.recipe["resume"]:
            self.recipe["resume"] = prepare_run_dir(self.out_dir, overwrite, self.main, self.allow_unchecked)
        torch.manual_seed(self.train["seed"])
        random.seed(self.train["seed"])
        if self.train["threads"] is not None:
            torch.set_num_threads(self.train["threads"])

    def _build(self) -> None:
        """The frozen model with initialised heads, the data streams, the optimizer."""
        recipe, train = self.recipe, self.train
        self.model, self.base = build_model(recipe["model"], self.accelerator.device)
        check_against_model(recipe, self.model, self.objective)
        self.fresh_heads = not recipe["model"]["forecast_weights"]
        if self.fresh_heads:
            apply_forecast_init(self.model, recipe["model"]["forecast"]["init"], seed=train["seed"])
        self.params = freeze_base(self.model)
        self.fingerprint = ckpt.model_fingerprint(self.model)
        tokenizer = _tokenizer(self.data_cfg, self.model, recipe["model"]["path"])
        self.data, self.eval_seqs, self.val_seqs = _datasets(recipe, tokenizer)
        self.optimizer, self.scheduler = _optimizer(self.params, train)

    def _resume_or_start(self) -> None:
        """The run's progress (a resumed checkpoint's, or none), metrics.jsonl cut to it, recipe.json."""
        recipe = self.recipe
        self.metrics_path = self.out_dir / "metrics.jsonl"
        if recipe["resume"]:
            self.run = _resume(
                recipe["resume"],
                self.model,
                self.optimizer,
                self.scheduler,
                self.data,
                self.fingerprint,
                self.base,
                self.allow_unchecked,
            )
        else:
            self.run = Progress()
        if self.main:
            if recipe["resume"]:
                truncate_metrics(self.metrics_path, self.run.step)
            else:
                self.metrics_path.unlink(missing_ok=True)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            recipe_text = json.dumps({**recipe, "processes": self.world}, indent=2, default=str)
            write_text_atomic(self.out_dir / "recipe.json", recipe_text)
        self.saved_step = self.run.step if recipe["resume"] else None  # the step of the newest checkpoint
        self.saved_path = None  # the checkpoint this call wrote last

    def _plan_rounds(self) -> None:
        """This process's share of a global batch, the feature cache, the counters."""
        train, model = self.train, self.model
        self.end, self.per_round, self.micro = last_step(train), train["steps_per_round"], train["micro_batch"]
        self.per_rank = train["global_batch"] // self.world
        self.first_chunk = self.rank * self.per_rank // self.micro  # global index of this process's first micro-batch
        rows = train["global_batch"] * model.config.num_key_value_heads * rows_per_sequence(self.recipe)
        self.denominator = float(rows)
        self.round_start = self.data.state_dict()  # the data position the current round was taken at
        self.show = self.main and train["progress"]
        identity = feature_identity(self.recipe, model, self.fingerprint, self.accelerator.device, self.mixed)
        self.cache = RoundCache(self.out_dir / FEATURE_DIR, identity)
        self.layers = model.config.num_hidden_layers
        self.bar = None  # the steps' bar, opened after the first round's features
        self.building = False  # inside a round's feature build (a stop there saves the round's start)
        self.feature_seconds, self.step_seconds, self.steps_run = 0.0, 0.0, 0

    # -- safe points ----------------------------------------------------------------------------

    def stop_requested(self) -> bool:
        """Whether a stop signal arrived, agreed by every process (a safe point for all)."""
        flag = torch.tensor([1.0 if self.signals.received is not None else 0.0])
        if self.world > 1:
            flag = self.accelerator.reduce(flag.to(self.accelerator.device), reduction="sum").cpu()
        return bool(flag.item() > 0)

    def check_local(self) -> None:
        """A safe point inside work no other process waits on (one process only)."""
        if self.world == 1 and self.signals.received is not None:
            raise Stop

    # -- the loop -------------------------------------------------------------------------------

    def loop(self) -> None:
        """The training loop: every `steps_per_round` steps a new round's features, each step one
        AdamW step on them; metrics, evaluations and checkpoints on their schedules, a stop signal
        honoured after every step."""
        run, train = self.run, self.train
        if run.step == 0 and train["eval_every"] >= 0 and train["eval_at_start"]:
            self.run_eval(0)
        features = None
        for step in range(run.step, self.end):  # `step` optimizer steps are done; this one makes step + 1
            if features is None or step % self.per_round == 0:
                features = None  # free the previous round first
                features = self.take_round(step)
            if self.bar is None:  # after the first round's features: its rate (and ETA) counts steps only
                self.bar = progress_bar("forecast" if self.show else None, train["steps"], initial=run.step)
            started = time.time()
            self.optimizer.zero_grad(set_to_none=True)
            loss = backward_step(
                self.model,
                self.params,
                features,
                self.first_chunk,
                step,
                self.recipe,
                self.objective,
                self.denominator,
                self.accelerator,
            )
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, train["grad_clip"]))
            lr = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            self.step_seconds += time.time() - started
            self.steps_run += 1
            run.step = done = step + 1
            run.losses.append((done, loss))
            if self.main and (done % train["log_every"] == 0 or done == self.end):
                row = {"step": done, "loss": loss, "grad_norm": grad_norm, "lr": lr, **self.speed()}
                append_metrics(self.metrics_path, row)
            if train["eval_every"] > 0 and done % train["eval_every"] == 0 and done < self.end:
                self.run_eval(done)
            recall = {"recall": f"{run.history[-1]['mean_recall']:.3f}"} if run.history else {}
            self.bar.set_postfix({"loss": f"{loss:.4f}", **recall})
            self.bar.update(1)
            if done % train["save_every"] == 0 and done < self.end:
                self.save(done)
            if self.stop_requested():
                raise Stop
        if self.bar is not None:
            self.bar.close()

    def take_round(self, step: int) -> Features:
        """The round starting at `step`: its data position kept, its features built (timed); a stop
        signal that arrived meanwhile stops here."""
        self.round_start = self.data.state_dict()
        started, self.building = time.time(), True
        features = self.next_round(step)
        self.feature_seconds += time.time() - started
        if self.stop_requested():
            raise Stop  # the data stream already moved past this round: save its start
        self.building = False
        return features

    def next_round(self, step: int) -> Features:
        """Cache the next global batch's features (this process's slice); the first round also
        calibrates fresh heads and keeps the starting heads for the guard."""
        batch = self.data.take(self.train["global_batch"])[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]
        count = -(-batch.shape[0] // self.micro)
        round_index = step // self.per_round
        label = f"features, round {round_index} ({batch.shape[0]} sequences x {self.layers} layers)"
        bar = progress_bar(label if self.show else None, count * self.layers, unit="layer", leave=False)

        def on_layer_done(n: int) -> None:
            bar.update(n)
            self.check_local()

        cache = self.cache
        before = (cache.built, cache.loaded, cache.saved_s, cache.load_s)
        started = time.perf_counter()
        try:
            with self.accelerator.autocast():
                parts = build_round(
                    self.model,
                    batch,
                    self.first_chunk,
                    round_index,
                    self.recipe,
                    self.objective,
                    self.accelerator.device,
                    cache,
                    on_layer_done,
                )
        finally:
            bar.close()
        built, loaded = cache.built - before[0], cache.loaded - before[1]
        note = f"built {built} in {time.perf_counter() - started:.1f} s" if built else ""
        if loaded:
            saved, took = cache.saved_s - before[2], cache.load_s - before[3]
            note += ("; " if note else "") + (
                f"read {loaded} from the run's cache in {took:.1f} s (building them took {saved:.1f} s)"
            )
        plural = "es" if count != 1 else ""
        say(
            self.show or (self.main and loaded > 0),
            f"features, round {round_index}: {count} micro-batch{plural} of this process: {note}",
        )
        if step == 0 and self.fresh_heads and self.recipe["model"]["calibrate_init"]:
            calibrate_from_features(self.model, parts, self.accelerator)
        if step == 0 and self.val_seqs is not None:
            self.run.start_heads = _head_copy(self.model)
        return Features.merge(parts)

    def run_eval(self, step: int) -> None:
        """Held-out recall at `step` (when the recipe has eval data), kept in the history and logged."""
        if self.eval_seqs is None:
            return
        label = f"recall at step {step} ({self.eval_seqs.shape[0]} held-out sequences)" if self.show else None
        recall = evaluate(
            self.model,
            self.eval_seqs,
            eval_window(self.data_cfg)[1],
            self.data_cfg["eval_backbone"],
            self.accelerator,
            label,
            self.check_local,
            self.recall_reference,
        )
        result = {"step": step, **recall, "reference": self.recall_reference}
        self.run.history.append(result)
        if self.main:
            append_metrics(self.metrics_path, {"step": step, "eval": result})

    def save(self, step: int, position: dict | None = None) -> None:
        """A checkpoint at `step` (main process); position: the data position it resumes from."""
        if self.main:
            # mid-round: the round's start, so a resume rebuilds (or reads) the same cached features
            if position is None:
                position = self.round_start if step % self.per_round else self.data.state_dict()
            run, model = self.run, self.model
            state = {
                "step": step,
                "trainable": _head_copy(model),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": ckpt.rng_state(),
                "data": position,
                "recipe": self.recipe,
                "fingerprint": self.fingerprint,
                "base_model": self.base,
                "sparse_config": model.config.sparse.to_dict(),
                "forecast": model.config.forecast_config.to_dict(),
                "history": run.history,
                "losses": run.losses,
                "start_heads": run.start_heads,
                "guard": run.guard,
            }
            try:
                self.saved_path = ckpt.save_checkpoint(self.out_dir, step, state, self.train["keep_last"])
            except DiskFullError as full:  # still one line: where the run resumes from
                last = f"step {self.saved_step}'s" if self.saved_step else "none yet"
                full.message += (
                    f"; training stopped at step {step}, its last intact checkpoint: {last} "
                    f"(--resume {self.out_dir} continues once there is room)"
                )
                raise
        self.saved_step = step
        self.accelerator.wait_for_everyone()

    def speed(self) -> dict:
        return _speed(self.steps_run, self.step_seconds, self.feature_seconds)

    # -- the end --------------------------------------------------------------------------------

    def guard_and_last_eval(self) -> None:
        """The per-layer guard (a finished run with validation windows), then the last evaluation."""
        run, train, data_cfg = self.run, self.train, self.data_cfg
        if self.val_seqs is not None and run.guard is None and run.step >= train["steps"]:  # not when max_steps cut it
            if run.start_heads is None:
                raise UserInputError(
                    "data.val_sequences > 0, but the resumed checkpoint holds no starting heads to guard with"
                )
            run.guard = guard_layers(
                self.model,
                run.start_heads,
                self.val_seqs,
                val_window(data_cfg)[1],
                data_cfg["eval_backbone"],
                self.accelerator,
                self.show,
                self.check_local,
                self.recall_reference,
            )
            if self.main:
                append_metrics(self.metrics_path, {"step": run.step, "guard": run.guard})
            if run.history and run.history[-1]["step"] == run.step:
                run.history.pop()  # measured before the guard gave layers their starting heads back
        if train["eval_every"] >= 0 and (not run.history or run.history[-1]["step"] != run.step):
            self.run_eval(run.step)

    def interrupted(self) -> None:
        """After a stop signal: a checkpoint at the last step done (unless one is there); raises
        `TrainingInterrupted`."""
        if self.bar is not None:
            self.bar.close()
        step = self.run.step
        if step > 0 and self.saved_step != step:
            say(self.main, f"{signal.Signals(self.signals.received).name}: writing a checkpoint at step {step}")
            self.save(step, self.round_start if self.building else None)
        path = self.saved_path or (ckpt.find_checkpoint(self.out_dir) if step > 0 else None)
        raise TrainingInterrupted(self.signals.received, step, path, self.out_dir) from None

    def finish(self) -> TrainResult:
        """The last checkpoint, forecast.safetensors (+ config) and recall.md; the run's result."""
        run, out_dir, cache = self.run, self.out_dir, self.cache
        say(self.show, f"writing the last checkpoint and {out_dir / 'forecast.safetensors'}")
        self.save(run.step)
        if self.main:
            self.model.save_forecast_weights(out_dir, base_model=self.base)
            write_text_atomic(out_dir / "recall.md", _recall_table(run.history) + _guard_note(run.guard))
            if run.step >= self.train["steps"]:  # finished: nothing resumes into its rounds again
                shutil.rmtree(out_dir / FEATURE_DIR, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        speed = {
            **self.speed(),
            "features_built": cache.built,
            "features_read": cache.loaded,
            "feature_read_s": cache.load_s,
            "feature_saved_s": cache.saved_s,
        }
        return TrainResult(out_dir, run.step, self.model, run.history, run.losses, speed, run.guard)
