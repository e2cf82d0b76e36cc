"""`forecastkv eval`: every example of a suite under every mode, streamed, resumable, sharded.

Order of work: examples in the suite's canonical order (`config.work_units`), all modes of one
example back to back on the same input ids.  Process r of W takes examples r, r + W, ...
(`torch.distributed` / `accelerate launch` / `torch.distributed.run` set RANK and WORLD_SIZE), writes
its own shard, and process 0 merges the shards into `results.jsonl` and writes the report.
Everything the suite asks for is checked before the first example runs (unknown task or mode,
a length beyond the model's context, a LongBench directory without the files, a forecast mode on a
model without heads), and results already on disk are never rewritten except by the merge.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import timedelta
from pathlib import Path

import torch

from ..bundled import resolve_heads_path, resolve_model_path
from ..errors import ConfigError
from . import longbench
from .codec import ByteCodec, TextCodec
from .config import Unit, load_config, max_new_tokens, work_units
from .evaluate import evaluate_example
from .modes import attending_with, check_model_supports, parse_mode
from .results import ShardWriter, merge, read_records, record_id
from .tasks import generate_example

# ----------------------------------------------------------------------------------------------
# processes
# ----------------------------------------------------------------------------------------------


def process_group() -> tuple[int, int]:
    """(rank, world size); joins the process group that the launcher's environment describes."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(hours=24))
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# model, tokenizer, validation
# ----------------------------------------------------------------------------------------------


def load_model(spec: dict, device: torch.device):
    """The model of the suite's `model:` section, in eval mode on `device`."""
    from ..modeling import ForecastKVConfig, ForecastKVForCausalLM

    dtype = getattr(torch, spec["dtype"]) if isinstance(spec["dtype"], str) else spec["dtype"]
    if spec["config"] is not None:  # a random model (tests)
        torch.manual_seed(spec["seed"])
        forecast = None if spec["forecast"] is None else {**spec["forecast"], "enabled": True}
        model = ForecastKVForCausalLM(
            ForecastKVConfig(**spec["config"], sparse_config=spec["sparse_config"], forecast=forecast)
        )
    else:
        model = ForecastKVForCausalLM.from_pretrained(
            resolve_model_path(spec["path"]),
            sparse_config=spec["sparse_config"],
            forecast=spec["forecast"],
            forecast_weights=spec["forecast_weights"],
        )
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device).eval()


def load_codec(config: dict, model):
    name = config["tokenizer"]
    if name == "bytes":
        return ByteCodec(model.config.vocab_size, model.config.eos_token_id)
    path = name or config["model"]["path"]
    if path is None:
        raise ConfigError("a random model (model.config) needs tokenizer: bytes or a tokenizer path")
    from transformers import AutoTokenizer

    return TextCodec(AutoTokenizer.from_pretrained(resolve_model_path(path)))


def validate_against_model(config: dict, model) -> dict:
    """Model-dependent checks; returns the LongBench rows per task."""
    for name in config["modes"]:
        check_model_supports(model, parse_mode(name))
    limit = model.config.max_position_embeddings
    lengths = [(t["name"], n) for t in config["tasks"] for n in t["lengths"]]
    bench = config["longbench"]
    if bench is not None:
        lengths += [(f"longbench:{name}", n) for name in bench["tasks"] for n in bench["lengths"]]
    for task, length in lengths:
        if length > limit:
            raise ConfigError(
                f"task {task!r}: length {length} exceeds the model's context (max_position_embeddings={limit})"
            )
    rows = {}
    if bench is not None:
        if bench.get("dir") is not None:
            longbench.check_directory(bench["dir"], bench["tasks"], bool(bench.get("e")))
        rows = {name: longbench.load_rows(name, bench.get("dir"), bool(bench.get("e"))) for name in bench["tasks"]}
    return rows


def build_example(config: dict, unit: Unit, codec, rows: dict):
    new = max_new_tokens(config, unit)
    if unit.spec >= 0:
        options = config["tasks"][unit.spec].get("options") or {}
        return generate_example(unit.task, codec, unit.length, unit.index, config["seed"], unit.depth, new, **options)
    name = unit.task.split(":", 1)[1]
    return longbench.build_example(name, rows[name][unit.index], unit.index, codec, unit.length, new)


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------


def heads_digest(spec: dict) -> str | None:
    """sha1 (16 hex digits) of the trained heads file a suite's `model.forecast_weights` names
    (a directory holding forecast.safetensors, or the file), None without one."""
    from ..modeling.checkpoint_dir import FORECAST_WEIGHTS

    if spec.get("forecast_weights") is None:
        return None
    path = Path(resolve_heads_path(spec["forecast_weights"]))
    path = path / FORECAST_WEIGHTS if path.is_dir() else path
    if not path.is_file():
        return None
    digest = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def provenance(config: dict, model) -> dict:
    """What produced a run's records, stored in each record (`run`) and shown in report.md: the
    model (checkpoint path, or a random test model), the heads (the trained file and its digest,
    the init they were created with at load, or the checkpoint's own) and the sparse config in
    effect."""
    spec = config["model"]
    forecast = model.config.forecast_config
    if spec.get("forecast_weights") is not None:
        heads = {
            "source": "trained",
            "path": str(spec["forecast_weights"]),
            "sha1": config.get("heads_sha1"),
            "heads_per_group": forecast.heads_per_group,
        }
    elif not forecast.enabled:
        heads = None
    elif spec.get("forecast") is not None or spec.get("config") is not None:
        heads = {"source": "init", "init": forecast.init, "heads_per_group": forecast.heads_per_group}
    else:
        heads = {"source": "checkpoint", "heads_per_group": forecast.heads_per_group}
    return {
        "model": spec["path"] if spec.get("config") is None else "random test model (model.config)",
        "heads": heads,
        "sparse_config": model.config.sparse_config,
    }


