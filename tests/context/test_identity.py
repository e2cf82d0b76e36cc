"""What a stored block is checked against: the model's identity hashes every byte of its weights
(issue 26 item 1), and `insert` checks its ids against the cache's own record of its tokens (item 2)."""

from __future__ import annotations

import json

import pytest
import torch

from forecastkv.context import ContextStore, ContextStoreError
from forecastkv.context.blocks import model_identity
from tests.context.common import document_and_questions, fresh_cache, generate, model_for
from tests.context.test_disk import run_python


def test_identity_sees_an_edit_of_any_single_weight(tmp_path):
    """Item 1: one element changed anywhere (here off any sampling stride: element 1 of the
    embeddings, and the last element of a v_proj) gives another identity, so the edited model
    never loads the original's prefills; the identity is the same in a new process."""
    model = model_for("infllmv2")
    base = model_identity(model, "query")
    edits = [("model.embed_tokens.weight", 1), ("model.layers.1.self_attn.v_proj.weight", -1)]
    for name, index in edits:
        edited = model_for("infllmv2")
        with torch.no_grad():
            dict(edited.named_parameters())[name].view(-1)[index] *= 1.001
        assert model_identity(edited, "query")["model"]["weights"] != base["model"]["weights"], name
    doc, questions = document_and_questions()
    store = ContextStore(model, tmp_path, namespace="alice", selector="query")
    prompt = torch.cat([doc, questions[0]])
    cache, _ = store.lookup(prompt)
    generate(model, prompt, cache)
    store.insert(cache, prompt)
    store.save()
    with pytest.raises(ContextStoreError, match="another model: model: weights"):
        ContextStore(edited, tmp_path, namespace="alice", selector="query")
    code = (
        "import json; from forecastkv.context.blocks import model_identity; "
        "from tests.context.common import model_for; print(json.dumps(model_identity(model_for('infllmv2'), 'query')))"
    )
    assert json.loads(run_python(code).strip().splitlines()[-1]) == base


def test_insert_checks_ids_against_the_cache_record():
    """Item 2: a cache inserted with another document's ids is refused (a later lookup of that
    document would return the first one's K/V); a cache with no record of its tokens is refused;
    the right ids (a prefill, a lookup + generate) are accepted."""
    from forecastkv.inference.fill import copy_into

    model = model_for("infllmv2")
    store = ContextStore(model, selector="query")
    doc, questions = document_and_questions()
    other, _ = document_and_questions(seed=1)
    cache = fresh_cache(model, None, "query")
    with torch.no_grad():
        model(doc[None], cache=cache)
    with pytest.raises(
        ContextStoreError, match=r"token mismatch: ids\[0\] = \d+, but the cache was prefilled with \d+ there"
    ):
        store.insert(cache, other)
    assert store.stats()["blocks"] == 0
    copied = fresh_cache(model, None, "query")
    copy_into(cache, copied)  # the same K/V, but written without a forward call: nothing to check ids against
    with pytest.raises(ContextStoreError, match="no record of the tokens it holds"):
        store.insert(copied, doc)
    assert store.insert(cache, doc) == 5
    prompt = torch.cat([doc, questions[0]])
    looked, matched = store.lookup(prompt)
    answer = generate(model, prompt, looked)
    assert matched == 40 and store.insert(looked, prompt) == 1
    with pytest.raises(ContextStoreError, match="record knows its first 50 tokens"):  # decode steps are not recorded
        store.insert(looked, torch.cat([prompt, answer[:-1]]))
    with pytest.raises(ContextStoreError, match="token mismatch"):
        store.insert(looked, torch.cat([prompt[:49], questions[1][:1]]))
    left = fresh_cache(model, None, "query")
    with torch.no_grad():
        model(doc[None], cache=left)
    right = left.fork()  # each copy extends its own record
    with torch.no_grad():
        model(questions[2][None], cache=left)
        model(questions[3][None], cache=right)
    with pytest.raises(ContextStoreError, match="token mismatch"):
        store.insert(left, torch.cat([doc, questions[3]]))
    assert (
        store.insert(left, torch.cat([doc, questions[2]])) == 1
        and store.insert(right, torch.cat([doc, questions[3]])) == 1
    )
