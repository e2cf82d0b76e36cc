"""The context-cache CLI parts, through a parser built as forecastkv/cli.py builds its own:
generate --context-cache DIR reuses and extends the store; context-cache ls / du / rm."""

from __future__ import annotations

import argparse
import io
import json

import torch

from forecastkv.context import ContextStore
from forecastkv.context.cli import (
    add_context_cache_arguments,
    register_context_cache_command,
    run_generate_with_context_cache,
)
from tests.context.common import document_and_questions, fresh_cache, generate, model_for


class ByteTokenizer:
    """Token ids as characters (the tiny model's vocabulary is 128 ids)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="forecastkv")
    commands = top.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate")
    gen.add_argument("--max-new-tokens", type=int, default=6)
    gen.add_argument("--stats", action="store_true")
    gen.add_argument("--offload", default=None)
    gen.add_argument("--selector", default=None)
    add_context_cache_arguments(gen)
    register_context_cache_command(commands)
    return top


def run(argv, capsys):
    args = parser().parse_args(argv)
    assert args.run(args) == 0
    return capsys.readouterr().out


def test_generate_with_context_cache_reuses_and_extends(tmp_path):
    model = model_for("infllmv2")
    doc, questions = document_and_questions()
    texts, errs = [], []
    for question in questions[:2]:
        prompt = torch.cat([doc, question])
        args = parser().parse_args(
            [
                "generate",
                "--context-cache",
                str(tmp_path),
                "--context-namespace",
                "alice",
                "--stats",
                "--offload",
                "sparse-offload",
            ]
        )
        out, err = io.StringIO(), io.StringIO()
        assert run_generate_with_context_cache(args, model, ByteTokenizer(), prompt[None], out=out, err=err) == 0
        expected = generate(model, prompt, fresh_cache(model, "sparse-offload", "query"))
        assert out.getvalue() == ByteTokenizer().decode(expected) + "\n"
        texts.append(out.getvalue())
        errs.append(err.getvalue())
    assert "0 from the context cache, 50 prefilled" in errs[0]
    assert "40 from the context cache, 16 prefilled" in errs[1] and "8 blocks" in errs[1]
    assert ContextStore(model, tmp_path, namespace="alice", selector="query").stats()["blocks"] == 8


def test_generate_with_context_cache_selects_with_the_selector_option(tmp_path):
    """--selector query on a model whose own selector is forecast: the store keeps query-routed prefills
    and the continuation is the query selector's, from an empty store and from a stored prefix."""
    model = model_for("infllmv2")
    doc, questions = document_and_questions()
    errs = []
    for question in questions[:2]:
        prompt = torch.cat([doc, question])
        args = parser().parse_args(["generate", "--context-cache", str(tmp_path), "--selector", "query", "--stats"])
        out, err = io.StringIO(), io.StringIO()
        assert run_generate_with_context_cache(args, model, ByteTokenizer(), prompt[None], out=out, err=err) == 0
        expected = generate(model, prompt, fresh_cache(model, None, "query"))
        assert out.getvalue() == ByteTokenizer().decode(expected) + "\n"
        errs.append(err.getvalue())
    assert "40 from the context cache" in errs[1], errs[1]
    assert ContextStore(model, tmp_path, selector="query").stats()["blocks"] == 8


def test_ls_du_rm(tmp_path, capsys):
    model = model_for("nosa")
    doc, questions = document_and_questions()
    store = ContextStore(model, tmp_path, namespace="alice", selector="query")
    for question in questions[:2]:
        prompt = torch.cat([doc, question])
        cache, _ = store.lookup(prompt)
        generate(model, prompt, cache, new_tokens=1)
        store.insert(cache, prompt)
    store.save()
    index = json.loads((tmp_path / "alice" / "index.json").read_text())
    size = sum(entry["bytes"] for entry in index["entries"])

    listing = run(["context-cache", "ls", str(tmp_path)], capsys)
    assert listing.startswith("alice: 8 blocks of 8 tokens") and "selector query, float32" in listing
    tips = [line.split()[0] for line in listing.splitlines()[1:]]
    assert len(tips) == 2 and all(
        f"{n} tokens" in listing for n in (48, 56)
    )  # two chains sharing the document's 5 blocks
    assert run(["context-cache", "du", str(tmp_path)], capsys) == f"{size}\talice\n{size}\ttotal\n"

    fork = next(entry["parent"] for entry in index["entries"] if entry["position"] == 6)  # the second chain's block 5
    removed = run(["context-cache", "rm", str(tmp_path), "--namespace", "alice", "--block", fork[:12]], capsys)
    assert removed.startswith("removed 2 blocks")  # the block and its descendant
    assert ContextStore(model, tmp_path, namespace="alice", selector="query").stats()["blocks"] == 6
    assert run(["context-cache", "rm", str(tmp_path), "--namespace", "alice", "--all"], capsys).startswith(
        "removed 6 blocks"
    )
    assert run(["context-cache", "du", str(tmp_path)], capsys) == "0\talice\n0\ttotal\n"
    assert not list((tmp_path / "alice" / "blocks").iterdir())
