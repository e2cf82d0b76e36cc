"""The main job on the bundled default (`forecastkv demo`, `make demo`), in five steps that call the
same code as the package's commands:

1. fit Forecast heads on the training essays      (`forecastkv train-forecast`: `train_forecast`);
   the trainer measures held-out forecast recall before and after (`training.recall.forecast_recall`),
   and the heads shipped with the package (`bundled_heads_path`) are measured on the same sequences;
2. held-out perplexity per selector at each length (`forecastkv eval`: `run_eval`);
3. curves over context length (2K / 4K / 8K): per length one prefill of the held-out essays, copied
   into the cache of each mode (`inference.fill.copy_into`), then a short greedy decode: device KV
   bytes, H2D bytes per decode step and the slot cache's block hit rate per mode.  The
   forecast-offload run at 8K goes on: the offloaded generation (`forecastkv generate --offload`);
4. one document, many questions: a held-out essay prefilled once into a `ContextStore`, four
   questions answered from its stored prefix, time to first token of a hit against the miss;
5. `<output>/report.md` with its plots (`curves.png` is the picture of the README) and the GPU
   numbers when `benchmarks/results/` holds a GPU run of `gpu_check.py`; a summary printed last.

The recipe, the eval suite and the curves are package data (`forecastkv/presets/demo/`); the
`*_overrides` shrink them for the test.  Everything is written under `output` and a rerun resumes:
finished training, finished eval examples and finished curve lengths are kept.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from .atomic import write_text_atomic
from .merge import deep_merge

DEMO_DIR = Path(__file__).parent / "presets" / "demo"
GPU_RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
GPU_COMMAND = "python3 benchmarks/gpu_check.py --out benchmarks/results/gpu_check"
MIB = 2**20


def generate_with_cache(model, ids: torch.Tensor, max_new_tokens: int):
    """Greedy continuation through an explicit SparseCache.  ids [1, T] -> (new ids [N], cache, seconds)."""
    from .modeling.cache import SparseCache
    from .modeling.modeling import CACHE_KWARG

    cache = SparseCache(model.config)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
            **{CACHE_KWARG: cache},
        )
    return out[0, ids.shape[1] :], cache, time.perf_counter() - start


def demo_configs(
    output: Path,
    train_overrides: dict | None = None,
    eval_overrides: dict | None = None,
    curve_overrides: dict | None = None,
) -> tuple[dict, dict, dict]:
    """(training recipe, {suite name: eval suite}, curves) for a demo run writing under `output`.
    The suites evaluate the heads the recipe writes, with the recipe's geometry, so every step sees
    the same selection.  eval_overrides: {suite name: overrides}; curve_overrides: curves.yaml keys."""
    recipe = deep_merge(yaml.safe_load((DEMO_DIR / "train.yaml").read_text()), train_overrides)
    recipe["output_dir"] = str(output / "heads")
    suites = deep_merge(yaml.safe_load((DEMO_DIR / "eval.yaml").read_text()), eval_overrides)
    for name, suite in suites.items():
        suite["model"] = {
            **suite.get("model", {}),
            "path": recipe["model"]["path"],
            "sparse_config": recipe["model"]["sparse_config"],
            "forecast_weights": recipe["output_dir"],
            "forecast": None,
        }
        suite["output_dir"] = str(output / "eval" / name)
    curves = deep_merge(yaml.safe_load((DEMO_DIR / "curves.yaml").read_text()), curve_overrides)
    return recipe, suites, curves


def _recall_plot(before: dict, after: dict, shipped: dict | None, path: Path) -> Path:
    """Forecast recall per layer before and after training, the shipped heads' and chance alongside
    (layers >= 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(range(1, len(after["recall"])))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(layers, before["recall"][1:], "o-", label=f"init, step {before['step']} (mean {before['mean_recall']:.3f})")
    ax.plot(layers, after["recall"][1:], "s-", label=f"trained, step {after['step']} (mean {after['mean_recall']:.3f})")
    if shipped is not None:
        ax.plot(layers, shipped["recall"][1:], "^--", label=f"shipped heads (mean {shipped['mean_recall']:.3f})")
    ax.plot(layers, after["chance"][1:], ":", color="grey", label=f"chance (mean {after['mean_chance']:.3f})")
    ax.set_xlabel("layer (predicted from the layer before)")
    ax.set_ylabel("forecast recall (share of query-selected blocks)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Held-out forecast recall per layer")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _perplexity_by_length(records: list[dict]) -> dict:
    """{mode: {length: pooled perplexity}} of the eval's perplexity records."""
    from .eval.report import pooled_perplexity

    table: dict = {}
    for mode in dict.fromkeys(r["mode"] for r in records):
        for length in sorted({r["length"] for r in records if r["mode"] == mode and r["task"] == "perplexity"}):
            rows = [r for r in records if r["mode"] == mode and r["task"] == "perplexity" and r["length"] == length]
            table.setdefault(mode, {})[length] = pooled_perplexity(rows)[0]
    return table


# ----------------------------------------------------------------------------------------------
# step 3: curves over context length
# ----------------------------------------------------------------------------------------------


def _fingerprint(*parts) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _heads_digest(directory: str) -> str | None:
    """Digest of the trained heads' weights, so a curve measured with other heads is redone."""
    path = Path(directory) / "forecast.safetensors"
    return hashlib.sha1(path.read_bytes()).hexdigest()[:16] if path.is_file() else None


def _decode_counters(model, cache, first: torch.Tensor, marks: list[int]) -> tuple[list[int], list[dict], float]:
    """Greedy decode from `first` [1, 1], `cache.stats()` taken after each step count in `marks`
    (ascending).  Returns (token ids [first + the decoded ones], the stats, seconds per step)."""
    from .inference.fill import greedy_steps

    tokens, snapshots, seconds, current, done = [int(first[0, 0])], [], 0.0, first, 0
    for mark in marks:
        if mark > done:
            new, _, took = greedy_steps(model, cache, current, mark - done)
            tokens += new[0].tolist()
            current, done, seconds = new[:, -1:], mark, seconds + sum(took)
        snapshots.append(cache.stats())
    return tokens[: done + 1], snapshots, seconds / max(done, 1)


def _measure_mode(model, name: str, prefilled, first: torch.Tensor, length: int, steps: int, total: int) -> dict:
    """One mode at one length: its cache filled from `prefilled`, `total` greedy steps (the curve
    reads the first `steps`).  Returns the byte counts, the H2D and hit rate of the cold first step
    and of the steady steps after it, the decoded ids and the mode's full final stats."""
    from .eval.modes import attending_with, make_cache, parse_mode
    from .inference.fill import copy_into
    from .inference.report import stats_between

    mode = parse_mode(name)
    with attending_with(model, mode), torch.no_grad():
        cache = make_cache(model, mode)
        cache.reserve(length)  # as generate() does: prompt + new tokens, allocated once
        copy_into(prefilled, cache)
        offloaded = [layer.offloaded for layer in cache.layers]
        start = cache.stats()
        ids, (cold, curve, end), step_s = _decode_counters(model, cache, first, [1, steps, total])
    return {
        "mode": name,
        "cache": mode.cache,
        "attention": mode.attention,
        "length": length,
        "device_nbytes": curve["device_nbytes"],
        "index_nbytes": curve["index_nbytes"],
        "host_nbytes": curve["host_nbytes"],
        "cold": stats_between(start, cold, offloaded),
        "steady": stats_between(cold, curve, offloaded),
        "all_steps": {
            **stats_between(cold, end, offloaded),
            "device_nbytes": end["device_nbytes"],
            "host_nbytes": end["host_nbytes"],
        },
        "hit_rate_per_layer": end["hit_rate_per_layer"],
        "decode_ms_per_step": round(1000 * step_s, 1),
        "ids": ids,
    }


def measure_curves(model, codec, curves: dict, output: Path, new_tokens: int, heads: str | None) -> list[dict]:
    """Step 3: one result per length (see curves.yaml), each kept in `output/<length>.json` and
    reused by a rerun with the same settings."""
    from .eval.modes import attending_with, parse_mode
    from .eval.tasks import heldout_stream
    from .modeling.cache import SparseCache
    from .modeling.modeling import CACHE_KWARG

    stream = heldout_stream(codec)
    longest, generation = max(curves["lengths"]), curves["generation"]["mode"]
    results = []
    for length in curves["lengths"]:
        total = {
            name: max(curves["decode_steps"], new_tokens if (length, name) == (longest, generation) else 0)
            for name in curves["modes"]
        }
        prompt = max(total.values())
        key = _fingerprint(
            model.config.sparse_config, heads, curves["prefill"], curves["modes"], curves["decode_steps"], total, length
        )
        path = output / f"{length}.json"
        if path.is_file() and json.loads(path.read_text()).get("fingerprint") == key:
            results.append(json.loads(path.read_text()))
            continue
        ids = torch.tensor([[stream[i % len(stream)] for i in range(length - prompt)]])
        began = time.perf_counter()
        with attending_with(model, parse_mode(curves["prefill"])), torch.no_grad():
            prefilled = SparseCache(model.config, max_length=ids.shape[1])
            for start in range(0, ids.shape[1], 2048):  # chunked, as the eval prefills
                logits = model(
                    ids[:, start : start + 2048], use_cache=True, logits_to_keep=1, **{CACHE_KWARG: prefilled}
                ).logits
        first = logits[:, -1].argmax(-1, keepdim=True)
        prefill_s = time.perf_counter() - began
        modes = {
            name: _measure_mode(model, name, prefilled, first, length, curves["decode_steps"], total[name])
            for name in curves["modes"]
        }
        del prefilled
        result = {
            "fingerprint": key,
            "length": length,
            "prompt_tokens": ids.shape[1],
            "prefill": curves["prefill"],
            "prefill_s": round(prefill_s, 1),
            "modes": modes,
        }
        output.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(result, indent=1) + "\n")
        results.append(result)
        print(
            f"{length} tokens: prefill {prefill_s:.0f} s, "
            + ", ".join(
                f"{m['cache']} {_fmt(m['steady']['h2d_bytes_per_step'], MIB)} MiB/step" for m in modes.values()
            ),
            flush=True,
        )
    return results


