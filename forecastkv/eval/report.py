"""The report beside `results.jsonl`: `report.md` (tables task x length x mode) and PNG plots.

    score_vs_length.png   per task: score (x100; perplexity: lower is better) vs context length, one line per mode
    recall_by_layer.png   forecast recall per layer per (mode, length), chance level in grey; curves
                          that coincide are drawn side by side (offset, own dash and marker)
    bytes_per_step.png    KV bytes read (and H2D bytes, when offloaded) per decode step vs length, per mode

`plot_over_length` draws any set of per-length curves the same way (the demo's curves).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from ..atomic import write_text_atomic
from ..modeling.selection import RECALL_FIRST_LAYER
from .results import MERGED

MIB = 2**20


def load(directory: str | Path) -> list[dict]:
    path = Path(directory) / MERGED
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _ordered(values):
    return list(dict.fromkeys(values))


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def pooled_perplexity(records):
    """Pooled perplexity over examples (sum of NLL / tokens), and per bucket."""
    nll = sum(b["nll_sum"] for r in records for b in r["buckets"])
    tokens = sum(b["tokens"] for r in records for b in r["buckets"])
    buckets: dict = defaultdict(lambda: [0.0, 0])
    for r in records:
        for b in r["buckets"]:
            buckets[(b["start"], b["end"])][0] += b["nll_sum"]
            buckets[(b["start"], b["end"])][1] += b["tokens"]
    return math.exp(nll / tokens), {k: math.exp(s / n) for k, (s, n) in sorted(buckets.items())}


def _recall(records):
    """Per layer recall and chance pooled over examples (counts summed), and means over layers >= 1."""
    counts = None
    for r in records:
        if r.get("recall"):
            c = r["recall"]["counts"]
            counts = c if counts is None else [[a + b for a, b in zip(x, y)] for x, y in zip(counts, c)]
    if counts is None:
        return None
    recall = [h / max(w, 1) for h, w, _ in counts]
    chance = [c / max(w, 1) for _, w, c in counts]
    first = RECALL_FIRST_LAYER if len(recall) > RECALL_FIRST_LAYER else 0
    tail = slice(first, None)
    return {
        "recall": recall,
        "chance": chance,
        "mean": _mean(recall[tail]),
        "mean_chance": _mean(chance[tail]),
        "start": next(r["recall"]["start"] for r in records if r.get("recall")),
    }


def _fmt(value, digits=1):
    return "—" if value is None else f"{value:.{digits}f}"


STALE_MARK = "> **Stale:**"


def _describe_heads(heads: dict | None) -> str:
    if heads is None:
        return "none (no forecast selector)"
    if heads["source"] == "trained":
        sha1 = heads.get("sha1") or "?"
        return f"trained, `{heads['path']}` (forecast.safetensors sha1 {sha1}), {heads['heads_per_group']} per KV group"
    if heads["source"] == "init":
        return f"untrained, created at load with the `{heads['init']}` init, {heads['heads_per_group']} per KV group"
    return f"the checkpoint's own, {heads['heads_per_group']} per KV group"


def provenance_lines(records: list[dict]) -> list[str]:
    """The 'what produced these results' section: model, heads and sparse config of each distinct
    run the records come from (records written before runs were recorded say so)."""
    runs: dict = {}
    for r in records:
        key = json.dumps(r.get("run"), sort_keys=True)
        runs.setdefault(key, [r.get("run"), 0])[1] += 1
    lines = ["## What produced these results", ""]
    for run, count in runs.values():
        prefix = f"{count} records: " if len(runs) > 1 else ""
        if run is None:
            lines.append(f"- {prefix}not recorded (written before forecastkv recorded its runs)")
            continue
        sparse = run["sparse_config"]
        geometry = "dense (no sparse_config)" if sparse is None else ", ".join(f"{k} {v}" for k, v in sparse.items())
        lines += [
            f"- {prefix}model `{run['model']}`",
            f"  - heads: {_describe_heads(run['heads'])}",
            f"  - sparse config: {geometry}",
        ]
    return lines + [""]


def tables(records: list[dict]) -> str:
    """report.md's text: provenance, then scores, perplexity (by position), forecast recall, bytes and time."""
    modes = _ordered(r["mode"] for r in records)
    lines = [
        "# Evaluation report",
        "",
        f"{len(records)} records; modes: {', '.join(modes)}.",
        "",
        *provenance_lines(records),
    ]
    groups = defaultdict(list)
    for r in records:
        groups[(r["task"], r["length"], r["mode"])].append(r)
    tasks = _ordered(r["task"] for r in records)
    lengths = sorted(set(r["length"] for r in records))
    scored = [t for t in tasks if t != "perplexity"]
    if scored:
        lines += _score_lines(groups, scored, lengths, modes)
    if "perplexity" in tasks:
        lines += _perplexity_lines(groups, lengths, modes)
    lines += _recall_lines(records, lengths, modes)
    lines += _bytes_lines(records, lengths, modes)
    return "\n".join(lines)


