"""`forecastkv quality`: its options (`register_quality_command`, wired in by `forecastkv/cli.py`) and its body
(`run`): task accuracy with Wilson intervals, held-out perplexity and H2D bytes per selector (`suite.py`),
then summary.json, summary.md and accuracy_vs_h2d.png (`suite_report.py`).  Importing this module imports
no torch.

`--small` runs on a tiny random model with byte tokens (no download, no bundled weights): a few examples
per task at one short length, a short answer, so CI checks the whole path in seconds.  Its accuracies
mean nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..usage import UsageError, check_heads_option, positive_int

# `forecastkv quality --small`: the tiny model's lengths, budget and answer (the options given win)
SMALL = {"lengths": [640], "budgets": [8], "examples": 3, "ppl_tokens": 32, "max_new_tokens": 8}
# the tiny random model of --small: byte tokens, 3 layers, blocks of 16 (one init block, a one-block window)
TINY_MODEL = dict(
    vocab_size=128,
    hidden_size=96,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.3,
    query_chunk_size=16,
    bos_token_id=None,
    eos_token_id=None,
)
TINY_SPARSE = dict(
    kernel_size=8, kernel_stride=4, block_size=16, init_blocks=1, window_size=16, topk=4, dense_len=0, query_blocks=1
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The quality command's options (defaults None: an option left out takes --small's value, else the spec's)."""
    parser.add_argument(
        "--tasks", nargs="+", default=None, help="tasks (niah_single_essay niah_multikey niah_multivalue vt passkey)"
    )
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=None, help="lengths in tokens (4096 8192)")
    parser.add_argument("--examples", type=int, default=None, help="examples per task and length (50)")
    parser.add_argument(
        "--selectors",
        nargs="+",
        default=None,
        help="selectors besides dense (query quest forecast quest-forecast oracle)",
    )
    parser.add_argument(
        "--budgets", type=positive_int, nargs="+", default=None, help="budgets in blocks, init and local included (16)"
    )
    parser.add_argument(
        "--heads",
        default=None,
        metavar="DIR",
        help="Forecast heads (a train-forecast output or bundled:NAME; default runs/demo/heads, else the shipped ones)",
    )
    parser.add_argument(
        "--ppl-tokens", type=positive_int, default=None, help="held-out tokens scored per length for perplexity (256)"
    )
    parser.add_argument(
        "--no-offload", action="store_true", help="no H2D bytes measured (the offloaded runs of the perplexity cells)"
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="the examples' seed (0); another gives other needles and haystacks"
    )
    parser.add_argument("--out", default="runs/quality", metavar="DIR", help="where the records and the summary go")
    parser.add_argument(
        "--small", action="store_true", help="CI: a tiny random model, 640 tokens, 3 examples, 8 new tokens"
    )
    parser.add_argument("--no-progress", action="store_true", help="no line per example on stderr")


def register_quality_command(subparsers) -> argparse.ArgumentParser:
    """`forecastkv quality [options]`."""
    parser = subparsers.add_parser(
        "quality",
        help="RULER-style task accuracy with 95%% Wilson intervals, held-out perplexity and H2D bytes, per "
        "selector and budget; writes summary.json, summary.md and accuracy_vs_h2d.png",
    )
    add_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def quality_spec(args):
    """The QualitySpec of the options: each one given wins, else --small's, else the spec's default."""
    from .suite import QualitySpec

    given = {
        "tasks": args.tasks,
        "lengths": args.lengths,
        "examples": args.examples,
        "selectors": args.selectors,
        "budgets": args.budgets,
        "heads_dir": args.heads,
        "ppl_tokens": args.ppl_tokens,
        "offload": False if args.no_offload else None,
        "seed": args.seed,
    }
    small = SMALL if args.small else {}
    return QualitySpec(**{**small, **{k: v for k, v in given.items() if v is not None}})


def tiny_model(seed: int = 0):
    """(model, codec) of --small: `TINY_MODEL` with `TINY_SPARSE` and random Forecast heads, seeded; byte tokens."""
    import torch

    from .. import ForecastKVConfig, ForecastKVForCausalLM
    from .codec import ByteCodec

    config = ForecastKVConfig(**TINY_MODEL, sparse_config=TINY_SPARSE, forecast={"enabled": True})
    torch.manual_seed(seed)
    return ForecastKVForCausalLM(config).float().eval(), ByteCodec(TINY_MODEL["vocab_size"])


def load(args, spec):
    """(model, tokenizer, spec, model name) for the run."""
    if args.small:
        model, codec = tiny_model()
        return model, codec, spec, "a tiny random model (--small: byte tokens, 3 layers, random Forecast heads)"
    from .study import load_study_model

    model, tokenizer, spec = load_study_model(spec)
    return model, tokenizer, spec, "SmolLM2-135M (bundled)"


def run(args) -> int:
    """Load the model, measure every cell into --out (a rerun resumes), then write the summary beside it."""
    import time

    from .suite import run_suite
    from .suite_report import summarize, write_summary

    spec = quality_spec(args)  # a bad value fails here, before the model loads
    if args.small and args.heads is not None:
        raise UsageError(f"--heads {args.heads}: --small runs a tiny random model with its own random heads")
    check_heads_option("--heads", args.heads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    model, tokenizer, spec, name = load(args, spec)
    records, ppl_records = run_suite(model, tokenizer, spec, out=out, progress=not args.no_progress)
    forecast = model.config.forecast_config
    heads = {
        "teacher": heads_teacher(spec.heads_dir),
        "vectors": forecast.heads_per_group if forecast.enabled else None,
    }
    cells = summarize(records, ppl_records, heads)
    seconds = time.perf_counter() - began
    answer = "each task's max_new_tokens" if spec.max_new_tokens is None else f"{spec.max_new_tokens}"
    setup = [
        f"model: {name}; Forecast heads: {spec.heads_dir or ('random (--small)' if args.small else 'none')}",
        f"{spec.examples} examples per task and length, needle depths (i + 0.5) / {spec.examples}; greedy decoding "
        f"of {answer} new tokens, every decode row sparse, after one dense prefill per example shared by every cell",
        f"lengths {list(spec.lengths)}, budgets {list(spec.budgets)} blocks (init and local included), "
        f"seed {spec.seed}",
        f"this call: {seconds:.0f} s (resumed records are not measured again)",
    ]
    paths = write_summary(cells, out, setup, spec.ppl_tokens, f"{name}: accuracy against H2D bytes per decode step")
    print(f"quality: {len(records)} example records in {seconds:.0f} s; wrote {', '.join(map(str, paths))}")
    return 0


def heads_teacher(heads_dir) -> str | None:
    """The teacher the Forecast heads in `heads_dir` were trained with (recipe.json's objective), else None."""
    import json

    from ..bundled import resolve_heads_path

    recipe = None if heads_dir is None else Path(resolve_heads_path(str(heads_dir))) / "recipe.json"
    if recipe is None or not recipe.is_file():
        return None
    try:
        return (json.loads(recipe.read_text()).get("objective") or {}).get("teacher")
    except (json.JSONDecodeError, AttributeError):
        return None
