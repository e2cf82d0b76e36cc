"""GPU check of the kernels and the runtime in about 7 minutes on one H100/H200, cheap correctness first:

    python3 benchmarks/gpu_check.py --out DIR [--deadline-s 420] [--sections NAME ...] [--dry-run]

Sections, in this order (`SECTIONS`: name, budget seconds on the GPU, budget with --dry-run):
1. kernel tests: the compiled Triton kernel tests on CUDA (TRITON_INTERPRET unset), two pytest
   processes per file of tests/kernels (its test functions dealt between them), in parallel, plus
   the CUDA-only tests of tests/modeling;
2. runtime parity: tests/inference/test_cuda_runtime.py, one process per policy (every offload
   mode = SparseCache's tokens, no host sync in a decode step), and the CUDA test of
   tests/serving/test_page_offload.py (the vLLM connector's runtime: loads on the side stream
   through the UVA gather into the pages);
3. decode sweep: benchmarks/decode_sweep.py at 32K and 128K, batch 1 and 4, modes no-offload /
   sparse-offload / forecast-sync / forecast-offload, and forecast-offload with the forecast-carry-pin
   selector (the quality suite's layer-ahead rule), on MiniCPM4.1-8B-shaped random weights, the
   cache filled with random K/V (no prefill), decode timed first, a 32K prefill last;
4. decode replay: benchmarks/decode_compile.py --config gpu: the decode step's layers compiled
   with mode="reduce-overhead" (a replayed CUDA graph per step) against eager, at 32K batch 4,
   no-offload and forecast-offload, on 8 MiniCPM4.1-8B-shaped layers: tokens/s both ways, the
   compile time, the logit difference, and inductor's counters (cudagraph skips);
5. kernel bench: benchmarks/kernel_timing.py (block gather vs a pinned copy of the same bytes, sparse
   decode, block scores), short;
6. prefill: benchmarks/prefill.py --gpu-check: sparse vs dense prefill at 128K, then 32K, on
   MiniCPM4.1-8B-shaped random weights (4 layers, bf16): the speedup, the selection share of
   sparse prefill time (fused stage-1 kernel), any eager FlexAttention fallback (with its
   shape), and whether the goals (>= 2.2x, <= 20% selection, no fallback) are met.

A section starts only if its budget fits before the global deadline (else it is recorded
"not started: deadline"); it runs as subprocesses from the repository root with PYTHONPATH set to
it, killed at its budget.  Their output is streamed line by line into DIR/<nn>-<section>.log (and
echoed here) as it comes; DIR/<nn>-<section>.json holds the status (passed / failed / timeout /
killed / skipped / not started), seconds, commands, return codes and the child's own JSON summary
(children write DIR/<nn>-<section>.child.json, pytest DIR/<nn>-<section>.<file>.xml).
DIR/summary.json and DIR/summary.md (date, machine, versions, every section) are rewritten
atomically before and after every section, so a run killed at any point leaves what it measured.
Exit code 0 when every section that ran passed.

Without CUDA every section is "skipped: no CUDA".  `--dry-run` (CPU machines) runs the CPU-runnable
part of every section at tiny size instead (kernel tests under TRITON_INTERPRET=1 on a few tests,
the runtime test's CPU part, the benchmarks' tiny CPU configurations), in about a minute.
This script imports neither torch nor the package: the environment probe is a subprocess too.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# running this file puts benchmarks/ on sys.path, where kernels.py would shadow HF's `kernels`
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

DEFAULT_DEADLINE_S = 420.0
PROBE_TIMEOUT_S = 90
# (name, budget seconds on the GPU, budget seconds with --dry-run), in the order they run.  The GPU
# budgets sum to 400 s: with the probe (a few seconds) they fit the default 7-minute deadline.
# The dry-run budgets sum to 120 s (a dry run takes about 50 s on a 2-core CPU).
SECTIONS = (
    ("kernel tests", 80.0, 22.0),
    ("runtime parity", 70.0, 28.0),
    ("decode sweep", 100.0, 20.0),
    ("decode replay", 50.0, 20.0),
    ("kernel bench", 20.0, 12.0),
    ("prefill", 80.0, 18.0),
)
KERNEL_TEST_SHARDS = 2  # pytest processes per file of tests/kernels (Triton compiles are per process, CPU-bound)
RUNTIME_SHARDS = ("infllmv2", "nosa")  # one pytest process per policy of tests/inference/test_cuda_runtime.py
SECTION_NAMES = tuple(name for name, _, _ in SECTIONS)
# the recommended layer-ahead selector last in each (length, batch): the first cell the budget drops
DECODE_MODES = (
    "no-offload",
    "sparse-offload",
    "forecast-sync",
    "forecast-offload",
    "forecast-offload:forecast-carry-pin",
)
# seconds of a section's budget kept back from the child's own `--budget-s`: the imports and model
# build before its clock starts, and the last cell it may start just before its budget ends (the
# decode sweep's one prefill cell, last, may compile FlexAttention first: it gets more)
DECODE_RESERVE_S, DECODE_RESERVE_DRY_S = 45.0, 8.0
DECODE_PREFILL_RESERVE_S, DECODE_PREFILL_RESERVE_DRY_S = 75.0, 10.0
PREFILL_RESERVE_S, PREFILL_RESERVE_DRY_S = 50.0, 12.0
REPLAY_RESERVE_S, REPLAY_RESERVE_DRY_S = 35.0, 12.0  # the model build, then one cell's compile
NOTES: dict = {}
DONE = ("passed", "failed", "timeout", "killed")  # statuses of a section that ran


class Interrupted(Exception):
    """SIGTERM / SIGINT while a section runs: its children are stopped and what ran is recorded."""


@dataclass
class Command:
    label: str
    argv: list[str]
    env: dict = field(default_factory=dict)  # overrides; None values remove the variable
    child_json: str | None = None  # a JSON file the child writes (its "summary" goes into the section)
    junit: str | None = None  # pytest's --junitxml file


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def stem(index: int, name: str) -> str:
    """The file stem of section `index` (1-based): 01-kernel-tests."""
    return f"{index:02d}-{slug(name)}"


def budget_of(name: str, dry_run: bool) -> float:
    return next(dry if dry_run else gpu for n, gpu, dry in SECTIONS if n == name)


def pytest_command(
    label: str, targets: list[str], out_dir: str, base: str, marker: str | None, extra=(), env=None
) -> Command:
    junit = os.path.join(out_dir, f"{base}.{slug(label)}.xml")
    argv = [
        sys.executable,
        "-m",
        "pytest",
        *targets,
        "-q",
        "-rfE",
        "-p",
        "no:cacheprovider",
        "--junitxml",
        junit,
        *extra,
    ]
    if marker:
        argv += ["-m", marker]
    if importlib.util.find_spec("pytest_timeout") is not None:
        argv += ["--timeout", "120"]
    return Command(label, argv, env=dict(env or {}), junit=junit)


def test_shards(path: str, shards: int) -> list[list[str]]:
    """The test functions of `path` (read, not imported) dealt into at most `shards` groups."""
    with open(path, encoding="utf-8") as f:
        names = re.findall(r"^def (test_\w+)", f.read(), re.MULTILINE)
    return [group for group in (names[i::shards] for i in range(shards)) if group]


def script(name: str) -> str:
    return os.path.join("benchmarks", name)


def section_commands(name: str, out_dir: str, index: int, dry_run: bool) -> list[Command]:
    """The commands of section `name` (run in parallel), writing their files under `out_dir`."""
    base = stem(index, name)
    child = os.path.join(out_dir, f"{base}.child.json")
    budget = budget_of(name, dry_run)
    py = sys.executable
    if name == "kernel tests":
        if dry_run:  # a few tests of two files in Triton's interpreter, and the CUDA-only ones (skipped)
            env = {"TRITON_INTERPRET": "1"}
            return [
                pytest_command(
                    "test_block_gather",
                    ["tests/kernels/test_block_gather.py"],
                    out_dir,
                    base,
                    None,
                    ["-k", "reference_values or program_counts"],
                    env,
                ),
                pytest_command(
                    "test_sparse_decode",
                    ["tests/kernels/test_sparse_decode.py"],
                    out_dir,
                    base,
                    None,
                    ["-k", "no_valid_key"],
                    env,
                ),
                pytest_command("modeling-cuda", ["tests/modeling"], out_dir, base, "cuda", (), env),
            ]
        commands = []
        for path in sorted(glob.glob(os.path.join(ROOT, "tests", "kernels", "test_*.py"))):
            groups = test_shards(path, KERNEL_TEST_SHARDS)
            for i, group in enumerate(groups, 1):
                label = os.path.splitext(os.path.basename(path))[0] + (
                    f"-{i}of{len(groups)}" if len(groups) > 1 else ""
                )
                commands.append(
                    pytest_command(
                        label, [os.path.relpath(path, ROOT)], out_dir, base, "not slow", ["-k", " or ".join(group)]
                    )
                )
        return commands + [pytest_command("modeling-cuda", ["tests/modeling"], out_dir, base, "cuda")]
    if name == "runtime parity":
        target = ["tests/inference/test_cuda_runtime.py"]
        if dry_run:  # the CUDA tests skip; the CPU check of the decode loop runs
            return [pytest_command("test_cuda_runtime", target, out_dir, base, None, env={"TRITON_INTERPRET": "1"})]
        pages = ["tests/serving/test_page_offload.py"]  # vLLM's connector runtime: side stream, UVA gather
        return [
            pytest_command(f"test_cuda_runtime-{policy}", target, out_dir, base, "cuda", ["-k", policy])
            for policy in RUNTIME_SHARDS
        ] + [pytest_command("test_page_offload", pages, out_dir, base, "cuda")]
    if name == "decode sweep":
        if dry_run:
            size = [
                "--config",
                "tiny",
                "--lengths",
                "512",
                "--batches",
                "1",
                "--steps",
                "1",
                "--warmup",
                "1",
                "--prefill-lengths",
                "512",
                "--prefill-batches",
                "1",
                "--no-plot",
            ]
            inner, prefill = budget - DECODE_RESERVE_DRY_S, budget - DECODE_PREFILL_RESERVE_DRY_S
        else:
            size = [
                "--config",
                "gpu-short",
                "--lengths",
                "32768",
                "131072",
                "--batches",
                "1",
                "4",
                "--prefill-lengths",
                "32768",
                "--prefill-batches",
                "1",
            ]
            inner, prefill = budget - DECODE_RESERVE_S, budget - DECODE_PREFILL_RESERVE_S
        argv = [
            py,
            script("decode_sweep.py"),
            *size,
            "--modes",
            *DECODE_MODES,
            "--budget-s",
            f"{inner:.0f}",
            "--prefill-budget-s",
            f"{prefill:.0f}",
            "--out",
            child,
        ]
        return [Command("decode_sweep", argv, child_json=child)]
    if name == "decode replay":
        # compiled decode steps (CUDA graphs: mode="reduce-overhead") against eager; a dry run traces only
        size = (
            ["--config", "tiny-eager", "--rounds", "1", "--steps", "1", "--warmup", "0", "--parity-steps", "1"]
            if dry_run
            else ["--config", "gpu"]
        )
        inner = budget - (REPLAY_RESERVE_DRY_S if dry_run else REPLAY_RESERVE_S)
        return [
            Command(
                "decode_compile",
                [py, script("decode_compile.py"), *size, "--budget-s", f"{inner:.0f}", "--out", child],
                child_json=child,
            )
        ]
    if name == "kernel bench":
        size = ["--device", "cpu", "--batches", "1", "--reps", "2"] if dry_run else ["--reps", "10"]
        return [Command("kernels", [py, script("kernel_timing.py"), *size, "--json", child], child_json=child)]
    if name == "prefill":
        inner = budget - (PREFILL_RESERVE_DRY_S if dry_run else PREFILL_RESERVE_S)
        size = ["--tiny"] if dry_run else ["--gpu-check"]
        return [
            Command(
                "prefill",
                [py, script("prefill.py"), *size, "--budget-s", f"{inner:.0f}", "--json", child],
                child_json=child,
            )
        ]
    raise ValueError(f"unknown section {name!r}; sections: {SECTION_NAMES}")


# ----------------------------------------------------------------------------------------------
# running
# ----------------------------------------------------------------------------------------------


def child_env(overrides: dict) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter (a dry run sets it back)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.setdefault(name, "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM to the child's process group (it was started in a session of its own), then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_commands(commands: list[Command], log_path: str, timeout_s: float, echo_prefix: str, results: list) -> bool:
    """Run `commands` in parallel, each line of their output (stdout and stderr) appended to
    `log_path` (flushed per line) and echoed, prefixed with the command's label when there are
    several.  Fills `results` (per command {label, argv, returncode, seconds, killed}) as they
    end, also when interrupted; returns whether the budget `timeout_s` ran out."""
    lock = threading.Lock()
    procs, pumps = [], []
    started = time.monotonic()
    with open(log_path, "a", encoding="utf-8") as log:

        def emit(text: str) -> None:
            with lock:
                log.write(text if text.endswith("\n") else text + "\n")
                log.flush()
                sys.stdout.write(f"[{echo_prefix}] {text}" if text.endswith("\n") else f"[{echo_prefix}] {text}\n")
                sys.stdout.flush()

        def pump(proc: subprocess.Popen, prefix: str) -> None:
            for line in proc.stdout:
                emit(prefix + line)

        timed_out = False
        try:
            for command in commands:
                prefix = f"[{command.label}] " if len(commands) > 1 else ""
                emit(f"{prefix}$ {shlex.join(command.argv)}")
                proc = subprocess.Popen(
                    command.argv,
                    cwd=ROOT,
                    env=child_env(command.env),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    bufsize=1,
                    errors="replace",
                    start_new_session=True,
                )
                procs.append(proc)
                results.append(
                    {
                        "label": command.label,
                        "argv": command.argv,
                        "returncode": None,
                        "seconds": None,
                        "_t0": time.monotonic(),
                    }
                )
                thread = threading.Thread(target=pump, args=(proc, prefix), daemon=True)
                thread.start()
                pumps.append(thread)
            while True:
                for proc, result in zip(procs, results):
                    if result["seconds"] is None and proc.poll() is not None:
                        result["returncode"], result["seconds"] = (
                            proc.returncode,
                            round(time.monotonic() - result["_t0"], 1),
                        )
                if all(r["seconds"] is not None for r in results):
                    break
                if time.monotonic() - started > timeout_s:
                    timed_out = True
                    emit(
                        f"[gpu_check] budget of {timeout_s:.0f} s spent: "
                        f"stopping {sum(r['seconds'] is None for r in results)} command(s)"
                    )
                    break
                time.sleep(0.2)
        finally:  # a timeout, or Interrupted / KeyboardInterrupt from the signal handler
            for proc, result in zip(procs, results):
                if proc.poll() is None:
                    stop(proc)
                    result["returncode"], result["killed"] = proc.returncode, True
                if result["seconds"] is None:
                    result["seconds"] = round(time.monotonic() - result["_t0"], 1)
            for thread in pumps:
                thread.join(timeout=5)
            for result in results:
                result.pop("_t0", None)
                with lock:
                    log.write(
                        f"# {result['label']}: return code {result['returncode']}, {result['seconds']} s"
                        f"{' (killed)' if result.get('killed') else ''}\n"
                    )
                    log.flush()
    return timed_out


def junit_counts(path: str) -> dict | None:
    """{tests, passed, failed, errors, skipped, failed_tests} from pytest's junit XML, None if absent."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname', '')}::{case.get('name', '')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {
        "tests": counts["tests"],
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
        "failed_tests": failed[:50],
    }


def read_child_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    out = {"path": os.path.basename(path)}
    if isinstance(data, dict):
        for key in ("summary", "complete", "seconds", "device"):
            if key in data:
                out[key] = data[key]
    return out


# ----------------------------------------------------------------------------------------------
# records
# ----------------------------------------------------------------------------------------------


def write_atomic(path: str, text: str) -> None:
    """A temporary file beside `path`, then os.replace: readers see the old file or the new one."""
    fd, tmp = tempfile.mkstemp(
        dir=os.path.dirname(os.path.abspath(path)), prefix=f".{os.path.basename(path)}.", suffix=".tmp"
    )
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def probe_environment() -> dict:
    """Python, torch, CUDA, device, triton and transformers versions (from a subprocess: a broken
    CUDA install is a result, not a crash of the check)."""
    code = r"""
import json, os, platform, sys
from importlib import metadata
info = {"python": sys.version.split()[0], "platform": platform.platform(), "cpu_count": os.cpu_count()}
try:
    info["host_memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
except (ValueError, OSError, AttributeError):
    pass
for name in ("triton", "transformers"):
    try:
        info[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        info[name] = None
import torch
info.update(torch=torch.__version__, cuda_version=torch.version.cuda, cuda_available=torch.cuda.is_available())
if info["cuda_available"]:
    props = torch.cuda.get_device_properties(0)
    info.update(device=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                device_memory_gib=round(props.total_memory / 2**30, 1))
else:
    info["device"] = "no CUDA device"
print("PROBE " + json.dumps(info))
"""
    info: dict = {}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=child_env({}),
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
        if lines:
            info = json.loads(lines[-1][len("PROBE ") :])
        else:
            info = {"probe_error": f"return code {proc.returncode}: {proc.stderr.strip()[-500:]}"}
    except subprocess.TimeoutExpired:
        info = {"probe_error": f"environment probe timed out after {PROBE_TIMEOUT_S} s"}
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
        )
        if smi.returncode == 0 and smi.stdout.strip():
            info["nvidia_smi"] = smi.stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def machine_line(env: dict) -> str:
    if "probe" in env:
        return "(probing the environment)"
    if "probe_error" in env:
        return f"environment probe failed: {env['probe_error']}"
    return (
        f"{env.get('device')} (CUDA {env.get('cuda_version')}), torch {env.get('torch')}, triton {env.get('triton')}, "
        f"transformers {env.get('transformers')}, python {env.get('python')}, {env.get('cpu_count')} CPUs"
    )


