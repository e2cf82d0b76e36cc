"""The selector study's report: the table prints every kind of cell (dense, fixed, top-p, skipped, missing
values), the plots and files are written for synthetic records, and bad records fail with a clear error."""

import json

import pytest

from forecastkv.eval.study import RECORD_FIELDS
from forecastkv.eval.study_report import (
    COLUMNS,
    MIB,
    budget_label,
    pareto_plot,
    recall_plot,
    study_table,
    write_study_report,
)
from tests.test_cli import _user_error

BLOCK = 64
AHEAD = ("forecast", "reuse", "speculate", "quest-forecast", "maxkey-forecast")  # the selectors that plan a layer ahead


def cell(length=2048, selector="query", kind="blocks", blocks=16, p=None, **metrics):
    """One study record with every field of the engine's schema (`study.RECORD_FIELDS`); metrics default
    to plausible values, any can be overridden."""
    context_blocks = length // BLOCK
    record = dict.fromkeys(RECORD_FIELDS)
    record.update(
        {
            "length": length,
            "context_blocks": context_blocks,
            "selector": selector,
            "budget_kind": kind,
            "budget_blocks": blocks,
            "p": p,
            "budget_tokens": None if blocks is None else blocks * BLOCK,
            "budget_share": None if blocks is None else blocks / context_blocks,
            "prefetch": selector in AHEAD,
            "offload_mode": "forecast-offload" if selector in AHEAD else "sparse-offload",
            "recall_mass": 0.8,
            "overlap": 0.7,
            "ppl": 11.0,
            "ppl_ratio": 1.1,
            "needle_accuracy": 0.75,
            "h2d_bytes_per_step": 3 * MIB,
            "hit_rate": 0.85,
            "selected_blocks": None if blocks is None else float(blocks),
            "seconds": 2.0,
            "skipped": None,
        }
    )
    unknown = set(metrics) - set(RECORD_FIELDS)
    assert not unknown, f"not in the engine's record schema: {unknown}"
    record.update(metrics)
    return record


def dense(length=2048):
    return cell(
        length,
        "dense",
        kind="dense",
        blocks=length // BLOCK,
        prefetch=None,
        offload_mode="dense-offload",
        recall_mass=None,
        overlap=None,
        ppl_ratio=1.0,
        h2d_bytes_per_step=4 * MIB,
        hit_rate=None,
        selected_blocks=None,
    )


def table_rows(text: str) -> dict[str, list[list[str]]]:
    """section heading -> the table's body rows, each split into its cells."""
    sections, heading = {}, None
    for line in text.splitlines():
        if line.startswith("### "):
            heading = line[4:]
            sections[heading] = []
        elif line.startswith("| ") and not line.startswith("| selector"):
            sections[heading].append([c.strip() for c in line.strip("|").split("|")])
    return sections


def test_budget_is_printed_as_blocks_tokens_and_share():
    assert budget_label(cell(2048, blocks=16)) == "16 blocks = 1024 tokens = 50.0%"
    assert budget_label(cell(8192, blocks=16)) == "16 blocks = 1024 tokens = 12.5%"
    assert budget_label(cell(kind="top_p", blocks=32, p=0.9)) == "p=0.9 (cap 32 blocks)"
    assert budget_label(dense()) == "all 32 blocks"
    assert budget_label(dense() | {"budget_blocks": None}) == "all blocks"
    # a budget of every block, and a single-block context
    assert budget_label(cell(64, blocks=1)) == "1 blocks = 64 tokens = 100.0%"


