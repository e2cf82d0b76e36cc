"""One store shared by several processes and users (issue 26 items 3-10): merged saves, locked
loads and removals, stale lazily-read stores, damaged stores, and a namespace that another user
swaps for a symlink."""

from __future__ import annotations

import argparse
import fcntl
import io
import json
import os
import shutil
import threading
import time
import warnings

import pytest
import torch

from forecastkv.context import ContextStore, ContextStoreError, disk
from forecastkv.context.cli import register_context_cache_command, run_generate_with_context_cache
from tests.context.common import document_and_questions, fresh_cache, generate, model_for
from tests.context.test_cli import ByteTokenizer, parser


def saved(model, root, doc, namespace="alice", **kwargs) -> ContextStore:
    """A store of `root` with the prompt doc + question 0 inserted (after a generate) and saved."""
    store = ContextStore(model, root, namespace=namespace, selector="query", **kwargs)
    prompt = torch.cat([doc, document_and_questions()[1][0]])
    cache, _ = store.lookup(prompt)
    generate(model, prompt, cache)
    store.insert(cache, prompt)
    store.save()
    return store


def assert_answers(model, store, doc, blocks: int) -> None:
    """Every question on `doc` through `store`: at least `blocks` full blocks matched, fresh-prefill tokens."""
    for question in document_and_questions()[1]:
        prompt = torch.cat([doc, question])
        cache, matched = store.lookup(prompt)
        assert matched >= blocks * 8
        assert torch.equal(generate(model, prompt, cache), generate(model, prompt, fresh_cache(model, None, "query")))


def cli(argv: list[str]) -> tuple[int, str]:
    top = argparse.ArgumentParser()
    register_context_cache_command(top.add_subparsers(dest="command", required=True))
    args = top.parse_args(argv)
    out = io.StringIO()
    status = args.run(args, out=out)
    return status, out.getvalue()


def test_concurrent_saves_merge(tmp_path):
    """Item 3: two stores opened on the same (empty) namespace save different documents: the
    second save merges with the first's index instead of replacing it (and deleting its files)."""
    model = model_for("infllmv2")
    first, _ = document_and_questions(seed=0)
    second, _ = document_and_questions(seed=1)
    a = ContextStore(model, tmp_path, namespace="alice", selector="query")
    b = ContextStore(model, tmp_path, namespace="alice", selector="query")
    for store, doc in ((a, first), (b, second)):
        prompt = torch.cat([doc, document_and_questions()[1][0]])
        cache, _ = store.lookup(prompt)
        generate(model, prompt, cache)
        store.insert(cache, prompt)
    a.save()
    b.save()
    assert b.stats()["blocks"] == 12  # its own 6 and the 6 a saved (on disk only)
    loaded = ContextStore(model, tmp_path, namespace="alice", selector="query")
    assert loaded.stats()["blocks"] == 12 and len(list((tmp_path / "alice" / "blocks").iterdir())) == 12
    assert_answers(model, loaded, first, 5)
    assert_answers(model, loaded, second, 5)
    assert_answers(model, b, first, 5)  # b reads a's blocks from disk when a lookup needs them