def detail(record: dict) -> str:
    """One line for the table: test counts, or how many headline numbers the child wrote."""
    parts = []
    if record.get("reason"):
        parts.append(record["reason"])
    tests = record.get("tests")
    if tests:
        parts.append(
            ", ".join(f"{tests[k]} {k}" for k in ("passed", "failed", "errors", "skipped") if tests.get(k))
            or "no tests"
        )
    child = record.get("child")
    if child and child.get("summary") is not None:
        parts.append(f"{len(child['summary'])} headline numbers{'' if child.get('complete', True) else ' (partial)'}")
    for command in record.get("commands", []):
        if command.get("returncode") not in (0, None) or command.get("killed"):
            parts.append(f"{command['label']}: rc {command['returncode']}{' killed' if command.get('killed') else ''}")
    return "; ".join(parts)


def summary_markdown(summary: dict) -> str:
    lines = [
        f"# GPU check {summary['date']}",
        "",
        f"Machine: {summary['machine']}",
        "",
        f"Command: `{summary['command']}`  ",
        f"Deadline {summary['deadline_s']:.0f} s, elapsed {summary['elapsed_s']:.0f} s"
        f"{', dry run' if summary['dry_run'] else ''}; {summary['state']}",
        "",
        "| # | section | status | seconds | budget | detail |",
        "|---|---|---|---|---|---|",
    ]
    for record in summary["sections"]:
        seconds = "" if record.get("seconds") is None else f"{record['seconds']:.0f}"
        lines.append(
            f"| {record['index']} | {record['section']} | {record['status']} | {seconds} | "
            f"{record['budget_s']:.0f} | {detail(record)} |"
        )
    for record in summary["sections"]:
        child = record.get("child") or {}
        failed = (record.get("tests") or {}).get("failed_tests") or []
        notes = (record.get("notes") or {}) if record["status"] in DONE else {}
        if not (child.get("summary") or failed or notes):
            continue
        lines += ["", f"## {record['index']}. {record['section']} ({record['log']})", ""]
        lines += [f"- FAILED {name}" for name in failed]
        lines += [f"- {key}: {value}" for key, value in (child.get("summary") or {}).items()]
        lines += [f"- note, {key}: {value}" for key, value in notes.items()]
    return "\n".join(lines) + "\n"


