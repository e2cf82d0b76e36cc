"""Peak RSS and time of loading a ~1B-parameter bf16 sharded checkpoint (random weights).

Writes a Llama-shaped checkpoint (TinyLlama-1.1B geometry: hidden 2048, 22 layers, 32 / 4 heads,
vocab 32000) as bf16 safetensors shards with a model.safetensors.index.json, then loads it with
`ForecastKVForCausalLM.from_pretrained(dir, dtype=torch.bfloat16)` in a fresh process while a
thread samples the process RSS every 2 ms.  Reported: peak RSS minus the RSS after imports, and
that as a multiple of the checkpoint's tensor bytes (goal <= 1.3).

    python benchmarks/load_memory.py --dir /tmp/fkv-1b            # writes once, then loads
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_memory import PeakSampler, rss_bytes  # noqa: E402

SHAPE = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    model_type="llama",
    architectures=["LlamaForCausalLM"],
)


def tensor_shapes(shape: dict) -> dict[str, tuple[int, ...]]:
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    d = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * d
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out.update(
            {
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    return out


def write_checkpoint(directory: str, shard_bytes: int = 512 * 2**20) -> int:
    """Random bf16 weights in shards of about `shard_bytes`; returns the tensor bytes written.
    Reuses a complete earlier write (the index is written last)."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    shapes = tensor_shapes(SHAPE)
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        return total
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(SHAPE, f)
    generator = torch.Generator().manual_seed(0)
    shards, current, size = [], {}, 0
    for name, shape in shapes.items():
        current[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        size += 2 * current[name].numel()
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
            save_file(shards[-1], os.path.join(directory, f"shard-{len(shards):05d}.safetensors"))
            shards[-1] = list(shards[-1])
    if current:
        shards.append(current)
        save_file(current, os.path.join(directory, f"shard-{len(shards):05d}.safetensors"))
        shards[-1] = list(current)
    weight_map = {name: f"shard-{n + 1:05d}.safetensors" for n, names in enumerate(shards) for name in names}
    tmp = index + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    os.replace(tmp, index)
    return total


def load_once(directory: str) -> dict:
    """In this process: load, sampling RSS.  Imports happen before the baseline."""
    import torch

    from forecastkv import ForecastKVForCausalLM

    held = rss_bytes()
    sampler = PeakSampler()
    sampler.start()
    start = time.perf_counter()
    model = ForecastKVForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    seconds = time.perf_counter() - start
    sampler.running = False
    sampler.join()
    params = sum(p.numel() for p in model.parameters())
    return {
        "seconds": seconds,
        "peak_bytes": sampler.peak - held,
        "params": params,
        "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/forecastkv-load-1b")
    parser.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_only:
        print(json.dumps(load_once(args.dir)))
        return
    start = time.perf_counter()
    total = write_checkpoint(args.dir)
    print(
        f"checkpoint: {total / 2**30:.2f} GiB of bf16 tensors in {args.dir} "
        f"(written in {time.perf_counter() - start:.0f} s)"
    )
    out = subprocess.run(
        [sys.executable, __file__, "--dir", args.dir, "--load-only"], check=True, capture_output=True, text=True
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["checkpoint_bytes"] = total
    result["peak_over_checkpoint"] = result["peak_bytes"] / total
    print(json.dumps(result))
    print(
        f"loaded {result['params'] / 1e9:.2f} B parameters in {result['seconds']:.1f} s; "
        f"peak RSS {result['peak_bytes'] / 2**30:.2f} GiB = {result['peak_over_checkpoint']:.2f} x the checkpoint"
    )


if __name__ == "__main__":
    main()
