"""The `forecastkv` console script.

Each sub-command is one `_<name>` function and one entry of `SUBCOMMANDS` (its parser builder);
`train-forecast`, `forecast-recall` and `lm-eval` hand their arguments to a program that parses
them itself (`PASSTHROUGH`).  A user error (`is_user_error`) prints one line, `forecastkv: error:
<message>`, and exits with status 2, as argparse does; `forecastkv --debug <command> ...` shows the
traceback.  Any other exception is a bug: it keeps its traceback, and a last line (`BUG_HINT`) asks
to file it.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

from .context.cli import register_context_cache_command  # imports no torch
from .errors import ForecastKVWarning, UserInputError  # imports no torch
from .modes import FORECAST_MODES, MODES, SELECTING_MODES, SELECTORS  # imports nothing

USAGE_STATUS = 2


class UsageError(UserInputError):
    """A user error worded for the command line (names the option to change)."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line: `forecastkv: error: <prog>: <message>`, status 2."""

    def error(self, message: str):
        sub = self.prog.removeprefix("forecastkv").strip()
        _print_error(f"{sub}: {message}" if sub else message)
        sys.exit(USAGE_STATUS)


def _print_error(message: str, kind: str = "error") -> None:
    print(f"forecastkv: {kind}: {' '.join(str(message).split())}", file=sys.stderr)


def _show_warning(message, category, filename, lineno, file=None, line=None, _default=warnings.showwarning) -> None:
    """warnings.showwarning for the console script: our own warnings as one `forecastkv: warning:`
    line (no source line), any other as Python prints it."""
    if issubclass(category, ForecastKVWarning):
        _print_error(message, "warning")
    else:
        _default(message, category, filename, lineno, file, line)


def argument_type(convert, ok, limit: str, expected: str):
    """An argparse type: `convert(text)` (a ValueError: "expected <expected>"), which must pass
    `ok` (else "<limit>, got <text>")."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{limit}, got {text}")
        return value

    return parse


positive_int = argument_type(int, lambda value: value >= 1, "must be at least 1", "a positive integer")
positive_float = argument_type(
    float, lambda value: math.isfinite(value) and value > 0, "must be a finite number > 0", "a number"
)
probability = argument_type(float, lambda value: 0 < value <= 1, "must lie in (0, 1]", "a number in (0, 1]")
seed = argument_type(int, lambda value: 0 <= value < 2**63, "must lie in [0, 2**63)", "an integer")


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
            raise UsageError(
                f"{option} {value}: no such checkpoint directory"
                if not local.exists()
                else f"{option} {value}: not a directory"
            )
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
    if mode not in FORECAST_MODES or forecast_given:
        return
    from .modeling.checkpoints import has_forecast_heads

    if not has_forecast_heads(path):
        raise UsageError(
            f"--offload {mode} selects blocks with Forecast heads, and {model_option} {path} has none: "
            "add --forecast-init next_query (untrained heads made from the next layer's queries) "
            "or --forecast-weights DIR (a train-forecast output)"
        )


def _check_sparse(mode: str | None, model) -> None:
    if mode in SELECTING_MODES and model.config.sparse is None:
        raise UsageError(
            f"--offload {mode} needs a sparse model, and this checkpoint is dense: "
            "add --sparse-config PRESET (e.g. smollm2-135m)"
        )


# ----------------------------------------------------------------------------------------------
# the sub-commands
# ----------------------------------------------------------------------------------------------


def _demo(args) -> int:
    from .demo import run_demo

    run_demo(
        output=args.output, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, progress=not args.no_progress
    )
    return 0


def _decode_utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(f"{what} is not valid UTF-8: byte {data[error.start]:#04x} at offset {error.start}") from None


def _read_prompt(args) -> tuple[str, str]:
    """(prompt text, how the user gave it): --prompt, --prompt-file or stdin, checked to be UTF-8."""
    import os

    if args.prompt is not None:  # argv bytes that are not UTF-8 reach Python as lone surrogates: fsencode restores them
        return _decode_utf8(os.fsencode(args.prompt), "--prompt"), f"--prompt {args.prompt!r}"
    if args.prompt_file is not None:
        path = Path(args.prompt_file).expanduser()
        if not path.is_file():
            raise UsageError(f"--prompt-file {args.prompt_file}: {'not a file' if path.exists() else 'no such file'}")
        return _decode_utf8(path.read_bytes(), f"--prompt-file {args.prompt_file}"), f"--prompt-file {args.prompt_file}"
    stdin = getattr(sys.stdin, "buffer", None)
    data = stdin.read() if stdin is not None else sys.stdin.read().encode("utf-8", "surrogateescape")
    return _decode_utf8(data, "the prompt on stdin"), "the prompt on stdin"


def _check_prompt_fits(tokenizer, prompt: str, source: str, max_positions: int) -> None:
    """Refuse, before tokenizing, a prompt that cannot fit the model's positions: no token of the
    vocabulary spells more than `longest` UTF-8 bytes, so the prompt has at least
    bytes // longest tokens (a 10 MB file once took 40 s and 2.3 GB to tokenize, then was refused)."""
    size = len(prompt.encode("utf-8"))
    longest = max((len(token.encode("utf-8")) for token in tokenizer.get_vocab()), default=1) or 1
    at_least = size // longest
    if at_least > max_positions:
        raise UsageError(
            f"{source} is {size:,} bytes: at least {at_least:,} tokens (no token of this tokenizer spells more "
            f"than {longest} bytes), more than the model's max_position_embeddings={max_positions}"
        )


