"""The `forecastkv` console script.

Each sub-command is one `_add_<name>` parser builder (an entry of `SUBCOMMANDS`) and one `_<name>`
function that runs it; a command's body lives in its sub-package (`inference/cli.py`, `modeling/cli.py`,
`eval/study_cli.py`, `context/cli.py`, `training/cli.py`) and is imported only when it runs, so
`--help` imports no torch.  What the bodies share is `usage.py`.
`train-forecast`, `forecast-recall` and `lm-eval` hand their arguments to a program that parses
them itself (`PASSTHROUGH`).  A user error (`is_user_error`) prints one line, `forecastkv: error:
<message>`, and exits with status 2, as argparse does; `forecastkv --debug <command> ...` shows the
traceback.  Any other exception is a bug: it keeps its traceback, and a last line (`BUG_HINT`) asks
to file it.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from .context.cli import register_context_cache_command  # imports no torch
from .errors import ForecastKVWarning, UserInputError  # imports no torch
from .eval.suite_cli import register_quality_command  # imports no torch
from .modes import MODES, SELECTORS  # imports nothing
from .usage import (  # imports no torch
    USAGE_STATUS,
    UsageError,
    positive_float,
    positive_int,
    print_error,
    probability,
    seed,
)


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line: `forecastkv: error: <prog>: <message>`, status 2."""

    def error(self, message: str):
        sub = self.prog.removeprefix("forecastkv").strip()
        print_error(f"{sub}: {message}" if sub else message)
        sys.exit(USAGE_STATUS)


def _show_warning(message, category, filename, lineno, file=None, line=None, _default=warnings.showwarning) -> None:
    """warnings.showwarning for the console script: our own warnings as one `forecastkv: warning:`
    line (no source line), any other as Python prints it."""
    if issubclass(category, ForecastKVWarning):
        print_error(message, "warning")
    else:
        _default(message, category, filename, lineno, file, line)


# ----------------------------------------------------------------------------------------------
# the sub-commands
# ----------------------------------------------------------------------------------------------


def _demo(args) -> int:
    from .demo import run_demo

    run_demo(
        output=args.output, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, progress=not args.no_progress
    )
    return 0


def _generate(args) -> int:
    from .inference.cli import run_generate  # the body imports torch: only when the command runs

    return run_generate(args)


def _convert(args) -> int:
    from .modeling.cli import run_convert

    return run_convert(args)


def _train_forecast(argv: list[str]) -> int:
    from .training import main as train_main

    return train_main(argv) or 0


def _forecast_recall(argv: list[str]) -> int:
    from .training.recall_cli import build_parser as recall_parser

    args = recall_parser().parse_args(argv)  # --help and bad options answer before torch is imported
    from .training.recall import run

    return run(args) or 0


def _lm_eval(argv: list[str]) -> int:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UsageError("forecastkv lm-eval needs lm-evaluation-harness: pip install 'forecastkv[lmeval]'") from None
    from .lm_eval import cli_evaluate

    return cli_evaluate(argv)


# commands whose arguments another parser owns (argparse would eat their --help)
PASSTHROUGH = {
    "train-forecast": (_train_forecast, "fit the Forecast heads on a frozen base model"),
    "forecast-recall": (_forecast_recall, "held-out recall of saved Forecast heads against the oracle's blocks"),
    "lm-eval": (_lm_eval, "lm-evaluation-harness with `--model forecastkv` (lm_eval's own arguments)"),
}


