"""Wall time of `forecastkv --help`, `--version` and each command's `--help` (issue 40: under 1 s,
as the parsers import no torch), beside `python -c pass` and `python -c "import torch"` measured
in the same run: the ratio to the interpreter's own start is what this machine's load cannot move.

Each command runs `--repeats` times in a fresh process; the median is reported.

    python benchmarks/cli_startup.py [--repeats 5] [--output benchmarks/results/cli_startup.md]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = ["demo", "generate", "convert", "eval", "study", "context-cache", "train-forecast", "forecast-recall"]


def script() -> list[str]:
    """The installed console script beside this interpreter, else `python -m forecastkv.cli`."""
    beside = Path(sys.executable).with_name("forecastkv")
    found = str(beside) if beside.is_file() else shutil.which("forecastkv")
    return [found] if found else [sys.executable, "-m", "forecastkv.cli"]


def median_seconds(argv: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr[-500:]}")
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command (the median is kept)")
    parser.add_argument("--output", default=None, help="also write the table here (markdown)")
    args = parser.parse_args()
    base = script()
    rows = [
        ("python -c pass", [sys.executable, "-c", "pass"]),
        ('python -c "import torch"', [sys.executable, "-c", "import torch"]),
        ("forecastkv --version", [*base, "--version"]),
        ("forecastkv --help", [*base, "--help"]),
        *((f"forecastkv {name} --help", [*base, name, "--help"]) for name in COMMANDS),
    ]
    measured = [(label, median_seconds(argv, args.repeats)) for label, argv in rows]
    python = measured[0][1]
    lines = [
        "# Console script start-up",
        "",
        f"`python benchmarks/cli_startup.py --repeats {args.repeats}` (median of {args.repeats} fresh processes each)",
        "",
        "| command | seconds | / python -c pass |",
        "|---|---|---|",
        *(f"| `{label}` | {seconds:.3f} | {seconds / python:.1f}x |" for label, seconds in measured),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
