"""The selector study's report: a Markdown table, a Pareto plot per length, a recall plot, the records.

`forecastkv.eval.study.run_study` returns one record (a dict) per cell of selectors x budgets x lengths; its
module docstring is the schema.  This report reads: length, selector ("dense" for the baseline), budget_kind
("dense" | "blocks" | "top_p"), budget_blocks (the budget, or the top-p cap), p, budget_tokens, budget_share,
context_blocks, prefetch, offload_mode, offload_note, recall_mass and overlap (rows where the budget is
selective; recall_mass_all / overlap_all when there is none), ppl_ratio, needle_accuracy,
h2d_bytes_per_step, hit_rate, selected_blocks, seconds, skipped, and for the header heads, tail_tokens and
anchors_source.  Any metric may be None (not measured): it prints as `-`.

Files `write_study_report` writes into its directory:

    report.md            the table (one section per length) and what its columns mean
    pareto_<length>.png  quality (perplexity ratio, needle accuracy) against H2D MiB per decode step
    recall.png           recall against oracle over the budget, one panel per length
    records.json         the records as given
"""

from __future__ import annotations

import json
from pathlib import Path

from ..atomic import write_text_atomic
from ..modes import SELECTORS

MIB = 2**20
MISSING = "-"
ALL_ROWS_MARK = "*"  # a recall over every row: no row saw more blocks than the budget or cap
# table rows and plot curves in this order: the baseline, the bound, then the deployable selectors
SELECTOR_ORDER = ("dense", "oracle", *(s for s in SELECTORS if s != "oracle"))
FIXED_MARKER, TOP_P_MARKER = "o", "^"

COLUMNS = (
    "selector",
    "budget",
    "prefetch (mode)",
    "recall (mass)",
    "overlap",
    "ppl ratio",
    "needle acc",
    "H2D MiB/step",
    "hit rate",
    "selected blocks",
    "note",
)

BUDGET_NOTE = (
    "A budget counts blocks of `block_size` tokens, the init and local blocks included; it is printed as "
    "blocks, tokens and the share of the context's blocks. A top-p budget keeps, per KV head, the smallest "
    "set of blocks holding p of the score mass, capped at the budget shown (`selected blocks` is what it used)."
)
COLUMN_NOTE = (
    "recall (mass): share of the oracle's attention mass the selected blocks hold; overlap: share of the "
    "oracle's blocks also selected; ppl ratio: held-out perplexity over dense's; needle acc: share of the "
    "needle's answer tokens predicted (teacher-forced argmax); H2D MiB/step: bytes the offloaded runtime "
    "counted host→device per decode step after the first, all layers; hit rate: share of wanted blocks "
    "already in the device slots; prefetch: whether the selector knows a "
    "layer's blocks a layer ahead (which fixes its offload mode). `-`: not measured. "
    f"`{ALL_ROWS_MARK}`: no step saw more blocks than the budget (or top-p's cap), so the recall is over every "
    "step (elsewhere: over the steps where the budget had to choose)."
)


def _fmt(value, digits: int = 3, scale: float = 1.0) -> str:
    return MISSING if value is None else f"{value / scale:.{digits}f}"


def _length_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def budget_label(record: dict) -> str:
    """The budget as printed: "16 blocks = 1024 tokens = 12.5%", "p=0.9 (cap 32 blocks)", or for dense
    "all 128 blocks" ("all blocks" when the record does not count them)."""
    blocks = record.get("budget_blocks")
    if record["selector"] == "dense" or blocks is None:
        return "all blocks" if blocks is None else f"all {blocks} blocks"
    if record.get("budget_kind") == "top_p":
        return f"p={record['p']:g} (cap {blocks} blocks)"
    parts = [f"{blocks} blocks"]
    if record.get("budget_tokens") is not None:
        parts.append(f"{record['budget_tokens']} tokens")
    if record.get("budget_share") is not None:
        parts.append(f"{100 * record['budget_share']:.1f}%")
    return " = ".join(parts)


def _prefetch_label(record: dict) -> str:
    """ "yes (forecast-offload)", "no (sparse-offload)", "no (resident only)"; dense: its mode, or "-"."""
    mode = record.get("offload_mode")
    if record.get("prefetch") is None:
        return f"{MISSING} ({mode})" if mode else MISSING
    return f"{'yes' if record['prefetch'] else 'no'} ({mode or 'resident only'})"


