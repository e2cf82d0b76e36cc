"""Peak memory of one Forecast training step (forward + per-layer backward) at several lengths.

Each (length, teacher chunk) runs in a fresh process: load the model, then run one
`forward_backward` on random tokens while a thread samples the process RSS every 2 ms (CPU), or
read `torch.cuda.max_memory_allocated` (CUDA).  Reported: the step's peak minus the memory held
just before it.  `--chunk 0` means one chunk of all rows (the unchunked O(T^2) teacher).

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


def one(model_spec: str, length: int, chunk: int) -> dict:
    import torch

    from forecastkv.training.objective import ObjectiveConfig
    from forecastkv.training.trainer import build_model, forward_backward, freeze_base, load_recipe

    torch.manual_seed(0)
    recipe = load_recipe({"model": {"path": model_spec, "sparse_config": "smollm2-135m", "forecast": {"init": "kaiming"}}})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, _ = build_model(recipe["model"], device)
    freeze_base(model)
    ids = torch.randint(0, model.config.vocab_size, (1, length), device=device)
    objective = ObjectiveConfig(chunk_size=chunk or length)
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
        losses = forward_backward(model, ids, objective)
    elapsed = time.time() - start
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        sampler.running = False
        sampler.join()
        peak = sampler.peak
    return {"length": length, "chunk": chunk or length, "device": device.type, "step_peak_mib": (peak - before) / 2**20,
            "held_before_mib": before / 2**20, "seconds": elapsed, "loss": sum(losses)}


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
            print(f"T={r['length']:6d} chunk={r['chunk']:6d} {r['device']}: step peak +{r['step_peak_mib']:8.1f} MiB "
                  f"(model etc. {r['held_before_mib']:.0f} MiB held before), {r['seconds']:.1f} s", flush=True)
    print("\n| T | teacher chunk | step peak (MiB above the loaded model) | s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['length']} | {r['chunk']} | {r['step_peak_mib']:.0f} | {r['seconds']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
