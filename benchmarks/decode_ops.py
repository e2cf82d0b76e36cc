"""aten ops and host reads per decode step, per offload mode, on a 32-layer model with MiniCPM4.1's
block geometry and tiny widths (what the zero-host-read test runs), so two versions of the runtime
can be compared op for op on the CPU:

    python benchmarks/decode_ops.py [--steps 8] [--json PATH]

Host reads are the aten calls that would read a device tensor back on CUDA (`_local_scalar_dense`:
item / int / bool; `nonzero`; `masked_select`); on the CPU a copy to the host is not visible to the
dispatcher, so `.cpu()` copies are not counted here (tests/strict_device.py counts them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select")


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.reads += (
            str(func.overloadpacket) in READS or str(func).split(".")[0] + "." + str(func).split(".")[1] in READS
        )
        return func(*args, **(kwargs or {}))


def build(policy: str):
    from forecastkv import ForecastKVConfig, ForecastKVForCausalLM
    from forecastkv.modeling.configuration import load_preset

    sparse = {
        **load_preset({"infllmv2": "minicpm4.1-8b", "nosa": "nosa-8b"}[policy])["sparse_config"],
        "dense_len": 0,
        "selector": "forecast",
    }
    config = ForecastKVConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        sparse_config=sparse,
        forecast={"enabled": True},
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    return ForecastKVForCausalLM(config).eval()


def measure(model, mode: str, prompt: int, steps: int) -> dict:
    from forecastkv.inference import OffloadedSparseCache

    kwarg = "past_key_values" if "past_key_values" in model.forward.__code__.co_varnames else "cache"
    cache = OffloadedSparseCache.for_model(model, mode=mode)
    if hasattr(cache, "reserve"):
        cache.reserve(prompt + steps + 1)
    ids = torch.randint(0, 128, (1, prompt), generator=torch.Generator().manual_seed(1))
    ops, reads, seconds = [], [], []
    with torch.no_grad():
        token = model(input_ids=ids, **{kwarg: cache}).logits[:, -1:].argmax(-1)
        for _ in range(steps):
            start = time.perf_counter()
            with Count() as count:
                token = model(input_ids=token, **{kwarg: cache}).logits[:, -1:].argmax(-1)
            seconds.append(time.perf_counter() - start)
            ops.append(count.ops)
            reads.append(count.reads)
    later = slice(1, None)  # the first step may size buffers
    return {
        "ops_per_step": statistics.mean(ops[later]),
        "reads_per_step": statistics.mean(reads[later]),
        "max_reads": max(reads[later]),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=254)
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["no-offload", "sparse-offload", "forecast-sync", "forecast-offload", "dense-offload"],
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = {}
    for policy in ("infllmv2", "nosa"):
        model = build(policy)
        for mode in args.modes:
            rows[f"{policy}/{mode}"] = measure(model, mode, args.prompt, args.steps)
            print(
                f"{policy:9s} {mode:17s} aten ops/step {rows[f'{policy}/{mode}']['ops_per_step']:8.0f}  "
                f"host reads/step {rows[f'{policy}/{mode}']['reads_per_step']:6.1f}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
