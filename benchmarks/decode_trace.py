"""How far one decode step reaches: package files, Python calls and frame depth, traced with
`sys.setprofile` under `ForecastKVForCausalLM.forward` for the second decode step of `generate()`
on a 3-layer forecast-offload model (what docs/architecture.md walks through):

    python benchmarks/decode_trace.py [--mode forecast-offload] [--json PATH]
    FORECASTKV_BACKEND=decode=kernels python benchmarks/decode_trace.py

files: forecastkv source files with at least one Python call; calls: Python calls into
forecastkv functions; depth: the deepest chain of forecastkv frames (frames of other modules in
between are not counted).  All three are counted below `forward`: its own frame is left out.
Run it without TRITON_INTERPRET (the interpreter runs kernel bodies as Python calls); the
"kernels" part of the backend is then the PyTorch reference, whose calls the kernels replace.
`--list` prints each file's calls.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch

PACKAGE = os.path.join("forecastkv", "")
FORWARD_FILE = os.path.join("modeling", "modeling.py")


def build(policy: str = "infllmv2"):
    """A 3-layer random model with Forecast heads and a block geometry the prompt makes sparse."""
    from forecastkv import ForecastKVConfig, ForecastKVForCausalLM

    sparse = dict(
        kernel_size=4,
        kernel_stride=2,
        block_size=8,
        init_blocks=1,
        window_size=8,
        topk=3,
        dense_len=0,
        query_blocks=1,
        selector="forecast",
        policy=policy,
    )
    config = ForecastKVConfig(
        vocab_size=128,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        query_chunk_size=16,
        bos_token_id=None,
        eos_token_id=None,
        sparse_config=sparse,
        forecast={"enabled": True},
    )
    torch.manual_seed(0)
    return ForecastKVForCausalLM(config).eval()


class Tracer:
    """sys.setprofile callback: counts Python calls and forecastkv frames on the stack."""

    def __init__(self) -> None:
        self.per_file: collections.Counter = collections.Counter()
        self.depth = 0
        self.max_depth = 0
        self.stack: list[bool] = []

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            filename = frame.f_code.co_filename
            ours = PACKAGE in filename
            if ours:
                self.per_file[filename.split(PACKAGE, 1)[1]] += 1
                self.depth += 1
                self.max_depth = max(self.max_depth, self.depth)
            self.stack.append(ours)
        elif event == "return" and self.stack:
            if self.stack.pop():
                self.depth -= 1


def trace(mode: str = "forecast-offload", policy: str = "infllmv2", prompt: int = 60, step: int = 2) -> dict:
    """Trace decode step `step` (1-based) of generate() on `build(policy)` with cache mode `mode`."""
    from forecastkv import ForecastKVForCausalLM
    from forecastkv.inference import OffloadedSparseCache

    model = build(policy)
    cache = OffloadedSparseCache.for_model(model, mode=mode)
    ids = torch.randint(0, 128, (1, prompt), generator=torch.Generator().manual_seed(1))
    forward = ForecastKVForCausalLM.forward
    seen = {"calls": 0}
    tracer = Tracer()

    def traced(self, *args, **kwargs):
        seen["calls"] += 1
        if seen["calls"] != step + 1:  # call 1 is the prefill
            return forward(self, *args, **kwargs)
        sys.setprofile(tracer)
        try:
            return forward(self, *args, **kwargs)
        finally:
            sys.setprofile(None)

    from forecastkv.modeling.modeling import CACHE_KWARG as kwarg

    ForecastKVForCausalLM.forward = traced
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=step + 1, do_sample=False, **{kwarg: cache})
    finally:
        ForecastKVForCausalLM.forward = forward
    # the first call the tracer saw is `forward` itself: leave it out of every figure
    tracer.per_file[FORWARD_FILE] -= 1
    files = sum(1 for count in tracer.per_file.values() if count > 0)
    return {
        "mode": mode,
        "policy": policy,
        "backend": os.environ.get("FORECASTKV_BACKEND", ""),
        "files": files,
        "calls": sum(tracer.per_file.values()),
        "depth": tracer.max_depth - 1,
        "per_file": {name: n for name, n in tracer.per_file.most_common() if n},
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="forecast-offload")
    parser.add_argument("--policy", default="infllmv2")
    parser.add_argument("--json", default=None)
    parser.add_argument("--list", action="store_true", help="print each file's calls")
    args = parser.parse_args(argv)
    row = trace(args.mode, args.policy)
    print(
        f"{args.mode} {args.policy} backend={row['backend'] or 'auto'}: {row['files']} package files, "
        f"{row['calls']} Python calls, {row['depth']} frames deep"
    )
    if args.list:
        for name, count in row["per_file"].items():
            print(f"  {count:5d}  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)
    return row


if __name__ == "__main__":
    main()
