"""Fine-tune the Forecast heads of a frozen sparse base model (SparDA §3, shared/DESIGN.md "Training").

Read top to bottom:

1. the recipe (YAML or dict, `DEFAULTS` below) and the `accelerate` state (one or many processes);
2. the model: the frozen base (its own sparse config, or the recipe's), Forecast heads created and
   initialised (`apply_forecast_init`); only `forecast_proj` of layers 0..L-2 and `current_proj`
   train, everything else has requires_grad False;
3. data: packed token sequences (`data.py`), the same deterministic stream on every process, each
   process taking its slice of the global batch;
4. per micro-batch `forward_backward`: a hand-written layer loop.  The backbone runs under no_grad
   and routes with its own query selection; each layer's loss is back-propagated at once
   (`loss_l.backward()`), the hidden state is detached between layers and only the forecast tensor
   of layer l-1 crosses into layer l's loss, so activation memory stays about one layer deep;
5. after the global batch: gradients summed over processes (a manual all-reduce, as SparDA does
   instead of DDP, which does not fit per-layer backward), clipped, AdamW step;
6. held-out forecast recall per layer (`evaluate`), checkpoints (`checkpointing.py`), and at the end
   `forecast.safetensors` + `forecast_config.json` in the output directory.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forecastkv.modeling import selection as sel
from forecastkv.modeling.cache import SparseCacheLayer
from forecastkv.modeling.forecast_init import apply_forecast_init
from forecastkv.modeling.rope import apply_rope

from . import checkpointing as ckpt
from .data import ByteTokenizer, build_sequences
from .objective import ObjectiveConfig, layer_loss

DEFAULTS: dict = {
    "model": {
        "path": None,                 # checkpoint dir / hub id / "bundled:<name>"; or `config` below
        "config": None,               # ForecastKVConfig kwargs for a random model (tests)
        "seed": 0,                    # weights of a random `config` model
        "sparse_config": None,        # preset name or dict; None keeps the checkpoint's own
        "forecast": {"heads_per_group": 1, "init": "kaiming"},
        "forecast_weights": None,     # start from trained heads (a forecast.safetensors directory)
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
        "eval_source": "bundled",
        "eval_split": "heldout",
        "eval_sequences": 4,
        "eval_seq_len": None,         # None: seq_len.  Recall needs lengths well past the budget
    },
    "objective": ObjectiveConfig().to_dict(),
    "train": {
        "steps": 2000,
        "max_steps": None,            # stop (with a checkpoint) once this step is reached
        "global_batch": 32,
        "micro_batch": 1,
        "lr": 5e-4,
        "warmup_steps": 0,
        "betas": [0.9, 0.95],
        "eps": 1e-6,
        "weight_decay": 0.01,
        "grad_clip": 0.5,
        "seed": 0,
        "log_every": 1,
        "eval_every": 100,            # 0: only before and after; -1: never
        "eval_loss": True,            # also the held-out loss per layer (costs a teacher pass)
        "save_every": 50,
        "keep_last": 5,
        "progress": True,
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
# the layer loop
# ----------------------------------------------------------------------------------------------


def _embed(model, ids: torch.Tensor):
    """hidden [B, T, hidden], positions [B, T], cos/sin [B, T, d], the residual scale (muP)."""
    inner = model.model
    config = model.config
    length = ids.shape[1]
    if length > config.max_position_embeddings:
        raise ValueError(f"sequence length {length} exceeds max_position_embeddings={config.max_position_embeddings}")
    hidden = inner.embed_tokens(ids)
    positions = torch.arange(length, device=ids.device).expand(ids.shape[0], -1)
    cos, sin = inner.rotary_emb(positions, hidden.dtype)
    scale = 1.0
    mup = config.mup_config
    if mup is not None:
        hidden = hidden * mup.scale_emb
        scale = mup.scale_depth / math.sqrt(config.num_hidden_layers)
    return hidden, positions, cos, sin, scale


def _cache_layer(sparse) -> SparseCacheLayer:
    coarse = sparse.coarse_kernel if sparse.lse == "coarse" else None
    return SparseCacheLayer(sparse.kernel_size, sparse.kernel_stride, coarse=coarse)


def _queries(attn, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The layer's post-RoPE queries [B, T, Hq, d] (the teacher's input)."""
    batch, length, _ = normed.shape
    return apply_rope(attn.q_proj(normed).view(batch, length, attn.num_heads, attn.head_dim), cos, sin)


def _residual(layer, hidden: torch.Tensor, attn_out: torch.Tensor, scale: float) -> torch.Tensor:
    hidden = hidden + attn_out * scale
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden)) * scale


