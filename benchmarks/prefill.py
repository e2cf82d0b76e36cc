"""Sparse vs dense prefill: time and peak memory of one forward over a long prompt.

CPU (this machine): the bundled SmolLM2-135M on real essay text, dense (no sparse_config) against
the `smollm2-135m` preset (12 blocks of 64).  Time: both models in one process, runs alternating
dense / sparse (`--repeats` each, best kept), so load from other processes hits both alike.
Memory: each (mode, length) in a fresh process, peak RSS minus the RSS held just before the forward.

    python benchmarks/prefill.py --lengths 4096 8192            # prints a table and JSON lines
    python benchmarks/prefill.py --lengths 8192 --chunked-memory 1024   # sparse, one call vs chunks

`--chunked-memory N`: the sparse model's peak RSS for one call against `prefill_chunk = N` (rows
per forward call, each attending to the cache so far), each in a fresh process.

GPU: `gpu_prefill_comparison()` runs the same comparison on MiniCPM4.1-8B-shaped random weights
(bf16, a few layers: per-layer cost is what differs) at 32K and 128K tokens; benchmarks/gpu_check.py
calls it (`--gpu-check --json PATH [--budget-s S]`).  Dense prefill there is flash-attn when
installed, else SDPA; sparse is FlexAttention (compiled once per shape bucket: the warm-up runs
the full length) with the fused stage-1 kernel, in query chunks of GPU_QUERY_CHUNK rows.  Each row
also reports the selection share of sparse prefill time (`selection_share`, from the phase run),
whether the fused stage-1 kernel ran, and the shapes for which FlexAttention fell back to eager.
Both modes return only the last position's logits (a prefill needs no more).  `--json` is rewritten
(atomically) after every length, so a killed run keeps the lengths it finished; with `--budget-s`
no length starts after that many seconds.
`--tiny`: the same comparison on tiny random models on the CPU (a dry run of the GPU path, seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_memory import PeakSampler, rss_bytes  # noqa: E402

MINICPM_SHAPE = dict(
    vocab_size=73448,
    hidden_size=4096,
    intermediate_size=16384,
    num_attention_heads=32,
    num_key_value_heads=2,
    head_dim=128,
    rms_norm_eps=1e-6,
    max_position_embeddings=131072 + 1024,
    bos_token_id=None,
    eos_token_id=None,
)


def prompt_ids(tokenizer, length: int):
    """The first `length` tokens of the bundled essays, [1, length] int64."""
    import torch

    from forecastkv import bundled_texts

    text = "\n\n".join(bundled_texts("all"))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :length]
    if ids.shape[1] < length:
        raise ValueError(f"the bundled essays hold {ids.shape[1]} tokens, fewer than length={length}")
    return ids.to(torch.long)


def timed_prefill(model, ids, repeats: int = 1) -> tuple[float, object]:
    """Best wall time of `repeats` forwards (last-position logits only) and the last logits."""
    import torch

    best, logits = float("inf"), None
    for _ in range(repeats):
        if ids.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            logits = model(ids, logits_to_keep=1, use_cache=False).logits
        if ids.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, logits


def smollm2(mode: str):
    from forecastkv import ForecastKVForCausalLM, bundled_model_path

    path = bundled_model_path("smollm2-135m")
    return path, ForecastKVForCausalLM.from_pretrained(path, sparse_config="smollm2-135m" if mode == "sparse" else None)


def cpu_memory(mode: str, length: int, threads: int, chunk: int = 0) -> dict:
    """Peak RSS of one (mode, length) prefill on the bundled SmolLM2, in this (fresh) process;
    `chunk` > 0: prefilled `chunk` rows per forward call (`prefill_chunk`)."""
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(threads)
    path, model = smollm2(mode)
    model.config.prefill_chunk = chunk
    ids = prompt_ids(AutoTokenizer.from_pretrained(path), length)
    gc.collect()
    held = rss_bytes()
    sampler = PeakSampler()
    sampler.start()
    _, logits = timed_prefill(model, ids)
    sampler.running = False
    sampler.join()
    return {
        "mode": mode,
        "length": length,
        "prefill_chunk": chunk,
        "peak_mib": (sampler.peak - held) / 2**20,
        "next_token": int(logits[0, -1].argmax()),
    }


def run_chunked_memory(lengths: list[int], threads: int, chunk: int) -> list[dict]:
    """Sparse prefill peak RSS, one call against `chunk` rows per call, each in a fresh process."""
    rows = []
    for length in lengths:
        pair = []
        for rows_per_call in (0, chunk):
            cmd = [
                sys.executable,
                __file__,
                "--one",
                "sparse",
                str(length),
                "--threads",
                str(threads),
                "--chunk",
                str(rows_per_call),
            ]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            pair.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(pair[-1]), flush=True)
        one, chunked = pair
        rows.append(
            {
                "length": length,
                "prefill_chunk": chunk,
                "one_call_peak_mib": one["peak_mib"],
                "chunked_peak_mib": chunked["peak_mib"],
                "memory_ratio": chunked["peak_mib"] / max(one["peak_mib"], 1e-9),
                "same_next_token": one["next_token"] == chunked["next_token"],
            }
        )
    return rows


def cpu_times(lengths: list[int], threads: int, repeats: int) -> dict:
    """{(mode, length): best seconds}, dense and sparse runs alternating in this process."""
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(threads)
    path, dense = smollm2("dense")
    _, sparse = smollm2("sparse")
    tokenizer = AutoTokenizer.from_pretrained(path)
    best = {}
    for length in lengths:
        ids = prompt_ids(tokenizer, length)
        for _ in range(repeats):
            for mode, model in (("dense", dense), ("sparse", sparse)):
                seconds, _ = timed_prefill(model, ids)
                best[(mode, length)] = min(seconds, best.get((mode, length), float("inf")))
                print(json.dumps({"mode": mode, "length": length, "seconds": seconds}), flush=True)
    return best


def run_cpu(lengths: list[int], threads: int, repeats: int) -> list[dict]:
    rows = []
    for length in lengths:
        for mode in ("dense", "sparse"):
            cmd = [sys.executable, __file__, "--one", mode, str(length), "--threads", str(threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    times = cpu_times(lengths, threads, repeats)
    for row in rows:
        row["seconds"] = times[(row["mode"], row["length"])]
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Per length: sparse / dense time and peak memory."""
    by = {(r["mode"], r["length"]): r for r in rows}
    out = []
    for length in sorted({r["length"] for r in rows}):
        dense, sparse = by[("dense", length)], by[("sparse", length)]
        out.append(
            {
                "length": length,
                "dense_s": dense["seconds"],
                "sparse_s": sparse["seconds"],
                "time_ratio": sparse["seconds"] / dense["seconds"],
                "dense_peak_mib": dense["peak_mib"],
                "sparse_peak_mib": sparse["peak_mib"],
                "memory_ratio": sparse["peak_mib"] / max(dense["peak_mib"], 1e-9),
            }
        )
    return out


