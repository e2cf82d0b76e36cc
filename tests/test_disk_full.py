"""A full disk at every writer (issue 39): a typed `DiskFullError` naming the path, what was on
disk before intact (and, for the context store, loading and answering with the same tokens), no
temporary file left, no signal.

The unit cases inject ENOSPC at the write's fsync (every writer fsyncs before it renames or
returns: the `full_disk` fixture of tests/conftest.py), so they run anywhere;
`test_a_store_on_a_full_tmpfs_*` fills a real tmpfs (root only, skipped cleanly otherwise)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forecastkv import atomic
from forecastkv.errors import DiskFullError
from tests.context.common import document_and_questions, fresh_cache, generate, model_for, snapshot

REPO = Path(__file__).resolve().parents[1]


def _checkpoint(root: Path, fill):
    from forecastkv.training.checkpointing import load_intact, save_checkpoint

    state = {"step": 1, "w": torch.arange(6.0)}
    save_checkpoint(root, 1, state)
    fill()
    yield "checkpoints/step-000002.safetensors", lambda: save_checkpoint(root, 2, {**state, "step": 2})
    assert load_intact(root)[1]["step"] == 1


def _results_shard(root: Path, fill):
    from forecastkv.eval.results import ShardWriter, read_records

    writer = ShardWriter(root, 0)
    writer.append({"key": "a-0", "mode": "dense", "score": 1.0})
    fill()
    yield writer.path.name, lambda: writer.append({"key": "a-1", "mode": "dense", "score": 0.0})
    assert [r["key"] for r in read_records(root)] == ["a-0"]


def _report(root: Path, fill):
    atomic.write_text_atomic(root / "report.md", "old report\n")
    fill()
    yield "report.md", lambda: atomic.write_text_atomic(root / "report.md", "new report\n" * 100)


def _metrics(root: Path, fill):
    from forecastkv.training.run_dir import append_metrics as _append_metrics

    _append_metrics(root / "metrics.jsonl", {"step": 1, "loss": 0.5})
    fill()
    yield "metrics.jsonl", lambda: _append_metrics(root / "metrics.jsonl", {"step": 2, "loss": 0.4})


def _features(root: Path, fill):
    from forecastkv.training import features

    class Part:  # the one method save_part reads
        def to_tensors(self):
            return {"rows": torch.ones(4, 3)}

    features.save_part(root / "part-0.safetensors", Part(), "key-0", 1.0)
    fill()
    yield "part-1.safetensors", lambda: features.save_part(root / "part-1.safetensors", Part(), "key-1", 1.0)


def _store(root: Path, fill, what: str):
    """A saved store of one document; the save of a second fails at its first block or at the index."""
    from forecastkv.context import ContextStore

    model = model_for("infllmv2")
    store = ContextStore(model, root, namespace="alice", selector="query")
    first, questions = document_and_questions(seed=0)
    second, _ = document_and_questions(seed=1)
    for doc in (first, second):
        prompt = torch.cat([doc, questions[0]])
        cache, _ = store.lookup(prompt)
        generate(model, prompt, cache)
        store.insert(cache, prompt)
        if doc is first:
            store.save()
    fill("blocks" if what == "block" else "index.json")  # the index case: its blocks go through
    yield "alice/" + ("blocks/" if what == "block" else "index.json"), store.save
    reopened = ContextStore(model, root, namespace="alice", selector="query")
    assert reopened.stats()["blocks"] == 6  # the first document's, as saved
    prompt = torch.cat([first, questions[1]])
    cache, matched = reopened.lookup(prompt)
    assert matched == 40
    assert torch.equal(generate(model, prompt, cache), generate(model, prompt, fresh_cache(model, None, "query")))
    assert store.stats()["blocks"] == 12  # the store in memory lost nothing: a later save can still write it


WRITERS = {
    "training checkpoint": _checkpoint,
    "results shard (results.jsonl's rows)": _results_shard,
    "eval report": _report,
    "metrics.jsonl": _metrics,
    "training features": _features,
    "context store block": lambda root, fill: _store(root, fill, "block"),
    "context store index": lambda root, fill: _store(root, fill, "index"),
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_full_disk_is_a_typed_error_and_loses_nothing(tmp_path, full_disk, writer):
    steps = WRITERS[writer](tmp_path, full_disk)
    named, write = next(steps)
    before = snapshot(tmp_path)
    with pytest.raises(DiskFullError, match=r"no space left") as raised:
        write()
    assert named in raised.value.filename and raised.value.errno == errno.ENOSPC
    assert str(raised.value).startswith(f"cannot write {raised.value.filename}")
    assert snapshot(tmp_path) == before, "the failed write changed what was on disk (or left a temporary)"
    full_disk(None)
    next(steps, None)  # what was on disk before still loads (and answers the same)


def test_a_write_bigger_than_the_free_space_is_refused_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "free_bytes", lambda path: 100)
    with pytest.raises(DiskFullError, match=r"needs 1,000 bytes, 100 free"):
        atomic.write_atomic(tmp_path / "big", lambda tmp: tmp.write_bytes(b"x" * 1000), nbytes=1000)
    assert not list(tmp_path.iterdir())


def test_a_library_error_that_says_no_space_is_a_disk_full_error(tmp_path):
    """safetensors reports ENOSPC as its own error type, with the OS's text."""

    class SafetensorError(Exception):
        pass

    def write(tmp):
        tmp.write_bytes(b"half")
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, message: 'No space left on device' })")

    with pytest.raises(DiskFullError, match=str(tmp_path / "weights")):
        atomic.write_atomic(tmp_path / "weights", write)
    assert not list(tmp_path.iterdir())


# -- a real full file system ---------------------------------------------------------------------
FILL_A_STORE = """
import sys, torch
from forecastkv.context import ContextStore
from forecastkv.errors import DiskFullError
from tests.context.common import document_and_questions, generate, model_for
model = model_for("infllmv2")
store = ContextStore(model, sys.argv[1], namespace="alice", selector="query")
for seed in range(int(sys.argv[2])):
    doc, questions = document_and_questions(seed=seed, document=400)
    prompt = torch.cat([doc, questions[0]])
    cache, _ = store.lookup(prompt)
    generate(model, prompt, cache, new_tokens=2)
    store.insert(cache, prompt)
try:
    store.save()
    print("saved", store.nbytes)
except DiskFullError as error:
    print("refused", error)
"""


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (root and a mount namespace that allows it), else skip."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def _fill(root: Path, documents: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", FILL_A_STORE, str(root), str(documents)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=env,
    )  # fmt: skip


def test_a_store_on_a_full_tmpfs_is_refused_cleanly(small_tmpfs):
    """Issue 39 item 1: inserting and saving more blocks than the file system holds ends in one
    DiskFullError, never SIGBUS; the store saved before still loads whole, no temporary is left."""
    first = _fill(small_tmpfs / "store", 1)
    assert first.returncode == 0 and first.stdout.startswith("saved"), first.stderr[-2000:]
    before = snapshot(small_tmpfs)
    index = json.loads((small_tmpfs / "store" / "alice" / "index.json").read_text())
    big = _fill(small_tmpfs / "store", 12)  # ~12x the first: more than the 1 MiB
    assert big.returncode == 0, (big.returncode, big.stderr[-2000:])  # no signal, no traceback
    assert big.stdout.startswith("refused cannot write") and "no space left" in big.stdout, big.stdout
    assert snapshot(small_tmpfs) == before
    again = json.loads((small_tmpfs / "store" / "alice" / "index.json").read_text())
    assert again["entries"] == index["entries"]
