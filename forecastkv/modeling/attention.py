"""`SparseAttention`: dense, InfLLM-v2 and NOSA attention with query or forecast selectors.

Prefill (and any multi-token call) runs in query chunks against the layer's stored keys with a
[chunk, S] key mask built from each row's block selection, so memory is O(chunk x S).  A one-token
decode step reads only its selected blocks through `cache_layer.blocks()`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from . import selection as sel
from .cache import Plan, decode_kernels_enabled
from .heads import scoring_head
from .prefill import (
    CHUNKED_ATTENTION_ROWS,
    block_layout,
    chunked_sparse_attention,
    dense_attention,
    dense_sequences,
    flex_sparse_attention,
    masked_attention,
    masked_decode_attention,
    pack_block_bits,
    row_block_masks,
    use_flex,
)
from .rope import apply_rope
from .step import CallInfo

# rows per stage-1 selection call where the fused kernel runs (CUDA): 1-2K-row tiles, not 256
STAGE1_QUERY_ROWS = 2048


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`prefill.masked_attention` with a mask per query row: query [B, H, R, d], keys/values
    [B, H, L, d], allowed bool [B, H, R, L], bias [B, H, L] or None -> [B, H, R, d] (rows with no
    allowed key: zeros)."""
    return masked_attention(query, keys, values, allowed, bias, group=1)


