"""`SparseAttention`: dense, InfLLM-v2 and NOSA attention with any registered selector
(`forecastkv/selectors`: the selector scores and plans, attention attends), and `apply_rope`.

Prefill (and any multi-token call) runs in query chunks against the layer's stored keys with a
[chunk, S] key mask built from each row's block selection, so memory is O(chunk x S).  A one-token
decode step attends only its planned blocks through the cache layer's `decode_attention` (the
cache-layer contract: `modeling/cache.py:CacheLayer`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..selectors import get_selector
from . import selection as sel
from .cache import CallInfo, Plan
from .heads import scoring_head
from .prefill import (
    CHUNKED_ATTENTION_ROWS,
    BlockSource,
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
        # True once a serving engine swapped q/k/v for one fused `qkv_proj` (`serving/vllm_layers.py`)
        self.fused_qkv = False

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
        if self.fused_qkv:
            return self.project(hidden, cos, sin)[0]
        batch, length, _ = hidden.shape
        return apply_rope(self.q_proj(hidden).view(batch, length, self.num_heads, self.head_dim), cos, sin)

    def project(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(queries [B, T, Hq, d], keys [B, T, H, d], both post-RoPE, values [B, T, H, d]) from the
        post-norm hidden [B, T, hidden]: three projections, or one fused `qkv_proj` call."""
        batch, length, _ = hidden.shape
        d = self.head_dim
        if self.fused_qkv:
            widths = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
            q, k, v = self.qkv_proj(hidden).split(widths, -1)
            q = apply_rope(q.reshape(batch, length, self.num_heads, d), cos, sin)
        else:
            q, k, v = self.queries(hidden, cos, sin), self.k_proj(hidden), self.v_proj(hidden)
        k = apply_rope(k.reshape(batch, length, self.num_kv_heads, d), cos, sin)
        return q, k, v.reshape(batch, length, self.num_kv_heads, d)

    def compute_cis(self, values: torch.Tensor) -> torch.Tensor:
        """NOSA's static per-token bias A * softplus(delta(v)).  values [B, T, H, d] -> [B, T, H]."""
        return self.A * F.softplus(self.delta(values.flatten(-2)))

    def select(
        self,
        vectors: torch.Tensor,
        positions: torch.Tensor,
        cache_layer,
        kind,
        bounds: tuple[int, int] | None = None,
        key_count: int | None = None,
        sparse=FROM_CONFIG,
    ) -> torch.Tensor:
        """This layer's selection [B, H, R, budget] from `vectors` against `cache_layer`'s keys by the
        selector `kind` (a registered name or a `Selector`): `Selector.select`, where bounds and
        key_count are the host ints a prefill already holds."""
        sparse = self.sparse if sparse is FROM_CONFIG else sparse
        return get_selector(kind).select(vectors, positions, cache_layer, sparse, bounds, key_count)

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
        selector: a registered name overriding `sparse_config.selector` (training routes the frozen
        backbone with "query"), this layer's rule its `at_layer`; or this layer's `Selector` as the
        decoder resolved it.  step: the call's `CallInfo` (the
        model passes it; a direct call without it reads the positions once).  sparse: the call's
        SparseConfig (the model reads it once per call); by default the config's.  Returns
        [B, T, hidden].
        """
        batch, length, _ = hidden.shape
        d = self.head_dim
        sparse = self.sparse if sparse is FROM_CONFIG else sparse
        if step is None:
            step = CallInfo.from_positions(positions, cache_layer.host_lengths, sparse)
        q, k, v = self.project(hidden, cos, sin)
        cis = self.compute_cis(v) if self.nosa_bias else None
        cache_layer.append(k, v, cis, positions, step)

        if selector is not None and not isinstance(selector, str):  # the decoder's, already this layer's rule
            rule = selector
        else:
            rule = get_selector(selector or (sparse.selector if sparse is not None else None))
            rule = None if rule is None else rule.at_layer(self.layer_idx, sparse)
        if rule is not None and rule.scores_with == "forecast" and forecast_in is None and plan is None:
            if not self.scores_itself:
                raise ValueError(f"layer {self.layer_idx} got no forecast vectors from layer {self.layer_idx - 1}")
            forecast_in = self.project_forecast(hidden, cos, sin, "current_proj")  # layer 0 scores itself
        vectors = self._scoring_vectors(rule, q, forecast_in, reused, plan, step, sparse)

        if step.decode and sparse is not None and not step.any_dense:
            if plan is None:
                plan = rule.plan(vectors, positions, cache_layer, sparse)
            if selections_out is not None:
                self._record(
                    selections_out,
                    q,
                    forecast_in,
                    positions,
                    cache_layer,
                    plan.selection.unsqueeze(2),
                    rule,
                    sparse,
                    bounds=step.bounds(),
                )
            out = cache_layer.decode_attention(q, plan)
            if step.dense_rows is not None:
                out = self._dense_rows_decode(q, out, cache_layer, step.dense_rows, sparse)
        else:
            out = self._attend_chunks(q, vectors, forecast_in, positions, cache_layer, selections_out, rule, step,
                                      sparse)
            if not step.decode and cache_layer.pinning:  # after the call's own selections
                cache_layer.pin_window(q, positions)
        return self.o_proj(out.reshape(batch, length, self.num_heads * d))

    def _dense_rows_decode(self, q, sparse_out, cache_layer, dense: torch.Tensor, sparse) -> torch.Tensor:
        """A decode step's output [B, 1, Hq, d] where MiniCPM's dense rule is decided on the device
        (`CallInfo.dense_rows`, dense bool [B]): the rows below dense_len attend every stored block, the
        others keep sparse_out.  Both attentions run at fixed shapes (a captured step cannot choose);
        the dense one reads only the current block of a sparse row (`selection.dense_row_blocks`)."""
        blocks = sel.num_blocks(cache_layer.capacity_rows(), sparse.block_size)
        every = sel.dense_row_blocks(cache_layer.lengths, dense, sparse.block_size, blocks, self.num_kv_heads)
        out = cache_layer.decode_attention(q, Plan(every, cis_bias=sparse.dense_cis_bias), observe=False)
        return torch.where(dense.view(-1, 1, 1, 1), out, sparse_out)

    def _scoring_vectors(self, rule, q, forecast_in, reused, plan, step: CallInfo, sparse):
        """What this layer's selection starts from (`Selector.scores_with`): its queries, the vectors
        handed over (Forecast vectors, guessed queries), or the reused selection.  A ValueError when the
        layer before handed over nothing where the call needs it (a sparse call without a plan)."""
        if sparse is None or rule.scores_with == "queries":
            return q
        blocks = rule.scores_with == "blocks"
        given = reused if blocks else forecast_in
        if given is None and plan is None and not step.all_dense:
            what = "blocks to reuse" if blocks else f"{rule.name} vectors"
            raise ValueError(f"layer {self.layer_idx} got no {what} from layer {self.layer_idx - 1}")
        return given

    def _record(
        self, out: dict | None, q, forecast_in, positions, cache_layer, selection, rule, sparse, **host
    ) -> None:
        """Store the selection in use ("selected") and the query and forecast selectors' choices for
        recall measurements (forecast: when the layer before handed Forecast vectors over); `host`:
        `select`'s bounds / key_count."""
        if out is None or sparse is None:
            return
        select = lambda vectors, kind: self.select(vectors, positions, cache_layer, kind, sparse=sparse, **host)  # noqa: E731
        out["selected"] = selection
        query, forecast = get_selector("query"), get_selector("forecast")
        out["query"] = selection if rule is query else select(q, query)
        if forecast_in is not None and rule.scores_with != "guessed-queries":  # guesses are not Forecast vectors
            out["forecast"] = selection if rule is forecast else select(forecast_in, forecast)

    def _stored_rows(self, cache_layer, dense: torch.Tensor, step: CallInfo, sparse, flex: bool) -> tuple:
        """(keys, values [B, S, H, d], cis [B, S, H] or None, S, None) from `cache_layer.full()`, or
        (None, None, None, S, the store's `BlockSource`) where the store reads its blocks in place (an
        engine's pages) and the call attends sparse rows by block: a chunk over a long stored context
        then copies only the blocks its rows chose, not every row.  dense bool [B]: `dense_sequences`."""
        any_dense = any(step.dense)
        # NOSA's bias must be dropped for the dense sequences of a mixed call: the pages hold it
        drop_bias = any_dense and self.nosa_bias and sparse is not None and not sparse.dense_cis_bias
        if sparse is not None and not step.decode and not step.all_dense and not flex and not drop_bias:
            source = cache_layer.block_source()
            if source is not None:
                return None, None, None, cache_layer.key_count(), source
        keys, values, cis, count = cache_layer.full()
        if cis is not None and sparse is not None and not sparse.dense_cis_bias:
            cis = cis.masked_fill(dense.view(-1, 1, 1), 0.0)  # SparDA-NOSA: dense sequences drop the CIS bias
        return keys, values, cis, count, None

    def _attend_chunks(
        self, q, vectors, forecast_in, positions, cache_layer, selections_out, rule, step: CallInfo, sparse
    ) -> torch.Tensor:
        """All rows of a multi-token call (and decode steps of a batch holding a dense sequence).

        q [B, T, Hq, d] -> [B, T, Hq, d]; vectors: `_scoring_vectors` (reuse: ids [B, H, T, K]).  Each
        sequence is dense or sparse for the whole call.  Sparse rows are selected in query chunks and
        attend only their blocks (or FlexAttention on CUDA): memory O(chunk x selected keys).  Every
        host-side number comes from `step`, so on CUDA the chunk loop never waits for the device."""
        dense = dense_sequences(positions, sparse)
        all_dense, any_dense = step.all_dense, any(step.dense)
        flex = sparse is not None and not step.decode and not all_dense and not any_dense and use_flex(q)
        flex = flex and step.contiguous()
        keys, values, cis, count, source = self._stored_rows(cache_layer, dense, step, sparse, flex)
        if sparse is None or (all_dense and selections_out is None):
            return dense_attention(q, keys, values, cis, positions, self.config.query_chunk_size)
        n_blocks = sel.num_blocks(count, sparse.block_size)
        if step.decode:  # a decode step of a batch holding a dense sequence
            host = {"bounds": step.bounds(), "key_count": count, "sparse": sparse}
            ids = rule.select(vectors, positions, cache_layer, sparse, host["bounds"], count)
            self._record(selections_out, q, forecast_in, positions, cache_layer, ids, rule, **host)
            cache_layer.observe_rows(q, ids[:, :, 0], keys, cis)  # the sparse sequences' carried blocks
            masks = row_block_masks(ids, positions, n_blocks, sparse.block_size, dense if any_dense else None)
            return masked_decode_attention(q, keys, values, cis, positions, masks, sparse.block_size)
        outputs, bits, records = [], [], {}
        blocks = source
        if blocks is None and not all_dense and not flex:  # K/V (and CIS) by block, once per call
            blocks = BlockSource.laid_out(keys, values, cis, sparse.block_size)
        pending, pending_from = [], 0  # row masks of chunks selected but not yet attended
        chunk = self.config.query_chunk_size
        if cache_layer.kernels.stage1:  # the fused kernel stores no [rows, C] scores: larger tiles pay
            chunk = max(chunk, STAGE1_QUERY_ROWS)
        for start in range(0, q.shape[1], chunk):
            rows = slice(start, start + chunk)
            pos = positions[:, rows]
            f_rows = None if forecast_in is None else forecast_in[:, rows]
            host = {"bounds": step.bounds(start, start + chunk), "key_count": count, "sparse": sparse}
            ids = rule.select(rule.rows(vectors, rows), pos, cache_layer, sparse, host["bounds"], count)
            if selections_out is not None:
                chunk_records: dict = {}
                self._record(chunk_records, q[:, rows], f_rows, pos, cache_layer, ids, rule, **host)
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