def forward_backward(model, ids: torch.Tensor, objective: ObjectiveConfig, loss_scale: float = 1.0) -> list[float]:
    """One micro-batch ids [B, T]: per layer, the frozen backbone (query routing) and the Forecast
    loss, back-propagated right away (times `loss_scale`).  Returns the per-layer losses."""
    sparse = model.config.sparse
    layers = model.model.layers
    last = len(layers) - 1
    with torch.no_grad():
        hidden, positions, cos, sin, scale = _embed(model, ids)
    forecast_in, losses = None, []
    for idx, layer in enumerate(layers):
        attn = layer.self_attn
        cache_layer = _cache_layer(sparse)
        with torch.no_grad():
            normed = layer.input_layernorm(hidden)
        if idx == 0:
            forecast_in = attn.project_forecast(normed, cos, sin, "current_proj")
        forecast_next = attn.project_forecast(normed, cos, sin) if idx < last else None
        with torch.no_grad():
            attn_out = attn(normed, positions, cos, sin, cache_layer, selector="query")
            queries = _queries(attn, normed, cos, sin)
        keys = cache_layer.full()[0]
        loss = layer_loss(queries, keys, cache_layer.compressed_keys(), forecast_in, positions, sparse, objective)
        (loss * loss_scale).backward()
        losses.append(float(loss.detach()))
        with torch.no_grad():
            hidden = _residual(layer, hidden, attn_out, scale)
        forecast_in = forecast_next
        del cache_layer, queries, keys, attn_out, loss
    return losses


@torch.no_grad()
def recall_counts(model, ids: torch.Tensor, objective: ObjectiveConfig | None) -> torch.Tensor:
    """Per layer [L, 4]: forecast-recall hits, wanted, chance (sums over batch, heads, positions;
    `selection.forecast_recall_counts` with the runtime's semantics) and the summed layer loss
    (0 when `objective` is None)."""
    sparse = model.config.sparse
    layers = model.model.layers
    last = len(layers) - 1
    hidden, positions, cos, sin, scale = _embed(model, ids)
    counts = torch.zeros(len(layers), 4, dtype=torch.float64)
    forecast_in = None
    for idx, layer in enumerate(layers):
        attn = layer.self_attn
        cache_layer = _cache_layer(sparse)
        normed = layer.input_layernorm(hidden)
        if idx == 0:
            forecast_in = attn.project_forecast(normed, cos, sin, "current_proj")
        forecast_next = attn.project_forecast(normed, cos, sin) if idx < last else None
        record: dict = {}
        attn_out = attn(normed, positions, cos, sin, cache_layer, forecast_in=forecast_in, selections_out=record, selector="query")
        hits, wanted, chance = sel.forecast_recall_counts(record["query"], record["forecast"], positions, sparse)
        loss = 0.0
        if objective is not None:
            loss = layer_loss(_queries(attn, normed, cos, sin), cache_layer.full()[0], cache_layer.compressed_keys(), forecast_in, positions, sparse, objective).item()
        counts[idx] = torch.tensor([hits.sum().item(), wanted.sum().item(), chance.sum().item(), loss * ids.shape[0]], dtype=torch.float64)
        hidden = _residual(layer, hidden, attn_out, scale)
        forecast_in = forecast_next
    return counts


def summarise_counts(counts: torch.Tensor, sequences: int) -> dict:
    """[L, 4] summed counts -> per-layer recall / chance / loss and the means over layers >= 1."""
    wanted = counts[:, 1].clamp(min=1)
    recall = (counts[:, 0] / wanted).tolist()
    chance = (counts[:, 2] / wanted).tolist()
    loss = (counts[:, 3] / max(sequences, 1)).tolist()
    tail = slice(1, None) if len(recall) > 1 else slice(None)
    mean = lambda values: sum(values[tail]) / len(values[tail])  # noqa: E731
    return {
        "recall": recall, "chance": chance, "loss": loss,
        "mean_recall": mean(recall), "mean_chance": mean(chance), "loss_sum": sum(loss),
    }


