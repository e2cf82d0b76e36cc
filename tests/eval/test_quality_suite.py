"""The quality suite (`forecastkv quality`, `forecastkv.eval.suite`) on the tiny random model of `--small`:
byte tokens, 3 layers, blocks of 16.  Its accuracies are all near 0 (random weights); what is tested is
the protocol: the same prompts for every cell, one dense prefill per example, resume after a kill, no
stale records, the errors, the depth spread and the summary's arithmetic."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from forecastkv.cli import main
from forecastkv.errors import ConfigError
from forecastkv.eval import study, suite
from forecastkv.eval.codec import ByteCodec
from forecastkv.eval.metrics import wilson_interval
from forecastkv.eval.suite_cli import SMALL, tiny_model
from forecastkv.eval.suite_report import SUMMARY_FIELDS, summarize
from forecastkv.kernels import use_backend
from forecastkv.selectors import get_selector

REPO = Path(__file__).resolve().parents[2]
CELLS = 1 + len(suite.DEFAULT_SELECTORS)  # dense + the selectors at --small's one budget
EXAMPLES = len(suite.DEFAULT_TASKS) * SMALL["examples"]  # one length
# what a rerun may change in a record: when and by which call it was measured
TIMING = ("run", "seconds")


@pytest.fixture(scope="module", autouse=True)
def one_thread_reference_kernels():
    """One thread (the subprocess gets OMP_NUM_THREADS=1 too, so both compute alike) and the reference kernels."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with use_backend("reference"):
        yield
    torch.set_num_threads(threads)


class Spy:
    """Wraps suite.dense_prefill and suite.decode_cell, keeping what each call was given."""

    def __init__(self, patch) -> None:
        self.prefills, self.decodes = [], []
        prefill, decode = suite.dense_prefill, suite.decode_cell

        def spy_prefill(model, seq):
            self.prefills.append(seq.ids[0, : seq.prefill].tolist())
            return prefill(model, seq)

        def spy_decode(model, prefilled, prompt, max_new, cell, anchors):
            self.decodes.append((list(prompt), cell.selector, cell.blocks))
            return decode(model, prefilled, prompt, max_new, cell, anchors)

        patch.setattr(suite, "dense_prefill", spy_prefill)
        patch.setattr(suite, "decode_cell", spy_decode)


def complete_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """`forecastkv quality --small` once, in this process, spied on: (out dir, spy, seconds)."""
    out = tmp_path_factory.mktemp("quality") / "small"
    with pytest.MonkeyPatch.context() as patch:
        spy = Spy(patch)
        began = time.perf_counter()
        assert main(["quality", "--small", "--out", str(out), "--no-progress"]) == 0
        seconds = time.perf_counter() - began
    return out, spy, seconds