def curve_series(results: list[dict], perplexity: dict, budget_blocks: int) -> tuple[list[int], list[dict]]:
    """(lengths, panels for `eval.report.plot_over_length`) of the measured curves."""
    lengths = [r["length"] for r in results]
    caches = list(dict.fromkeys(m["cache"] for r in results for m in r["modes"].values()))

    def series(field, scale=1.0, only=None):
        out = {}
        for cache in caches:
            if only is not None and cache not in only:
                continue
            values = []
            for r in results:
                mode = next((m for m in r["modes"].values() if m["cache"] == cache), None)
                value = None if mode is None else field(mode)
                values.append(None if value is None else value / scale)
            out[cache] = values
        return out

    panels = [
        {
            "title": "Device KV memory",
            "ylabel": "MiB on the device (KV tier)",
            "series": series(lambda m: m["device_nbytes"], MIB),
            "ylim": (0, None),
        },
        {
            "title": "Host → device bytes per decode step (steady)",
            "ylabel": "MiB per decode step (log scale)",
            "log": True,
            "series": series(
                lambda m: m["steady"]["h2d_bytes_per_step"],
                MIB,
                only={"dense-offload", "sparse-offload", "forecast-offload"},
            ),
        },
        {
            "title": f"Slot cache block hit rate (steady, {budget_blocks}-block budget)",
            "ylabel": "share of selected blocks already on the device",
            "series": series(lambda m: m["steady"]["hit_rate"], only={"sparse-offload", "forecast-offload"}),
            "ylim": (0, 1.02),
        },
        {
            "title": "Held-out perplexity per selector",
            "ylabel": "perplexity (lower is better)",
            "series": {mode: [perplexity.get(mode, {}).get(n) for n in lengths] for mode in perplexity},
        },
    ]
    return lengths, panels


