"""`forecastkv forecast-recall`'s parser, which imports no torch, so `--help` answers at once; the
run is `recall.py:run`.

    forecastkv forecast-recall --forecast-weights runs/smollm2-135m-forecast --length 2048 --start 1024
    forecastkv forecast-recall --init next_query --heads-per-group 1      # an untrained init
"""

from __future__ import annotations

import argparse

from ..modes import BACKBONES

# query rows t >= DEFAULT_START are counted (the first blocks of a sequence select everything)
DEFAULT_START = 1024


REFERENCES = ("query", "oracle")  # whose blocks recall counts (`recall.measure_recall_counts`)


def build_parser(prog: str = "forecastkv forecast-recall") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Held-out forecast recall of saved (or freshly initialised) heads."
    )
    parser.add_argument(
        "--model", default="bundled:smollm2-135m", help="base checkpoint directory / hub id / bundled:<name>"
    )
    parser.add_argument(
        "--forecast-weights",
        default=None,
        help="a directory with forecast.safetensors (train-forecast output), or bundled:NAME (the shipped heads)",
    )
    parser.add_argument(
        "--init",
        default="next_query",
        choices=("next_query", "kaiming"),
        help="without --forecast-weights: heads to create",
    )
    parser.add_argument(
        "--heads-per-group",
        type=int,
        default=1,
        help="with --init: scoring vectors per KV group (1: one per group, as the trained heads)",
    )
    parser.add_argument(
        "--sparse-config",
        default=None,
        help="geometry both selectors use: a preset name or JSON (default: the saved heads', else smollm2-135m)",
    )
    parser.add_argument(
        "--topk", type=int, default=None, help="override the geometry's topk (the issue's SmolLM2 protocol: 12)"
    )
    parser.add_argument(
        "--source", default="bundled", help="held-out text: bundled (the packaged essays), a .txt/.jsonl path"
    )
    parser.add_argument("--split", default="heldout", help="the split of --source to read (heldout: not trained on)")
    parser.add_argument("--length", type=int, default=2048, help="T: tokens per held-out sequence")
    parser.add_argument("--start", type=int, default=DEFAULT_START, help="count query rows t >= start only")
    parser.add_argument("--sequences", type=int, default=None, help="at most this many sequences (default: all)")
    parser.add_argument(
        "--backbone",
        default="dense",
        choices=BACKBONES,
        help="what the layers attend with while the heads are scored (dense: full attention)",
    )
    parser.add_argument(
        "--reference",
        default="query",
        choices=REFERENCES,
        help="whose blocks recall counts: the query selector's (the selector teacher's target) or the oracle's, "
        "the top blocks of the true attention (the attention teacher's)",
    )
    parser.add_argument("--json", default=None, help="also write the report as JSON here")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (one is drawn on stderr, layer by layer)"
    )
    return parser