class Recorder:
    """Keeps every section's record and rewrites its JSON, summary.json and summary.md atomically."""

    def __init__(self, out_dir: str, args, environment: dict, started: float):
        self.out_dir, self.started = out_dir, started
        self.head = {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join([os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] + sys.argv[1:]),
            "dry_run": args.dry_run,
            "deadline_s": args.deadline_s,
            "environment": environment,
            "machine": machine_line(environment),
        }
        self.records = []
        for index, (name, gpu, dry) in enumerate(SECTIONS, 1):
            base = stem(index, name)
            self.records.append(
                {
                    "index": index,
                    "section": name,
                    "status": "pending",
                    "reason": None,
                    "budget_s": dry if args.dry_run else gpu,
                    "seconds": None,
                    "log": f"{base}.log",
                    "json": f"{base}.json",
                    "notes": NOTES.get(name, {}),
                }
            )

    def save(self, record: dict | None = None, state: str = "running") -> dict:
        # the summary first: whoever sees a section's JSON finished finds the summary saying so too
        ran = [r for r in self.records if r["status"] in DONE]
        summary = {
            **self.head,
            "elapsed_s": round(time.monotonic() - self.started, 1),
            "state": state,
            "ok": all(r["status"] == "passed" for r in ran),
            "sections": self.records,
        }
        write_atomic(os.path.join(self.out_dir, "summary.json"), json.dumps(summary, indent=1) + "\n")
        write_atomic(os.path.join(self.out_dir, "summary.md"), summary_markdown(summary))
        if record is not None:
            write_atomic(os.path.join(self.out_dir, record["json"]), json.dumps(record, indent=1) + "\n")
        return summary