def _prompt_ids(tokenizer, prompt: str, source: str, chat: bool, model_path: str):
    """The prompt's token ids [1, T] (through the chat template with --chat); at least one token."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError(
                f"--chat: the tokenizer of {model_path} has no chat template "
                "(an instruct model's tokenizer has one); leave out --chat"
            )
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        ids = encoded["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise UsageError(f"{source} has no tokens: give a prompt of at least one token")
    return ids


def _cap_new_tokens(requested: int, prompt_tokens: int, max_positions: int) -> int:
    """--max-new-tokens, capped by the positions the prompt leaves (a note says so)."""
    left = max_positions - prompt_tokens
    if left < 1:
        raise UsageError(
            f"the prompt has {prompt_tokens} tokens and the model's max_position_embeddings is {max_positions}: "
            "no position is left for a new token; shorten the prompt"
        )
    if requested > left:
        _print_error(
            f"--max-new-tokens {requested} capped at {left}, the positions a {prompt_tokens}-token prompt leaves "
            f"of the model's max_position_embeddings={max_positions}",
            "note",
        )
        return left
    return requested


def _generation_streamer(tokenizer, stream: bool, progress_total: int | None = None):
    """A transformers streamer that keeps the new token ids as they come (so an interrupted run
    still prints them) and, with --stream, prints the text as it comes (TextStreamer).
    progress_total: the new tokens asked for, shown as a bar on stderr (tokens/s, ETA); None: no bar."""
    from transformers import TextStreamer
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self) -> None:
            self.tokenizer = tokenizer  # decodes what was generated when the run stops early
            self.ids: list[int] = []
            self.prompt_seen = False
            self.printer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
            self.bar = None
            if progress_total is not None:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=progress_total, desc="generate", unit="tok", file=sys.stderr, mininterval=1.0)

        def put(self, value) -> None:
            if self.printer is not None:
                self.printer.put(value)
            if not self.prompt_seen:  # generate() hands over the prompt first
                self.prompt_seen = True
                return
            new = [int(token) for token in value.reshape(-1).tolist()]
            self.ids.extend(new)
            if self.bar is not None:
                self.bar.update(len(new))

        def end(self) -> None:
            if self.printer is not None:
                self.printer.end()
            if self.bar is not None:
                self.bar.close()

    return Collect()


def _generate(args) -> int:
    path = _model_path("--model", args.model)
    _check_preset("--sparse-config", args.sparse_config)
    _check_offload_needs(args.offload, "--model", path, bool(args.forecast_init or args.forecast_weights))
    sampling = args.temperature is not None or args.top_p is not None
    if args.context_cache and (sampling or args.stream):
        raise UsageError(
            "--context-cache generates greedily and prints at the end: leave out --temperature, --top-p and --stream"
        )
    prompt, source = _read_prompt(args)
    if not prompt and not args.chat:
        raise UsageError(f"{source} is empty: give a prompt of at least one token")

    import time

    import torch
    from transformers import AutoTokenizer

    from . import ForecastKVForCausalLM

    forecast = {"init": args.forecast_init} if args.forecast_init else None
    model = ForecastKVForCausalLM.from_pretrained(
        path,
        sparse_config=args.sparse_config,
        forecast_weights=args.forecast_weights,
        forecast=forecast,
        allow_geometry_mismatch=args.allow_geometry_mismatch,
    )
    _check_sparse(args.offload, model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    _check_prompt_fits(tokenizer, prompt, source, model.config.max_position_embeddings)
    ids = _prompt_ids(tokenizer, prompt, source, args.chat, path)
    args.max_new_tokens = _cap_new_tokens(args.max_new_tokens, ids.shape[1], model.config.max_position_embeddings)
    if args.context_cache:
        from .context.cli import run_generate_with_context_cache

        return run_generate_with_context_cache(args, model, tokenizer, ids)
    cache = _new_cache(model, args.offload)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    # a bar for long runs where someone watches (a terminal) or asked for numbers (--stats); not
    # beside --stream, whose text is the progress
    watched = (sys.stderr.isatty() or args.stats) and not args.stream
    streamer = _generation_streamer(tokenizer, args.stream, args.max_new_tokens if watched else None)
    start = time.perf_counter()
    _run_generation(model, ids, cache, streamer, args, sampling)
    seconds = time.perf_counter() - start
    if not args.stream:
        print(tokenizer.decode(streamer.ids, skip_special_tokens=True))
    if args.stats:
        _print_stats(cache, args.offload, ids.shape[1], len(streamer.ids), seconds)
    return 0


def _new_cache(model, offload: str | None):
    """The cache `generate` decodes into: the offloaded one of `--offload`, else a `SparseCache`."""
    if offload:
        from .inference import OffloadedSparseCache

        return OffloadedSparseCache.for_model(model, mode=offload)
    from .modeling.cache import SparseCache

    return SparseCache(model.config)


def _run_generation(model, ids, cache, streamer, args, sampling: bool) -> None:
    """`model.generate` of prompt `ids` [1, T] into `cache`, the new ids collected by `streamer`
    (greedy, or sampled with --temperature / --top-p)."""
    import torch

    from .modeling.modeling import CACHE_KWARG

    options = {"do_sample": sampling}
    if sampling:
        options.update(temperature=args.temperature or 1.0, top_p=args.top_p or 1.0)
    try:
        with torch.no_grad():
            model.generate(
                ids,
                max_new_tokens=args.max_new_tokens,
                pad_token_id=model.config.eos_token_id,
                streamer=streamer,
                **options,
                **{CACHE_KWARG: cache},
            )
    except BaseException:  # nothing generated is lost: print it before the error (or Ctrl-C) goes on
        if streamer.ids:
            if not args.stream:
                print(streamer.tokenizer.decode(streamer.ids, skip_special_tokens=True), flush=True)
            _print_error(f"generation stopped after {len(streamer.ids)} new tokens (printed above)", "note")
        raise


def _print_stats(cache, offload: str | None, prompt_tokens: int, new_tokens: int, seconds: float) -> None:
    """--stats on stderr: the offloaded cache's bytes and hit rates, or the resident cache's block share."""
    if offload:
        from .inference.report import format_stats

        print(f"[{prompt_tokens} prompt tokens, {new_tokens} new, {seconds:.1f}s]", file=sys.stderr)
        print(format_stats(cache.stats()), file=sys.stderr)
        return
    stats = cache.stats()
    share = "n/a (dense)" if stats["block_share"] is None else f"{100 * stats['block_share']:.1f}%"
    print(
        f"[{prompt_tokens} prompt tokens, {new_tokens} new, {seconds:.1f}s, blocks read per step: {share}]",
        file=sys.stderr,
    )


def _convert(args) -> int:
    source = _model_path("source", args.source)
    _check_preset("--sparse-config", args.sparse_config)
    if args.forecast_init and args.forecast_weights:
        raise UsageError("--forecast-init makes new heads and --forecast-weights loads trained ones: give one")

    from . import ForecastKVForCausalLM
    from .modeling.checkpoints import copy_tokenizer_files, has_forecast_heads

    model = ForecastKVForCausalLM.from_pretrained(
        source,
        sparse_config=args.sparse_config,
        forecast_weights=args.forecast_weights,
        forecast={"init": args.forecast_init} if args.forecast_init else None,
        dtype=args.dtype,
        allow_geometry_mismatch=args.allow_geometry_mismatch,
    )
    model.save_pretrained(args.output)
    tokenizer = copy_tokenizer_files(source, args.output)  # replacing any an earlier run left in OUTPUT
    heads = (
        "yes" if has_forecast_heads(args.output) else "none (forecast modes need --forecast-init/--forecast-weights)"
    )
    print(
        f"wrote {args.output} (model_type forecastkv, {str(model.dtype).removeprefix('torch.')}; "
        f"Forecast heads: {heads}; tokenizer files: {', '.join(tokenizer) if tokenizer else 'none in the source'}); "
        "it loads with AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True) and serves with vLLM"
    )
    return 0


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
    gen.add_argument("--forecast-weights", default=None, help="a directory written by train-forecast")
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


# `forecastkv study --small`: one length of 16 blocks, two budgets below it (so top-p's cap still chooses), one p,
# a short tail
STUDY_SMALL = {"lengths": [1024], "budgets": [8, 12], "top_p": [0.9], "tail_tokens": 8}


def _study_spec(args):
    """The StudySpec of `forecastkv study`'s options: each one given wins, else --small's, else the spec's default."""
    from .eval.study import StudySpec

    given = {
        "lengths": args.lengths,
        "budgets": args.budgets,
        "top_p": args.top_p,
        "tail_tokens": args.tail,
        "selectors": args.selectors,
        "heads_dir": args.heads,
    }
    small = STUDY_SMALL if args.small else {}
    return StudySpec(**{**small, **{k: v for k, v in given.items() if v is not None}})