def recall_of(record: dict, field: str = "recall_mass") -> tuple[float | None, bool]:
    """(recall, over every row): `field` over the rows where the budget is selective, else (no row saw
    more blocks than the budget or top-p's cap) `field`_all over every row."""
    if record.get(field) is not None:
        return record[field], False
    return record.get(f"{field}_all"), record.get(f"{field}_all") is not None


def _recall_cell(record: dict, field: str) -> str:
    value, every_row = recall_of(record, field)
    return _fmt(value) + (ALL_ROWS_MARK if every_row else "")


def _selector_rank(selector: str) -> int:
    return SELECTOR_ORDER.index(selector) if selector in SELECTOR_ORDER else len(SELECTOR_ORDER)


def _row_key(record: dict):
    """Rows by selector, then fixed budgets before top-p, then budget, p, and sync before prefetch."""
    return (
        _selector_rank(record["selector"]),
        record["selector"],
        record.get("budget_kind") == "top_p",
        record.get("budget_blocks") or 0,
        record.get("p") or 0.0,
        bool(record.get("prefetch")),
    )


def _row(record: dict) -> list[str]:
    """One table row: the metrics, or `-` and the reason in the note for a skipped cell."""
    head = [record["selector"], budget_label(record), _prefetch_label(record)]
    if record.get("skipped"):
        return head + [MISSING] * (len(COLUMNS) - len(head) - 1) + [f"skipped: {record['skipped']}"]
    return head + [
        _recall_cell(record, "recall_mass"),
        _recall_cell(record, "overlap"),
        _fmt(record.get("ppl_ratio"), 4),
        _fmt(record.get("needle_accuracy"), 2),
        _fmt(record.get("h2d_bytes_per_step"), 3, MIB),
        _fmt(record.get("hit_rate")),
        _fmt(record.get("selected_blocks"), 1),
        record.get("offload_note") or "",
    ]


def _context_blocks(records: list[dict]) -> int | None:
    """The context's blocks at one length: a record's count, else from a budget and its share."""
    for r in records:
        if r.get("context_blocks"):
            return r["context_blocks"]
        if r.get("budget_blocks") and r.get("budget_share"):
            return round(r["budget_blocks"] / r["budget_share"])
    return None


def study_table(records: list[dict]) -> str:
    """The Markdown table, one section per length (shortest first), one row per cell."""
    lines = []
    for length in sorted({r["length"] for r in records}):
        cells = sorted((r for r in records if r["length"] == length), key=_row_key)
        blocks = _context_blocks(cells)
        size = f" ({blocks} blocks)" if blocks else ""
        lines += [f"### {_length_label(length)} context: {length} tokens{size}", ""]
        lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(_row(r)) + " |" for r in cells]
        lines.append("")
    return "\n".join(lines)


def _measured(records: list[dict]) -> list[dict]:
    return [r for r in records if not r.get("skipped")]


def _model_name(records: list[dict], model: str | None) -> str:
    return model or next((r["model"] for r in records if r.get("model")), "model not recorded")


def _curves(records: list[dict]) -> dict[str, list[dict]]:
    """label -> its records, one curve per selector (and per offload mode when one selector ran in several)."""
    selectors = sorted({r["selector"] for r in records}, key=lambda s: (_selector_rank(s), s))
    curves = {}
    for selector in selectors:
        mine = [r for r in records if r["selector"] == selector]
        modes = list(dict.fromkeys(r.get("offload_mode") for r in mine))
        for mode in modes:
            label = selector if len(modes) == 1 or mode is None else f"{selector} [{mode}]"
            curves[label] = [r for r in mine if r.get("offload_mode") == mode]
    return curves


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# (record field, axis label, short name for the legend)
PARETO_PANELS = (
    ("ppl_ratio", "perplexity / dense (lower is better)", "ppl ratio"),
    ("needle_accuracy", "needle accuracy (share of answer tokens)", "needle acc"),
)


def _draw_curve(ax, rows: list[dict], field: str, color, label: str | None) -> None:
    """A selector's fixed budgets as a solid line of circles, its top-p cells as a dashed line of triangles,
    over H2D MiB per step, joined in budget order (bytes need not grow with the budget: a budget of every
    block keeps the slots full) and each point labelled with its budget; cells without bytes or without
    this metric are left out."""
    for kind, marker, style in (("blocks", FIXED_MARKER, "-"), ("top_p", TOP_P_MARKER, "--")):
        cells = sorted(
            (r for r in rows if r.get("budget_kind") == kind and r.get("h2d_bytes_per_step") is not None),
            key=lambda r: (r.get("budget_blocks") or 0, r.get("p") or 0.0),
        )
        cells = [r for r in cells if r.get(field) is not None]
        if not cells:
            continue
        xs = [r["h2d_bytes_per_step"] / MIB for r in cells]
        ys = [r[field] for r in cells]
        ax.plot(xs, ys, color=color, marker=marker, ls=style, ms=7, label=label)
        label = None  # one legend entry per selector
        for x, y, r in zip(xs, ys, cells):
            name = str(r["budget_blocks"]) if kind == "blocks" else f"p{r['p']:g}"
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=6, color=color)


