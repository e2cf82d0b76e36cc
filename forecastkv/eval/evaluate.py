"""One example under one mode: chunked prefill, greedy decode, score, forecast recall, bytes, time.

Prefill runs in chunks of `prefill_chunk` tokens through the mode's cache (memory O(chunk x T)).
Forecast recall uses the selections the forward itself makes (`collect_selections=True`): for each
layer, the query selector's and the forecast selector's blocks at every prefill row past
`recall_start`, counted by `modeling.selection` (the single definition).  Bytes per decode step:
`kv_read_bytes` is what attention read from the KV cache (selected blocks' K/V, NOSA's bias; all
stored K/V when dense), summed over layers -- the H2D traffic a cache without slot reuse would move.
`h2d_bytes` is every byte the offloaded runtime counted host -> device during the decode steps, per
step (`OffloadedSparseCache.stats()`; null on the resident cache, which moves nothing).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from ..modeling import selection as sel
from ..modeling.modeling import CACHE_KWARG
from ..selectors import get_selector
from . import longbench
from .metrics import score_prediction
from .modes import Mode, make_cache


def default_recall_start(sparse) -> int:
    """First row whose visible blocks exceed the budget (earlier rows are trivially perfect)."""
    return sparse.budget_blocks * sparse.block_size


def _kv_read_bytes(model, records: list | None, key_len: int, mode: Mode) -> int:
    """Bytes of K/V (and NOSA's bias) one decode step read, summed over layers and KV heads.
    key_len: stored tokens incl. the one being decoded; records: the step's per-layer selections."""
    config = model.config
    elem = next(model.parameters()).element_size()
    per_head_token = (2 * config.head_dim + (1 if mode.policy == "nosa" else 0)) * elem
    block = config.sparse.block_size if config.sparse is not None else 0
    total = 0
    for idx in range(config.num_hidden_layers):
        ids = (records[idx] if records else {}).get(mode.selector) if mode.sparse else None
        if ids is None:  # dense attention (or a step below dense_len): every stored token of every head
            total += key_len * config.num_key_value_heads * per_head_token
            continue
        valid = ids[0, :, 0][ids[0, :, 0] >= 0]  # block ids over all KV heads
        tokens = (key_len - valid * block).clamp(min=0, max=block).sum().item()
        total += tokens * per_head_token
    return int(total)


OFFLOAD_FIELDS = (
    "mode",
    "h2d_bytes_per_step_mean",
    "hit_rate",
    "h2d_other_bytes",
    "d2h_bytes",
    "device_nbytes",
    "index_nbytes",
    "host_nbytes",
)


def _offload_stats(cache) -> dict | None:
    """The offloaded runtime's counters (a summary), or None for the resident cache."""
    if not hasattr(cache, "host_nbytes"):
        return None
    stats = cache.stats()
    return {k: stats.get(k) for k in OFFLOAD_FIELDS}


def _h2d_per_step(cache, steps: int) -> float:
    """All bytes moved host -> device during the decode steps, per step (the runtime's per-step
    counters: block fetches, and whole-layer copies of dense rows)."""
    return sum(cache.stats()["h2d_bytes_per_step"]) / steps


@torch.no_grad()
def evaluate_example(
    model,
    example,
    mode: Mode,
    codec,
    prefill_chunk: int = 1024,
    recall_start: int | None = None,
    bucket_tokens: int = 1024,
    recall: str = "all",
) -> dict:
    """Score `example` with `model` already switched to `mode` (see `modes.attending_with`).

    recall: "all" (every sparse mode of a model with heads), "forecast" (forecast-selector modes only) or "none".
    Returns the record fields: score, prediction, recall counts per layer [[hits, wanted, chance]],
    bytes per decode step, perplexity buckets (perplexity task), timings.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([example.input_ids], dtype=torch.long, device=device)
    forecast_mode = mode.sparse and get_selector(mode.selector).needs_forecast_heads
    wanted = recall == "all" or (recall == "forecast" and forecast_mode)
    collect = mode.sparse and model.config.forecast_config.enabled and wanted
    start_row = (
        (default_recall_start(model.config.sparse) if recall_start is None else recall_start) if collect else None
    )
    cache = make_cache(model, mode)

    began = time.perf_counter()
    logits, counts, nll = _prefill(model, ids, cache, prefill_chunk, start_row, example.metric == "perplexity")
    prefill_s = time.perf_counter() - began
    began = time.perf_counter()
    generated, step_bytes = _greedy_decode(model, logits, ids.shape[1], cache, mode, example.max_new_tokens)
    decode_s = time.perf_counter() - began

    offload = _offload_stats(cache)
    steps = len(step_bytes)
    result = {
        "prompt_tokens": ids.shape[1],
        "decode_steps": steps,
        "kv_read_bytes_per_step": (sum(step_bytes) / steps) if step_bytes else None,
        "h2d_bytes_per_step": _h2d_per_step(cache, steps) if offload and step_bytes else None,
        "offload_stats": offload,
        "time": {
            "prefill_s": round(prefill_s, 4),
            "decode_s": round(decode_s, 4),
            "decode_ms_per_step": round(1000 * decode_s / steps, 3) if step_bytes else None,
        },
    }
    result["recall"] = _recall_fields(counts, start_row) if collect else None
    if nll is not None:
        result.update(_perplexity_fields(nll, bucket_tokens))
    else:
        text = codec.decode(generated)
        is_longbench = example.task.startswith("longbench:")
        scored = longbench.prepare_prediction(example.task.split(":", 1)[1], text) if is_longbench else text
        score = score_prediction(example.metric, scored, example.references, example.all_classes)
        result.update(score=score, prediction=text)
    return result


def _prefill(model, ids: torch.Tensor, cache, chunk: int, start_row: int | None, perplexity: bool):
    """Prefill ids [1, T] through `cache` in chunks of `chunk` tokens.

    start_row: count forecast recall over rows >= it (None: no recall).  Returns (the last chunk's
    logits [1, chunk or 1, vocab], recall counts float64 [L, 3] or None, per-token NLL float64
    [T - 1] or None when not `perplexity`)."""
    length, device, sparse = ids.shape[1], ids.device, model.config.sparse
    collect = start_row is not None
    counts = torch.zeros(model.config.num_hidden_layers, 3, dtype=torch.float64) if collect else None
    nll = torch.zeros(length - 1, dtype=torch.float64) if perplexity else None
    logits = None
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        out = model(
            ids[:, start:end],
            use_cache=True,
            collect_selections=collect,
            logits_to_keep=0 if perplexity else 1,
            **{CACHE_KWARG: cache},
        )
        logits = out.logits
        if perplexity:
            targets = ids[0, start + 1 : end + 1]
            token_nll = F.cross_entropy(logits[0, : targets.shape[0]].float(), targets, reduction="none")
            nll[start : start + targets.shape[0]] = token_nll.double().cpu()
        if collect and end > start_row:
            positions = torch.arange(start, end, device=device).view(1, -1)
            for idx, record in enumerate(out.selections):
                if "query" in record and "forecast" in record:
                    counts[idx] += sel.recall_row_sums(
                        record["query"], record["forecast"], positions, sparse, start_row
                    )
        del out
    return logits, counts, nll


def _greedy_decode(model, logits: torch.Tensor, length: int, cache, mode: Mode, max_new_tokens: int):
    """Greedy decode after a prefill of `length` tokens whose last logits are `logits`, up to
    `max_new_tokens` or an EOS.  Returns (the tokens generated, KV bytes read per decode step)."""
    generated: list[int] = []
    step_bytes: list[int] = []
    eos = model.config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos]) - {None}
    if max_new_tokens <= 0:
        return generated, step_bytes
    device = next(model.parameters()).device
    token = int(logits[0, -1].argmax())
    key_len = length
    while True:
        if token in stops:
            break
        generated.append(token)
        if len(generated) >= max_new_tokens:
            break
        key_len += 1
        out = model(
            torch.tensor([[token]], device=device),
            use_cache=True,
            collect_selections=mode.sparse,
            **{CACHE_KWARG: cache},
        )
        step_bytes.append(_kv_read_bytes(model, out.selections, key_len, mode))
        token = int(out.logits[0, -1].argmax())
    return generated, step_bytes


def _recall_fields(counts: torch.Tensor, start_row: int) -> dict:
    """The record's recall: counts [L, 3] (hits, wanted, chance), per-layer recall and chance."""
    wanted = counts[:, 1].clamp(min=1)
    return {
        "start": start_row,
        "counts": counts.tolist(),
        "per_layer": (counts[:, 0] / wanted).tolist(),
        "chance": (counts[:, 2] / wanted).tolist(),
    }


def _perplexity_fields(nll: torch.Tensor, bucket_tokens: int) -> dict:
    """Perplexity (score), mean NLL and NLL sums per bucket of `bucket_tokens` positions."""
    buckets = []
    for lo in range(0, nll.numel(), bucket_tokens):
        part = nll[lo : lo + bucket_tokens]
        buckets.append(
            {"start": lo + 1, "end": lo + 1 + part.numel(), "nll_sum": float(part.sum()), "tokens": part.numel()}
        )
    mean = float(nll.mean())
    return {"score": math.exp(mean), "nll": mean, "buckets": buckets, "prediction": None}
