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


def load_model(base: str):
    from transformers import AutoTokenizer

    from forecastkv import ForecastKVForCausalLM
    from forecastkv.bundled import resolve_model_path

    path = resolve_model_path(base)
    model = ForecastKVForCausalLM.from_pretrained(path).float().eval()
    return model, AutoTokenizer.from_pretrained(path)


def knee(means: dict[int, float]) -> int:
    """The knee of mean recall against the anchor count (Kneedle, Satopaa et al. 2011): both axes
    scaled to [0, 1] over the sweep, the count farthest above the chord from the first to the last."""
    counts = sorted(means)
    (x0, x1), (y0, y1) = (counts[0], counts[-1]), (means[counts[0]], means[counts[-1]])
    if x1 == x0 or y1 == y0:
        return counts[0]
    return max(counts, key=lambda c: (means[c] - y0) / (y1 - y0) - (c - x0) / (x1 - x0))


def report(recall: torch.Tensor, overlap: torch.Tensor, counts, args, seconds: float, rows: int) -> str:
    from forecastkv.eval.reuse_anchors import anchors_score, pick_anchors

    layers = recall.shape[0]
    every = list(range(layers))
    ceiling, ceiling_overlap = anchors_score(recall, every) / layers, anchors_score(overlap, every) / layers
    chosen = {count: pick_anchors(recall, count) for count in counts}
    means = {count: anchors_score(recall, anchors) / layers for count, anchors in chosen.items()}
    overlaps = {count: anchors_score(overlap, anchors) / layers for count, anchors in chosen.items()}
    best = knee(means)
    tokens = args.budget * args.block_size
    lines = [
        "# Reuse anchors (Kascade) on SmolLM2-135M",
        "",
        f"Command: `python benchmarks/reuse_anchors.py {' '.join(sys.argv[1:])}`, {seconds:.0f} s on this CPU.",
        "",
        f"Geometry: preset `{args.sparse_config}`, budget {args.budget} blocks of {args.block_size} tokens "
        f"({tokens} tokens, {tokens / args.length:.1%} of {args.length}; init and local included).",
        f"Data: {rows} windows of {args.length} tokens from the bundled essays' `{args.split}` split, "
        f"rows t >= {tokens}; dense backbone.",
        "Mean recall: the share of each layer's oracle mass (its own top-budget blocks by true attention) that "
        "the blocks of its anchor hold, averaged over the layers (layer 0 included), KV heads and rows; "
        "overlap: the share of those oracle blocks the anchor's blocks include; missed mass: 1 - recall.  "
        "Anchors are picked by mass recall (`pick_anchors`, exact).",
        "",
        "| anchors | layers | mean recall | missed mass vs the query selector's | mean overlap |",
        "|---:|---|---:|---:|---:|",
    ]
    for count in counts:
        missed = (1 - means[count]) / (1 - ceiling)
        lines.append(f"| {count} | {chosen[count]} | {means[count]:.4f} | {missed:.2f}x | {overlaps[count]:.3f} |")
    lines.append(f"| {layers} (query selector) | every layer | {ceiling:.4f} | 1.00x | {ceiling_overlap:.3f} |")
    lines += [
        "",
        f"Knee (Kneedle over counts {list(counts)}): **{best} anchors**, {chosen[best]}.",
        "",
        "Per layer, own query R[l, l] and reused R[a(l), l] with the knee's anchors (mass recall, overlap):",
        "",
        "| layer | own recall | reused recall | own overlap | reused overlap |",
        "|---:|---:|---:|---:|---:|",
    ]
    served = 0
    for layer in range(layers):
        served = layer if layer in chosen[best] else served
        lines.append(
            f"| {layer} | {recall[layer, layer]:.3f} | {recall[served, layer]:.3f} "
            f"| {overlap[layer, layer]:.3f} | {overlap[served, layer]:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from forecastkv.eval.reuse_anchors import anchor_recall_matrices, planning_geometry, planning_sequences

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
    args.block_size = planning_geometry(args.sparse_config, args.budget, args.length)["block_size"]

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    ids = planning_sequences(tokenizer, args.length, args.sequences, args.split)
    began = time.perf_counter()
    start = args.budget * args.block_size  # the first row whose visible blocks exceed the budget
    recall, overlap = anchor_recall_matrices(model, ids, start, args.budget, sparse=args.sparse_config)
    text = report(recall, overlap, args.counts, args, time.perf_counter() - began, ids.shape[0])
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
