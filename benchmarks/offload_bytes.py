"""Host->device bytes per decode step of the offloading modes on the bundled SmolLM2 (CPU is fine:
the counters are the same on every device).

    PYTHONPATH=. python benchmarks/offload_bytes.py [--context 8192] [--new-tokens 16]
        [--modes dense-offload sparse-offload forecast-offload] [--forecast-weights DIR] [--out FILE.json]

The prompt is the held-out essays (repeated if too short) cut to `context - new_tokens` tokens, so
the last step sees the whole context.  It is prefilled once; each mode's cache is filled from that
prefill (`inference.fill.copy_into`) and decodes greedily.  The first decode step of each mode
starts from an empty slot cache (a cold fill), as after a real prefill.  Forecast heads:
`--forecast-weights` (trained) or the `next_query` init.  Prints, per mode: mean H2D bytes per
decode step, the ratio to dense-offload, the block hit rate overall and per layer; writes the same
as JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# benchmarks/kernels.py shadows HF's `kernels`
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]


def prompt_ids(tokenizer, length: int) -> torch.Tensor:
    from forecastkv import bundled_texts

    text = "\n\n".join(bundled_texts("heldout"))
    ids = tokenizer(text, return_tensors="pt").input_ids
    while ids.shape[1] < length:
        ids = torch.cat([ids, ids], dim=1)
    return ids[:, :length]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--modes", nargs="+", default=["dense-offload", "sparse-offload", "forecast-offload"])
    parser.add_argument("--forecast-weights", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from forecastkv import ForecastKVForCausalLM, SparseCache, bundled_model_path
    from forecastkv.inference import OffloadedSparseCache
    from forecastkv.inference.fill import copy_into, greedy_steps
    from forecastkv.inference.report import format_stats
    from forecastkv.modeling.modeling import CACHE_KWARG

    path = bundled_model_path("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(path)
    forecast = None if args.forecast_weights else {"init": "next_query", "heads_per_group": 1}
    model = ForecastKVForCausalLM.from_pretrained(
        path, sparse_config=args.preset, forecast=forecast, forecast_weights=args.forecast_weights
    )
    ids = prompt_ids(tokenizer, args.context - args.new_tokens)
    heads = "trained (" + args.forecast_weights + ")" if args.forecast_weights else "next_query init"
    print(
        f"SmolLM2-135M, preset {args.preset}, forecast heads: {heads}; "
        f"prompt {ids.shape[1]} tokens + {args.new_tokens} new",
        flush=True,
    )
    results = {
        "context": args.context,
        "prompt_tokens": ids.shape[1],
        "new_tokens": args.new_tokens,
        "heads": heads,
        "modes": {},
    }
    # one prefill (resident cache), copied into each mode's cache: an 8K prompt is not re-run per mode
    start = time.perf_counter()
    prefilled = SparseCache(model.config, max_length=args.context)
    with torch.no_grad():
        first = model(ids, **{CACHE_KWARG: prefilled}).logits[:, -1].argmax(-1, keepdim=True)
    print(f"prefill {time.perf_counter() - start:.0f} s", flush=True)
    for mode in args.modes:
        start = time.perf_counter()
        cache = OffloadedSparseCache.for_model(model, mode=mode, max_length=args.context)
        copy_into(prefilled, cache)
        tokens, _, _ = greedy_steps(model, cache, first, args.new_tokens - 1)
        stats = cache.stats()
        stats["seconds"] = time.perf_counter() - start
        stats["new_ids"] = [int(first[0, 0])] + tokens[0].tolist()
        results["modes"][mode] = stats
        print(format_stats(stats), flush=True)
    # the first decode step fills empty slots (cold); "steady" averages the steps after it
    for stats in results["modes"].values():
        steady = stats["h2d_bytes_per_step"][1:]
        stats["h2d_bytes_per_step_steady"] = sum(steady) / len(steady) if steady else 0.0
    dense = results["modes"].get("dense-offload")
    print("\nmode              H2D/step (all)  H2D/step (steady)  ratio to dense-offload (steady)  hit rate")
    for mode, stats in results["modes"].items():
        ratio = None if not dense else stats["h2d_bytes_per_step_steady"] / dense["h2d_bytes_per_step_steady"]
        stats["ratio_to_dense_offload"] = ratio
        rate = "-" if stats["hit_rate"] is None else f"{100 * stats['hit_rate']:.1f}%"
        print(
            f"{mode:17s} {stats['h2d_bytes_per_step_mean'] / 2**20:9.3f} MiB  "
            f"{stats['h2d_bytes_per_step_steady'] / 2**20:11.3f} MiB  "
            f"{'' if ratio is None else f'{ratio:.4f}':>20s}             {rate}"
        )
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as handle:
            json.dump(results, handle, indent=1)
        os.replace(tmp, args.out)
    return results


if __name__ == "__main__":
    main()
