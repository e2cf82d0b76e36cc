"""GPU check for the kernels and the runtime, one script, about 10 minutes on one H100/H200:

1. the kernel tests on CUDA, compiled (TRITON_INTERPRET unset): `pytest tests/kernels -m "not slow"`;
2. the kernel benchmark (`benchmarks/kernels.py`);
3. the runtime: decode tokens/s of every offload mode on MiniCPM4.1-8B-shaped random bf16 weights
   at 32K-128K, batch 1-16 (OOM marked), hidden fetch share, gather vs pinned copy, host syncs per
   step, prefill tokens/s (`benchmarks/decode_sweep.py --config gpu-short`), and sparse vs dense
   prefill at 32K / 128K on MiniCPM4.1-8B-shaped layers (`benchmarks/prefill.py --gpu-check`);
4. a short table last.

    PYTHONPATH=. python benchmarks/gpu_check.py [--skip-tests] [--skip-bench] [--skip-sections [NAME ...]]

Every step runs as a subprocess from the repository root with PYTHONPATH set to it, each with its
own timeout, so a crash or hang in one still leaves the others' results and the table.  Exit code 0
when everything that ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# running this file puts benchmarks/ on sys.path, where kernels.py would shadow HF's `kernels`
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

TEST_TIMEOUT_S = 300
BENCH_TIMEOUT_S = 150
RUNTIME_TIMEOUT_S = 270  # benchmarks/decode_sweep.py stops starting new runs after RUNTIME_BUDGET_S
RUNTIME_BUDGET_S = 200
PREFILL_TIMEOUT_S = 200  # FlexAttention's compile plus dense and sparse prefill at 32K and 128K
# Extra sections, CUDA only: (name, script, arguments, timeout).  A script that writes `--json PATH`
# with a "summary" dict has it printed in the table.
SECTIONS = [
    ("decode sweep", os.path.join("benchmarks", "decode_sweep.py"), ["--config", "gpu-short", "--budget-s", str(RUNTIME_BUDGET_S)], RUNTIME_TIMEOUT_S),
    # sparse (minicpm4.1-8b preset, FlexAttention) vs dense prefill, MiniCPM4.1-8B-shaped layers
    ("prefill", os.path.join("benchmarks", "prefill.py"), ["--gpu-check"], PREFILL_TIMEOUT_S),
]


def child_env() -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.setdefault(name, "1")
    return env


def run(cmd: list[str], timeout: int) -> tuple[int | None, str, float]:
    """(return code or None on timeout, combined output, seconds)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        return proc.returncode, proc.stdout, time.perf_counter() - t0
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        return None, out + f"\n[timed out after {timeout} s]", time.perf_counter() - t0


def environment() -> str:
    code = (
        "import sys, torch\n"
        "try:\n    import triton; tv = triton.__version__\nexcept Exception as e:\n    tv = f'missing ({e})'\n"
        "dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device'\n"
        "print(f'python {sys.version.split()[0]}, torch {torch.__version__}, triton {tv}, {dev}')\n"
    )
    rc, out, _ = run([sys.executable, "-c", code], 120)
    return out.strip().splitlines()[-1] if out.strip() else f"environment probe failed (rc {rc})"


def tail(text: str, lines: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def main() -> int:
    parser = argparse.ArgumentParser(description="kernel tests (compiled) + kernel benchmark on one GPU")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--skip-sections", nargs="*", default=None, help="skip these extra sections (no names: all)")
    args = parser.parse_args()
    t_start = time.perf_counter()
    env_line = environment()
    print(f"== environment: {env_line}", flush=True)
    table: list[tuple[str, str, float, str]] = []
    ok = True

    if not args.skip_tests:
        print("== kernel tests (compiled on CUDA, TRITON_INTERPRET unset)", flush=True)
        cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-m", "not slow", "-q", "-rfE", "-p", "no:cacheprovider"]
        rc, out, secs = run(cmd, TEST_TIMEOUT_S)
        print(tail(out, 80), flush=True)
        counts = re.findall(r"^=*\s*(\d+ (?:passed|failed|errors?|skipped|deselected).*?) in [\d.]+s", out, re.MULTILINE)
        detail = counts[-1] if counts else tail(out, 1)
        status = "timeout" if rc is None else ("ok" if rc == 0 else f"FAILED (rc {rc})")
        ok &= rc == 0
        table.append(("kernel tests", status, secs, detail))

    bench_summary: dict = {}
    if not args.skip_bench:
        print("== kernel benchmark", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "bench.json")
            rc, out, secs = run([sys.executable, os.path.join("benchmarks", "kernels.py"), "--json", path], BENCH_TIMEOUT_S)
            print(tail(out, 60), flush=True)
            if rc == 0 and os.path.exists(path):
                with open(path) as f:
                    bench_summary = json.load(f).get("summary", {})
        status = "timeout" if rc is None else ("ok" if rc == 0 else f"FAILED (rc {rc})")
        ok &= rc == 0
        table.append(("kernel benchmark", status, secs, f"{len(bench_summary)} headline numbers"))

    cuda = "no CUDA device" not in env_line and "probe failed" not in env_line
    for name, script, extra, timeout in SECTIONS:
        if args.skip_sections is not None and (not args.skip_sections or name in args.skip_sections):
            continue
        if not cuda:  # these sections measure the GPU runtime; say so instead of failing
            table.append((name, "skipped", 0.0, "needs a CUDA device"))
            continue
        print(f"== {name}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "section.json")
            rc, out, secs = run([sys.executable, script, *extra, "--json", path], timeout)
            print(tail(out, 70), flush=True)
            summary = {}
            if rc == 0 and os.path.exists(path):
                with open(path) as f:
                    summary = json.load(f).get("summary", {})
        status = "timeout" if rc is None else ("ok" if rc == 0 else f"FAILED (rc {rc})")
        ok &= rc == 0
        table.append((name, status, secs, f"{len(summary)} headline numbers" if summary else "table above"))
        bench_summary.update({f"{name}: {key}": value for key, value in summary.items()})

    print("\n== summary")
    print(f"{env_line}")
    print(f"{'step':<18} {'status':<16} {'time':>7}  detail")
    for step, status, secs, detail in table:
        print(f"{step:<18} {status:<16} {secs:>6.0f}s  {detail}")
    for key, value in bench_summary.items():
        print(f"  {key:<22} {value}")
    print(f"total {time.perf_counter() - t_start:.0f} s: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
