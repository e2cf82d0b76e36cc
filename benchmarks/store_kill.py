"""Random SIGKILLs during a context store save (issue 39).  Each trial saves one document, adds
five more, and forks a child that saves them, killed at a random moment within 1.5x the time a
whole save takes.  The store that loads afterwards must be exactly the old one or the new one, and
a lookup through it must give a fresh prefill's tokens.  Tiny test model (tests/helpers.py).

    PYTHONPATH=. python benchmarks/store_kill.py [--trials 30] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
# running this file puts benchmarks/ on sys.path, where kernels.py would shadow HF's `kernels`
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]


def answered(store, model, prompt, new_tokens=2) -> None:
    """Look `prompt` up, decode a little, insert its blocks."""
    from tests.context.common import generate

    cache, _ = store.lookup(prompt)
    generate(model, prompt, cache, new_tokens)
    store.insert(cache, prompt)


def saved_in_child(store, kill_after: float | None) -> float:
    """`store.save()` in a forked child, SIGKILLed after `kill_after` s (None: let it finish).
    Returns the seconds until the child was gone."""
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            store.save()
        finally:
            os._exit(0)
    if kill_after is not None:
        time.sleep(kill_after)
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import torch

    from forecastkv.context import ContextStore
    from tests.context.common import document_and_questions, fresh_cache, generate, model_for

    warnings.simplefilter("ignore")  # the store's warnings about what a kill left are expected
    model = model_for("infllmv2")
    docs = [document_and_questions(seed=seed, document=400)[0] for seed in range(6)]
    question, check = document_and_questions()[1][:2]
    rng = random.Random(args.seed)
    counts = {"old": 0, "new": 0, "other": 0, "tokens_exact": 0}
    duration = None
    while sum(counts[k] for k in ("old", "new", "other")) < args.trials:
        root = Path(tempfile.mkdtemp(prefix="store-kill-"))
        store = ContextStore(model, root, namespace="alice", selector="query")
        answered(store, model, torch.cat([docs[0], question]))
        store.save()
        old = set(store.entries)
        for doc in docs[1:]:
            answered(store, model, torch.cat([doc, question]))
        new = set(store.entries)
        if duration is None:  # first: how long a whole save takes here
            duration = saved_in_child(store, None)
            shutil.rmtree(root)
            continue
        saved_in_child(store, rng.uniform(0, 1.5 * duration))
        loaded = ContextStore(model, root, namespace="alice", selector="query")
        got = set(loaded.entries)
        counts["old" if got == old else "new" if got == new else "other"] += 1
        prompt = torch.cat([docs[0], check])
        cache, _ = loaded.lookup(prompt)
        fresh = generate(model, prompt, fresh_cache(model, None, "query"))
        counts["tokens_exact"] += bool(torch.equal(generate(model, prompt, cache), fresh))
        shutil.rmtree(root)
    print(f"a whole save: {duration:.2f} s; {args.trials} kills in [0, {1.5 * duration:.2f}] s: {counts}")


if __name__ == "__main__":
    main()