def test_loads_wait_for_a_save_in_progress(tmp_path, monkeypatch):
    """Item 4: a load that has read the index while another process saves with eviction (its
    cleanup deletes files) sees every block it read: the saver waits for the reader's shared
    lock.  The reader asks the saver to go right after reading the index and gives it
    1.5 s; without the lock the saver deletes the files before the reader reads them."""
    model = model_for("infllmv2")
    doc, _ = document_and_questions()
    store = saved(model, tmp_path, doc)
    per_block = store.block_nbytes()
    go, done = tmp_path / "go", tmp_path / "done"
    pid = os.fork()
    if pid == 0:  # the saver: on the signal, open with a 2-block cap (evicting 4) and save
        status = 1
        try:
            while not go.exists():
                time.sleep(0.01)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ContextStore(model, tmp_path, namespace="alice", selector="query", max_bytes=2 * per_block).save()
            done.write_text("saved")
            status = 0
        finally:
            os._exit(status)
    original = disk.read_index

    def read_then_let_the_saver_go(*args, **kwargs):
        index = original(*args, **kwargs)
        go.write_text("go")
        deadline = time.time() + 1.5
        while not done.exists() and time.time() < deadline:
            time.sleep(0.01)
        return index

    monkeypatch.setattr(disk, "read_index", read_then_let_the_saver_go)
    reader = ContextStore(model, tmp_path, namespace="alice", selector="query")
    monkeypatch.setattr(disk, "read_index", original)
    assert not done.exists()  # the saver waited for the reader's lock
    assert reader.stats()["blocks"] == 6
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and done.exists()
    # the reader reads blocks when a lookup needs them: it sees the saver's eviction (revalidates
    # against the new index) and matches the 2 blocks left, answering as a fresh prefill
    assert_answers(model, reader, doc, 2)
    assert ContextStore(model, tmp_path, namespace="alice", selector="query").stats()["blocks"] == 2


def test_generate_treats_a_store_it_cannot_use_as_a_miss(tmp_path):
    """Item 4, at the CLI: a truncated index, or a namespace of another model, is a miss (a
    message on stderr), never a failed generate; the truncated one is rebuilt by the save."""
    model = model_for("infllmv2")
    doc, questions = document_and_questions()
    prompt = torch.cat([doc, questions[0]])
    expected = ByteTokenizer().decode(generate(model, prompt, fresh_cache(model, "sparse-offload", "query"))) + "\n"
    saved(model_for("infllmv2", seed=6), tmp_path, doc, namespace="other")  # another model's blocks
    (tmp_path / "broken").mkdir(mode=0o700)
    (tmp_path / "broken" / "index.json").write_text('{"format": 1, "entr')
    for namespace, said in (("broken", "is not a valid index"), ("other", r"not used \(.*another model")):
        args = parser().parse_args(
            [
                "generate",
                "--context-cache",
                str(tmp_path),
                "--context-namespace",
                namespace,
                "--offload",
                "sparse-offload",
            ]
        )
        out, err = io.StringIO(), io.StringIO()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert run_generate_with_context_cache(args, model, ByteTokenizer(), prompt[None], out=out, err=err) == 0
        assert out.getvalue() == expected
        import re

        assert re.search(said, err.getvalue() + " ".join(str(w.message) for w in caught)), (err.getvalue(), caught)
    assert ContextStore(model, tmp_path, namespace="broken", selector="query").stats()["blocks"] == 6


def test_rm_waits_for_the_lock(tmp_path):
    """Item 5: `context-cache rm` takes the namespace's exclusive lock (what saves hold), so it
    never deletes files a save has just written and is about to name."""
    model = model_for("infllmv2")
    doc, _ = document_and_questions()
    saved(model, tmp_path, doc)
    before = (tmp_path / "alice" / "index.json").read_bytes()
    handle = open(tmp_path / "alice" / ".lock", "a+")
    fcntl.flock(handle, fcntl.LOCK_EX)  # a save in progress
    result = {}
    thread = threading.Thread(
        target=lambda: result.setdefault(
            "rm", cli(["context-cache", "rm", str(tmp_path), "--namespace", "alice", "--all"])
        )
    )
    thread.start()
    time.sleep(0.5)
    try:
        assert thread.is_alive() and (tmp_path / "alice" / "index.json").read_bytes() == before
        assert len(list((tmp_path / "alice" / "blocks").iterdir())) == 6
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()
        thread.join(30)
    assert result["rm"][0] == 0 and result["rm"][1].startswith("removed 6 blocks")
    assert not list((tmp_path / "alice" / "blocks").iterdir())