def run_section(record: dict, commands: list[Command], out_dir: str) -> None:
    """Run one section's commands and fill `record` (status, seconds, commands, tests, child)."""
    record.update(
        status="running",
        started_at=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        commands=[{"label": c.label, "argv": c.argv} for c in commands],
    )
    t0 = time.monotonic()
    interrupted, results, timed_out = None, [], False
    try:
        timed_out = run_commands(
            commands, os.path.join(out_dir, record["log"]), record["budget_s"], record["section"], results
        )
    except (Interrupted, KeyboardInterrupt) as error:
        interrupted = error
    record["seconds"] = round(time.monotonic() - t0, 1)
    record["commands"] = results
    tests = [junit_counts(c.junit) for c in commands if c.junit]
    tests = [t for t in tests if t is not None]
    if tests:
        record["tests"] = {k: sum(t[k] for t in tests) for k in ("tests", "passed", "failed", "errors", "skipped")}
        record["tests"]["failed_tests"] = [name for t in tests for name in t["failed_tests"]]
    children = [read_child_json(c.child_json) for c in commands if c.child_json]
    if children and children[0] is not None:
        record["child"] = children[0]
    if interrupted is not None:
        record.update(status="killed", reason="gpu_check was stopped")
        raise interrupted
    if timed_out:
        record.update(status="timeout", reason=f"budget {record['budget_s']:.0f} s spent")
    elif all(r.get("returncode") == 0 for r in results):
        record["status"] = "passed"
    else:
        record["status"] = "failed"


