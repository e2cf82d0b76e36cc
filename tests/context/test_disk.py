"""The disk tier: tokens after save and load in a new process, namespaces, validation of what is
loaded (each mismatch named, the store left as it was), and kills at several points of a save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from forecastkv.context import ContextStore, ContextStoreError, disk
from tests.context.common import MODES, POLICIES, document_and_questions, fresh_cache, generate, model_for, snapshot

REPO = Path(__file__).resolve().parents[2]


def answer(store, model, mode, prompt):
    """(new tokens, matched) of a prompt answered through a lookup, its blocks inserted after."""
    cache, matched = store.lookup(prompt, mode=mode)
    tokens = generate(model, prompt, cache)
    store.insert(cache, prompt)
    return tokens, matched


def filled_store(tmp_path, policy="infllmv2", name="resident", namespace="alice", questions=2):
    """A saved store of the document and its first `questions` questions; returns (model, store)."""
    mode, selector = MODES[name]
    model = model_for(policy)
    doc, asked = document_and_questions()
    store = ContextStore(model, tmp_path, namespace=namespace, selector=selector)
    for question in asked[:questions]:
        answer(store, model, mode, torch.cat([doc, question]))
    store.save()
    return model, store


# the new process: load each namespace's store and answer the four questions through lookups
LOADER = """
import json, sys, torch
from forecastkv.context import ContextStore
from tests.context.common import MODES, document_and_questions, generate, model_for
root, combos = sys.argv[1], json.loads(sys.argv[2])
doc, questions = document_and_questions()
out = {}
for policy, name in combos:
    mode, selector = MODES[name]
    model = model_for(policy)
    store = ContextStore(model, root, namespace=f"{policy}-{name}", selector=selector)
    answers = []
    for question in questions:
        prompt = torch.cat([doc, question])
        cache, matched = store.lookup(prompt, mode=mode)
        answers.append([matched, generate(model, prompt, cache).tolist()])
    out[f"{policy}-{name}"] = {"answers": answers, "blocks": store.stats()["blocks"]}