def test_small_run_writes_every_cell_with_every_key(small_run):
    out, _, seconds = small_run
    assert seconds < 60, f"--small took {seconds:.1f} s"
    cells = json.loads((out / "summary.json").read_text())
    assert isinstance(cells, list)
    tasks = [c for c in cells if c["task"] != "perplexity"]
    assert len(tasks) == len(suite.DEFAULT_TASKS) * CELLS
    assert len(cells) - len(tasks) == CELLS  # one perplexity cell per cell at the one length
    for c in cells:
        assert set(c) == set(SUMMARY_FIELDS)
        assert c["length"] == SMALL["lengths"][0] and c["skipped"] is None
        dense = c["selector"] == "dense"
        assert c["budget"] == (None if dense else SMALL["budgets"][0])
        assert c["prefetch"] is (False if dense else get_selector(c["selector"]).plans_ahead)
        heads = c["selector"] in ("forecast", "quest-forecast", "maxkey-forecast")
        assert c["vectors"] == (1 if heads else None) and c["teacher"] is None  # random heads: no recipe
    for c in tasks:
        assert c["examples"] == SMALL["examples"] and 0 <= c["successes"] <= c["examples"]
        low, high = c["interval"]
        assert 0.0 <= low <= c["accuracy"] <= high <= 1.0
        assert (low, high) == pytest.approx(wilson_interval(c["successes"], c["examples"]), abs=1e-12)
        low, high = c["score_interval"]
        assert low <= c["score"] <= high
        dense = {d["task"]: d for d in tasks if d["selector"] == "dense"}[c["task"]]
        query = {d["task"]: d for d in tasks if d["selector"] == "query"}[c["task"]]
        if c["selector"] == "dense":
            assert c["vs_dense"] is None and c["recall_vs_query"] is None and c["recall_interval"] is None
        else:  # paired on the same examples: the difference of the two means, found and lost within them
            versus = c["vs_dense"]
            assert versus["score"] == pytest.approx(c["score"] - dense["score"], abs=1e-6)
            assert versus["interval"][0] <= versus["score"] <= versus["interval"][1]
            assert versus["found"] - versus["lost"] == c["successes"] - dense["successes"]
            low, high = c["recall_interval"]
            assert low <= c["recall_mass"] <= high
            if c["selector"] != "query":
                gain = c["recall_vs_query"]
                assert gain["recall"] == pytest.approx(c["recall_mass"] - query["recall_mass"], abs=1e-6)
                assert gain["interval"][0] <= gain["recall"] <= gain["interval"][1]
        if c["selector"] == "oracle":
            assert c["recall_mass"] == pytest.approx(1.0, abs=1e-5) and c["h2d_bytes_per_step"] is None
        elif c["selector"] != "dense":
            assert 0.0 < c["recall_mass"] < 1.0 and c["h2d_bytes_per_step"] > 0
            assert c["recall_layers"][0] is None and all(0 < r <= 1 for r in c["recall_layers"][1:])
    ppl = {c["selector"]: c for c in cells if c["task"] == "perplexity"}
    assert ppl["dense"]["ppl_ratio"] == 1.0 and ppl["dense"]["h2d_bytes_per_step"] > ppl["query"]["h2d_bytes_per_step"]
    assert "| passkey | 640 | query | 8 |" in (out / "summary.md").read_text()
    assert (out / "accuracy_vs_h2d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_cell_of_an_example_decodes_its_prompt_after_one_prefill(small_run):
    out, spy, _ = small_run
    records = complete_lines(out / suite.RECORDS)
    assert len(records) == EXAMPLES * CELLS and len(spy.decodes) == EXAMPLES * CELLS
    assert len(spy.prefills) == EXAMPLES  # one dense prefill per example, not per cell
    examples = suite.suite_examples(ByteCodec(128), suite.QualitySpec(**SMALL))
    prompts = [e.input_ids for group in examples.values() for e in group]
    # each prefill holds its example's prompt but the last token, which the first decode step feeds
    assert spy.prefills == [p[:-1] for p in prompts]
    for i, prompt in enumerate(prompts):
        calls = spy.decodes[i * CELLS : (i + 1) * CELLS]
        assert [c[1] for c in calls] == ["dense", *suite.DEFAULT_SELECTORS]
        assert all(c[0] == prompt for c in calls)
    by_example: dict = {}
    for r in records:
        by_example.setdefault(r["key"], set()).add(r["prompt_sha"])
    assert len(by_example) == EXAMPLES and all(len(shas) == 1 for shas in by_example.values())
    for r in records:  # the per-layer recall pools back to the record's own
        if r["recall_rows"]:
            pooled = sum(m * n for m, n in zip(r["recall_layers"], r["recall_layer_rows"]) if n) / r["recall_rows"]
            assert pooled == pytest.approx(r["recall_mass"], rel=1e-9)


def test_a_killed_run_resumes_without_measuring_a_finished_record_again(small_run, tmp_path):
    reference, _, _ = small_run
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FORECASTKV_BACKEND": "kernels=reference"}
    command = [sys.executable, "-m", "forecastkv.cli", "quality", "--small", "--out", str(out), "--no-progress"]
    child = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    records = out / suite.RECORDS
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and child.poll() is None:
        if records.is_file() and len(complete_lines(records)) >= CELLS + 2:  # inside the second example
            break
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    _, stderr = child.communicate()
    assert child.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
    before = {(r["key"], r["mode"]): r for r in complete_lines(records)}
    assert CELLS + 2 <= len(before) < EXAMPLES * CELLS

    with pytest.MonkeyPatch.context() as patch:
        spy = Spy(patch)
        patch.setattr(study, "measure_cell", lambda *a, **k: pytest.fail("a perplexity cell was measured again"))
        assert main(["quality", "--small", "--out", str(out), "--no-progress"]) == 0
    assert len(spy.decodes) == EXAMPLES * CELLS - len(before)
    after = {(r["key"], r["mode"]): r for r in complete_lines(records)}
    assert all(after[key] == record for key, record in before.items())  # kept as they were, run id included
    assert len({r["run"] for r in after.values()}) == 2
    expected = {(r["key"], r["mode"]): r for r in complete_lines(reference / suite.RECORDS)}
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMING}  # noqa: E731
    assert {k: strip(r) for k, r in after.items()} == {k: strip(r) for k, r in expected.items()}
    assert json.loads((out / "summary.json").read_text()) == json.loads((reference / "summary.json").read_text())


