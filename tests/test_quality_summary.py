"""benchmarks/quality_summary.py: study cells become one record per cell and teacher, with the needle's
Wilson interval; head-free selectors are kept once, headed ones per teacher."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("quality_summary", ROOT / "benchmarks" / "quality_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cell(selector, accuracy, recall=0.9, **more):
    return {"selector": selector, "length": 2048, "budget_blocks": 16, "p": None, "prefetch": selector != "query",
            "recall_mass": recall, "recall_rows": 696, "needle_accuracy": accuracy, "tail_tokens": 8,
            "ppl_ratio": 1.01, **more}  # fmt: skip


def test_records_per_teacher_with_intervals(tmp_path):
    qs = load()
    for teacher, recall in (("selector", 0.92), ("attention", 0.95)):
        folder = tmp_path / teacher
        folder.mkdir()
        cells = [cell("query", 0.875), cell("forecast", 1.0, recall), cell("quest", 0.5, skipped="no heads")]
        (folder / "cells.json").write_text(json.dumps(cells))
    # the same teacher with 3 vectors per KV head: its headed cells are records of their own
    three = tmp_path / "selector3"
    three.mkdir()
    (three / "cells.json").write_text(json.dumps([cell("query", 0.5), cell("forecast", 1.0, 0.97)]))
    studies = [f"{teacher}={tmp_path / teacher}" for teacher in ("selector", "attention")]
    records = qs.summarise(qs.parse_studies([*studies, f"selector:3={three}"]))
    assert [(r["selector"], r["teacher"], r["vectors"], r["recall_mass"]) for r in records] == [
        ("forecast", "attention", 1, 0.95), ("forecast", "selector", 1, 0.92), ("forecast", "selector", 3, 0.97),
        ("query", None, None, 0.9),
    ]
    query = records[-1]
    assert query["trials"] == 8 and query["interval"] == pytest.approx([0.5291, 0.9776], abs=1e-4)  # 7 of 8
    assert "| forecast | attention | 1 | 16 |" in qs.markdown(records)
    assert "| forecast | selector | 3 | 16 |" in qs.markdown(records)
    with pytest.raises(SystemExit, match=r"TEACHER\[:VECTORS\]=DIR"):
        qs.parse_studies(["nothing"])
    with pytest.raises(SystemExit, match="VECTORS must be a positive integer, got '0'"):
        qs.parse_studies([f"selector:0={three}"])


def suite_cell(task, selector, **values):
    base = {"task": task, "length": 4096, "selector": selector, "budget": None if selector == "dense" else 16,
            "teacher": None, "vectors": None, "prefetch": selector == "forecast-carry", "examples": None,
            "successes": None, "accuracy": None, "interval": None, "recall_mass": None,
            "h2d_bytes_per_step": None, "ppl_ratio": None, "skipped": None}  # fmt: skip
    return {**base, **values}


def test_suite_cells_join_their_held_out_bytes(tmp_path):
    """`--suite DIR`: a `forecastkv quality` run's task cells become records after the study's, each with
    its task, examples and the held-out text's bytes a step and perplexity ratio of the same selector;
    skipped cells and the held-out cells themselves are not records."""
    qs = load()
    folder = tmp_path / "suite-niah-4k"
    folder.mkdir()
    cells = [
        suite_cell("niah_single_essay", "dense", examples=50, successes=45, accuracy=0.9, interval=[0.7864, 0.9565]),
        suite_cell("niah_single_essay", "forecast-carry", teacher="selector", vectors=1, examples=50, successes=43,
                   accuracy=0.86, interval=[0.7381, 0.9305], recall_mass=0.94123, recall_interval=[0.93, 0.95],
                   recall_vs_query={"recall": 0.0151, "interval": [0.012, 0.018]},
                   vs_dense={"score": -0.04, "interval": [-0.14, 0.06], "found": 2, "lost": 4}),
        suite_cell("perplexity", "forecast-carry", h2d_bytes_per_step=4.1e6, ppl_ratio=1.04412, recall_mass=0.97),
        suite_cell("niah_single_essay", "quest", skipped="no bounds"),
    ]
    (folder / "summary.json").write_text(json.dumps(cells))
    records = qs.suite_records([str(folder)])
    expected = [("dense", 64, 0.9), ("forecast-carry", 16, 0.86)]
    assert [(r["selector"], r["budget"], r["accuracy"]) for r in records] == expected
    carry = records[1]
    assert carry["source"] == "suite-niah-4k" and carry["task"] == "niah_single_essay" and carry["examples"] == 50
    assert (carry["recall_mass"], carry["h2d_bytes_per_step"], carry["ppl_ratio"]) == (0.9412, 4.1e6, 1.0441)
    assert carry["recall_interval"] == [0.93, 0.95] and carry["vs_dense"]["lost"] == 4
    row = ("| suite-niah-4k | niah_single_essay | 4096 | forecast-carry | 16 | yes | 0.9412 [0.9300, 0.9500] "
           "| +0.0151 [0.0120, 0.0180] | 43/50 = 0.86 [0.74, 0.93] | -0.04 [-0.14, 0.06] |")
    assert row in qs.markdown(records)
    with pytest.raises(SystemExit, match="run `forecastkv quality --out"):
        qs.suite_records([str(tmp_path / "missing")])