print(json.dumps(out))
"""


def run_python(code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_tokens_after_save_and_load_in_a_new_process(tmp_path):
    """Every mode and policy: the four questions, answered in a new process from the saved
    blocks, give the tokens of independent prefills."""
    doc, questions = document_and_questions()
    combos, expected = [], {}
    for policy in POLICIES:
        for name, (mode, selector) in MODES.items():
            model = model_for(policy)
            store = ContextStore(model, tmp_path, namespace=f"{policy}-{name}", selector=selector)
            answer(store, model, mode, torch.cat([doc, questions[0]]))
            store.save()
            combos.append((policy, name))
            expected[f"{policy}-{name}"] = [
                generate(model, torch.cat([doc, q]), fresh_cache(model, mode, selector)).tolist() for q in questions
            ]
    loaded = json.loads(run_python(LOADER, str(tmp_path), json.dumps(combos)).strip().splitlines()[-1])
    for key, want in expected.items():
        got = loaded[key]
        assert got["blocks"] == 6, key  # doc + question 1: 50 tokens, 6 full blocks
        assert [tokens for _, tokens in got["answers"]] == want, key
        assert [matched for matched, _ in got["answers"]] == [48, 40, 40, 40], key


def test_save_load_round_trip_reads_blocks_lazily(tmp_path):
    model, store = filled_store(tmp_path)
    before = snapshot(tmp_path)
    loaded = ContextStore(model, tmp_path, namespace="alice", selector="query")
    assert loaded.stats()["blocks"] == store.stats()["blocks"] == 8 and loaded.nbytes == store.nbytes
    # opening reads the index only: no block in the pools (RAM), nothing written on the store's disk
    assert all(entry.blocks is None for entry in loaded.entries.values())
    assert all(pool.capacity == 0 for pool in loaded.pools)
    doc, questions = document_and_questions()
    prompt = torch.cat([doc, questions[2]])
    cache, matched = loaded.lookup(prompt)
    assert matched == 40
    read_in = [entry for entry in loaded.entries.values() if entry.blocks is not None]
    assert len(read_in) == 5 and all(pool.capacity >= 5 for pool in loaded.pools)  # the matched chain only
    assert snapshot(tmp_path) == before
    assert torch.equal(generate(model, prompt, cache), generate(model, prompt, fresh_cache(model, None, "query")))
    name, entry = next(iter(loaded.entries.items()))
    read, original = disk.DiskBlock((tmp_path / "alice" / entry.disk["file"]).read_bytes()), store.block_rows(name)
    for index in range(original.keys.shape[0]):  # each layer as the file holds it
        keys, values, cis = read.layer(index)
        assert torch.equal(keys, original.keys[index]) and torch.equal(values, original.values[index]) and cis is None


def test_namespaces_are_private_and_isolated(tmp_path):
    model, _ = filled_store(tmp_path, namespace="alice")
    assert os.stat(tmp_path / "alice").st_mode & 0o777 == 0o700
    bob = ContextStore(model, tmp_path, namespace="bob", selector="query")
    doc, questions = document_and_questions()
    _, matched = bob.lookup(torch.cat([doc, questions[0]]))
    assert matched == 0 and bob.stats()["blocks"] == 0  # bob never sees alice's blocks
    bob.save()
    assert os.stat(tmp_path / "bob").st_mode & 0o777 == 0o700
    with pytest.raises(ContextStoreError, match="not a valid name"):
        ContextStore(model, tmp_path, namespace="../alice")


def _block_path(root: Path) -> Path:
    return root / "alice" / json.loads((root / "alice" / "index.json").read_text())["entries"][0]["file"]


def _truncate(root):
    path = _block_path(root)
    path.write_bytes(path.read_bytes()[:-10])


def _flip(root):
    path = _block_path(root)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))


def _retoken(root):
    path = root / "alice" / "index.json"
    index = json.loads(path.read_text())
    index["entries"][1]["tokens"][3] += 1
    path.write_text(json.dumps(index))


def _move_namespace(root):
    os.rename(root / "alice", root / "carol")


def _open_up(root):
    os.chmod(root / "alice", 0o755)


def _give_away(root):
    os.chown(root / "alice", 12345, -1)


# name -> (how the store or its reader differs, the loader's arguments, what the error says): refused
BAD = {
    "other model": (None, dict(seed=6), r"another model: model: weights"),
    "other geometry": (
        None,
        dict(topk=2),
        r"another geometry: geometry: budget_blocks 4 \(stored\) vs 3 \(this model\)",
    ),
    "other dtype": (None, dict(dtype=torch.bfloat16), r"dtype: kv 'float32' \(stored\) vs 'bfloat16'"),
    "foreign namespace": (_move_namespace, dict(namespace="carol"), r"belongs to namespace 'alice', not 'carol'"),
    "open namespace": (_open_up, {}, r"has mode 0o755; a namespace must be private \(0700\)"),
    "another user's namespace": (_give_away, {}, r"belongs to uid 12345, not to this user"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_named_and_leaves_the_store_intact(tmp_path, case):
    if case == "another user's namespace" and os.getuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    change, reader, message = BAD[case]
    filled_store(tmp_path)
    if change is not None:
        change(tmp_path)
    before = snapshot(tmp_path)
    namespace = reader.pop("namespace", "alice")
    dtype = reader.pop("dtype", None)
    model = model_for("infllmv2", seed=reader.pop("seed", 5), **reader)
    if dtype is not None:
        model = model.to(dtype)
    with pytest.raises(ContextStoreError, match=message):
        ContextStore(model, tmp_path, namespace=namespace, selector="query")
    assert snapshot(tmp_path) == before  # a failed load changes nothing on disk
    if change is None:  # the store itself is fine: its own model still loads every block
        assert ContextStore(model_for("infllmv2"), tmp_path, namespace="alice", selector="query").stats()["blocks"] == 8


# name -> (how one block is damaged, what the warning says): that block's chain is a miss, the rest loads
DAMAGED = {
    "truncated file": (_truncate, r"is missing or has another size than its index records"),
    "flipped byte": (_flip, r"fails its checksum"),
    "token mismatch": (_retoken, r"token mismatch: block [0-9a-f]{16} lists tokens that do not hash to its name"),
    "missing file": (lambda root: _block_path(root).unlink(), r"No such file|missing"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_bad_block_is_a_miss_for_its_chain(tmp_path, case):
    """Item 7: one bad or missing block is a miss for its chain (with a warning naming it), the
    other blocks load and answer as fresh prefills; a failed load changes nothing on disk; the
    next save drops the bad entry (and its descendants)."""
    damage, message = DAMAGED[case]
    model, _ = filled_store(tmp_path)
    damage(tmp_path)
    before = snapshot(tmp_path)
    doc, questions = document_and_questions()
    prompts = [torch.cat([doc, question]) for question in questions]
    # a wrong size or a bad entry is seen when the store opens, a bad checksum when a lookup reads
    # the block (blocks stay in their files until then): either way, a warning and a miss
    with pytest.warns(UserWarning, match=message):  # a ContextStoreWarning
        store = ContextStore(model, tmp_path, namespace="alice", selector="query")
        looked_up = [store.lookup(prompt) for prompt in prompts]
    assert snapshot(tmp_path) == before
    kept = store.stats()["blocks"]
    assert 0 <= kept < 8
    for prompt, (cache, matched) in zip(prompts, looked_up):
        assert torch.equal(generate(model, prompt, cache), generate(model, prompt, fresh_cache(model, None, "query")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", disk.ContextStoreWarning)  # the save sees the bad entry again, and drops it
        store.save()
    assert len(json.loads((tmp_path / "alice" / "index.json").read_text())["entries"]) == kept
    assert ContextStore(model, tmp_path, namespace="alice", selector="query").stats()["blocks"] == kept


# -- kills during a save --------------------------------------------------------------------------
def _kill():
    os.kill(os.getpid(), signal.SIGKILL)


def _torn(dir_fd, name, data):
    """write_atomic_at killed half way: its temporary file half written, nothing renamed."""
    fd = os.open(f".{name}.killed.tmp", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=dir_fd)
    os.write(fd, data[: len(data) // 2])
    os.close(fd)
    _kill()


def _block_writes(original, block):
    """write_atomic_at with `block(original, dir_fd, name, data)` for block files; the index as usual."""
    return lambda dir_fd, name, data: (
        original(dir_fd, name, data) if name == disk.INDEX else block(original, dir_fd, name, data)
    )


KILL_POINTS = {
    "inside a block file": ("write_atomic_at", lambda original: _block_writes(original, lambda o, *args: _torn(*args))),
    "after the first block file": (
        "write_atomic_at",
        lambda original: _block_writes(original, lambda o, *args: (o(*args), _kill())),
    ),
    "inside the index": (
        "write_atomic_at",
        lambda original: (
            lambda dir_fd, name, data: _torn(dir_fd, name, data) if name == disk.INDEX else original(dir_fd, name, data)
        ),
    ),
    "after the index, before deleting": ("remove_unlisted", lambda original: lambda *args: _kill()),
}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="kills a forked child process")
def test_a_kill_at_any_point_of_a_save_leaves_a_loadable_store(tmp_path):
    """A process killed at each point of a save (forked: a real process, really killed) leaves a
    store that loads with every block saved before it; killed after the index, with the new ones."""
    model, store = filled_store(tmp_path, questions=1)
    earlier = set(store.entries)
    doc, questions = document_and_questions()
    answer(store, model, None, torch.cat([doc, questions[1], questions[2]]))  # more blocks to save
    pending = set(store.entries) - earlier
    assert pending
    for point, (name, make) in KILL_POINTS.items():
        pid = os.fork()
        if pid == 0:  # the child: save with the kill in place; never returns to pytest
            try:
                setattr(disk, name, make(getattr(disk, name)))
                store.save()
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, point
        loaded = set(ContextStore(model, tmp_path, namespace="alice", selector="query").entries)
        assert earlier <= loaded, point
        assert loaded == (earlier | pending if point.startswith("after the index") else earlier), point
    store.save()  # a later save completes and clears what the kills left behind
    assert not list((tmp_path / "alice").rglob("*.tmp"))
    assert set(ContextStore(model, tmp_path, namespace="alice", selector="query").entries) == earlier | pending