TINY_SPEC = dict(
    tasks=["passkey"], lengths=[320], selectors=["query"], budgets=[6], examples=1, ppl_tokens=16, max_new_tokens=4
)


@pytest.mark.parametrize("change", [{"max_new_tokens": 5}, {"seed": 1}, {"examples": 2}])
def test_a_changed_spec_measures_afresh(tmp_path, change):
    model, codec = tiny_model()
    suite.run_suite(model, codec, TINY_SPEC, out=tmp_path)
    with pytest.MonkeyPatch.context() as patch:
        spy = Spy(patch)
        again, _ = suite.run_suite(model, codec, TINY_SPEC, out=tmp_path)
        assert spy.decodes == [] and len(again) == 2  # the same spec: everything read back
        changed, _ = suite.run_suite(model, codec, {**TINY_SPEC, **change}, out=tmp_path)
    examples = change.get("examples", 1)
    assert len(spy.decodes) == 2 * examples and len(changed) == 2 * examples  # nothing reused
    assert len({r["fingerprint"] for r in again + changed}) == 2


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tasks": ["passkey", "nope"]}, "quality tasks: 'nope' not one of"),
        ({"tasks": ["perplexity"]}, "quality tasks: 'perplexity' not one of"),
        ({"selectors": ["bogus"]}, "quality selectors: 'bogus' not one of"),
        ({"examples": 0}, "quality examples must be an integer >= 1, got 0"),
        ({"lengths": [16]}, r"quality lengths \[16\] must exceed ppl_tokens \+ 1 = 17"),
        ({"lengths": [2048]}, r"quality lengths \[2048\] exceed the model's max_position_embeddings=1024"),
        ({"budgets": [3]}, r"quality budgets \[3\] leave no block to choose: each must exceed the 3 forced"),
        ({"tasks": ["vt"], "lengths": [300]}, "task 'vt': length 300 is too short; it needs at least"),
        ({"colour": "red"}, "unknown quality spec key"),
    ],
)
def test_bad_input_names_the_value_and_the_limit(change, message):
    model, codec = tiny_model()
    with pytest.raises(ConfigError, match=message):
        suite.run_suite(model, codec, {**TINY_SPEC, **change})


def test_the_command_reports_bad_input_in_one_line(tmp_path, capsys):
    assert main(["quality", "--small", "--tasks", "passkey", "nope", "--out", str(tmp_path)]) == 2
    assert "'nope' not one of" in capsys.readouterr().err
    assert main(["quality", "--small", "--examples", "0", "--out", str(tmp_path)]) == 2
    assert "examples must be an integer >= 1, got 0" in capsys.readouterr().err