def fingerprint(config: dict, unit: Unit) -> str:
    """A short hash of every setting that shapes `unit`'s records (not output_dir or progress),
    the trained heads' file contents included."""
    entry = config["tasks"][unit.spec] if unit.spec >= 0 else config["longbench"]
    shaping = {k: config[k] for k in ("model", "tokenizer", "seed", "prefill_chunk", "recall_start", "bucket_tokens")}
    if config.get("heads_sha1"):
        shaping["heads_sha1"] = config["heads_sha1"]
    text = json.dumps({**shaping, "entry": entry, "depth": unit.depth}, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def canonical_order(config: dict, units: list[Unit]) -> dict[tuple, int]:
    modes = config["modes"]
    return {
        (u.key, m, fingerprint(config, u)): i * len(modes) + j for i, u in enumerate(units) for j, m in enumerate(modes)
    }


def run_eval(
    source, limit: int | None = None, output_dir: str | None = None, progress: bool | None = None, after_record=None
) -> dict:
    """Run a suite (YAML path or dict).  Returns {"results": path, "report": path or None,
    "evaluated": records this call evaluated on this process}.

    after_record(record) is called after each record is on disk (tests use it to interrupt a run).
    """
    config = load_config(source, {"output_dir": output_dir, "progress": progress})
    config["heads_sha1"] = heads_digest(config["model"])
    rank, world = process_group()
    model = load_model(config["model"], _device())
    run = provenance(config, model)
    codec = load_codec(config, model)
    rows = validate_against_model(config, model)
    units = work_units(config, limit, rows)
    order = canonical_order(config, units)
    out = Path(config["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    done = {record_id(r) for r in read_records(out)}
    writer = ShardWriter(out, rank)
    pending = _pending(config, units, done, codec, rows, out, rank, world)
    evaluated = _evaluate(config, model, codec, rows, pending, run, writer, after_record, rank, world)
    _barrier(world)
    report = None
    if rank == 0:
        results = merge(out, order)
        from .report import write_report

        report = write_report(out)
    else:
        results = out / "results.jsonl"
    _barrier(world)
    return {"results": str(results), "report": None if report is None else str(report), "evaluated": evaluated}


def _pending(config: dict, units: list[Unit], done: set, codec, rows, out: Path, rank: int, world: int) -> list:
    """This process's (unit, [modes without a record in `done`]); every such example is built once
    first, so a task that cannot fit its length fails before any run.  While records are missing,
    report.md carries a stale banner."""
    mine = units[rank::world]
    pending = [(u, [m for m in config["modes"] if (u.key, m, fingerprint(config, u)) not in done]) for u in mine]
    pending = [(u, modes) for u, modes in pending if modes]
    for unit, _ in pending:  # then dropped: 128K prompts add up
        build_example(config, unit, codec, rows)
    missing = sum((u.key, m, fingerprint(config, u)) not in done for u in units for m in config["modes"])
    if missing and rank == 0:  # the report on disk no longer describes this suite until the merge
        from .report import mark_stale

        mark_stale(out, missing, len(units) * len(config["modes"]))
    return pending


def _evaluate(
    config: dict, model, codec, rows, pending: list, run: dict, writer: ShardWriter, after_record, rank: int, world: int
) -> int:
    """Evaluate every pending (unit, mode) under its mode, with a progress bar; each record is on
    disk (`writer`) before `after_record(record)` and the next run.  Returns how many ran."""
    from tqdm.auto import tqdm

    bar = tqdm(
        total=sum(len(m) for _, m in pending),
        desc=f"eval[{rank}/{world}]",
        disable=not config["progress"] or rank != 0,
        unit="run",
    )
    evaluated = 0
    for unit, modes in pending:
        example = build_example(config, unit, codec, rows)
        for name in modes:
            mode = parse_mode(name)
            bar.set_postfix_str(f"{unit.key} {name}")
            with attending_with(model, mode):
                result = evaluate_example(
                    model,
                    example,
                    mode,
                    codec,
                    config["prefill_chunk"],
                    config["recall_start"],
                    config["bucket_tokens"],
                    config["recall"],
                )
            record = {
                "key": unit.key,
                "task": unit.task,
                "length": unit.length,
                "index": unit.index,
                "mode": name,
                "attention": mode.attention,
                "cache": mode.cache,
                "metric": example.metric,
                "references": example.references,
                "depth": example.meta.get("depth"),
                "seed": config["seed"],
                "fingerprint": fingerprint(config, unit),
                "run": run,
                **result,
            }
            writer.append(record)
            evaluated += 1
            bar.update(1)
            if after_record is not None:
                after_record(record)
    bar.close()
    return evaluated
