"""Context cache on the bundled SmolLM2 (sparse preset) at 8K tokens on the CPU: time to first
token with a full prefix hit over a miss, and peak RSS while decoding from a store on disk.

In one run:

1. miss: `ContextStore.lookup` on an empty store, then `generate(max_new_tokens=1)` prefills all
   8K tokens (per mode: resident `SparseCache`, sparse-offload); the prompt's blocks are inserted
   and saved;
2. full hit: the same prompt looked up again (8K - 64 tokens from the store: generate needs one
   block to prefill), `generate(max_new_tokens=1)`; ratio hit / miss per mode (goal <= 0.1);
3. disk tier, in a fresh process: the store loaded from its directory (index and checksums; on
   the CPU each layer's pool then maps a file of the blocks copy-on-write, so only touched pages
   become resident), the prompt less 32 tokens looked up (sparse-offload: the cache attaches to
   the mapped blocks), the rest prefilled and 32 tokens decoded while a thread samples the RSS
   (/proc/self/statm: file-backed pages the process maps count too); reported: peak RSS growth
   over the RSS after loading the model and the store (lookup + prefill + decode, and decode
   alone), against the cache's host tier: the bytes of the host blocks it holds (the store's it
   points at and its own), and the mapped pools' size (the goal: growth below the host tier).

    python benchmarks/context_cache.py --dir /tmp/fkv-context --output benchmarks/results/context_cache_cpu.md
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prefill import prompt_ids  # noqa: E402
from train_memory import PeakSampler, rss_bytes  # noqa: E402

NAMESPACE = "bench"


def load():
    from transformers import AutoTokenizer

    from forecastkv import ForecastKVForCausalLM, bundled_model_path

    path = bundled_model_path("smollm2-135m")
    return ForecastKVForCausalLM.from_pretrained(path, sparse_config="smollm2-135m"), AutoTokenizer.from_pretrained(
        path
    )


def first_token(model, store, ids, mode):
    """(wall seconds from lookup to the first new token, CPU seconds of this process over the same
    span (less sensitive to other processes on a shared machine), matched, the cache)."""
    import torch

    from forecastkv.modeling.modeling import CACHE_KWARG

    start, cpu = time.perf_counter(), time.process_time()
    cache, matched = store.lookup(ids, mode=mode)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0, **{CACHE_KWARG: cache})
    return time.perf_counter() - start, time.process_time() - cpu, matched, cache


def prefix_hits(directory: str, length: int, repeats: int) -> list[dict]:
    """Miss and full-hit time to first token per mode; the store saved to `directory`."""
    from forecastkv.context import ContextStore

    model, tokenizer = load()
    ids = prompt_ids(tokenizer, length)
    shutil.rmtree(os.path.join(directory, NAMESPACE), ignore_errors=True)
    store = ContextStore(model, directory, namespace=NAMESPACE)
    rows = []
    for name, mode in (("resident", None), ("sparse-offload", "sparse-offload")):
        miss, miss_cpu, matched, cache = first_token(model, ContextStore(model), ids, mode)
        assert matched == 0
        if not store.entries:
            start = time.perf_counter()
            store.insert(cache, ids)
            store.save()
            saved = time.perf_counter() - start
        del cache
        hits, hits_cpu = [], []
        for _ in range(repeats):
            seconds, cpu, matched, cache = first_token(model, store, ids, mode)
            hits.append(seconds)
            hits_cpu.append(cpu)
            del cache
            gc.collect()
        row = {
            "mode": name,
            "length": length,
            "matched": matched,
            "miss_s": miss,
            "hit_s": min(hits),
            "hit_over_miss": min(hits) / miss,
            "miss_cpu_s": miss_cpu,
            "hit_cpu_s": min(hits_cpu),
            "hit_over_miss_cpu": min(hits_cpu) / miss_cpu,
            "store_bytes": store.nbytes,
            "insert_and_save_s": saved,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def disk_child(directory: str, length: int, new_tokens: int) -> dict:
    """In a fresh process: load the store, look the prompt up (sparse-offload), decode."""
    import torch

    from forecastkv.context import ContextStore
    from forecastkv.inference.fill import greedy_steps
    from forecastkv.modeling.modeling import CACHE_KWARG

    def rss_parts() -> dict:
        """RssAnon / RssFile (MiB) of this process: what the mapped pools' touched pages add is RssFile."""
        with open("/proc/self/status") as f:
            parts = dict(line.split(":", 1) for line in f if line.startswith(("RssAnon", "RssFile")))
        return {key: int(value.split()[0]) / 1024 for key, value in parts.items()}

    model, tokenizer = load()
    # room for the new tokens within max_position_embeddings
    ids = prompt_ids(tokenizer, length)[:, : length - new_tokens]
    start = time.perf_counter()
    store = ContextStore(model, directory, namespace=NAMESPACE)
    load_s = time.perf_counter() - start
    gc.collect()
    held, parts_before = rss_bytes(), rss_parts()
    sampler = PeakSampler()
    sampler.start()
    start = time.perf_counter()
    cache, matched = store.lookup(ids, mode="sparse-offload", reserve=length + new_tokens)
    with torch.no_grad():
        logits = model(ids[:, matched:], logits_to_keep=1, **{CACHE_KWARG: cache}).logits
    ttft = time.perf_counter() - start
    after_lookup = rss_bytes()
    sampler.running = False
    sampler.join()
    decode = PeakSampler()
    decode.start()
    greedy_steps(model, cache, logits[:, -1].argmax(-1, keepdim=True), new_tokens)
    decode.running = False
    decode.join()
    parts_after = rss_parts()
    peak = max(sampler.peak, decode.peak)
    layers = [layer for layer in cache.layers if layer.offloaded]
    tier = sum(
        len(layer.store.host.blocks.distinct_blocks()) * layer.store.host.pool.block_nbytes() for layer in layers
    )
    return {
        "matched": matched,
        "store_load_s": load_s,
        "ttft_s": ttft,
        "host_tier_bytes": tier,
        "host_tier_mib": tier / 2**20,
        "mapped_pools_mib": cache.host_nbytes() / 2**20,
        "rss_after_load_mib": held / 2**20,
        "rss_growth_after_lookup_and_prefill_mib": (after_lookup - held) / 2**20,
        "peak_rss_growth_mib": (peak - held) / 2**20,
        "peak_rss_growth_decode_mib": (decode.peak - held) / 2**20,
        "peak_growth_over_host_tier": (peak - held) / tier,
        "new_tokens": new_tokens,
        **{f"{key}_growth_after_decode_mib": parts_after[key] - parts_before[key] for key in parts_before},
    }


