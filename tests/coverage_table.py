"""Line coverage per sub-package, from coverage.py's JSON reports (`--cov-report=json:FILE`).

    .venv/bin/python tests/coverage_table.py before.json after.json      # one column per report

Not a pytest file (pytest collects `test_*.py` only).  A sub-package is `forecastkv/<name>/`; the
modules directly under `forecastkv/` count as `(top level)`.  Each cell is covered / statements and
the percentage; the table is Markdown (tests/README.md, "Coverage").
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def by_package(report: dict) -> dict[str, tuple[int, int]]:
    """{sub-package: (covered lines, statements)} of one coverage JSON report, plus "total"."""
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for name, data in report["files"].items():
        parts = Path(name).parts
        at = parts.index("forecastkv")  # paths are relative to where coverage ran
        package = parts[at + 1] if len(parts) > at + 2 else "(top level)"
        for key in (package, "total"):
            sums[key][0] += data["summary"]["covered_lines"]
            sums[key][1] += data["summary"]["num_statements"]
    return {key: (covered, statements) for key, (covered, statements) in sums.items()}


def table(reports: dict[str, dict]) -> str:
    """A Markdown table: a row per sub-package (total last), a column per named report."""
    counts = {label: by_package(report) for label, report in reports.items()}
    packages = sorted({p for c in counts.values() for p in c} - {"total"}) + ["total"]
    lines = ["| sub-package | " + " | ".join(counts) + " |", "|---|" + "---|" * len(counts)]
    for package in packages:
        cells = []
        for label in counts:
            covered, statements = counts[label].get(package, (0, 0))
            cells.append(f"{covered}/{statements} ({100 * covered / statements:.1f}%)" if statements else "-")
        lines.append(f"| {package} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    print(table({Path(path).stem: json.loads(Path(path).read_text()) for path in argv}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
