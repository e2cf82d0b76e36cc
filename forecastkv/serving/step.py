"""One serving-engine forward call of a forecastkv model over paged KV: flat tokens in, hidden states out.

An engine (vLLM) batches requests as one flat run of tokens: request r owns tokens
query_start[r] .. query_start[r+1] - 1, which continue its `seq_len - query_len` stored positions.
`forward_paged` runs them through `ForecastKVModel.forward` with a `PagedSparseCache` per group:
all one-token (decode) requests together, and all requests with more tokens (prefill chunks)
together, right-padded: every row is selected and attended by its own positions and key length,
as a batch is in `generate()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .paged import LayerPages, PagedSparseCache


@dataclass(frozen=True)
class EngineBatch:
    """The engine's description of one call (host ints): query_start [R + 1] token offsets,
    seq_lens [R] stored positions per request after the call, table [R, nb] page ids; device_seq_lens:
    the engine's own device tensor of seq_lens [R], or None (then made from the host ints).

    device_rule: a decode call decided on the device alone (`captured_decode`): seq_lens are upper
    bounds, and nothing is chosen from them."""

    query_start: list[int]
    seq_lens: list[int]
    table: torch.Tensor
    device_seq_lens: torch.Tensor | None = None
    device_rule: bool = False

    @classmethod
    def captured_decode(cls, table: torch.Tensor, device_seq_lens: torch.Tensor, bound: int) -> "EngineBatch":
        """A call of one token per request, every fact on the device, so that a CUDA graph captured at one
        call replays right at the next: table [R, nb] (its full width under graphs), device_seq_lens [R]
        (the stored positions after the call, at least 1; a request's first token, a one-token prompt,
        is a decode step on nothing stored).  bound: an upper bound of every seq_len (the host's checks:
        the table holds it, max_position_embeddings); no host int says which request is dense, how long
        a request is, or which is new."""
        requests = table.shape[0]
        return cls(list(range(requests + 1)), [bound] * requests, table, device_seq_lens, device_rule=True)

    @property
    def requests(self) -> int:
        return len(self.seq_lens)

    def query_len(self, r: int) -> int:
        return self.query_start[r + 1] - self.query_start[r]

    def stored_before(self, r: int) -> int:
        return self.seq_lens[r] - self.query_len(r)

    def is_decode(self, r: int) -> bool:
        """Request r stores one token on a stored sequence this call (any token of a `captured_decode`)."""
        return self.query_len(r) == 1 and (self.device_rule or self.stored_before(r) > 0)

    def decode_only(self) -> bool:
        """Every request decodes (request r's token at offset r)."""
        return all(map(self.is_decode, range(self.requests)))

    def groups(self) -> list[list[int]]:
        """Request ids per model call: the decode requests together (one token on a stored
        sequence), then the prefill chunks together (right-padded to the longest: each row keeps its
        own positions, key length and dense-or-sparse rule); requests with no token this call are skipped."""
        decode = [r for r in range(self.requests) if self.is_decode(r)]
        chunks = [r for r in range(self.requests) if self.query_len(r) > 0 and r not in decode]
        return [group for group in (decode, chunks) if group]


def forward_paged(
    model, token_ids: torch.Tensor, batch: EngineBatch, pages: list[LayerPages], selector: str | None = None, tier=None,
    reduce_heat=None,
) -> torch.Tensor:
    """Hidden states [N, hidden] (after the final norm) for the flat token_ids [N] of `batch`, whose
    K/V (and window indexes) go to and come from `pages` (one `LayerPages` per layer).

    model: a `ForecastKVModel` (the decoder stack); tier: forecast-offload's host tier
    (`serving/page_offload.py:PageOffload`) or None; reduce_heat: `PagedSparseCache`'s (tensor parallelism
    under a selector that carries blocks).  Rows of token_ids past the batch's last request
    (an engine's padding) come back as zeros."""
    out = torch.zeros(
        token_ids.shape[0], model.config.hidden_size, dtype=model.norm.weight.dtype, device=token_ids.device
    )
    for group in batch.groups():
        before = [batch.stored_before(r) for r in group]
        if batch.is_decode(group[0]):  # the decode group: positions come from the stored lengths (no mask)
            rows, table, device_before = decode_inputs(batch, group, token_ids.device)
            cache = PagedSparseCache(model.config, pages, table, before, selector=selector, tier=tier,
                                     device_lengths=device_before, reduce_heat=reduce_heat,
                                     device_rule=batch.device_rule)
            out[rows] = model(token_ids[rows].view(-1, 1), cache=cache)[0][:, 0]
            continue
        cache = PagedSparseCache(model.config, pages, batch.table[group], before, selector=selector, tier=tier,
                                 reduce_heat=reduce_heat)
        width = max(batch.query_len(r) for r in group)
        ids = torch.zeros(len(group), width, dtype=torch.long, device=token_ids.device)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(group):
            start, n = batch.query_start[r], batch.query_len(r)
            ids[row, :n] = token_ids[start : start + n]
            mask[row, :n] = 1
        # positions: each row continues its stored length (right padding is marked in the mask)
        hidden = model(ids, attention_mask=_full_mask(before, mask), cache=cache)[0]
        for row, r in enumerate(group):
            start, n = batch.query_start[r], batch.query_len(r)
            out[start : start + n] = hidden[row, :n]
    return out


def decode_inputs(batch: EngineBatch, group: list[int], device) -> tuple:
    """(the rows of the flat tokens, the block table, the device lengths before the call or None) of
    the decode requests `group`.  A decode-only call takes all three from the engine's own tensors (no
    index made from host numbers: a captured step would replay with the next call's values); a mixed
    call indexes its decode requests."""
    if batch.decode_only():
        lengths = None if batch.device_seq_lens is None else batch.device_seq_lens - 1
        return slice(0, batch.requests), batch.table, lengths
    rows = torch.tensor([batch.query_start[r] for r in group], device=device)
    return rows, batch.table[group], None


def _full_mask(before: list[int], new: torch.Tensor) -> torch.Tensor:
    """The 2-D attention mask [B, past + T] `ForecastKVModel.positions_for` reads: its new columns
    are `new` [B, T] (the stored part is not read)."""
    past = max(before, default=0)
    return torch.cat([torch.ones(new.shape[0], past, dtype=new.dtype, device=new.device), new], dim=1)