def test_the_command_sets_perplexity_tokens_and_offload():
    from forecastkv.eval.suite_cli import add_arguments, quality_spec

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = quality_spec(parser.parse_args(["--small", "--ppl-tokens", "8", "--no-offload"]))
    assert (spec.ppl_tokens, spec.offload) == (8, False)
    spec = quality_spec(parser.parse_args(["--small"]))
    assert spec.offload is True and spec.ppl_tokens != 8 and spec.seed == 0
    seeded = quality_spec(parser.parse_args(["--small", "--seed", "3"]))
    assert seeded.seed == 3  # other examples: other needles (a seed change measures afresh, above)
    ids = [[e.input_ids for group in suite.suite_examples(ByteCodec(128), s).values() for e in group]
           for s in (spec, seeded)]
    assert ids[0] != ids[1]
    with pytest.raises(ConfigError, match="quality seed must be an integer >= 0, got -1"):
        quality_spec(parser.parse_args(["--small", "--seed", "-1"]))
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        parser.parse_args(["--ppl-tokens", "0"])


def test_needle_depths_spread_over_the_context():
    spec = suite.QualitySpec(**{**SMALL, "examples": 5})
    for (task, _), examples in suite.suite_examples(ByteCodec(128), spec).items():
        asked = [e.meta["depth"] for e in examples]
        assert asked == pytest.approx([0.1, 0.3, 0.5, 0.7, 0.9]), task
        landed = [suite.needle_at(e) for e in examples]  # where the needle is in the ids, not what was asked
        assert landed == sorted(landed), task
        assert min(landed) < 0.2 and max(landed) > 0.8, (task, landed)
        assert landed == pytest.approx(asked, abs=0.05), task


def test_a_cell_counts_the_examples_that_hold_every_reference():
    def record(index, score, recall, rows, layers):
        return {
            "task": "vt", "length": 640, "mode": "query@8", "selector": "query", "budget": 8, "index": index,
            "score": score, "skipped": None, "recall_mass": recall, "recall_rows": rows,
            "recall_layers": layers, "recall_layer_rows": [0, rows // 2, rows // 2],
        }  # fmt: skip

    records = [
        record(0, 1.0, 0.5, 4, [None, 0.4, 0.6]),
        record(1, 0.6, 0.9, 12, [None, 0.8, 1.0]),
        record(2, 1.0, 0.2, 2, [None, 0.2, 0.2]),
        record(3, 0.0, None, 0, [None, None, None]),
    ]
    (cell,) = summarize(records, [])
    assert (cell["examples"], cell["successes"], cell["accuracy"]) == (4, 2, 0.5)
    assert cell["interval"] == pytest.approx(list(wilson_interval(2, 4)))
    assert cell["score"] == pytest.approx(2.6 / 4)
    assert cell["recall_mass"] == pytest.approx((0.5 * 4 + 0.9 * 12 + 0.2 * 2) / 18)
    assert cell["recall_layers"][1] == pytest.approx((0.4 * 2 + 0.8 * 6 + 0.2 * 1) / 9)
    assert cell["recall_layers"][0] is None and cell["h2d_bytes_per_step"] is None


def test_a_summary_rebuilt_from_the_records_is_the_one_the_run_wrote(small_run, tmp_path):
    """`benchmarks/quality_summary.py --rebuild` (committed suites get the summary's present fields without the
    model): from the records, the perplexity cells and the setup of a finished run, the same cells come back."""
    import importlib.util
    import shutil

    out, _, _ = small_run
    folder = tmp_path / "suite"
    shutil.copytree(out, folder)
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "quality_summary.py"
    spec = importlib.util.spec_from_file_location("quality_summary", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--rebuild", str(folder)]) == 0
    assert json.loads((folder / "summary.json").read_text()) == json.loads((out / "summary.json").read_text())
    report = (folder / "summary.md").read_text()
    assert "rebuilt from these records" in report and "| passkey | 640 | query | 8 |" in report
