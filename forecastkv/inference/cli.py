"""The body of `forecastkv generate` (its parser: `forecastkv/cli.py`): read and check the prompt, load the
model, generate into a resident or offloaded cache (`--offload`), print the text and `--stats`.  The
console script imports this module only when the command runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..usage import (
    UsageError,
    check_offload_needs,
    check_preset,
    check_selector,
    check_sparse,
    model_path,
    print_error,
    selector_option,
)


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
        print_error(
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


def run_generate(args) -> int:
    """`forecastkv generate ARGS`: 0 when the text was printed."""
    path = model_path("--model", args.model)
    check_preset("--sparse-config", args.sparse_config)
    check_selector(args.offload, args.selector, args.context_cache)
    shipped = check_offload_needs(
        args.offload, "--model", args.model, path, bool(args.forecast_init or args.forecast_weights), args.selector
    )
    if shipped is not None:
        args.forecast_weights = shipped
        print(
            f"forecastkv: {selector_option(args.offload, args.selector)} selects with the trained heads shipped for "
            f"{args.model} "
            f"(--forecast-weights {shipped}); --forecast-weights DIR loads your own",
            file=sys.stderr,
        )
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

    from .. import ForecastKVForCausalLM

    forecast = {"init": args.forecast_init} if args.forecast_init else None
    model = ForecastKVForCausalLM.from_pretrained(
        path,
        sparse_config=args.sparse_config,
        forecast_weights=args.forecast_weights,
        forecast=forecast,
        allow_geometry_mismatch=args.allow_geometry_mismatch,
    )
    check_sparse(args.offload, model, args.selector)
    tokenizer = AutoTokenizer.from_pretrained(path)
    _check_prompt_fits(tokenizer, prompt, source, model.config.max_position_embeddings)
    ids = _prompt_ids(tokenizer, prompt, source, args.chat, path)
    args.max_new_tokens = _cap_new_tokens(args.max_new_tokens, ids.shape[1], model.config.max_position_embeddings)
    if args.context_cache:
        from ..context.cli import run_generate_with_context_cache

        return run_generate_with_context_cache(args, model, tokenizer, ids)
    from .offloaded import new_cache

    cache = new_cache(model, args.offload, args.selector)
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


def _run_generation(model, ids, cache, streamer, args, sampling: bool) -> None:
    """`model.generate` of prompt `ids` [1, T] into `cache`, the new ids collected by `streamer`
    (greedy, or sampled with --temperature / --top-p)."""
    import torch

    from ..modeling.modeling import CACHE_KWARG

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
            print_error(f"generation stopped after {len(streamer.ids)} new tokens (printed above)", "note")
        raise


def _print_stats(cache, offload: str | None, prompt_tokens: int, new_tokens: int, seconds: float) -> None:
    """--stats on stderr: the offloaded cache's bytes and hit rates, or the resident cache's block share."""
    if offload:
        from .report import format_stats

        print(f"[{prompt_tokens} prompt tokens, {new_tokens} new, {seconds:.1f}s]", file=sys.stderr)
        print(format_stats(cache.stats()), file=sys.stderr)
        return
    stats = cache.stats()
    share = "n/a (dense)" if stats["block_share"] is None else f"{100 * stats['block_share']:.1f}%"
    print(
        f"[{prompt_tokens} prompt tokens, {new_tokens} new, {seconds:.1f}s, blocks read per step: {share}]",
        file=sys.stderr,
    )