# ----------------------------------------------------------------------------------------------
# step 4: one document, many questions
# ----------------------------------------------------------------------------------------------


class _FirstTokenClock:
    """A `generate()` streamer that notes when the first new token arrives (its first `put` is the
    prompt)."""

    def __init__(self) -> None:
        self.puts, self.first_at = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.first_at is None:
            self.first_at = time.perf_counter()

    def end(self) -> None:
        pass


def many_questions(model, tokenizer, spec: dict) -> dict:
    """Step 4: one held-out essay, prefilled once (with the first question: the miss) and kept in a
    `ContextStore`; the other questions are answered from its stored prefix (hits).  Returns the
    answers and the time to first token of each question."""
    from . import bundled_texts
    from .context import ContextStore
    from .eval.modes import attending_with, parse_mode
    from .modeling.modeling import CACHE_KWARG

    mode = parse_mode(spec["mode"])
    essay = tokenizer(bundled_texts("heldout")[spec["essay"]], add_special_tokens=False).input_ids[: spec["max_tokens"]]
    head = tokenizer(
        "<|im_start|>user\nRead this essay, then answer the question after it.\n\n", add_special_tokens=False
    ).input_ids
    document = head + essay + tokenizer("\n\n", add_special_tokens=False).input_ids
    rows = []
    with attending_with(model, mode):
        store = ContextStore(model, selector=mode.selector)
        for index, question in enumerate(spec["ask"]):
            asked = tokenizer(
                f"Question: {question}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
            ).input_ids
            ids = torch.tensor([document + asked])
            clock = _FirstTokenClock()
            began = time.perf_counter()
            cache, matched = store.lookup(ids, mode=mode.cache, reserve=ids.shape[1] + spec["new_tokens"])
            with torch.no_grad():
                out = model.generate(
                    ids,
                    max_new_tokens=spec["new_tokens"],
                    do_sample=False,
                    pad_token_id=model.config.eos_token_id,
                    streamer=clock,
                    **{CACHE_KWARG: cache},
                )
            if index == 0:
                store.insert(cache, document)  # the essay's full blocks, shared by every later question
            store.release(cache)
            rows.append(
                {
                    "question": question,
                    "prompt_tokens": ids.shape[1],
                    "matched": matched,
                    "ttft_s": clock.first_at - began,
                    "answer": " ".join(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).split()),
                }
            )  # one line
    hits = [r for r in rows if r["matched"]]
    misses = [r for r in rows if not r["matched"]]
    mean = lambda rs: sum(r["ttft_s"] for r in rs) / len(rs) if rs else None  # noqa: E731
    return {
        "mode": spec["mode"],
        "document_tokens": len(document),
        "questions": rows,
        "store": store.stats(),
        "ttft_hit_s": mean(hits),
        "ttft_miss_s": mean(misses),
    }


