"""Kascade-style anchor layers for the `reuse` selector on the bundled SmolLM2-135M, and the knee.

One recall matrix R (`eval.reuse_anchors.anchor_recall_matrix`: layer a's query selection against
layer l's oracle, rows t >= budget x block_size of held-out windows), then the exact best anchors
(`pick_anchors`) for each count and their mean recall over the layers.  Every layer its own anchor
(count = L) is the query selector itself: the ceiling reuse approaches.

    python benchmarks/reuse_anchors.py --out benchmarks/results/reuse_anchors.md
    python benchmarks/reuse_anchors.py --split heldout --sequences 4      # are the anchors stable?
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

COUNTS = (1, 2, 4, 6, 8)
KNEE_SHARE = 0.9  # the recommended count: the fewest anchors that close this share of the gap to count = L


def load_model(base: str):
    from transformers import AutoTokenizer

    from forecastkv import ForecastKVForCausalLM
    from forecastkv.bundled import resolve_model_path

    path = resolve_model_path(base)
    model = ForecastKVForCausalLM.from_pretrained(path).float().eval()
    return model, AutoTokenizer.from_pretrained(path)


def knee(means: dict[int, float], ceiling: float) -> int:
    """The fewest anchors whose mean recall closes KNEE_SHARE of the gap from one anchor to every layer."""
    floor = means[min(means)]
    for count in sorted(means):
        if means[count] - floor >= KNEE_SHARE * (ceiling - floor):
            return count
    return max(means)


def report(recall: torch.Tensor, counts, args, seconds: float, rows: int) -> str:
    from forecastkv.eval.reuse_anchors import anchors_score, pick_anchors

    layers = recall.shape[0]
    ceiling = anchors_score(recall, list(range(layers))) / layers
    chosen = {count: pick_anchors(recall, count) for count in counts}
    means = {count: anchors_score(recall, anchors) / layers for count, anchors in chosen.items()}
    best = knee(means, ceiling)
    lines = [
        "# Reuse anchors (Kascade) on SmolLM2-135M",
        "",
        f"Command: `python benchmarks/reuse_anchors.py {' '.join(sys.argv[1:])}`, {seconds:.0f} s on this CPU.",
        "",
        f"Geometry: preset `{args.sparse_config}`, budget {args.budget} blocks of 64 tokens "
        f"({args.budget * 64} tokens, {args.budget * 64 / args.length:.1%} of {args.length}; init and local included).",
        f"Data: {rows} windows of {args.length} tokens from the bundled essays' `{args.split}` split, "
        f"rows t >= {args.budget * 64}; dense backbone.",
        "Mean recall: the share of each layer's oracle mass (its own top-budget blocks by true attention) that "
        "the blocks of its anchor hold, averaged over the layers (layer 0 included), KV heads and rows.",
        "",
        "| anchors | layers | mean recall | of the ceiling |",
        "|---:|---|---:|---:|",
    ]
    for count in counts:
        lines.append(f"| {count} | {chosen[count]} | {means[count]:.3f} | {means[count] / ceiling:.1%} |")
    lines.append(f"| {layers} (query selector) | every layer | {ceiling:.3f} | 100.0% |")
    lines += [
        "",
        f"Recommended: **{best} anchors**, {chosen[best]} (the fewest that close {KNEE_SHARE:.0%} of the gap "
        "from one anchor to every layer).",
        "",
        "Per layer, R[l, l] (own query) and R[a(l), l] with the recommended anchors:",
        "",
        "| layer | own query | reused |",
        "|---:|---:|---:|",
    ]
    served = 0
    for layer in range(layers):
        served = layer if layer in chosen[best] else served
        lines.append(f"| {layer} | {recall[layer, layer]:.3f} | {recall[served, layer]:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from forecastkv.eval.reuse_anchors import anchor_recall_matrix, planning_sequences

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bundled:smollm2-135m")
    parser.add_argument("--sparse-config", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=16, help="budget in blocks, init and local included")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--split", default="train")
    parser.add_argument("--counts", type=int, nargs="+", default=list(COUNTS))
    parser.add_argument("--out", default=None, help="write the Markdown report here")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    ids = planning_sequences(tokenizer, args.length, args.sequences, args.split)
    began = time.perf_counter()
    recall = anchor_recall_matrix(model, ids, args.budget * 64, args.budget, sparse=args.sparse_config)
    text = report(recall, args.counts, args, time.perf_counter() - began, ids.shape[0])
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
