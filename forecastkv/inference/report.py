"""Run greedy generation through an `OffloadedSparseCache` and summarise its counters as text."""

from __future__ import annotations

import time

import torch

from .offloaded import OffloadedSparseCache


def generate_offloaded(
    model, ids: torch.Tensor, max_new_tokens: int, mode: str | None = None, max_length: int | None = None
):
    """Greedy continuation with the KV cache offloaded in `mode`.  ids [B, T] ->
    (new ids [B, N], the cache, seconds)."""
    from ..modeling.modeling import CACHE_KWARG

    cache = OffloadedSparseCache.for_model(model, mode=mode, max_length=max_length)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
            **{CACHE_KWARG: cache},
        )
    return out[:, ids.shape[1] :], cache, time.perf_counter() - start


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _selector_note(selector: str | None) -> str:
    return "" if selector is None else f" (selector {selector})"


def format_stats(stats: dict) -> str:
    """A few lines: mode, H2D bytes per decode step, hit rate overall and per layer, tier sizes."""
    rates = stats["hit_rate_per_layer"]
    per_layer = " ".join("-" if rate is None else f"{rate:.2f}" for rate in rates)
    overall = "n/a" if stats["hit_rate"] is None else f"{100 * stats['hit_rate']:.1f}%"
    return "\n".join(
        [
            f"mode {stats['mode']}{_selector_note(stats.get('selector'))}: {stats['decode_steps']} decode steps, "
            f"H2D {_mib(stats['h2d_bytes_per_step_mean'])} per step "
            f"(prefill/other H2D {_mib(stats['h2d_other_bytes'])}, D2H {_mib(stats['d2h_bytes'])})",
            f"block hit rate {overall}; per layer: {per_layer}",
            f"device KV tier {_mib(stats['device_nbytes'])}, selection index {_mib(stats['index_nbytes'])}, "
            f"host tier {_mib(stats['host_nbytes'])}",
        ]
    )


def stats_between(before: dict, after: dict, offloaded: list[bool]) -> dict:
    """H2D bytes per step and block hit rate over the decode steps between two
    `OffloadedSparseCache.stats()` snapshots (other H2D booked meanwhile counted in, as the eval
    does); `offloaded[i]`: layer i is offloaded (only those count toward the hit rate).  The demo's
    curves and the selector study both count with it."""
    steps = after["h2d_bytes_per_step"][len(before["h2d_bytes_per_step"]) :]
    other = after["h2d_other_bytes"] - before["h2d_other_bytes"]
    wanted = sum(
        a - b
        for a, b, off in zip(after["blocks_wanted_per_layer"], before["blocks_wanted_per_layer"], offloaded)
        if off
    )
    hits = sum(a - b for a, b, off in zip(after["hits_per_layer"], before["hits_per_layer"], offloaded) if off)
    dense = after["mode"] == "dense-offload"
    return {
        "steps": len(steps),
        "h2d_bytes_per_step": (sum(steps) + other) / len(steps) if steps else None,
        "hit_rate": None if dense or not wanted else hits / wanted,
    }
