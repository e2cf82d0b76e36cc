"""The selector study's cells as the quality claims issue 38 asks for: one record per cell with its
selector, the teacher its Forecast heads were trained on, length, budget, prefetch, recall of the
oracle's attention mass, and the needle's accuracy with a 95% Wilson interval.

    python benchmarks/quality_summary.py --study selector=runs/study-selector attention=runs/study-attention \
        selector:3=runs/study-selector-3v --out benchmarks/results/quality

Each `--study TEACHER[:VECTORS]=DIR` is a `forecastkv study --out DIR` run whose `forecast` and
`quest-forecast` cells used heads trained with objective.teacher TEACHER and VECTORS Forecast vectors
per KV head (forecast.heads_per_group; default 1); cells of selectors that use no heads (query,
quest, dense, ...) are kept once, from the first study that has them.  Each `--suite DIR` is a
`forecastkv quality --out DIR` run (committed as benchmarks/results/quality/suite-*): its cells follow
the study's, with `task`, `examples` and `successes` and `source` the suite's folder name (its
held-out text's bytes a step and perplexity ratio joined to each task cell of the same selector).  Writes
OUT/summary.json (a list of records) and OUT/summary.md (a table per length, then the suites').

    python benchmarks/quality_summary.py --rebuild benchmarks/results/quality/suite-*

rewrites each suite folder's summary.json, summary.md and plot from its records (`results.rank0.jsonl`) with
the summary's present fields (`forecastkv/eval/suite_report.py`: bootstrap intervals, paired differences),
keeping its perplexity cells, heads and setup lines, without the model.

What the numbers are: `recall_mass` is the study's (the share of the oracle's attention mass the
selected blocks hold, over `recall_rows` (decode step, layer >= 1, KV head) rows of one held-out text);
`accuracy` is the needle's answer tokens predicted under teacher forcing, over `trials` tokens of one
needle, so its interval is over tokens of one example, not over independent examples.  A suite
record's `accuracy` is the share of `examples` independent examples answered whole (string match),
its interval over them; its `recall_mass` is over the answer's decode rows of those examples.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# selectors that score with the Forecast heads
HEADED = ("forecast", "quest-forecast", "maxkey-forecast", "forecast-carry", "quest-forecast-carry")


def parse_studies(items: list[str]) -> list[tuple[str, int, Path]]:
    """(teacher, vectors per KV head, cells.json) per `TEACHER[:VECTORS]=DIR`."""
    studies = []
    for item in items:
        heads, sep, folder = item.partition("=")
        teacher, _, vectors = heads.partition(":")
        if not sep or not teacher or not folder:
            raise SystemExit(f"--study takes TEACHER[:VECTORS]=DIR, got {item!r}")
        if vectors and not (vectors.isdigit() and int(vectors) >= 1):
            raise SystemExit(f"--study {item!r}: VECTORS must be a positive integer, got {vectors!r}")
        cells = Path(folder) / "cells.json"
        if not cells.is_file():
            raise SystemExit(f"{cells} does not exist: run `forecastkv study --out {folder}` first")
        studies.append((teacher, int(vectors or 1), cells))
    return studies


def record(cell: dict, teacher: str | None, vectors: int = 1) -> dict:
    """One summary record of a study cell."""
    from forecastkv.eval.metrics import wilson_interval

    trials = int(cell.get("tail_tokens") or 0)
    accuracy = cell.get("needle_accuracy")
    interval = None
    if accuracy is not None and trials:
        interval = [round(x, 4) for x in wilson_interval(round(accuracy * trials), trials)]
    return {
        "selector": cell["selector"],
        "teacher": teacher if cell["selector"] in HEADED else None,
        "vectors": vectors if cell["selector"] in HEADED else None,
        "length": cell["length"],
        "budget": cell["budget_blocks"],
        "top_p": cell.get("p"),
        "prefetch": cell.get("prefetch"),
        "recall_mass": None if cell.get("recall_mass") is None else round(cell["recall_mass"], 4),
        "recall_rows": cell.get("recall_rows"),
        "accuracy": accuracy,
        "trials": trials,
        "interval": interval,
        "h2d_bytes_per_step": cell.get("h2d_bytes_per_step"),
        "ppl_ratio": None if cell.get("ppl_ratio") is None else round(cell["ppl_ratio"], 4),
    }


def summarise(studies: list[tuple[str, Path]]) -> list[dict]:
    records, seen = [], set()
    for teacher, vectors, cells in studies:
        for cell in json.loads(cells.read_text()):
            if cell.get("skipped"):
                continue
            key = (cell["selector"], cell["length"], cell["budget_blocks"], cell.get("p"))
            if cell["selector"] in HEADED:
                key = (*key, teacher, vectors)
            if key in seen:
                continue
            seen.add(key)
            records.append(record(cell, teacher, vectors))
    return sorted(
        records,
        key=lambda r: (r["length"], r["budget"], r["top_p"] or 0, r["selector"], r["teacher"] or "", r["vectors"] or 0),
    )


SUITE_FIELDS = ("selector", "teacher", "vectors", "length", "budget", "prefetch", "recall_mass", "recall_interval",
                "recall_vs_query", "accuracy", "interval", "score", "score_interval", "vs_dense", "task", "examples",
                "successes", "h2d_bytes_per_step", "ppl_ratio")


def suite_records(folders: list[str]) -> list[dict]:
    """The cells of `forecastkv quality` runs (each folder's summary.json), in the order given."""
    records = []
    for folder in folders:
        summary = Path(folder) / "summary.json"
        if not summary.is_file():
            raise SystemExit(f"{summary} does not exist: run `forecastkv quality --out {folder}` first")
        cells = [cell for cell in json.loads(summary.read_text()) if not cell.get("skipped")]
        # the held-out text's cells give their selector's bytes a step and perplexity ratio
        heldout = {(c["length"], c["selector"], c["budget"]): c for c in cells if c["task"] == "perplexity"}
        for cell in cells:
            if cell["task"] == "perplexity":
                continue
            text = heldout.get((cell["length"], cell["selector"], cell["budget"]), {})
            cell = {**cell, **{name: cell.get(name) if cell.get(name) is not None else text.get(name)
                               for name in ("h2d_bytes_per_step", "ppl_ratio")}}
            kept = {name: cell.get(name) for name in SUITE_FIELDS}
            kept["budget"] = kept["budget"] or (cell["length"] // 64 if cell["selector"] == "dense" else None)
            for name in ("recall_mass", "ppl_ratio"):
                kept[name] = None if kept[name] is None else round(kept[name], 4)
            for name in ("interval", "score_interval", "recall_interval"):
                kept[name] = None if kept[name] is None else [round(x, 4) for x in kept[name]]
            records.append({**kept, "source": Path(folder).name})
    return records


def _span(pair, digits: int = 4) -> str:
    return "" if pair is None else f" [{pair[0]:.{digits}f}, {pair[1]:.{digits}f}]"


def markdown(records: list[dict]) -> str:
    lines = ["# Selector quality by teacher (benchmarks/quality_summary.py)", ""]
    suites = [r for r in records if r.get("source")]
    records = [r for r in records if not r.get("source")]
    for length in sorted({r["length"] for r in records}):
        lines += [
            f"## {length} tokens",
            "",
            "| selector | teacher | vectors | budget | top-p | prefetch | recall (mass) | needle acc [95% CI] "
            "| ppl ratio |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in records if r["length"] == length):
            low, high = r["interval"] or (None, None)
            interval = "-" if low is None else f"{r['accuracy']:.2f} [{low:.2f}, {high:.2f}]"
            recall = "-" if r["recall_mass"] is None else f"{r['recall_mass']:.4f}"
            lines.append(
                f"| {r['selector']} | {r['teacher'] or '-'} | {r['vectors'] or '-'} | {r['budget']} | "
                f"{r['top_p'] or '-'} | "
                f"{'-' if r['prefetch'] is None else ('yes' if r['prefetch'] else 'no')} | {recall} | {interval} | "
                f"{'-' if r['ppl_ratio'] is None else r['ppl_ratio']} |"
            )
        lines.append("")
    if suites:
        lines += ["## The suite's cells (independent examples, `forecastkv quality`)", "",
                  "| source | task | length | selector | budget | prefetch | recall (mass) [95%] | - query, paired "
                  "| accuracy [95% CI] | score - dense, paired |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in suites:
            low, high = r["interval"]
            recall = "-" if r["recall_mass"] is None else f"{r['recall_mass']:.4f}{_span(r.get('recall_interval'))}"
            prefetch = "yes" if r["prefetch"] else "no" if r["selector"] != "dense" else "-"
            gain, versus = r.get("recall_vs_query"), r.get("vs_dense")
            gain = "-" if gain is None else f"{gain['recall']:+.4f}{_span(gain['interval'])}"
            versus = "-" if versus is None else f"{versus['score']:+.2f}{_span(versus['interval'], 2)}"
            lines.append(f"| {r['source']} | {r['task']} | {r['length']} | {r['selector']} | {r['budget'] or '-'} | "
                         f"{prefetch} | {recall} | {gain} | {r['successes']}/{r['examples']} = {r['accuracy']:.2f} "
                         f"[{low:.2f}, {high:.2f}] | {versus} |")
        lines.append("")
    return "\n".join(lines)


def rebuild(folder: Path) -> list[Path]:
    """A suite folder's summary from its records (see the module's docstring)."""
    from forecastkv.eval.suite import RECORDS
    from forecastkv.eval.suite_report import PERPLEXITY, SUMMARY_FIELDS, summarize, write_summary

    old = json.loads((folder / "summary.json").read_text())
    records = [json.loads(line) for line in (folder / RECORDS).read_text().splitlines() if line.strip()]
    modes = {c["mode"] for c in old if c["task"] != PERPLEXITY}  # the run's cells (the records may hold more)
    records = [r for r in records if r["mode"] in modes]
    headed = next((c for c in old if c.get("teacher") or c.get("vectors")), {})
    cells = summarize(records, [], {"teacher": headed.get("teacher"), "vectors": headed.get("vectors")})
    heldout = [{**dict.fromkeys(SUMMARY_FIELDS), **c} for c in old if c["task"] == PERPLEXITY]
    measured = {(c["length"], c["selector"], c["budget"]): c for c in heldout}
    for cell in cells:  # each task cell's bytes a step: its selector's on the held-out text, as the run joined them
        text = measured.get((cell["length"], cell["selector"], cell["budget"]), {})
        cell.update({name: text.get(name) for name in ("h2d_bytes_per_step", "hit_rate", "offload_mode")})
    cells += heldout
    report = (folder / "summary.md").read_text().splitlines()
    setup = [line[2:] for line in report[: report.index("## Tasks")] if line.startswith("- ")]
    setup = [line for line in setup if not line.startswith("summary rebuilt")]
    setup.append("summary rebuilt from these records by `benchmarks/quality_summary.py --rebuild` (intervals added)")
    heading = next(line for line in report if line.startswith("## Held-out perplexity ("))
    tokens = int(heading.split("(")[1].split()[0])
    name = next(line for line in setup if line.startswith("model: "))[len("model: "):].split(";")[0]
    return write_summary(cells, folder, setup, tokens, f"{name}: accuracy against H2D bytes per decode step")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rebuild", nargs="+", metavar="DIR", help="rewrite these suite folders' summaries, then stop")
    parser.add_argument("--study", nargs="+", help="TEACHER[:VECTORS]=DIR of a `forecastkv study` run")
    parser.add_argument("--suite", nargs="*", default=[], help="DIR of a `forecastkv quality` run (its summary.json)")
    parser.add_argument("--out", default="benchmarks/results/quality", help="where summary.json and summary.md go")
    args = parser.parse_args(argv)
    if args.rebuild:
        for folder in args.rebuild:
            print(f"rebuilt {', '.join(map(str, rebuild(Path(folder))))}")
        return 0
    if not args.study:
        parser.error("--study is required (or --rebuild)")
    records = summarise(parse_studies(args.study)) + suite_records(args.suite)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from forecastkv.atomic import write_text_atomic

    write_text_atomic(out / "summary.json", json.dumps(records, indent=1))
    write_text_atomic(out / "summary.md", markdown(records))
    print(markdown(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