def why_not_run(name: str, budget_s: float, elapsed_s: float, deadline_s: float, selected, cuda: bool, dry_run: bool):
    """(status, reason) of a section that is not run now, None if it runs: not selected, no CUDA
    (without --dry-run), or its budget ends past the deadline."""
    if selected is not None and name not in selected:
        return "skipped", "not selected"
    if not cuda and not dry_run:
        return "skipped", "no CUDA"
    if elapsed_s + budget_s > deadline_s:
        return "not started", f"deadline: {elapsed_s:.0f} s + budget {budget_s:.0f} s > {deadline_s:.0f} s"
    return None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="sections: " + "; ".join(f"{n} ({g:.0f} s, dry run {d:.0f} s)" for n, g, d in SECTIONS),
    )
    parser.add_argument(
        "--out", required=True, help="directory for the logs, JSON and summary (created; files in it are overwritten)"
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=DEFAULT_DEADLINE_S,
        help=(
            "no section starts unless its budget ends before this many seconds from the start "
            f"(default {DEFAULT_DEADLINE_S:.0f})"
        ),
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="the CPU-runnable part of every section at tiny size (no CUDA needed)"
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        default=None,
        metavar="NAME",
        help="run only these sections (names or numbers); the others are recorded 'skipped: not selected'",
    )
    args = parser.parse_args(argv)
    if args.sections is not None:
        chosen = set()
        for item in args.sections:
            if item.isdigit() and 1 <= int(item) <= len(SECTIONS):
                chosen.add(SECTION_NAMES[int(item) - 1])
            elif item in SECTION_NAMES:
                chosen.add(item)
            else:
                parser.error(f"unknown section {item!r}; sections: {', '.join(SECTION_NAMES)} (or 1-{len(SECTIONS)})")
        args.sections = chosen
    return args