# ----------------------------------------------------------------------------------------------
# step 5: GPU numbers, report, summary
# ----------------------------------------------------------------------------------------------


def gpu_runs(results: Path = GPU_RESULTS) -> list[dict]:
    """The GPU runs of `benchmarks/gpu_check.py` under `results` (a `summary.json` of a run that
    found CUDA and was not a dry run), newest first: {date, machine, state, ok, summary_md}."""
    runs = []
    for path in sorted(results.glob("**/summary.json")) if results.is_dir() else []:
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(summary, dict):  # another tool's summary.json (benchmarks/results/quality's is a list)
            continue
        if summary.get("dry_run") or not (summary.get("environment") or {}).get("cuda_available"):
            continue
        md = path.with_name("summary.md")
        runs.append(
            {
                "date": summary.get("date"),
                "machine": summary.get("machine"),
                "state": summary.get("state"),
                "ok": summary.get("ok"),
                "path": str(path.parent),
                "summary_md": md.read_text() if md.is_file() else None,
            }
        )
    return sorted(runs, key=lambda r: str(r["date"]), reverse=True)


def _gpu_line(runs: list[dict]) -> str:
    if not runs:
        return f"No GPU run of benchmarks/gpu_check.py in benchmarks/results/ yet; on a GPU machine: `{GPU_COMMAND}`"
    run = runs[0]
    return f"GPU run of benchmarks/gpu_check.py on {run['date']}, {run['machine']}: {run['state']} ({run['path']})"


def _fmt(value: float | None, unit: float = 1.0, digits: int = 3) -> str:
    return "—" if value is None else f"{value / unit:.{digits}f}"


def _label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def curve_table(results: list[dict], perplexity: dict, budget_blocks: int, block_size: int) -> list[list[str]]:
    """Rows [what, mode, value per length] of the curves and the perplexity per selector."""
    rows = [
        ["budget share of the blocks", "", *[f"{100 * budget_blocks * block_size / r['length']:.1f}%" for r in results]]
    ]

    def add(what, cache, field, unit=1.0, digits=3):
        values = [next((field(m) for m in r["modes"].values() if m["cache"] == cache), None) for r in results]
        if any(v is not None for v in values):
            rows.append([what, cache, *[_fmt(v, unit, digits) for v in values]])

    caches = list(dict.fromkeys(m["cache"] for r in results for m in r["modes"].values()))
    for cache in caches:
        add("device KV MiB", cache, lambda m: m["device_nbytes"], MIB, 1)
    for cache in caches:
        add("host KV MiB", cache, lambda m: m["host_nbytes"] or None, MIB, 1)
    for cache in caches:
        if cache != "no-offload":
            add("H2D MiB per decode step (steady)", cache, lambda m: m["steady"]["h2d_bytes_per_step"], MIB)
    for cache in caches:
        add(
            "H2D MiB, first (cold) step",
            cache,
            lambda m: m["cold"]["h2d_bytes_per_step"] if m["cache"] != "no-offload" else None,
            MIB,
        )
    for cache in caches:
        add("block hit rate (steady)", cache, lambda m: m["steady"]["hit_rate"])
    for mode, by_length in perplexity.items():
        rows.append(["perplexity", mode, *[_fmt(by_length.get(r["length"])) for r in results]])
    return rows


def _text_table(rows: list[list[str]], lengths: list[int]) -> str:
    head = ["", "mode", *[_label(n) for n in lengths]]
    table = [head] + rows
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        for row in table
    )


def _md_table(rows: list[list[str]], lengths: list[int]) -> list[str]:
    return [
        "| | mode | " + " | ".join(_label(n) for n in lengths) + " |",
        "|---|---|" + "---|" * len(lengths),
        *["| " + " | ".join(row) + " |" for row in rows],
    ]


