"""Decode sweep: runtime modes x batch x context length, organised like SparDA's efficiency runs.

    PYTHONPATH=. python benchmarks/decode_sweep.py --config cpu  # SmolLM2-135M-shaped, fp32, 1K-4K, batch 1-4
    PYTHONPATH=. python benchmarks/decode_sweep.py --config gpu  # MiniCPM4.1-8B-shaped, bf16, 32K-128K, batch 1-64
    PYTHONPATH=. python benchmarks/decode_sweep.py --config gpu-short  # what benchmarks/gpu_check.py runs
    PYTHONPATH=. python benchmarks/decode_sweep.py --config tiny  # a dry run of the script (CPU, seconds)

Per (length, batch): prefill tokens/s of one forward over random token ids into a resident
`SparseCache` and into an offloaded cache (`forecast-offload`: K/V written to host as it goes).
Per (length, mode, batch): the cache is filled with random post-RoPE K/V (decode cost does not
depend on where the keys came from), then warm-up steps (the first fills empty slots) and timed
steps: decode tokens/s, H2D bytes per step, block hit rate, host syncs per step on CUDA
(`offload_decode.run_config`).  Per (length, batch): the share of the synchronous fetch time the
prefetch hides, 1 - (t[forecast-offload] - t[no-offload]) / (t[forecast-sync] - t[no-offload]),
the forecast-offload speed-up over sparse-offload, and its step time over no-offload; once per run,
the block-gather bandwidth against a plain pinned copy.
Order: the decode steps first (per length, shortest first: per batch, every mode, so each
(length, batch) has its hidden share before the next starts), then the gather bandwidth, then
the prefill rates last (`--prefill-lengths` / `--prefill-batches` narrow them, `--no-prefill`
drops them): a run cut short by the budget or killed has the decode numbers.
Once a batch runs out of memory (device or pinned host) for a (length, mode), larger batches are
marked OOM and not run; configurations left when the time budget is spent are marked "skipped".
Writes JSON (atomically, after every measured row, so a killed run keeps what it measured) and,
at the end, a PNG beside it: decode tokens/s vs batch per mode, one panel per length, and H2D MiB
per step.  Random weights: the numbers are speeds and bytes, not quality.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# benchmarks/kernels.py shadows HF's `kernels`
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.append(HERE)  # for offload_decode (appended: HF's `kernels` still wins)
from offload_decode import (  # noqa: E402
    MINICPM41_8B,
    gather_bandwidth,
    hidden_shares,
    is_oom,
    run_config,
    split_mode,
    synchronize,
)

# besides the runtime's modes, forecast-offload with the layer-ahead selector the quality suite recommends
# (`benchmarks/results/quality/`): what its carried blocks cost a decode step (random K/V: nothing is pinned)
EXTRA_MODES = ("forecast-offload:forecast-carry-pin",)

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
    max_position_embeddings=8192,
    bos_token_id=None,
    eos_token_id=None,
    tie_word_embeddings=True,
)
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    initializer_range=0.2,
    max_position_embeddings=4096,
    bos_token_id=None,
    eos_token_id=None,
)
CONFIGS = {
    # name: (model shape, preset, dtype on that device, lengths, batches, budget seconds)
    "cpu": (SMOLLM2_135M, "smollm2-135m", torch.float32, [1024, 2048, 4096], [1, 2, 4], 480.0),
    "gpu": (MINICPM41_8B, "minicpm4.1-8b", torch.bfloat16, [32768, 65536, 131072], [1, 4, 16, 64], 1800.0),
    "tiny": (TINY, "smollm2-135m", torch.float32, [512, 1024], [1, 2], 120.0),  # a dry run of the script
    # what benchmarks/gpu_check.py runs (it also passes --modes, --budget-s and the prefill cells)
    "gpu-short": (MINICPM41_8B, "minicpm4.1-8b", torch.bfloat16, [32768, 131072], [1, 4], 90.0),
}


def build_model(shape: dict, preset: str, device: torch.device, dtype: torch.dtype):
    """A random-weight model of `shape` with `preset`'s geometry, forecast selector and heads."""
    from forecastkv import ForecastKVConfig, ForecastKVForCausalLM
    from forecastkv.modeling.configuration import load_preset

    sparse = dict(load_preset(preset)["sparse_config"], selector="forecast")
    config = ForecastKVConfig(**shape, sparse_config=sparse, forecast={"enabled": True, "heads_per_group": 1})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return ForecastKVForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def prefill_rate(model, batch: int, length: int, mode: str | None, device: torch.device) -> dict:
    """Tokens/s of one prefill forward of random ids [batch, length] into a fresh cache:
    `SparseCache` when mode is None, else `OffloadedSparseCache` in `mode`."""
    from forecastkv import SparseCache
    from forecastkv.inference import OffloadedSparseCache
    from forecastkv.modeling.modeling import CACHE_KWARG

    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device)
    cache = (
        SparseCache(model.config)
        if mode is None
        else OffloadedSparseCache.for_model(model, mode=mode, max_length=length + 1)
    )
    synchronize(device)
    start = time.perf_counter()
    model(ids, logits_to_keep=1, **{CACHE_KWARG: cache})
    synchronize(device)
    seconds = time.perf_counter() - start
    return {"status": "ok", "seconds": seconds, "tokens_per_s": batch * length / seconds}