def _add_demo(commands) -> None:
    demo = commands.add_parser(
        "demo", help="the main job on the bundled SmolLM2: train Forecast heads, evaluate, generate offloaded, report"
    )
    demo.add_argument(
        "--output", default="runs/demo", help="where the heads, eval results and report.md go (a rerun resumes)"
    )
    demo.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=None,
        help="prompt of the offloaded generation (default: the 8K curve's prompt, whose prefill it continues)",
    )
    demo.add_argument(
        "--new-tokens",
        type=positive_int,
        default=None,
        help="tokens the offloaded generation adds (default: presets/demo/curves.yaml's)",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(run=_demo)


def _add_generate(commands) -> None:
    gen = commands.add_parser(
        "generate",
        help="generation from a prompt (--prompt, --prompt-file or stdin): "
        "greedy, or sampled with --temperature / --top-p",
    )
    gen.add_argument(
        "--model", default="smollm2-135m", help="a checkpoint directory, hub id, bundled:NAME or smollm2-135m"
    )
    gen.add_argument(
        "--sparse-config",
        default=None,
        help="a preset name from forecastkv/presets "
        "(default: the checkpoint's, else the --forecast-weights heads' own)",
    )
    gen.add_argument(
        "--forecast-weights",
        default=None,
        help="a directory written by train-forecast, or bundled:NAME for the heads shipped with the package "
        "(the default of a forecast --offload mode on the bundled model)",
    )
    _add_geometry_option(gen)
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help="the prompt text (default: read stdin)")
    prompt.add_argument("--prompt-file", default=None, metavar="PATH", help="read the prompt from this UTF-8 file")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt in the tokenizer's chat template as a user turn (instruct models)",
    )
    gen.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=64,
        help="at most this many new tokens (capped by the positions the prompt leaves of max_position_embeddings)",
    )
    gen.add_argument(
        "--temperature", type=positive_float, default=None, help="sample at this temperature (> 0; default: greedy)"
    )
    gen.add_argument(
        "--top-p",
        type=probability,
        default=None,
        help="sample from the smallest token set of this probability mass, in (0, 1]",
    )
    gen.add_argument("--seed", type=seed, default=None, help="seed torch's generator first (reproducible sampling)")
    gen.add_argument("--stream", action="store_true", help="print the text as tokens come")
    gen.add_argument(
        "--stats",
        action="store_true",
        help="print the share of KV blocks read per decode step (with --offload: bytes moved, hit rates)",
    )
    gen.add_argument(
        "--offload",
        default=None,
        choices=MODES,
        help="keep the KV cache in host memory, moving blocks as this mode does",
    )
    gen.add_argument(
        "--selector",
        default=None,
        choices=SELECTORS,
        metavar="NAME",
        help="the block selector, one of: " + ", ".join(SELECTORS) + " (default: the --offload mode's, else the "
        "checkpoint's own). forecast-carry-pin plans a layer ahead and keeps what the quality suite's needles need "
        "(benchmarks/results/quality/README.md)",
    )
    gen.add_argument(
        "--forecast-init",
        default=None,
        choices=("next_query", "kaiming"),
        help="create Forecast heads the checkpoint lacks (needed by the forecast-* modes)",
    )
    from .context.cli import add_context_cache_arguments

    add_context_cache_arguments(gen)
    gen.set_defaults(run=_generate)


def _add_convert(commands) -> None:
    convert = commands.add_parser(
        "convert",
        help="convert a MiniCPM / NOSA / Llama / SparDA checkpoint to our format (weights, tokenizer, auto_map)",
        description="Write SOURCE as a forecastkv checkpoint in OUTPUT: weights, tokenizer files, config.json "
        "with auto_map (plain transformers loads it with trust_remote_code=True) and, with --forecast-init or "
        "--forecast-weights, Forecast heads, so every mode (the forecast ones included) and vLLM serve it.",
    )
    convert.add_argument(
        "source", metavar="SOURCE", help="a checkpoint directory, hub id, bundled:NAME or smollm2-135m"
    )
    convert.add_argument("output", metavar="OUTPUT", help="the directory to write (created; files in it are replaced)")
    convert.add_argument(
        "--sparse-config",
        default=None,
        metavar="PRESET",
        help="a preset from forecastkv/presets for the block selection (default: the source's own; a dense "
        "Llama stays dense)",
    )
    heads = convert.add_mutually_exclusive_group()
    heads.add_argument(
        "--forecast-init",
        default=None,
        choices=("next_query", "kaiming"),
        help="write new Forecast heads: next_query copies each next layer's query projection (selects like "
        "the query selector before any training), kaiming is random",
    )
    heads.add_argument(
        "--forecast-weights", default=None, metavar="DIR", help="write the trained heads of a train-forecast output"
    )
    convert.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="the weights' dtype (default auto: the source's)",
    )
    _add_geometry_option(convert)
    convert.set_defaults(run=_convert)


