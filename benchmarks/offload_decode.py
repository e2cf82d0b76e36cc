"""Decode throughput of every runtime mode on MiniCPM4.1-8B-shaped random bf16 weights.

    PYTHONPATH=. python benchmarks/offload_decode.py [--lengths 32768 131072] [--batches 1 4 16]
        [--modes ...] [--steps 4] [--budget-s 200] [--json FILE]
    PYTHONPATH=. python benchmarks/offload_decode.py --tiny      # a dry run on CPU, tiny shapes

Per (context length, mode, batch): the cache is filled with random post-RoPE K/V (no prefill; the
decode cost does not depend on how the keys were made), then `--warmup` steps (the first one fills
empty slots) and `--steps` timed steps.  Reported: decode tokens/s (batch x steps / time), H2D
bytes per step, host syncs in one decode step (`torch.cuda.set_sync_debug_mode`), and per
(length, batch) the share of fetch time hidden by the prefetch:
    hidden = 1 - (t[forecast-offload] - t[no-offload]) / (t[forecast-sync] - t[no-offload]).
Once a batch runs out of memory (device or pinned host) for a (length, mode), larger batches are
marked OOM, not run.  Configurations left when `--budget-s` is spent are marked "skipped".
Also: block-gather bandwidth against a plain pinned-memory copy of the same bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]  # benchmarks/kernels.py shadows HF's `kernels`

MINICPM41_8B = dict(
    vocab_size=73448, hidden_size=4096, intermediate_size=16384, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6, initializer_range=0.02,
    max_position_embeddings=262144, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, initializer_range=0.2, max_position_embeddings=4096,
    bos_token_id=None, eos_token_id=None,
)
TINY_SPARSE = dict(kernel_size=4, kernel_stride=2, block_size=8, init_blocks=1, window_size=16, topk=4, dense_len=0, lse="coarse", query_blocks=2)


def is_oom(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in text or "could not pin" in text


def build_model(tiny: bool, device: torch.device, dtype: torch.dtype):
    from forecastkv import ForecastKVConfig, ForecastKVForCausalLM
    from forecastkv.modeling.configuration import load_preset

    if tiny:
        settings, sparse = dict(TINY), dict(TINY_SPARSE)
    else:
        settings, sparse = dict(MINICPM41_8B), dict(load_preset("minicpm4.1-8b")["sparse_config"])
    sparse["selector"] = "forecast"
    config = ForecastKVConfig(**settings, sparse_config=sparse, forecast={"enabled": True, "heads_per_group": 1})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = ForecastKVForCausalLM(config).eval()  # random weights, made on the device
    finally:
        torch.set_default_dtype(previous)
    return model


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


def run_config(model, mode: str, batch: int, length: int, args, device) -> dict:
    from forecastkv.inference import OffloadedSparseCache
    from forecastkv.inference.fill import fill_random, greedy_steps

    config = model.config
    total = length + args.warmup + args.steps + 2
    cache = OffloadedSparseCache.for_model(model, mode=mode, max_length=total)
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
        steady = stats["h2d_bytes_per_step"][args.warmup:]
        return {
            "status": "ok", "step_s": seconds, "tokens_per_s": batch / seconds, "syncs_per_step": syncs,
            "h2d_bytes_per_step": sum(steady) / len(steady) if steady else 0.0, "hit_rate": stats["hit_rate"],
            "device_nbytes": stats["device_nbytes"], "host_nbytes": stats["host_nbytes"],
        }
    finally:
        del cache
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
    ids = torch.stack([torch.randperm(n_blocks)[:slots] for _ in range(heads * batch)]).view(heads, batch, slots).to(device)
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


def main(argv=None) -> dict:
    from forecastkv.inference import MODES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[131072, 32768], help="longest first: the goals are at 128K")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=200.0)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a dry run of this script)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.tiny and args.lengths == [131072, 32768]:
        args.lengths = [96, 160]
    if args.tiny and args.batches == [1, 4, 16]:
        args.batches = [1, 2]

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    started = time.perf_counter()
    model = build_model(args.tiny, device, dtype)
    print(f"model: {'tiny' if args.tiny else 'MiniCPM4.1-8B-shaped'} random weights, {dtype}, {device}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters ({time.perf_counter() - started:.0f} s)", flush=True)
    results: dict = {"device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"), "runs": []}
    with torch.no_grad():
        for length in args.lengths:
            for mode in args.modes:
                failed_at = None
                for batch in sorted(args.batches):
                    row = {"length": length, "mode": mode, "batch": batch}
                    if failed_at is not None:
                        row["status"] = f"OOM (batch {failed_at} did)"
                    elif time.perf_counter() - started > args.budget_s:
                        row["status"] = "skipped (time budget)"
                    else:
                        try:
                            row.update(run_config(model, mode, batch, length, args, device))
                        except Exception as error:  # noqa: BLE001 - OOM of either tier, reported
                            if not is_oom(error):
                                raise
                            failed_at = batch
                            row["status"] = "OOM"
                    results["runs"].append(row)
                    print(json.dumps(row), flush=True)
        results["gather"] = gather_bandwidth(device, dtype, args.tiny)
    results["hidden_share"] = hidden_shares(results["runs"])
    longest = max(args.lengths)
    results["summary"] = {
        f"{longest // 1024}K b{entry['batch']} {key}": round(value, 3)
        for entry in results["hidden_share"] if entry["length"] == longest
        for key, value in entry.items() if isinstance(value, float)
    }
    results["summary"].update({key: round(value, 2) for key, value in results["gather"].items() if key.endswith("GBps")})
    print_table(results)
    if args.json:
        with open(args.json + ".tmp", "w") as handle:
            json.dump(results, handle, indent=1)
        os.replace(args.json + ".tmp", args.json)
    return results


def hidden_shares(runs: list[dict]) -> list[dict]:
    """Per (length, batch): share of the synchronous fetch time the prefetch hides, and the
    forecast-offload speed-up over sparse-offload and its step time relative to no-offload."""
    by_key = {(r["length"], r["batch"], r["mode"]): r for r in runs if r.get("status") == "ok"}
    shares = []
    for length, batch in sorted({(r["length"], r["batch"]) for r in runs}):
        get = lambda mode: by_key.get((length, batch, mode), {}).get("step_s")
        base, sync, overlap, sparse = get("no-offload"), get("forecast-sync"), get("forecast-offload"), get("sparse-offload")
        entry = {"length": length, "batch": batch}
        if None not in (base, sync, overlap) and sync > base:
            entry["hidden_fetch_share"] = 1.0 - (overlap - base) / (sync - base)
        if None not in (overlap, sparse):
            entry["forecast_vs_sparse_speedup"] = sparse / overlap
        if None not in (overlap, base):
            entry["forecast_step_vs_no_offload"] = overlap / base
        shares.append(entry)
    return shares


def print_table(results: dict) -> None:
    print(f"\n{'length':>7} {'mode':<17} {'batch':>5} {'status':<22} {'tok/s':>9} {'H2D MiB/step':>13} {'syncs/step':>10}")
    for r in results["runs"]:
        ok = r.get("status") == "ok"
        tps = f"{r['tokens_per_s']:.1f}" if ok else ""
        h2d = f"{r['h2d_bytes_per_step'] / 2**20:.2f}" if ok else ""
        syncs = "" if not ok or r["syncs_per_step"] is None else str(r["syncs_per_step"])
        print(f"{r['length']:>7} {r['mode']:<17} {r['batch']:>5} {r['status']:<22} {tps:>9} {h2d:>13} {syncs:>10}")
    for entry in results["hidden_share"]:
        parts = [f"{k}={v:.3f}" for k, v in entry.items() if isinstance(v, float)]
        print(f"length {entry['length']} batch {entry['batch']}: {', '.join(parts) or 'n/a'}")
    g = results["gather"]
    print(f"block gather {g['gather_GBps']:.1f} GB/s vs pinned copy {g['pinned_copy_GBps']:.1f} GB/s ({g['bytes'] / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
