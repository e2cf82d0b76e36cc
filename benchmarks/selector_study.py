"""The selector study in full on the bundled SmolLM2-135M: six selectors x budgets x top-p x lengths.

    PYTHONPATH=. python benchmarks/selector_study.py              # 2K/4K/8K, budgets 8 16 32, p 0.8 0.9 0.95
    PYTHONPATH=. python benchmarks/selector_study.py --heads runs/forecast-8k   # heads trained at 8K
    PYTHONPATH=. python benchmarks/selector_study.py --lengths 2048 --tail 8    # a shorter run

Per cell (`forecastkv/eval/study.py`, its docstring is the protocol): recall against the oracle,
held-out perplexity against dense, needle accuracy, and H2D bytes per decode step and slot hit rate
in the offloaded runtime (forecast-offload for a selector that knows its blocks a layer ahead, else
sparse-offload).  Measures into `<out>/cells.json` after every cell, so a killed run resumes where it
stopped; then writes `<out>/report.md` (the table, with this run's wall time and machine), one
`pareto_<length>.png` per length, `recall.png` and `records.json` (`forecastkv/eval/study_report.py`).
The Forecast heads are --heads, else runs/demo/heads (what `forecastkv demo` trains) when it exists;
without heads the forecast cells are skipped with the reason.  Not part of `make test`: its small
version is `forecastkv study --small`.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

from forecastkv.eval.study import StudySpec, load_study_model, run_study
from forecastkv.eval.study_report import write_study_report
from forecastkv.modes import SELECTORS

RESULTS = Path(__file__).resolve().parent / "results" / "selector_study"
MODEL = "SmolLM2-135M (bundled)"


def machine() -> str:
    """The machine the wall time was measured on, in a few words."""
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32], help="blocks, init and local included")
    parser.add_argument("--top-p", type=float, nargs="*", default=[0.8, 0.9, 0.95])
    parser.add_argument("--selectors", nargs="+", choices=SELECTORS, default=list(SELECTORS))
    parser.add_argument("--tail", type=int, default=StudySpec.tail_tokens, help="decode steps scored per length")
    parser.add_argument("--heads", default=None, help="Forecast heads (a train-forecast output directory)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    spec = StudySpec(
        lengths=args.lengths,
        budgets=args.budgets,
        top_p=args.top_p,
        selectors=args.selectors,
        tail_tokens=args.tail,
        heads_dir=args.heads,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    model, tokenizer, spec = load_study_model(spec)
    records = run_study(model, tokenizer, spec, out=args.out / "cells.json", progress=True)
    wall = time.perf_counter() - began
    timing = f"wall time of this run: {wall:.0f} s (load, prefills, cells; resumed cells cost nothing) on {machine()}"
    paths = write_study_report(records, args.out, model=MODEL, timing=timing)
    print(f"{len(records)} cells, {timing}", file=sys.stderr)
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
