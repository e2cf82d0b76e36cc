"""benchmarks/gpu_check.py: its sections and their order, budgets that fit the deadline, every
section's script accepting the arguments the check passes it, the no-CUDA and deadline paths, and
(slow) a dry run writing each section's files as it goes and recording a stop."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("kernel tests", "runtime parity", "decode sweep", "decode replay", "kernel bench", "prefill")


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_check(*args, timeout=180):
    env = {"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home())}
    return subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


def read_summary(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    assert [r["section"] for r in summary["sections"]] == list(ORDER)
    return summary


def test_sections_order_and_budgets():
    gpu_check = load_gpu_check()
    assert gpu_check.SECTION_NAMES == ORDER  # cheap correctness first, prefill last
    assert [gpu_check.stem(i, n) for i, n in enumerate(ORDER, 1)] == [
        "01-kernel-tests",
        "02-runtime-parity",
        "03-decode-sweep",
        "04-decode-replay",
        "05-kernel-bench",
        "06-prefill",
    ]
    gpu = sum(budget for _, budget, _ in gpu_check.SECTIONS)
    dry = sum(budget for _, _, budget in gpu_check.SECTIONS)
    assert gpu + 15 <= gpu_check.DEFAULT_DEADLINE_S <= 450  # every section fits the ~7-minute default
    assert dry <= 120  # a dry run stays within 2 minutes even at its budgets
    # the children's own time budgets leave room for their start-up inside the section's
    for dry_run in (False, True):
        for index, name in enumerate(ORDER, 1):
            for command in gpu_check.section_commands(name, "/tmp/out", index, dry_run):
                for flag in ("--budget-s", "--prefill-budget-s"):
                    if flag in command.argv:
                        inner = float(command.argv[command.argv.index(flag) + 1])
                        assert 0 < inner < gpu_check.budget_of(name, dry_run), (name, flag)


def test_section_not_started_unless_its_budget_fits():
    why = load_gpu_check().why_not_run
    assert why("prefill", 90, 300, 420, None, True, False) is None
    status, reason = why("prefill", 90, 331, 420, None, True, False)
    assert status == "not started" and reason.startswith("deadline")
    assert why("prefill", 90, 0, 420, None, False, False) == ("skipped", "no CUDA")
    assert why("prefill", 15, 0, 420, None, False, True) is None  # a dry run needs no CUDA
    assert why("prefill", 15, 0, 420, {"kernel tests"}, True, True) == ("skipped", "not selected")


@pytest.mark.slow  # one interpreter per benchmark script (--help)
def test_every_section_script_accepts_its_arguments():
    gpu_check = load_gpu_check()
    helps = {}
    for dry_run in (False, True):
        for index, name in enumerate(ORDER, 1):
            commands = gpu_check.section_commands(name, "/tmp/out", index, dry_run)
            assert commands, name
            for command in commands:
                argv = command.argv
                if argv[1:3] == ["-m", "pytest"]:
                    targets = [a for a in argv[3:] if not a.startswith("-")][:1]
                    assert targets and (ROOT / targets[0]).exists(), (name, argv)
                    assert command.junit and command.junit.startswith("/tmp/out/")
                    continue
                script = argv[1]
                if script not in helps:
                    out = subprocess.run(
                        [sys.executable, str(ROOT / script), "--help"],
                        capture_output=True,
                        text=True,
                        cwd=ROOT,
                        env={**os.environ, "PYTHONPATH": str(ROOT)},
                        timeout=180,
                    )
                    assert out.returncode == 0, out.stderr[-2000:]
                    helps[script] = out.stdout
                for flag in (a for a in argv[2:] if a.startswith("--")):
                    assert flag in helps[script], (
                        f"{script} does not accept {flag} (gpu_check's {name} section passes it)"
                    )
                assert command.child_json and command.child_json.startswith("/tmp/out/")  # no temporary directory
    # the replayed (CUDA graph) decode variant is a section of its own: compiled with reduce-overhead on the GPU
    replay = gpu_check.section_commands("decode replay", "/tmp/out", 4, False)[0].argv
    assert replay[replay.index("--config") + 1] == "gpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_sections_are_skipped_without_cuda(tmp_path):
    out = tmp_path / "check"
    proc = run_check("--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_summary(out)
    assert summary["environment"]["device"] == "no CUDA device" and summary["state"] == "finished"
    for record in summary["sections"]:
        assert (record["status"], record["reason"]) == ("skipped", "no CUDA")
        assert json.loads((out / record["json"]).read_text())["status"] == "skipped"
        assert (out / record["log"]).read_text().startswith("skipped: no CUDA")
    assert "| kernel tests | skipped |" in (out / "summary.md").read_text()


def test_sections_past_the_deadline_are_recorded_not_started(tmp_path):
    out = tmp_path / "check"
    proc = run_check("--dry-run", "--deadline-s", "5", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]  # nothing ran, nothing failed
    for record in read_summary(out)["sections"]:
        assert record["status"] == "not started" and record["reason"].startswith("deadline"), record
        assert (out / record["json"]).exists() and (out / record["log"]).exists()


@pytest.mark.slow
@pytest.mark.serial  # the dry run starts three pytest processes at once, inside a 22 s section budget
def test_dry_run_writes_each_section_as_it_goes_and_records_a_stop(tmp_path):
    """The first section's log, JSON and junit files and a valid summary exist once it ends, while
    the next one runs; SIGTERM then stops the check, which records that section "killed"."""
    out = tmp_path / "check"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        first = out / "01-kernel-tests.json"
        limit = time.monotonic() + 150
        while time.monotonic() < limit and proc.poll() is None:
            if first.exists() and json.loads(first.read_text())["status"] not in ("running", "pending"):
                break
            time.sleep(0.2)
        record = json.loads(first.read_text())
        assert record["status"] == "passed", record
        assert record["tests"]["passed"] > 0 and len(record["commands"]) == 3  # three pytest processes in parallel
        log = (out / "01-kernel-tests.log").read_text()
        assert "[test_block_gather]" in log and " passed" in log
        summary = read_summary(out)
        assert summary["sections"][0]["status"] == "passed"
        assert {r["status"] for r in summary["sections"][1:]} <= {"pending", "running"}
        assert summary["environment"]["torch"] == torch.__version__
        time.sleep(1.0)  # the second section has started
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, output[-3000:]
    summary = read_summary(out)
    assert summary["state"].startswith("stopped")
    statuses = [r["status"] for r in summary["sections"]]
    assert statuses[0] == "passed" and statuses[1] == "killed" and set(statuses[2:]) == {"pending"}, statuses
    assert json.loads((out / "02-runtime-parity.json").read_text())["status"] == "killed"
    assert (out / "02-runtime-parity.log").exists() and (out / "summary.md").exists()