def _add_geometry_option(parser) -> None:
    parser.add_argument(
        "--allow-geometry-mismatch",
        action="store_true",
        help="load --forecast-weights trained for another block geometry than --sparse-config's (a warning names both)",
    )


def _add_eval(commands) -> None:
    from .eval.__main__ import add_arguments as eval_arguments
    from .eval.__main__ import run as eval_run

    evaluate = commands.add_parser("eval", help="long-context tasks under every mode side by side (see --config)")
    eval_arguments(evaluate)
    evaluate.set_defaults(run=eval_run)


def _add_study(commands) -> None:
    from .eval.study_cli import add_arguments as study_arguments
    from .eval.study_cli import run as study_run

    study = commands.add_parser(
        "study",
        help="selectors x budgets x lengths on the bundled model: recall against oracle, perplexity, needles, "
        "H2D bytes; writes a table and plots (see benchmarks/selector_study.py for the full run)",
    )
    study_arguments(study)
    study.set_defaults(run=study_run)


# name -> the function that adds its sub-parser; a new sub-command is one function and one entry
SUBCOMMANDS = {
    "demo": _add_demo,
    "generate": _add_generate,
    "convert": _add_convert,
    "eval": _add_eval,
    "study": _add_study,
    "context-cache": register_context_cache_command,
    "quality": register_quality_command,
}


DESCRIPTION = "Trainable block-sparse attention with KV-cache offloading, for Hugging Face and vLLM models."
EPILOG = (
    "`forecastkv COMMAND --help` describes a command's options. "
    "Start with `forecastkv demo` (the main job on the bundled SmolLM2-135M); see README.md."
)


def build_parser() -> argparse.ArgumentParser:
    """The console script's parser: one sub-parser per command, each described by its help line."""
    from . import __version__

    parser = Parser(prog="forecastkv", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"forecastkv {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=Parser, title="commands", metavar="COMMAND"
    )
    for add in SUBCOMMANDS.values():
        add(commands)
    for name, (run, help_text) in PASSTHROUGH.items():
        commands.add_parser(name, help=help_text, add_help=False)
    for command in commands.choices.values():  # each command's --help opens with its help line
        if command.description is None:
            command.description = next(
                (action.help for action in commands._choices_actions if action.dest == command.prog.split()[-1]), None
            )
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
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return _run(argv)
    except KeyboardInterrupt:
        if debug:
            raise
        print_error("interrupted", "error")
        return 130
    except SystemExit as stop:
        if isinstance(stop.code, str) and not debug:  # `raise SystemExit("message")` deep inside a command
            print_error(stop.code)
            return USAGE_STATUS
        raise
    except Exception as error:
        if not is_user_error(error):
            _mark_as_bug(error)
            raise
        if debug:
            raise
        print_error(error)
        return USAGE_STATUS


# the line printed below a bug's traceback
BUG_HINT = (
    "forecastkv: this is a bug in forecastkv, not in your input: "
    "please file an issue with the command and the traceback above"
)


def _mark_as_bug(error: BaseException) -> None:
    """Add `BUG_HINT` to an exception that is no user error, which goes on with its traceback.
    Python prints an exception's notes below its traceback (3.11+); 3.10 has no notes, so there
    the hint goes to stderr first."""
    if hasattr(error, "add_note"):
        error.add_note(BUG_HINT)
    else:
        print(BUG_HINT, file=sys.stderr)


# OSErrors that name a path the user gave (a missing --config, an unwritable output directory)
PATH_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


def is_user_error(error: BaseException) -> bool:
    """The errors the console script reports in one line: forecastkv's user-error types
    (`forecastkv.errors`: usage, checkpoint, config, data), the context store's, and an OSError
    about a named path.  Anything else is a bug and keeps its traceback."""
    if isinstance(error, UserInputError):
        return True
    if isinstance(error, PATH_ERRORS) and error.filename is not None:
        return True
    disk = sys.modules.get("forecastkv.context.disk")  # loaded if it raised
    return disk is not None and isinstance(error, disk.ContextStoreError)


if __name__ == "__main__":
    sys.exit(main())