def _study(args) -> int:
    """Load the bundled model (with --heads' Forecast heads), measure every cell into --out/cells.json
    (a rerun resumes), then write the report (report.md, plots, records.json) beside it."""
    import time

    from .eval.study import load_study_model, run_study
    from .eval.study_report import write_study_report

    spec = _study_spec(args)  # a bad value fails here, before the model loads
    if args.heads is not None and not Path(args.heads).expanduser().is_dir():
        raise UsageError(f"--heads {args.heads}: no such directory (a train-forecast output)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    model, tokenizer, spec = load_study_model(spec)
    records = run_study(model, tokenizer, spec, out=out / "cells.json", progress=not args.no_progress)
    paths = write_study_report(records, out, model="SmolLM2-135M (bundled)")
    print(f"study: {len(records)} cells in {time.perf_counter() - began:.0f} s; wrote {', '.join(map(str, paths))}")
    return 0


def _add_study(commands) -> None:
    study = commands.add_parser(
        "study",
        help="selectors x budgets x lengths on the bundled model: recall against oracle, perplexity, needles, "
        "H2D bytes; writes a table and plots (see benchmarks/selector_study.py for the full run)",
    )
    # defaults None: an option left out takes --small's value, else the study's (forecastkv/eval/study.py)
    study.add_argument("--lengths", type=positive_int, nargs="+", default=None, help="context lengths (2048 4096 8192)")
    study.add_argument(
        "--budgets",
        type=positive_int,
        nargs="+",
        default=None,
        help="fixed budgets in blocks of block_size tokens, init and local blocks included (8 16 32)",
    )
    study.add_argument(
        "--top-p",
        type=probability,
        nargs="*",
        default=None,
        help="top-p masses in (0, 1], each capped at the largest budget (0.8 0.9 0.95; no value: no top-p cells)",
    )
    study.add_argument("--selectors", nargs="+", choices=SELECTORS, default=None, help="selectors to run (all)")
    study.add_argument("--tail", type=positive_int, default=None, help="decode steps scored at each length's end (32)")
    study.add_argument(
        "--heads", default=None, metavar="DIR", help="Forecast heads for `forecast` (default: runs/demo/heads if there)"
    )
    study.add_argument("--out", default="runs/study", metavar="DIR", help="where report.md, the plots and records go")
    study.add_argument(
        "--small", action="store_true", help="1024 tokens, budgets 8 12, p 0.9, tail 8 (the options given win)"
    )
    study.add_argument("--no-progress", action="store_true", help="no line per measured cell")
    study.set_defaults(run=_study)


# name -> the function that adds its sub-parser; a new sub-command is one function and one entry
SUBCOMMANDS = {
    "demo": _add_demo,
    "generate": _add_generate,
    "convert": _add_convert,
    "eval": _add_eval,
    "study": _add_study,
    "context-cache": register_context_cache_command,
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
        _print_error("interrupted", "error")
        return 130
    except SystemExit as stop:
        if isinstance(stop.code, str) and not debug:  # `raise SystemExit("message")` deep inside a command
            _print_error(stop.code)
            return USAGE_STATUS
        raise
    except Exception as error:
        if not is_user_error(error):
            _mark_as_bug(error)
            raise
        if debug:
            raise
        _print_error(error)
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