def sweep(keys, batches, measure, started: float, budget_s: float, on_row=None) -> list[dict]:
    """Run `measure(**key, batch=b)` for every key (a dict of fixed settings, with a "length") and
    batch: per length (in the keys' order), per increasing batch, every key of that length.  After
    an OOM of a key its larger batches are marked, not run; past the budget, "skipped".
    `on_row(rows)` runs after every row (the caller saves what it has)."""
    rows = []
    failed_at = {}
    lengths = list(dict.fromkeys(key["length"] for key in keys))
    for length in lengths:
        for batch in sorted(batches):
            for index, key in enumerate(keys):
                if key["length"] != length:
                    continue
                row = {**key, "batch": batch}
                if index in failed_at:
                    row["status"] = f"OOM (batch {failed_at[index]} did)"
                elif time.perf_counter() - started > budget_s:
                    row["status"] = "skipped (time budget)"
                else:
                    try:
                        row.update(measure(**key, batch=batch))
                    except Exception as error:  # noqa: BLE001 - OOM of either tier is a result
                        if not is_oom(error):
                            raise
                        failed_at[index], row["status"] = batch, "OOM"
                        if torch.cuda.is_available():
                            torch.cuda.empty_cache()
                rows.append(row)
                print(json.dumps(row), flush=True)
                if on_row is not None:
                    on_row(rows)
    return rows