def run_demo(
    output: str | Path = "runs/demo",
    train_overrides: dict | None = None,
    eval_overrides: dict | None = None,
    prompt_tokens: int | None = None,
    new_tokens: int | None = None,
    progress: bool = True,
    curve_overrides: dict | None = None,
) -> dict:
    """Run the five steps; returns the numbers of the summary it prints last.

    new_tokens: the offloaded generation's length (None: curves.yaml's); prompt_tokens: its prompt
    (None: the longest curve length, whose prefill it continues; another value prefills its own)."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    recipe, suites, curves = demo_configs(output, train_overrides, eval_overrides, curve_overrides)
    new_tokens = curves["generation"]["new_tokens"] if new_tokens is None else new_tokens
    clock = {"start": time.perf_counter()}
    trained, threads = _fit_heads(recipe, progress)
    shipped = _shipped_recall(recipe, trained)
    clock["train"] = time.perf_counter()
    reports, perplexity = _held_out_perplexity(suites, progress)
    clock["eval"] = time.perf_counter()
    model, tokenizer, results, gen = _curves_and_generation(recipe, curves, output, prompt_tokens, new_tokens)
    clock["curves"] = time.perf_counter()
    questions = _ask_questions(model, tokenizer, curves["questions"])
    clock["questions"] = time.perf_counter()
    steps = (("start", "train"), ("train", "eval"), ("eval", "curves"), ("curves", "questions"))
    run = DemoRun(
        output,
        recipe,
        curves,
        trained,
        shipped,
        threads,
        reports,
        perplexity,
        model.config.sparse,
        results,
        gen,
        questions,
        {k: clock[k] - clock[p] for p, k in steps},
    )
    print("== 5/5 report", flush=True)
    return _report(run)


@dataclass
class DemoRun:
    """What steps 1-4 produced: the report and the summary (step 5) read it."""

    output: Path
    recipe: dict
    curves: dict
    trained: object  # training.trainer.TrainResult: history[0] / [-1] are the recall before / after
    shipped: dict | None  # the shipped heads' recall on the same sequences (None: none shipped for this model)
    threads: int  # torch threads of the steps after training
    reports: list  # the eval suites' report.md paths
    perplexity: dict  # {mode: {length: pooled perplexity}}
    sparse: object  # the loaded model's SparseConfig
    results: list  # `measure_curves`' result per length
    gen: dict  # the offloaded generation's numbers, "continuation" its text
    questions: dict  # `many_questions`' result (or {"skipped": why})
    seconds: dict  # wall seconds of steps 1-4


def _fit_heads(recipe: dict, progress: bool) -> tuple[object, int]:
    """Step 1: train (or resume) the heads; returns the `TrainResult` and the threads used after it."""
    from .training.trainer import train_forecast

    print("== 1/5 fit Forecast heads on the training essays (recall measured before and after)", flush=True)
    resume = recipe["output_dir"] if (Path(recipe["output_dir"]) / "checkpoints").is_dir() else None
    default_threads = torch.get_num_threads()
    trained = train_forecast(recipe, resume=resume, train={"progress": progress})
    # training's small ops run on the recipe's one thread; the long forwards that follow are
    # matmul-bound (a 4K SmolLM2 prefill: 1.6x faster on 2 threads than on 1, idle 2-core CPU)
    torch.set_num_threads(default_threads)
    before, after = trained.history[0], trained.history[-1]
    print(
        f"recall (mean over layers >= 1): {before['mean_recall']:.3f} at step {before['step']} -> "
        f"{after['mean_recall']:.3f} at step {after['step']} (chance {after['mean_chance']:.3f})",
        flush=True,
    )
    return trained, torch.get_num_threads()


def _shipped_recall(recipe: dict, trained) -> dict | None:
    """Step 1's comparison: the recall of the heads shipped for the recipe's model
    (`forecast_weights="bundled:NAME"`) on the held-out sequences, rows and reference of the trained
    heads' last eval, measured on the trained model with its heads swapped in and back.  None where no
    heads are shipped for the model, the recipe has no eval, or the heads differ in shape (another
    heads_per_group) or block geometry (`head_files.GEOMETRY_KEYS`)."""
    from transformers import AutoTokenizer

    from .bundled import resolve_heads_path, resolve_model_path, shipped_heads_for
    from .modeling.head_files import GEOMETRY_KEYS, read_forecast_side
    from .training.recall import RecallProtocol, evaluate_recall
    from .training.recipe import eval_window

    shipped = shipped_heads_for(str(recipe["model"]["path"]))
    data = json.loads((Path(trained.output_dir) / "recipe.json").read_text())["data"]  # with the defaults
    if shipped is None or not trained.history or not data["eval_source"] or not data["eval_sequences"]:
        return None
    heads, side = read_forecast_side(resolve_heads_path(shipped))
    model = trained.model
    own = {name: value for name, value in model.state_dict().items() if name in heads}
    trained_for = side.get("sparse_config") or {}
    geometry = [key for key in GEOMETRY_KEYS if trained_for.get(key) != model.config.sparse_config.get(key)]
    if own.keys() != heads.keys() or any(own[k].shape != heads[k].shape for k in heads) or geometry:
        print(f"shipped heads {shipped}: another shape or block geometry than the recipe's, not compared", flush=True)
        return None
    own = {name: value.clone() for name, value in own.items()}
    length, start = eval_window(data)
    reference = trained.history[-1].get("reference", "query")
    protocol = RecallProtocol(
        data["eval_source"], data["eval_split"], length, start, data["eval_sequences"], data["eval_backbone"], reference
    )
    model.load_state_dict(heads, strict=False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(recipe["model"]["path"]))
        report = evaluate_recall(model, tokenizer, protocol).to_dict()
    finally:
        model.load_state_dict(own, strict=False)
    print(
        f"shipped heads ({shipped}) on the same held-out rows: recall {report['mean_recall']:.3f} "
        f"(these heads {trained.history[-1]['mean_recall']:.3f})",
        flush=True,
    )
    return {"heads": shipped, **report}


def _held_out_perplexity(suites: dict, progress: bool) -> tuple[list[Path], dict]:
    """Step 2: run every eval suite; returns their report paths and {mode: {length: perplexity}}."""
    from .eval.report import load as load_records
    from .eval.runner import run_eval

    print("== 2/5 held-out perplexity per selector at each length", flush=True)
    reports, records = [], []
    for suite in suites.values():
        reports.append(Path(run_eval(suite, progress=progress)["report"] or Path(suite["output_dir"]) / "report.md"))
        records += load_records(suite["output_dir"])
    return reports, _perplexity_by_length(records)


def _curves_and_generation(recipe: dict, curves: dict, output: Path, prompt_tokens: int | None, new_tokens: int):
    """Step 3: load the trained model, measure the curves, and the offloaded generation (the
    longest curve's forecast-offload decode, or its own prompt).  Returns (model, tokenizer,
    curve results, generation numbers with its "continuation")."""
    from transformers import AutoTokenizer

    from . import ForecastKVForCausalLM
    from .bundled import resolve_model_path
    from .eval.codec import TextCodec

    print(
        "== 3/5 curves over context length: device KV, H2D bytes per decode step, block hit rate per mode", flush=True
    )
    path = resolve_model_path(recipe["model"]["path"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = ForecastKVForCausalLM.from_pretrained(
        path, sparse_config=recipe["model"]["sparse_config"], forecast_weights=recipe["output_dir"]
    ).eval()
    reuse = prompt_tokens is None or prompt_tokens + new_tokens == max(curves["lengths"])
    heads = _heads_digest(recipe["output_dir"])
    results = measure_curves(model, TextCodec(tokenizer), curves, output / "curves", new_tokens if reuse else 0, heads)
    if reuse:
        gen = _curve_generation(results[-1], curves["generation"]["mode"], new_tokens)
    else:  # a prompt length of its own: its own offloaded generate()
        gen = _own_generation(model, tokenizer, prompt_tokens, new_tokens)
    gen["continuation"] = tokenizer.decode(gen["ids"], skip_special_tokens=True)
    print(f"continuation of the {gen['prompt_tokens']}-token prompt: {gen['continuation']!r}", flush=True)
    return model, tokenizer, results, gen


def _curve_generation(longest: dict, mode: str, new_tokens: int) -> dict:
    """The generation's numbers from the longest curve's decode in `mode` (its first `new_tokens`)."""
    run = longest["modes"][mode]
    dense = next(
        (m["steady"]["h2d_bytes_per_step"] for m in longest["modes"].values() if m["cache"] == "dense-offload"), None
    )
    return {
        "prompt_tokens": longest["prompt_tokens"],
        "ids": run["ids"][:new_tokens],
        **run["all_steps"],
        "dense_h2d": dense,
    }


def _own_generation(model, tokenizer, prompt_tokens: int, new_tokens: int) -> dict:
    """A forecast-offload `generate()` of `new_tokens` after the first `prompt_tokens` of the held-out essays."""
    from . import bundled_texts
    from .eval.codec import TextCodec
    from .inference.report import format_stats, generate_offloaded

    ids = torch.tensor([TextCodec(tokenizer).encode("\n\n".join(bundled_texts("heldout")))[:prompt_tokens]])
    new_ids, cache, _ = generate_offloaded(model, ids, new_tokens, mode="forecast-offload")
    stats = cache.stats()
    return {
        "prompt_tokens": ids.shape[1],
        "ids": new_ids[0].tolist(),
        "steps": stats["decode_steps"],
        "h2d_bytes_per_step": stats["h2d_bytes_per_step_mean"],
        "hit_rate": stats["hit_rate"],
        "device_nbytes": stats["device_nbytes"],
        "host_nbytes": stats["host_nbytes"],
        "dense_h2d": None,
        "stats_text": format_stats(stats),
    }


def _ask_questions(model, tokenizer, spec: dict) -> dict:
    """Step 4: `many_questions`, each answer printed (skipped when the context store does not import)."""
    print("== 4/5 one document, many questions (a ContextStore prefix shared by four questions)", flush=True)
    try:
        questions = many_questions(model, tokenizer, spec)
    except ImportError as error:  # the context store is not part of this install
        questions = {"skipped": f"forecastkv.context does not import ({error})"}
    for row in questions.get("questions", []):
        print(
            f"[{'hit' if row['matched'] else 'miss'} {row['matched']}/{row['prompt_tokens']} tokens, "
            f"first token {row['ttft_s']:.2f} s] {row['question']} -> {row['answer']!r}",
            flush=True,
        )
    return questions


def _report(run: DemoRun) -> dict:
    """Step 5: the plots, report.md and the summary (printed, and kept as summary.txt); returns the
    summary's numbers."""
    from .eval.report import plot_over_length

    sparse, gen, before, after = run.sparse, run.gen, run.trained.history[0], run.trained.history[-1]
    recall_png = _recall_plot(before, after, run.shipped, run.output / "recall_by_layer.png")
    lengths, panels = curve_series(run.results, run.perplexity, sparse.budget_blocks)
    title = (
        f"SmolLM2-135M, {sparse.budget_blocks}-block budget of {sparse.block_size} tokens: "
        "what each mode holds and moves"
    )
    curves_png = plot_over_length(lengths, panels, run.output / "curves.png", title)
    query, forecast = run.perplexity.get("infllmv2-query", {}), run.perplexity.get("infllmv2-forecast", {})
    ratios = {n: forecast[n] / query[n] for n in query if n in forecast}
    gpu = gpu_runs()
    table = curve_table(run.results, run.perplexity, sparse.budget_blocks, sparse.block_size)
    curve_fields = ("device_nbytes", "host_nbytes", "index_nbytes", "steady", "cold")
    result = {
        "recall_before": before["mean_recall"],
        "recall_after": after["mean_recall"],
        "recall_shipped": None if run.shipped is None else run.shipped["mean_recall"],
        "chance": after["mean_chance"],
        "lengths": lengths,
        "perplexity": run.perplexity,
        "forecast_over_query_perplexity": ratios,
        "curves": {
            r["length"]: {m["cache"]: {k: m[k] for k in curve_fields} for m in r["modes"].values()} for r in run.results
        },
        "generation": {k: v for k, v in gen.items() if k != "ids"},
        "questions": run.questions,
        "gpu": gpu[:1],
        "seconds": run.seconds,
    }
    gen_line, q_line = _generation_line(gen), _questions_line(run.questions)
    lines = _report_lines(run, table, lengths, curves_png, recall_png, gen_line, q_line, gpu)
    write_text_atomic(run.output / "report.md", "\n".join(lines))
    result["report"] = str(run.output / "report.md")
    summary = _summary_lines(run, result, table, ratios, gen_line, q_line, gpu)
    # the block the README quotes (tests/test_readme.py compares them), printed and kept beside the report
    write_text_atomic(run.output / "summary.txt", "\n".join(summary) + "\n")
    print("\n" + "\n".join(summary), flush=True)
    return result