def test_table_prints_every_kind_of_cell():
    records = [
        cell(blocks=8, h2d_bytes_per_step=1.5 * MIB),
        cell(kind="top_p", blocks=32, p=0.95, selected_blocks=19.25),
        cell(
            selector="oracle",
            blocks=8,
            prefetch=False,
            offload_mode=None,
            offload_note="oracle reads every key",
            h2d_bytes_per_step=None,
            hit_rate=None,
        ),
        cell(selector="oracle", kind="top_p", blocks=32, p=0.8, skipped="out of time"),
        cell(selector="forecast", blocks=16, needle_accuracy=None, ppl_ratio=1.02345),
        dense(),
    ]
    rows = table_rows(study_table(records))["2K context: 2048 tokens (32 blocks)"]
    assert all(len(r) == len(COLUMNS) for r in rows)
    # dense first, then oracle, then the deployable selectors in SELECTORS order; fixed budgets before top-p
    assert [r[:2] for r in rows] == [
        ["dense", "all 32 blocks"],
        ["oracle", "8 blocks = 512 tokens = 25.0%"],
        ["oracle", "p=0.8 (cap 32 blocks)"],
        ["query", "8 blocks = 512 tokens = 25.0%"],
        ["query", "p=0.95 (cap 32 blocks)"],
        ["forecast", "16 blocks = 1024 tokens = 50.0%"],
    ]
    dense_row, oracle_row, skipped_row, query_row, top_p_row, forecast_row = rows
    assert dense_row[2:] == ["- (dense-offload)", "-", "-", "1.0000", "0.75", "4.000", "-", "-", ""]
    assert oracle_row[2] == "no (resident only)" and oracle_row[7:9] == ["-", "-"]
    assert oracle_row[10] == "oracle reads every key"  # why there are no bytes
    assert skipped_row[3:10] == ["-"] * 7 and skipped_row[10] == "skipped: out of time"
    assert query_row[2:] == ["no (sparse-offload)", "0.800", "0.700", "1.1000", "0.75", "1.500", "0.850", "8.0", ""]
    assert top_p_row[9] == "19.2"  # the blocks top-p used, below its cap
    assert forecast_row[2] == "yes (forecast-offload)"
    assert forecast_row[5:7] == ["1.0234", "-"]  # a missing metric is "-", not 0


def test_table_has_one_section_per_length_shortest_first():
    uncounted = cell(1000, blocks=8) | {"context_blocks": None, "budget_share": None}
    text = study_table([cell(8192, blocks=32), cell(2048, blocks=8), dense(4096), uncounted])
    assert list(table_rows(text)) == [
        "1000 context: 1000 tokens",  # no record counts its blocks
        "2K context: 2048 tokens (32 blocks)",
        "4K context: 4096 tokens (64 blocks)",
        "8K context: 8192 tokens (128 blocks)",
    ]


def test_a_budget_that_never_chooses_prints_its_recall_over_every_row():
    """At a budget >= every block no row is selective: recall_mass is None, recall_mass_all is shown, marked."""
    every = cell(blocks=32, recall_mass=None, overlap=None, recall_mass_all=1.0, overlap_all=1.0)
    neither = cell(blocks=8, recall_mass=None, overlap=None)
    rows = table_rows(study_table([every, neither]))["2K context: 2048 tokens (32 blocks)"]
    assert [r[3:5] for r in rows] == [["-", "-"], ["1.000*", "1.000*"]]


def synthetic_study(lengths=(2048, 8192)) -> list[dict]:
    records = []
    for length in lengths:
        records.append(dense(length))
        for selector in ("oracle", "query", "forecast"):
            for blocks in (8, 16, 32):
                recall = 1.0 if selector == "oracle" else blocks / 40
                h2d = None if selector == "oracle" else blocks * 0.25 * MIB
                records.append(cell(length, selector, blocks=blocks, recall_mass=recall, h2d_bytes_per_step=h2d))
            for p in (0.8, 0.9):
                skipped = "oracle has no offloaded runtime" if selector == "oracle" else None
                records.append(cell(length, selector, "top_p", 32, p, selected_blocks=20 * p, skipped=skipped))
    return records


def test_report_writes_table_plots_and_records(tmp_path):
    records = synthetic_study()
    paths = write_study_report(records, tmp_path / "study", model="tiny model")
    names = [p.name for p in paths]
    assert names == ["report.md", "pareto_2048.png", "pareto_8192.png", "recall.png", "records.json"]
    for path in paths:
        assert path.is_file() and path.stat().st_size > 0
    for png in paths[1:4]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "study" / "records.json").read_text()) == records
    report = (tmp_path / "study" / "report.md").read_text()
    assert "- model: tiny model" in report and "(4 skipped)" in report
    assert "![pareto_2048](pareto_2048.png)" in report and "![recall](recall.png)" in report
    assert "| forecast | p=0.9 (cap 32 blocks) | yes (forecast-offload) |" in report