def plot(results: dict, path: str) -> str:
    """Decode tokens/s vs batch (one panel per length, a line per mode) and H2D MiB per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in results["decode"]})
    modes = list(dict.fromkeys(r["mode"] for r in results["decode"]))
    fig, axes = plt.subplots(2, len(lengths), figsize=(4.2 * len(lengths), 7), squeeze=False)
    for col, length in enumerate(lengths):
        for mode in modes:
            ok = [
                r for r in results["decode"] if r["length"] == length and r["mode"] == mode and r.get("status") == "ok"
            ]
            if ok:
                axes[0, col].plot([r["batch"] for r in ok], [r["tokens_per_s"] for r in ok], "o-", label=mode)
                axes[1, col].plot(
                    [r["batch"] for r in ok], [r["h2d_bytes_per_step"] / 2**20 for r in ok], "o-", label=mode
                )
        axes[0, col].set_title(f"context {length // 1024}K tokens" if length >= 1024 else f"context {length} tokens")
        for row, label in ((0, "decode tokens/s"), (1, "H2D MiB per decode step")):
            ax = axes[row, col]
            ax.set_xscale("log", base=2)
            ax.set_xticks(results["batches"], [str(b) for b in results["batches"]])
            ax.set_xlabel("batch")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[1, col].set_yscale("symlog", linthresh=0.1)
        axes[1, col].set_ylim(bottom=0)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"{results['model']}\non {results['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def tokens_label(length: int) -> str:
    return f"{length // 1024}K" if length >= 1024 and length % 1024 == 0 else str(length)


def summarize(results: dict) -> None:
    """Fill results' hidden_share and the headline numbers gpu_check shows from what is measured so
    far: the hidden share and speed-ups at the longest context, gather GB/s, and per decode cell
    tokens/s and host syncs per step."""
    results["hidden_share"] = hidden_shares(results.get("decode", []))
    longest = max(results["lengths"])  # the goals are at the longest context
    summary = {
        f"{tokens_label(longest)} b{e['batch']} {k}": round(v, 3)
        for e in results["hidden_share"]
        if e["length"] == longest
        for k, v in e.items()
        if isinstance(v, float)
    }
    summary.update({k: round(v, 2) for k, v in results.get("gather", {}).items() if k.endswith("GBps")})
    for r in results.get("decode", []):
        if r.get("status") == "ok":
            cell = f"{tokens_label(r['length'])} b{r['batch']} {r['mode']}"
            summary[f"{cell} tok/s"] = round(r["tokens_per_s"], 2)
            if r.get("syncs_per_step") is not None:
                summary[f"{cell} syncs/step"] = r["syncs_per_step"]
    results["summary"] = summary


def save(results: dict, out: str, started: float) -> None:
    """Write results (with the summary so far) to `out`, atomically."""
    from forecastkv.atomic import write_text_atomic

    summarize(results)
    results["seconds"] = time.perf_counter() - started
    write_text_atomic(out, json.dumps(results, indent=1))


def _mode_spec(text: str) -> str:
    try:
        split_mode(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def main(argv=None) -> dict:
    from forecastkv.inference import MODES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument(
        "--modes",
        nargs="+",
        type=_mode_spec,
        default=[*MODES, *EXTRA_MODES],
        help=f"runtime modes {MODES}, or MODE:SELECTOR for another registered selector (default: every mode and "
        f"{', '.join(EXTRA_MODES)})",
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="no new (length, mode, batch) cell starts after this many seconds (default: the config's)",
    )
    parser.add_argument("--no-prefill", action="store_true", help="do not time prefill (it runs last otherwise)")
    parser.add_argument(
        "--prefill-lengths",
        type=int,
        nargs="+",
        default=None,
        help="prefill cells at these lengths (default --lengths)",
    )
    parser.add_argument(
        "--prefill-batches",
        type=int,
        nargs="+",
        default=None,
        help="prefill cells at these batches (default --batches)",
    )
    parser.add_argument(
        "--prefill-budget-s",
        type=float,
        default=None,
        help="no prefill cell starts after this many seconds (default --budget-s); its first call may compile",
    )
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    parser.add_argument(
        "--out",
        "--json",
        dest="out",
        default=None,
        help="JSON path (the PNG goes beside it); default benchmarks/results/decode_sweep_<config>.json",
    )
    args = parser.parse_args(argv)
    shape, preset, dtype, lengths, batches, budget = CONFIGS[args.config]
    lengths, batches, budget = args.lengths or lengths, args.batches or batches, args.budget_s or budget
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.config.startswith("gpu") and device.type != "cuda":
        raise SystemExit(f"--config {args.config} needs a CUDA device (this machine has none); use --config cpu")
    out = args.out or os.path.join(HERE, "results", f"decode_sweep_{args.config}.json")

    started = time.perf_counter()
    model = build_model(shape, preset, device, dtype)
    name = (
        f"{ {id(SMOLLM2_135M): 'SmolLM2-135M', id(MINICPM41_8B): 'MiniCPM4.1-8B'}.get(id(shape), 'tiny') }-shaped "
        f"random {str(dtype).split('.')[-1]}, preset {preset}"
    )
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(
        f"{name} on {device_name}: lengths {lengths}, batches {batches}, modes {args.modes}, budget {budget:.0f} s",
        flush=True,
    )
    results = {
        "config": args.config,
        "model": name,
        "device": device_name,
        "lengths": lengths,
        "batches": batches,
        "modes": args.modes,
        "budget_s": budget,
        "complete": False,
        "command": "python benchmarks/decode_sweep.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    torch.manual_seed(0)
    grid = [{"length": n, "mode": m} for n in lengths for m in args.modes]

    def keep(key):
        def on_row(rows):
            results[key] = rows
            save(results, out, started)

        return on_row

    results["decode"] = sweep(
        grid,
        batches,
        lambda length, mode, batch: run_config(model, mode, batch, length, args, device),
        started,
        budget,
        on_row=keep("decode"),
    )
    with torch.no_grad():
        results["gather"] = gather_bandwidth(device, dtype, tiny=device.type != "cuda")
    save(results, out, started)
    if not args.no_prefill:
        caches = [
            {"length": n, "cache": c}
            for n in (args.prefill_lengths or lengths)
            for c in ("resident", "forecast-offload")
        ]
        results["prefill"] = sweep(
            caches,
            args.prefill_batches or batches,
            lambda length, cache, batch: prefill_rate(
                model, batch, length, None if cache == "resident" else cache, device
            ),
            started,
            budget if args.prefill_budget_s is None else args.prefill_budget_s,
            on_row=keep("prefill"),
        )
    results["complete"] = True
    save(results, out, started)
    png = None
    if not args.no_plot:
        try:
            png = plot(results, os.path.splitext(out)[0] + ".png")
        except ImportError as error:  # the JSON is written; a machine without matplotlib gets no PNG
            print(f"no PNG: {error}", flush=True)
    print(
        f"\n{'length':>7} {'mode':<36} {'batch':>5} {'status':<22} {'tok/s':>9} {'H2D MiB/step':>13} {'syncs/step':>10}"
    )
    for r in results["decode"]:
        ok = r.get("status") == "ok"
        syncs = r.get("syncs_per_step") if ok else None
        print(
            f"{r['length']:>7} {r['mode']:<36} {r['batch']:>5} {r['status']:<22} "
            f"{r['tokens_per_s'] if ok else float('nan'):>9.2f} "
            f"{r['h2d_bytes_per_step'] / 2**20 if ok else float('nan'):>13.3f} "
            f"{'-' if syncs is None else syncs:>10}"
        )
    for r in results.get("prefill", []):
        if r.get("status") == "ok":
            print(f"prefill {r['length']:>7} {r['cache']:<17} batch {r['batch']}: {r['tokens_per_s']:.0f} tokens/s")
    for entry in results["hidden_share"]:
        parts = [f"{k}={v:.3f}" for k, v in entry.items() if isinstance(v, float)]
        print(f"length {entry['length']} batch {entry['batch']}: {', '.join(parts) or 'n/a'}")
    g = results["gather"]
    print(
        f"block gather {g['gather_GBps']:.2f} GB/s vs pinned copy {g['pinned_copy_GBps']:.2f} GB/s "
        f"({g['bytes'] / 2**20:.1f} MiB)"
    )
    print(f"wrote {out}{'' if png is None else f' and {png}'} ({results['seconds']:.0f} s)", flush=True)
    return results


if __name__ == "__main__":
    main()