def _against_dense(modes: list[str]) -> tuple[str | None, list[str]]:
    """("dense" when it is one of the modes, else None; the other modes), for the columns against dense."""
    dense = "dense" if "dense" in modes else None
    return dense, [m for m in modes if m != dense]


def _score_lines(groups: dict, scored: list[str], lengths: list[int], modes: list[str]) -> list[str]:
    """The scores table: one row per scored task and length, each mode's mean (x100) and its change against dense."""
    dense, others = _against_dense(modes)
    head = ["task", "length", "n"] + modes + ([f"{m} − dense" for m in others] if dense else [])
    lines = ["## Scores (×100, mean over examples)", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for task in scored:
        for length in lengths:
            cells = {m: _mean(r["score"] for r in groups[(task, length, m)]) for m in modes}
            if all(v is None for v in cells.values()):
                continue
            n = max(len(groups[(task, length, m)]) for m in modes)
            row = [task, str(length), str(n)] + [_fmt(None if cells[m] is None else 100 * cells[m]) for m in modes]
            if dense:
                row += [
                    _fmt(None if cells[m] is None or cells[dense] is None else 100 * (cells[m] - cells[dense]), 1)
                    for m in others
                ]
            lines.append("| " + " | ".join(row) + " |")
    return lines + [""]


def _perplexity_lines(groups: dict, lengths: list[int], modes: list[str]) -> list[str]:
    """The perplexity table (pooled per length, each mode against dense), then one table by position per length."""
    dense, others = _against_dense(modes)
    head = ["length", "n"] + modes + ([f"{m} / dense" for m in others] if dense else [])
    lines = [
        "## Perplexity on held-out essays (lower is better)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    details = []
    for length in lengths:
        ppl = {
            m: pooled_perplexity(groups[("perplexity", length, m)]) if groups[("perplexity", length, m)] else None
            for m in modes
        }
        if all(v is None for v in ppl.values()):
            continue
        n = max(len(groups[("perplexity", length, m)]) for m in modes)
        row = [str(length), str(n)] + [_fmt(None if ppl[m] is None else ppl[m][0], 3) for m in modes]
        if dense:
            row += [
                _fmt(None if ppl[m] is None or ppl[dense] is None else ppl[m][0] / ppl[dense][0], 4) for m in others
            ]
        lines.append("| " + " | ".join(row) + " |")
        spans = _ordered(k for v in ppl.values() if v for k in v[1])
        details += [
            f"**{length} tokens, by position**",
            "",
            "| positions | " + " | ".join(modes) + " |",
            "|" + "---|" * (len(modes) + 1),
        ]
        for span in spans:
            cells = " | ".join(_fmt(ppl[m][1].get(span) if ppl[m] else None, 3) for m in modes)
            details.append(f"| {span[0]}–{span[1] - 1} | {cells} |")
        details.append("")
    return lines + [""] + details


def _recall_lines(records: list[dict], lengths: list[int], modes: list[str]) -> list[str]:
    """The forecast recall table, one row per mode and length that measured it (none: no lines)."""
    recall_rows = []
    for m in modes:
        for length in lengths:
            got = _recall([r for r in records if r["mode"] == m and r["length"] == length])
            if got:
                recall_rows.append((m, length, got))
    if not recall_rows:
        return []
    lines = [
        f"## Forecast recall (mean over layers ≥ {RECALL_FIRST_LAYER}; prefill rows from the start on)",
        "",
        "| mode | length | rows from | recall | chance | per layer |",
        "|---|---|---|---|---|---|",
    ]
    for m, length, got in recall_rows:
        per = " ".join(f"{x:.2f}" for x in got["recall"])
        lines.append(f"| {m} | {length} | {got['start']} | {got['mean']:.3f} | {got['mean_chance']:.3f} | {per} |")
    return lines + [""]


def _bytes_lines(records: list[dict], lengths: list[int], modes: list[str]) -> list[str]:
    """The bytes per decode step and time table, one row per mode and length, and what its columns count."""
    lines = [
        "## Bytes per decode step and time (mean over examples)",
        "",
        "| mode | length | KV read MiB/step | H2D MiB/step | prefill s | decode ms/step |",
        "|---|---|---|---|---|---|",
    ]
    for m in modes:
        for length in lengths:
            rs = [r for r in records if r["mode"] == m and r["length"] == length]
            if not rs:
                continue
            kv = _mean(r["kv_read_bytes_per_step"] for r in rs)
            h2d = _mean(r["h2d_bytes_per_step"] for r in rs)
            prefill = _fmt(_mean(r["time"]["prefill_s"] for r in rs), 2)
            decode = _fmt(_mean(r["time"]["decode_ms_per_step"] for r in rs), 1)
            kv_mib, h2d_mib = _fmt(None if kv is None else kv / MIB, 3), _fmt(None if h2d is None else h2d / MIB, 3)
            lines.append(f"| {m} | {length} | {kv_mib} | {h2d_mib} | {prefill} | {decode} |")
    return lines + [
        "",
        "KV read: bytes of K/V (and NOSA bias) the attention read per decode step, all layers — what a "
        "cache without slot reuse would move host→device. H2D: every byte the offloaded runtime "
        "counted host→device during the decode steps, per step (— on the resident cache, which moves nothing). "
        "Times are wall-clock on the machine that ran it.",
        "",
    ]


def summary(records: list[dict]) -> str:
    """A plain-text table for the terminal, one row per mode and length: mean score (x100) over
    the scored tasks, pooled perplexity, forecast recall (layers >= 1) and MiB per decode step."""
    head = ["mode", "length", "score", "perplexity", "recall", "KV read MiB/step", "H2D MiB/step"]
    rows = [head]
    for m in _ordered(r["mode"] for r in records):
        for length in sorted({r["length"] for r in records if r["mode"] == m}):
            rs = [r for r in records if r["mode"] == m and r["length"] == length]
            scored = [r["score"] for r in rs if r["task"] != "perplexity" and r.get("score") is not None]
            ppl = [r for r in rs if r["task"] == "perplexity"]
            recall = _recall(rs)
            kv, h2d = _mean(r["kv_read_bytes_per_step"] for r in rs), _mean(r["h2d_bytes_per_step"] for r in rs)
            rows.append(
                [
                    m,
                    _length_label(length),
                    _fmt(None if not scored else 100 * _mean(scored)),
                    _fmt(pooled_perplexity(ppl)[0] if ppl else None, 3),
                    _fmt(None if recall is None else recall["mean"], 3),
                    _fmt(None if kv is None else kv / MIB, 3),
                    _fmt(None if h2d is None else h2d / MIB, 3),
                ]
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        for row in rows
    )


def mark_stale(directory: str | Path, missing: int, total: int) -> None:
    """Put a stale banner on top of `report.md` while a run (re)computes `missing` of the suite's
    `total` records; `write_report` replaces the whole file when the run ends."""
    path = Path(directory) / "report.md"
    old = path.read_text(encoding="utf-8") if path.is_file() else "# Evaluation report\n\nNo results yet.\n"
    body = "\n".join(line for line in old.splitlines() if not line.startswith(STALE_MARK)).lstrip("\n")
    banner = (
        f"{STALE_MARK} a run of this suite is in progress: {missing} of its {total} records are missing or were "
        "produced by other settings and are being computed. What follows is from before that run; it is "
        "rewritten when the run ends."
    )
    write_text_atomic(path, banner + "\n\n" + body + ("" if body.endswith("\n") else "\n"))


def _length_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _length_axis(ax, lengths) -> None:
    """Log-2 x axis with a labelled tick at every length measured."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths)
    ax.set_xticklabels([_length_label(n) for n in lengths])
    ax.minorticks_off()
    ax.set_xlabel("context length (tokens)")


def _save_with_side_legend(fig, ax, title: str, path: Path) -> Path:
    """Title, grid, the legend beside the axes; write `path` (PNG) and return it."""
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _styles(plt, labels: list[str]) -> tuple[dict, dict]:
    """A colour and a look per label.  Curves that coincide (modes that score the same, or hold
    the same bytes) would hide each other, so each also gets its own marker, size and dash."""
    colors = {label: plt.cm.tab10(i % 10) for i, label in enumerate(labels)}
    looks = {
        label: {"marker": "osD^v<>p"[i % 8], "ms": 8 - 1.5 * (i % 4), "ls": ["-", "--", "-.", ":"][i % 4]}
        for i, label in enumerate(labels)
    }
    return colors, looks


def plots(records: list[dict], directory: Path) -> list[Path]:
    """Write the suite's figures into `directory`: score vs length (always), forecast recall by layer
    (when some record measured it), KV bytes per decode step (when some record counted them).
    Returns the PNGs written, in that order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = _ordered(r["mode"] for r in records)
    colors, looks = _styles(plt, modes)
    written = [_score_plot(plt, records, modes, colors, looks, directory / "score_vs_length.png")]
    recall = _recall_plot(plt, records, modes, colors, looks, directory / "recall_by_layer.png")
    written += [recall] if recall is not None else []
    bytes_png = _bytes_plot(plt, records, modes, colors, looks, directory / "bytes_per_step.png")
    written += [bytes_png] if bytes_png is not None else []
    return written


def _score_plot(plt, records: list[dict], modes: list[str], colors: dict, looks: dict, path: Path) -> Path:
    """One panel per task: each mode's score (perplexity: pooled perplexity) over context length."""
    tasks = _ordered(r["task"] for r in records)
    cols = min(4, len(tasks))
    rows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        for m in modes:
            by_len = defaultdict(list)
            for r in records:
                if r["task"] == task and r["mode"] == m:
                    by_len[r["length"]].append(r)
            xs = sorted(by_len)
            if task == "perplexity":
                ys = [pooled_perplexity(by_len[x])[0] for x in xs]
            else:
                ys = [100 * _mean(r["score"] for r in by_len[x]) for x in xs]
            ax.plot(xs, ys, color=colors[m], label=m, **looks[m])
        ax.set_title(task + (" (lower is better)" if task == "perplexity" else ""), fontsize=10)
        ax.set_ylabel("perplexity" if task == "perplexity" else "score (×100)")
        if task != "perplexity":
            ax.set_ylim(-5, 105)  # the full score range, so a flat line reads as what it is
        _length_axis(ax, sorted({r["length"] for r in records if r["task"] == task}))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    # one legend row per mode beside the panels: mode names are long, and a row under a
    # one-panel figure cut them off; the tight bounding box keeps every label in the picture
    fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 0.92), frameon=False, fontsize=8)
    fig.suptitle("Score vs context length per mode")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _recall_plot(plt, records: list[dict], modes: list[str], colors: dict, looks: dict, path: Path) -> Path | None:
    """Forecast recall per layer, one curve per (mode, length), chance in grey; None: no record has recall."""
    lengths = sorted(set(r["length"] for r in records))
    curves = [
        (m, n, _recall([r for r in records if r["mode"] == m and r["length"] == n])) for m in modes for n in lengths
    ]
    curves = [c for c in curves if c[2]]
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(10, 4.2))
    shades = {n: 0.35 + 0.65 * (i + 1) / len(lengths) for i, n in enumerate(lengths)}
    # modes that select alike (forecast resident and forecast-offload) give the same recall:
    # each curve sits a little to the side of its layer, with its own dash and an open or
    # filled marker, so coinciding curves stay visible side by side
    spread = min(0.5 / len(curves), 0.12)
    chances = {}
    for i, (m, n, got) in enumerate(curves):
        layers = [layer + (i - (len(curves) - 1) / 2) * spread for layer in range(len(got["recall"]))]
        look = looks[m]
        ax.plot(
            layers,
            got["recall"],
            marker=look["marker"],
            ms=look["ms"] / 1.6,
            ls=look["ls"],
            lw=1.2,
            color=colors[m],
            alpha=shades[n],
            mfc="none" if i % 2 else colors[m],
            label=f"{m}, {_length_label(n)} tokens",
        )
        chances.setdefault((n, tuple(round(c, 6) for c in got["chance"])), got["chance"])
    for (n, _), chance in chances.items():  # chance depends on the rows, not the mode: drawn once per length
        label = f"chance, {_length_label(n)} tokens"
        ax.plot(range(len(chance)), chance, ls="--", color="grey", alpha=shades[n] * 0.8, label=label)
    ax.set_xlabel("layer")
    count = len(curves[0][2]["recall"])
    ax.set_xticks(range(0, count, 1 if count <= 16 else 5))
    ax.set_ylabel("forecast recall (share of query-selected blocks)")
    ax.set_ylim(0, 1.02)
    _save_with_side_legend(fig, ax, "Forecast recall by layer (grey: chance)", path)
    plt.close(fig)
    return path


