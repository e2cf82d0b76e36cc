"""forecastkv's cache-layer contract over a paged KV cache: what a serving engine (vLLM) stores.

A serving engine keeps every sequence's K/V in fixed-size pages of one pool per layer and hands
each forward call a block table (sequence -> its pages) and each sequence's stored length.
`PagedCacheLayer` reads and writes those pages, so `SparseAttention` (the same selection, the same
attention ops as `generate()`) runs unchanged on top of them.

forecastkv's window indexes (compressed keys, NOSA's pooled CIS, coarse keys) are kept
incrementally beside the pages in `LayerPages.windows`, one slot per compression window, filed
under the page that holds the window's *last* key: a window depends only on keys up to its end,
so a page shared by prefix caching (whose content is fixed by its whole prefix) shares its window
slots too, and a freed page's slots are overwritten as its next owner completes windows.

Shapes: P pages of `page` tokens, H KV heads, d head dim, B sequences, nb pages per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import kernels
from ..errors import ConfigError
from ..modeling import selection as sel
from ..modeling.cache import (
    CallInfo,
    SparseCache,
    SparseCacheLayer,
    WindowIndex,
    attend_gathered,
    block_rows,
    compress_windows,
    window_geometry,
    window_indexes,
    window_rows,
)


def check_page_geometry(page: int, sparse) -> None:
    """Raise a ConfigError unless pages of `page` tokens fit `sparse`'s geometry: a page must divide
    the selection block (so a block is whole pages) and hold whole strides of every window index
    (so each window has one slot in the page holding its last key)."""
    if isinstance(page, bool) or not isinstance(page, int) or page < 1:
        raise ConfigError(f"the KV page size (vLLM block_size) must be a positive integer, got {page!r}")
    if sparse is None:
        return
    if sparse.block_size % page:
        raise ConfigError(
            f"the KV page size (vLLM block_size={page}) must divide the selection block "
            f"(sparse_config.block_size={sparse.block_size}); use block_size={sparse.block_size} or a divisor of it"
        )
    strides = {"kernel_stride": sparse.kernel_stride}
    if sparse.lse == "coarse":
        strides["coarse_kernel stride"] = sparse.coarse_kernel[1]
    for name, stride in strides.items():
        if page % stride and stride % page:
            raise ConfigError(
                f"the KV page size (vLLM block_size={page}) and sparse_config {name}={stride} must divide one "
                "another (each window gets one slot in the page holding its last key)"
            )


def window_slots(page: int, stride: int) -> int:
    """Window slots per page: the windows (`stride` apart) whose last key a page can hold."""
    return max(page // stride, 1)


def slot_of(offsets: torch.Tensor, stride: int) -> torch.Tensor:
    """The slot of a window whose last key sits at `offsets` in its page (0 when stride >= page:
    at most one window ends in a page)."""
    return torch.div(offsets, stride, rounding_mode="floor")


@dataclass
class LayerPages:
    """One layer's paged storage.  keys/values [P, H, page, d] (views of the engine's KV pool);
    cis [P, H, page] (NOSA's per-token bias) or None; windows: index name -> [P, slots, H, ...] (in the
    index's dtype, fp32 for the pooled CIS; `window_slots`), the slot of a window ending at position e in
    page table[e // page] being `slot_of(e % page, stride)`; indexes: name -> the `WindowIndex` it stores
    (its window, source and pooling: the resident layer's own list, `window_indexes`)."""

    keys: torch.Tensor
    values: torch.Tensor
    cis: torch.Tensor | None = None
    windows: dict[str, torch.Tensor] = field(default_factory=dict)
    indexes: dict[str, WindowIndex] = field(default_factory=dict)

    @property
    def strides(self) -> dict[str, tuple[int, int]]:
        """Name -> (size, stride) of each window index."""
        return {name: (index.size, index.stride) for name, index in self.indexes.items()}

    @property
    def page(self) -> int:
        return self.keys.shape[2]

    @classmethod
    def around(cls, keys: torch.Tensor, values: torch.Tensor, sparse, nosa: bool) -> "LayerPages":
        """The window indexes (and CIS pages) for the K/V pages keys/values [P, H, page, d]."""
        pages, heads, page, dim = keys.shape
        check_page_geometry(page, sparse)
        indexes = {index.name: index for index in window_indexes(*window_geometry(sparse), cis=nosa)}
        windows = {}
        for name, index in indexes.items():
            tail = () if index.source == "cis" else (dim,)
            shape = (pages, window_slots(page, index.stride), heads, *tail)
            windows[name] = torch.zeros(shape, dtype=index.dtype or keys.dtype, device=keys.device)
        cis = torch.zeros((pages, heads, page), dtype=keys.dtype, device=keys.device) if nosa else None
        return cls(keys, values, cis, windows, indexes)


def page_slots(table: torch.Tensor, positions: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page id, offset) of positions [B, ...] of the sequences of block table [B, nb]; positions
    past a table's end read its last entry (the caller masks them)."""
    column = torch.div(positions.clamp(min=0), page, rounding_mode="floor").clamp(max=table.shape[1] - 1)
    pages = torch.gather(table, 1, column.reshape(table.shape[0], -1)).view_as(positions)
    return pages, positions.clamp(min=0) % page


class PagedCacheLayer(SparseCacheLayer):
    """`CacheLayer` over one layer's `LayerPages` for the B sequences of one engine call.

    table [B, nb] int64 page ids per sequence; lengths: stored positions per sequence before the
    call (host ints).  Selection, planning and the step logs are `SparseCacheLayer`'s; what is
    stored where is the pages'.  Only for this call: the engine owns the pages between calls."""

    def __init__(
        self,
        pages: LayerPages,
        table: torch.Tensor,
        lengths: list[int],
        sparse,
        block_size: int | None,
        tier=None,
        index: int = 0,
    ):
        kernel, coarse = window_geometry(sparse)
        super().__init__(*(kernel or (None, None)), coarse=coarse, block_size=block_size)
        self.pages, self.table = pages, table.to(pages.keys.device, torch.long)
        self.dtype, self.device = pages.keys.dtype, pages.keys.device
        self.kernels = kernels.kernel_set(self.device)
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=self.device)
        self.lengths_before = self.lengths  # what the call started from (the tier files slot maps by it)
        # nothing stored yet: the call is a prefill, as a fresh SparseCache's first call is
        self.host_lengths = list(lengths) if any(lengths) else None
        self.is_initialized = True
        # forecast-offload: the runtime that loads this layer's planned blocks (`serving/page_offload.py`)
        self.tier, self.index, self.decoding = tier, index, False

    def prepare(self, step: CallInfo, columns: int) -> None:
        super().prepare(step, columns)
        self.decoding = step.decode and not step.any_dense

    def _make_room(self, step: CallInfo) -> None:
        """The engine allocated the pages before the call: nothing to grow."""

    def _need_table(self, rows: int) -> None:
        page = self.pages.page
        if -(-rows // page) > self.table.shape[1]:
            raise ValueError(f"the block table holds {self.table.shape[1]} pages of {page}, not {rows} positions")

    # -- storing ------------------------------------------------------------------------------------
    def append(self, keys, values, cis, positions, step: CallInfo | None = None) -> None:
        """Store keys/values [B, n, H, d] (cis [B, n, H]) at positions [B, n] (-1 = padding) in their
        pages, then file the windows they complete (`_file_windows`)."""
        step = self.step_for(positions) if step is None else step
        if not step.prepared:
            self.prepare(step, positions.shape[1])
        self._need_table(max(step.lengths_after, default=0))
        valid = positions >= 0
        b_idx, col = valid.nonzero(as_tuple=True)
        pos = positions[b_idx, col]
        page_ids, offsets = page_slots(self.table[b_idx], pos.unsqueeze(1), self.pages.page)
        page_ids, offsets = page_ids[:, 0, None], offsets[:, 0, None]  # [N, 1] against heads [1, H]
        heads = torch.arange(keys.shape[2], device=keys.device).view(1, -1)
        rows = [keys[b_idx, col], values[b_idx, col], None if cis is None else cis[b_idx, col]]
        for pool, row in zip((self.pages.keys, self.pages.values, self.pages.cis), rows):
            if row is not None:
                pool[page_ids, heads, offsets] = row.to(pool.dtype)
        if self.tier is not None:
            self.tier.write_through(self.index, page_ids.view(-1), offsets.view(-1), *rows)
        old = self.lengths
        self.lengths = torch.tensor(step.lengths_after, dtype=torch.long, device=self.device)
        self._file_windows(old)

    def _file_windows(self, old_lengths: torch.Tensor) -> None:
        """Each window completed since old_lengths [B], pooled as `SparseCacheLayer._extend` pools it
        (`compress_windows` over the same rows), into its slot."""
        for name, index in self.pages.indexes.items():
            size, stride = index.size, index.stride
            ids, valid, rows = window_rows(old_lengths, self.lengths, size, stride)
            if not ids.shape[1]:
                continue
            source = self.pages.cis if index.source == "cis" else self.pages.keys
            gathered = self._rows(source, rows)  # [B, W * size, H, ...]
            local = torch.arange(rows.shape[1] * size, device=rows.device).view(1, rows.shape[1], size)
            windows = compress_windows(gathered, local.expand(rows.shape[0], -1, -1), index.dtype, reduce=index.reduce)
            end = ids * stride + size - 1
            page_ids, offsets = page_slots(self.table, end, self.pages.page)
            b, w = valid.nonzero(as_tuple=True)
            target = self.pages.windows[name]
            target[page_ids[b, w], slot_of(offsets[b, w], stride)] = windows[b, w].to(target.dtype)

    def _rows(self, source: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """source [P, H, page, ...] at positions [B, ...] -> [B, n, H, ...] (n = positions per sequence)."""
        page_ids, offsets = page_slots(self.table, positions, self.pages.page)
        flat_pages, flat_offsets = page_ids.reshape(page_ids.shape[0], -1), offsets.reshape(offsets.shape[0], -1)
        # advanced indices around the head slice: [B, n, H, ...]
        return source[flat_pages, :, flat_offsets]

    # -- reading --------------------------------------------------------------------------------------
    def _window_index(self, name: str, count: int) -> torch.Tensor:
        """The first `count` windows of index `name` per sequence [B, count, H, ...] (read from their
        slots; windows a sequence has not completed read a stale slot, which visibility masks)."""
        size, stride = self.pages.strides[name]
        end = torch.arange(count, device=self.device) * stride + size - 1
        page_ids, offsets = page_slots(self.table, end.expand(self.table.shape[0], -1), self.pages.page)
        return self.pages.windows[name][page_ids, slot_of(offsets, stride)]

    def compressed(self, key_count: int | None = None) -> tuple:
        """(compressed keys [B, C, H, d], coarse keys or None, pooled CIS [B, C, H] or None) up to the
        longest sequence (`SparseCacheLayer.compressed`)."""
        longest = self._longest(key_count)
        count = sel.num_compressed(longest, *self.kernel)
        ckeys = self._window_index("ckeys", count)
        coarse = None
        if self.coarse is not None:
            coarse = self._window_index("coarse_keys", sel.num_compressed(longest, *self.coarse))
        pooled = self._window_index("pooled_cis", count) if "pooled_cis" in self.pages.windows else None
        return ckeys, coarse, pooled

    def capacity_rows(self) -> int:
        return self._longest(None)

    def decode_index(self) -> tuple:
        return (*self.compressed(), self.capacity_rows())

    def key_bounds(self):
        raise ConfigError("the paged cache keeps no Quest block key bounds: serve with the query or forecast selector")

    def plan(self, selection: torch.Tensor):
        """`SparseCacheLayer.plan`; at a decode step with a host tier, the load of the blocks of
        selection [B, H, K] it misses starts here (a layer ahead under the forecast selector)."""
        plan = super().plan(selection)
        if self.tier is not None and self.decoding:
            self.tier.request(self.index, self.table, self.lengths_before, self.lengths, selection)
        return plan

    def decode_attention(self, q: torch.Tensor, plan) -> torch.Tensor:
        """One token per sequence, q [B, 1, Hq, d], over the planned blocks read from their pages ->
        [B, 1, Hq, d] (`attend_gathered`, as the resident layer's CPU path)."""
        if self.tier is not None:
            self.tier.wait(self.index)
        pos, exists = block_rows(plan.selection, self.block_size, self.lengths)  # [B, H, K*bs]
        page_ids, offsets = page_slots(self.table, pos, self.pages.page)
        heads = torch.arange(pos.shape[1], device=pos.device).view(1, -1, 1)
        missing = ~exists.unsqueeze(-1)
        k = self.pages.keys[page_ids, heads, offsets].masked_fill(missing, 0.0)
        v = self.pages.values[page_ids, heads, offsets].masked_fill(missing, 0.0)
        bias = None
        if self.pages.cis is not None:
            bias = self.pages.cis[page_ids, heads, offsets].masked_fill(~exists, 0.0)
        return attend_gathered(q, k, v, pos.masked_fill(~exists, -1), bias, self.lengths)

    def full(self) -> tuple:
        """(keys, values [B, S, H, d], cis [B, S, H] or None, S): every stored row, read from the pages;
        rows past a sequence's length are zero (a stale page row must not reach the softmax)."""
        rows = self._longest(None)
        positions = torch.arange(rows, device=self.device).expand(self.table.shape[0], -1)
        stale = (positions >= self.lengths.view(-1, 1)).unsqueeze(-1)
        keys = self._rows(self.pages.keys, positions).masked_fill(stale.unsqueeze(-1), 0.0)
        values = self._rows(self.pages.values, positions).masked_fill(stale.unsqueeze(-1), 0.0)
        cis = None if self.pages.cis is None else self._rows(self.pages.cis, positions).masked_fill(stale, 0.0)
        return keys, values, cis, rows


class PagedSparseCache(SparseCache):
    """A `SparseCache` whose layers are `PagedCacheLayer`s: one engine call's view of the pages.

    config: the model's; pages: one `LayerPages` per layer; table [B, nb] page ids per sequence;
    lengths: stored positions per sequence before the call (host ints); tier: a
    `serving/page_offload.py:PageOffload` (forecast-offload) or None."""

    def __init__(
        self, config, pages: list[LayerPages], table: torch.Tensor, lengths: list[int], selector=None, tier=None
    ):
        self._paged = (pages, table, list(lengths), tier)
        self.tier = tier
        super().__init__(config, selector=selector)

    def _make_layer(self, config, sparse, idx: int, max_length: int | None) -> PagedCacheLayer:
        pages, table, lengths, tier = self._paged
        block = sparse.block_size if sparse is not None else None
        return PagedCacheLayer(pages[idx], table, lengths, sparse, block, tier=tier, index=idx)

    def begin_call(self, positions: torch.Tensor, sparse, input_ids: torch.Tensor | None = None) -> CallInfo:
        step = super().begin_call(positions, sparse, input_ids)
        self._tier_step = self.tier is not None and step.decode and not step.any_dense
        if self._tier_step:
            self.tier.begin_decode()
        elif self.tier is not None:
            self.tier.forget(self._paged[1], torch.tensor(step.lengths_after))
        return step

    def finish_call(self) -> None:
        super().finish_call()
        if getattr(self, "_tier_step", False):
            pages, table, before, _ = self._paged
            self.tier.end_decode(
                self.layers[0].table, torch.tensor(before, device=table.device), self.layers[0].lengths
            )