def _no_bytes_note(label: str, rows: list[dict], field: str, short: str) -> str | None:
    """A legend line for a selector measured without bytes (oracle: resident only): its range of `field`."""
    if any(r.get("h2d_bytes_per_step") is not None for r in rows):
        return None
    values = [r[field] for r in rows if r.get(field) is not None]
    if not values:
        return f"{label}: no H2D bytes (resident only), not measured here"
    span = f"{min(values):.3g}" if min(values) == max(values) else f"{min(values):.3g}–{max(values):.3g}"
    return f"{label}: resident only, no H2D bytes; {short} {span}"


def _pareto_panel(ax, records: list[dict], panel: tuple[str, str, str], colors: dict) -> None:
    field, ylabel, short = panel
    dense = [r for r in records if r["selector"] == "dense" and r.get(field) is not None]
    if dense:
        moved = [r["h2d_bytes_per_step"] for r in dense if r.get("h2d_bytes_per_step") is not None]
        where = f"; {moved[0] / MIB:.1f} MiB/step in {dense[0]['offload_mode']}" if moved else ""
        value = sum(r[field] for r in dense) / len(dense)
        ax.axhline(value, color="black", ls=":", lw=1.2, label=f"dense (reference{where})")
    for label, rows in _curves([r for r in records if r["selector"] != "dense"]).items():
        note = _no_bytes_note(label, rows, field, short)
        if note:  # an invisible handle: the legend names the value the axes cannot place
            ax.plot([], [], color=colors[label], marker="x", ls="none", label=note)
        else:
            _draw_curve(ax, rows, field, colors[label], label)
    ax.plot([], [], color="grey", marker=FIXED_MARKER, ls="-", label="fixed budget (8, 16, ... blocks)")
    ax.plot([], [], color="grey", marker=TOP_P_MARKER, ls="--", label="top-p budget (capped)")
    ax.set_xlabel("H2D per decode step (MiB, all layers)")
    ax.set_ylabel(ylabel)
    if field == "needle_accuracy":
        ax.set_ylim(-0.05, 1.05)  # the whole range of a share, so a flat line reads as what it is
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def pareto_plot(records: list[dict], path: str | Path, length: int, model: str | None = None) -> Path:
    """Quality against H2D bytes per decode step at one `length`: two panels (perplexity ratio, needle
    accuracy), one curve per selector, dense as a horizontal reference.  Writes the PNG `path`."""
    plt = _pyplot()
    rows = [r for r in _measured(records) if r["length"] == length]
    if not rows:
        raise ValueError(
            f"pareto_plot: no measured record at length {length}; lengths: {sorted({r['length'] for r in records})}"
        )
    labels = list(_curves([r for r in rows if r["selector"] != "dense"]))
    colors = {label: plt.cm.tab10(i % 10) for i, label in enumerate(labels)}
    fig, axes = plt.subplots(1, len(PARETO_PANELS), figsize=(13, 5))
    for ax, panel in zip(axes, PARETO_PANELS):
        _pareto_panel(ax, rows, panel, colors)
    fig.suptitle(
        f"{_model_name(records, model)}, {length}-token context: quality against bytes moved\n"
        "H2D = bytes the offloaded runtime copies host→device per decode step (KV blocks missing from the slots)",
        fontsize=11,
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _recall_points(rows: list[dict], kind: str) -> list[tuple[float, float]]:
    """(budget in blocks, recall) per cell of `kind`: a fixed budget at its blocks, top-p at the blocks it
    selected (its cap when that was not counted)."""
    points = []
    for r in rows:
        recall = recall_of(r)[0]
        if r.get("budget_kind") != kind or recall is None:
            continue
        blocks = r["budget_blocks"] if kind == "blocks" else (r.get("selected_blocks") or r["budget_blocks"])
        points.append((blocks, recall))
    return sorted(points)


def recall_plot(records: list[dict], path: str | Path, model: str | None = None) -> Path:
    """Recall (share of the oracle's attention mass) against the budget in blocks, one curve per selector
    and one panel per length.  Writes the PNG `path`."""
    plt = _pyplot()
    rows = [r for r in _measured(records) if r["selector"] != "dense" and recall_of(r)[0] is not None]
    if not rows:
        raise ValueError("recall_plot: no measured record has recall_mass")
    lengths = sorted({r["length"] for r in rows})
    labels = sorted({r["selector"] for r in rows}, key=lambda s: (_selector_rank(s), s))
    colors = {label: plt.cm.tab10(i % 10) for i, label in enumerate(labels)}
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4.2), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        here = [r for r in rows if r["length"] == length]
        for selector in labels:
            mine = [r for r in here if r["selector"] == selector]
            for kind, marker, style in (("blocks", FIXED_MARKER, "-"), ("top_p", TOP_P_MARKER, "--")):
                points = _recall_points(mine, kind)
                if points:
                    xs, ys = zip(*points)
                    name = selector if kind == "blocks" else f"{selector} top-p"
                    ax.plot(xs, ys, color=colors[selector], marker=marker, ls=style, ms=6, label=name)
        ax.set_xscale("log", base=2)
        budgets = sorted({r["budget_blocks"] for r in here if r.get("budget_kind") == "blocks"})
        if budgets:
            ax.set_xticks(budgets)
            ax.set_xticklabels([str(b) for b in budgets])
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{_length_label(length)} context ({length} tokens)", fontsize=10)
        ax.set_xlabel("budget (blocks; top-p: blocks selected)")
        ax.set_ylabel("recall of oracle's attention mass")
        ax.grid(alpha=0.3)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper left", bbox_to_anchor=(1.0, 0.9), frameon=False, fontsize=8)
    fig.suptitle(f"{_model_name(records, model)}: block recall against oracle over the budget")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _distinct(records: list[dict], field: str) -> str:
    values = list(dict.fromkeys(str(r[field]) for r in records if r.get(field) is not None))
    return "; ".join(values) if values else "not recorded"


