"""The `forecastkv` console script."""

from __future__ import annotations

import argparse
import sys

# forecastkv.inference.MODES, spelled here so --help needs no torch import; a test keeps them equal
OFFLOAD_MODES = ("no-offload", "sparse-offload", "forecast-sync", "forecast-offload", "dense-offload")


def _demo(args) -> int:
    from .demo import run_demo

    run_demo(output=args.output, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, progress=not args.no_progress)
    return 0


def _generate(args) -> int:
    from transformers import AutoTokenizer

    from . import ForecastKVForCausalLM, bundled_model_path
    from .demo import generate_with_cache

    path = bundled_model_path(args.model) if args.model == "smollm2-135m" else args.model
    forecast = {"init": args.forecast_init} if args.forecast_init else None
    model = ForecastKVForCausalLM.from_pretrained(path, sparse_config=args.sparse_config, forecast_weights=args.forecast_weights, forecast=forecast)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    if args.offload:
        from .inference.report import format_stats, generate_offloaded

        new_ids, cache, seconds = generate_offloaded(model, ids, args.max_new_tokens, mode=args.offload)
        print(tokenizer.decode(new_ids[0], skip_special_tokens=True))
        if args.stats:
            print(f"[{ids.shape[1]} prompt tokens, {new_ids.shape[1]} new, {seconds:.1f}s]", file=sys.stderr)
            print(format_stats(cache.stats()), file=sys.stderr)
        return 0
    new_ids, cache, seconds = generate_with_cache(model, ids, args.max_new_tokens)
    print(tokenizer.decode(new_ids, skip_special_tokens=True))
    if args.stats:
        stats = cache.stats()
        share = "n/a (dense)" if stats["block_share"] is None else f"{100 * stats['block_share']:.1f}%"
        print(f"[{ids.shape[1]} prompt tokens, {len(new_ids)} new, {seconds:.1f}s, blocks read per step: {share}]", file=sys.stderr)
    return 0


def _convert(args) -> int:
    from . import ForecastKVForCausalLM

    model = ForecastKVForCausalLM.from_pretrained(args.source, sparse_config=args.sparse_config, forecast_weights=args.forecast_weights)
    model.save_pretrained(args.output)
    print(f"wrote {args.output} (model_type forecastkv)")
    return 0


def _train_forecast(args) -> int:
    from .training import main as train_main

    return train_main(args.rest) or 0


def _forecast_recall(args) -> int:
    from .training.recall import main as recall_main

    return recall_main(args.rest) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forecastkv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="the main job on the bundled SmolLM2: train Forecast heads, evaluate, generate offloaded, report")
    demo.add_argument("--output", default="runs/demo", help="where the heads, eval results and report.md go (a rerun resumes)")
    demo.add_argument("--prompt-tokens", type=int, default=1024, help="prompt of the offloaded generation (step 3)")
    demo.add_argument("--new-tokens", type=int, default=32)
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(run=_demo)

    gen = commands.add_parser("generate", help="greedy generation from a prompt (argument or stdin)")
    gen.add_argument("--model", default="smollm2-135m", help="a checkpoint directory, hub id, or smollm2-135m")
    gen.add_argument("--sparse-config", default=None, help="a preset name from forecastkv/presets (default: the checkpoint's)")
    gen.add_argument("--forecast-weights", default=None, help="a directory written by train-forecast")
    gen.add_argument("--prompt", default=None)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--stats", action="store_true", help="print the share of KV blocks read per decode step (with --offload: bytes moved, hit rates)")
    gen.add_argument("--offload", default=None, choices=OFFLOAD_MODES, help="keep the KV cache in host memory, moving blocks as this mode does")
    gen.add_argument("--forecast-init", default=None, choices=("next_query", "kaiming"), help="create Forecast heads the checkpoint lacks (needed by the forecast-* modes)")
    gen.set_defaults(run=_generate)

    convert = commands.add_parser("convert", help="convert a MiniCPM / NOSA / Llama / SparDA checkpoint to our format")
    convert.add_argument("source")
    convert.add_argument("output")
    convert.add_argument("--sparse-config", default=None)
    convert.add_argument("--forecast-weights", default=None)
    convert.set_defaults(run=_convert)

    evaluate = commands.add_parser("eval", help="long-context tasks under every mode side by side (see --config)")
    from .eval.__main__ import add_arguments as eval_arguments
    from .eval.__main__ import run as eval_run

    eval_arguments(evaluate)
    evaluate.set_defaults(run=eval_run)

    train = commands.add_parser("train-forecast", help="fit the Forecast heads on a frozen base (see --config)", add_help=False)
    train.add_argument("rest", nargs=argparse.REMAINDER)
    train.set_defaults(run=_train_forecast)

    recall = commands.add_parser("forecast-recall", help="held-out forecast recall of saved heads (see --help)", add_help=False)
    recall.add_argument("rest", nargs=argparse.REMAINDER)
    recall.set_defaults(run=_forecast_recall)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train-forecast"]:  # the trainer owns its own options (argparse would eat --help)
        return _train_forecast(argparse.Namespace(rest=argv[1:]))
    if argv[:1] == ["forecast-recall"]:
        return _forecast_recall(argparse.Namespace(rest=argv[1:]))
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