def _generation_line(gen: dict) -> str:
    """The offloaded generation in one line: device against host KV, H2D per step, hit rate."""
    dense = f" (dense-offload: {_fmt(gen['dense_h2d'], MIB, 1)} MiB)" if gen.get("dense_h2d") else ""
    hits = "" if gen.get("hit_rate") is None else f", block hit rate {100 * gen['hit_rate']:.1f}%"
    return (
        f"forecast-offload, {gen['prompt_tokens']}-token prompt + {len(gen['ids'])} new tokens: "
        f"device KV {_fmt(gen['device_nbytes'], MIB, 1)} MiB against host {_fmt(gen['host_nbytes'], MIB, 1)} MiB; "
        f"H2D {_fmt(gen['h2d_bytes_per_step'], MIB)} MiB per step after the first" + dense + hits
    )


def _report_lines(
    run: DemoRun, table: list, lengths: list, curves_png: Path, recall_png: Path, gen_line: str, q_line: str, gpu: list
) -> list[str]:
    """report.md, line by line: the curves, then sections 1-5."""
    recipe, curves, gen, output = run.recipe, run.curves, run.gen, run.output
    recall_md = run.trained.output_dir / "recall.md"
    links = ", ".join(f"[{p.relative_to(output)}]({p.relative_to(output)})" for p in run.reports)
    answers = [
        f"- {'hit' if r['matched'] else 'miss'} ({r['matched']} of {r['prompt_tokens']} tokens from the store, "
        f"first token after {r['ttft_s']:.2f} s): *{r['question']}* {r['answer']}"
        for r in run.questions.get("questions", [])
    ]
    return [
        "# forecastkv demo: SmolLM2-135M, Forecast heads, offloaded decode",
        "",
        f"Base `{recipe['model']['path']}`, geometry {recipe['model']['sparse_config']}.",
        "",
        "## Curves over context length",
        "",
        f"Per length one prefill of the held-out essays ({curves['prefill']}), copied into each mode's cache, then "
        f'{curves["decode_steps"]} greedy decode steps: the first fills the empty slot cache (cold), "steady" is '
        "the mean of the steps after it. Device KV: the KV tier on the device (no-offload: every layer's K/V; "
        "sparse- and forecast-offload: slots of the budget and block maps per layer, layer 0 resident; "
        "dense-offload: layer 0 and the layer being copied); the selection index (compressed keys) is apart. "
        "Perplexity: step 2's eval, one held-out window per length.",
        "",
        *_md_table(table, lengths),
        "",
        f"![curves]({curves_png.name})",
        "",
        f"## 1. Forecast recall on held-out essays (T = {recipe['data']['eval_seq_len']}, "
        f"rows t >= {recipe['data']['eval_start']})",
        "",
        recall_md.read_text() if recall_md.is_file() else "",
        "",
        _shipped_line(run.shipped, run.trained.history[-1]),
        "",
        f"![recall by layer]({recall_png.name})",
        "",
        "## 2. Held-out perplexity per selector",
        "",
        "Full tables and plots: " + links + ".",
        "",
        *[f"![{p.stem}]({p.relative_to(output)})" for r in run.reports for p in sorted(r.parent.glob("*.png"))],
        "",
        f"## 3. Offloaded generation at {_label(gen['prompt_tokens'] + len(gen['ids']))}",
        "",
        gen_line,
        "",
        "```",
        gen["continuation"].strip(),
        "```",
        "",
        *(["```", gen["stats_text"], "```", ""] if gen.get("stats_text") else []),
        "## 4. One document, many questions",
        "",
        q_line,
        "",
        *answers,
        "",
        "## 5. GPU numbers",
        "",
        _gpu_line(gpu),
        "",
        *([gpu[0]["summary_md"]] if gpu and gpu[0]["summary_md"] else []),
        "",
    ]


