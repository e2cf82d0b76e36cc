"""`SparseAttention`: dense, InfLLM-v2 and NOSA attention with query or forecast selectors,
`plan_decode`, which selects a layer's blocks for a decode step, and `apply_rope`.

Prefill (and any multi-token call) runs in query chunks against the layer's stored keys with a
[chunk, S] key mask built from each row's block selection, so memory is O(chunk x S).  A one-token
decode step attends only its planned blocks through the cache layer's `decode_attention` (the
cache-layer contract: `modeling/cache.py:CacheLayer`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import selection as sel
from . import selectors
from .cache import CallInfo, Plan
from .heads import scoring_head
from .prefill import (
    CHUNKED_ATTENTION_ROWS,
    block_layout,
    chunked_sparse_attention,
    dense_attention,
    dense_sequences,
    flex_sparse_attention,
    masked_decode_attention,
    pack_block_bits,
    row_block_masks,
    use_flex,
)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, d], cos/sin [B, T, d] -> rotated x (NeoX rotate-half: the halves swapped, the
    first one negated)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


# rows per stage-1 selection call where the fused kernel runs (CUDA): 1-2K-row tiles, not 256
STAGE1_QUERY_ROWS = 2048
FROM_CONFIG = object()  # `sparse=` not given: the module's config's


# the selectors that score with the layer's own queries, not vectors handed over by the layer before
OWN_QUERY_KINDS = ("query", "quest", "oracle")


def layer_selector(selector: str | None, layer_idx: int, sparse) -> str | None:
    """The rule layer `layer_idx` selects by under the call's `selector`: reuse's anchors and
    speculate's layer 0 (which has no layer before it to guess its queries) select with their own
    queries ("query"); reuse's other layers take the last anchor's blocks ("reuse"); every other
    selector is the same on every layer (forecast's layer 0 scores itself with current_proj)."""
    if selector == "reuse":
        return "query" if layer_idx in sparse.reuse_anchors else "reuse"
    if selector == "speculate" and layer_idx == 0:
        return "query"
    return selector


def key_selection(
    kind: str, q: torch.Tensor, positions: torch.Tensor, cache_layer, sparse, n_blocks: int
) -> torch.Tensor:
    """The selection int64 [B, H, Tq, budget] of the selectors that score keys themselves, not the
    compressed index: "quest" (the cache's block key bounds, `selectors.quest_block_scores`, init and
    local blocks forced) and "oracle" (the exact attention mass over every stored key,
    `selectors.oracle_block_mass`; no forced blocks: it is the upper bound).  q [B, Tq, Hq, d]."""
    if kind == "quest":
        low, high = cache_layer.key_bounds()
        scores = selectors.quest_block_scores(q, low, high, positions, sparse.block_size, n_blocks)
        scores = sel.force_blocks(scores, positions, sparse.block_size, sparse.init_blocks, sparse.local_blocks)
        agnostic = None
        if sparse.policy == "nosa":
            pooled = cache_layer.decode_index()[2]
            agnostic = sel.pooled_agnostic_scores(pooled, positions, sparse, n_blocks)
        return sel.select_blocks(scores, positions, sparse, agnostic)
    keys = cache_layer.full()[0]
    mass = selectors.oracle_block_mass(q, keys, positions, sparse.block_size, n_blocks)
    if not sparse.top_p:
        return selectors.oracle_blocks(mass, positions, sparse.budget_blocks, sparse.block_size)
    blocks = torch.arange(n_blocks, device=mass.device).view(1, 1, -1)
    future = (blocks > torch.div(positions, sparse.block_size, rounding_mode="floor").unsqueeze(-1))[:, None]
    return sel.top_p_blocks(
        mass.masked_fill(future, sel.NEG_INF), positions, sparse.top_p, sparse.budget_blocks, sparse.block_size,
        logits=False,
    )


def plan_decode(vectors: torch.Tensor, positions: torch.Tensor, cache_layer, sparse, kind: str) -> Plan:
    """Select `cache_layer`'s blocks for a decode step and plan their fetch: the one place both
    selectors make a `Plan` (the decoder layer before calls it for the next layer with the
    forecast selector, the attention itself with the query selector).

    vectors [B, 1, H*n, d] (queries or forecast vectors), positions [B, 1].  Scores every key and
    block the buffers hold, masked by visibility: the same selection as the current length's, at
    shapes that stay fixed from step to step.  The cache layer's kernel choices decide between the
    decode-time scoring kernels and `selection.score_blocks` (what `layer_selection` runs)."""
    ckeys, coarse, pooled, rows = cache_layer.decode_index()
    n_blocks = sel.num_blocks(rows, sparse.block_size)
    if kind in ("quest", "oracle"):
        return cache_layer.plan(key_selection(kind, vectors, positions, cache_layer, sparse, n_blocks)[:, :, 0])
    coarse = coarse if kind == "query" else None
    pooled = pooled if sparse.policy == "nosa" else None
    ops, lag = cache_layer.kernels, sel.visibility_lag(kind)
    if ops.decode_kernels:  # the decode-time scoring kernels (Triton on CUDA), equal at one row
        pos = positions[:, 0]
        # the cache's own buffers, in range by construction: no Python-level checks per step
        scores = ops.block_scores(vectors[:, 0], ckeys, pos, sparse, n_blocks, sel.score_kind(kind), lag,
                                  lse_keys=coarse, check_ids=False)
        agnostic = None
        if pooled is not None:
            agnostic = ops.agnostic_scores(pooled, pos, sparse, n_blocks, lag, check_ids=False).unsqueeze(2)
        scores = scores.unsqueeze(2)
    else:
        scores = sel.score_blocks(vectors, ckeys, positions, sparse, n_blocks, kind, lag, lse_keys=coarse)
        agnostic = None if pooled is None else sel.pooled_agnostic_scores(pooled, positions, sparse, n_blocks, lag)
    selection = sel.select_blocks(scores, positions, sparse, agnostic, sel.scores_are_logits(kind, vectors, ckeys))
    return cache_layer.plan(selection[:, :, 0])


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
        self.nosa_bias = sparse is not None and sparse.policy == "nosa"  # it has A and delta, and stores CIS
        if self.nosa_bias:
            self.A = nn.Parameter(torch.zeros(self.num_kv_heads))
            self.delta = nn.Linear(self.num_kv_heads * d, self.num_kv_heads, bias=bias)
        self.scores_itself = scoring_head(layer_idx)[0] == layer_idx  # layer 0: its current_proj scores it

    @property
    def sparse(self):
        return self.config.sparse

    # ------------------------------------------------------------------------------------------
    def project_forecast(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, which: str = "forecast_proj"
    ) -> torch.Tensor:
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

    def select(
        self,
        vectors: torch.Tensor,
        positions: torch.Tensor,
        cache_layer,
        kind: str,
        bounds: tuple[int, int] | None = None,
        key_count: int | None = None,
        sparse=FROM_CONFIG,
    ) -> torch.Tensor:
        """This layer's selection [B, H, R, budget] from `vectors` against `cache_layer`'s keys.

        kind "query": real queries, fresh keys (lag 0).  kind "forecast": forecast vectors scored as
        the prefetching runtime does, before this layer appended the row's own token (lag 1); kind
        "speculate" the same with guessed queries.  "quest" and "oracle": real queries, scored by
        `key_selection`.
        bounds (lowest, highest entry of positions) and key_count (the longest stored sequence):
        host ints the caller already holds; a prefill passes them so that its query chunks read
        nothing back from the device (else each is read here, one CUDA sync each).
        """
        sparse = self.sparse if sparse is FROM_CONFIG else sparse
        if kind in ("quest", "oracle"):
            bounds = sel.position_range(positions) if bounds is None else bounds
            return key_selection(kind, vectors, positions, cache_layer, sparse, sel.num_blocks(bounds[1] + 1,
                                                                                              sparse.block_size))
        # the incrementally pooled CIS: a decode step never re-pools every token, and an
        # offloaded cache keeps the raw CIS on the host
        ckeys, coarse, pooled = cache_layer.compressed(key_count)
        return sel.layer_selection(
            vectors,
            ckeys,
            positions,
            sparse,
            kind,
            lse_keys=coarse if kind == "query" else None,
            pooled_cis=pooled if sparse.policy == "nosa" else None,
            bounds=bounds,
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
        sparse=FROM_CONFIG,
        reused: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden [B, T, hidden] (post-norm), positions [B, T] (-1 = padding), cos/sin [B, T, d].

        cache_layer: this layer's `CacheLayer`.  forecast_in: the vectors scoring this layer
        [B, T, H*n, d] from the layer before (forecast heads, or speculate's guessed queries).
        plan: this layer's decode `Plan`, made one layer ahead.  reused: the selection [B, H, T, K]
        this layer reuses (reuse selector, from its anchor).  selections_out: if a dict, receives
        {"selected": the ids attended with, "query": ids, "forecast": ids} for recall measurements.
        selector: overrides `sparse_config.selector` (training routes the frozen backbone with
        "query"); this layer's rule is `layer_selector` of it.  step: the call's `CallInfo` (the
        model passes it; a direct call without it reads the positions once).  sparse: the call's
        SparseConfig (the model reads it once per call); by default the config's.  Returns
        [B, T, hidden].
        """
        batch, length, _ = hidden.shape
        d = self.head_dim
        sparse = self.sparse if sparse is FROM_CONFIG else sparse
        if step is None:
            step = CallInfo.from_positions(positions, cache_layer.host_lengths, sparse)
        q = self.queries(hidden, cos, sin)
        k = apply_rope(self.k_proj(hidden).view(batch, length, self.num_kv_heads, d), cos, sin)
        v = self.v_proj(hidden).view(batch, length, self.num_kv_heads, d)
        cis = self.compute_cis(v) if self.nosa_bias else None
        cache_layer.append(k, v, cis, positions, step)

        selector = layer_selector(selector or (sparse.selector if sparse is not None else None), self.layer_idx, sparse)
        if selector == "forecast" and forecast_in is None and plan is None:
            if not self.scores_itself:
                raise ValueError(f"layer {self.layer_idx} got no forecast vectors from layer {self.layer_idx - 1}")
            forecast_in = self.project_forecast(hidden, cos, sin, "current_proj")  # layer 0 scores itself
        vectors = self._scoring_vectors(selector, q, forecast_in, reused, plan, step, sparse)

        if step.decode and sparse is not None and not step.any_dense:
            if plan is None:
                plan = (
                    cache_layer.plan(reused[:, :, 0])
                    if selector == "reuse"
                    else plan_decode(vectors, positions, cache_layer, sparse, selector)
                )
            if selections_out is not None:
                self._record(
                    selections_out,
                    q,
                    forecast_in,
                    positions,
                    cache_layer,
                    plan.selection.unsqueeze(2),
                    selector,
                    sparse,
                    bounds=step.bounds(),
                )
            out = cache_layer.decode_attention(q, plan)
        else:
            out = self._attend_chunks(q, vectors, forecast_in, positions, cache_layer, selections_out, selector, step,
                                      sparse)
        return self.o_proj(out.reshape(batch, length, self.num_heads * d))

    def _scoring_vectors(self, selector, q, forecast_in, reused, plan, step: CallInfo, sparse):
        """What this layer's selection starts from: its queries (query, quest, oracle), the vectors
        handed over (forecast, speculate), or the reused selection (reuse).  A ValueError when the
        layer before handed over nothing where the call needs it (a sparse call without a plan)."""
        if selector in OWN_QUERY_KINDS or sparse is None:
            return q
        given = reused if selector == "reuse" else forecast_in
        if given is None and plan is None and not step.all_dense:
            what = "blocks to reuse" if selector == "reuse" else f"{selector} vectors"
            raise ValueError(f"layer {self.layer_idx} got no {what} from layer {self.layer_idx - 1}")
        return given

    def _record(
        self, out: dict | None, q, forecast_in, positions, cache_layer, selection, selector, sparse, **host
    ) -> None:
        """Store the selection in use ("selected") and the query and forecast selectors' choices for
        recall measurements (forecast: when the layer before handed Forecast vectors over); `host`:
        `select`'s bounds / key_count."""
        if out is None or sparse is None:
            return
        select = lambda vectors, kind: self.select(vectors, positions, cache_layer, kind, sparse=sparse, **host)  # noqa: E731
        out["selected"] = selection
        out["query"] = selection if selector == "query" else select(q, "query")
        if forecast_in is not None and selector != "speculate":  # speculate hands over guessed queries
            out["forecast"] = selection if selector == "forecast" else select(forecast_in, "forecast")

    def _attend_chunks(
        self, q, vectors, forecast_in, positions, cache_layer, selections_out, selector, step: CallInfo, sparse
    ) -> torch.Tensor:
        """All rows of a multi-token call (and decode steps of a batch holding a dense sequence).

        q [B, T, Hq, d] -> [B, T, Hq, d]; vectors: `_scoring_vectors` (reuse: ids [B, H, T, K]).  Each
        sequence is dense or sparse for the whole call.  Sparse rows are selected in query chunks and
        attend only their blocks (or FlexAttention on CUDA): memory O(chunk x selected keys).  Every
        host-side number comes from `step`, so on CUDA the chunk loop never waits for the device."""
        keys, values, cis, count = cache_layer.full()
        dense = dense_sequences(positions, sparse)
        if cis is not None and sparse is not None and not sparse.dense_cis_bias:
            cis = cis.masked_fill(dense.view(-1, 1, 1), 0.0)  # SparDA-NOSA: dense sequences attend without the CIS bias
        all_dense, any_dense = step.all_dense, any(step.dense)
        if sparse is None or (all_dense and selections_out is None):
            return dense_attention(q, keys, values, cis, positions, self.config.query_chunk_size)
        n_blocks = sel.num_blocks(count, sparse.block_size)
        if step.decode:  # a decode step of a batch holding a dense sequence
            host = {"bounds": step.bounds(), "key_count": count, "sparse": sparse}
            ids = vectors if selector == "reuse" else self.select(vectors, positions, cache_layer, selector, **host)
            self._record(selections_out, q, forecast_in, positions, cache_layer, ids, selector, **host)
            masks = row_block_masks(ids, positions, n_blocks, sparse.block_size, dense if any_dense else None)
            return masked_decode_attention(q, keys, values, cis, positions, masks, sparse.block_size)
        flex = not all_dense and not any_dense and use_flex(q) and step.contiguous()
        outputs, bits, records = [], [], {}
        blocks = None
        if not all_dense and not flex:  # K/V (and CIS) by block, once per call: chunks gather whole blocks
            blocks = tuple(None if x is None else block_layout(x, sparse.block_size) for x in (keys, values, cis))
        pending, pending_from = [], 0  # row masks of chunks selected but not yet attended
        chunk = self.config.query_chunk_size
        if cache_layer.kernels.stage1:  # the fused kernel stores no [rows, C] scores: larger tiles pay
            chunk = max(chunk, STAGE1_QUERY_ROWS)
        for start in range(0, q.shape[1], chunk):
            rows = slice(start, start + chunk)
            pos = positions[:, rows]
            f_rows = None if forecast_in is None else forecast_in[:, rows]
            host = {"bounds": step.bounds(start, start + chunk), "key_count": count, "sparse": sparse}
            reused = selector == "reuse"
            ids = vectors[:, :, rows] if reused else self.select(vectors[:, rows], pos, cache_layer, selector, **host)
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
                    outputs.append(
                        chunked_sparse_attention(
                            q[:, group],
                            keys,
                            values,
                            cis,
                            positions[:, group],
                            torch.cat(pending, dim=2),
                            sparse.block_size,
                            blocks,
                        )
                    )
                    pending, pending_from = [], end
        if selections_out is not None:
            selections_out.update({key: torch.cat(parts, dim=2) for key, parts in records.items()})
        if all_dense:
            return dense_attention(q, keys, values, cis, positions, self.config.query_chunk_size)
        if flex:
            return flex_sparse_attention(
                q, keys, values, cis, count - q.shape[1], torch.cat(bits, dim=2), sparse.block_size
            )
        return torch.cat(outputs, dim=1)
