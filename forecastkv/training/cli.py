"""`forecastkv train-forecast`: the command-line entry of the Forecast trainer.

    forecastkv train-forecast --config configs/train/smollm2-135m.yaml [--resume DIR] [--output DIR] [--max-steps N]
    forecastkv train-forecast --config configs/train/smollm2-135m.yaml --data my_corpus/ --seq-len 1024 --steps 200
    accelerate launch --num_processes 8 -m forecastkv.training.cli --config configs/train/sparda-minicpm4.1-8b.yaml
    torchrun --nproc_per_node 2 -m forecastkv.training.cli --config ...   # several CPU processes (gloo)

(`accelerate launch --cpu --num_processes N` needs mpirun; torchrun starts CPU processes without it,
and `Accelerator` picks them up from the environment.)

Into a directory that holds an interrupted run the command resumes it, into one that holds a
finished run it refuses (exit 2) unless --overwrite; each says so in one line.  Ctrl-C (SIGINT) or
SIGTERM writes a checkpoint at the next safe point, prints how to resume, and exits 130 / 143.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DATA_SUFFIXES = (".txt", ".jsonl")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _data_source(text: str) -> str:
    """--data: an existing .txt / .jsonl file or directory, or a `datasets` name (or "bundled")."""
    path = Path(text).expanduser()
    if path.exists():
        if path.is_file() and path.suffix not in DATA_SUFFIXES:
            raise argparse.ArgumentTypeError(f"{text} is neither a .txt nor a .jsonl file")
        return str(path)
    if path.suffix in DATA_SUFFIXES or text.startswith(("/", "./", "../", "~")):
        raise argparse.ArgumentTypeError(
            f"{text} does not exist (a .txt / .jsonl file or directory, or a datasets name)"
        )
    return text


def build_parser(prog: str = "forecastkv train-forecast") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Fine-tune Forecast heads on a frozen sparse base model.")
    parser.add_argument("--config", help="YAML recipe (configs/train/*.yaml); optional with --resume")
    parser.add_argument("--resume", help="run directory or checkpoint file to continue from")
    parser.add_argument("--output", help="output directory (default: the recipe's output_dir, or the resumed run's)")
    parser.add_argument("--max-steps", type=int, help="stop (with a checkpoint) once this step is reached")
    parser.add_argument("--steps", type=_positive, help="override train.steps")
    parser.add_argument(
        "--data",
        type=_data_source,
        metavar="SOURCE",
        help="override data.source: a .txt / .jsonl file, a directory of them, or a datasets name",
    )
    parser.add_argument(
        "--seq-len", type=_positive, metavar="T", help="override data.seq_len (tokens per training sequence)"
    )
    parser.add_argument("--overwrite", action="store_true", help="start again in a directory that holds a previous run")
    parser.add_argument(
        "--allow-unchecked",
        action="store_true",
        help="resume from a checkpoint without a checksum (format 1, written by an older version); refused otherwise",
    )
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return parser


def _check_resume_overrides(args, stored: dict) -> None:
    """--data / --seq-len may not change a resumed run's data: its position counts those sequences."""
    for option, key, value in (("--data", "source", args.data), ("--seq-len", "seq_len", args.seq_len)):
        if value is not None and value != stored["data"][key]:
            raise SystemExit(
                f"{option} {value} differs from the resumed run's data.{key}={stored['data'][key]!r}: "
                "a resumed run keeps its data; start a new run (another --output, or --overwrite) to change it"
            )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from .trainer import TrainingInterrupted, recall_change, train_forecast

    if args.config is None and args.resume is None:
        raise SystemExit("train-forecast needs --config (or --resume with a run directory)")
    if args.resume and args.overwrite:
        raise SystemExit("--resume and --overwrite contradict each other: pick one")
    config = args.config
    if args.resume:
        from .checkpointing import load_intact

        stored = load_intact(args.resume, args.allow_unchecked)[1]["recipe"]
        _check_resume_overrides(args, stored)
        if config is None:  # resume with the recipe stored in the checkpoint
            config = {k: v for k, v in stored.items() if k != "resume"}
            config["train"] = {**config["train"], "max_steps": None}  # the interrupted run's stop point
    overrides = {"resume": args.resume, "output_dir": args.output, "max_steps": args.max_steps, "steps": args.steps}
    data = {key: value for key, value in (("source", args.data), ("seq_len", args.seq_len)) if value is not None}
    if data:
        overrides["data"] = data
    if args.no_progress:
        overrides["train"] = {"progress": False}
    try:
        result = train_forecast(config, overwrite=args.overwrite, allow_unchecked=args.allow_unchecked, **overrides)
    except TrainingInterrupted as stop:
        print(f"forecastkv train-forecast: {stop.message()}", file=sys.stderr)
        return stop.exit_status
    except KeyboardInterrupt:  # before the run's own handlers were installed: nothing was trained
        print("forecastkv train-forecast: interrupted before training started; nothing to save", file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    print(f"forecast weights: {result.output_dir / 'forecast.safetensors'}")
    if result.history:
        final = result.history[-1]
        print(
            f"step {result.step}: mean forecast recall (layers >= 1) {final['mean_recall']:.4f} "
            f"(chance {final['mean_chance']:.4f})"
        )
    change = recall_change(result.history)
    if change is not None:
        print(change)  # the last line: a fall says so
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
