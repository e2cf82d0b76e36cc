"""Decode throughput of forecastkv's attention modes inside vLLM, against vLLM's own model, in one run.

For each mode: one engine on the converted bundled SmolLM2 (tests/vllm/engines.py builds it),
`--requests` prompts of `--length` tokens from the bundled essays.  The baseline `vllm-native` is
what a vLLM user runs today: vLLM's own `LlamaForCausalLM` (its fused layers and CPU attention) on
the plain bundled checkpoint, no forecastkv model.  A first pass generates one token each, which
fills vLLM's prefix cache (its time: `prefill_seconds`, every prompt's prefill at once); the timed
pass asks for 1 + `--new` tokens with the same prompts, so its prefill is a cache hit and its time
is the decode of `--new` tokens for every request at once.  Decode tokens/s = requests x new / time;
every mode is divided by vllm-native's and by forecastkv's own dense (the second ratio alone would
hide the gap to the engine a user already has).  A prefix-cache hit is not free: vLLM recomputes each
prompt's last page (a 64-token prefill chunk over the whole stored prompt), so the timed pass holds
that chunk too; a third pass asking for 1 token times it alone (`cache_hit_seconds`), and
`step_tokens_per_s` = requests x new / (time - cache_hit_seconds) is the decode steps alone.
`infllmv2-forecast-gather` is infllmv2-forecast with
its decode attention gathered and computed by forecastkv (FORECASTKV_VLLM_KERNEL=0) instead of vLLM-CPU's
attention kernel on the selected pages (`serving/vllm_model.py:cpu_page_attention`).
Before both, each engine's time to the first token
of one `--ttft-length` prompt alone (other text, cold: no prefix cache hit) is its TTFT.

    .venv-vllm/bin/python benchmarks/vllm_throughput.py --length 8000 --requests 8 --new 32

Writes benchmarks/results/vllm/throughput.json (and prints a table).  The 2-core CPU is shared and
noisy: compare the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # 8 x 8K tokens of SmolLM2 fp32 KV: 3 GB
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NATIVE = "vllm-native"  # vLLM's own model on the plain checkpoint: the baseline
GATHER = "-gather"  # a sparse mode with its decode attention gathered by forecastkv, not vLLM's kernel
MODES = (NATIVE, "dense", "infllmv2-query", "infllmv2-forecast", "infllmv2-forecast" + GATHER, "nosa",
         "infllmv2-forecast-carry", "infllmv2-forecast-carry-pin", "infllmv2-quest-forecast-carry-pin")


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def decode_rate(path: str, mode: str | None, prompts: list[list[int]], new: int, first: list[int]) -> dict:
    """Decode tokens/s of `mode` (None: the checkpoint as vLLM loads it, no forecastkv_mode) for
    `prompts` sent together (prefill served from the prefix cache), and the time to the first token
    of the prompt `first` alone (sent first, on a cold engine: a user's TTFT)."""
    import gc

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.vllm.engines import engine

    longest = max(len(first), *map(len, prompts))
    llm = engine(path, mode, enable_prefix_caching=True, max_model_len=longest + new + 1)
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=first)], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    ttft = time.perf_counter() - start
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start = time.perf_counter()
    llm.generate(inputs, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    prefill = time.perf_counter() - start  # every prompt's prefill and first token, together, cold
    start = time.perf_counter()
    llm.generate(inputs, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    hit = time.perf_counter() - start  # a prefix-cache hit: vLLM recomputes each prompt's last page
    start = time.perf_counter()
    outputs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=1 + new, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - start
    cached = min(o.num_cached_tokens for o in outputs)
    del llm
    gc.collect()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return {
        "ttft_seconds": ttft,
        "ttft_prompt_tokens": len(first),
        "prefill_seconds": prefill,
        "prefill_tokens_per_s": sum(map(len, prompts)) / prefill,
        "seconds": seconds,
        "decode_tokens_per_s": len(prompts) * new / seconds,
        "cache_hit_seconds": hit,
        "step_tokens_per_s": len(prompts) * new / max(seconds - hit, 1e-9),
        "min_cached_tokens": cached,
        "tokens": tokens,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=positive, default=8000)  # + new tokens within the 8192 positions
    parser.add_argument("--requests", type=positive, default=8)
    parser.add_argument("--new", type=positive, default=32)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--ttft-length", type=positive, default=4000, help="tokens of the TTFT prompt")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm" / "throughput.json")
    args = parser.parse_args(argv)
    for needed in (NATIVE, "dense"):
        if needed not in args.modes:
            parser.error(f"--modes must include {needed} (the ratios divide by it)")

    from forecastkv import bundled_model_path
    from tests.vllm.engines import build_checkpoints, essay_prompts

    *prompts, first = essay_prompts([args.length] * args.requests + [args.ttft_length])
    rows = {}
    with tempfile.TemporaryDirectory() as root:
        paths = build_checkpoints(Path(root))
        paths[NATIVE] = bundled_model_path()  # a plain Llama checkpoint: vLLM serves it with its own model
        for mode in args.modes:
            path = paths[NATIVE if mode == NATIVE else "nosa" if mode == "nosa" else "demo"]
            served = None if mode == NATIVE else mode.removesuffix(GATHER)
            # serving/vllm_model.py reads it as each engine's model first runs (engines run in this process)
            os.environ["FORECASTKV_VLLM_KERNEL"] = "0" if mode.endswith(GATHER) else "1"
            rows[mode] = decode_rate(path, served, prompts, args.new, first)
            print(mode, rows[mode], flush=True)
    native, dense = (rows[name]["decode_tokens_per_s"] for name in (NATIVE, "dense"))
    native_tokens = rows[NATIVE]["tokens"]
    for row in rows.values():
        # greedy, fp32: dense should give vLLM's own tokens; a sparse mode may differ where it drops mass
        row["prompts_with_native_tokens"] = sum(a == b for a, b in zip(row.pop("tokens"), native_tokens))
        row["ratio_to_vllm_native"] = row["decode_tokens_per_s"] / native
        row["ratio_to_dense"] = row["decode_tokens_per_s"] / dense
        row["step_ratio_to_vllm_native"] = row["step_tokens_per_s"] / rows[NATIVE]["step_tokens_per_s"]
    result = {"length": args.length, "requests": args.requests, "new_tokens": args.new, "modes": rows,
              "machine": "vLLM-CPU 0.32.0, " + os.uname().machine, "threads": os.environ.get("OMP_NUM_THREADS")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(args.out)
    print(f"{'mode':<28} {'decode tok/s':>12} {'/ native':>9} {'/ dense':>8} {'steps only':>10} {'/ native':>9} "
          f"{'TTFT s':>8} {'/ native':>9}")
    for mode, row in rows.items():
        print(
            f"{mode:<28} {row['decode_tokens_per_s']:>12.2f} {row['ratio_to_vllm_native']:>9.2f} "
            f"{row['ratio_to_dense']:>8.2f} {row['step_tokens_per_s']:>10.2f} {row['step_ratio_to_vllm_native']:>9.2f} "
            f"{row['ttft_seconds']:>8.2f} {row['ttft_seconds'] / rows[NATIVE]['ttft_seconds']:>9.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