@pytest.fixture
def kept_figures(monkeypatch):
    """The figures the plots draw, kept open (plt.close does nothing) to read their labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    return figures


def test_pareto_plot_names_model_length_units_and_what_has_no_bytes(tmp_path, kept_figures):
    pareto_plot(synthetic_study(), tmp_path / "p.png", 8192, model="tiny model")
    (figure,) = kept_figures
    assert figure._suptitle.get_text().startswith("tiny model, 8192-token context: quality against bytes moved")
    assert "H2D = bytes the offloaded runtime copies host→device per decode step" in figure._suptitle.get_text()
    ppl, needle = figure.axes
    assert ppl.get_xlabel() == needle.get_xlabel() == "H2D per decode step (MiB, all layers)"
    assert ppl.get_ylabel() == "perplexity / dense (lower is better)"
    assert needle.get_ylim() == (-0.05, 1.05)
    legend = [t.get_text() for t in ppl.get_legend().get_texts()]
    assert legend == [
        "dense (reference; 4.0 MiB/step in dense-offload)",
        "oracle: resident only, no H2D bytes; ppl ratio 1.1",  # it has no bytes to be placed at
        "query",
        "forecast",
        "fixed budget (8, 16, ... blocks)",
        "top-p budget (capped)",
    ]
    # query's fixed budgets joined in budget order, at their bytes; its top-p cells on their own dashed line
    query = next(line for line in ppl.get_lines() if line.get_label() == "query")
    fixed, top_p = [line for line in ppl.get_lines() if line.get_color() == query.get_color() and len(line.get_xdata())]
    assert (fixed.get_marker(), fixed.get_linestyle(), list(fixed.get_xdata())) == ("o", "-", [2.0, 4.0, 8.0])
    assert (top_p.get_marker(), top_p.get_linestyle(), list(top_p.get_xdata())) == ("^", "--", [3.0, 3.0])


def test_recall_plot_has_a_panel_per_length(tmp_path, kept_figures):
    recall_plot(synthetic_study(lengths=(2048, 4096, 8192)), tmp_path / "r.png", model="tiny model")
    (figure,) = kept_figures
    assert [ax.get_title() for ax in figure.axes] == [
        "2K context (2048 tokens)",
        "4K context (4096 tokens)",
        "8K context (8192 tokens)",
    ]
    for ax in figure.axes:
        assert ax.get_xlabel() == "budget (blocks; top-p: blocks selected)"
        assert ax.get_ylabel() == "recall of oracle's attention mass"
        oracle = next(line for line in ax.get_lines() if line.get_label() == "oracle")
        assert list(oracle.get_xdata()) == [8, 16, 32] and list(oracle.get_ydata()) == [1.0, 1.0, 1.0]


def test_plots_with_a_single_cell_and_no_bytes(tmp_path):
    """One oracle cell (no bytes anywhere): the Pareto plot still draws (its value named in the legend)."""
    only = [cell(selector="oracle", blocks=1, h2d_bytes_per_step=None, recall_mass=1.0)]
    assert pareto_plot(only, tmp_path / "p.png", 2048).stat().st_size > 0
    assert recall_plot(only, tmp_path / "r.png").stat().st_size > 0


def test_dense_only_study_has_no_recall_plot(tmp_path):
    paths = write_study_report([dense(2048)], tmp_path)
    assert [p.name for p in paths] == ["report.md", "pareto_2048.png", "records.json"]


def test_nothing_to_draw_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no measured record at length 4096; lengths: \\[2048\\]"):
        pareto_plot([cell()], tmp_path / "p.png", 4096)
    with pytest.raises(ValueError, match="no measured record has recall_mass"):
        recall_plot([dense(), cell(skipped="out of time")], tmp_path / "r.png")
    with pytest.raises(ValueError, match="no records"):
        write_study_report([], tmp_path)


# -- the console script's `study` front end (no model: the engine is replaced where a run would start) --


def _one_line_error(argv, capsys) -> str:
    """Run the console script; assert it ends as a user error in one stderr line, no traceback."""
    line = _user_error(argv, capsys)
    assert "Traceback" not in line
    return line


@pytest.fixture
def no_model(monkeypatch):
    """Any attempt to load the model fails the test: the errors below must come before it."""
    from forecastkv.eval import study

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(study, "load_study_model", refuse)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budgets", "0"], "--budgets: must be at least 1, got 0"),
        (["--lengths", "2k"], "--lengths: expected a positive integer, got '2k'"),
        (["--top-p", "1.5"], "--top-p: must lie in (0, 1], got 1.5"),
        (["--top-p", "0"], "--top-p: must lie in (0, 1], got 0"),
        (["--selectors", "random"], "--selectors: invalid choice: 'random'"),
        (["--tail", "-1"], "--tail: must be at least 1, got -1"),
        (["--budgets", "8", "8"], "study budgets must not repeat a value, got [8, 8]"),
        (["--selectors", "quest", "quest"], "study selectors must be distinct names"),
        (["--lengths", "64", "--tail", "64"], "study lengths [64] must exceed tail_tokens + 1 = 65"),
        (["--top-p", "0.9", "--budgets"], "--budgets: expected at least one argument"),
    ],
)
def test_study_bad_options_are_one_line_errors(argv, message, no_model, capsys):
    assert message in _one_line_error(["study", *argv], capsys)


def test_study_heads_must_be_a_directory_or_shipped_heads(tmp_path, no_model, capsys):
    line = _one_line_error(["study", "--heads", str(tmp_path / "missing"), "--out", str(tmp_path)], capsys)
    missing = tmp_path / "missing"
    assert line.endswith(f"--heads {missing}: no such directory (a train-forecast output, or bundled:NAME)")
    line = _one_line_error(["study", "--heads", "bundled:nope", "--out", str(tmp_path)], capsys)
    assert line.endswith("--heads bundled:nope: no shipped Forecast heads named 'nope'; shipped: ['smollm2-135m']")


def test_study_options_make_the_spec():
    from forecastkv.cli import build_parser
    from forecastkv.eval.study import StudySpec
    from forecastkv.eval.study_cli import STUDY_SMALL
    from forecastkv.eval.study_cli import study_spec as _study_spec

    parse = build_parser().parse_args
    assert _study_spec(parse(["study"])) == StudySpec()  # the full study by default
    small = _study_spec(parse(["study", "--small"]))
    assert (list(small.lengths), list(small.budgets), list(small.top_p)) == (
        STUDY_SMALL["lengths"],
        STUDY_SMALL["budgets"],
        STUDY_SMALL["top_p"],
    )
    given = _study_spec(parse(["study", "--small", "--lengths", "512", "--top-p", "--selectors", "oracle", "quest"]))
    assert given.lengths == (512,) and given.top_p == () and given.selectors == ("oracle", "quest")
    assert given.budgets == tuple(STUDY_SMALL["budgets"]) and given.tail_tokens == STUDY_SMALL["tail_tokens"]


def test_study_command_measures_then_writes_the_report(tmp_path, monkeypatch, capsys):
    """`forecastkv study` hands its spec to run_study (cells.json in --out, to resume) and writes the report there."""
    from forecastkv.cli import main
    from forecastkv.eval import study

    calls = {}

    def fake_load(spec):
        calls["loaded"] = spec
        return "model", "tokenizer", spec

    def fake_run(model, tokenizer, spec, out=None, progress=False):
        calls["run"] = (model, tokenizer, spec, out)
        return synthetic_study(lengths=spec.lengths)

    monkeypatch.setattr(study, "load_study_model", fake_load)
    monkeypatch.setattr(study, "run_study", fake_run)
    out = tmp_path / "study"
    assert main(["study", "--small", "--lengths", "2048", "--out", str(out), "--no-progress"]) == 0
    model, tokenizer, spec, cells = calls["run"]
    assert (model, tokenizer, spec.lengths, cells) == ("model", "tokenizer", (2048,), out / "cells.json")
    assert sorted(p.name for p in out.iterdir()) == ["pareto_2048.png", "recall.png", "records.json", "report.md"]
    assert "study: " in capsys.readouterr().out


def test_suite_plot_gives_every_cell_its_own_colour(tmp_path, kept_figures):
    """Eleven cells (dense, the oracle and nine selectors, as the 4K needle suite has): tab10 would give the
    eleventh dense's colour."""
    from forecastkv.eval.suite_report import accuracy_plot

    modes = ["dense"] + [f"s{i}@16" for i in range(10)]
    cells = [
        {"task": "niah_single_essay", "length": 4096, "mode": mode, "accuracy": 0.5, "interval": [0.4, 0.6],
         "h2d_bytes_per_step": 2**20 * (1.0 + i)}
        for i, mode in enumerate(modes)
    ]
    accuracy_plot(cells, tmp_path / "a.png", "tiny")
    (figure,) = kept_figures
    handles = figure.legends[0].legend_handles
    assert len({tuple(handle.get_color()) for handle in handles}) == len(modes) == len(handles)
