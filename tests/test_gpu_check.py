"""benchmarks/gpu_check.py on a machine without CUDA: its GPU sections say "skipped" instead of
failing, and every section's script accepts the arguments the check passes it."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_every_section_script_accepts_its_arguments():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert {name for name, *_ in gpu_check.SECTIONS} == {"decode sweep", "prefill"}
    for name, script, extra, _ in gpu_check.SECTIONS:
        out = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert out.returncode == 0, out.stderr
        for flag in [a for a in extra if a.startswith("--")] + ["--json"]:
            assert flag in out.stdout, f"{script} does not accept {flag} (gpu_check's {name} section passes it)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_sections_are_skipped_without_cuda():
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--skip-tests", "--skip-bench"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:]
    lines = out.stdout.splitlines()
    for name in ("decode sweep", "prefill"):
        assert any(line.startswith(name) and "skipped" in line for line in lines), out.stdout[-2000:]
