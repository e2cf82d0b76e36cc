"""Decode tokens/s with the decoder layers compiled (`torch.compile(fullgraph=True)`, inductor)
against eager, in one run, per (length, mode, batch).

    PYTHONPATH=. python benchmarks/decode_compile.py --out benchmarks/results/decode_compile_cpu.json
    PYTHONPATH=. python benchmarks/decode_compile.py --config tiny --out /tmp/decode_compile.json  # a dry run
    PYTHONPATH=. python benchmarks/decode_compile.py --config gpu --out DIR/decode_replay.json       # CUDA graphs

What is compiled is `ForecastKVModel.decode_layers`, the device part of a call (what
`forecastkv.modeling.compiled.compile_decode` compiles for generate()), on CUDA with
mode="reduce-overhead", so that a compiled step is a replayed CUDA graph.  The host side of a
decode step (`SparseCache.begin_call` / `finish_call`, the step logs) stays eager around it.
Per cell: the cache is filled with random post-RoPE K/V (`benchmarks/decode_fill.py`) and
reserved for the whole run (fixed shapes); the first `--parity-steps` compiled steps (the compile,
its time reported) are checked against eager steps from a fork of the same cache (inductor
reorders float sums: the largest logit difference is reported); then `--warmup` compiled steps and
`--rounds` rounds of `--steps` eager and `--steps` compiled steps, alternating so that a change of
machine load hits both sides (the median round per side).  A recompile after the first call fails
the cell (`error_on_recompile`).  Random weights: speeds, not quality.  Writes JSON atomically
after each cell; `--budget-s` stops starting cells.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# benchmarks/kernels.py shadows HF's `kernels`
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.append(HERE)
# decode_fill first: importing decode_sweep imports offload_decode, which takes benchmarks/ off sys.path
from decode_fill import fill_random  # noqa: E402
from decode_sweep import SMOLLM2_135M, TINY, build_model  # noqa: E402
from offload_decode import MINICPM41_8B, synchronize  # noqa: E402

CONFIGS = {
    # name: (model shape, preset, device, dtype, torch.compile options, lengths, batches, modes)
    # SmolLM2 holds 8192 positions: "8K" leaves room for the timed steps
    "cpu": (SMOLLM2_135M, "smollm2-135m", "cpu", torch.float32, {}, [4096, 8128], [1, 4], ["forecast-offload"]),
    "tiny": (TINY, "smollm2-135m", "cpu", torch.float32, {}, [512], [1, 2], ["no-offload", "forecast-offload"]),
    # gpu_check's dry run
    "tiny-eager": (TINY, "smollm2-135m", "cpu", torch.float32, {"backend": "eager"}, [256], [1], ["no-offload"]),
    # what benchmarks/gpu_check.py runs: 8 of MiniCPM4.1-8B's 32 layers (the compile fits its budget)
    "gpu": (
        {**MINICPM41_8B, "num_hidden_layers": 8},
        "minicpm4.1-8b",
        "cuda",
        torch.bfloat16,
        {"mode": "reduce-overhead"},
        [32768],
        [4],
        ["no-offload", "forecast-offload"],
    ),
}


def timed_steps(model, cache, token: torch.Tensor, steps: int):
    """`steps` greedy decode steps from token [B, 1]: (last token, logits [B, steps, V], seconds per step)."""
    from forecastkv.inference.fill import greedy_steps

    if steps == 0:
        return token, None, 0.0
    synchronize(token.device)
    start = time.perf_counter()
    tokens, logits, _ = greedy_steps(model, cache, token, steps)
    synchronize(token.device)
    return tokens[:, -1:], logits, (time.perf_counter() - start) / steps


def run_cell(model, mode: str, batch: int, length: int, args) -> dict:
    """Eager and compiled decode on one filled cache.  Parity first: `--parity-steps` eager steps
    on a fork of the cache against the first compiled steps (the compile) on the cache itself, the
    largest logit difference; then `--warmup` compiled steps, and `--rounds` rounds of `--steps`
    eager and `--steps` compiled steps alternating (so a change of machine load hits both sides);
    per side the median round."""
    from torch._dynamo.utils import counters

    from forecastkv.inference import OffloadedSparseCache

    config = model.config
    total = length + args.parity_steps + args.warmup + args.rounds * 2 * args.steps + 4
    cache = OffloadedSparseCache.for_model(model, mode=mode, max_length=total)
    cache.reserve(total)
    fill_random(cache, batch, length, config.num_key_value_heads, config.head_dim, model.dtype, model.device)
    token = torch.zeros((batch, 1), dtype=torch.long, device=model.device)
    inner = model.model
    eager_layers = inner.decode_layers
    compiled_layers = torch.compile(eager_layers, fullgraph=True, dynamic=False, **args.compile_options)
    times = {"eager": [], "compiled": []}
    counters.clear()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            _, eager_logits, _ = timed_steps(model, cache.fork(), token, args.parity_steps)
            inner.decode_layers = compiled_layers
            start = time.perf_counter()
            token, compiled_logits, _ = timed_steps(model, cache, token, args.parity_steps)  # compiles
            compile_s = time.perf_counter() - start
            token, _, _ = timed_steps(model, cache, token, args.warmup)
            for _ in range(args.rounds):
                for side, layers in (("eager", eager_layers), ("compiled", compiled_layers)):
                    inner.decode_layers = layers
                    token, _, seconds = timed_steps(model, cache, token, args.steps)
                    times[side].append(seconds)
    finally:
        inner.decode_layers = eager_layers
        torch._dynamo.reset()
    eager_s, compiled_s = (sorted(times[side])[len(times[side]) // 2] for side in ("eager", "compiled"))
    return {
        "status": "ok",
        "length": length,
        "batch": batch,
        "mode": mode,
        "eager_step_s": eager_s,
        "compiled_step_s": compiled_s,
        "compile_s": compile_s,
        "rounds_s": times,
        "eager_tokens_per_s": batch / eager_s,
        "compiled_tokens_per_s": batch / compiled_s,
        "compiled_over_eager": eager_s / compiled_s,
        "max_abs_logit_diff": float((eager_logits - compiled_logits).abs().max()),
        "logit_scale": float(eager_logits.abs().max()),
        # e.g. inductor's cudagraph skips (a graph that mutates an input is not captured): what replay really ran
        "inductor_counters": {k: dict(v) for k, v in counters.items() if k in ("inductor", "stats") and v},
    }


def main(argv=None) -> int:
    from forecastkv.atomic import write_text_atomic

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="cpu")
    parser.add_argument("--out", required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps per round and side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parity-steps", type=int, default=2, help="compiled steps checked against eager ones first")
    parser.add_argument("--budget-s", type=float, default=None, help="no cell starts after this many seconds")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="context lengths (default: the config's)")
    args = parser.parse_args(argv)
    shape, preset, device, dtype, args.compile_options, lengths, batches, modes = CONFIGS[args.config]
    lengths = args.lengths or lengths
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--config {args.config} needs a CUDA device (this machine has none)")
    started = time.perf_counter()
    torch.manual_seed(0)
    model = build_model(shape, preset, device, dtype)
    result = {
        "config": args.config,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "compile_options": args.compile_options,
        "cells": [],
    }

    def save():
        result["summary"] = {
            f"{c['length']} b{c['batch']} {c['mode']} compiled/eager": round(c["compiled_over_eager"], 3)
            for c in result["cells"]
            if c.get("status") == "ok"
        }
        write_text_atomic(args.out, json.dumps(result, indent=1))

    save()
    for length in lengths:
        for batch in batches:
            for mode in modes:
                if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                    result["cells"].append({"status": "skipped", "length": length, "batch": batch, "mode": mode})
                    continue
                try:
                    cell = run_cell(model, mode, batch, length, args)
                except Exception as error:  # noqa: BLE001 - recorded, the next cell still runs
                    cell = {
                        "status": f"error: {type(error).__name__}: {str(error)[:300]}",
                        "length": length,
                        "batch": batch,
                        "mode": mode,
                    }
                result["cells"].append(cell)
                print(json.dumps(cell), flush=True)
                save()
                gc.collect()
    return 1 if any(c["status"].startswith("error") for c in result["cells"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