def _shipped_line(shipped: dict | None, after: dict) -> str:
    if shipped is None:
        return "No heads are shipped for this model (or for its block geometry): nothing to compare."
    return (
        f"The heads shipped with the package (`forecast_weights=\"{shipped['heads']}\"`, what "
        f"`forecastkv generate --offload forecast-offload` loads without training) on the same rows: mean recall "
        f"{shipped['mean_recall']:.3f}, against {after['mean_recall']:.3f} for the heads trained here."
    )


def _summary_lines(
    run: DemoRun, result: dict, table: list, ratios: dict, gen_line: str, q_line: str, gpu: list
) -> list[str]:
    """The summary printed last (the README quotes it in this form)."""
    sparse, threads = run.sparse, run.threads
    ratio_text = ", ".join(f"{_label(n)} {r:.4f} ({100 * (r - 1):+.2f}%)" for n, r in sorted(ratios.items()))
    return [
        f"== summary (SmolLM2-135M; {sparse.budget_blocks}-block budget of {sparse.block_size} tokens; "
        f"CPU, {threads} thread{'s' if threads > 1 else ''})",
        f"forecast recall (held-out, layers >= 1): {result['recall_before']:.3f} init -> "
        f"{result['recall_after']:.3f} trained (chance {result['chance']:.3f})",
        _text_table(table, result["lengths"]),
        *([f"forecast / query perplexity: {ratio_text}"] if ratios else []),
        f"generation: {gen_line}",
        f"many questions: {q_line}",
        f"GPU: {_gpu_line(gpu)}",
        "time: " + ", ".join(f"{k} {v:.0f} s" for k, v in result["seconds"].items()),
        f"report: {result['report']}",
    ]


def _questions_line(questions: dict) -> str:
    if "skipped" in questions:
        return f"skipped: {questions['skipped']}"
    hits = sum(1 for r in questions["questions"] if r["matched"])
    return (
        f"{questions['mode']}, a {questions['document_tokens']}-token essay prefilled once: time to first token "
        f"{_fmt(questions['ttft_miss_s'], 1, 2)} s for the miss, "
        f"{_fmt(questions['ttft_hit_s'], 1, 2)} s mean over {hits} hits"
    )