def write_report(path: str, hits: list[dict], disk: dict) -> None:
    from forecastkv.atomic import write_text_atomic

    lines = [
        "| mode | tokens | from store | miss TTFT s | hit TTFT s | hit / miss | miss CPU s | hit CPU s "
        "| hit / miss (CPU time) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['mode']} | {r['length']} | {r['matched']} | {r['miss_s']:.2f} | {r['hit_s']:.3f} | "
        f"{r['hit_over_miss']:.3f} | {r.get('miss_cpu_s', float('nan')):.2f} | "
        f"{r.get('hit_cpu_s', float('nan')):.3f} | {r.get('hit_over_miss_cpu', float('nan')):.3f} |"
        for r in hits
    ]
    lines += [
        "",
        f"store: {hits[0]['store_bytes'] / 2**20:.1f} MiB of blocks, "
        f"insert + save {hits[0]['insert_and_save_s']:.2f} s",
        "",
        "| disk tier (fresh process, sparse-offload) | value |",
        "|---|---|",
    ]
    lines += [
        f"| {key} | {value:.3f} |" if isinstance(value, float) else f"| {key} | {value} |"
        for key, value in disk.items()
    ]
    write_text_atomic(path, "\n".join(lines) + "\n")
    json_path = os.path.splitext(path)[0] + ".json"
    write_text_atomic(json_path, json.dumps({"prefix_hits": hits, "disk": disk}, indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir", default="/tmp/fkv-context", help="the store's directory (its bench namespace is rewritten)"
    )
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=2, help="full-hit runs per mode (the best is kept)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default=None, help="a Markdown table (and a .json beside it)")
    parser.add_argument("--disk-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.disk_child:
        print(json.dumps(disk_child(args.dir, args.length, args.new_tokens)))
        return 0
    load_before = os.getloadavg()
    hits = prefix_hits(args.dir, args.length, args.repeats)
    command = [
        sys.executable,
        __file__,
        "--disk-child",
        "--dir",
        args.dir,
        "--length",
        str(args.length),
        "--new-tokens",
        str(args.new_tokens),
    ]
    if args.threads:
        command += ["--threads", str(args.threads)]
    child = subprocess.run(command, capture_output=True, text=True)
    if child.returncode != 0:
        raise SystemExit(f"the disk-tier process failed:\n{child.stderr[-4000:]}")
    disk = json.loads(child.stdout.strip().splitlines()[-1])
    disk["machine"] = (
        f"{os.cpu_count()} CPUs, load average (1/5/15 min) {'/'.join(f'{x:.1f}' for x in load_before)} at start, "
        f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())} at end"
    )
    print(json.dumps(disk), flush=True)
    if args.output:
        write_report(args.output, hits, disk)
    return 0


if __name__ == "__main__":
    sys.exit(main())
