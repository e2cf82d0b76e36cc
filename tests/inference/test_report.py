"""The runtime's text summary and the CLI's --offload option."""

from __future__ import annotations

from forecastkv.cli import build_parser
from forecastkv.inference import MODES
from forecastkv.inference.report import format_stats, generate_offloaded
from tests.helpers import left_padded, rel, tiny_model


def test_cli_offload_option_lists_the_runtime_modes():
    for mode in MODES:
        assert build_parser().parse_args(["generate", "--prompt", "x", "--offload", mode]).offload == mode
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--offload", "forecast-offload", "--stats", "--forecast-init", "next_query"]
    )
    assert args.offload == "forecast-offload" and args.stats and args.forecast_init == "next_query"


def test_summary_reports_bytes_and_hit_rates():
    model = tiny_model({"policy": "infllmv2", "selector": "forecast"}, seed=2)
    ids, _ = left_padded([60])
    new_ids, cache, _ = generate_offloaded(model, ids, 5, mode="forecast-sync")
    stats = cache.stats()
    text = format_stats(stats)
    assert new_ids.shape == (1, 5) and stats["decode_steps"] == 4
    mib = stats["h2d_bytes_per_step_mean"] / 2**20
    assert f"mode forecast-sync (selector forecast): 4 decode steps, H2D {mib:.2f} MiB per step" in text
    assert "per layer: 1.00 " in text  # layer 0 is resident: every block a hit


def test_copied_prefill_decodes_like_generate():
    """The benchmark's shortcut (prefill once, copy into each mode's cache, greedy loop) gives the
    tokens and logits of generate() with that cache."""
    import torch

    from forecastkv import SparseCache
    from forecastkv.inference import OffloadedSparseCache
    from forecastkv.inference.fill import copy_into, greedy_steps
    from forecastkv.modeling.modeling import CACHE_KWARG
    from tests.inference.test_offloaded import generate

    model = tiny_model({"policy": "nosa", "selector": "forecast"}, seed=9)
    ids, mask = left_padded([52])
    prefilled = SparseCache(model.config)
    with torch.no_grad():
        first = model(ids, **{CACHE_KWARG: prefilled}).logits[:, -1].argmax(-1, keepdim=True)
    for mode in ("forecast-offload",):
        ref_cache = OffloadedSparseCache.for_model(model, mode=mode)
        ref = generate(model, ids, mask, ref_cache, new_tokens=5)
        cache = OffloadedSparseCache.for_model(model, mode=mode)
        copy_into(prefilled, cache)
        tokens, logits, _ = greedy_steps(model, cache, first, 4)
        assert torch.equal(torch.cat([first, tokens], 1), ref.sequences[:, ids.shape[1] :])
        assert rel(logits, torch.stack(ref.logits[1:], 1)) < 1e-5
        assert cache.stats()["h2d_bytes_per_step"] == ref_cache.stats()["h2d_bytes_per_step"]
