"""forecastkv's cache-layer contract over a paged KV cache: what a serving engine (vLLM) stores.

A serving engine keeps every sequence's K/V in fixed-size pages of one pool per layer and hands
each forward call a block table (sequence -> its pages) and each sequence's stored length.
`PagedRows`, the `KVStore` of a `SparseCacheLayer` (`paged_layer`), reads and writes those pages,
so `SparseAttention` (the same selection, the same attention ops as `generate()`) runs unchanged on
top of them.

forecastkv's window indexes (compressed keys, NOSA's pooled CIS, coarse keys) are kept
incrementally beside the pages in `LayerPages.windows`, one slot per compression window, filed
under the page that holds the window's *last* key: a window depends only on keys up to its end,
so a page shared by prefix caching (whose content is fixed by its whole prefix) shares its window
slots too, and a freed page's slots are overwritten as its next owner completes windows.  The blocks
a carrying selector takes from one decode step to the next (`modeling/carry.py`) are kept the same
way, one slot per page (`LayerPages.carried`), under the page of the sequence's last stored token, and so are
the blocks a pinning selector pinned from the prompt (`modeling/pins.py`; `LayerPages.pinned`, per layer).  The
query rows a prompt's pins are read from may span its prefill chunks: each layer keeps the last rows of a
request's chunk until its next one (`LayerPages.pin_rows`, filed on the host by the page and position of its last
token).  A prompt served partly from the prefix cache pins from the rows it computes: the cached part's query rows
were another request's, and are not kept.

Shapes: P pages of `page` tokens, H KV heads, d head dim, B sequences, nb pages per sequence.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import kernels
from ..errors import ConfigError
from ..modeling import selection as sel
from ..modeling.cache import (
    CallInfo,
    Plan,
    SparseCache,
    SparseCacheLayer,
    WindowIndex,
    attend_gathered,
    block_rows,
    compress_windows,
    pool_rows,
    window_geometry,
    window_indexes,
    window_rows,
    windows_complete,
    zero_missing_,
)
from ..modeling.prefill import BlockSource
from ..selectors import get_selector


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


# prefill chunks whose last query rows a layer keeps for each request's next chunk (`LayerPages.pin_rows`; never
# fewer than one call's chunks): a request whose next chunk comes after more calls' chunks than this pins from
# that chunk's rows alone.  Each holds up to 32 query rows a layer (Llama-3-8B in bf16: 8 MiB over its layers),
# on the device beside the pages, outside what the engine profiled
KEPT_PIN_ROWS = 16


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
    cis [P, H, page] (NOSA's per-token bias) or None; windows: index name -> [P + 1, H, slots, ...] (in
    the index's dtype, fp32 for the pooled CIS; `window_slots`; heads outside the slots, so a head's
    windows are consecutive rows, what selection scores against), the slot of a window ending at
    position e in page table[e // page] being `slot_of(e % page, stride)`; indexes: name -> the `WindowIndex` it stores
    (its window, source and pooling: the resident layer's own list, `window_indexes`)."""

    keys: torch.Tensor
    values: torch.Tensor
    cis: torch.Tensor | None = None
    windows: dict[str, torch.Tensor] = field(default_factory=dict)
    indexes: dict[str, WindowIndex] = field(default_factory=dict)
    # attend(q, entries, lengths): an engine's kernel over these pages with `head_page_attention`'s
    # contract (its keys and values bound), which a decode step without NOSA's bias calls on the
    # selected pages instead of gathering them here
    attend: Callable | None = None
    # carried blocks (`modeling/carry.py`) between a sequence's calls, [P, count] int64 (-1: none): the ids
    # its last call left, under the page holding the last token it stored (`PagedSparseCache`); made on
    # first use, kept in one layer's pages (they are the model's, not a layer's)
    carried: torch.Tensor | None = None
    # pinned blocks (`modeling/pins.py`) of this layer, [P, H, count] int64 (-1: none), kept as `carried` is
    pinned: torch.Tensor | None = None
    # a prefill chunk's last query rows for the request's next chunk (a prompt's pins read its last rows):
    # (page id, position) of its last stored token -> (q [R, Hq, d], positions [R], that token's key [H, d],
    # which a later chunk finds on the page unless another request's rows replaced it); `KEPT_PIN_ROWS` at most
    pin_rows: OrderedDict = field(default_factory=OrderedDict)
    # the key [P, H, d] of the token the carried and pinned slots were kept under (layer 0's pages): a sequence
    # reads them only where its own last key is that key (`PagedSparseCache._read_slots`); NaN: never kept
    slot_keys: torch.Tensor | None = None

    def carried_slots(self, count: int) -> torch.Tensor:
        """`carried`, made (all -1) for `count` blocks a sequence if it holds another count."""
        if self.carried is None or self.carried.shape[1] != count:
            self.carried = self._no_blocks(count)
        return self.carried

    def pinned_slots(self, count: int) -> torch.Tensor:
        """`pinned`, made (all -1) for `count` blocks per KV head if it holds another count."""
        if self.pinned is None or self.pinned.shape[2] != count:
            self.pinned = self._no_blocks(self.keys.shape[1], count)
        return self.pinned

    def slot_keys_made(self) -> torch.Tensor:
        """`slot_keys`, made (all NaN: no key matches) on first use."""
        if self.slot_keys is None:
            shape = (self.keys.shape[0], self.keys.shape[1], self.keys.shape[3])
            self.slot_keys = torch.full(shape, float("nan"), dtype=self.keys.dtype, device=self.keys.device)
        return self.slot_keys

    def _no_blocks(self, *shape: int) -> torch.Tensor:
        return torch.full((self.keys.shape[0], *shape), -1, dtype=torch.long, device=self.keys.device)

    @property
    def strides(self) -> dict[str, tuple[int, int]]:
        """Name -> (size, stride) of each window index."""
        return {name: (index.size, index.stride) for name, index in self.indexes.items()}

    @property
    def page(self) -> int:
        return self.keys.shape[2]

    @classmethod
    def around(
        cls, keys: torch.Tensor, values: torch.Tensor, sparse, nosa: bool, attend: Callable | None = None
    ) -> "LayerPages":
        """The window indexes (and CIS pages) for the K/V pages keys/values [P, H, page, d]: Quest's block key
        bounds too where `sparse`'s selector scores them (one slot per block, under the page of its last key)."""
        pages, heads, page, dim = keys.shape
        check_page_geometry(page, sparse)
        bounds = (sparse.block_size,) * 2 if sparse is not None and get_selector(sparse.selector).key_bounds else None
        indexes = {index.name: index for index in window_indexes(*window_geometry(sparse), bounds, cis=nosa)}
        windows = {}
        for name, index in indexes.items():
            tail = () if index.source == "cis" else (dim,)
            # one scratch page past the pool's (id `pages`, in no block table): where a decode step's
            # sequences that complete no window write, so the step writes every row (`file_one`)
            shape = (pages + 1, heads, window_slots(page, index.stride), *tail)
            windows[name] = torch.zeros(shape, dtype=index.dtype or keys.dtype, device=keys.device)
        cis = torch.zeros((pages, heads, page), dtype=keys.dtype, device=keys.device) if nosa else None
        return cls(keys, values, cis, windows, indexes, attend)


