"""The `forecastkv` console script.

Each sub-command is one `_<name>` function and one entry of `SUBCOMMANDS` (its parser builder);
`train-forecast`, `forecast-recall` and `lm-eval` hand their arguments to a program that parses
them itself (`PASSTHROUGH`).  A user error prints one line, `forecastkv: error: <message>`, and
exits with status 2, as argparse does; `forecastkv --debug <command> ...` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .context.cli import register_context_cache_command  # imports no torch

# forecastkv.inference.MODES, spelled here so --help needs no torch import; a test keeps them equal
OFFLOAD_MODES = ("no-offload", "sparse-offload", "forecast-sync", "forecast-offload", "dense-offload")
# forecastkv.inference.offloaded.MODE_SELECTOR's forecast modes (the same test keeps them equal)
FORECAST_OFFLOAD_MODES = ("forecast-sync", "forecast-offload")
USAGE_STATUS = 2


class UsageError(ValueError):
    """A user error worded for the command line (names the option to change)."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line: `forecastkv: error: <prog>: <message>`, status 2."""

    def error(self, message: str):
        sub = self.prog.removeprefix("forecastkv").strip()
        _print_error(f"{sub}: {message}" if sub else message)
        sys.exit(USAGE_STATUS)


def _print_error(message: str) -> None:
    print(f"forecastkv: error: {' '.join(str(message).split())}", file=sys.stderr)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# ----------------------------------------------------------------------------------------------
# checks that word the library's errors for this interface
# ----------------------------------------------------------------------------------------------


def _model_path(option: str, value: str) -> str:
    """The checkpoint directory (or hub id) an option names: `smollm2-135m` and `bundled:NAME` are
    the bundled model; a local-looking path must exist."""
    from .bundled import bundled_model_path, resolve_model_path

    if value == "smollm2-135m":
        return bundled_model_path(value)
    path = resolve_model_path(value)
    local = Path(path).expanduser()
    if path.startswith((".", "/", "~")) or local.exists():
        if not local.is_dir():
            raise UsageError(f"{option} {value}: no such checkpoint directory" if not local.exists() else f"{option} {value}: not a directory")
        if not (local / "config.json").is_file():
            raise UsageError(f"{option} {value}: no config.json in that directory (not a checkpoint)")
    return str(local) if local.exists() else path


def _check_preset(option: str, name: str | None) -> None:
    if name is None:
        return
    from .modeling.configuration import list_presets

    if name not in list_presets():
        raise UsageError(f"{option} {name!r} is not a preset; known presets: {', '.join(list_presets())}")


def _check_offload_needs(mode: str | None, model_option: str, path: str, forecast_given: bool) -> None:
    """Before loading: a forecast offload mode needs Forecast heads (created or loaded)."""
    if mode not in FORECAST_OFFLOAD_MODES or forecast_given:
        return
    from .modeling.checkpoints import has_forecast_heads

    if not has_forecast_heads(path):
        raise UsageError(
            f"--offload {mode} selects blocks with Forecast heads, and {model_option} {path} has none: add --forecast-init next_query "
            "(untrained heads made from the next layer's queries) or --forecast-weights DIR (a train-forecast output)")


def _check_sparse(mode: str | None, model) -> None:
    if mode in ("sparse-offload", *FORECAST_OFFLOAD_MODES) and model.config.sparse is None:
        raise UsageError(f"--offload {mode} needs a sparse model, and this checkpoint is dense: add --sparse-config PRESET (e.g. smollm2-135m)")


# ----------------------------------------------------------------------------------------------
# the sub-commands
# ----------------------------------------------------------------------------------------------


def _demo(args) -> int:
    from .demo import run_demo

    run_demo(output=args.output, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, progress=not args.no_progress)
    return 0


