"""Shared helpers of the training tests: a tiny random model recipe and synthetic text files."""

from __future__ import annotations

import random
from pathlib import Path

from tests.helpers import TINY_MODEL, TRAINING_SPARSE

WORDS = "the of and to in is was for on that with by as at from his her it an were are which this be or".split()


def write_texts(folder: Path, docs: int = 6, words: int = 400, seed: int = 0) -> tuple[list[str], str]:
    """`docs` .txt files and one held-out .jsonl of random words; returns (train paths, eval path)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(docs):
        path = folder / f"doc{i}.txt"
        path.write_text(" ".join(rng.choice(WORDS) for _ in range(words)))
        paths.append(str(path))
    held = folder / "held.jsonl"
    held.write_text(
        "\n".join('{"text": "%s"}' % " ".join(rng.choice(WORDS) for _ in range(300)) for _ in range(2)) + "\n"
    )
    return paths, str(held)


def tiny_recipe(folder: Path, output: Path, steps: int = 4, seed: int = 0, **train) -> dict:
    paths, held = write_texts(folder)
    return {
        "model": {
            "config": dict(TINY_MODEL),
            "seed": seed,
            "sparse_config": dict(TRAINING_SPARSE),
            "forecast": {"heads_per_group": 1, "init": "kaiming"},
        },
        "data": {"source": paths, "tokenizer": "bytes", "seq_len": 64, "eval_source": held, "eval_sequences": 2},
        "objective": {"chunk_size": 24},
        "train": {
            "steps": steps,
            "global_batch": 4,
            "micro_batch": 1,
            "lr": 1e-2,
            "eval_every": 0,
            "save_every": 2,
            "progress": False,
            **train,
        },
        "output_dir": str(output),
    }