# ----------------------------------------------------------------------------------------------
# GPU: MiniCPM4.1-8B-shaped random weights (called by benchmarks/gpu_check.py)
# ----------------------------------------------------------------------------------------------


# query rows per stage-1 call on CUDA: the fused kernel keeps no [rows, C] scores, so chunks of 2K
# rows cost ~32 MiB of block scores and need 8x fewer launches than the default 256
GPU_QUERY_CHUNK = 2048


def minicpm_shaped_model(sparse: bool, num_layers: int, device, dtype, query_chunk_size: int = 256):
    """A ForecastKVForCausalLM with MiniCPM4.1-8B's layer shape (random weights, `num_layers`
    layers), the `minicpm4.1-8b` preset when `sparse`, dense otherwise."""
    import torch

    from forecastkv import ForecastKVConfig, ForecastKVForCausalLM

    config = ForecastKVConfig(
        **MINICPM_SHAPE,
        num_hidden_layers=num_layers,
        initializer_range=0.02,
        sparse_config="minicpm4.1-8b" if sparse else None,
        query_chunk_size=query_chunk_size,
    )
    with torch.device(device):
        model = ForecastKVForCausalLM(config)
    return model.to(dtype).eval()


PHASES = {  # what `phase_times` attributes a call's time to: (module, owner in it or None, name)
    # the compressed-index selectors' prefill selection (query, forecast, speculate: what is timed here)
    "select": ("forecastkv.selectors.base", "Selector", "select"),
    "sparse_attention": ("forecastkv.modeling.attention", None, "chunked_sparse_attention"),
    "flex_attention": ("forecastkv.modeling.attention", None, "flex_sparse_attention"),
    "dense_attention": ("forecastkv.modeling.attention", None, "dense_attention"),
}


