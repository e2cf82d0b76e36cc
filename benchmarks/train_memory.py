"""Peak memory and speed of Forecast training: one feature-cache build (the frozen forward, one
layer's K/V at a time, teacher in query chunks) and the cheap steps that reuse it.

Each (length, teacher chunk) runs in a fresh process: load the model, build the features of one
random-token sequence while a thread samples the process RSS every 2 ms (CPU), or read
`torch.cuda.max_memory_allocated` (CUDA); then time optimizer-free steps (loss + backward over all
layers) on `--rows` cached rows.  Reported: the build's peak minus the memory held before it, the
cache size, the seconds of one build and of one step, and their ratio (steps per frozen forward).
`--chunk 0` means one chunk of all rows.

    python benchmarks/train_memory.py --model bundled:smollm2-135m --lengths 1024 4096 --chunks 256 0
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler(threading.Thread):
    def __init__(self, interval: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.interval, self.peak, self.running = interval, rss_bytes(), True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)


def one(model_spec: str, length: int, chunk: int, rows: int = 512, steps: int = 5) -> dict:
    import torch

    from forecastkv.training.features import build_features, cached_rows, head_vectors
    from forecastkv.training.objective import ObjectiveConfig, rows_kl
    from forecastkv.training.trainer import build_model, freeze_base, load_recipe

    torch.manual_seed(0)
    recipe = load_recipe(
        {"model": {"path": model_spec, "sparse_config": "smollm2-135m", "forecast": {"init": "kaiming"}}}
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, _ = build_model(recipe["model"], device)
    freeze_base(model)
    sparse = model.config.sparse
    ids = torch.randint(0, model.config.vocab_size, (1, length), device=device)
    objective = ObjectiveConfig(chunk_size=chunk or length, teacher_kernel=2, teacher_stride=1)
    picked = cached_rows(length, 0, rows, torch.Generator().manual_seed(0))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = rss_bytes()
        sampler = PeakSampler()
        sampler.start()
    start = time.time()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        feats = build_features(model, ids, picked, sparse, objective, backbone="query")
    build_s = time.time() - start
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        sampler.running = False
        sampler.join()
        peak = sampler.peak
    start = time.time()
    for _ in range(steps):
        total = sum(
            rows_kl(head_vectors(model, feats, m), feats.ckeys[m], feats.positions, feats.teachers[m], sparse, "full")
            for m in range(model.config.num_hidden_layers)
        )
        total.backward()
    step_s = (time.time() - start) / steps
    return {
        "length": length,
        "chunk": chunk or length,
        "device": device.type,
        "build_peak_mib": (peak - before) / 2**20,
        "cache_mib": feats.nbytes() / 2**20,
        "held_before_mib": before / 2**20,
        "build_s": build_s,
        "step_s": step_s,
        "rows": picked.numel(),
        "loss": float(total),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bundled:smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 0], help="teacher query chunk; 0 = unchunked")
    parser.add_argument("--single", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.single:
        print(json.dumps(one(args.model, *args.single)))
        return 0
    rows = []
    for chunk in args.chunks:
        for length in args.lengths:
            cmd = [sys.executable, __file__, "--model", args.model, "--single", str(length), str(chunk)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(
                f"T={r['length']:6d} chunk={r['chunk']:6d} {r['device']}: build peak +{r['build_peak_mib']:8.1f} MiB "
                f"(model etc. {r['held_before_mib']:.0f} MiB held before), cache {r['cache_mib']:.1f} MiB, "
                f"build {r['build_s']:.1f} s, step {r['step_s']:.3f} s",
                flush=True,
            )
    print(
        "\n| T | teacher chunk | build peak (MiB above the loaded model) | "
        "cache MiB | build s | step s | steps per build |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['length']} | {r['chunk']} | {r['build_peak_mib']:.0f} | {r['cache_mib']:.1f} | {r['build_s']:.1f} | "
            f"{r['step_s']:.3f} | {r['build_s'] / r['step_s']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