def _generate(args) -> int:
    path = _model_path("--model", args.model)
    _check_preset("--sparse-config", args.sparse_config)
    _check_offload_needs(args.offload, "--model", path, bool(args.forecast_init or args.forecast_weights))

    from transformers import AutoTokenizer

    from . import ForecastKVForCausalLM
    from .demo import generate_with_cache

    forecast = {"init": args.forecast_init} if args.forecast_init else None
    model = ForecastKVForCausalLM.from_pretrained(path, sparse_config=args.sparse_config, forecast_weights=args.forecast_weights, forecast=forecast)
    _check_sparse(args.offload, model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    if args.context_cache:
        from .context.cli import run_generate_with_context_cache

        return run_generate_with_context_cache(args, model, tokenizer, ids)
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
    source = _model_path("source", args.source)
    _check_preset("--sparse-config", args.sparse_config)

    from . import ForecastKVForCausalLM
    from .modeling.checkpoints import copy_tokenizer_files

    model = ForecastKVForCausalLM.from_pretrained(source, sparse_config=args.sparse_config, forecast_weights=args.forecast_weights)
    model.save_pretrained(args.output)
    copied = copy_tokenizer_files(source, args.output)
    print(f"wrote {args.output} (model_type forecastkv; loads with AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True); "
          f"tokenizer files: {', '.join(copied) if copied else 'none in the source'})")
    return 0


def _train_forecast(argv: list[str]) -> int:
    from .training import main as train_main

    return train_main(argv) or 0


def _forecast_recall(argv: list[str]) -> int:
    from .training.recall import main as recall_main

    return recall_main(argv) or 0


def _lm_eval(argv: list[str]) -> int:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UsageError("forecastkv lm-eval needs lm-evaluation-harness: pip install 'forecastkv[lmeval]'") from None
    from .lm_eval import cli_evaluate

    return cli_evaluate(argv)


# commands whose arguments another parser owns (argparse would eat their --help)
PASSTHROUGH = {
    "train-forecast": (_train_forecast, "fit the Forecast heads on a frozen base (see --help)"),
    "forecast-recall": (_forecast_recall, "held-out forecast recall of saved heads (see --help)"),
    "lm-eval": (_lm_eval, "lm-evaluation-harness with `--model forecastkv` registered (lm_eval's own arguments; see --help)"),
}


def _add_demo(commands) -> None:
    demo = commands.add_parser("demo", help="the main job on the bundled SmolLM2: train Forecast heads, evaluate, generate offloaded, report")
    demo.add_argument("--output", default="runs/demo", help="where the heads, eval results and report.md go (a rerun resumes)")
    demo.add_argument("--prompt-tokens", type=positive_int, default=None,
                      help="prompt of the offloaded generation (default: the 8K curve's prompt, whose prefill it continues)")
    demo.add_argument("--new-tokens", type=positive_int, default=None, help="tokens the offloaded generation adds (default: presets/demo/curves.yaml's)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(run=_demo)


def _add_generate(commands) -> None:
    gen = commands.add_parser("generate", help="greedy generation from a prompt (argument or stdin)")
    gen.add_argument("--model", default="smollm2-135m", help="a checkpoint directory, hub id, bundled:NAME or smollm2-135m")
    gen.add_argument("--sparse-config", default=None, help="a preset name from forecastkv/presets (default: the checkpoint's)")
    gen.add_argument("--forecast-weights", default=None, help="a directory written by train-forecast")
    gen.add_argument("--prompt", default=None)
    gen.add_argument("--max-new-tokens", type=positive_int, default=64)
    gen.add_argument("--stats", action="store_true", help="print the share of KV blocks read per decode step (with --offload: bytes moved, hit rates)")
    gen.add_argument("--offload", default=None, choices=OFFLOAD_MODES, help="keep the KV cache in host memory, moving blocks as this mode does")
    gen.add_argument("--forecast-init", default=None, choices=("next_query", "kaiming"), help="create Forecast heads the checkpoint lacks (needed by the forecast-* modes)")
    from .context.cli import add_context_cache_arguments

    add_context_cache_arguments(gen)
    gen.set_defaults(run=_generate)


def _add_convert(commands) -> None:
    convert = commands.add_parser("convert", help="convert a MiniCPM / NOSA / Llama / SparDA checkpoint to our format (weights, tokenizer, auto_map)")
    convert.add_argument("source")
    convert.add_argument("output")
    convert.add_argument("--sparse-config", default=None)
    convert.add_argument("--forecast-weights", default=None)
    convert.set_defaults(run=_convert)


def _add_eval(commands) -> None:
    from .eval.__main__ import add_arguments as eval_arguments
    from .eval.__main__ import run as eval_run

    evaluate = commands.add_parser("eval", help="long-context tasks under every mode side by side (see --config)")
    eval_arguments(evaluate)
    evaluate.set_defaults(run=eval_run)


# name -> the function that adds its sub-parser; a new sub-command is one function and one entry
SUBCOMMANDS = {"demo": _add_demo, "generate": _add_generate, "convert": _add_convert, "eval": _add_eval,
               "context-cache": register_context_cache_command}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="forecastkv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in SUBCOMMANDS.values():
        add(commands)
    for name, (run, help_text) in PASSTHROUGH.items():
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def _run(argv: list[str]) -> int:
    if argv[:1] and argv[0] in PASSTHROUGH:
        return PASSTHROUGH[argv[0]][0](argv[1:])
    args = build_parser().parse_args(argv)
    return args.run(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = False
    while argv[:1] == ["--debug"]:
        debug, argv = True, argv[1:]
    if argv[:1] and argv[0] not in PASSTHROUGH and "--debug" in argv:  # our own commands take it anywhere
        debug, argv = True, [a for a in argv if a != "--debug"]
    try:
        return _run(argv)
    except SystemExit as stop:
        if isinstance(stop.code, str) and not debug:  # `raise SystemExit("message")` deep inside a command
            _print_error(stop.code)
            return USAGE_STATUS
        raise
    except (ValueError, OSError, ImportError) as error:  # CheckpointError and the config checks are ValueErrors
        if debug:
            raise
        _print_error(error)
        return USAGE_STATUS


if __name__ == "__main__":
    sys.exit(main())
