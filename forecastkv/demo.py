"""The main job on the bundled default (`forecastkv demo`, `make demo`), in four steps that call the
same code as the package's commands:

1. fit Forecast heads on the training essays      (`forecastkv train-forecast`: `train_forecast`);
   the trainer measures held-out forecast recall before and after (`training.recall.forecast_recall`);
2. evaluate on the held-out essays                 (`forecastkv eval`: `run_eval`): perplexity with the
   query and the forecast selector, H2D bytes per decode step of dense-, sparse- and forecast-offload;
3. continue a held-out essay with the offloaded runtime in forecast mode
                                                   (`forecastkv generate --offload`: `generate_offloaded`);
4. write `<output>/report.md` with its plots and print a short summary last.

The recipe and the eval suites are package data (`forecastkv/presets/demo/`); `overrides` shrink them
for the test.  Everything is written under `output` and a rerun resumes: finished training and
finished eval examples are kept.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import yaml

from .atomic import write_text_atomic
from .merge import deep_merge

DEMO_DIR = Path(__file__).parent / "presets" / "demo"


def generate_with_cache(model, ids: torch.Tensor, max_new_tokens: int):
    """Greedy continuation through an explicit SparseCache.  ids [1, T] -> (new ids [N], cache, seconds)."""
    from .modeling.cache import SparseCache
    from .modeling.modeling import CACHE_KWARG

    cache = SparseCache(model.config)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=model.config.eos_token_id, **{CACHE_KWARG: cache})
    return out[0, ids.shape[1] :], cache, time.perf_counter() - start


def demo_configs(output: Path, train_overrides: dict | None = None, eval_overrides: dict | None = None) -> tuple[dict, dict]:
    """(training recipe, {suite name: eval suite}) for a demo run writing under `output`.  The suites
    evaluate the heads the recipe writes, with the recipe's geometry, so both steps see the same
    selection.  eval_overrides: {suite name: overrides}."""
    recipe = deep_merge(yaml.safe_load((DEMO_DIR / "train.yaml").read_text()), train_overrides)
    recipe["output_dir"] = str(output / "heads")
    suites = deep_merge(yaml.safe_load((DEMO_DIR / "eval.yaml").read_text()), eval_overrides)
    for name, suite in suites.items():
        suite["model"] = {**suite.get("model", {}), "path": recipe["model"]["path"], "sparse_config": recipe["model"]["sparse_config"],
                          "forecast_weights": recipe["output_dir"], "forecast": None}
        suite["output_dir"] = str(output / "eval" / name)
    return recipe, suites


def _recall_plot(before: dict, after: dict, path: Path) -> Path:
    """Forecast recall per layer before and after training, chance alongside (layers >= 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(range(1, len(after["recall"])))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(layers, before["recall"][1:], "o-", label=f"init, step {before['step']} (mean {before['mean_recall']:.3f})")
    ax.plot(layers, after["recall"][1:], "s-", label=f"trained, step {after['step']} (mean {after['mean_recall']:.3f})")
    ax.plot(layers, after["chance"][1:], ":", color="grey", label=f"chance (mean {after['mean_chance']:.3f})")
    ax.set_xlabel("layer (predicted from the layer before)")
    ax.set_ylabel("forecast recall (share of query-selected blocks)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Held-out forecast recall per layer")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _eval_summary(records: list[dict]) -> dict:
    """Per mode: pooled perplexity (perplexity task) and mean H2D bytes per decode step."""
    from .eval.report import pooled_perplexity

    summary: dict = {}
    for mode in dict.fromkeys(r["mode"] for r in records):
        rows = [r for r in records if r["mode"] == mode]
        ppl_rows = [r for r in rows if r["task"] == "perplexity"]
        h2d = [r["h2d_bytes_per_step"] for r in rows if r.get("h2d_bytes_per_step") is not None]
        summary[mode] = {"perplexity": pooled_perplexity(ppl_rows)[0] if ppl_rows else None,
                         "h2d_bytes_per_step": sum(h2d) / len(h2d) if h2d else None}
    return summary


def _fmt(value: float | None, unit: float = 1.0) -> str:
    return "—" if value is None else f"{value / unit:.3f}"


def run_demo(output: str | Path = "runs/demo", train_overrides: dict | None = None, eval_overrides: dict | None = None,
             prompt_tokens: int = 1024, new_tokens: int = 32, progress: bool = True) -> dict:
    """Run the four steps; returns the numbers of the summary it prints last."""
    from transformers import AutoTokenizer

    from . import ForecastKVForCausalLM, bundled_texts
    from .bundled import resolve_model_path
    from .eval.report import load as load_records
    from .eval.runner import run_eval
    from .inference.report import format_stats, generate_offloaded
    from .training.trainer import train_forecast

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    recipe, suites = demo_configs(output, train_overrides, eval_overrides)
    clock = {"start": time.perf_counter()}

    print("== 1/4 fit Forecast heads on the training essays (recall measured before and after)", flush=True)
    resume = recipe["output_dir"] if (Path(recipe["output_dir"]) / "checkpoints").is_dir() else None
    trained = train_forecast(recipe, resume=resume, train={"progress": progress})
    before, after = trained.history[0], trained.history[-1]
    clock["train"] = time.perf_counter()
    print(f"recall (mean over layers >= 1): {before['mean_recall']:.3f} at step {before['step']} -> "
          f"{after['mean_recall']:.3f} at step {after['step']} (chance {after['mean_chance']:.3f})", flush=True)

    print("== 2/4 evaluate on the held-out essays (perplexity per selector, H2D bytes per offload mode)", flush=True)
    reports, records = [], []
    for suite in suites.values():
        reports.append(Path(run_eval(suite, progress=progress)["report"] or Path(suite["output_dir"]) / "report.md"))
        records += load_records(suite["output_dir"])
    per_mode = _eval_summary(records)
    clock["eval"] = time.perf_counter()

    print("== 3/4 continue a held-out essay, KV offloaded, blocks prefetched by the forecast heads", flush=True)
    path = resolve_model_path(recipe["model"]["path"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = ForecastKVForCausalLM.from_pretrained(path, sparse_config=recipe["model"]["sparse_config"], forecast_weights=recipe["output_dir"])
    ids = tokenizer(bundled_texts("heldout")[0], return_tensors="pt").input_ids[:, :prompt_tokens]
    new_ids, cache, seconds = generate_offloaded(model, ids, new_tokens, mode="forecast-offload")
    continuation = tokenizer.decode(new_ids[0])
    stats_text = format_stats(cache.stats())
    print(repr(continuation), flush=True)
    clock["generate"] = time.perf_counter()

    print("== 4/4 report", flush=True)
    recall_png = _recall_plot(before, after, output / "recall_by_layer.png")
    query, forecast = per_mode.get("infllmv2-query", {}), per_mode.get("infllmv2-forecast", {})
    bytes_of = {m.split("@")[1]: v["h2d_bytes_per_step"] for m, v in per_mode.items() if "@" in m}
    ppl_ratio = (forecast["perplexity"] / query["perplexity"]) if query.get("perplexity") and forecast.get("perplexity") else None
    result = {
        "recall_before": before["mean_recall"], "recall_after": after["mean_recall"], "chance": after["mean_chance"],
        "perplexity": {m: v["perplexity"] for m, v in per_mode.items() if v["perplexity"] is not None},
        "forecast_over_query_perplexity": ppl_ratio, "h2d_bytes_per_step": bytes_of, "continuation": continuation,
        "seconds": {k: clock[k] - clock[p] for p, k in (("start", "train"), ("train", "eval"), ("eval", "generate"))},
    }
    lines = [
        "# forecastkv demo: SmolLM2-135M, Forecast heads, offloaded decode", "",
        f"Base `{recipe['model']['path']}`, geometry {recipe['model']['sparse_config']}.", "",
        f"## 1. Forecast recall on held-out essays (T = {recipe['data']['eval_seq_len']}, rows t >= {recipe['data']['eval_start']})", "",
        (trained.output_dir / "recall.md").read_text() if (trained.output_dir / "recall.md").is_file() else "", "",
        f"![recall by layer]({recall_png.name})", "",
        "## 2. Held-out evaluation (perplexity per selector, H2D bytes per decode step per offload mode)", "",
        "Full tables and plots: " + ", ".join(f"[{p.relative_to(output)}]({p.relative_to(output)})" for p in reports) + ".", "",
        "| mode | perplexity | H2D MiB per decode step |", "|---|---|---|",
        *[f"| {m} | {_fmt(v['perplexity'])} | {_fmt(v['h2d_bytes_per_step'], 2**20)} |" for m, v in per_mode.items()],
        "", *[f"![{p.stem}]({p.relative_to(output)})" for r in reports for p in sorted(r.parent.glob("*.png"))], "",
        f"## 3. Offloaded generation (forecast-offload, {ids.shape[1]}-token prompt, {seconds:.1f} s)", "",
        "```", continuation.strip(), "```", "", "```", stats_text, "```", "",
    ]
    write_text_atomic(output / "report.md", "\n".join(lines))
    result["report"] = str(output / "report.md")

    print("\n== summary", flush=True)
    print(f"forecast recall (held-out, layers >= 1): {result['recall_before']:.3f} init -> {result['recall_after']:.3f} trained "
          f"(chance {result['chance']:.3f})")
    for mode, value in result["perplexity"].items():
        print(f"perplexity {mode}: {value:.3f}")
    if ppl_ratio is not None:
        print(f"forecast / query perplexity: {ppl_ratio:.4f} ({100 * (ppl_ratio - 1):+.2f}%)")
    dense = bytes_of.get("dense-offload")
    for mode, value in bytes_of.items():
        ratio = f" ({value / dense:.4f} x dense-offload)" if dense and value is not None else ""
        print(f"H2D per decode step, {mode}: {_fmt(value, 2**20)} MiB{ratio}")
    print(f"time: train {result['seconds']['train']:.0f} s, eval {result['seconds']['eval']:.0f} s, generate {result['seconds']['generate']:.0f} s")
    print(f"report: {result['report']}")
    return result
