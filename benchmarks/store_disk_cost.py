"""Disk a context store costs while N processes have it open (issue 39): the file system's used
bytes (`statvfs`) and the store's own (`du`) before, while N readers each open the store, look up a
stored prefix and decode, and after.  Goal: <= 1.1x the store's bytes with 6 readers (the mapped
pool copies once cost about 2x per open).

The store is filled with `--documents` random documents on the tiny test model (tests/helpers.py)
in a scratch directory on the file system under test, so nothing else writes there: pass a
directory on a file system of its own (a tmpfs) for exact numbers.

    PYTHONPATH=. python benchmarks/store_disk_cost.py --dir /mnt/tmpfs [--readers 6] [--documents 20]
        [--output benchmarks/results/store_disk_cost.md]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = os.path.dirname(os.path.abspath(__file__))
# running this file puts benchmarks/ on sys.path, where kernels.py would shadow HF's `kernels`
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

READER = """
import sys, time, torch
from forecastkv.context import ContextStore
from tests.context.common import document_and_questions, generate, model_for
model = model_for("infllmv2")
store = ContextStore(model, sys.argv[1], namespace="bench", selector="query")
doc, questions = document_and_questions(seed=0, document=400)
prompt = torch.cat([doc, questions[1]])
cache, matched = store.lookup(prompt)
generate(model, prompt, cache, new_tokens=4)
print(matched, flush=True)
sys.stdin.read()  # stay open until the parent has measured
"""


def used_bytes(path: Path) -> int:
    info = os.statvfs(path)
    return (info.f_blocks - info.f_bfree) * info.f_frsize


def du_bytes(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def fill(root: Path, documents: int) -> None:
    import torch

    from forecastkv.context import ContextStore
    from tests.context.common import document_and_questions, generate, model_for

    model = model_for("infllmv2")
    store = ContextStore(model, root, namespace="bench", selector="query")
    for seed in range(documents):
        doc, questions = document_and_questions(seed=seed, document=400)
        prompt = torch.cat([doc, questions[0]])
        cache, _ = store.lookup(prompt)
        generate(model, prompt, cache, new_tokens=2)
        store.insert(cache, prompt)
    store.save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="a directory on the file system to measure (a tmpfs of its own)")
    parser.add_argument("--readers", type=int, default=6)
    parser.add_argument("--documents", type=int, default=20)
    parser.add_argument("--output", default=None, help="also write the table here (markdown)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="store-disk-cost-", dir=args.dir))
    fill(root, args.documents)
    store_bytes, before = du_bytes(root), used_bytes(root)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    readers = [
        subprocess.Popen([sys.executable, "-c", READER, str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, cwd=REPO, env=env)
        for _ in range(args.readers)
    ]  # fmt: skip
    matched = [int(reader.stdout.readline()) for reader in readers]  # each has opened, looked up and decoded
    time.sleep(0.5)
    during = used_bytes(root)
    for reader in readers:
        reader.communicate("")
    after = used_bytes(root)
    ratio = (store_bytes + during - before) / store_bytes
    lines = [
        f"# Disk cost of a context store open in {args.readers} processes",
        "",
        f"`PYTHONPATH=. python benchmarks/store_disk_cost.py --dir {args.dir} --readers {args.readers} "
        f"--documents {args.documents}` (tiny test model; each reader matched {sorted(set(matched))} tokens)",
        "",
        "| store (du) | fs used before | with readers open | after | store + growth / store |",
        "|---|---|---|---|---|",
        f"| {store_bytes / 1024:.0f} KiB | {before / 1024:.0f} KiB | {during / 1024:.0f} KiB | {after / 1024:.0f} KiB "
        f"| **{ratio:.2f}x** |",
    ]
    print("\n".join(lines))
    if args.output:
        from forecastkv.atomic import write_text_atomic

        write_text_atomic(args.output, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
