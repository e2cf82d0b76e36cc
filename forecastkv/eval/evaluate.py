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


OFFLOAD_FIELDS = ("mode", "h2d_bytes_per_step_mean", "hit_rate", "h2d_other_bytes", "d2h_bytes", "device_nbytes", "index_nbytes", "host_nbytes")


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
def evaluate_example(model, example, mode: Mode, codec, prefill_chunk: int = 1024, recall_start: int | None = None,
                     bucket_tokens: int = 1024, recall: str = "all") -> dict:
    """Score `example` with `model` already switched to `mode` (see `modes.attending_with`).

    recall: "all" (every sparse mode of a model with heads), "forecast" (forecast-selector modes only) or "none".
    Returns the record fields: score, prediction, recall counts per layer [[hits, wanted, chance]],
    bytes per decode step, perplexity buckets (perplexity task), timings.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([example.input_ids], dtype=torch.long, device=device)
    length = ids.shape[1]
    sparse = model.config.sparse
    collect = mode.sparse and model.config.forecast_config.enabled and (recall == "all" or (recall == "forecast" and mode.selector == "forecast"))
    start_row = (default_recall_start(sparse) if recall_start is None else recall_start) if collect else None
    counts = torch.zeros(model.config.num_hidden_layers, 3, dtype=torch.float64) if collect else None
    perplexity = example.metric == "perplexity"
    nll = torch.zeros(length - 1, dtype=torch.float64) if perplexity else None
    cache = make_cache(model, mode)

    began = time.perf_counter()
    logits = None
    for start in range(0, length, prefill_chunk):
        end = min(start + prefill_chunk, length)
        out = model(ids[:, start:end], use_cache=True, collect_selections=collect, logits_to_keep=0 if perplexity else 1,
                    **{CACHE_KWARG: cache})
        logits = out.logits
        if perplexity:
            targets = ids[0, start + 1 : end + 1]
            nll[start : start + targets.shape[0]] = F.cross_entropy(logits[0, : targets.shape[0]].float(), targets, reduction="none").double().cpu()
        if collect and end > start_row:
            positions = torch.arange(start, end, device=device).view(1, -1)
            for idx, record in enumerate(out.selections):
                if "query" in record and "forecast" in record:
                    counts[idx] += sel.recall_row_sums(record["query"], record["forecast"], positions, sparse, start_row)
        del out
    prefill_s = time.perf_counter() - began

    generated: list[int] = []
    step_bytes: list[int] = []
    eos = model.config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos]) - {None}
    began = time.perf_counter()
    if example.max_new_tokens > 0:
        token = int(logits[0, -1].argmax())
        key_len = length
        while True:
            if token in stops:
                break
            generated.append(token)
            if len(generated) >= example.max_new_tokens:
                break
            key_len += 1
            out = model(torch.tensor([[token]], device=device), use_cache=True, collect_selections=mode.sparse, **{CACHE_KWARG: cache})
            step_bytes.append(_kv_read_bytes(model, out.selections, key_len, mode))
            token = int(out.logits[0, -1].argmax())
    decode_s = time.perf_counter() - began

    offload = _offload_stats(cache)
    result = {"prompt_tokens": length, "decode_steps": len(step_bytes),
              "kv_read_bytes_per_step": (sum(step_bytes) / len(step_bytes)) if step_bytes else None,
              "h2d_bytes_per_step": _h2d_per_step(cache, len(step_bytes)) if offload and step_bytes else None,
              "offload_stats": offload,
              "time": {"prefill_s": round(prefill_s, 4), "decode_s": round(decode_s, 4),
                       "decode_ms_per_step": round(1000 * decode_s / len(step_bytes), 3) if step_bytes else None}}
    if collect:
        wanted = counts[:, 1].clamp(min=1)
        result["recall"] = {"start": start_row, "counts": counts.tolist(),
                            "per_layer": (counts[:, 0] / wanted).tolist(), "chance": (counts[:, 2] / wanted).tolist()}
    else:
        result["recall"] = None
    if perplexity:
        buckets = []
        for lo in range(0, length - 1, bucket_tokens):
            part = nll[lo : lo + bucket_tokens]
            buckets.append({"start": lo + 1, "end": lo + 1 + part.numel(), "nll_sum": float(part.sum()), "tokens": part.numel()})
        mean = float(nll.mean())
        result.update(score=math.exp(mean), nll=mean, buckets=buckets, prediction=None)
    else:
        text = codec.decode(generated)
        scored = longbench.prepare_prediction(example.task.split(":", 1)[1], text) if example.task.startswith("longbench:") else text
        result.update(score=score_prediction(example.metric, scored, example.references, example.all_classes), prediction=text)
    return result
