"""`forecastkv study`: its options (`add_arguments`, wired in by `forecastkv/cli.py`) and its body (`run`):
the bundled model's selectors x budgets x lengths (`study.py`), then the report (`study_report.py`).
Importing this module imports no torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..modes import SELECTORS
from ..usage import check_heads_option, positive_int, probability


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The study command's options."""
    # defaults None: an option left out takes --small's value, else the study's (forecastkv/eval/study.py)
    parser.add_argument(
        "--lengths", type=positive_int, nargs="+", default=None, help="context lengths (2048 4096 8192)"
    )
    parser.add_argument(
        "--budgets",
        type=positive_int,
        nargs="+",
        default=None,
        help="fixed budgets in blocks of block_size tokens, init and local blocks included (8 16 32)",
    )
    parser.add_argument(
        "--top-p",
        type=probability,
        nargs="*",
        default=None,
        help="top-p masses in (0, 1], each capped at the largest budget (0.8 0.9 0.95; no value: no top-p cells)",
    )
    parser.add_argument("--selectors", nargs="+", choices=SELECTORS, default=None, help="selectors to run (all)")
    parser.add_argument("--tail", type=positive_int, default=None, help="decode steps scored at each length's end (32)")
    parser.add_argument(
        "--heads",
        default=None,
        metavar="DIR",
        help="Forecast heads for `forecast`: a directory or bundled:NAME "
        "(default: runs/demo/heads if there, else the shipped heads)",
    )
    parser.add_argument("--out", default="runs/study", metavar="DIR", help="where report.md, the plots and records go")
    parser.add_argument(
        "--small", action="store_true", help="1024 tokens, budgets 8 12, p 0.9, tail 8 (the options given win)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no line per measured cell")


# `forecastkv study --small`: one length of 16 blocks, two budgets below it (so top-p's cap still chooses), one p,
# a short tail
STUDY_SMALL = {"lengths": [1024], "budgets": [8, 12], "top_p": [0.9], "tail_tokens": 8}


def study_spec(args):
    """The StudySpec of `forecastkv study`'s options: each one given wins, else --small's, else the spec's default."""
    from .study import StudySpec

    given = {
        "lengths": args.lengths,
        "budgets": args.budgets,
        "top_p": args.top_p,
        "tail_tokens": args.tail,
        "selectors": args.selectors,
        "heads_dir": args.heads,
    }
    small = STUDY_SMALL if args.small else {}
    return StudySpec(**{**small, **{k: v for k, v in given.items() if v is not None}})


def run(args) -> int:
    """Load the bundled model (with --heads' Forecast heads), measure every cell into --out/cells.json
    (a rerun resumes), then write the report (report.md, plots, records.json) beside it."""
    import time

    from .study import load_study_model, run_study
    from .study_report import write_study_report

    spec = study_spec(args)  # a bad value fails here, before the model loads
    check_heads_option("--heads", args.heads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    model, tokenizer, spec = load_study_model(spec)
    records = run_study(model, tokenizer, spec, out=out / "cells.json", progress=not args.no_progress)
    paths = write_study_report(records, out, model="SmolLM2-135M (bundled)")
    print(f"study: {len(records)} cells in {time.perf_counter() - began:.0f} s; wrote {', '.join(map(str, paths))}")
    return 0
