"""The runtime's text summary and the CLI's --offload option."""

from __future__ import annotations

from forecastkv.cli import OFFLOAD_MODES, build_parser
from forecastkv.inference import MODES
from forecastkv.inference.report import format_stats, generate_offloaded
from tests.inference.test_offloaded import left_padded
from tests.modeling.test_model import tiny_model


def test_cli_offload_option_lists_the_runtime_modes():
    assert OFFLOAD_MODES == MODES
    args = build_parser().parse_args(["generate", "--prompt", "x", "--offload", "forecast-offload", "--stats", "--forecast-init", "next_query"])
    assert args.offload == "forecast-offload" and args.stats and args.forecast_init == "next_query"


def test_summary_reports_bytes_and_hit_rates():
    model = tiny_model({"policy": "infllmv2", "selector": "forecast"}, seed=2)
    ids, _ = left_padded([60])
    new_ids, cache, _ = generate_offloaded(model, ids, 5, mode="forecast-sync")
    stats = cache.stats()
    text = format_stats(stats)
    assert new_ids.shape == (1, 5) and stats["decode_steps"] == 4
    assert f"mode forecast-sync: 4 decode steps, H2D {stats['h2d_bytes_per_step_mean'] / 2**20:.2f} MiB per step" in text
    assert "per layer: 1.00 " in text  # layer 0 is resident: every block a hit
