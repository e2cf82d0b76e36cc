"""Cost of the context store's model identity (`forecastkv.context.blocks.model_identity`): every
byte of every parameter and buffer hashed with sha256 (threads over tensors), on the bundled
SmolLM2-135M, with the 8B estimate scaled from the measured bytes per second.

    PYTHONPATH=. python benchmarks/context_identity.py [--repeats 3]

Prints the weight bytes, the seconds per identity (best of the repeats), the throughput, and the
time the same throughput gives for an 8B model in bf16 (16 GB).
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    from forecastkv import ForecastKVForCausalLM, bundled_model_path
    from forecastkv.context.blocks import model_identity

    model = ForecastKVForCausalLM.from_pretrained(bundled_model_path("smollm2-135m"), sparse_config="smollm2-135m")
    nbytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        model_identity(model, "query")
        seconds.append(time.perf_counter() - start)
    best = min(seconds)
    rate = nbytes / best
    print(
        f"SmolLM2-135M: {nbytes / 1e6:.0f} MB of weights ({next(model.parameters()).dtype}), identity {best:.2f} s "
        f"(runs: {', '.join(f'{s:.2f}' for s in seconds)}), {rate / 1e9:.2f} GB/s on {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}"
    )
    print(f"8B in bf16 (16 GB) at this rate: {16e9 / rate:.1f} s")


if __name__ == "__main__":
    main()
