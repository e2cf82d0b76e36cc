"""Kernel benchmark: each Triton kernel against its reference, and the UVA gather against the
copy-engine path and a plain pinned host->device copy of the same bytes.

    PYTHONPATH=. python benchmarks/kernel_timing.py                # CUDA if present, else CPU references
    PYTHONPATH=. python benchmarks/kernel_timing.py --json out.json

On CPU only the references (and the copy-engine path) are timed, at small sizes (< 1 min); the
Triton interpreter is never timed.  On CUDA: the gather for 16/32/64 programs and a few batch sizes
(achieved GB/s and the fraction of plain pinned-copy bandwidth), decode attention and block scores
(time and speedup over the reference).  All ratios come from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# Running this file puts benchmarks/ first on sys.path, where this very file would shadow the
# Hugging Face `kernels` package that transformers probes for: drop that entry, add the repo root.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

import forecastkv.kernels as K  # noqa: E402
from forecastkv.modeling import selection as sel  # noqa: E402
from forecastkv.modeling.configuration import SparseConfig  # noqa: E402


def timed(fn, device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of `fn()` (CUDA events on CUDA, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------------------------


def bench_gather(device, batches, programs, heads, dim, block, slots, seq, miss, dtype, reps, run_triton):
    rows = []
    cuda = device.type == "cuda"
    for batch in batches:
        k_host = torch.randn(batch, seq, heads, dim, dtype=dtype, pin_memory=cuda)
        v_host = torch.randn(batch, seq, heads, dim, dtype=dtype, pin_memory=cuda)
        b_host = torch.randn(batch, seq, heads, dtype=dtype, pin_memory=cuda)
        n_blocks = seq // block
        ids = torch.stack([torch.randperm(n_blocks)[:slots] for _ in range(heads * batch)]).view(heads, batch, slots)
        ids[torch.rand(ids.shape) >= miss] = -1  # hits: nothing to move
        ids = ids.to(device)
        k_slots = torch.zeros(batch, slots * block, heads, dim, dtype=dtype, device=device)
        v_slots = torch.zeros_like(k_slots)
        b_slots = torch.zeros(batch, slots * block, heads, dtype=dtype, device=device)
        moved_rows = int((ids >= 0).sum()) * block
        nbytes = moved_rows * (2 * dim + 1) * k_host.element_size()
        args = (k_host, v_host, ids, k_slots, v_slots, block, b_host, b_slots)
        plain_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        plain_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        plain_ms = timed(lambda: plain_dst.copy_(plain_src, non_blocking=True), device, reps)
        plain = gbps(nbytes, plain_ms)
        config = f"B={batch} H={heads} M={slots} blk={block} d={dim} miss={miss:.2f} {nbytes / 2**20:.1f}MiB"
        plain_name = "plain pinned H2D" if cuda else "plain copy"
        candidates = [(plain_name, None, lambda: plain_dst.copy_(plain_src, non_blocking=True))]
        candidates.append(("reference", None, lambda: K.block_gather_reference(*args, check_ids=False)))
        candidates.append(("copy engine", None, lambda: K.block_gather_copy_engine(*args, check_ids=False)))
        if run_triton:
            for n in programs:
                candidates.append(
                    ("triton UVA", n, lambda n=n: K.block_gather_triton(*args, num_programs=n, check_ids=False))
                )
        for impl, n, fn in candidates:
            ms = plain_ms if impl == plain_name else timed(fn, device, reps)
            rate = gbps(nbytes, ms)
            row = dict(kernel="block_gather", config=config, impl=impl, programs=n, ms=ms, gbps=rate)
            rows.append(dict(row, vs_copy=rate / plain))
        k_host = v_host = b_host = plain_src = plain_dst = None  # free before the next batch
    return rows


def reference_and_triton(kernel, config, nbytes, reference, triton, device, reps, run_triton) -> list[dict]:
    """Rows timing `reference()` and, with run_triton, `triton()`: ms, GB/s over nbytes, speedup."""
    ref_ms = timed(reference, device, reps)
    rows = [dict(kernel=kernel, config=config, impl="reference", ms=ref_ms, gbps=gbps(nbytes, ref_ms), speedup=1.0)]
    if run_triton:
        ms = timed(triton, device, reps)
        rows.append(
            dict(kernel=kernel, config=config, impl="triton", ms=ms, gbps=gbps(nbytes, ms), speedup=ref_ms / ms)
        )
    return rows


def bench_decode(device, batches, heads, group, dim, block, width, seq, dtype, reps, run_triton):
    rows = []
    for batch in batches:
        q = torch.randn(batch, heads * group, dim, dtype=dtype, device=device)
        k = torch.randn(batch, seq, heads, dim, dtype=dtype, device=device)
        v, bias = torch.randn_like(k), torch.randn(batch, seq, heads, device=device)
        n_blocks = seq // block
        ids = (
            torch.stack([torch.randperm(n_blocks)[:width] for _ in range(batch * heads)])
            .view(batch, heads, width)
            .to(device)
        )
        lengths = torch.full((batch,), seq, device=device)
        nbytes = batch * heads * width * block * (2 * dim * k.element_size() + 4)
        config = f"B={batch} Hkv={heads} G={group} K={width} blk={block} d={dim} S={seq}"
        args = (q, k, v, ids, lengths, block)
        reference = lambda: K.sparse_decode_blocks_reference(*args, bias=bias, check_ids=False)  # noqa: E731
        triton = lambda: K.sparse_decode_blocks_triton(*args, bias=bias, check_ids=False)  # noqa: E731
        rows += reference_and_triton("sparse_decode", config, nbytes, reference, triton, device, reps, run_triton)
    return rows


def bench_scores(device, batches, heads, group, dim, seq, dtype, reps, run_triton, sparse):
    rows = []
    for kind, n in (("query", group), ("forecast", 1)):
        for batch in batches:
            count = sel.num_compressed(seq, sparse.kernel_size, sparse.kernel_stride)
            n_blocks = sel.num_blocks(seq, sparse.block_size)
            vectors = torch.randn(batch, heads * n, dim, dtype=dtype, device=device)
            ckeys = torch.randn(batch, count, heads, dim, dtype=dtype, device=device)
            pos = torch.full((batch,), seq - 1, device=device)
            lag = 0 if kind == "query" else 1  # selection.visibility_lag
            args = (vectors, ckeys, pos, sparse, n_blocks, kind, lag)
            nbytes = ckeys.numel() * ckeys.element_size()
            config = f"{kind} B={batch} Hkv={heads} n={n} C={count} NB={n_blocks} d={dim}"
            reference, triton = lambda: K.block_scores_reference(*args), lambda: K.block_scores_triton(*args)
            rows += reference_and_triton("block_scores", config, nbytes, reference, triton, device, reps, run_triton)
    return rows


# ----------------------------------------------------------------------------------------------


def print_table(rows, out=sys.stdout):
    header = f"{'kernel':<14} {'config':<52} {'impl':<18} {'progs':>5} {'ms':>9} {'GB/s':>8} {'ratio':>7}"
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in rows:
        ratio = r.get("vs_copy", r.get("speedup"))
        progs = "" if r.get("programs") is None else str(r["programs"])
        print(
            f"{r['kernel']:<14} {r['config']:<52} {r['impl']:<18} {progs:>5} "
            f"{r['ms']:>9.3f} {r['gbps']:>8.2f} {ratio:>7.3f}",
            file=out,
        )
    print(
        "ratio: block_gather = GB/s / GB/s of one plain (pinned H2D on CUDA) copy of the same bytes; "
        "others = reference ms / ms",
        file=out,
    )


def summary(rows) -> dict:
    """A few headline numbers (used by gpu_check.py)."""
    out = {}
    gather = [r for r in rows if r["kernel"] == "block_gather" and r["impl"] == "triton UVA"]
    if gather:
        best = max(gather, key=lambda r: r["gbps"])
        out["gather_best"] = (
            f"{best['gbps']:.1f} GB/s = {best['vs_copy']:.2f} x plain copy "
            f"({best['programs']} programs, {best['config']})"
        )
    engine = [r for r in rows if r["kernel"] == "block_gather" and r["impl"] == "copy engine"]
    if engine:
        best = max(engine, key=lambda r: r["gbps"])
        out["copy_engine_best"] = f"{best['gbps']:.1f} GB/s = {best['vs_copy']:.2f} x plain copy ({best['config']})"
    for kernel in ("sparse_decode", "block_scores"):
        fast = [r for r in rows if r["kernel"] == kernel and r["impl"] == "triton"]
        if fast:
            speed = [r["speedup"] for r in fast]
            out[f"{kernel}_speedup"] = f"{min(speed):.2f}x .. {max(speed):.2f}x over the reference"
    return out


def run_sizes(device: torch.device, batches, reps) -> dict:
    """The run's sizes, repetitions and dtype: realistic on CUDA, small on the CPU (references only)."""
    if device.type == "cuda":
        return dict(
            name=torch.cuda.get_device_name(device), batches=batches or [1, 4, 16], reps=reps or 20,
            heads=8, dim=128, block=64, slots=64, gather_seq=8192, group=4, width=32, decode_seq=32768,
            score_seq=32768, dtype=torch.bfloat16,
        )  # fmt: skip
    torch.set_num_threads(1)  # thread wake-ups on a busy shared CPU swamp these small timings
    return dict(
        name="CPU (references only, 1 thread)", batches=batches or [1, 4], reps=reps or 5,
        heads=2, dim=64, block=64, slots=16, gather_seq=4096, group=4, width=16, decode_seq=4096,
        score_seq=4096, dtype=torch.float32,
    )  # fmt: skip


