"""benchmarks/decode_sweep.py (the runtime's efficiency sweep, also gpu_check's decode section) runs
end to end on tiny shapes: every (length, mode, batch) cell is measured or marked, and the byte
counts order as the modes' definitions say."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # the benchmark script as a subprocess
def test_tiny_sweep_writes_json_and_plot(tmp_path):
    out = tmp_path / "sweep.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    env.pop("FORECASTKV_BACKEND", None)  # the CPU reference path is what the benchmark runs here
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "decode_sweep.py"),
            "--config",
            "tiny",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    cells = {(r["length"], r["mode"], r["batch"]): r for r in results["decode"]}
    assert len(cells) == 2 * 6 * 2 and all(r["status"] == "ok" for r in cells.values())
    for length in (512, 1024):
        for batch in (1, 2):
            moved = {
                mode: cells[(length, mode, batch)]["h2d_bytes_per_step"]
                for mode in (
                    "no-offload",
                    "sparse-offload",
                    "forecast-offload",
                    "dense-offload",
                    "forecast-offload:forecast-carry-pin",
                )
            }
            assert moved["no-offload"] == 0
            assert (
                moved["forecast-offload"] < moved["dense-offload"] and moved["sparse-offload"] < moved["dense-offload"]
            )
            assert moved["forecast-offload:forecast-carry-pin"] < moved["dense-offload"]
            # at 1K the budget is selective after the warm-up step: the carrying selector misses some blocks too
            assert length == 512 or moved["forecast-offload:forecast-carry-pin"] > 0
        # whole-layer copies grow with the context; the budget does not
        assert (
            cells[(1024, "dense-offload", 1)]["h2d_bytes_per_step"]
            > cells[(512, "dense-offload", 1)]["h2d_bytes_per_step"]
        )
    assert {(r["length"], r["cache"], r["batch"]) for r in results["prefill"]} == {
        (n, c, b) for n in (512, 1024) for c in ("resident", "forecast-offload") for b in (1, 2)
    }
    assert results["gather"]["bytes"] > 0 and results["hidden_share"]
