"""Decode throughput of forecastkv's attention modes inside vLLM, as ratios to dense in one run.

For each mode: one engine on the converted bundled SmolLM2 (tests/vllm/engines.py builds it),
`--requests` prompts of `--length` tokens from the bundled essays.  A first pass generates one
token each, which fills vLLM's prefix cache; the timed pass asks for 1 + `--new` tokens with the
same prompts, so its prefill is a cache hit and its time is the decode of `--new` tokens for every
request at once.  Decode tokens/s = requests x new / time; the ratios divide by dense's.

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

MODES = ("dense", "infllmv2-query", "infllmv2-forecast", "nosa")


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def decode_rate(path: str, mode: str, prompts: list[list[int]], new: int) -> dict:
    """Decode tokens/s of `mode` for `prompts` sent together (prefill served from the prefix cache)."""
    import gc

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.vllm.engines import engine

    llm = engine(path, mode, enable_prefix_caching=True, max_model_len=max(map(len, prompts)) + new + 1)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(inputs, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=1 + new, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - start
    cached = min(o.num_cached_tokens for o in outputs)
    del llm
    gc.collect()
    return {"seconds": seconds, "decode_tokens_per_s": len(prompts) * new / seconds, "min_cached_tokens": cached}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=positive, default=8000)  # + new tokens within the 8192 positions
    parser.add_argument("--requests", type=positive, default=8)
    parser.add_argument("--new", type=positive, default=32)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm" / "throughput.json")
    args = parser.parse_args(argv)
    if "dense" not in args.modes:
        parser.error("--modes must include dense (the ratios divide by it)")

    from tests.vllm.engines import build_checkpoints, essay_prompts

    prompts = essay_prompts([args.length] * args.requests)
    rows = {}
    with tempfile.TemporaryDirectory() as root:
        paths = build_checkpoints(Path(root))
        for mode in args.modes:
            rows[mode] = decode_rate(paths["nosa" if mode == "nosa" else "demo"], mode, prompts, args.new)
            print(mode, rows[mode], flush=True)
    dense = rows["dense"]["decode_tokens_per_s"]
    for row in rows.values():
        row["ratio_to_dense"] = row["decode_tokens_per_s"] / dense
    result = {"length": args.length, "requests": args.requests, "new_tokens": args.new, "modes": rows,
              "machine": "vLLM-CPU 0.32.0, " + os.uname().machine, "threads": os.environ.get("OMP_NUM_THREADS")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(args.out)
    print(f"{'mode':<20} {'decode tok/s':>12} {'/ dense':>8}")
    for mode, row in rows.items():
        print(f"{mode:<20} {row['decode_tokens_per_s']:>12.1f} {row['ratio_to_dense']:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
