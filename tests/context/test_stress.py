"""Stress of one store shared by processes and users (issue 26 "Must show"):

* 3 processes save different documents into one namespace while 2 open it and look up, and one
  runs `context-cache rm` on the first document's chain, for `SECONDS`; afterwards the store
  loads, the documents no rm touched are complete, and every lookup hit (during and after) gives
  the tokens of a fresh prefill; the counts are printed and failures must be 0;
* another user (uid nobody, in a forked child) swaps the namespace for a symlink to its own
  directory 100 times while the owner saves: nothing lands outside the namespace.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

from forecastkv.context import ContextStore, ContextStoreError, disk
from tests.context.common import document_and_questions, fresh_cache, generate, model_for

REPO = Path(__file__).resolve().parents[2]
SECONDS = 20.0
NAMESPACE = "shared"

# one worker: role (save <doc> | read | rm), the root, the go file, how long; prints its counts as JSON
WORKER = r"""
import json, random, sys, time, warnings
import torch
from forecastkv.context import ContextStore, ContextStoreError, disk
from forecastkv.context.cli import register_context_cache_command
from tests.context.common import document_and_questions, fresh_cache, generate, model_for
role, root, go, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
doc_id = int(sys.argv[5]) if len(sys.argv) > 5 else 0
torch.manual_seed(0)
model = model_for("infllmv2")
docs = [document_and_questions(seed=seed)[0] for seed in range(3)]
rng = random.Random(f"{role}-{doc_id}")
counts = {"role": role, "doc": doc_id, "errors": []}
counts.update(dict.fromkeys(("saves", "loads", "lookups", "hits", "removals", "failures", "warnings"), 0))
root_block = ContextStore(model, selector="query").root
from forecastkv.context.blocks import chain_hashes
first_block = chain_hashes(root_block, docs[0].tolist(), 8, 1)[0]
def question():
    return torch.randint(3, 128, (rng.randint(3, 12),), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
def fail(error):
    counts["failures"] += 1
    counts["errors"].append(repr(error)[:300])
with open(go + ".ready-" + role + str(doc_id), "w"):
    pass
while not __import__("os").path.exists(go):
    time.sleep(0.02)
deadline = time.time() + seconds
while time.time() < deadline:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", disk.ContextStoreWarning)
        try:
            if role == "rm":
                import argparse, io
                top = argparse.ArgumentParser()
                register_context_cache_command(top.add_subparsers(dest="command", required=True))
                args = top.parse_args(["context-cache", "rm", root, "--namespace", "shared", "--block", first_block])
                try:
                    args.run(args, out=io.StringIO())
                    counts["removals"] += 1
                except SystemExit:  # the chain is not there now
                    pass
                except FileNotFoundError:  # no namespace yet
                    pass
                time.sleep(0.3)
                continue
            store = ContextStore(model, root, namespace="shared", selector="query")
            counts["loads"] += 1
            targets = [doc_id] if role == "save" else [0, 1, 2]
            for target in targets:
                prompt = torch.cat([docs[target], question()])
                cache, matched = store.lookup(prompt)
                counts["lookups"] += 1
                tokens = generate(model, prompt, cache, new_tokens=2)
                if matched:
                    counts["hits"] += 1
                    fresh = generate(model, prompt, fresh_cache(model, None, "query"), new_tokens=2)
                    if not torch.equal(tokens, fresh):
                        fail(f"lookup of document {target} (matched {matched}) gave other tokens than a fresh prefill")
                if role == "save":
                    store.insert(cache, prompt)
                    store.save()
                    counts["saves"] += 1
        except Exception as error:
            fail(error)
        counts["warnings"] += len(caught)
        for warning in caught:
            counts["errors"].append("warning: " + str(warning.message)[:300])
print(json.dumps(counts))
"""


@pytest.mark.slow
@pytest.mark.serial  # six processes on one store
def test_three_savers_two_readers_and_rm_share_one_store(tmp_path):
    root, go = tmp_path / "store", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    roles = [("save", 0), ("save", 1), ("save", 2), ("read", 0), ("read", 1), ("rm", 0)]
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, role, str(root), str(go), str(SECONDS), str(doc)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for role, doc in roles
    ]
    try:
        deadline = time.time() + 300
        while len(list(tmp_path.glob("go.ready-*"))) < len(workers) and time.time() < deadline:
            assert all(worker.poll() is None for worker in workers), [
                worker.stderr.read()[-2000:] for worker in workers if worker.poll() is not None
            ]
            time.sleep(0.1)
        go.write_text("go")
        results = []
        for worker in workers:
            out, err = worker.communicate(timeout=SECONDS + 240)
            assert worker.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    totals = {
        key: sum(result[key] for result in results)
        for key in ("saves", "loads", "lookups", "hits", "removals", "failures", "warnings")
    }
    print(f"\nstress {SECONDS:.0f} s: {json.dumps(totals)}")
    for result in results:
        print(f"  {result['role']} {result['doc']}: " + json.dumps({key: result[key] for key in totals}))
    errors = [error for result in results for error in result["errors"]]
    assert totals["failures"] == 0 and totals["warnings"] == 0, errors[:10]
    assert totals["saves"] >= 6 and totals["loads"] >= 8 and totals["hits"] >= 3 and totals["removals"] >= 1, totals

    model = model_for("infllmv2")
    with warnings.catch_warnings():
        warnings.simplefilter("error", disk.ContextStoreWarning)
        store = ContextStore(model, root, namespace=NAMESPACE, selector="query")
    index = json.loads((root / NAMESPACE / "index.json").read_text())
    named = {entry["file"] for entry in index["entries"]}
    on_disk = {f"blocks/{path.name}" for path in (root / NAMESPACE / "blocks").iterdir()}
    assert named == on_disk  # every named file exists, no file is left unnamed
    questions = document_and_questions()[1]
    for seed in range(3):
        doc = document_and_questions(seed=seed)[0]
        for question in questions:
            prompt = torch.cat([doc, question])
            cache, matched = store.lookup(prompt)
            if seed:  # documents no rm touched are complete
                assert matched >= 40, (seed, matched)
            assert torch.equal(
                generate(model, prompt, cache), generate(model, prompt, fresh_cache(model, None, "query"))
            )


def _nobody() -> int | None:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


@pytest.mark.slow
@pytest.mark.serial  # two processes racing on one namespace
@pytest.mark.skipif(
    not hasattr(os, "fork") or not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="another user's swaps need root (to become uid nobody)",
)
def test_another_user_swapping_the_namespace_for_a_symlink_gets_nothing():
    """Under a world-writable root without the sticky bit, uid nobody renames the owner's
    namespace away and puts a symlink to its own directory in its place, 100 times, while the
    owner saves new blocks: no file lands in the attacker's directory (saves go to the directory
    they opened, or are refused), and the namespace that is left loads."""
    uid = _nobody()
    base = Path(tempfile.mkdtemp(prefix="forecastkv-swap-"))  # not under pytest's 0700 tmp: nobody must reach it
    try:
        os.chmod(base, 0o755)
        root, attacker = base / "root", base / "attacker"
        root.mkdir()
        os.chmod(root, 0o777)  # world-writable, no sticky bit: the attack the issue describes
        attacker.mkdir()
        (attacker / "blocks").mkdir()
        for path in (attacker, attacker / "blocks"):
            os.chown(path, uid, uid)
            os.chmod(path, 0o777)
        model = model_for("infllmv2")
        store = ContextStore(model, root, namespace="victim", selector="query")
        store.save()
        ready_read, ready_write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the attacker
            status = 1
            try:
                os.setgid(uid)
                os.setuid(uid)
                swaps, deadline = 0, time.time() + 120
                os.write(ready_write, b"r")
                while swaps < 100 and time.time() < deadline:
                    victim, moved = root / "victim", root / f"victim.moved-{swaps}"
                    try:
                        os.rename(victim, moved)
                        os.symlink(attacker, victim)
                    except OSError:
                        time.sleep(0.001)
                        continue
                    swaps += 1
                    time.sleep(0.02)
                    os.unlink(victim)
                    try:
                        os.rename(moved, victim)
                    except OSError:  # the owner made a new namespace meanwhile
                        pass
                    time.sleep(0.02)
                status = 0 if swaps == 100 else 2
            finally:
                os._exit(status)
        os.close(ready_write)
        if os.read(ready_read, 1) != b"r":  # the child could not become uid nobody
            os.waitpid(pid, 0)
            pytest.skip(f"could not become uid {uid}")
        os.close(ready_read)
        saves = refused = 0
        gen = torch.Generator().manual_seed(0)
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            ids = torch.randint(3, 128, (17,), generator=gen)
            cache = fresh_cache(model, None, "query")
            with torch.no_grad():
                model(ids[None], cache=cache)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", disk.ContextStoreWarning)
                    if (saves + refused) % 4 == 0:  # reopen now and then: loads race the swaps too
                        store = ContextStore(model, root, namespace="victim", selector="query")
                    store.insert(cache, ids)
                    store.save()
                saves += 1
            except (ContextStoreError, OSError):
                refused += 1
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        leaked = [str(path) for path in attacker.rglob("*") if path != attacker / "blocks"]
        print(
            f"\nsymlink race: 100 swaps, {saves} saves done, {refused} refused, "
            f"{len(leaked)} files outside the namespace"
        )
        assert leaked == [] and saves > 0
        assert ContextStore(model, root, namespace="victim", selector="query") is not None
    finally:
        shutil.rmtree(base, ignore_errors=True)
