"""The runner on a tiny random model: resume after a kill, one process = two, clear errors that keep
earlier results, LongBench from the fixture, and the report files."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from forecastkv.eval import runner
from forecastkv.eval.results import MERGED
from tests.helpers import free_port

from .common import FIXTURES, read_jsonl, same_records, tiny_suite

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """One uninterrupted single-process run of the tiny suite."""
    out = tmp_path_factory.mktemp("reference")
    result = runner.run_eval(tiny_suite(out))
    return out, read_jsonl(result["results"])


def test_uninterrupted_run_and_report(reference_run):
    out, records = reference_run
    # 2 passkey + 1 perplexity examples x 3 modes, in canonical order: example-major, modes in order
    assert [(r["key"], r["mode"]) for r in records] == [
        (k, m)
        for k in ("passkey/320/0", "passkey/320/1", "perplexity/200/0")
        for m in ("dense", "infllmv2-query", "infllmv2-forecast")
    ]
    for r in records:
        assert r["prompt_tokens"] == (320 - 3 if r["task"] == "passkey" else 200)
        assert (r["recall"] is None) == (r["mode"] != "infllmv2-forecast")  # recall: forecast (the default)
    text = (out / "report.md").read_text()
    assert "| passkey | 320 | 2 |" in text and "## Forecast recall" in text and "## Perplexity" in text
    # what produced them, in every record and in the report
    assert all(r["run"] == records[0]["run"] for r in records)
    assert records[0]["run"]["heads"] == {"source": "init", "init": "kaiming", "heads_per_group": 1}
    assert records[0]["run"]["sparse_config"]["block_size"] == 8 and records[0]["run"]["model"].startswith(
        "random test model"
    )
    assert "## What produced these results" in text and "created at load with the `kaiming` init" in text
    geometry = next(line for line in text.splitlines() if "sparse config:" in line)
    assert all(f"{key} {value}," in geometry for key, value in (("block_size", 8), ("kernel_size", 4), ("topk", 3)))
    assert report_mark() not in text
    for name in ("score_vs_length.png", "recall_by_layer.png", "bytes_per_step.png"):
        assert (out / name).stat().st_size > 10_000


def report_mark():
    from forecastkv.eval.report import STALE_MARK

    return STALE_MARK


def test_report_is_marked_stale_while_a_changed_suite_reruns(reference_run, tmp_path):
    import shutil

    out, _ = reference_run
    shutil.copytree(out, tmp_path / "out")
    changed = tiny_suite(tmp_path / "out", seed=1)  # every record's settings change

    def look(record):
        text = (tmp_path / "out" / "report.md").read_text()
        assert text.startswith(report_mark()) and "9 of its 9 records" in text and "| passkey | 320 | 2 |" in text
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.run_eval(changed, after_record=look)
    assert (tmp_path / "out" / "report.md").read_text().startswith(report_mark())  # killed: still stale
    runner.run_eval(changed)
    assert report_mark() not in (tmp_path / "out" / "report.md").read_text()


def test_heads_digest_names_the_trained_file(tmp_path):
    (tmp_path / "forecast.safetensors").write_bytes(b"heads v1")
    first = runner.heads_digest({"forecast_weights": str(tmp_path)})
    assert len(first) == 16 and first == runner.heads_digest(
        {"forecast_weights": str(tmp_path / "forecast.safetensors")}
    )
    (tmp_path / "forecast.safetensors").write_bytes(b"heads v2")  # retrained into the same directory
    assert runner.heads_digest({"forecast_weights": str(tmp_path)}) != first
    assert runner.heads_digest({"forecast_weights": None}) is None


def test_kill_and_restart_gives_the_same_jsonl(reference_run, tmp_path, monkeypatch):
    _, expected = reference_run
    calls = []
    real = runner.evaluate_example

    def counting(model, example, mode, *args, **kwargs):
        calls.append((example.key, mode.name))
        return real(model, example, mode, *args, **kwargs)

    monkeypatch.setattr(runner, "evaluate_example", counting)

    def kill_after_four(record):
        if len(calls) == 4:
            raise KeyboardInterrupt  # the process dies right after its 4th record reached the disk

    with pytest.raises(KeyboardInterrupt):
        runner.run_eval(tiny_suite(tmp_path), after_record=kill_after_four)
    shard = tmp_path / "results.rank0.jsonl"
    assert len(read_jsonl(shard)) == 4 and not (tmp_path / MERGED).exists()
    with open(shard, "a") as f:  # ... and a 5th record was half written when it died
        f.write('{"key": "passkey/320/1", "mode": "infllm')
    result = runner.run_eval(tiny_suite(tmp_path))
    assert len(calls) == len(set(calls)) == len(expected)  # each (example, mode) evaluated exactly once
    same_records(read_jsonl(result["results"]), expected)
    assert runner.run_eval(tiny_suite(tmp_path))["evaluated"] == 0  # a finished suite does nothing


@pytest.mark.slow  # the eval CLI in two processes (torch.distributed.run)
@pytest.mark.serial
def test_two_processes_equal_one(reference_run, tmp_path):
    _, expected = reference_run
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump(tiny_suite(tmp_path / "out")))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "-m",
        "forecastkv.eval",
        "--config",
        str(suite),
        "--no-progress",
    ]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    shards = [read_jsonl(tmp_path / "out" / f"results.rank{r}.jsonl") for r in (0, 1)]
    assert {r["key"] for r in shards[0]} == {"passkey/320/0", "perplexity/200/0"}  # examples 0 and 2
    assert {r["key"] for r in shards[1]} == {"passkey/320/1"}
    same_records(read_jsonl(tmp_path / "out" / MERGED), expected)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tasks": [{"name": "needle_party", "lengths": [400]}]}, "unknown task 'needle_party'"),
        ({"modes": ["dense", "psychic"]}, "unknown attention mode 'psychic'"),
        ({"modes": ["dense@floppy-disk"]}, "cache mode 'floppy-disk'"),
        (
            {"tasks": [{"name": "passkey", "lengths": [4000]}]},
            r"length 4000 exceeds the model's context \(max_position_embeddings=640\)",
        ),
        ({"longbench": {"dir": "EMPTY", "tasks": ["hotpotqa"], "lengths": [512]}}, r"lacks \['hotpotqa.jsonl'\]"),
        ({"longbench": {"dir": "MISSING", "tasks": ["hotpotqa"], "lengths": [512]}}, "does not exist"),
        ({"modes": ["infllmv2-forecast"], "model": {"forecast": None}}, "needs forecast heads, but the model has none"),
        ({"modes": ["nosa"]}, "needs NOSA's A/delta"),
        ({"tasks": [{"name": "cwe", "lengths": [300], "max_new_tokens": 8}]}, "task 'cwe': length 300 is too short"),
    ],
)
def test_bad_input_errors_keep_earlier_results(reference_run, tmp_path, change, message):
    out, _ = reference_run
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    change = dict(change)
    if "longbench" in change:
        (tmp_path / "EMPTY").mkdir()
        change["longbench"] = {**change["longbench"], "dir": str(tmp_path / change["longbench"]["dir"])}
    if "model" in change:
        change["model"] = {**tiny_suite(out)["model"], **change["model"]}
    with pytest.raises(ValueError, match=message):
        runner.run_eval(tiny_suite(out, **change))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_longbench_fixture_end_to_end(tmp_path):
    suite = tiny_suite(
        tmp_path,
        tasks=[],
        modes=["dense", "infllmv2-query"],
        longbench={
            "dir": str(FIXTURES / "longbench"),
            "tasks": ["hotpotqa", "trec"],
            "lengths": [256],
            "max_new_tokens": 4,
        },
    )
    records = read_jsonl(runner.run_eval(suite, limit=1)["results"])
    assert [(r["key"], r["mode"]) for r in records] == [
        ("longbench:hotpotqa/256/0", "dense"),
        ("longbench:hotpotqa/256/0", "infllmv2-query"),
        ("longbench:trec/256/0", "dense"),
        ("longbench:trec/256/0", "infllmv2-query"),
    ]
    assert records[0]["metric"] == "qa_f1" and records[2]["metric"] == "classification"
    assert records[0]["references"] == ["Graz"] and all(0.0 <= r["score"] <= 1.0 for r in records)


def test_cli_eval_subcommand(reference_run, tmp_path, capsys):
    from forecastkv.cli import main

    suite = tmp_path / "suite.yaml"
    suite.write_text(
        yaml.safe_dump(tiny_suite(tmp_path / "out", tasks=[{"name": "perplexity", "lengths": [200]}], modes=["dense"]))
    )
    assert main(["eval", "--config", str(suite), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "report:" in printed and "What produced these results" in printed and "heads: untrained" in printed
    table = printed[printed.index("mode ") :].splitlines()
    assert table[0].split()[:4] == ["mode", "length", "score", "perplexity"] and table[1].split()[:2] == [
        "dense",
        "200",
    ]
    assert len(read_jsonl(tmp_path / "out" / MERGED)) == 1


def test_shipped_suites_are_valid():
    from forecastkv.eval.config import load_config, work_units

    for path in sorted((REPO / "configs" / "eval").glob("*.yaml")):
        config = load_config(path)
        assert work_units(config), path
    smol = load_config(REPO / "configs" / "eval" / "smollm2-135m.yaml")
    assert max(n for t in smol["tasks"] for n in t["lengths"]) <= 8192  # SmolLM2's context
