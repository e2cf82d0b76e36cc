"""Mutation check: deliberate one-line bugs in the package, each of which the test suite must catch.

Not a pytest file (pytest collects `test_*.py` only) and importable without side effects.

    python tests/mutations.py [--root DIR] [--only NAME ...] [--list]

For each mutation: the file must hold its pristine text (`old` exactly once), the mutated text is
written, `python -m pytest -x -q -p no:cacheprovider --timeout=600 <tests>` runs in ROOT, and the
original bytes are restored whatever happens.  pytest exit 1 (tests failed) = CAUGHT, 0 = MISSED,
anything else (interrupted, usage error, nothing collected) = ERROR.  Exits 1 unless all are CAUGHT.
See tests/mutations.md.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the pristine file
    new: str
    tests: tuple[str, ...]  # pytest args: files or node ids expected to catch it


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "gather-blocks-no-zeroing",
        "forecastkv/modeling/cache.py",
        "return k.masked_fill(missing, 0.0), v.masked_fill(missing, 0.0), pos.masked_fill(~exists, -1), bias",
        "return k, v, pos.masked_fill(~exists, -1), bias",
        ("tests/kernels/test_empty_rows.py::test_sparse_decode_blocks_empty_rows",),
    ),
    Mutation(
        "context-save-without-lock",
        "forecastkv/context/persist.py",
        "with disk.Namespace(self.root, self.namespace, create=True) as space, space.lock(exclusive=True):",
        "with disk.Namespace(self.root, self.namespace, create=True) as space:",
        ("tests/context/test_sharing.py::test_loads_wait_for_a_save_in_progress",),
    ),
    Mutation(
        "forecast-visibility-lag-0",
        "forecastkv/modeling/selection.py",
        'lags = {"query": 0, "forecast": 1, "speculate": 1}',
        'lags = {"query": 0, "forecast": 0, "speculate": 1}',
        ("tests/modeling/test_selection.py",),
    ),
    Mutation(
        "forecast-plans-layer-m-not-m+1",
        "forecastkv/modeling/modeling.py",
        "next_cache_layer, next_layer = (cache.layers[idx + 1], self.layers[idx + 1]) if idx < last else (None, None)",
        "next_cache_layer, next_layer = (cache.layers[idx], self.layers[idx + 1]) if idx < last else (None, None)",
        ("tests/serving/test_page_offload.py",),
    ),
    Mutation(
        "page-offload-skips-the-last-slots-load",
        "forecastkv/serving/page_offload.py",
        "ids = pages.masked_fill(load_ids.unsqueeze(-1) < 0, -1).flatten(-2).permute(1, 0, 2).contiguous()",
        "ids = pages.masked_fill(load_ids.unsqueeze(-1) < 0, -1)[..., :-1, :]"
        ".flatten(-2).permute(1, 0, 2).contiguous()",
        ("tests/serving/test_page_offload.py",),
    ),
    Mutation(
        "top-p-no-budget-cap",
        "forecastkv/modeling/selection.py",
        "take = min(cap, n_blocks)",
        "take = n_blocks",
        ("tests/modeling/test_selectors.py",),
    ),
    Mutation(
        "checkpoint-without-checksum",
        "forecastkv/training/checkpointing.py",
        "metadata = {STATE_KEY: meta, CHECKSUM_KEY: state_checksum(meta, tensors)}",
        "metadata = {STATE_KEY: meta}",
        ("tests/training/test_run_safety.py::test_checkpoint_holds_its_checksum",),
    ),
    Mutation(
        "cli-empty-prompt-raises",
        "forecastkv/inference/cli.py",
        'raise UsageError(f"{source} is empty: give a prompt of at least one token")',
        'raise ValueError(f"{source} is empty: give a prompt of at least one token")',
        ("tests/test_bad_input.py::test_bad_input_is_one_line_and_status_2[empty-prompt]",),
    ),
    Mutation(
        "sparse-decode-kernel-reads-one-row-more",
        "forecastkv/kernels/sparse_decode.py",
        "key_ok = rows < count",
        "key_ok = rows <= count",
        ("tests/kernels/test_sparse_decode.py",),
    ),
    Mutation(
        "objective-rest-from-all-probs",
        "forecastkv/training/objective.py",
        "rest = (1.0 - gathered.sum(dim=-1, keepdim=True)).clamp(min=0.0)",
        "rest = (1.0 - probs.sum(dim=-1, keepdim=True)).clamp(min=0.0)",
        ("tests/training/test_objective.py",),
    ),
    Mutation(
        "token-f1-recall-over-prediction",
        "forecastkv/eval/metrics.py",
        "recall = same / len(reference_tokens)",
        "recall = same / len(prediction_tokens)",
        ("tests/eval/test_metrics.py",),
    ),
    Mutation(
        "atomic-temporaries-glob-without-dot",
        "forecastkv/atomic.py",
        'removed = [p for p in folder.glob(f".{name}.*.tmp") if p.is_file()]',
        'removed = [p for p in folder.glob(f"{name}.*.tmp") if p.is_file()]',
        ("tests/training/test_run_safety.py::test_stale_temporaries_are_removed_at_start",),
    ),
    Mutation(
        "nosa-shortlist-takes-the-whole-budget",
        "forecastkv/modeling/selection.py",
        "shortlist_k = min(sparse.init_blocks + sparse.local_blocks + sparse.query_blocks, budget)",
        "shortlist_k = budget",
        ("tests/modeling/test_selection.py",),
    ),
    Mutation(
        "offload-diff-overwrites-hits",
        "forecastkv/inference/host_pool.py",
        "order_key = order_key.masked_fill(kept, 3 * slots)",
        "order_key = order_key.masked_fill(kept, 0)",
        ("tests/inference/test_layers.py",),
    ),
)

PYTEST = ("-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--timeout=600")
ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRITON_INTERPRET": "1",
}
STATUS = {1: "CAUGHT", 0: "MISSED"}


def mutated_text(mutation: Mutation, text: str) -> str:
    """`text` with the mutation applied; a ValueError unless `old` occurs exactly once."""
    count = text.count(mutation.old)
    if count != 1:
        raise ValueError(f"{mutation.name}: {mutation.path} holds its `old` text {count} times, not once")
    if mutation.old == mutation.new:
        raise ValueError(f"{mutation.name}: `old` and `new` are the same")
    return text.replace(mutation.old, mutation.new)


def line_of(mutation: Mutation, text: str) -> int:
    """The 1-based line where `old` starts."""
    return text[: text.index(mutation.old)].count("\n") + 1


def first_failure(output: str) -> str:
    """The first failing test id in pytest's -q output ('' if none is named)."""
    for pattern in (r"^(?:FAILED|ERROR) (\S+)", r"^_{3,} (\S+) _{3,}$"):
        found = re.search(pattern, output, re.MULTILINE)
        if found:
            return found.group(1)
    return ""