def _setup_lines(records: list[dict], model: str, timing: str | None) -> list[str]:
    """What produced the table: model, heads, tail, reuse anchors, cells and the time they took."""
    measured = _measured(records)
    seconds = sum(r.get("seconds") or 0.0 for r in records) + sum(r.get("prefill_s") or 0.0 for r in records)
    return [
        f"- model: {model}",
        f"- Forecast heads: {_distinct(records, 'heads')}",
        f"- decode steps scored per length (tail): {_distinct(records, 'tail_tokens')}",
        *(
            [f"- reuse anchors: {_distinct(records, 'anchors')} ({_distinct(records, 'anchors_source')})"]
            if any(r.get("anchors") for r in records)
            else []
        ),
        f"- {len(records)} cells ({len(records) - len(measured)} skipped) at lengths "
        f"{', '.join(str(n) for n in sorted({r['length'] for r in records}))}; "
        f"{seconds:.0f} s of measurement (prefills and cells, as recorded)",
        *([f"- {timing}"] if timing else []),
    ]


def _report_text(records: list[dict], model: str, pictures: list[Path], timing: str | None) -> str:
    lines = [
        "# Selector study",
        "",
        *_setup_lines(records, model, timing),
        "",
        BUDGET_NOTE,
        "",
        study_table(records),
        COLUMN_NOTE,
        "",
    ]
    lines += [f"![{p.stem}]({p.name})" for p in pictures]
    return "\n".join(lines) + "\n"


def write_study_report(
    records: list[dict], out_dir: str | Path, model: str | None = None, timing: str | None = None
) -> list[Path]:
    """Write report.md, one pareto_<length>.png per length with a measured cell, recall.png (when some
    cell measured recall) and records.json into `out_dir`; returns the paths written, report.md first.
    model: named in the report and the plots' titles (else the records' "model", else "not recorded");
    timing: a line on the run's wall time and machine for the report's header."""
    if not records:
        raise ValueError("write_study_report: no records (the study measured no cell)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = _model_name(records, model)
    measured = _measured(records)
    pictures = [
        pareto_plot(records, out / f"pareto_{length}.png", length, name)
        for length in sorted({r["length"] for r in measured})
    ]
    if any(r["selector"] != "dense" and recall_of(r)[0] is not None for r in measured):
        pictures.append(recall_plot(records, out / "recall.png", name))
    report = out / "report.md"
    write_text_atomic(report, _report_text(records, name, pictures, timing))
    data = out / "records.json"
    write_text_atomic(data, json.dumps(records, indent=1) + "\n")
    return [report, *pictures, data]
