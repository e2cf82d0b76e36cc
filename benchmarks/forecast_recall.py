"""Held-out forecast recall of several head sets side by side, and perplexity forecast vs query.

The recall protocol is `training.recall.forecast_recall` (rows t >= start, layers >= 1, chance beside);
every head set runs on the same held-out sequences and geometry.

    python benchmarks/forecast_recall.py --heads init:next_query:1 runs/smollm2-135m-forecast \\
        runs/smollm2-135m-forecast-3v --length 2048 --start 1024 --topk 12 --out results/recall-2048.md
    python benchmarks/forecast_recall.py --heads runs/smollm2-135m-forecast --perplexity --length 4096 --topk 12

A head set is a directory with forecast.safetensors, or init:<next_query|kaiming>:<vectors per group>.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch


def load_heads(spec: str, base: str, sparse: dict):
    from forecastkv.training.recall import load_for_recall

    if spec.startswith("init:"):
        _, init, per_group = spec.split(":")
        return load_for_recall(base, None, sparse, init, int(per_group))
    return load_for_recall(base, spec, sparse)


@torch.no_grad()
def perplexity(model, sequences: torch.Tensor, selector: str) -> float:
    """exp(mean next-token loss) over sequences [N, T], the sparse backbone routed by `selector`."""
    saved = model.config.sparse_config
    model.config.sparse_config = {**saved, "selector": selector}
    try:
        total, count = 0.0, 0
        for row in sequences:
            ids = row.view(1, -1)
            out = model(ids, labels=ids, use_cache=False)
            total += float(out.loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    finally:
        model.config.sparse_config = saved
    return math.exp(total / count)


def main(argv: list[str] | None = None) -> int:
    from forecastkv.training.recall import (
        BACKBONES,
        RecallProtocol,
        forecast_recall,
        heldout_sequences,
        resolve_geometry,
    )

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", nargs="+", required=True)
    parser.add_argument("--model", default="bundled:smollm2-135m")
    parser.add_argument("--sparse-config", default="smollm2-135m")
    parser.add_argument("--topk", type=int, default=None)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--start", type=int, default=1024)
    parser.add_argument("--sequences", type=int, default=None)
    parser.add_argument("--backbone", default="dense", choices=BACKBONES)
    parser.add_argument(
        "--perplexity", action="store_true", help="instead of recall: perplexity forecast vs query (sparse backbone)"
    )
    parser.add_argument("--out", default=None, help="write the Markdown table (and a .json beside it)")
    args = parser.parse_args(argv)

    sparse = resolve_geometry(args.sparse_config, None, args.topk)
    protocol = RecallProtocol(length=args.length, start=args.start, sequences=args.sequences, backbone=args.backbone)
    lines, results = [], {}
    if args.perplexity:
        lines += [
            "| heads | perplexity (query selector) | perplexity (forecast selector) | change |",
            "|---|---|---|---|",
        ]
    for spec in args.heads:
        model, tokenizer, _ = load_heads(spec, args.model, sparse)
        sequences = heldout_sequences(protocol, tokenizer)
        started = time.time()
        if args.perplexity:
            query, forecast = perplexity(model, sequences, "query"), perplexity(model, sequences, "forecast")
            results[spec] = {
                "query": query,
                "forecast": forecast,
                "sequences": sequences.shape[0],
                "seconds": time.time() - started,
            }
            lines.append(f"| {spec} | {query:.3f} | {forecast:.3f} | {100 * (forecast / query - 1):+.2f}% |")
        else:
            report = forecast_recall(model, sequences, args.start, args.backbone)
            results[spec] = {**report.to_dict(), "seconds": time.time() - started}
        print(
            f"{spec}: {json.dumps({k: v for k, v in results[spec].items() if not isinstance(v, list)})}",
            file=sys.stderr,
        )
    if not args.perplexity:
        specs = list(results)
        lines += ["| layer | " + " | ".join(specs) + " | chance |", "|---" * (len(specs) + 2) + "|"]
        layers = len(next(iter(results.values()))["recall"])
        chance = next(iter(results.values()))["chance"]
        for layer in range(layers):
            lines.append(
                f"| {layer} | "
                + " | ".join(f"{results[s]['recall'][layer]:.3f}" for s in specs)
                + f" | {chance[layer]:.3f} |"
            )
        lines.append(
            "| mean (>= 1) | "
            + " | ".join(f"**{results[s]['mean_recall']:.3f}**" for s in specs)
            + f" | {results[specs[0]]['mean_chance']:.3f} |"
        )
    geometry = json.dumps(
        {k: sparse[k] for k in ("kernel_size", "kernel_stride", "block_size", "init_blocks", "window_size", "topk")}
    )
    what = (
        "sparse backbone, every next-token loss"
        if args.perplexity
        else f"rows t >= {args.start}, {args.backbone} backbone"
    )
    title = f"T = {args.length}, {what}, geometry {geometry}"
    table = title + "\n\n" + "\n".join(lines) + "\n"
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table)
        out.with_suffix(".json").write_text(
            json.dumps({"protocol": protocol.__dict__, "sparse_config": sparse, "results": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