def main(argv=None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)

    def on_signal(signum, frame):
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    recorder = Recorder(out_dir, args, {"probe": "running"}, started)
    recorder.save(state="probing the environment")
    environment = probe_environment()
    recorder.head.update(environment=environment, machine=machine_line(environment))
    print(
        f"== gpu_check: {recorder.head['machine']}; deadline {args.deadline_s:.0f} s"
        f"{'; dry run' if args.dry_run else ''}; writing {out_dir}",
        flush=True,
    )
    cuda = bool(environment.get("cuda_available"))
    recorder.save()
    state = "finished"
    try:
        for record in recorder.records:
            name, log = record["section"], os.path.join(out_dir, record["log"])
            elapsed = time.monotonic() - started
            held = why_not_run(name, record["budget_s"], elapsed, args.deadline_s, args.sections, cuda, args.dry_run)
            for old in glob.glob(os.path.join(out_dir, glob.escape(stem(record["index"], name)) + ".*")):
                os.unlink(old)  # a previous run's files of this section (logs, child JSON, junit XML)
            if held is not None:
                record["status"], record["reason"] = held
                write_atomic(log, f"{record['status']}: {record['reason']}\n")
                print(f"== {record['index']}. {name}: {record['status']} ({record['reason']})", flush=True)
                recorder.save(record)
                continue
            commands = section_commands(name, out_dir, record["index"], args.dry_run)
            print(f"== {record['index']}. {name} (budget {record['budget_s']:.0f} s, at {elapsed:.0f} s)", flush=True)
            with open(log, "w", encoding="utf-8") as f:
                f.write(
                    f"# {name}: started at {elapsed:.0f} s of a {args.deadline_s:.0f} s deadline, "
                    f"budget {record['budget_s']:.0f} s\n"
                )
            record.update(status="running")
            recorder.save(record)
            try:
                run_section(record, commands, out_dir)
            finally:
                recorder.save(record)
            print(
                f"== {record['index']}. {name}: {record['status']} in {record['seconds']:.0f} s; {detail(record)}",
                flush=True,
            )
    except (Interrupted, KeyboardInterrupt) as error:
        state = f"stopped ({error or 'interrupt'})"
        print(f"== gpu_check stopped: {state}", flush=True)
    summary = recorder.save(state=state)
    print("\n" + summary_markdown(summary), flush=True)
    if state != "finished":
        return 143
    print(
        f"total {summary['elapsed_s']:.0f} s: {'PASS' if summary['ok'] else 'FAIL'} (summary in {out_dir})", flush=True
    )
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
