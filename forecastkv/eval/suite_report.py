"""The quality suite's summary: one record per cell (`summarize`), written as summary.json, summary.md and
accuracy_vs_h2d.png (`write_summary`).

A task cell is (task, length, selector, budget); its record (`SUMMARY_FIELDS`):

    selector, budget     "dense" (budget None: every block) or a selector at `budget` blocks (init and local included)
    teacher, vectors     for a selector that scores with Forecast heads: the teacher they were trained with
                         (their recipe.json; None if unknown) and their vectors per KV group; else None
    prefetch             whether the selector knows a layer's blocks a layer ahead (`Selector.plans_ahead`;
                         False for dense)
    task, length         the task and its length in tokens (prompt + max_new_tokens)
    examples, successes  examples measured; those scored 1.0 (every reference in the prediction)
    accuracy, interval   successes / examples and its 95% Wilson interval [low, high] (`metrics.wilson_interval`)
    score                the mean RULER score (string_match_all: partial credit for some of several references)
    score_interval       its 95% percentile-bootstrap interval over the examples [low, high]
                         (`metrics.bootstrap_interval`)
    recall_mass          share of the oracle's attention mass the selected blocks hold, pooled over the rows
                         where the budget is selective, every decode step, layer >= 1 and KV head (None: no row)
    recall_interval      its 95% bootstrap interval, whole examples (with their rows) resampled: the rows of
                         one example are not independent, the examples are
    vs_dense             the score minus dense's on the same examples (paired bootstrap): {"score", "interval",
                         "found": examples it answers whole and dense does not, "lost": the reverse}; None for dense
    recall_vs_query      recall_mass minus the query selector's at the same budget on the same examples (paired
                         bootstrap): {"recall", "interval"}; None without a query cell
    recall_layers        the same per layer (layer 0 has none: its blocks are not compared)
    h2d_bytes_per_step   host->device bytes per decode step of the selector's offloaded run at that length
                         (the perplexity text, see below; None: not measured, e.g. the oracle)
    ppl, ppl_ratio       None on task cells
    skipped              why the cell was not measured (None: measured)

The perplexity cells (task "perplexity", one per length and cell) carry ppl, ppl_ratio (to dense), the
text's recall_mass and the bytes; accuracy, interval, examples and successes are None there.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..atomic import write_text_atomic
from ..modes import SELECTORS
from ..selectors import get_selector
from .metrics import bootstrap_interval, wilson_interval
from .suite import DENSE, study_mode

MIB = 2**20
PERPLEXITY = "perplexity"
SELECTOR_ORDER = (DENSE, "oracle", *(s for s in SELECTORS if s != "oracle"))
SUMMARY_FIELDS = (
    "task length selector budget mode teacher vectors prefetch examples successes accuracy interval score "
    "score_interval recall_mass recall_interval recall_layers vs_dense recall_vs_query h2d_bytes_per_step hit_rate "
    "offload_mode ppl ppl_ratio skipped"
).split()


def uses_heads(selector: str) -> bool:
    return selector != DENSE and get_selector(selector).needs_forecast_heads


def _cell_base(task: str, length: int, selector: str, budget, heads: dict, bytes_record: dict | None) -> dict:
    """The fields every cell has: what was measured, and how its selector selects."""
    record = dict.fromkeys(SUMMARY_FIELDS)
    forecast = uses_heads(selector)
    record.update(
        task=task,
        length=length,
        selector=selector,
        budget=budget,
        mode=DENSE if selector == DENSE else f"{selector}@{budget}",
        teacher=heads.get("teacher") if forecast else None,
        vectors=heads.get("vectors") if forecast else None,
        prefetch=selector != DENSE and get_selector(selector).plans_ahead,
    )
    if bytes_record is not None:
        for name in ("h2d_bytes_per_step", "hit_rate", "offload_mode"):
            record[name] = bytes_record.get(name)
    return record


def pooled_recall(records: list[dict]) -> tuple[float | None, list | None]:
    """recall_mass over every selective row of `records` (each record's mean weighted by its rows),
    overall and per layer."""
    rows = sum(r["recall_rows"] or 0 for r in records)
    overall = sum(r["recall_mass"] * r["recall_rows"] for r in records if r["recall_rows"]) / rows if rows else None
    layered = [r for r in records if r.get("recall_layers") is not None]
    if not layered:
        return overall, None
    per_layer = []
    for layer in range(len(layered[0]["recall_layers"])):
        pairs = [(r["recall_layers"][layer], r["recall_layer_rows"][layer]) for r in layered]
        total = sum(n for _, n in pairs)
        per_layer.append(sum(m * n for m, n in pairs if n) / total if total else None)
    return overall, per_layer


def task_cell(records: list[dict], heads: dict, bytes_record: dict | None) -> dict:
    """The summary of one (task, length, cell) from its per-example records."""
    first = records[0]
    cell = _cell_base(first["task"], first["length"], first["selector"], first["budget"], heads, bytes_record)
    measured = [r for r in records if r["skipped"] is None]
    if not measured:
        cell["skipped"] = first["skipped"]
        return cell
    successes = sum(r["score"] == 1.0 for r in measured)
    accuracy = successes / len(measured)
    low, high = wilson_interval(successes, len(measured))
    recall, layers = pooled_recall(measured)
    cell.update(
        examples=len(measured),
        successes=successes,
        accuracy=accuracy,
        interval=[low, high],
        score=sum(r["score"] for r in measured) / len(measured),
        score_interval=list(bootstrap_interval([r["score"] for r in measured])[1:]),
        recall_mass=recall,
        recall_interval=None if recall is None else list(bootstrap_interval(*_recall_rows(measured))[1:]),
        recall_layers=layers,
    )
    return cell


def _recall_rows(records: list[dict]) -> tuple[list[float], list[int]]:
    """(recall, selective rows) per example: an example with no selective row weighs nothing."""
    return [r["recall_mass"] or 0.0 for r in records], [r["recall_rows"] or 0 for r in records]


def _paired(mine: list[dict], theirs: list[dict]) -> tuple[list[dict], list[dict]] | None:
    """The measured records of two cells on the examples both have, in the same order (None: none shared)."""
    by_index = {r["index"]: r for r in theirs if r["skipped"] is None}
    pairs = [(r, by_index[r["index"]]) for r in mine if r["skipped"] is None and r["index"] in by_index]
    return (tuple(map(list, zip(*pairs))) if pairs else None)


def compare_cells(cell: dict, records: list[dict], dense: list[dict] | None, query: list[dict] | None) -> None:
    """`vs_dense` and `recall_vs_query` of a task cell from its records and those of its task and length's dense
    cell and query cell at its budget (each None where absent or the cell is that one)."""
    paired = None if dense is None or cell["selector"] == DENSE else _paired(records, dense)
    if paired is not None:
        mine, base = paired
        difference, low, high = bootstrap_interval([r["score"] for r in mine], other=[r["score"] for r in base])
        cell["vs_dense"] = {
            "score": difference, "interval": [low, high],
            "found": sum(a["score"] == 1.0 and b["score"] != 1.0 for a, b in zip(mine, base)),
            "lost": sum(a["score"] != 1.0 and b["score"] == 1.0 for a, b in zip(mine, base)),
        }
    paired = None if query is None or cell["selector"] in (DENSE, "query") else _paired(records, query)
    if paired is not None and cell["recall_mass"] is not None:
        (values, rows), (other, other_rows) = (_recall_rows(side) for side in paired)
        if sum(rows) and sum(other_rows):
            difference, low, high = bootstrap_interval(values, rows, other, other_rows)
            cell["recall_vs_query"] = {"recall": difference, "interval": [low, high]}


def perplexity_cell(record: dict, heads: dict) -> dict:
    """The summary of one of the study's perplexity records."""
    dense = record["selector"] == DENSE
    budget = None if dense else record["budget_blocks"]
    cell = _cell_base(PERPLEXITY, record["length"], record["selector"], budget, heads, record)
    cell.update(
        ppl=record["ppl"],
        ppl_ratio=record["ppl_ratio"],
        recall_mass=record["recall_mass"],
        skipped=record["skipped"],
    )
    return cell


def summarize(task_records: list[dict], ppl_records: list[dict], heads: dict | None = None) -> list[dict]:
    """One record per task cell (task, length, selector, budget), then one per perplexity cell; in the
    order of the lengths, the tasks as measured, dense, oracle, the other selectors, the budgets.
    heads: {"teacher": ..., "vectors": ...} of the Forecast heads (None: unknown)."""
    heads = heads or {}
    by_length = {(r["length"], study_mode(r)): r for r in ppl_records}
    groups: dict = {}
    for record in task_records:
        groups.setdefault((record["task"], record["length"], record["mode"]), []).append(record)
    cells = []
    for (task, length, mode), rs in groups.items():
        cell = task_cell(rs, heads, by_length.get((length, mode)))
        query = groups.get((task, length, f"query@{cell['budget']}"))
        compare_cells(cell, rs, groups.get((task, length, DENSE)), query)
        cells.append(cell)
    cells += [perplexity_cell(r, heads) for r in ppl_records]
    tasks = list(dict.fromkeys(c["task"] for c in cells))
    return sorted(
        cells,
        key=lambda c: (c["length"], tasks.index(c["task"]), SELECTOR_ORDER.index(c["selector"]), c["budget"] or 0),
    )


# ----------------------------------------------------------------------------------------------
# summary.md
# ----------------------------------------------------------------------------------------------


def _fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _mib(value) -> str:
    return "-" if value is None else f"{value / MIB:.3f}"


def _span(pair, digits: int = 3) -> str:
    return "-" if pair is None else f"[{pair[0]:.{digits}f}, {pair[1]:.{digits}f}]"


def _estimate(value, interval) -> str:
    return "-" if value is None else f"{value:.3f} {_span(interval)}"


def _difference(entry: dict | None, name: str, digits: int = 3) -> str:
    """A paired difference `{name: d, "interval": [l, h], ...}` as "d [l, h]" (found / lost where counted)."""
    if entry is None:
        return "-"
    counts = f" ({entry['found']} / {entry['lost']})" if "found" in entry else ""
    return f"{entry[name]:+.{digits}f} {_span(entry['interval'], digits)}{counts}"


def task_table(cells: list[dict]) -> list[str]:
    lines = [
        "| task | length | selector | budget | prefetch | accuracy | 95% interval | examples | mean score [95%] "
        "| score - dense, paired (found / lost) | recall (mass) [95%] | recall - query, paired | H2D MiB/step |",
        "|---|---:|---|---:|---|---:|---|---:|---|---|---|---|---:|",
    ]
    for c in cells:
        if c["task"] == PERPLEXITY:
            continue
        accuracy = f"skipped: {c['skipped']}" if c["skipped"] else _fmt(c["accuracy"])
        lines.append(
            f"| {c['task']} | {c['length']} | {c['selector']} | {c['budget'] or 'all'} | {c['prefetch']} | {accuracy} "
            f"| {_span(c['interval'])} | {c['examples'] or 0} | {_estimate(c['score'], c['score_interval'])} "
            f"| {_difference(c['vs_dense'], 'score')} | {_estimate(c['recall_mass'], c['recall_interval'])} "
            f"| {_difference(c['recall_vs_query'], 'recall')} | {_mib(c['h2d_bytes_per_step'])} |"
        )
    return lines


def perplexity_table(cells: list[dict]) -> list[str]:
    lines = [
        "| length | selector | budget | ppl | ratio to dense | recall (mass) | H2D MiB/step | hit rate |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        if c["task"] != PERPLEXITY:
            continue
        ppl = f"skipped: {c['skipped']}" if c["skipped"] else _fmt(c["ppl"])
        lines.append(
            f"| {c['length']} | {c['selector']} | {c['budget'] or 'all'} | {ppl} | {_fmt(c['ppl_ratio'])} "
            f"| {_fmt(c['recall_mass'])} | {_mib(c['h2d_bytes_per_step'])} | {_fmt(c['hit_rate'])} |"
        )
    return lines


def summary_markdown(cells: list[dict], setup: list[str], ppl_tokens: int | None) -> str:
    """summary.md: what produced it, the task table, the perplexity table, the plot."""
    lines = ["# Quality suite", "", *(f"- {line}" for line in setup), "", "## Tasks", ""]
    lines += [
        "accuracy: the share of examples whose greedy answer holds every reference (score 1.0), with its 95% "
        "Wilson interval; mean score: RULER's string_match_all (partial credit for some of several references). "
        "recall (mass): the share of the oracle's attention mass the selected blocks hold, pooled over decode "
        "rows where the budget is selective. [95%] and the paired differences (to dense on the same examples; "
        "found / lost: examples answered whole where dense is not / the reverse; to the query selector at the "
        "same budget) are percentile-bootstrap intervals over the examples, 10,000 resamples, seed 0. "
        "H2D MiB/step: measured once per length and cell, in the offloaded "
        "runtime, on the held-out perplexity text (the table below), not on every task example; the oracle "
        "reads every key and cannot run offloaded (`-`).",
        "",
        *task_table(cells),
        "",
        f"## Held-out perplexity ({ppl_tokens} teacher-forced tokens per length after a shared dense prefill)",
        "",
        *perplexity_table(cells),
        "",
        "![accuracy against H2D bytes per decode step](accuracy_vs_h2d.png)",
    ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# accuracy_vs_h2d.png
# ----------------------------------------------------------------------------------------------


def accuracy_plot(cells: list[dict], path: Path, title: str) -> Path:
    """One panel per (task, length), tasks down, lengths across: each cell's accuracy with its Wilson
    interval against its H2D MiB per decode step (log scale); a cell without bytes (the oracle: not
    deployable) as a dashed line across the panel with its interval as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task_cells = [c for c in cells if c["task"] != PERPLEXITY and c["accuracy"] is not None]
    lengths = sorted({c["length"] for c in task_cells})
    tasks = list(dict.fromkeys(c["task"] for c in task_cells))
    modes = list(dict.fromkeys(c["mode"] for c in task_cells))
    palette = plt.cm.tab10 if len(modes) <= 10 else plt.cm.tab20  # past 10 cells tab10 would repeat a colour
    colors = {mode: palette(i % palette.N) for i, mode in enumerate(modes)}
    rows, cols = max(len(tasks), 1), max(len(lengths), 1)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 2.6 * rows), squeeze=False, sharey=True)
    for i, task in enumerate(tasks):
        for j, length in enumerate(lengths):
            ax = axes[i][j]
            _panel(ax, [c for c in task_cells if c["length"] == length and c["task"] == task], colors)
            ax.set_title(f"{task}, {length} tokens", fontsize=9)
            ax.set_ylim(-0.05, 1.05)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=8)
            if i == rows - 1:
                ax.set_xlabel("H2D MiB per decode step", fontsize=8)
            if j == 0:
                ax.set_ylabel("accuracy (95% Wilson)", fontsize=8)
    fig.legend(
        handles=_legend(plt, task_cells, modes, colors),
        loc="upper left",
        bbox_to_anchor=(1.0, 0.97),
        frameon=False,
        fontsize=8,
    )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _legend(plt, cells: list[dict], modes: list[str], colors: dict) -> list:
    lines = {c["mode"] for c in cells if not c["h2d_bytes_per_step"]}
    return [
        plt.Line2D([], [], color=colors[m], ls="--", label=f"{m} (no bytes: not run offloaded)")
        if m in lines
        else plt.Line2D([], [], color=colors[m], marker="o", ls="", label=m)
        for m in modes
    ]


def _panel(ax, cells: list[dict], colors: dict) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    placed = [c for c in cells if c["h2d_bytes_per_step"]]
    for c in placed:
        low, high = c["interval"]
        x = c["h2d_bytes_per_step"] / MIB
        yerr = [[c["accuracy"] - low], [high - c["accuracy"]]]
        ax.errorbar([x], [c["accuracy"]], yerr=yerr, color=colors[c["mode"]], marker="o", ms=5, capsize=3)
    if placed:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    for c in cells:
        if not c["h2d_bytes_per_step"]:  # no bytes (the oracle): its accuracy across the panel
            ax.axhline(c["accuracy"], color=colors[c["mode"]], ls="--", lw=1)
            ax.axhspan(*c["interval"], color=colors[c["mode"]], alpha=0.1)


def write_summary(cells: list[dict], out_dir, setup: list[str], ppl_tokens: int | None, title: str) -> list[Path]:
    """summary.json (the cells, a list), summary.md and accuracy_vs_h2d.png into `out_dir`; returns them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "summary.json"
    write_text_atomic(data, json.dumps(cells, indent=1) + "\n")
    picture = accuracy_plot(cells, out / "accuracy_vs_h2d.png", title)
    report = out / "summary.md"
    write_text_atomic(report, summary_markdown(cells, setup, ppl_tokens))
    return [data, report, picture]