def test_a_lazily_read_store_revalidates_when_another_process_changed_the_index(tmp_path):
    """Item 6: a store (its blocks read when a lookup needs them) while another process evicts and
    saves: its lookups are misses past what is gone (never an error) and answer as fresh
    prefills, and its next save writes an index that names only files that exist."""
    model = model_for("infllmv2")
    doc, questions = document_and_questions()
    store = saved(model, tmp_path, doc)
    per_block = store.block_nbytes()
    lazy = ContextStore(model, tmp_path, namespace="alice", selector="query")
    assert lazy.stats()["blocks"] == 6 and all(entry.blocks is None for entry in lazy.entries.values())
    ContextStore(
        model, tmp_path, namespace="alice", selector="query", max_bytes=2 * per_block
    ).save()  # another process evicts 4
    for number, question in enumerate(questions):
        prompt = torch.cat([doc, question])
        cache, matched = lazy.lookup(prompt)
        assert matched == (
            16 if number == 0 else 40
        )  # the 2 blocks left (a chain's root goes last), then what the first insert put back
        assert torch.equal(generate(model, prompt, cache), generate(model, prompt, fresh_cache(model, None, "query")))
        lazy.insert(cache, prompt)
    lazy.save()
    index = json.loads((tmp_path / "alice" / "index.json").read_text())
    assert all((tmp_path / "alice" / entry["file"]).exists() for entry in index["entries"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", disk.ContextStoreWarning)  # nothing skipped
        assert (
            ContextStore(model, tmp_path, namespace="alice", selector="query").stats()["blocks"]
            == len(index["entries"])
            == 10
        )


def test_rm_all_and_repair_work_on_a_broken_store(tmp_path):
    """Item 7: a truncated index: ls names it and points at repair, `rm --all` and `repair` both
    leave a store that loads; repair keeps the good blocks of a store with one bad block."""
    model = model_for("infllmv2")
    doc, _ = document_and_questions()
    saved(model, tmp_path, doc)
    index = tmp_path / "alice" / "index.json"
    good = index.read_text()
    entries = json.loads(good)["entries"]
    index.write_text(good[: len(good) // 2])
    status, said = cli(["context-cache", "rm", str(tmp_path), "--namespace", "alice", "--all"])
    assert status == 0 and said.startswith("removed 0 blocks")  # the files go all the same
    assert not list((tmp_path / "alice" / "blocks").iterdir())
    assert ContextStore(model, tmp_path, namespace="alice", selector="query").stats()["blocks"] == 0

    saved(model, tmp_path, doc)
    index.write_text(good[: len(good) // 2])
    err = io.StringIO()
    top = argparse.ArgumentParser()
    register_context_cache_command(top.add_subparsers(dest="command", required=True))
    args = top.parse_args(["context-cache", "ls", str(tmp_path)])
    assert (
        args.run(args, out=io.StringIO(), err=err) == 1
        and "is not a valid index" in err.getvalue()
        and "repair" in err.getvalue()
    )
    status, said = cli(["context-cache", "repair", str(tmp_path), "--namespace", "alice"])
    assert status == 0 and said.startswith("alice: kept 0 blocks")
    assert ContextStore(model, tmp_path, namespace="alice", selector="query").stats()["blocks"] == 0

    saved(model, tmp_path, doc)
    tip = max(entries, key=lambda entry: entry["position"])
    (tmp_path / "alice" / tip["file"]).write_bytes(b"not a block")
    status, said = cli(["context-cache", "repair", str(tmp_path), "--namespace", "alice"])
    assert status == 0 and said.startswith("alice: kept 5 blocks, dropped 1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", disk.ContextStoreWarning)
        assert ContextStore(model, tmp_path, namespace="alice", selector="query").stats()["blocks"] == 5


def test_the_root_is_created_private_whatever_the_umask(tmp_path):
    """Item 8: a missing root (and its missing parents) is created 0700 under umask 000."""
    model = model_for("infllmv2")
    doc, _ = document_and_questions()
    old = os.umask(0)
    try:
        saved(model, tmp_path / "parent" / "root", doc)
    finally:
        os.umask(old)
    for path in (tmp_path / "parent", tmp_path / "parent" / "root", tmp_path / "parent" / "root" / "alice"):
        assert os.stat(path).st_mode & 0o777 == 0o700, path


def test_a_namespace_swapped_during_a_save_gets_nothing(tmp_path, monkeypatch):
    """Item 8: the namespace swapped for a symlink to another directory after the save opened it
    (here: when it reads its first block's rows): every file still goes to the directory the
    save opened and checked, none through the symlink."""
    model = model_for("infllmv2")
    doc, questions = document_and_questions()
    store = saved(model, tmp_path / "root", doc)
    prompt = torch.cat([doc, questions[1]])
    cache, _ = store.lookup(prompt)
    generate(model, prompt, cache)
    store.insert(cache, prompt)  # a new block to write
    outside = tmp_path / "outside"
    (outside / "blocks").mkdir(parents=True, mode=0o700)
    os.chmod(outside, 0o700)
    original = ContextStore.block_rows

    def swap_then_read(self, name):
        if not (tmp_path / "root" / "alice").is_symlink():
            os.rename(tmp_path / "root" / "alice", tmp_path / "root" / "alice.moved")
            os.symlink(outside, tmp_path / "root" / "alice")
        return original(self, name)

    monkeypatch.setattr(ContextStore, "block_rows", swap_then_read)
    store.save()
    assert [p for p in outside.rglob("*")] == [outside / "blocks"]
    assert len(json.loads((tmp_path / "root" / "alice.moved" / "index.json").read_text())["entries"]) == 8


def test_a_symlinked_namespace_is_refused(tmp_path):
    """Item 9: a namespace that is a symlink (here to a directory of the user's own, with files
    in its blocks/) is refused, by loads and saves alike; its files are untouched."""
    model = model_for("infllmv2")
    mine = tmp_path / "mine"
    (mine / "blocks").mkdir(parents=True)
    os.chmod(mine, 0o700)
    (mine / "blocks" / "notes.txt").write_text("keep me")
    (tmp_path / "root").mkdir(mode=0o700)
    os.symlink(mine, tmp_path / "root" / "alice")
    doc, _ = document_and_questions()
    with pytest.raises(ContextStoreError, match="is a symbolic link or not a directory"):
        saved(model, tmp_path / "root", doc)
    store = ContextStore(model, tmp_path / "root", namespace="bob", selector="query")
    store.namespace = "alice"
    with pytest.raises(ContextStoreError, match="is a symbolic link"):
        store.save()
    assert (mine / "blocks" / "notes.txt").read_text() == "keep me" and sorted(p.name for p in mine.rglob("*")) == [
        "blocks",
        "notes.txt",
    ]


def test_an_index_path_outside_the_namespace_is_refused(tmp_path):
    """Item 10: an index entry whose file is not `blocks/<its hash>.safetensors` (here a valid
    copy of the block outside the namespace) is skipped with a warning, and the next save does not
    keep the pointer; the outside file is untouched."""
    model = model_for("infllmv2")
    doc, _ = document_and_questions()
    saved(model, tmp_path / "root", doc)
    index_path = tmp_path / "root" / "alice" / "index.json"
    index = json.loads(index_path.read_text())
    tip = max(index["entries"], key=lambda entry: entry["position"])
    (tmp_path / "outside").mkdir()
    shutil.copy(tmp_path / "root" / "alice" / tip["file"], tmp_path / "outside" / "x.safetensors")
    os.unlink(tmp_path / "root" / "alice" / tip["file"])
    tip["file"] = "../../outside/x.safetensors"
    index_path.write_text(json.dumps(index))
    outside = (tmp_path / "outside" / "x.safetensors").read_bytes()
    with pytest.warns(UserWarning, match="paths outside blocks/ are refused"):  # a ContextStoreWarning
        store = ContextStore(model, tmp_path / "root", namespace="alice", selector="query")
    assert store.stats()["blocks"] == 5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", disk.ContextStoreWarning)
        store.save()
    assert all(
        entry["file"].startswith("blocks/") and ".." not in entry["file"]
        for entry in json.loads(index_path.read_text())["entries"]
    )
    assert len(json.loads(index_path.read_text())["entries"]) == 5
    assert (tmp_path / "outside" / "x.safetensors").read_bytes() == outside