class SparseAttention(nn.Module):
    """Llama attention plus block selection, Forecast heads and NOSA's CIS bias.

    Parameters beyond Llama's: `forecast_proj` (hidden -> H*n*d, n = heads_per_group) when the model
    carries Forecast heads, `current_proj` on layer 0, and `A` [H] / `delta` (H*d -> H) for NOSA.
    """

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.group = self.num_heads // self.num_kv_heads
        hidden, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=bias)
        forecast = config.forecast_config
        if forecast.enabled:
            width = self.num_kv_heads * forecast.heads_per_group * d
            self.forecast_proj = nn.Linear(hidden, width, bias=False)
            if layer_idx == 0:
                self.current_proj = nn.Linear(hidden, width, bias=False)
        sparse = config.sparse
        if sparse is not None and sparse.policy == "nosa":
            self.A = nn.Parameter(torch.zeros(self.num_kv_heads))
            self.delta = nn.Linear(self.num_kv_heads * d, self.num_kv_heads, bias=bias)

    @property
    def sparse(self):
        return self.config.sparse

    # ------------------------------------------------------------------------------------------
    def project_forecast(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, which: str = "forecast_proj") -> torch.Tensor:
        """Forecast vectors [B, T, H*n, d], RoPE at the current positions."""
        out = getattr(self, which)(hidden)
        return apply_rope(out.view(*hidden.shape[:2], -1, self.head_dim), cos, sin)

    def queries(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Post-RoPE queries [B, T, Hq, d] from the post-norm input hidden [B, T, hidden]."""
        batch, length, _ = hidden.shape
        return apply_rope(self.q_proj(hidden).view(batch, length, self.num_heads, self.head_dim), cos, sin)

    def compute_cis(self, values: torch.Tensor) -> torch.Tensor:
        """NOSA's static per-token bias A * softplus(delta(v)).  values [B, T, H, d] -> [B, T, H]."""
        return self.A * F.softplus(self.delta(values.flatten(-2)))

    def select(self, vectors: torch.Tensor, positions: torch.Tensor, cache_layer, kind: str,
               bounds: tuple[int, int] | None = None, key_count: int | None = None) -> torch.Tensor:
        """This layer's selection [B, H, R, budget] from `vectors` against `cache_layer`'s keys.

        kind "query": real queries, fresh keys (lag 0).  kind "forecast": forecast vectors scored as
        the prefetching runtime does, before this layer appended the row's own token (lag 1).
        bounds (lowest, highest entry of positions) and key_count (the longest stored sequence):
        host ints the caller already holds; a prefill passes them so that its query chunks read
        nothing back from the device (else each is read here, one CUDA sync each).
        """
        # the incrementally pooled CIS: a decode step never re-pools every token, and an
        # offloaded cache keeps the raw CIS on the host
        nosa = self.sparse.policy == "nosa"
        return sel.layer_selection(
            vectors, cache_layer.compressed_keys(key_count), positions, self.sparse, kind,
            lse_keys=cache_layer.coarse_compressed_keys(key_count) if kind == "query" else None,
            pooled_cis=cache_layer.pooled_compressed_cis(key_count) if nosa else None, bounds=bounds,
        )

    # ------------------------------------------------------------------------------------------
    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache_layer,
        forecast_in: torch.Tensor | None = None,
        plan: Plan | None = None,
        selections_out: dict | None = None,
        selector: str | None = None,
        step: CallInfo | None = None,
    ) -> torch.Tensor:
        """hidden [B, T, hidden] (post-norm), positions [B, T] (-1 = padding), cos/sin [B, T, d].

        forecast_in: the previous layer's forecast vectors [B, T, H*n, d] (forecast selector).
        plan: this layer's decode `Plan`, made one layer ahead by the model (forecast selector).
        selections_out: if a dict, receives {"query": ids, "forecast": ids} for recall measurements.
        selector: overrides `sparse_config.selector` (training routes the frozen backbone with "query").
        step: the call's host-side facts (`CallInfo`, the model passes them); a direct call without
        them reads the positions once.  Returns the attention output [B, T, hidden].
        """
        batch, length, _ = hidden.shape
        d = self.head_dim
        sparse = self.sparse
        if step is None:
            step = CallInfo.from_positions(positions, cache_layer.host_lengths, sparse)
        q = self.queries(hidden, cos, sin)
        k = apply_rope(self.k_proj(hidden).view(batch, length, self.num_kv_heads, d), cos, sin)
        v = self.v_proj(hidden).view(batch, length, self.num_kv_heads, d)
        cis = self.compute_cis(v) if hasattr(self, "A") else None
        cache_layer.append(k, v, cis, positions, step)

        selector = selector or (sparse.selector if sparse is not None else None)
        if selector == "forecast" and forecast_in is None and plan is None:
            owner, projection = scoring_head(self.layer_idx)
            if owner != self.layer_idx:
                raise ValueError(f"layer {self.layer_idx} got no forecast vectors from layer {owner}")
            forecast_in = self.project_forecast(hidden, cos, sin, projection)  # a layer that scores itself

        if step.decode and sparse is not None and not step.any_dense:
            if plan is None:
                plan = self.plan_decode(q if selector == "query" else forecast_in, positions, cache_layer, selector, step)
            if selections_out is not None:
                self._record(selections_out, q, forecast_in, positions, cache_layer, plan.selection.unsqueeze(2), selector, bounds=step.bounds())
            out = self._decode_blocks(q, positions, cache_layer, plan)
        else:
            out = self._attend_chunks(q, forecast_in, positions, cache_layer, selections_out, selector, step)
        return self.o_proj(out.reshape(batch, length, self.num_heads * d))

    def plan_decode(self, vectors: torch.Tensor, positions: torch.Tensor, cache_layer, kind: str, step: CallInfo) -> Plan:
        """Select this layer's blocks for a decode step and plan their fetch: the one place both
        selectors make a `Plan` (the model calls it one layer ahead for the forecast selector,
        `forward` at the layer itself for the query selector).  vectors [B, 1, H*n, d]."""
        # every key and block the buffers hold, masked by visibility: the same selection as the
        # current length's, at shapes that stay fixed from step to step
        sparse = self.sparse
        ckeys, coarse, pooled, rows = cache_layer.decode_index()
        coarse = coarse if kind == "query" else None
        pooled = pooled if sparse.policy == "nosa" else None
        n_blocks = sel.num_blocks(rows, sparse.block_size)
        if decode_kernels_enabled(vectors.device):
            # the decode-time scoring kernels (Triton on CUDA), equal to score_blocks at one row
            lag, pos = sel.visibility_lag(kind), positions[:, 0]
            scores = kernels.block_scores(vectors[:, 0], ckeys, pos, sparse, n_blocks, kind, lag, lse_keys=coarse).unsqueeze(2)
            agnostic = None if pooled is None else kernels.agnostic_scores(pooled, pos, sparse, n_blocks, lag).unsqueeze(2)
            selection = sel.select_blocks(scores, positions, sparse, agnostic)
        else:
            selection = sel.layer_selection(vectors, ckeys, positions, sparse, kind, lse_keys=coarse, pooled_cis=pooled, n_blocks=n_blocks)
        return cache_layer.plan(selection[:, :, 0], sparse.block_size)

    def _record(self, out: dict | None, q, forecast_in, positions, cache_layer, selection, selector, **host) -> None:
        """Store both selectors' choices (the one in use is `selection`) for recall measurements;
        `host`: `select`'s bounds / key_count."""
        if out is None or self.sparse is None:
            return
        out["query"] = selection if selector == "query" else self.select(q, positions, cache_layer, "query", **host)
        if forecast_in is not None:
            out["forecast"] = selection if selector == "forecast" else self.select(forecast_in, positions, cache_layer, "forecast", **host)

    def _decode_blocks(self, q: torch.Tensor, positions: torch.Tensor, cache_layer, plan: Plan) -> torch.Tensor:
        """One token per sequence over its planned blocks.  q [B, 1, Hq, d] -> [B, 1, Hq, d]."""
        batch = q.shape[0]
        if decode_kernels_enabled(q.device) and hasattr(cache_layer, "decode_attention"):
            # the sparse_decode kernel reads the blocks in place: no gather copy, no host sync
            out = cache_layer.decode_attention(q[:, 0], plan, self.sparse.block_size)
            return out.view(batch, 1, self.num_heads, self.head_dim)
        keys, values, key_pos, bias = cache_layer.blocks(plan, self.sparse.block_size)
        query = q.view(batch, self.num_kv_heads, self.group, self.head_dim)  # the G heads of a KV head as rows
        allowed = ((key_pos >= 0) & (key_pos <= positions.view(-1, 1, 1))).unsqueeze(2)  # [B, H, 1, L]: one row, shared
        out = masked_attention(query, keys, values, allowed, bias, self.group)
        return out.reshape(batch, 1, self.num_heads, self.head_dim)

    def _attend_chunks(self, q, forecast_in, positions, cache_layer, selections_out, selector, step: CallInfo) -> torch.Tensor:
        """All rows of a multi-token call (and decode steps of a batch holding a dense sequence).

        q [B, T, Hq, d] -> [B, T, Hq, d].  Each sequence is dense or sparse for the whole call
        (`prefill.dense_sequences`).  Sparse rows are selected in query chunks and attend only
        their blocks (`prefill.chunked_sparse_attention`, or FlexAttention on CUDA), so memory is
        O(chunk x selected keys); K/V are never repeated per query head.  Every host-side number
        comes from `step` (one read of the positions per call, none at a decode step), so on CUDA
        the chunk loop itself never waits for the device.
        """
        keys, values, cis, count = cache_layer.full()
        sparse = self.sparse
        dense = dense_sequences(positions, sparse)
        if cis is not None and sparse is not None and not sparse.dense_cis_bias:
            cis = cis.masked_fill(dense.view(-1, 1, 1), 0.0)  # SparDA-NOSA: dense sequences attend without the CIS bias
        all_dense, any_dense = step.all_dense, any(step.dense)
        if sparse is None or (all_dense and selections_out is None):
            return dense_attention(q, keys, values, cis, positions, self.config.query_chunk_size)
        n_blocks = sel.num_blocks(count, sparse.block_size)
        if step.decode:  # a decode step of a batch holding a dense sequence
            ids = self.select(q if selector == "query" else forecast_in, positions, cache_layer, selector, bounds=step.bounds(), key_count=count)
            self._record(selections_out, q, forecast_in, positions, cache_layer, ids, selector, bounds=step.bounds(), key_count=count)
            masks = row_block_masks(ids, positions, n_blocks, sparse.block_size, dense if any_dense else None)
            return masked_decode_attention(q, keys, values, cis, positions, masks, sparse.block_size)
        flex = not all_dense and not any_dense and use_flex(q) and step.contiguous()
        outputs, bits, records = [], [], {}
        blocks = None
        if not all_dense and not flex:  # K/V (and CIS) by block, once per call: chunks gather whole blocks
            blocks = tuple(None if x is None else block_layout(x, sparse.block_size) for x in (keys, values, cis))
        pending, pending_from = [], 0  # row masks of chunks selected but not yet attended
        chunk = self.config.query_chunk_size
        if kernels.use_stage1_kernel(q.device):  # the fused kernel stores no [rows, C] scores: larger tiles pay
            chunk = max(chunk, STAGE1_QUERY_ROWS)
        for start in range(0, q.shape[1], chunk):
            rows = slice(start, start + chunk)
            pos = positions[:, rows]
            f_rows = None if forecast_in is None else forecast_in[:, rows]
            host = {"bounds": step.bounds(start, start + chunk), "key_count": count}
            ids = self.select(q[:, rows] if selector == "query" else f_rows, pos, cache_layer, selector, **host)
            if selections_out is not None:
                chunk_records: dict = {}
                self._record(chunk_records, q[:, rows], f_rows, pos, cache_layer, ids, selector, **host)
                for key, value in chunk_records.items():
                    records.setdefault(key, []).append(value)
            if all_dense:
                continue
            masks = row_block_masks(ids, pos, n_blocks, sparse.block_size, dense if any_dense else None)
            if flex:
                bits.append(pack_block_bits(masks))
            else:
                # selection runs per query chunk (its [Hq, chunk, C] scores bound the memory);
                # attention runs per CHUNKED_ATTENTION_ROWS rows: fewer, larger SDPA groups
                pending.append(masks)
                end = min(start + chunk, q.shape[1])
                if end - pending_from >= CHUNKED_ATTENTION_ROWS or end == q.shape[1]:
                    group = slice(pending_from, end)
                    outputs.append(chunked_sparse_attention(
                        q[:, group], keys, values, cis, positions[:, group], torch.cat(pending, dim=2), sparse.block_size, blocks,
                    ))
                    pending, pending_from = [], end
        if selections_out is not None:
            selections_out.update({key: torch.cat(parts, dim=2) for key, parts in records.items()})
        if all_dense:
            return dense_attention(q, keys, values, cis, positions, self.config.query_chunk_size)
        if flex:
            return flex_sparse_attention(q, keys, values, cis, count - q.shape[1], torch.cat(bits, dim=2), sparse.block_size)
        return torch.cat(outputs, dim=1)