@contextlib.contextmanager
def phase_times(device):
    """Seconds spent in block selection and in each attention back end while the block runs,
    {phase: seconds}.  Each timed call synchronises CUDA before and after it, so use it on an extra,
    untimed run: the breakdown, not the total, is what it is for."""
    import importlib

    import torch

    totals = dict.fromkeys(PHASES, 0.0)
    originals = []

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for phase, (module, owner, name) in PHASES.items():
        target = importlib.import_module(module)
        target = getattr(target, owner) if owner else target
        original = getattr(target, name)

        def timed(*args, _original=original, _phase=phase, **kwargs):
            sync()
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                sync()
                totals[_phase] += time.perf_counter() - start

        originals.append((target, name, original))
        setattr(target, name, timed)
    try:
        yield totals
    finally:
        for target, name, original in originals:
            setattr(target, name, original)


def prefill_comparison(
    dense,
    sparse,
    lengths,
    vocab_size: int,
    repeats: int = 2,
    warmup_length: int | None = None,
    on_row=None,
    budget_s: float | None = None,
) -> list[dict]:
    """Time dense vs sparse prefill of random prompts on the models' device (same weights).

    Per length: dense_s, sparse_s (best of `repeats`, after a warm-up of `warmup_length` rows,
    None = the full length, which compiles FlexAttention for this length's shape bucket on CUDA),
    speedup = dense_s / sparse_s, on CUDA each mode's peak GiB, `{mode}_phases`: one more run's
    seconds in selection and attention (`phase_times`), the rest under "other";
    `selection_share`: the sparse phase run's selection seconds over its total; `stage1_kernel`:
    whether selection ran the fused kernel; `flex_fallbacks`: the shapes for which FlexAttention
    ran eagerly (`prefill.FLEX_FALLBACKS`, none is the goal).  `on_row(rows)` runs after every
    length, and after each length's dense half (that row marked "status": "partial: dense only",
    so a run killed while sparse compiles keeps the dense numbers); with `budget_s`, a length not
    started within that many seconds of the call is a row {"length", "status": "skipped (time budget)"}.
    """
    import torch

    from forecastkv import kernels
    from forecastkv.modeling import prefill

    device = next(dense.parameters()).device
    started = time.perf_counter()
    results = []
    for length in lengths:
        if budget_s is not None and time.perf_counter() - started > budget_s:
            results.append({"length": length, "status": "skipped (time budget)"})
            if on_row is not None:
                on_row(results)
            continue
        ids = torch.randint(0, vocab_size, (1, length), device=device)
        row = {
            "length": length,
            "num_layers": dense.config.num_hidden_layers,
            "query_chunk_size": sparse.config.query_chunk_size,
            "stage1_kernel": kernels.use_stage1_kernel(device),
            "flex": prefill.use_flex(ids.new_empty((1, length, 1, 1))),
        }
        fallbacks_before = len(prefill.FLEX_FALLBACKS)
        for name, model in (("dense", dense), ("sparse", sparse)):
            # warm-up / compile
            timed_prefill(model, ids if warmup_length is None else ids[:, : min(length, warmup_length)])
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            row[f"{name}_s"], _ = timed_prefill(model, ids, repeats)
            if device.type == "cuda":
                row[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            with phase_times(device) as phases:
                total, _ = timed_prefill(model, ids)
            row[f"{name}_phases"] = {k: round(v, 4) for k, v in phases.items() if v > 0}
            row[f"{name}_phases"]["other"] = round(total - sum(phases.values()), 4)
            if on_row is not None and name == "dense":  # a run killed during the sparse half keeps the dense numbers
                on_row([*results, {**row, "status": "partial: dense only"}])
        row["speedup"] = row["dense_s"] / row["sparse_s"]
        phases = row["sparse_phases"]
        row["selection_share"] = phases.get("select", 0.0) / max(sum(phases.values()), 1e-12)
        row["flex_fallbacks"] = [list(shape) for shape in prefill.FLEX_FALLBACKS[fallbacks_before:]]
        results.append(row)
        if on_row is not None:
            on_row(results)
    return results


def gpu_prefill_comparison(
    lengths=(32768, 131072),
    num_layers: int = 4,
    repeats: int = 2,
    seed: int = 0,
    on_row=None,
    budget_s: float | None = None,
) -> list[dict]:
    """Dense vs block-sparse prefill on CUDA with MiniCPM4.1-8B-shaped layers (random weights,
    bf16, `num_layers` layers), the `minicpm4.1-8b` preset (96 blocks of 64) against dense.

    Returns one dict per length (see `prefill_comparison`).  Goal at 128K: speedup >= 2.2 (the
    FLOP bound at the 96-block budget is ~2.5).  Dense is flash-attn when installed, else SDPA.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("gpu_prefill_comparison needs a CUDA device")
    torch.manual_seed(seed)
    dense = minicpm_shaped_model(False, num_layers, "cuda", torch.bfloat16)
    sparse = minicpm_shaped_model(True, num_layers, "cuda", torch.bfloat16, query_chunk_size=GPU_QUERY_CHUNK)
    sparse.load_state_dict(dense.state_dict())
    return prefill_comparison(
        dense, sparse, lengths, MINICPM_SHAPE["vocab_size"], repeats, on_row=on_row, budget_s=budget_s
    )


TINY_SHAPE = dict(
    vocab_size=128,
    hidden_size=96,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.3,
    bos_token_id=None,
    eos_token_id=None,
)
TINY_SPARSE = dict(
    policy="infllmv2",
    kernel_size=4,
    kernel_stride=2,
    block_size=8,
    init_blocks=1,
    window_size=8,
    topk=3,
    dense_len=0,
    query_blocks=1,
)


def tiny_prefill_comparison(lengths=(128, 256), on_row=None, budget_s: float | None = None) -> list[dict]:
    """`prefill_comparison` on tiny random same-weight dense / sparse models on the CPU (a dry run
    of the GPU path: same rows, seconds)."""
    import torch

    from forecastkv import ForecastKVConfig, ForecastKVForCausalLM

    torch.manual_seed(0)
    dense = ForecastKVForCausalLM(ForecastKVConfig(**TINY_SHAPE)).eval()
    sparse = ForecastKVForCausalLM(ForecastKVConfig(**TINY_SHAPE, sparse_config=TINY_SPARSE)).eval()
    sparse.load_state_dict(dense.state_dict(), strict=False)
    return prefill_comparison(
        dense, sparse, lengths, TINY_SHAPE["vocab_size"], repeats=1, warmup_length=32, on_row=on_row, budget_s=budget_s
    )


# the goals at 128K on MiniCPM4.1-8B-shaped weights (checked per length in the summary)
GOAL_SPEEDUP, GOAL_SELECTION_SHARE = 2.2, 0.20


def length_tag(length: int) -> str:
    return f"{length // 1024}K" if length >= 1024 else str(length)


def write_rows(path: str, rows: list[dict], complete: bool) -> None:
    """{"rows", "summary": per finished length the speedup, the selection share of sparse time,
    the eager flex fallbacks and whether the goals are met, "complete"} to `path`, atomically."""
    from forecastkv.atomic import write_text_atomic

    summary = {}
    for row in rows:
        if "speedup" not in row:
            continue
        tag = length_tag(row["length"])
        summary[f"speedup_{tag}"] = round(row["speedup"], 3)
        summary[f"selection_share_{tag}"] = round(row["selection_share"], 3)
        summary[f"flex_fallbacks_{tag}"] = len(row["flex_fallbacks"])
        summary[f"goals_met_{tag}"] = (
            row["speedup"] >= GOAL_SPEEDUP
            and row["selection_share"] <= GOAL_SELECTION_SHARE
            and not row["flex_fallbacks"]
        )
    write_text_atomic(path, json.dumps({"rows": rows, "summary": summary, "complete": complete}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per mode and length (best kept)")
    parser.add_argument("--gpu", action="store_true", help="run gpu_prefill_comparison at --lengths instead")
    parser.add_argument(
        "--gpu-check", action="store_true", help="gpu_check.py's section: the GPU comparison at 128K, then 32K"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="the comparison on tiny random models on the CPU (a dry run of --gpu-check)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="with --gpu / --gpu-check / --tiny: no length starts after this many seconds",
    )
    parser.add_argument(
        "--json",
        "--out",
        dest="json",
        default=None,
        help="with --gpu / --gpu-check / --tiny: write rows and a summary here (after every length)",
    )
    parser.add_argument(
        "--chunked-memory",
        type=int,
        default=None,
        metavar="ROWS",
        help="sparse prefill peak RSS: one call against ROWS rows per forward call (prefill_chunk)",
    )
    parser.add_argument("--one", nargs=2, metavar=("MODE", "LENGTH"), help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(cpu_memory(args.one[0], int(args.one[1]), args.threads, args.chunk)))
        return
    if args.chunked_memory:
        print(
            "\n| length | rows per call | one call peak MiB | chunked peak MiB | chunked / one call | same next token |"
        )
        print("|---|---|---|---|---|---|")
        for r in run_chunked_memory(args.lengths, args.threads, args.chunked_memory):
            print(
                f"| {r['length']} | {r['prefill_chunk']} | {r['one_call_peak_mib']:.0f} | "
                f"{r['chunked_peak_mib']:.0f} | {r['memory_ratio']:.2f} | {r['same_next_token']} |"
            )
        return
    if args.gpu or args.gpu_check or args.tiny:

        def on_row(rows):
            print(json.dumps(rows[-1]), flush=True)
            if args.json:
                write_rows(args.json, rows, complete=False)

        if args.tiny:
            rows = tiny_prefill_comparison(on_row=on_row, budget_s=args.budget_s)
        else:
            lengths = (131072, 32768) if args.gpu_check else tuple(args.lengths)  # the goal's length first
            rows = gpu_prefill_comparison(lengths, repeats=args.repeats, on_row=on_row, budget_s=args.budget_s)
        if args.json:
            write_rows(args.json, rows, complete=True)
        return
    rows = run_cpu(args.lengths, args.threads, args.repeats)
    print(
        "\n| length | dense s | sparse s | sparse/dense time | dense peak MiB | sparse peak MiB | sparse/dense memory |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in ratios(rows):
        print(
            f"| {r['length']} | {r['dense_s']:.2f} | {r['sparse_s']:.2f} | {r['time_ratio']:.2f} | "
            f"{r['dense_peak_mib']:.0f} | {r['sparse_peak_mib']:.0f} | {r['memory_ratio']:.2f} |"
        )


if __name__ == "__main__":
    main()
