"""What the context-cache tests share: the modes they run, a document with four questions, and
greedy generation through a given cache."""

from __future__ import annotations

from pathlib import Path

import torch

from forecastkv import SparseCache
from forecastkv.inference import OffloadedSparseCache
from forecastkv.modeling.modeling import CACHE_KWARG
from tests.helpers import tiny_model

# name -> (lookup mode, the store's selector): resident SparseCache, sparse- and forecast-offload
MODES = {
    "resident": (None, "query"),
    "sparse-offload": ("sparse-offload", "query"),
    "forecast-offload": ("forecast-offload", "forecast"),
}
POLICIES = ("infllmv2", "nosa")
NEW_TOKENS = 6


def model_for(policy: str, seed: int = 5, **overrides):
    """The tiny model with Forecast heads (every mode can run on it)."""
    return tiny_model({"policy": policy, "selector": "forecast", **overrides}, seed=seed)


def document_and_questions(seed: int = 0, document: int = 45) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A document of `document` random tokens (not a whole number of blocks) and four questions
    of 5-11 tokens: 1-D int64 tensors."""
    gen = torch.Generator().manual_seed(seed)
    doc = torch.randint(3, 128, (document,), generator=gen)
    questions = [torch.randint(3, 128, (int(n),), generator=gen) for n in (5, 11, 7, 9)]
    return doc, questions


def fresh_cache(model, mode: str | None, selector: str):
    """An empty cache as an independent prefill would use it."""
    if mode is None:
        return SparseCache(model.config, selector=selector)
    return OffloadedSparseCache.for_model(model, mode=mode)


def generate(model, ids: torch.Tensor, cache, new_tokens: int = NEW_TOKENS) -> torch.Tensor:
    """Greedy new tokens [new_tokens] of the prompt ids [T] through `cache`."""
    with torch.no_grad():
        out = model.generate(
            ids[None], max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **{CACHE_KWARG: cache}
        )
    return out[0, ids.shape[0] :]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` (hidden temporaries included) and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}
