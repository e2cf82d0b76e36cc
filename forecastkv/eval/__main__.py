"""`python -m forecastkv.eval --config <suite>.yaml` (also under `accelerate launch -m` and
`torch.distributed.run -m`): run a suite, or `report <dir>` to redraw a report."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="a suite file, e.g. configs/eval/smollm2-135m.yaml")
    parser.add_argument("--limit", type=int, default=None, help="at most this many examples per task and length")
    parser.add_argument("--output-dir", default=None, help="override the suite's output_dir")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from .runner import run_eval

    if args.limit is not None and args.limit < 1:
        raise SystemExit(f"--limit must be at least 1, got {args.limit}")
    out = run_eval(
        args.config, limit=args.limit, output_dir=args.output_dir, progress=False if args.no_progress else None
    )
    if out["report"]:
        from pathlib import Path

        from .report import load, provenance_lines, summary

        records = load(Path(out["results"]).parent)
        if records:
            print("\n".join(line.lstrip("# ") for line in provenance_lines(records) if line))
            print(summary(records))
        print(f"results: {out['results']}\nreport: {out['report']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:
        from .report import write_report

        if len(argv) != 2:
            raise SystemExit("usage: python -m forecastkv.eval report <results dir>")
        print(write_report(argv[1]))
        return 0
    parser = argparse.ArgumentParser(prog="forecastkv eval", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
