"""A tiny random model suite for the runner tests (byte tokens, 3 layers, blocks of 8)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

from tests.helpers import TINY_MODEL, TINY_SPARSE

# the tiny model with room for the suites' tasks and their error cases (a 640-token context), in
# query chunks of 64 (fewer chunk loops on these longer prompts); the geometry is TINY_SPARSE's
EVAL_MODEL = {**TINY_MODEL, "max_position_embeddings": 640, "query_chunk_size": 64}
FIXTURES = Path(__file__).parent / "fixtures"


def tiny_suite(output_dir, **changes) -> dict:
    suite = {
        "model": {
            "config": dict(EVAL_MODEL),
            "sparse_config": dict(TINY_SPARSE),
            "forecast": {"heads_per_group": 1},
            "seed": 0,
        },
        "tokenizer": "bytes",
        "modes": ["dense", "infllmv2-query", "infllmv2-forecast"],
        "tasks": [
            {"name": "passkey", "lengths": [320], "examples": 2, "max_new_tokens": 3},
            {"name": "perplexity", "lengths": [200], "examples": 1},
        ],
        "prefill_chunk": 128,
        "bucket_tokens": 100,
        "output_dir": str(output_dir),
        "progress": False,
    }
    suite.update(copy.deepcopy(changes))
    return suite


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def same_records(a: list[dict], b: list[dict], rel: float = 1e-6) -> None:
    """Equal except wall-clock times; floats to a relative tolerance (thread counts may differ)."""
    assert len(a) == len(b), (len(a), len(b))
    for x, y in zip(a, b):
        _same(
            {k: v for k, v in x.items() if k != "time"}, {k: v for k, v in y.items() if k != "time"}, rel, x.get("key")
        )


def _same(x, y, rel, where) -> None:
    if isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), (where, x, y)
        for k in x:
            _same(x[k], y[k], rel, where)
    elif isinstance(x, list):
        assert isinstance(y, list) and len(x) == len(y), (where, x, y)
        for u, v in zip(x, y):
            _same(u, v, rel, where)
    elif isinstance(x, float) and isinstance(y, float):
        assert math.isclose(x, y, rel_tol=rel, abs_tol=1e-9), (where, x, y)
    else:
        assert x == y, (where, x, y)
