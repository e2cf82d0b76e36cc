"""Measurement helpers of the runtime decode benchmark (`benchmarks/decode_sweep.py` drives them):
one (mode, batch, length) decode run on a randomly filled cache, the share of fetch time the
prefetch hides, and block-gather bandwidth against a plain pinned copy.

    PYTHONPATH=. python benchmarks/decode_sweep.py --config gpu-short    # what gpu_check.py runs
    PYTHONPATH=. python benchmarks/decode_sweep.py --config cpu          # a small CPU run

Per (context length, mode, batch) `run_config` fills the cache with random post-RoPE K/V (no prefill;
the decode cost does not depend on how the keys were made), then runs `--warmup` steps (the first
one fills empty slots) and `--steps` timed steps: decode tokens/s (batch x steps / time), H2D
bytes per step, host syncs in one decode step (`torch.cuda.set_sync_debug_mode`).  Per (length,
batch) `hidden_shares` gives the share of fetch time hidden by the prefetch:
    hidden = 1 - (t[forecast-offload] - t[no-offload]) / (t[forecast-sync] - t[no-offload]).
"""

from __future__ import annotations

import gc
import os
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# benchmarks/kernels.py shadows HF's `kernels`
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.append(HERE)  # appended, so HF's `kernels` still wins: for decode_fill
from decode_fill import fill_random  # noqa: E402  (at import, while benchmarks/ is on the path)

MINICPM41_8B = dict(
    vocab_size=73448,
    hidden_size=4096,
    intermediate_size=16384,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=2,
    head_dim=128,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    max_position_embeddings=262144,
    bos_token_id=None,
    eos_token_id=None,
    tie_word_embeddings=False,
)


def is_oom(error: BaseException) -> bool:
    text = str(error).lower()
    return (
        isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError))
        or "out of memory" in text
        or "could not pin" in text
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_syncs(fn, device: torch.device) -> int | None:
    """Host-device synchronisations during fn() (CUDA only: set_sync_debug_mode warns on each)."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchron" in str(w.message).lower() for w in caught)


def split_mode(spec: str) -> tuple[str, str | None]:
    """A decode cell's mode: "MODE" (its own selector) or "MODE:SELECTOR" (another registered one, e.g.
    "forecast-offload:forecast-carry-pin") -> (mode, selector or None); a ValueError naming the choices."""
    from forecastkv.modes import MODES, SELECTORS

    mode, _, selector = spec.partition(":")
    if mode not in MODES or (selector and selector not in SELECTORS):
        raise ValueError(f"mode {spec!r}: expected MODE or MODE:SELECTOR, MODE in {MODES}, SELECTOR in {SELECTORS}")
    return mode, selector or None


def run_config(model, mode: str, batch: int, length: int, args, device) -> dict:
    """One decode cell: `mode` ("MODE" or "MODE:SELECTOR", `split_mode`) at `batch` x `length` random K/V."""
    from forecastkv.inference import OffloadedSparseCache
    from forecastkv.inference.fill import greedy_steps

    config = model.config
    total = length + args.warmup + args.steps + 2
    mode, selector = split_mode(mode)
    cache = OffloadedSparseCache.for_model(model, mode=mode, selector=selector, max_length=total)
    try:
        fill_random(cache, batch, length, config.num_key_value_heads, config.head_dim, model.dtype, device)
        synchronize(device)
        token = torch.zeros((batch, 1), dtype=torch.long, device=device)
        tokens, _, _ = greedy_steps(model, cache, token, args.warmup, sync=lambda: synchronize(device))
        token = tokens[:, -1:]
        syncs = count_syncs(lambda: greedy_steps(model, cache, token, 1), device)
        synchronize(device)
        start = time.perf_counter()
        greedy_steps(model, cache, token, args.steps)
        synchronize(device)
        seconds = (time.perf_counter() - start) / args.steps
        stats = cache.stats()
        steady = stats["h2d_bytes_per_step"][args.warmup :]
        return {
            "status": "ok",
            "step_s": seconds,
            "tokens_per_s": batch / seconds,
            "syncs_per_step": syncs,
            "h2d_bytes_per_step": sum(steady) / len(steady) if steady else 0.0,
            "hit_rate": stats["hit_rate"],
            "device_nbytes": stats["device_nbytes"],
            "host_nbytes": stats["host_nbytes"],
        }
    finally:
        cache = None  # free before the next config
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def gather_bandwidth(device: torch.device, dtype: torch.dtype, tiny: bool) -> dict:
    """GB/s of the block gather (misses scattered over a long host store) vs one pinned copy."""
    from forecastkv import kernels

    batch, seq, heads, dim, block, slots = (1, 256, 2, 16, 8, 4) if tiny else (4, 65536, 2, 128, 64, 96)
    pin = device.type == "cuda"
    host_k = torch.randn(batch, seq, heads, dim).to(dtype)
    host_v = torch.randn(batch, seq, heads, dim).to(dtype)
    if pin:
        host_k, host_v = host_k.pin_memory(), host_v.pin_memory()
    k_slots = torch.empty(batch, slots * block, heads, dim, dtype=dtype, device=device)
    v_slots = torch.empty_like(k_slots)
    n_blocks = seq // block
    ids = (
        torch.stack([torch.randperm(n_blocks)[:slots] for _ in range(heads * batch)])
        .view(heads, batch, slots)
        .to(device)
    )
    nbytes = 2 * k_slots.numel() * k_slots.element_size()
    flat = torch.empty(nbytes // 2, dtype=torch.uint8, pin_memory=pin)

    def timed(fn, reps=10):
        fn()
        synchronize(device)
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        synchronize(device)
        return (time.perf_counter() - start) / reps

    gather_s = timed(lambda: kernels.block_gather(host_k, host_v, ids, k_slots, v_slots, block, check_ids=False))
    copy_s = timed(lambda: (flat.to(device, non_blocking=pin), flat.to(device, non_blocking=pin)))
    return {"bytes": nbytes, "gather_GBps": nbytes / gather_s / 1e9, "pinned_copy_GBps": nbytes / copy_s / 1e9}


def hidden_shares(runs: list[dict]) -> list[dict]:
    """Per (length, batch): share of the synchronous fetch time the prefetch hides, and the
    forecast-offload speed-up over sparse-offload and its step time relative to no-offload."""
    by_key = {(r["length"], r["batch"], r["mode"]): r for r in runs if r.get("status") == "ok"}
    shares = []
    for length, batch in sorted({(r["length"], r["batch"]) for r in runs}):
        get = lambda mode: by_key.get((length, batch, mode), {}).get("step_s")
        base, sync, overlap, sparse = (
            get("no-offload"),
            get("forecast-sync"),
            get("forecast-offload"),
            get("sparse-offload"),
        )
        entry = {"length": length, "batch": batch}
        if None not in (base, sync, overlap) and sync > base:
            entry["hidden_fetch_share"] = 1.0 - (overlap - base) / (sync - base)
        if None not in (overlap, sparse):
            entry["forecast_vs_sparse_speedup"] = sparse / overlap
        if None not in (overlap, base):
            entry["forecast_step_vs_no_offload"] = overlap / base
        shares.append(entry)
    return shares
