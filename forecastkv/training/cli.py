"""`forecastkv train-forecast`: the command-line entry of the Forecast trainer.

    forecastkv train-forecast --config configs/train/smollm2-135m.yaml [--resume DIR] [--output DIR] [--max-steps N]
    accelerate launch --num_processes 8 -m forecastkv.training.cli --config configs/train/sparda-minicpm4.1-8b.yaml
    torchrun --nproc_per_node 2 -m forecastkv.training.cli --config ...   # several CPU processes (gloo)

(`accelerate launch --cpu --num_processes N` needs mpirun; torchrun starts CPU processes without it,
and `Accelerator` picks them up from the environment.)
"""

from __future__ import annotations

import argparse
import os
import sys


def build_parser(prog: str = "forecastkv train-forecast") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Fine-tune Forecast heads on a frozen sparse base model.")
    parser.add_argument("--config", help="YAML recipe (configs/train/*.yaml); optional with --resume")
    parser.add_argument("--resume", help="run directory or checkpoint file to continue from")
    parser.add_argument("--output", help="output directory (default: the recipe's output_dir, or the resumed run's)")
    parser.add_argument("--max-steps", type=int, help="stop (with a checkpoint) once this step is reached")
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from .trainer import train_forecast

    if args.config is None and args.resume is None:
        raise SystemExit("train-forecast needs --config (or --resume with a run directory)")
    config = args.config
    if config is None:  # resume with the recipe stored in the checkpoint
        from .checkpointing import find_checkpoint, load_checkpoint

        config = load_checkpoint(find_checkpoint(args.resume))["recipe"]
        config = {k: v for k, v in config.items() if k != "resume"}
        config["train"] = {**config["train"], "max_steps": None}  # the interrupted run's stop point
    overrides = {"resume": args.resume, "output_dir": args.output, "max_steps": args.max_steps, "steps": args.steps}
    if args.no_progress:
        overrides["train"] = {"progress": False}
    result = train_forecast(config, **overrides)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if result.history:
        final = result.history[-1]
        print(f"step {result.step}: mean forecast recall (layers >= 1) {final['mean_recall']:.4f} (chance {final['mean_chance']:.4f})")
    print(f"forecast weights: {result.output_dir / 'forecast.safetensors'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