def evaluate(model, sequences: torch.Tensor, objective: ObjectiveConfig | None, accelerator, micro_batch: int = 1) -> dict:
    """Held-out forecast recall per layer (and loss unless `objective` is None); the sequences are
    split over processes, counts summed."""
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = sequences[rank::world]
    counts = torch.zeros(model.config.num_hidden_layers, 4, dtype=torch.float64)
    with accelerator.autocast():
        for start in range(0, mine.shape[0], micro_batch):
            counts += recall_counts(model, mine[start : start + micro_batch].to(accelerator.device), objective)
    if world > 1:
        counts = accelerator.reduce(counts.to(accelerator.device), reduction="sum").cpu()
    return summarise_counts(counts, sequences.shape[0])


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
    for key in ("seq_len", "eval_seq_len"):
        length = recipe["data"][key]
        if length is None:
            continue
        if length > config.max_position_embeddings:
            raise ValueError(f"data.{key}={length} exceeds the model's max_position_embeddings={config.max_position_embeddings}")
        if length < sparse.kernel_size:
            raise ValueError(f"data.{key}={length} is shorter than sparse_config.kernel_size={sparse.kernel_size}: no compressed key to select")
    train = recipe["train"]
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
    if not history:
        return ""
    first, final = history[0], history[-1]
    lines = [f"| layer | recall @ step {first['step']} | recall @ step {final['step']} | chance |", "|---|---|---|---|"]
    for i, (a, b, c) in enumerate(zip(first["recall"], final["recall"], final["chance"])):
        lines.append(f"| {i} | {a:.3f} | {b:.3f} | {c:.3f} |")
    lines.append(f"| mean (>= 1) | {first['mean_recall']:.3f} | {final['mean_recall']:.3f} | {final['mean_chance']:.3f} |")
    return "\n".join(lines) + "\n"


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

    # -- model ---------------------------------------------------------------------------------
    model, base = build_model(recipe["model"], accelerator.device)
    objective.check_against(model.config.sparse)
    _check_lengths(recipe, model, world)
    if not recipe["model"]["forecast_weights"]:
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

    # -- optimizer -----------------------------------------------------------------------------
    optimizer = torch.optim.AdamW(params, lr=train["lr"], betas=tuple(train["betas"]), eps=train["eps"], weight_decay=train["weight_decay"])
    warmup = train["warmup_steps"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0)

    # -- resume --------------------------------------------------------------------------------
    out_dir = Path(recipe["output_dir"])
    metrics_path = out_dir / "metrics.jsonl"
    step, history, losses = 0, [], []
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
        data.load_state_dict(state["data"])
        ckpt.set_rng_state(state["rng"])
        step, history, losses = state["step"], state["history"], state["losses"]
        if main:
            _truncate_metrics(metrics_path, step)
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "recipe.json").write_text(json.dumps({**recipe, "processes": world}, indent=2, default=str))

    def save(step: int) -> None:
        if main:
            state = {
                "step": step, "trainable": {n: p.detach().cpu().clone() for n, p in forecast_heads(model)},
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": ckpt.rng_state(),
                "data": data.state_dict(), "recipe": recipe, "fingerprint": fingerprint, "base_model": base,
                "sparse_config": model.config.sparse_config, "forecast": model.config.forecast,
                "history": history, "losses": losses,
            }
            ckpt.save_checkpoint(out_dir, step, state, train["keep_last"])
        accelerator.wait_for_everyone()

    def run_eval(step: int) -> None:
        if eval_seqs is None:
            return
        result = {"step": step, **evaluate(model, eval_seqs, objective if train["eval_loss"] else None, accelerator, train["micro_batch"])}
        history.append(result)
        if main:
            _append_metrics(metrics_path, {"step": step, "eval": result})

    # -- loop ----------------------------------------------------------------------------------
    end = train["steps"] if train["max_steps"] is None else min(train["steps"], train["max_steps"])
    per_rank = train["global_batch"] // world
    micro = train["micro_batch"]
    from tqdm.auto import tqdm

    bar = tqdm(total=train["steps"], initial=step, disable=not (main and train["progress"]), desc="forecast", dynamic_ncols=True)
    evals = train["eval_every"] >= 0  # -1: no evaluation at all; 0: before and after only
    if step == 0 and evals:
        run_eval(0)
    started = time.time()
    while step < end:
        optimizer.zero_grad(set_to_none=True)
        batch = data.take(train["global_batch"])[rank * per_rank : (rank + 1) * per_rank]
        step_loss = torch.zeros(1, dtype=torch.float64)
        with accelerator.autocast():
            for start in range(0, per_rank, micro):
                ids = batch[start : start + micro].to(accelerator.device)
                layer_losses = forward_backward(model, ids, objective, loss_scale=ids.shape[0] / train["global_batch"])
                step_loss += sum(layer_losses) * ids.shape[0] / train["global_batch"]
        if world > 1:
            sum_over_processes(params, accelerator)
            step_loss = accelerator.reduce(step_loss.to(accelerator.device), reduction="sum").cpu()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, train["grad_clip"]))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        step += 1
        loss_value = float(step_loss)
        losses.append((step, loss_value))
        if main and (step % train["log_every"] == 0 or step == end):
            _append_metrics(metrics_path, {"step": step, "loss": loss_value, "grad_norm": grad_norm, "lr": lr, "elapsed_s": time.time() - started})
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
    if evals and (not history or history[-1]["step"] != step):
        run_eval(step)
    save(step)
    if main:
        model.save_forecast_weights(out_dir, base_model=base)
        (out_dir / "recall.md").write_text(_recall_table(history))
    accelerator.wait_for_everyone()
    return TrainResult(output_dir=out_dir, step=step, model=model, history=history, losses=losses)
