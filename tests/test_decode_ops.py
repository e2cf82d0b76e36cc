"""benchmarks/decode_ops.py runs, and its dispatcher count sees no host read in a decode step."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_decode_ops_counts_zero_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("FORECASTKV_BACKEND", "kernels=reference")  # the CPU path, not the Triton interpreter
    spec = importlib.util.spec_from_file_location("decode_ops", ROOT / "benchmarks" / "decode_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.main(
        ["--steps", "3", "--prompt", "70", "--modes", "forecast-offload", "--json", str(tmp_path / "ops.json")]
    )
    assert set(rows) == {"infllmv2/forecast-offload", "nosa/forecast-offload"}
    for row in rows.values():
        assert row["reads_per_step"] == 0 and row["ops_per_step"] > 1000
    assert (tmp_path / "ops.json").is_file()