def run_all(device: torch.device, sizes: dict, programs, miss: float, run_triton: bool) -> list[dict]:
    """Every benchmark's rows: the gather, decode attention, block scores."""
    batches, heads, dim, block, group = (sizes[k] for k in ("batches", "heads", "dim", "block", "group"))
    common = (sizes["dtype"], sizes["reps"], run_triton)
    rows = bench_gather(
        device, batches, programs, heads, dim, block, sizes["slots"], sizes["gather_seq"], miss, *common
    )
    rows += bench_decode(device, batches, heads, group, dim, block, sizes["width"], sizes["decode_seq"], *common)
    rows += bench_scores(device, batches, heads, group, dim, sizes["score_seq"], *common, SparseConfig())
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--programs", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--miss", type=float, default=0.5, help="share of slots that load a block")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)

    auto_device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto_device if args.device == "auto" else args.device)
    run_triton = device.type == "cuda" and K._common.triton_available()
    sizes = run_sizes(device, args.batches, args.reps)
    name = sizes["name"]
    timed_triton = "yes" if run_triton else "not timed"
    print(f"device: {name}; torch {torch.__version__}; triton {timed_triton}; dtype {sizes['dtype']}")
    t0 = time.perf_counter()
    rows = run_all(device, sizes, args.programs, args.miss, run_triton)
    print_table(rows)
    for key, value in summary(rows).items():
        print(f"{key}: {value}")
    print(f"benchmark time: {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, rows=rows, summary=summary(rows)), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
