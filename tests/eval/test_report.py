"""The report's parts on hand-made records: the terminal summary, what produced the results, the
stale banner while a suite reruns, and recall curves of modes that coincide drawn apart."""

import matplotlib

from forecastkv.eval import report

MIB = 2**20
RUN = {
    "model": "bundled:smollm2-135m",
    "heads": {"source": "trained", "path": "runs/heads", "sha1": "0123456789abcdef", "heads_per_group": 1},
    "sparse_config": {"block_size": 64, "topk": 8, "selector": "forecast"},
}


def _record(mode, task, length, *, score=None, recall=None, h2d=None, run=RUN):
    counts = None if recall is None else [[round(r * 100), 100, 40] for r in recall]
    return {
        "mode": mode,
        "task": task,
        "length": length,
        "score": score,
        "run": run,
        "recall": None if counts is None else {"start": 256, "counts": counts},
        "buckets": [{"start": 1, "end": 101, "nll_sum": 200.0, "tokens": 100}] if task == "perplexity" else [],
        "kv_read_bytes_per_step": 2 * MIB,
        "h2d_bytes_per_step": h2d,
        "time": {"prefill_s": 1.0, "decode_ms_per_step": 10.0},
    }


def _records():
    same = [0.9, 0.7, 0.8, 0.85]  # the resident forecast mode and forecast-offload select alike
    return [
        _record("dense", "passkey", 2048, score=1.0),
        _record("infllmv2-forecast", "passkey", 2048, score=0.5, recall=same),
        _record("infllmv2-forecast@forecast-offload", "passkey", 2048, score=0.5, recall=same, h2d=0.25 * MIB),
        _record("dense", "perplexity", 2048),
    ]


def test_summary_table_for_the_terminal():
    text = report.summary(_records())
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["mode", "length", "score", "perplexity"]
    dense = next(line for line in lines if line.startswith("dense "))
    assert dense.split()[:4] == ["dense", "2K", "100.0", f"{2.718281828**2:.3f}"]
    offload = next(line for line in lines if line.startswith("infllmv2-forecast@forecast-offload"))
    assert offload.split()[2:] == ["50.0", "—", "0.783", "2.000", "0.250"]  # recall: mean over layers >= 1


def test_report_names_model_heads_and_sparse_config(tmp_path):
    records = _records() + [_record("dense", "passkey", 4096, score=0.0, run=None)]
    text = report.tables(records)
    assert "## What produced these results" in text
    assert "4 records: model `bundled:smollm2-135m`" in text and "1 records: not recorded" in text
    assert "trained, `runs/heads` (forecast.safetensors sha1 0123456789abcdef)" in text
    assert "sparse config: block_size 64, topk 8, selector forecast" in text
    init = {**RUN, "heads": {"source": "init", "init": "next_query", "heads_per_group": 1}}
    assert "untrained, created at load with the `next_query` init" in report.tables(
        [_record("dense", "passkey", 2048, score=1.0, run=init)]
    )


def test_stale_banner_until_the_report_is_rewritten(tmp_path):
    report.mark_stale(tmp_path, 3, 9)
    first = (tmp_path / "report.md").read_text()
    assert first.startswith(report.STALE_MARK) and "3 of its 9 records" in first and "No results yet." in first
    (tmp_path / "report.md").write_text("# Evaluation report\n\nold tables\n")
    report.mark_stale(tmp_path, 2, 9)
    report.mark_stale(tmp_path, 1, 9)  # one banner, the latest count
    text = (tmp_path / "report.md").read_text()
    assert text.count(report.STALE_MARK) == 1 and "1 of its 9" in text and text.endswith("old tables\n")


def test_recall_curves_that_coincide_are_both_visible(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    matplotlib.use("Agg")
    kept, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    paths = report.plots(_records(), tmp_path)
    assert (tmp_path / "recall_by_layer.png") in paths
    fig = next(f for f in kept if f is not None and f.axes and "recall" in f.axes[0].get_title().lower())
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    a, b = lines["infllmv2-forecast, 2K tokens"], lines["infllmv2-forecast@forecast-offload, 2K tokens"]
    assert list(a.get_ydata()) == list(b.get_ydata())  # the same recall ...
    assert all(x != y for x, y in zip(a.get_xdata(), b.get_xdata()))  # ... drawn side by side
    assert max(abs(x - y) for x, y in zip(a.get_xdata(), b.get_xdata())) < 0.5  # each still at its layer
    assert (a.get_linestyle(), a.get_marker(), str(a.get_markerfacecolor())) != (
        b.get_linestyle(),
        b.get_marker(),
        str(b.get_markerfacecolor()),
    )
    assert [label for label in lines if label.startswith("chance")] == ["chance, 2K tokens"]  # drawn once
    close("all")
