"""`SparseCache`: the resident KV cache behind `generate()`, a transformers `Cache`.

The attention module talks to a cache layer through four calls (shared/DESIGN.md):

    layer.append(k, v, cis, positions)   # store new tokens, update compressed keys
    layer.compressed_keys()              # [B, C, H, d]
    layer.plan(selection)                # the blocks the next attention of this layer will read
    layer.blocks(selection)              # K/V (and bias) of those blocks, ready to attend

Storage is indexed by *position*, per sequence: token t of sequence b lives at row t of sequence b,
whatever column it came in.  Left padding (positions -1) is never stored, so every sequence of a
left-padded batch sees exactly the keys, compressed keys and blocks it would see alone.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .selection import compress_keys, num_compressed


def _grow(buffer: torch.Tensor | None, rows: int, like: torch.Tensor) -> torch.Tensor:
    """Return `buffer` with at least `rows` rows along dim 1 (doubling), zero-filled."""
    if buffer is not None and buffer.shape[1] >= rows:
        return buffer
    old = 0 if buffer is None else buffer.shape[1]
    capacity = max(rows, 2 * old, 64)
    grown = like.new_zeros((like.shape[0], capacity, *like.shape[2:]))
    if buffer is not None:
        grown[:, :old] = buffer
    return grown


class SparseCacheLayer(CacheLayerMixin):
    """One layer: K/V [B, S, H, d] (and NOSA's CIS [B, S, H]) by position, plus compressed keys.

    `lengths` [B] counts the stored positions of each sequence (they are contiguous from 0).
    """

    is_compileable = False
    is_sliding = False

    def __init__(self, kernel_size: int | None = None, kernel_stride: int | None = None, coarse: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.kernel = (kernel_size, kernel_stride) if kernel_size else None
        self.coarse = coarse
        self.cis: torch.Tensor | None = None
        self.ckeys: torch.Tensor | None = None
        self.coarse_keys: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        self.planned: torch.Tensor | None = None
        self.block_shares: list[float] = []  # per planned decode step: blocks read / blocks stored
        self.columns = 0  # input columns seen, padding included (what generate() slices by)

    # -- transformers' CacheLayerMixin -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.lengths = torch.zeros(key_states.shape[0], dtype=torch.long, device=key_states.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("SparseCacheLayer is written through append(k, v, cis, positions), not update()")

    def get_seq_length(self) -> int:
        return self.columns

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def reset(self) -> None:
        self.__init__(*(self.kernel or (None, None)), coarse=self.coarse)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for name in ("keys", "values", "cis", "ckeys", "coarse_keys", "lengths"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.index_select(0, beam_idx.to(tensor.device)))

    # -- the four calls --------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor, cis: torch.Tensor | None, positions: torch.Tensor) -> None:
        """Store new tokens.  keys/values [B, n, H, d], cis [B, n, H] or None, positions [B, n] (-1 = padding)."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self.columns += positions.shape[1]
        valid = positions >= 0
        if not bool(valid.any()):
            return
        new_lengths = torch.maximum(self.lengths, (positions + 1).amax(dim=1))
        rows = int(new_lengths.max())
        self.keys = _grow(self.keys, rows, keys)
        self.values = _grow(self.values, rows, values)
        batch_idx, col_idx = valid.nonzero(as_tuple=True)
        pos = positions[batch_idx, col_idx]
        self.keys[batch_idx, pos] = keys[batch_idx, col_idx]
        self.values[batch_idx, pos] = values[batch_idx, col_idx]
        if cis is not None:
            self.cis = _grow(self.cis, rows, cis)
            self.cis[batch_idx, pos] = cis[batch_idx, col_idx]
        old_lengths, self.lengths = self.lengths, new_lengths
        if self.kernel is not None:
            self.ckeys = self._extend_compressed(self.ckeys, self.kernel, old_lengths)
            if self.coarse is not None:
                self.coarse_keys = self._extend_compressed(self.coarse_keys, self.coarse, old_lengths)

    def _extend_compressed(self, ckeys: torch.Tensor | None, kernel: tuple[int, int], old_lengths: torch.Tensor) -> torch.Tensor:
        """Compute the windows completed by the last append (per sequence counts differ; windows
        past a sequence's own count hold partial data and are never visible to its queries)."""
        size, stride = kernel
        # num_compressed is monotonic in the length: the extremes bound every sequence's window range
        first = num_compressed(int(old_lengths.min()), size, stride)
        last = num_compressed(int(self.lengths.max()), size, stride)
        ckeys = _grow(ckeys, max(last, 1), self.keys[:, :1])
        if last > first:
            span = self.keys[:, first * stride : (last - 1) * stride + size]
            ckeys[:, first:last] = compress_keys(span, size, stride)
        return ckeys

    def compressed_keys(self) -> torch.Tensor:
        """[B, C, H, d]: compressed keys up to the longest sequence (visibility masks the rest)."""
        return self.ckeys[:, : num_compressed(int(self.lengths.max()), *self.kernel)]

    def coarse_compressed_keys(self) -> torch.Tensor | None:
        if self.coarse is None:
            return None
        return self.coarse_keys[:, : num_compressed(int(self.lengths.max()), *self.coarse)]

    def plan(self, selection: torch.Tensor, block_size: int | None = None) -> None:
        """Resident cache: nothing to move.  Remembers the plan and, given `block_size`, the share
        of this step's stored blocks it reads.  selection [B, H, K] (-1 = none)."""
        self.planned = selection
        if block_size is not None and self.lengths is not None:
            stored = (-(-self.lengths.clamp(min=1) // block_size)).sum() * selection.shape[1]
            self.block_shares.append(float((selection >= 0).sum()) / float(stored))

    def blocks(self, selection: torch.Tensor, block_size: int):
        """Gather selected blocks.  selection [B, H, K] (-1 = none) ->
        keys, values [B, H, K*bs, d], key positions [B, H, K*bs] (-1 = not a key), bias [B, H, K*bs] or None."""
        batch, heads, width = selection.shape
        offsets = torch.arange(block_size, device=selection.device)
        pos = (selection.clamp(min=0).unsqueeze(-1) * block_size + offsets).view(batch, heads, width * block_size)
        exists = (selection >= 0).repeat_interleave(block_size, dim=-1) & (pos < self.lengths.view(-1, 1, 1))
        index = pos.clamp(max=self.keys.shape[1] - 1)
        rows = torch.arange(batch, device=index.device).view(-1, 1, 1)
        heads_idx = torch.arange(heads, device=index.device).view(1, -1, 1)
        # advanced indexing copies whole d-rows (a gather over a transposed view is several x slower)
        keys, values = self.keys[rows, index, heads_idx], self.values[rows, index, heads_idx]
        bias = None if self.cis is None else self.cis[rows, index, heads_idx]
        return keys, values, pos.masked_fill(~exists, -1), bias

    # -- full views (prefill and dense paths) ----------------------------------------------------
    def full(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """K, V [B, S, H, d], CIS [B, S, H] or None, and S = the longest stored sequence."""
        rows = int(self.lengths.max())
        cis = None if self.cis is None else self.cis[:, :rows]
        return self.keys[:, :rows], self.values[:, :rows], cis, rows


class SparseCache(Cache):
    """Everything resident on the model's device; the default cache of `generate()`."""

    def __init__(self, config=None, num_layers: int | None = None) -> None:
        sparse = config.sparse if config is not None else None
        num_layers = num_layers if num_layers is not None else config.num_hidden_layers
        kernel = (sparse.kernel_size, sparse.kernel_stride) if sparse is not None else (None, None)
        coarse = sparse.coarse_kernel if sparse is not None and sparse.lse == "coarse" else None
        super().__init__(layers=[SparseCacheLayer(*kernel, coarse=coarse) for _ in range(num_layers)])

    def sequence_lengths(self) -> torch.Tensor | None:
        """[B] stored positions per sequence (None before the first token)."""
        return self.layers[0].lengths

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length()

    def stats(self) -> dict:
        """Sparse decode steps seen and the mean share of stored KV blocks they read, per layer and overall."""
        per_layer = [sum(layer.block_shares) / len(layer.block_shares) if layer.block_shares else None for layer in self.layers]
        seen = [share for share in per_layer if share is not None]
        return {
            "decode_steps": max((len(layer.block_shares) for layer in self.layers), default=0),
            "block_share_per_layer": per_layer,
            "block_share": sum(seen) / len(seen) if seen else None,
        }