def _bytes_plot(plt, records: list[dict], modes: list[str], colors: dict, looks: dict, path: Path) -> Path | None:
    """KV bytes read and H2D bytes moved per decode step over context length; None: no record has them."""
    lengths = sorted(set(r["length"] for r in records))
    fig, ax = plt.subplots(figsize=(10, 4.2))
    drawn = False
    for m in modes:
        for field, style, label in (("kv_read_bytes_per_step", "-", "KV read"), ("h2d_bytes_per_step", ":", "H2D")):
            xs, ys = [], []
            for n in lengths:
                v = _mean(r[field] for r in records if r["mode"] == m and r["length"] == n)
                if v is not None:
                    xs.append(n)
                    ys.append(v / MIB)
            if xs:
                look = looks[m]
                ax.plot(xs, ys, ls=style, marker=look["marker"], ms=look["ms"], color=colors[m], label=f"{m} ({label})")
                drawn = True
    if drawn:
        _length_axis(ax, lengths)
        ax.set_yscale("log")
        ax.set_ylabel("MiB per decode step (all layers, log scale)")
        _save_with_side_legend(fig, ax, "KV bytes per decode step per mode", path)
    plt.close(fig)
    return path if drawn else None


def plot_over_length(lengths: list[int], panels: list[dict], path: Path, title: str) -> Path:
    """Panels of curves over context length, two per row, one colour per label across panels.

    panels: [{"title", "ylabel", "series": {label: [value or None per length]}, "log": bool,
    "ylim": (lo, hi) or None}]; a label's missing values (and on a log axis its zeros) are skipped.
    Writes `path` (PNG) with every legend inside the picture and returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors, looks = _styles(plt, _ordered(label for panel in panels for label in panel["series"]))
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 3.9 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for label, values in panel["series"].items():
            # a log axis cannot show 0 (e.g. no block missed): such a point is left out
            points = [(n, v) for n, v in zip(lengths, values) if v is not None and (v > 0 or not panel.get("log"))]
            if points:
                ax.plot(*zip(*points), color=colors[label], label=label, **looks[label])
        _length_axis(ax, lengths)
        if panel.get("log"):
            ax.set_yscale("log")
        if panel.get("ylim"):
            ax.set_ylim(*panel["ylim"])
        ax.set_ylabel(panel["ylabel"])
        ax.set_title(panel["title"], fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best", frameon=True, framealpha=0.85)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_report(directory: str | Path) -> Path:
    """Write `report.md` and the plots beside `results.jsonl`; returns the report's path."""
    directory = Path(directory)
    records = load(directory)
    path = directory / "report.md"
    if not records:
        write_text_atomic(path, "# Evaluation report\n\nNo results yet.\n")
        return path
    images = plots(records, directory)
    text = tables(records) + "\n" + "".join(f"![{p.stem}]({p.name})\n" for p in images)
    write_text_atomic(path, text)
    return path
