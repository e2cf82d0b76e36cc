"""What several test files share: the tiny random model, its block geometries, the relative error,
left-padded batches and a free TCP port.  One copy each; a test that needs another geometry names
its variant here (or passes the change as a parameter) instead of copying the dict."""

from __future__ import annotations

import socket

import torch

from forecastkv.eval.suite_cli import TINY_MODEL as SMALL_MODEL

# The tiny random model: G = 3 (6 query heads on 2 KV heads), head_dim 16, large enough weights
# (initializer_range 0.3) that attention choices change the logits; no BOS/EOS (byte tokens).  The
# package's own (`forecastkv quality --small`'s), with 512 positions.
TINY_MODEL = {**SMALL_MODEL, "max_position_embeddings": 512}

# Its block geometry: kernel 4/2, blocks of 8, one init block, a one-block window.  A row deep in a
# sequence attends to topk + 1 blocks, 3 of them forced (init, window, current): topk 3 leaves one
# free block per row.
TINY_SPARSE = dict(
    kernel_size=4, kernel_stride=2, block_size=8, init_blocks=1, window_size=8, topk=3, dense_len=0, query_blocks=1
)


def tiny_sparse(**changes) -> dict:
    """A fresh copy of TINY_SPARSE with `changes` applied."""
    return {**TINY_SPARSE, **changes}


# The training tests' geometry: topk 4 leaves two free blocks per row, so the Forecast heads (and the
# recall they are guarded by) have a choice among visible blocks to get right or wrong.
TRAINING_SPARSE = tiny_sparse(topk=4)


def tiny_config(**overrides):
    """A ForecastKVConfig of TINY_MODEL with `overrides` (sparse_config=, forecast=, any model key)."""
    from forecastkv import ForecastKVConfig

    return ForecastKVConfig(**{**TINY_MODEL, **overrides})


def tiny_model(mode=None, seed=0, heads_per_group=1, **overrides):
    """A tiny ForecastKVForCausalLM in eval mode with Forecast heads (`heads_per_group` per group).

    mode: None (dense) or changes to TINY_SPARSE (policy=, selector=, lse=, ...); NOSA models get
    A ~ N(0, 1), since A = 0 at init would make the CIS bias a no-op.
    """
    from forecastkv import ForecastKVForCausalLM

    sparse = None if mode is None else tiny_sparse(**mode)
    config = tiny_config(
        sparse_config=sparse, forecast={"enabled": True, "heads_per_group": heads_per_group}, **overrides
    )
    torch.manual_seed(seed)
    model = ForecastKVForCausalLM(config).eval()
    if mode is not None and mode.get("policy") == "nosa":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.A.normal_()
    return model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ||a - b|| / ||b|| in float64 (the absolute error ||a - b|| when b is all zeros)."""
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


def left_padded(lengths, seed: int = 9, vocab: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of random prompts: ids and attention mask, both int64 [B, max(lengths)].

    Row b holds lengths[b] tokens drawn uniformly from [3, vocab) (one seeded generator, rows in
    order) right-aligned, padding id 0 and mask 0 before them.
    """
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, vocab, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for torch.distributed.run's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@torch.no_grad()
def offloaded_counts(model, mode: str, prompt: list[int], tokens: list[int]) -> tuple[dict, object]:
    """The HF runtime (`OffloadedSparseCache`, offload `mode`) over `prompt`, then `tokens` fed back
    one at a time as generate() does: ({"per_step": H2D bytes of each decode step, "wanted": complete
    blocks the offloaded layers' plans wanted, "hits": of those, the ones already held}, the cache).
    What the vLLM connector must count too."""
    from forecastkv.inference import OffloadedSparseCache

    cache = OffloadedSparseCache.for_model(model, mode=mode)
    model(torch.tensor([prompt]), cache=cache)
    for token in tokens[:-1]:
        model(torch.tensor([[token]]), cache=cache)
    stats, offloaded = cache.stats(), [layer.offloaded for layer in cache.layers]
    counts = {
        "per_step": stats["h2d_bytes_per_step"],
        "wanted": sum(w for w, o in zip(stats["blocks_wanted_per_layer"], offloaded) if o),
        "hits": sum(h for h, o in zip(stats["hits_per_layer"], offloaded) if o),
    }
    return counts, cache