def head_page_attention(
    keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, entries: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Attention of R rows over their own head pages, the reference of an engine's paged kernel
    (vLLM-CPU's `cpu_attention_with_kv_cache` with one KV head per row: `serving/vllm_model.py`).

    keys/values [P * H, page, d]: one entry per page and KV head (`head_pages`); q [R, G, d]: the G
    query heads of row r's KV head; entries [R, n]: row r's head pages in position order; lengths
    [R]: its keys, the first lengths[r] rows of those pages (at least one).  -> [R, G, d]."""
    rows, width = entries.shape
    page, dim = keys.shape[1], keys.shape[-1]
    k = keys.index_select(0, entries.reshape(-1)).view(rows, width * page, dim)
    v = values.index_select(0, entries.reshape(-1)).view(rows, width * page, dim)
    exists = torch.arange(width * page, device=q.device) < lengths.view(-1, 1)  # [R, n * page]
    zero_missing_(exists.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1))
    bias = torch.where(exists, 0.0, float("-inf")).to(q.dtype).unsqueeze(1)  # [R, 1, n * page]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def head_pages(pool: torch.Tensor) -> torch.Tensor | None:
    """pool [P, H, page, ...] as [P * H, page, ...] (one entry per page and head), or None where the
    layout has no such view (a CUDA backend's [2, P, page, H, d] pool puts heads inside the page)."""
    if pool.shape[0] > 1 and pool.stride(0) != pool.shape[1] * pool.stride(1):
        return None
    return pool.flatten(0, 1)


def head_entries(page_ids: torch.Tensor, heads: int) -> torch.Tensor:
    """page_ids [B, H, ...] (each head's pages; or [B, 1, ...], the same pages for every head) -> their
    entries [B, H, ...] in `head_pages`' [P * H, page, ...] view."""
    shape = (1, heads) + (1,) * (page_ids.dim() - 2)
    return page_ids * heads + torch.arange(heads, device=page_ids.device).view(shape)


def page_slots(table: torch.Tensor, positions: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page id, offset) of positions [B, ...] of the sequences of block table [B, nb]; positions
    past a table's end read its last entry (the caller masks them)."""
    column = torch.div(positions.clamp(min=0), page, rounding_mode="floor").clamp(max=table.shape[1] - 1)
    pages = torch.gather(table, 1, column.reshape(table.shape[0], -1)).view_as(positions)
    return pages, positions.clamp(min=0) % page


class CallIndexes:
    """Index tensors that every layer of one engine call computes alike (one block table, one set of
    positions and lengths): the first layer makes each, the others reuse it.  Storing a decode token
    and filing its window took 0.87 ms a layer at 8 x 8K with them made per layer, 0.35 ms shared."""

    def __init__(self) -> None:
        self._made: dict = {}

    def get(self, key, make: Callable):
        """The tensors stored under `key`, made by `make()` the first time (per call, never stale)."""
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]


@dataclass
class PagedWindows(WindowIndex):
    """A `WindowIndex` whose windows live in the pages' slots (`LayerPages.windows[name]`), read and
    filed through the call's block table [B, nb] (`PagedRows.table`): the same pooling (`compress_windows`
    over the same rows) as the resident index, another place to keep it."""

    rows: "PagedRows | None" = None

    @property
    def made(self) -> bool:
        return True

    def view(self, rows: int) -> torch.Tensor:
        """The first windows of `rows` positions per sequence [B, C, H, ...], read from their slots;
        windows a sequence has not completed read a stale slot, which visibility masks."""
        count = sel.num_compressed(rows, self.size, self.stride)
        store = self.rows
        page = store.pages.page
        if page % self.stride == 0:
            # window c ends in flat slot (page column x slots + slot) c + (size - 1) // stride of its
            # sequence: the windows are consecutive slots, read as whole pages by one index_select
            # ([B, H, C, ...] in memory, returned as the [B, C, H, ...] view: scores read a head's rows)
            slots, first = page // self.stride, (self.size - 1) // self.stride
            windows = store.pages.windows[self.name]
            heads = windows.shape[1]

            def entries():  # [B * H * n]
                page_ids = store.pages_at(torch.arange(-(-(first + count) // slots), device=store.table.device))
                return head_entries(page_ids.unsqueeze(1), heads).reshape(-1)

            ids = store.shared.get(("view", self.size, self.stride, count, heads), entries)
            whole = windows.flatten(0, 1).index_select(0, ids)  # [B * H * n, slots, ...]
            whole = whole.view(store.table.shape[0], heads, -1, *windows.shape[3:])[:, :, first : first + count]
            return whole.transpose(1, 2)

        def places():  # each window's page [B, C] and slot [B, C]
            end = torch.arange(count, device=store.table.device) * self.stride + self.size - 1
            page_ids, offsets = page_slots(store.table, end.expand(store.table.shape[0], -1), page)
            return page_ids, slot_of(offsets, self.stride)

        page_ids, slots = store.shared.get(("view slots", self.size, self.stride, count), places)
        return store.pages.windows[self.name][page_ids, :, slots]

    def whole(self, rows: int) -> torch.Tensor:
        """A paged index has no buffer of its own: the windows of the `rows` stored positions."""
        return self.view(rows)

    def file(self, old_lengths: torch.Tensor, lengths: torch.Tensor, one_token: bool = False) -> None:
        """Each window completed between old_lengths and lengths [B], pooled from the pages, into its
        slot.  one_token: every sequence stored one token (a decode step): `file_one`."""
        if one_token:
            return self.file_one(old_lengths, lengths)
        store, size, stride = self.rows, self.size, self.stride
        ids, valid, rows = window_rows(old_lengths, lengths, size, stride)
        if not ids.shape[1]:
            return
        source = store.pages.cis if self.source == "cis" else store.pages.keys
        gathered = store.rows_at(source, rows)  # [B, W * size, H, ...]
        local = torch.arange(rows.shape[1] * size, device=rows.device).view(1, rows.shape[1], size)
        windows = compress_windows(gathered, local.expand(rows.shape[0], -1, -1), self.dtype, reduce=self.reduce)
        end = ids * stride + size - 1
        page_ids, offsets = page_slots(store.table, end, store.pages.page)
        b, w = valid.nonzero(as_tuple=True)
        target = store.pages.windows[self.name]
        target[page_ids[b, w], :, slot_of(offsets[b, w], stride)] = windows[b, w].to(target.dtype)

    def file_one(self, old_lengths: torch.Tensor, lengths: torch.Tensor) -> None:
        """`file` for a step of one token per sequence, which completes at most one window each: fixed
        shapes, no host read (as the resident index's `extend_one`).  Every sequence pools its next
        window; one that did not complete it writes to the scratch page instead of its slot."""
        store, size, stride = self.rows, self.size, self.stride
        target = store.pages.windows[self.name]

        def places():  # the next window's rows (page, offset) [B, size] and its slot (page [B], slot [B])
            first, last = windows_complete(old_lengths, size, stride), windows_complete(lengths, size, stride)
            rows = first.unsqueeze(-1) * stride + torch.arange(size, device=first.device)  # [B, size]
            row_pages, row_offsets = page_slots(store.table, rows, store.pages.page)
            # the slot is the window's last row's; a sequence that completed none writes the scratch page
            scratch = torch.full_like(row_pages[:, -1], target.shape[0] - 1)
            page_ids = torch.where(last > first, row_pages[:, -1], scratch)
            return row_pages, row_offsets, page_ids, slot_of(row_offsets[:, -1], stride)

        row_pages, row_offsets, page_ids, slots = store.shared.get(("file_one", size, stride, target.shape[0]), places)
        source = store.pages.cis if self.source == "cis" else store.pages.keys
        gathered = store.rows_of(source, row_pages, row_offsets)  # [B, size, H, ...]
        window = pool_rows(gathered.movedim(1, -1), self.dtype, self.reduce)  # [B, H, ...]
        target[page_ids, :, slots] = window.to(target.dtype)

    def emptied(self) -> "PagedWindows":
        return self

    def forked(self, repeats: int = 1) -> "PagedWindows":
        raise NotImplementedError("an engine call's paged view is not forked: the engine shares its pages")

    def reordered(self, beam_idx: torch.Tensor) -> None:
        raise NotImplementedError("an engine call's paged view is not reordered: the engine owns its block tables")


class PagedRows:
    """The `KVStore` over one layer's `LayerPages` for the B sequences of one engine call.

    table [B, nb] int64 page ids per sequence; lengths_before [B]: stored positions per sequence
    before the call; tier: forecast-offload's `serving/page_offload.py:PageOffload` (loads this layer's
    planned blocks into the pages) or None; index: the layer's number; shared: the call's `CallIndexes`
    (one for every layer of the call).  Only for this call: the engine owns the pages between calls."""

    offloaded = False
    log = None
    d2h_bytes = h2d_other = 0

    def __init__(
        self, pages: LayerPages, table: torch.Tensor, tier=None, index: int = 0, shared: CallIndexes | None = None
    ) -> None:
        self.pages, self.table = pages, table.to(pages.keys.device, torch.long)
        self.tier, self.index, self.decoding = tier, index, False
        self.shared = CallIndexes() if shared is None else shared
        self.lengths_before: torch.Tensor | None = None

    def windows(self) -> list[PagedWindows]:
        """The layer's window indexes, kept in the pages."""
        return [PagedWindows(**vars(index), rows=self) for index in self.pages.indexes.values()]

    def emptied(self) -> "PagedRows":
        return self

    def allocate(self, layer, keys, cis) -> None:
        """The engine allocated the pages before the call."""

    def make_room(self, layer, step: CallInfo) -> None:
        """Nothing to grow (the engine allocated the pages before the call): the table must hold the
        call's positions (checked here, on the host side, before the layers run)."""
        self._need_table(max(step.lengths_after, default=0))
        self.decoding = step.decode and not step.any_dense

    def pages_at(self, columns: torch.Tensor) -> torch.Tensor:
        """The page ids [B, n] at block-table columns [n]; a column past the table reads its last page
        (rows the caller masks)."""
        return self.table[:, columns.clamp(max=self.table.shape[1] - 1)]

    def _need_table(self, rows: int) -> None:
        page = self.pages.page
        if -(-rows // page) > self.table.shape[1]:
            raise ValueError(f"the block table holds {self.table.shape[1]} pages of {page}, not {rows} positions")

    # -- storing ------------------------------------------------------------------------------------
    def append(self, layer, keys, values, cis, positions, step: CallInfo) -> None:
        """Store keys/values [B, n, H, d] (cis [B, n, H]) at positions [B, n] (-1 = padding) in their
        pages, then file the windows they complete (`PagedWindows.file`)."""
        if step.decode:  # one token per sequence, every one stored: no padding to find (no host read)
            b_idx, col = slice(None), 0
        else:
            b_idx, col = (positions >= 0).nonzero(as_tuple=True)

        def places():  # (page ids [N, 1], offsets [N, 1]) against heads [1, H]; the lengths after the call
            pos = positions[b_idx, col]
            page_ids, offsets = page_slots(self.table[b_idx], pos.unsqueeze(1), self.pages.page)
            heads = torch.arange(keys.shape[2], device=keys.device).view(1, -1)
            # a decode step's lengths from the device's (no host list baked into a captured step)
            after = (layer.lengths + 1 if step.decode
                     else torch.tensor(step.lengths_after, dtype=torch.long, device=self.table.device))
            return page_ids, offsets, heads, after

        # a decode step stores every sequence's one token: the same places in every layer
        page_ids, offsets, heads, after = self.shared.get("append", places) if step.decode else places()
        rows = [keys[b_idx, col], values[b_idx, col], None if cis is None else cis[b_idx, col]]
        for pool, row in zip((self.pages.keys, self.pages.values, self.pages.cis), rows):
            if row is not None:
                pool[page_ids, heads, offsets] = row.to(pool.dtype)
        if self.tier is not None:
            self.tier.write_through(self.index, page_ids.view(-1), offsets.view(-1), *rows)
        old = layer.lengths
        layer.lengths = after
        for window in layer.windows:
            window.file(old, layer.lengths, one_token=step.decode)

    def rows_at(self, source: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """source [P, H, page, ...] at positions [B, ...] -> [B, n, H, ...] (n = positions per sequence)."""
        return self.rows_of(source, *page_slots(self.table, positions, self.pages.page))

    @staticmethod
    def rows_of(source: torch.Tensor, page_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """source [P, H, page, ...] at (page_ids, offsets) [B, ...] (`page_slots`) -> [B, n, H, ...]."""
        flat_pages, flat_offsets = page_ids.reshape(page_ids.shape[0], -1), offsets.reshape(offsets.shape[0], -1)
        # advanced indices around the head slice: [B, n, H, ...]
        return source[flat_pages, :, flat_offsets]

    # -- reading --------------------------------------------------------------------------------------
    def capacity_rows(self, layer) -> int:
        """The positions the call's block table holds (an engine's table is max_model_len wide): what a
        decode step scores, at the same shapes from step to step (visibility masks the rest)."""
        return self.table.shape[1] * self.pages.page

    def plan(self, layer, selection: torch.Tensor) -> Plan:
        """The resident `Plan` (nothing to move on the device); at a decode step with a host tier, the
        load of the blocks of selection [B, H, K] it misses starts here (a layer ahead under a selector
        that plans ahead)."""
        stored = (-(-layer.lengths.clamp(min=1) // layer.block_size)).sum() * selection.shape[1]
        plan = Plan(selection, share=(selection >= 0).sum() / stored)
        if self.tier is not None and self.decoding:
            self.tier.request(self.index, self.table, self.lengths_before, layer.lengths, selection)
        return plan

    def record(self, layer, plan) -> None:
        """No step log: the engine's connector counts its own loads."""

    def decode_attention(self, layer, q: torch.Tensor, plan) -> torch.Tensor:
        """One token per sequence, q [B, 1, Hq, d], over the planned blocks read from their pages ->
        [B, 1, Hq, d]: by the engine's kernel where it has one (`attend_selected`), else gathered and
        attended here (`attend_gathered`, as the resident store's CPU path)."""
        if self.tier is not None:
            self.tier.wait(self.index)
        if self.pages.attend is not None and self.pages.cis is None:
            return self.attend_selected(layer, q, plan.selection)
        keys, values, positions, bias = self.blocks(layer, plan)
        return attend_gathered(q, keys, values, positions, bias if plan.cis_bias else None, layer.lengths)

    def blocks(self, layer, plan: Plan, with_values: bool = True) -> tuple:
        """The blocks of plan.selection [B, H, K] read from their pages -> keys, values [B, H, K*bs, d] (None
        unless with_values), key positions [B, H, K*bs] (-1 = not a key), NOSA's bias [B, H, K*bs] or None
        (the resident store's `blocks`): what a gathered decode attends and what carried blocks weigh
        (`carry.py`, keys only)."""
        pos, exists = block_rows(plan.selection, layer.block_size, layer.lengths)  # [B, H, K*bs]
        pools = (self.pages.keys, self.pages.values if with_values else None, self.pages.cis)
        k, v, bias = (None if pool is None else self.block_rows_of(pool, plan.selection, layer.block_size, pos)
                      for pool in pools)
        zero_missing_(exists, k, v, bias)  # the gathers are fresh copies
        return k, v, pos.masked_fill(~exists, -1), bias

    def attend_selected(self, layer, q: torch.Tensor, selection: torch.Tensor) -> torch.Tensor:
        """Decode attention by the engine's kernel (`LayerPages.attend`): each (sequence, KV head) a
        row whose pages are its selected blocks', ascending, so the current (partial) block, the
        highest id and always selected, comes last and its keys are the row's first.
        q [B, 1, Hq, d], selection [B, H, K] (-1: none) -> [B, 1, Hq, d]."""
        batch, heads, width = selection.shape
        block, page = layer.block_size, self.pages.page
        chosen = selection >= 0
        ordered = torch.where(chosen, selection, torch.iinfo(selection.dtype).max).sort(dim=-1).values
        per_block = block // page

        def lengths():  # each sequence's current block [B, 1, 1], the keys it lacks [B, 1], the page steps
            current = torch.div(layer.lengths - 1, block, rounding_mode="floor").view(-1, 1, 1)
            short = block - (layer.lengths.view(-1, 1) - current.view(-1, 1) * block)
            return current, short, torch.arange(per_block, device=q.device)

        current, short, steps = self.shared.get(("attend", block), lengths)
        columns = ordered.clamp(max=self.table.shape[1]).unsqueeze(-1) * per_block  # none: past the table
        columns = (columns + steps).clamp(max=self.table.shape[1] - 1).view(batch, -1)
        page_ids = torch.gather(self.table, 1, columns).view(batch, heads, width * per_block)
        entries = head_entries(page_ids, heads)
        keys = chosen.sum(-1) * block - (selection == current).any(-1) * short  # [B, H]
        group = q.shape[2] // heads
        out = self.pages.attend(q.reshape(batch * heads, group, -1), entries.view(batch * heads, -1), keys.view(-1))
        return out.view(q.shape)

    def block_rows_of(self, pool: torch.Tensor, selection: torch.Tensor, block_size: int, pos: torch.Tensor):
        """pool [P, H, page, ...] at the rows of the selected blocks, selection [B, H, K] (-1: none;
        pos [B, H, K*bs] = `block_rows`' positions) -> [B, H, K*bs, ...].  A block is whole pages
        (`check_page_geometry`), so this copies whole pages of one head by one flat `index_select`,
        not one row at a time; a pool with heads inside the page reads row by row."""
        flat = head_pages(pool)
        batch, heads, width = selection.shape
        if flat is None:
            page_ids, offsets = page_slots(self.table, pos, self.pages.page)
            return pool[page_ids, torch.arange(heads, device=pos.device).view(1, -1, 1), offsets]
        per_block = block_size // self.pages.page
        columns = selection.clamp(min=0).unsqueeze(-1) * per_block + torch.arange(per_block, device=pos.device)
        columns = columns.clamp(max=self.table.shape[1] - 1).view(batch, heads * width * per_block)
        page_ids = torch.gather(self.table, 1, columns).view(batch, heads, -1)
        entries = head_entries(page_ids, heads)
        return flat.index_select(0, entries.view(-1)).view(batch, heads, width * block_size, *pool.shape[3:])

    def full(self, layer, rows: int) -> tuple:
        """(keys, values [B, rows, H, d], cis [B, rows, H] or None): every stored row, read from the
        pages; rows past a sequence's length are zero (a stale page row must not reach the softmax)."""
        positions = torch.arange(rows, device=self.table.device).expand(self.table.shape[0], -1)
        stale = (positions >= layer.lengths.view(-1, 1)).unsqueeze(-1)
        keys = self.full_keys(layer, rows)
        values = self.first_rows(self.pages.values, positions).masked_fill(stale.unsqueeze(-1), 0.0)
        cis = None if self.pages.cis is None else self.first_rows(self.pages.cis, positions).masked_fill(stale, 0.0)
        return keys, values, cis

    def full_keys(self, layer, rows: int) -> torch.Tensor:
        """`full`'s keys alone: a pin window reads no value (`modeling/pins.py`)."""
        positions = torch.arange(rows, device=self.table.device).expand(self.table.shape[0], -1)
        stale = (positions >= layer.lengths.view(-1, 1)).unsqueeze(-1).unsqueeze(-1)
        return self.first_rows(self.pages.keys, positions).masked_fill(stale, 0.0)

    def block_source(self, layer) -> BlockSource | None:
        """The pages as the key blocks a prefill chunk attends (`BlockSource`): one piece per page and
        head, block j of sequence b the pages table[b, j * per : (j + 1) * per] (per = block / page), so
        a chunk copies only its rows' blocks.  Rows past a sequence's length are stale or never written:
        `chunked_sparse_attention` masks and zeroes them.  None where the pool puts heads inside the
        page (`head_pages`): then `full`."""
        keys, values = head_pages(self.pages.keys), head_pages(self.pages.values)
        if keys is None or values is None:
            return None
        bias = None if self.pages.cis is None else head_pages(self.pages.cis)
        heads, per = self.pages.keys.shape[1], layer.block_size // self.pages.page
        n_blocks = -(-layer.key_count() // layer.block_size)
        page_ids = self.pages_at(torch.arange(n_blocks * per, device=self.table.device))
        return BlockSource(keys, values, bias, head_entries(page_ids.view(-1, 1, n_blocks, per), heads))

    def first_rows(self, pool: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """pool [P, H, page, ...] at positions [B, n] = 0 .. n-1 of every sequence -> [B, n, H, ...]:
        the table's first pages whole (one flat `index_select`), or row by row where the pool has
        heads inside the page (`head_pages`)."""
        flat = head_pages(pool)
        if flat is None:
            return self.rows_at(pool, positions)
        batch, rows = positions.shape
        heads, page = pool.shape[1], self.pages.page
        count = -(-rows // page)
        page_ids = self.pages_at(torch.arange(count, device=positions.device))
        entries = page_ids.unsqueeze(-1) * heads + torch.arange(heads, device=positions.device)  # [B, count, H]
        gathered = flat.index_select(0, entries.view(-1)).view(batch, count, heads, page, *pool.shape[3:])
        return gathered.transpose(2, 3).reshape(batch, count * page, heads, *pool.shape[3:])[:, :rows]

    def crop(self, layer) -> None:
        raise NotImplementedError("an engine call's paged view is not cropped: the engine frees its pages")

    def reorder(self, beam_idx) -> None:
        raise NotImplementedError("an engine call's paged view is not reordered: the engine owns its block tables")

    def forked(self, layer, repeats: int):
        raise NotImplementedError("an engine call's paged view is not forked: the engine shares its pages")

    def device_tensors(self) -> dict:
        """None of its own: the pages are the engine's."""
        return {}

    def host_nbytes(self) -> int:
        return 0

    def block_bytes(self) -> int:
        return 0

    def missing_bounds(self) -> Exception:
        return ConfigError("these pages keep no Quest block key bounds (`check_paged_selector`)")


def check_paged_selector(rule, pages: "LayerPages") -> None:
    """Raise a ConfigError for a selector (`Selector` or None) that scores what `pages` do not keep: Quest's
    block key bounds (`Selector.key_bounds`), kept only where the pages were made for such a selector."""
    if rule is not None and rule.key_bounds and "block_lo" not in pages.indexes:
        raise ConfigError(
            f"selector {rule.name!r} scores Quest's block key bounds, which these pages were not made to keep "
            "(LayerPages.around keeps them for a sparse_config whose selector scores them)"
        )


def paged_layer(
    pages: LayerPages, table: torch.Tensor, lengths: list[int], sparse, tier=None, index: int = 0,
    shared: CallIndexes | None = None, device_lengths: torch.Tensor | None = None,
):
    """A `SparseCacheLayer` over one layer's pages (`PagedRows`) for the B sequences of one engine call:
    lengths are the stored positions per sequence before the call (host ints); device_lengths: the same
    [B] made on the device from the engine's own tensors (what a replayed graph sees), or None (made
    from the host ints); shared: the call's `CallIndexes`, one for all its layers."""
    store = PagedRows(pages, table, tier, index, shared)
    kernel, coarse = window_geometry(sparse)
    block = sparse.block_size if sparse is not None else None
    layer = SparseCacheLayer(*(kernel or (None, None)), coarse=coarse, block_size=block, store=store,
                             windows=store.windows())
    layer.dtype, layer.device = pages.keys.dtype, pages.keys.device
    layer.kernels = kernels.kernel_set(layer.device)
    layer.lengths = store.lengths_before = store.shared.get(
        "lengths",
        lambda: torch.tensor(lengths, dtype=torch.long, device=layer.device)
        if device_lengths is None else device_lengths.to(layer.device, torch.long),
    )
    # nothing stored yet: the call is a prefill, as a fresh SparseCache's first call is
    layer.host_lengths = list(lengths) if any(lengths) else None
    layer.is_initialized = True
    return layer


class PagedSparseCache(SparseCache):
    """A `SparseCache` whose layers keep their rows and window indexes in pages (`paged_layer`): one
    engine call's view of the pages.

    config: the model's; pages: one `LayerPages` per layer; table [B, nb] page ids per sequence;
    lengths: stored positions per sequence before the call (host ints); device_lengths: the same on the
    device, from the engine's tensors, or None; tier: a `serving/page_offload.py:PageOffload`
    (forecast-offload) or None; reduce_heat: for a selector that carries blocks on a tensor-parallel
    engine, the in-place max of a step's heat over the ranks (`CarriedBlocks.reduce`), else None.

    A selector that carries blocks (`modeling/carry.py`) keeps what each sequence carries between the
    engine's calls in the pages (`LayerPages.carried`), so its decode steps select as `generate()`'s do; one
    that pins blocks (`modeling/pins.py`) keeps each layer's pins there too (`LayerPages.pinned`), and the rows
    they are read from between a prompt's chunks (`LayerPages.pin_rows`).

    device_rule: a decode call decided on the device alone (what a captured CUDA graph replays): lengths
    are upper bounds for the host's checks, device_lengths the values, and MiniCPM's dense rule is taken
    per sequence on the device (`CallInfo.dense_rows`), not from the host ints.  Not with a host tier."""

    def __init__(
        self, config, pages: list[LayerPages], table: torch.Tensor, lengths: list[int], selector=None, tier=None,
        device_lengths: torch.Tensor | None = None, reduce_heat: Callable | None = None, device_rule: bool = False,
    ):
        if device_rule and (tier is not None or device_lengths is None):
            raise ValueError("a decode call decided on the device needs the engine's device lengths and no host tier")
        self._paged = (pages, table, list(lengths), tier, device_lengths)
        self.tier, self.shared, self.reduce_heat = tier, CallIndexes(), reduce_heat
        self.device_rule = device_rule
        self._before: tuple | None = None  # `_read_slots` as the call begins, once
        super().__init__(config, selector=selector)
        if pages:
            check_paged_selector(self.call_rule(config.sparse), pages[0])

    def call_info(self, positions: torch.Tensor, sparse) -> CallInfo:
        """The base's, but for a decode call under `device_rule`: every sequence's dense rule on the device
        (`CallInfo.dense_rows`; None where `dense_len` makes none dense), none on the host."""
        call = super().call_info(positions, sparse)
        if not (self.device_rule and call.decode and sparse is not None):
            return call
        dense = sel.dense_at(self.layers[0].lengths + 1, sparse) if sparse.dense_len > 0 else None
        never = (False,) * call.batch
        return dataclasses.replace(call, dense=never, any_dense=False, all_dense=False, dense_rows=dense)

    def _make_layer(self, config, sparse, idx: int, max_length: int | None) -> SparseCacheLayer:
        pages, table, lengths, tier, device_lengths = self._paged
        return paged_layer(pages[idx], table, lengths, sparse, tier=tier, index=idx, shared=self.shared,
                           device_lengths=device_lengths)

    def _carry_for(self, call: CallInfo, sparse) -> None:
        """The base's carried blocks, and for a sparse decode step the ids each sequence's last call left
        under the page of its last stored token (`LayerPages.carried`): a device gather, no host read."""
        super()._carry_for(call, sparse)
        if self._carry_call == "decode":
            carry = self.layers[0].carry
            carry.reduce = self.reduce_heat
            last, elsewhere = self._read_slots()
            none = elsewhere if self._carry_none is None else elsewhere | self._carry_none
            carry.ids = self.layers[0].store.pages.carried_slots(carry.count)[last].masked_fill(none.view(-1, 1), -1)

    def _pins_for(self, call: CallInfo, sparse) -> None:
        """The base's pinning, and what each sequence's last call left in the pages: for a decode step its
        pins (a device gather, no host read; none where another sequence left them, `_read_slots`), for a
        multi-token call the rows its last chunk pinned from (`LayerPages.pin_rows`)."""
        super()._pins_for(call, sparse)
        pinning = self.layers[0].pinning if self.layers else None
        self._pin_call = None if pinning is None else call
        if pinning is None:
            return
        if not call.decode:
            return self._take_pin_rows(list(call.lengths_before))
        last, elsewhere = self._read_slots()
        for layer in self.layers:
            layer.pinned = layer.store.pages.pinned_slots(pinning[0])[last].masked_fill(elsewhere.view(-1, 1, 1), -1)

    def _read_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the page [B] whose carried and pinned slots each sequence of a decode step reads, bool [B]: the
        sequences that read none, because another sequence left them): where the key those slots were kept under
        (`LayerPages.slot_keys`) is not the key at the sequence's last position.  That is a prompt served from
        the prefix cache but its last token (vLLM recomputes that one; where it opens a page it is a decode step
        on pages another request computed), and under `device_rule` a one-token prompt (nothing stored: its first
        page's leftovers).  Device ops only, once per call (as it begins)."""
        if self._before is None:
            pages = self.layers[0].store.pages
            ids, offsets = self._last_place()
            elsewhere = (pages.slot_keys_made()[ids] != pages.keys[ids, :, offsets]).flatten(1).any(1)
            self._before = (ids, elsewhere | (self._paged[4] == 0) if self.device_rule else elsewhere)
        return self._before

    def _carries_nothing(self, call: CallInfo) -> torch.Tensor | None:
        """The base's, and under `device_rule` the sequences storing their first token too (a one-token
        prompt: its last page's slot is another sequence's leftover, and alone its first call is a prefill,
        which carries nothing)."""
        nothing = super()._carries_nothing(call)
        if not self.device_rule:
            return nothing
        first = self._paged[4] == 0  # device_lengths: what each sequence stored before this call
        return first if nothing is None else nothing | first

    def _last_place(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(page [B], offset [B]) of each sequence's last stored token: its carried and pinned blocks are kept
        under that page (a first token's: its first page, offset 0)."""
        layer = self.layers[0]
        page_ids, offsets = page_slots(layer.store.table, (layer.lengths - 1).view(-1, 1), layer.store.pages.page)
        return page_ids.view(-1), offsets.view(-1)

    def _last_tokens(self, lengths: list[int]) -> list[tuple[int, int, int] | None]:
        """(page id, offset, position) of each sequence's last token at `lengths` stored positions (host ints;
        None for 0): one host read of the block table, made for a multi-token call that pins."""
        store = self.layers[0].store
        positions = torch.tensor([max(n - 1, 0) for n in lengths], device=store.table.device).view(-1, 1)
        pages, offsets = page_slots(store.table, positions, store.pages.page)
        places = zip(pages.view(-1).tolist(), offsets.view(-1).tolist(), lengths)
        return [(page, offset, n - 1) if n > 0 else None for page, offset, n in places]

    def _take_pin_rows(self, lengths: list[int]) -> None:
        """Each layer's `pin_rows` [B, R, ...] from the rows each sequence's previous chunk left
        (`LayerPages.pin_rows`, taken out): only where the page still holds that chunk's last key (a freed page
        another request refilled does not hand over its rows); None where no sequence has any."""
        places = self._last_tokens(lengths)
        for layer in self.layers:
            pages = layer.store.pages
            found = [None if place is None else pages.pin_rows.pop((place[0], place[2]), None) for place in places]
            found = [rows if rows is not None and torch.equal(rows[2], pages.keys[place[0], :, place[1]]) else None
                     for rows, place in zip(found, places)]
            kept = [rows for rows in found if rows is not None]
            if not kept:
                continue
            width = max(rows[0].shape[0] for rows in kept)
            q = kept[0][0].new_zeros((len(found), width, *kept[0][0].shape[1:]))
            positions = torch.full((len(found), width), -1, dtype=torch.long, device=q.device)
            for b, rows in enumerate(found):
                if rows is not None:
                    q[b, width - rows[0].shape[0]:], positions[b, width - rows[1].shape[0]:] = rows[0], rows[1]
            layer.pin_rows = (q, positions)

    def _keep_pin_rows(self, lengths: list[int]) -> None:
        """Each layer's `pin_rows` after a multi-token call, per sequence under the page and position of its
        last token (`LayerPages.pin_rows`), for its next chunk; the oldest beyond `KEPT_PIN_ROWS` (or this
        call's sequences, if more) dropped."""
        places = self._last_tokens(lengths)
        for layer in self.layers:
            if layer.pin_rows is None:
                continue
            pages, (q, positions) = layer.store.pages, layer.pin_rows
            for b, place in enumerate(places):
                if place is not None:
                    key = pages.keys[place[0], :, place[1]].clone()
                    pages.pin_rows[(place[0], place[2])] = (q[b].clone(), positions[b].clone(), key)
            while len(pages.pin_rows) > max(KEPT_PIN_ROWS, len(places)):
                pages.pin_rows.popitem(last=False)

    def begin_call(self, positions: torch.Tensor, sparse, input_ids: torch.Tensor | None = None) -> CallInfo:
        step = super().begin_call(positions, sparse, input_ids)
        self._tier_step = self.tier is not None and step.decode and not step.any_dense
        if self._tier_step:
            self.tier.begin_decode()
        elif self.tier is not None:
            self.tier.forget(self._paged[1], torch.tensor(step.lengths_after))
        return step

    def finish_call(self) -> None:
        carrying = getattr(self, "_carry_call", None) is not None
        super().finish_call()
        call, self._pin_call = getattr(self, "_pin_call", None), None
        if carrying or call is not None:  # the key the slots are kept under: the sequence's last (`_read_slots`)
            pages, (last, offsets) = self.layers[0].store.pages, self._last_place()
            pages.slot_keys_made()[last] = pages.keys[last, :, offsets]
        if carrying:  # what the next decode step of each sequence carries (-1s after any other call)
            carry = self.layers[0].carry
            pages.carried_slots(carry.count)[last] = carry.ids  # masked as the base's step ended (`_carries_nothing`)
        if call is not None:  # each layer's pins where the sequence's next call finds them
            for layer in self.layers:
                slots = layer.store.pages.pinned_slots(layer.pinning[0])
                slots[last] = -1 if layer.pinned is None else layer.pinned
            if not call.decode:
                self._keep_pin_rows(list(call.lengths_after))
        if getattr(self, "_tier_step", False):
            store = self.layers[0].store
            self.tier.end_decode(store.table, store.lengths_before, self.layers[0].lengths)