def run_one(mutation: Mutation, root: Path, pristine: dict[str, bytes]) -> tuple[str, float, str]:
    """(CAUGHT | MISSED | ERROR, seconds, first failing test or a reason) of one mutation."""
    path = root / mutation.path
    original = path.read_bytes()
    if original != pristine[mutation.path]:
        return "ERROR", 0.0, f"{mutation.path} is not its pristine text (an earlier mutation left?)"
    mutated = mutated_text(mutation, original.decode("utf-8"))
    env = {**os.environ, **ENV, "PYTHONPATH": str(root)}
    start = time.monotonic()
    try:
        path.write_bytes(mutated.encode("utf-8"))
        proc = subprocess.run(
            [sys.executable, *PYTEST, *mutation.tests],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    finally:
        path.write_bytes(original)
    seconds = time.monotonic() - start
    status = STATUS.get(proc.returncode, "ERROR")
    detail = first_failure(proc.stdout) if status == "CAUGHT" else ""
    if status == "ERROR":
        tail = proc.stdout.strip().splitlines()[-1:] or [""]
        detail = f"pytest exit {proc.returncode}: {tail[0]}"
    return status, seconds, detail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="repository to mutate (default: the one holding this script)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    names = [m.name for m in MUTATIONS]
    if len(set(names)) != len(names):
        parser.error("mutation names are not unique")
    chosen = list(MUTATIONS)
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            parser.error(f"unknown mutation(s): {', '.join(unknown)}; known: {', '.join(names)}")
        chosen = [m for m in MUTATIONS if m.name in args.only]
    # check every mutation applies before running any
    pristine = {m.path: (root / m.path).read_bytes() for m in chosen}
    for mutation in chosen:
        text = pristine[mutation.path].decode("utf-8")
        mutated_text(mutation, text)
    if args.list:
        for mutation in chosen:
            line = line_of(mutation, pristine[mutation.path].decode("utf-8"))
            print(f"{mutation.name}\t{mutation.path}:{line}\t{' '.join(mutation.tests)}")
        return 0
    results = []
    total = time.monotonic()
    for mutation in chosen:
        status, seconds, detail = run_one(mutation, root, pristine)
        results.append(status)
        print(f"{mutation.name:42s} {status:7s} {seconds:7.1f}s  {detail}", flush=True)
    bad = sum(status != "CAUGHT" for status in results)
    print(f"{len(results) - bad}/{len(results)} caught in {time.monotonic() - total:.1f}s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
