"""`SparseCache`: the resident KV cache behind `generate()`, a transformers `Cache`, and the
contract every cache layer keeps with attention (`CacheLayer`).

Attention talks to a cache layer through six calls (and, for Quest's selectors, `key_bounds()`),
whatever tier holds the KV:

    layer.append(k, v, cis, positions, step)   # store new tokens, update the compressed keys
    layer.compressed(key_count)                # (compressed keys, coarse keys, pooled CIS): prefill scores these
    layer.decode_index()                       # the same at fixed shapes, for a decode step
    layer.plan(selection)                      # the blocks a decode attention of this layer will read: a `Plan`
    layer.decode_attention(q, plan)            # one token per sequence over those blocks
    layer.full()                               # every stored K/V (prefill, dense rows)

`SparseCacheLayer` keeps everything on the device; the offloaded runtime's layers
(`inference/layers.py`) keep the full KV on the host and implement the same calls.

Storage is indexed by *position*, per sequence: token t of sequence b lives at row t of sequence b,
whatever column it came in.  Left padding (positions -1) is never stored, so every sequence of a
left-padded batch sees exactly the keys, compressed keys and blocks it would see alone.

Capacity is preallocated (`max_length`) or grown in fixed chunks of `GROWTH_CHUNK` rows, so decoding
does not copy every layer's KV each time a power of two is crossed.

`CallInfo` holds the host-side facts of one forward call, fixed before any layer runs.  A decode
step adds exactly one token to every sequence, at its stored length, so everything a layer must
decide on the host (dense or sparse, how many keys and blocks exist, the positions' bounds)
follows from the cache's host counters: a decode step reads nothing back from the device.  A
multi-token call reads its positions to the host once, and every layer and query chunk takes its
bounds from that copy.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import kernels
from ..selectors import get_selector
from . import pins
from . import selection as sel
from .carry import CarriedBlocks
from .prefill import masked_attention
from .selection import num_compressed
from .token_record import note_call

GROWTH_CHUNK = 1024  # rows added per growth when no max_length was given


def capacity_for(rows: int, max_length: int | None, chunk: int = GROWTH_CHUNK, reserved: int | None = None) -> int:
    """Rows to allocate for `rows` stored rows: `max_length` if given (an error past it), else
    `reserved` (what generate() will store at most) while the rows fit in it, else
    `rows` rounded up to the next multiple of `chunk`."""
    if max_length is not None:
        if rows > max_length:
            raise ValueError(
                f"sequence of {rows} tokens exceeds this cache's max_length={max_length}; "
                "build the cache with a larger max_length"
            )
        return max_length
    if reserved is not None and rows <= reserved:
        return reserved
    return -(-rows // chunk) * chunk


def grow_rows(
    buffer: torch.Tensor | None,
    rows: int,
    like: torch.Tensor,
    max_length: int | None = None,
    chunk: int = GROWTH_CHUNK,
    reserved: int | None = None,
) -> torch.Tensor:
    """Return `buffer` with at least `rows` rows along dim 1, zero-filled; a new buffer is sized by
    `capacity_for` and shaped like `like` [B, *, ...] (its dtype and device)."""
    if buffer is not None and buffer.shape[1] >= rows:
        return buffer
    capacity = capacity_for(rows, max_length, chunk, reserved)
    grown = torch.zeros((like.shape[0], capacity, *like.shape[2:]), dtype=like.dtype, device=like.device)
    if buffer is not None:
        grown[:, : buffer.shape[1]] = buffer
    return grown


def windows_complete(lengths: torch.Tensor, size: int, stride: int) -> torch.Tensor:
    """How many compression windows (`size` keys, `stride` apart) lengths [B] stored keys complete."""
    return torch.where(lengths >= size, torch.div(lengths - size, stride, rounding_mode="floor") + 1, 0)


def window_rows(old_lengths: torch.Tensor, new_lengths: torch.Tensor, size: int, stride: int):
    """The compression windows completed between two lengths, per sequence.

    Returns (window ids [B, W], valid bool [B, W], key rows [B, W, size]) with W the most windows
    any sequence completed; each sequence computes only its own new windows.
    """
    first, last = windows_complete(old_lengths, size, stride), windows_complete(new_lengths, size, stride)
    width = int((last - first).max()) if last.numel() else 0
    ids = first.unsqueeze(1) + torch.arange(max(width, 0), device=first.device)
    valid = ids < last.unsqueeze(1)
    rows = ids.unsqueeze(-1) * stride + torch.arange(size, device=first.device)
    return ids, valid, rows


def compress_windows(
    source: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype | None = None, ring: bool = False, reduce="mean"
) -> torch.Tensor:
    """Mean of the key rows of each window.  source [B, S, H, ...], rows [B, W, size] -> [B, W, H, ...]
    (fp32 mean, cast to `dtype`, by default the source's, as `selection.compress_keys`).
    ring: source holds the latest S rows, row r at r % S (an offloaded layer's device ring).
    reduce "amin" / "amax": the per-channel min / max instead (Quest's block key bounds, exact)."""
    batch = torch.arange(source.shape[0], device=rows.device).view(-1, 1, 1)
    index = rows % source.shape[1] if ring else rows.clamp(max=source.shape[1] - 1)
    return pool_rows(source[batch, index].movedim(2, -1), dtype, reduce)  # [B, W, H, ..., size] pooled


def pool_rows(windows: torch.Tensor, dtype: torch.dtype | None = None, reduce="mean") -> torch.Tensor:
    """windows [..., size] (one window's rows on the last dim) -> [...]: `compress_windows`' pooling."""
    if reduce != "mean":
        return getattr(windows, reduce)(dim=-1).to(dtype or windows.dtype)
    return windows.float().mean(dim=-1).to(dtype or windows.dtype)


def write_windows(target: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, windows: torch.Tensor) -> None:
    """target[b, ids[b, w]] = windows[b, w] where valid.  target [B, C, ...]."""
    batch_idx, w_idx = valid.nonzero(as_tuple=True)
    target[batch_idx, ids[batch_idx, w_idx]] = windows[batch_idx, w_idx].to(target.device, target.dtype)


@dataclass
class WindowIndex:
    """One index a cache layer keeps by windows of its stored rows: the compressed keys, NOSA's pooled
    CIS, MiniCPM4.1's coarse keys, or one side of Quest's block bounds.  buffer [B, C, H, ...]: window c
    pools rows [c*stride, c*stride + size) of `source` ("keys" [B, S, H, d] or "cis" [B, S, H]) by
    `reduce` ("mean" in fp32, or the exact per-channel "amin" / "amax"), stored in `dtype` (None: the
    source's).  Only complete windows are written; the rest of the buffer is whatever it held (the
    selection's visibility masks it), so `crop` needs nothing here: windows past the new lengths are
    rewritten when they complete again.  One copy of append (`extend`, `extend_one`), grow (`grow_for`),
    fork (`forked`) and reorder (`reordered`) for every index of every tier."""

    name: str
    size: int
    stride: int
    source: str = "keys"
    reduce: str = "mean"
    dtype: torch.dtype | None = None
    buffer: torch.Tensor | None = None

    def windows(self, rows: int) -> int:
        """Buffer rows for the windows of `rows` positions (at least one, so an empty layer has a shape)."""
        return max(num_compressed(rows, self.size, self.stride), 1)

    def capacity(self, max_length: int | None, reserved: int | None) -> tuple[int | None, int | None]:
        """(max_length, reserved) counted in windows."""
        return (None if max_length is None else self.windows(max_length),
                None if reserved is None else self.windows(reserved))

    def fits(self, rows: int) -> bool:
        """Whether the buffer holds the windows of `rows` positions (an index not yet made: nothing to grow)."""
        return self.buffer is None or self.buffer.shape[1] >= self.windows(rows)

    def grow_for(self, rows: int, max_length: int | None, reserved: int | None) -> None:
        """Room for the windows of `rows` positions, in chunks worth GROWTH_CHUNK positions."""
        if self.buffer is not None:
            capacity, reserve = self.capacity(max_length, reserved)
            chunk = max(GROWTH_CHUNK // self.stride, 1)
            self.buffer = grow_rows(self.buffer, self.windows(rows), self.buffer, capacity, chunk, reserve)

    def extend(self, old_lengths, lengths, source, longest: int, max_length, reserved) -> None:
        """Write the windows completed between old_lengths and lengths [B] (each sequence its own, none
        twice), pooled from source [B, S, H, ...] (every stored row, any device); the buffer lands on
        the lengths' device, grown for `longest` positions."""
        ids, valid, rows = window_rows(old_lengths, lengths, self.size, self.stride)
        like = source[:, :1].to(lengths.device, self.dtype or source.dtype)
        capacity, reserve = self.capacity(max_length, reserved)
        chunk = max(GROWTH_CHUNK // self.stride, 1)  # chunks worth GROWTH_CHUNK positions, not windows
        self.buffer = grow_rows(self.buffer, self.windows(longest), like, capacity, chunk, reserve)
        if ids.shape[1]:
            pooled = compress_windows(source, rows.to(source.device), self.dtype, reduce=self.reduce)
            write_windows(self.buffer, ids, valid, pooled)

    def extend_one(self, old_lengths, lengths, source, ring: bool = False) -> None:
        """`extend` for a one-token step: each sequence completes at most one window.  Fixed shapes, no
        host read; source is the layer's rows by position, or a ring (`compress_windows`)."""
        size, stride, target = self.size, self.stride, self.buffer
        # windows complete before and after the step
        first, last = windows_complete(old_lengths, size, stride), windows_complete(lengths, size, stride)
        rows = (first.unsqueeze(-1) * stride + torch.arange(size, device=first.device)).unsqueeze(1)  # [B, 1, size]
        window = compress_windows(source, rows, self.dtype, ring, self.reduce)[:, 0]
        index = first.clamp(max=target.shape[1] - 1)
        batch = torch.arange(first.shape[0], device=first.device)
        done = (last > first).view(-1, *([1] * (window.dim() - 1)))
        target[batch, index] = torch.where(done, window.to(target.dtype), target[batch, index])

    @property
    def made(self) -> bool:
        """Whether it holds windows (an index of a source the layer does not store is never made)."""
        return self.buffer is not None

    def view(self, rows: int) -> torch.Tensor:
        """The windows complete within `rows` positions, [B, num_compressed(rows), H, ...]."""
        return self.buffer[:, : num_compressed(rows, self.size, self.stride)]

    def whole(self, rows: int) -> torch.Tensor | None:
        """The buffer whole as allocated (a decode step's fixed shape), or None; `rows`: the positions the
        store holds (what a store that reads its windows from elsewhere sizes them by)."""
        return self.buffer

    def emptied(self) -> "WindowIndex":
        """The same index with no buffer (a reset layer's)."""
        return dataclasses.replace(self, buffer=None)

    def forked(self, repeats: int = 1) -> "WindowIndex":
        """A copy whose buffer is its own: each sequence repeated `repeats` times."""
        buffer = self.buffer
        if buffer is not None:
            buffer = buffer.repeat_interleave(repeats, dim=0) if repeats > 1 else buffer.clone()
        return dataclasses.replace(self, buffer=buffer)

    def reordered(self, beam_idx: torch.Tensor) -> None:
        """Sequences reordered by beam_idx [B] (beam search)."""
        if self.buffer is not None:
            self.buffer = self.buffer.index_select(0, beam_idx.to(self.buffer.device))


def window_indexes(kernel, coarse=None, bounds=None, cis: bool = True) -> list[WindowIndex]:
    """The window indexes of a layer with compression window kernel (size, stride) (None: a dense layer,
    none), MiniCPM4.1's coarse window or None, Quest's block window (bs, bs) or None, and NOSA's CIS:
    the compressed keys, the pooled CIS (fp32, as `selection` pools it), the coarse keys, the block
    key min and max.  The one list every tier keeps (the resident and offloaded layers, the pages)."""
    if kernel is None:
        return []
    indexes = [WindowIndex("ckeys", *kernel)]
    if cis:
        indexes.append(WindowIndex("pooled_cis", *kernel, source="cis", dtype=torch.float32))
    if coarse is not None:
        indexes.append(WindowIndex("coarse_keys", *coarse))
    if bounds is not None:
        indexes += [WindowIndex("block_lo", *bounds, reduce="amin"), WindowIndex("block_hi", *bounds, reduce="amax")]
    return indexes


def window_geometry(sparse) -> tuple:
    """(kernel (size, stride), coarse window or None) of a SparseConfig; (None, None) for a dense model:
    the one place a layer's window geometry is read from the config."""
    if sparse is None:
        return None, None
    coarse = tuple(sparse.coarse_kernel) if sparse.lse == "coarse" else None
    return (sparse.kernel_size, sparse.kernel_stride), coarse


def new_rows(lengths: torch.Tensor, positions: torch.Tensor):
    """Where an append's tokens go: (batch_idx [N], col_idx [N], pos [N], new lengths [B], rows = the
    longest new length) for the N non-padding tokens of positions [B, n], or None if all are padding."""
    valid = positions >= 0
    if not bool(valid.any()):
        return None
    new_lengths = torch.maximum(lengths, (positions + 1).amax(dim=1))
    batch_idx, col_idx = valid.nonzero(as_tuple=True)
    return batch_idx, col_idx, positions[batch_idx, col_idx], new_lengths, int(new_lengths.max())


@dataclass(frozen=True)
class CallInfo:
    """The host-side facts of one forward call.  lengths_before / lengths_after: stored positions
    per sequence before and after the call; positions: the call's positions as a CPU int64 [B, T]
    copy (None for a decode step, whose positions are lengths_before); dense: per sequence, whether
    it attends densely in this call (`selection.dense_at`); stores: whether it stores a token.
    decode, any_dense (a sequence storing a token attends densely), all_dense and key_count (the
    longest sequence after the call: rows any layer holds): fields, not properties, so a decode step
    reads them without a call."""

    lengths_before: tuple[int, ...]
    lengths_after: tuple[int, ...]
    positions: torch.Tensor | None
    dense: tuple[bool, ...]
    stores: tuple[bool, ...]
    decode: bool
    any_dense: bool
    all_dense: bool
    key_count: int
    prepared: bool = False  # the cache did this call's host bookkeeping already (`SparseCache.begin_call`)
    # a decode step whose dense rule is decided on the device (an engine's captured step, `PagedSparseCache`):
    # bool [B], the sequences attending every block (`selection.dense_at` of their lengths); the host's
    # `dense` is then all False, its lengths upper bounds
    dense_rows: torch.Tensor | None = None

    @classmethod
    def for_decode(cls, lengths, sparse) -> "CallInfo":
        """One token per sequence at position lengths[b] (no device read)."""
        before = tuple(lengths)
        after = tuple([n + 1 for n in before])  # lists, not generators: no call per sequence
        dense = tuple([sel.dense_at(n, sparse) for n in after])
        return cls(
            before, after, None, dense, (True,) * len(before), True, any(dense), all(dense), max(after, default=0)
        )

    @classmethod
    def from_positions(cls, positions: torch.Tensor, lengths, sparse) -> "CallInfo":
        """A multi-token call: positions [B, T] (-1 = padding) read to the host once."""
        host = positions.detach().to("cpu", torch.int64)
        last = host.amax(dim=1).tolist() if host.shape[1] else [-1] * host.shape[0]
        before = tuple(int(n) for n in lengths) if lengths is not None else (0,) * host.shape[0]
        after = tuple(max(n, p + 1) for n, p in zip(before, last))
        dense = tuple(sel.dense_at(p + 1, sparse) for p in last)
        stores = tuple(p >= 0 for p in last)
        any_dense = any(d and s for d, s in zip(dense, stores))
        return cls(before, after, host, dense, stores, False, any_dense, all(dense), max(after, default=0))

    @property
    def batch(self) -> int:
        return len(self.lengths_after)

    def bounds(self, start: int = 0, stop: int | None = None) -> tuple[int, int]:
        """(lowest, highest) position of the call's rows [start, stop), padding (-1) included."""
        if self.positions is None:
            return min(self.lengths_before), max(self.lengths_before)
        rows = self.positions[:, start:stop]
        if rows.numel() == 0:
            return -1, -1
        return int(rows.min()), int(rows.max())

    def contiguous(self) -> bool:
        """Every sequence's rows are the positions key_count - T .. key_count - 1 (no padding, one
        common start): what FlexAttention's one `start` needs."""
        rows = 1 if self.positions is None else self.positions.shape[1]
        start = self.key_count - rows
        if start < 0:
            return False
        if self.positions is None:
            return all(n == start for n in self.lengths_before)
        return bool((self.positions == torch.arange(start, self.key_count)).all())


@dataclass
class Plan:
    """What one layer's next decode attention reads, made by `plan()` once per layer and step and
    handed to the attention that consumes it (as an argument: nothing is matched by address).

    selection [B, H, K] int64 block ids (-1 = none); share: a device scalar, blocks read / blocks
    stored (resident layers' `SparseCache.stats`).  The offloaded runtime adds its slot map and
    fetch in a subclass (`inference/layers.py:RuntimePlan`)."""

    selection: torch.Tensor
    share: torch.Tensor | None = None
    cis_bias: bool = True  # NOSA's CIS bias added (False: a dense row's attention under dense_cis_bias false)
    counts: torch.Tensor | None = None  # device int64 [3]: blocks wanted / hit / missed (a runtime's step log)
    h2d_extra: int = 0  # bytes moved outside the block gather (dense-offload's whole-layer copy)


class CacheLayer(Protocol):
    """The contract between `SparseAttention` and one layer of a cache.  Shapes: B sequences, H KV
    heads, Hq query heads, d head dim, n new columns, C compressed keys, K selected blocks.

    `host_lengths`: stored positions per sequence on the host (None before the first token);
    `lengths`: the same on the device, int64 [B]; `is_initialized`: it holds a token; `device`: where
    its device tensors live (once initialized); `kernels`: the kernel choices for that device (a
    selector scores with them).  Attention, the decoder loop and the selectors use nothing else
    (tests/modeling/test_cache_contract.py reads them for it)."""

    host_lengths: list[int] | None
    lengths: torch.Tensor | None
    is_initialized: bool
    device: torch.device
    kernels: kernels.KernelSet | None
    pinning: tuple | None  # (blocks per KV head, SparseConfig) this call pins with (`pins.py`), or None
    pinned: torch.Tensor | None  # int64 [B, H, pins] the prompt pinned (-1: none), or None
    pin_rows: tuple | None  # (q [B, R, Hq, d], positions [B, R]): the rows pins are read from (`pins.py`), or None

    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        cis: torch.Tensor | None,
        positions: torch.Tensor,
        step: CallInfo | None = None,
    ) -> None:
        """Store keys/values [B, n, H, d] and NOSA's cis [B, n, H] (or None) at positions [B, n]
        (-1 = padding), and the compression windows they complete."""

    def compressed(self, key_count: int | None = None) -> tuple:
        """(compressed keys [B, C, H, d], coarse keys [B, C', H, d] or None, pooled CIS fp32
        [B, C, H] or None) up to the longest sequence (`key_count` when given: no host read)."""

    def decode_index(self) -> tuple:
        """The same three at the fixed shapes a decode step scores (whole buffers; visibility masks
        what is not complete yet), and the positions they span."""

    def plan(self, selection: torch.Tensor) -> Plan:
        """The `Plan` for selection [B, H, K] (-1 = none); a runtime layer starts its fetch here."""

    def decode_attention(self, q: torch.Tensor, plan: Plan, observe: bool = True) -> torch.Tensor:
        """One token per sequence, q [B, 1, Hq, d], over the planned blocks -> [B, 1, Hq, d]; observe: the
        plan is the step's selection (what carried blocks weigh)."""

    def full(self) -> tuple:
        """(keys, values [B, S, H, d], cis [B, S, H] or None, S): every stored row on the device."""

    def observe_rows(self, q: torch.Tensor, selection: torch.Tensor, keys: torch.Tensor, cis) -> None:
        """A decode step that attended from every stored row (keys, cis: `full()`): its selection [B, H, K]'s
        share of the attention, for carried blocks (`carry.py`)."""

    def pin_window(self, q: torch.Tensor, positions: torch.Tensor) -> None:
        """After a multi-token call of q [B, T, Hq, d] at positions [B, T] under `pinning`: `pinned` from the
        last rows' attention over every stored key, those of `pin_rows` and this call's (`pins.py`)."""

    def key_count(self) -> int:
        """S: the longest stored sequence (a host int, no read)."""

    def capacity_rows(self) -> int:
        """Positions per sequence a decode step may score (a host int that stays fixed while decoding)."""

    def call_indexes(self):
        """The index tensors every layer of this call computes alike, made once for the call (an
        engine call's `serving/paged.py:CallIndexes`), or None: each layer makes its own."""

    def block_source(self):
        """The stored rows as key blocks read in place (`modeling/prefill.py:BlockSource`: an engine's
        pages), or None where only `full()` gives them."""

    def key_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Quest's index: per complete block the per-channel min and max key [B, NBc, H, d] (a layer
        built for a selector whose `key_bounds` is set; others raise)."""


class KVStore(Protocol):
    """Where one layer's K/V rows (and NOSA's CIS) live, and the calls that read them: the part of a
    `SparseCacheLayer` that differs between tiers.  `ResidentRows` (the device), the offloaded
    runtime's `inference/layers.py:OffloadedRows` (pinned host blocks, device slots, a side-stream
    fetch) and an engine's pages (`serving/paged.py:PagedRows`).  `layer` is the `SparseCacheLayer`
    that owns the store: its lengths, host counters, window indexes and settings.  Counters:
    `log` (a `StepLog` or None), `d2h_bytes`, `h2d_other`.  shared: the call's index tensors that every
    layer computes alike (`serving/paged.py:CallIndexes`), or None (each layer makes its own)."""

    offloaded: bool
    shared: object | None

    def emptied(self) -> "KVStore":
        """The same kind of store, holding nothing (a reset layer's)."""

    def allocate(self, layer, keys: torch.Tensor, cis: torch.Tensor | None) -> None:
        """Before the first rows, keys [B, n, H, d] and cis [B, n, H] or None (their batch and shapes)."""

    def make_room(self, layer, step: CallInfo) -> None:
        """The host side of a call, before the layer runs: room for its rows."""

    def append(self, layer, keys, values, cis, positions: torch.Tensor, step: CallInfo) -> None:
        """Store the rows at positions [B, n], set `layer.lengths`, and extend the layer's window indexes
        (`SparseCacheLayer.extend_windows`, `.advance`)."""

    def capacity_rows(self, layer) -> int:
        """Positions per sequence a decode step may score."""

    def plan(self, layer, selection: torch.Tensor) -> Plan:
        """The `Plan` of selection [B, H, K]; a runtime store starts its fetch here."""

    def record(self, layer, plan: Plan | None) -> None:
        """After the call: the plan's counters into the step log."""

    def decode_attention(self, layer, q: torch.Tensor, plan: Plan) -> torch.Tensor:
        """One token per sequence, q [B, 1, Hq, d], over the planned blocks -> [B, 1, Hq, d]."""

    def full(self, layer, rows: int) -> tuple:
        """(keys, values [B, rows, H, d], cis [B, rows, H] or None) on the device."""

    def full_keys(self, layer, rows: int) -> torch.Tensor:
        """The keys of `full` alone, [B, rows, H, d] (what a pin window scores: `pins.py`)."""

    def block_source(self, layer):
        """The rows as key blocks read in place (`modeling/prefill.py:BlockSource`), or None."""

    def crop(self, layer) -> None:
        """After the layer dropped trailing positions."""

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Sequences reordered by beam_idx [B] (beam search)."""

    def forked(self, layer, repeats: int) -> "KVStore":
        """An independent copy, each sequence repeated `repeats` times, with fresh counters."""

    def device_tensors(self) -> dict:
        """Name -> the device tensors holding rows (what `device_nbytes` counts)."""

    def host_nbytes(self) -> int:
        """Bytes of host memory it holds."""

    def block_bytes(self) -> int:
        """Bytes one (sequence, head) block moves host -> device (0: nothing moves)."""

    def missing_bounds(self) -> Exception:
        """The error of a `key_bounds()` call on a layer built without Quest's bounds."""


def put_rows(writes, valid: torch.Tensor) -> None:
    """For each (buffer, rows, new) of `writes` (new None: skipped): buffer[b, rows[b]] = new[b] where
    valid[b] (else the row keeps its value): one row per sequence, so no two writes meet.
    buffer [B, R, ...], rows [B], new [B, ...], valid bool [B].  One call for a decode step's writes."""
    batch = None
    for buffer, rows, new in writes:
        if new is None:
            continue
        if batch is None:
            batch = torch.arange(buffer.shape[0], device=buffer.device)
        keep = valid.view(-1, *([1] * (new.dim() - 1)))
        buffer[batch, rows] = torch.where(keep, new.to(buffer.dtype), buffer[batch, rows])


def columns_to_remove(tokens: int, columns: int) -> int:
    """transformers' crop argument -> columns to drop.  Negative: drop that many (5.24); positive:
    keep that many (the legacy absolute form); 0: nothing."""
    if tokens < 0:
        return min(-tokens, columns)
    if tokens == 0:
        return 0
    return max(columns - tokens, 0)


def _buffer(index: dict, name: str) -> torch.Tensor | None:
    """The buffer of window index `name` in a layer's `index`, None when it keeps none or has none yet."""
    window = index.get(name)
    return None if window is None else window.buffer


class StepLog:
    """Per decode step of one layer: blocks wanted / hit / missed (device int64 [3], summed over
    sequences and heads: no host sync) and bytes moved that the host already knows.  Kept by the
    offloaded runtime's stores (`ResidentRows(counted=True)`, `inference/layers.py:OffloadedRows`)."""

    def __init__(self, recording: bool = False) -> None:
        self.counts: list[torch.Tensor] = []
        self.h2d_extra: list[int] = []  # bytes outside the block gather (dense-offload's whole-layer copy)
        # (selection, complete blocks) per plan while recording (`record_selections`), else None
        self.selections: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if recording else None

    def add(self, counts: torch.Tensor, h2d_extra: int = 0) -> None:
        self.counts.append(counts)
        self.h2d_extra.append(h2d_extra)

    def record(self, selection: torch.Tensor, lengths: torch.Tensor, block_size: int) -> None:
        """Keep a plan's selection and the complete blocks it saw (while recording: the caller checks)."""
        complete = torch.div(lengths, block_size, rounding_mode="floor")
        self.selections.append((selection.clone(), complete.clone()))

    def fresh(self) -> "StepLog":
        """An empty log that records if this one does (a reset or forked layer's)."""
        return StepLog(self.selections is not None)

    def table(self) -> torch.Tensor:
        """int64 [steps, 3] on the CPU (one sync)."""
        if not self.counts:
            return torch.zeros(0, 3, dtype=torch.long)
        return torch.stack(self.counts).cpu()


class ResidentRows:
    """The resident `KVStore`: K/V [B, S, H, d] (and NOSA's CIS [B, S, H]) on the device, row = position,
    grown in chunks or preallocated (`capacity_for`).  counted: keep the offloaded runtime's counters
    (`log`, `d2h_bytes`, `h2d_other`: a runtime's resident layer, where every wanted block is a hit).

    A store holds rows and runs the calls that read them; the layer that owns it (`SparseCacheLayer`,
    passed as `layer`) holds the lengths, the window indexes and the settings."""

    offloaded = False
    shared = None

    def __init__(self, counted: bool = False, recording: bool = False) -> None:
        self.keys = self.values = self.cis = None
        self.log = StepLog(recording) if counted else None
        self.d2h_bytes = self.h2d_other = 0

    def emptied(self) -> "ResidentRows":
        """The same kind of store holding nothing (a reset layer's)."""
        return ResidentRows(self.log is not None, self.log is not None and self.log.selections is not None)

    # -- storing ---------------------------------------------------------------------------------
    def allocate(self, layer, keys: torch.Tensor, cis: torch.Tensor | None) -> None:
        """Nothing before the first rows: the buffers are sized when they come."""

    def make_room(self, layer, step: CallInfo) -> None:
        """Room for a decode step's token in every buffer (a multi-token call grows its own)."""
        if step.decode and self.keys is not None:
            rows = layer.columns
            for name in ("keys", "values", "cis"):
                buffer = getattr(self, name)
                if buffer is not None:
                    setattr(self, name, grow_rows(buffer, rows, buffer, layer.max_length, reserved=layer.reserved))
            layer.grow_windows_for(rows)

    def append(self, layer, keys, values, cis, positions, step: CallInfo) -> None:
        """Store keys/values [B, n, H, d], cis [B, n, H] or None at positions [B, n] (-1 = padding).

        A decode step writes without host syncs: `make_room` made room for its token, and a padding
        row writes back what it read, so no row selection is needed."""
        if step.decode and self.keys is not None:
            pos = positions[:, 0]
            valid, index = pos >= 0, pos.clamp(min=0)
            put_rows(
                ((self.keys, index, keys[:, 0]), (self.values, index, values[:, 0]),
                 (self.cis, index, None if cis is None else cis[:, 0])),
                valid,
            )  # fmt: skip
            layer.advance(pos, valid, self.keys, self.cis)
            return
        new = new_rows(layer.lengths, positions)
        if new is None:
            return
        batch_idx, col_idx, pos, new_lengths, rows = new
        for name, source in (("keys", keys), ("values", values), ("cis", cis)):
            if source is not None:
                buffer = grow_rows(getattr(self, name), rows, source, layer.max_length, reserved=layer.reserved)
                buffer[batch_idx, pos] = source[batch_idx, col_idx]
                setattr(self, name, buffer)
        old_lengths, layer.lengths = layer.lengths, new_lengths
        layer.extend_windows(old_lengths, self.keys, self.cis)

    def capacity_rows(self, layer) -> int:
        """Positions per sequence the buffers hold now (what a decode step may score)."""
        return 0 if self.keys is None else self.keys.shape[1]

    # -- reading -----------------------------------------------------------------------------------
    def plan(self, layer, selection: torch.Tensor) -> Plan:
        """Nothing to move: the `Plan` of selection [B, H, K] (-1 = none), with the share of this step's
        stored blocks it reads (a device scalar: no sync while decoding), and when counted the step
        log's counters (every wanted block is a hit)."""
        stored = (-(-layer.lengths.clamp(min=1) // layer.block_size)).sum() * selection.shape[1]
        plan = Plan(selection, share=(selection >= 0).sum() / stored)
        if self.log is not None:
            wanted = (selection >= 0).sum()
            plan.counts = torch.stack([wanted, wanted, torch.zeros_like(wanted)])
            if self.log.selections is not None:
                self.log.record(selection, layer.lengths, layer.block_size)
        return plan

    def record(self, layer, plan: Plan | None) -> None:
        """After the call: the plan's counters into the step log (when counted)."""
        if self.log is not None and plan is not None:
            self.log.add(plan.counts, plan.h2d_extra)

    def blocks(self, layer, plan: Plan, with_values: bool = True):
        """The blocks of plan.selection [B, H, K] -> keys, values [B, H, K*bs, d] (None unless with_values),
        key positions [B, H, K*bs] (-1 = not a key), bias [B, H, K*bs] or None (`gather_blocks`)."""
        return gather_blocks(self.keys, self.values, self.cis, plan.selection, layer.lengths, layer.block_size,
                             with_values=with_values)

    def decode_attention(self, layer, q: torch.Tensor, plan: Plan) -> torch.Tensor:
        """One decode token per sequence, q [B, 1, Hq, d], over the planned blocks -> [B, 1, Hq, d]: the
        `sparse_decode_blocks` kernel reading the blocks in place (no gather copy, no host sync), or
        a gather + masked SDPA (`kernels.decode_kernels` decides).  Keys are those stored (position
        < length), which at a decode step is every key up to the token."""
        ops = layer.kernels
        if ops.decode_kernels:
            return ops.sparse_decode_blocks(
                q[:, 0], self.keys, self.values, plan.selection, layer.lengths, layer.block_size, bias=self.cis,
                check_ids=False,
            )[0].unsqueeze(1)
        return attend_gathered(q, *self.blocks(layer, plan), layer.lengths)

    def full(self, layer, rows: int) -> tuple:
        """K, V [B, rows, H, d], CIS [B, rows, H] or None: the first `rows` positions."""
        cis = None if self.cis is None else self.cis[:, :rows]
        return self.keys[:, :rows], self.values[:, :rows], cis

    def full_keys(self, layer, rows: int) -> torch.Tensor:
        return self.keys[:, :rows]

    def block_source(self, layer) -> None:
        """None: the rows are [B, S, H, d] buffers, laid out by block where a chunk needs them."""
        return None

    # -- lifecycle -----------------------------------------------------------------------------------
    def crop(self, layer) -> None:
        """After the layer dropped trailing positions: rows past the new lengths are rewritten when
        stored again, so nothing to clear."""

    def reorder(self, beam_idx: torch.Tensor) -> None:
        for name in ("keys", "values", "cis"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.index_select(0, beam_idx.to(tensor.device)))

    def forked(self, layer, repeats: int) -> "ResidentRows":
        """An independent copy, each sequence repeated `repeats` times, with fresh counters."""
        other = self.emptied()
        for name in ("keys", "values", "cis"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(other, name, tensor.repeat_interleave(repeats, dim=0) if repeats > 1 else tensor.clone())
        return other

    # -- bytes ---------------------------------------------------------------------------------------
    def device_tensors(self) -> dict:
        names = ("keys", "values", "cis")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def host_nbytes(self) -> int:
        return 0

    def host_pool(self) -> None:
        return None

    def block_bytes(self) -> int:
        return 0

    def missing_bounds(self) -> Exception:
        """The error of a `key_bounds()` call on a layer built without them."""
        return ValueError(
            "this cache keeps no block key bounds: build the cache while sparse_config.selector is 'quest' "
            "(or SparseCache(..., selector='quest'))"
        )


class SparseCacheLayer(CacheLayerMixin):
    """One layer of a cache, composed of three parts:

    * `store`: where the K/V rows (and NOSA's CIS) live and the calls that read them: `ResidentRows`
      (the device, by position), the offloaded runtime's `inference/layers.py:OffloadedRows` (pinned host
      blocks, device slots) or an engine's pages (`serving/paged.py:PagedRows`);
    * `windows`: the selector's window indexes (`WindowIndex`, `window_indexes`): compressed keys
      [B, C, H, d], NOSA's pooled CIS [B, C, H] (fp32), MiniCPM4.1's coarse keys, Quest's block bounds;
    * the contract (`CacheLayer`): what attention calls, and nothing else.

    `lengths` [B] counts the stored positions of each sequence (they are contiguous from 0), on the
    device; `host_lengths` is the same count on the host, kept from each call's `CallInfo`, so
    decisions that need a number (rows, keys, blocks) never read it back from the device.
    `kernels`: the kernel choices (`kernels.kernel_set`) for its device, made when the first token
    comes and carried.  `reset`, `crop`, `forked` and `reorder_cache` run once per part.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(
        self,
        kernel_size: int | None = None,
        kernel_stride: int | None = None,
        coarse: tuple[int, int] | None = None,
        max_length: int | None = None,
        block_size: int | None = None,
        key_bounds: bool = False,
        store=None,
        windows: list[WindowIndex] | None = None,
    ) -> None:
        super().__init__()
        self.kernel = (kernel_size, kernel_stride) if kernel_size else None
        # Quest's per-block key min / max, kept like the compressed keys (windows of one block)
        bounds = (block_size, block_size) if key_bounds and self.kernel else None
        self.windows = window_indexes(self.kernel, coarse, bounds) if windows is None else windows
        self.store = ResidentRows() if store is None else store
        self.coarse = coarse
        self.max_length = max_length
        self.block_size = block_size
        self.reserved: int | None = None  # rows generate() will store at most (`SparseCache.reserve`)
        self.carry = None  # the cache's `carry.CarriedBlocks` (a selector that carries blocks), shared by its layers
        # (blocks per KV head, SparseConfig) a multi-token call pins with (`pins.py`; the cache sets it per call)
        self.pinning: tuple | None = None
        self._clear()

    def _clear(self) -> None:
        """Drop everything stored: the state a new layer starts from, and what `reset` leaves.  The
        settings, `reserved`, the kinds of window index and of store (each emptied) stay."""
        self.is_initialized = False
        self.windows = [window.emptied() for window in self.windows]
        self.index = {window.name: window for window in self.windows}
        self.store = self.store.emptied()
        self.kernels: kernels.KernelSet | None = None
        self.lengths: torch.Tensor | None = None
        self.host_lengths: list[int] | None = None
        self.last_plan: Plan | None = None  # recorded into the step logs after the call (`record_plan`)
        self.block_shares: list[torch.Tensor] = []  # per planned decode step: blocks read / blocks stored
        self.columns = 0  # input columns seen, padding included (what generate() slices by)
        if self.carry is not None:  # what was carried belonged to the rows dropped
            self.carry.forget()
        self.pinned: torch.Tensor | None = None  # [B, H, pins] int64 (-1: none), `pin_window`
        # (q [B, R, Hq, d], positions [B, R]): the last query rows of the multi-token calls since the last decode
        # step, which the next one's pins also read (a prompt in chunks: `pins.py`), or None
        self.pin_rows: tuple | None = None

    # -- the window indexes by name (None: not kept, or not made yet) ------------------------------
    ckeys = property(lambda self: _buffer(self.index, "ckeys"))
    pooled_cis = property(lambda self: _buffer(self.index, "pooled_cis"))
    coarse_keys = property(lambda self: _buffer(self.index, "coarse_keys"))
    block_lo = property(lambda self: _buffer(self.index, "block_lo"))
    block_hi = property(lambda self: _buffer(self.index, "block_hi"))

    def index_tensors(self) -> dict:
        """Name -> buffer of every window index made, and the lengths: the layer's selection index on the
        device (what `OffloadedSparseCache.index_nbytes` counts)."""
        made = {window.name: window.buffer for window in self.windows if window.buffer is not None}
        return made if self.lengths is None else {**made, "lengths": self.lengths}

    # -- transformers' CacheLayerMixin -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.kernels = kernels.kernel_set(key_states.device)
        self.lengths = torch.zeros(key_states.shape[0], dtype=torch.long, device=key_states.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is written through append(k, v, cis, positions), not update()")

    def get_seq_length(self) -> int:
        return self.columns

    def get_max_length(self) -> int:
        return -1 if self.max_length is None else self.max_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def reset(self) -> None:
        """Empty, as new, for the next text: every window index and the store kept (emptied), `reserved` kept."""
        self._clear()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # beams of one prompt share its length, and beam_idx only permutes within a prompt's
        # beams, so host_lengths stay as they are (reading beam_idx would cost a sync per step)
        self.store.reorder(beam_idx)
        if self.carry is not None:
            self.carry.forget()
        if self.pinned is not None:  # a beam keeps the pins of the prompt it continues
            self.pinned = self.pinned.index_select(0, beam_idx.to(self.pinned.device))
        if self.pin_rows is not None:
            self.pin_rows = tuple(t.index_select(0, beam_idx.to(t.device)) for t in self.pin_rows)
        if self.lengths is not None:
            self.lengths = self.lengths.index_select(0, beam_idx.to(self.lengths.device))
        for window in self.windows:
            window.reordered(beam_idx)

    def forked(self, repeats: int = 1) -> "SparseCacheLayer":
        """An independent copy of this layer with each sequence repeated `repeats` times (sequence
        b*repeats + j is copy j of sequence b): the store, the window indexes and the lengths copied,
        the host counters and settings kept, the per-step logs fresh."""
        other = copy.copy(self)
        if self.lengths is not None:
            other.lengths = self.lengths.repeat_interleave(repeats, dim=0) if repeats > 1 else self.lengths.clone()
        if self.host_lengths is not None:
            other.host_lengths = [n for n in self.host_lengths for _ in range(repeats)]
        other.windows = [window.forked(repeats) for window in self.windows]
        other.index = {window.name: window for window in other.windows}
        other.store = self.store.forked(self, repeats)
        other.last_plan, other.block_shares = None, []
        if self.pinned is not None:
            other.pinned = self.pinned.repeat_interleave(repeats, dim=0)
        if self.pin_rows is not None:
            other.pin_rows = tuple(t.repeat_interleave(repeats, dim=0) for t in self.pin_rows)
        return other

    def crop(self, tokens: int) -> None:
        """Drop the last columns (transformers' crop: negative = how many, positive = how many to keep).

        Every sequence loses the same number of trailing positions (trailing columns are real tokens
        in assisted and prompt-lookup decoding).  Windows past the new lengths are recomputed when
        they complete again, so nothing else needs clearing; the store refills what it keeps of the
        last rows (`OffloadedRows.crop`).
        """
        if not self.is_initialized:
            return
        drop = columns_to_remove(tokens, self.columns)
        if drop == 0:
            return
        self.columns -= drop
        if self.carry is not None:
            self.carry.forget()
        self.pinned = self.pin_rows = None
        self.lengths = (self.lengths - drop).clamp(min=0)
        self.host_lengths = [max(n - drop, 0) for n in self.host_lengths]
        self.store.crop(self)

    # -- the four calls --------------------------------------------------------------------------
    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        cis: torch.Tensor | None,
        positions: torch.Tensor,
        step: CallInfo | None = None,
    ) -> None:
        """Store new tokens.  keys/values [B, n, H, d], cis [B, n, H] or None, positions [B, n] (-1 = padding).

        step: the call's host-side facts (the model passes them); without it the positions are
        read to the host once here (a direct call, not a decode step of the model).
        """
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
            self.store.allocate(self, keys, cis)
        step = self.step_for(positions) if step is None else step
        if not step.prepared:
            self.prepare(step, positions.shape[1])
        self.store.append(self, keys, values, cis, positions, step)

    def prepare(self, step: CallInfo, columns: int) -> None:
        """The host side of a call storing `columns` columns, done before the layer runs: the
        counters, and for a decode step room for its token in every buffer, so that the step
        itself reads no Python number that changes from step to step (what a compiled or
        captured step needs).  The model's cache does it for every layer (`begin_call`)."""
        if not self.is_initialized:
            return
        self.columns += columns
        self.host_lengths = list(step.lengths_after)
        self.store.make_room(self, step)

    def grow_windows_for(self, rows: int) -> None:
        """Room for the window indexes of `rows` positions."""
        if self.kernel is None or self._windows_fit(rows):
            return
        for window in self.windows:
            window.grow_for(rows, self.max_length, self.reserved)

    def _windows_fit(self, rows: int) -> bool:
        """Whether every window index already holds the windows of `rows` positions (a decode step
        of a reserved cache: nothing to grow, checked in a few calls)."""
        for window in self.windows:
            buffer = window.buffer
            if buffer is not None and buffer.shape[1] < max(num_compressed(rows, window.size, window.stride), 1):
                return False
        return True

    def advance(
        self,
        pos: torch.Tensor,
        valid: torch.Tensor,
        key_source: torch.Tensor,
        cis_source: torch.Tensor | None,
        ring: bool = False,
    ) -> None:
        """After a decode step stored its token at pos [B] (valid: pos >= 0): the lengths (in place:
        a fixed address) and the windows it completed, pooled from key_source / cis_source (the
        store's rows by position, or an offloaded store's ring)."""
        old_lengths = self.lengths.clone()
        self.lengths.copy_(torch.where(valid, torch.maximum(old_lengths, pos + 1), old_lengths))
        for window in self.windows:
            source = key_source if window.source == "keys" else cis_source
            if source is not None:
                window.extend_one(old_lengths, self.lengths, source, ring)

    def extend_windows(
        self, old_lengths: torch.Tensor, key_source: torch.Tensor, cis_source: torch.Tensor | None
    ) -> None:
        """Pool the windows completed by the last append into every window index, per sequence (no
        window twice).  key_source [B, S, H, d] and cis_source [B, S, H] hold every stored row (any
        device); the results land on the lengths' device."""
        longest = self._longest(None)
        for window in self.windows:
            source = key_source if window.source == "keys" else cis_source
            if source is not None:
                window.extend(old_lengths, self.lengths, source, longest, self.max_length, self.reserved)

    def step_for(self, positions: torch.Tensor) -> CallInfo:
        """The `CallInfo` of a direct call storing `positions` [B, n] (one read of them)."""
        return CallInfo.from_positions(positions, self.host_lengths, None)

    def _longest(self, length: int | None) -> int:
        """The longest stored sequence: `length` when given, else the host counter (no read)."""
        return max(self.host_lengths, default=0) if length is None else length

    def compressed(self, key_count: int | None = None) -> tuple:
        """(compressed keys [B, C, H, d], coarse keys or None, pooled CIS fp32 [B, C, H] or None) up
        to the longest sequence, `key_count` when given (visibility masks the rest)."""
        longest, index = self._longest(key_count), self.index
        ckeys = index["ckeys"].view(longest)
        coarse = None if self.coarse is None else index["coarse_keys"].view(longest)
        pooled = index.get("pooled_cis")
        return ckeys, coarse, None if pooled is None or not pooled.made else pooled.view(longest)

    def capacity_rows(self) -> int:
        """Positions per sequence the store holds now (what a decode step may score)."""
        return self.store.capacity_rows(self)

    def decode_index(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
        """What a decode step scores, at fixed shapes: the compressed keys [B, C, H, d], the coarse
        keys or None and the pooled CIS or None, whole as allocated (visibility masks the windows
        not yet complete), and the rows they span (`capacity_rows`).  Changes only when a buffer
        grows, which a reserved or max_length cache never does while decoding."""
        rows, index = self.store.capacity_rows(self), self.index
        coarse, pooled = index.get("coarse_keys"), index.get("pooled_cis")
        return (index["ckeys"].whole(rows), None if coarse is None else coarse.whole(rows),
                None if pooled is None else pooled.whole(rows), rows)

    def key_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Quest's index: per complete block the per-channel min and max key, each [B, NBc, H, d], whole as
        allocated (fixed shapes; blocks not yet complete are masked by the scoring).  Kept only by a cache
        built for a selector whose `key_bounds` is set."""
        low, high = self.index.get("block_lo"), self.index.get("block_hi")
        if low is None or not low.made:
            raise self.store.missing_bounds()
        rows = self.capacity_rows()
        return low.whole(rows), high.whole(rows)

    def plan(self, selection: torch.Tensor) -> Plan:
        """The store's `Plan` for selection [B, H, K] (-1 = none): what the decode attention will read,
        with the fetch a runtime store starts here."""
        self.last_plan = self.store.plan(self, selection)
        return self.last_plan

    def record_plan(self) -> None:
        """After the call, on the host side: the last plan's counters into the store's step log and
        its share into `block_shares`."""
        plan, self.last_plan = self.last_plan, None
        self.store.record(self, plan)
        if plan is not None and plan.share is not None:
            self.block_shares.append(plan.share)

    def decode_attention(self, q: torch.Tensor, plan: Plan, observe: bool = True) -> torch.Tensor:
        """One decode token per sequence, q [B, 1, Hq, d], over the planned blocks -> [B, 1, Hq, d]
        (the store's kernel or gather); a cache that carries blocks (`carry.py`) then takes the share of the
        attention each planned block held (unless `observe` is False: a plan that is not the step's selection)."""
        out = self.store.decode_attention(self, q, plan)
        if observe and self.carry is not None and self.carry.ids is not None:
            self.carry.observe(self, q, plan)
        return out

    def observe_rows(self, q: torch.Tensor, selection: torch.Tensor, keys: torch.Tensor, cis) -> None:
        """A decode step that attended from every stored row (keys [B, S, H, d], cis [B, S, H] or None: `full()`;
        a batch holding a sequence below dense_len): its selection [B, H, K]'s share of the attention into
        the carried blocks' heat, as `decode_attention` takes it (the dense sequences' share is dropped as
        the step ends, `SparseCache.finish_call`)."""
        if self.carry is None or self.carry.ids is None:
            return
        k, _, key_pos, bias = gather_blocks(keys, keys, cis, selection, self.lengths, self.block_size,
                                            with_values=False)  # the mass needs no values
        self.carry.weigh(self, q, selection, k, key_pos, bias)

    def pin_window(self, q: torch.Tensor, positions: torch.Tensor) -> None:
        """After a multi-token call of q [B, T, Hq, d] (post-RoPE) at positions [B, T], under `pinning`: the
        blocks its last rows attended most, per KV head, pinned for the decode steps after it (`pins.py`), read
        from every stored key."""
        count, sparse = self.pinning
        if self.pin_rows is not None:  # rows of the calls before this one (a prompt in chunks)
            q, positions = torch.cat([self.pin_rows[0], q], dim=1), torch.cat([self.pin_rows[1], positions], dim=1)
        self.pin_rows = pins.last_rows(q, positions)
        keys = self.store.full_keys(self, self._longest(None))  # the values are not read
        mass = pins.window_block_mass(*self.pin_rows, keys, sparse.block_size)
        self.pinned = pins.window_pins(mass, self.lengths, sparse, count)

    # -- full views (prefill and dense paths) ----------------------------------------------------
    def full(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """K, V [B, S, H, d], CIS [B, S, H] or None, and S = the longest stored sequence, on the device."""
        rows = self._longest(None)
        return (*self.store.full(self, rows), rows)

    def key_count(self) -> int:
        """The longest stored sequence (the host counter)."""
        return self._longest(None)

    def call_indexes(self):
        """The store's per-call shared index tensors (`KVStore.shared`), or None."""
        return self.store.shared

    def block_source(self):
        """The store's rows as key blocks read in place (an engine's pages), or None: `full()`."""
        return self.store.block_source(self)

    @property
    def offloaded(self) -> bool:
        """Whether the store keeps the rows on the host (the runtime's reports count by it)."""
        return self.store.offloaded


def attend_gathered(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_pos: torch.Tensor,
    bias: torch.Tensor | None,
    lengths: torch.Tensor,
) -> torch.Tensor:
    """Decode attention over gathered blocks (`gather_blocks`' output): q [B, 1, Hq, d], keys/values
    [B, H, L, d], key_pos [B, H, L] (-1 = not a key), bias [B, H, L] or None, lengths [B] (the token
    sits at lengths - 1) -> [B, 1, Hq, d].  The G query heads of a KV head attend as rows of it."""
    batch, _, heads, dim = q.shape
    kv_heads = keys.shape[1]
    allowed = ((key_pos >= 0) & (key_pos < lengths.view(-1, 1, 1))).unsqueeze(2)  # [B, H, 1, L]: one row, shared
    out = masked_attention(
        q.view(batch, kv_heads, heads // kv_heads, dim), keys, values, allowed, bias, heads // kv_heads
    )
    return out.reshape(batch, 1, heads, dim)


def block_rows(selection: torch.Tensor, block_size: int, lengths: torch.Tensor):
    """Key positions [B, H, K*bs] of the selected blocks and whether each is a stored key."""
    batch, heads, width = selection.shape
    offsets = torch.arange(block_size, device=selection.device)
    pos = (selection.clamp(min=0).unsqueeze(-1) * block_size + offsets).view(batch, heads, width * block_size)
    exists = (selection >= 0).repeat_interleave(block_size, dim=-1) & (pos < lengths.view(-1, 1, 1))
    return pos, exists


def gather_blocks(
    keys, values, cis, selection, lengths, block_size, rows: torch.Tensor | None = None, with_values: bool = True
):
    """K/V/bias of the selected blocks from position-indexed storage [B, S, H, ...].

    rows [B, H, K*bs] overrides where each key is read from (a slot buffer); by default row = position.
    Returns keys, values [B, H, K*bs, d] (None unless with_values: what weighing the blocks skips), key
    positions [B, H, K*bs] (-1 = not a key), bias or None;
    entries that are not keys are 0.  Their rows may hold anything (a slot never filled is NaN, and
    a -1 entry or a short prompt's missing blocks read one), and a masked logit does not stop NaN
    keys or values from reaching the softmax's output, so they are zeroed here.
    """
    batch, heads, _ = selection.shape
    pos, exists = block_rows(selection, block_size, lengths)
    index = (pos if rows is None else rows).clamp(min=0, max=keys.shape[1] - 1)
    b_idx = torch.arange(batch, device=index.device).view(-1, 1, 1)
    h_idx = torch.arange(heads, device=index.device).view(1, -1, 1)
    # advanced indexing copies whole d-rows (a gather over a transposed view is several x slower)
    k, v = keys[b_idx, index, h_idx], values[b_idx, index, h_idx] if with_values else None
    bias = None if cis is None else cis[b_idx, index, h_idx]
    zero_missing_(exists, k, v, bias)
    return k, v, pos.masked_fill(~exists, -1), bias


def zero_missing_(exists: torch.Tensor, *gathered: torch.Tensor | None) -> None:
    """Zero, in place, the rows of fresh gathers [B, H, L, ...] (None: skipped) where exists [B, H, L]
    is False: a row that is not a key may hold anything (NaN in a never-written slot), and a masked
    logit does not stop it from reaching the softmax's output."""
    missing = ~exists
    for rows in gathered:
        if rows is not None:
            rows.masked_fill_(missing.view(*missing.shape, *[1] * (rows.dim() - 3)).expand_as(rows), 0.0)


def model_signature(config) -> dict:
    """What a cache must agree on with the model it serves."""
    sparse = config.sparse
    signature = {
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
    }
    if sparse is not None:
        signature.update(
            kernel_size=sparse.kernel_size,
            kernel_stride=sparse.kernel_stride,
            block_size=sparse.block_size,
            budget_blocks=sparse.budget_blocks,
            policy=sparse.policy,
            lse=sparse.lse,
        )
    return signature


class SparseCache(Cache):
    """Everything resident on the model's device; the default cache of `generate()`.

    max_length: preallocate this many positions per sequence (else grow in chunks);
    selector: one of `modes.SELECTORS` overrides the model's `sparse_config.selector` for runs with
    this cache (how the runtime modes compare selectors on one model); None keeps the model's.  A
    cache for the quest selector keeps Quest's block key bounds too.
    """

    def __init__(
        self, config=None, num_layers: int | None = None, max_length: int | None = None, selector: str | None = None
    ) -> None:
        sparse = config.sparse if config is not None else None
        num_layers = num_layers if num_layers is not None else config.num_hidden_layers
        self.selector = selector
        self.signature = model_signature(config) if config is not None else None
        self._checked: tuple = (None, None)  # the (config, config.sparse) that last passed `check_model`
        self.unrecorded_from: tuple[int, ...] | None = None  # decode steps' first positions (`token_record.py`)
        # (blocks per KV head, SparseConfig) every multi-token call pins with whatever the selector (`pins.py`):
        # a dense prefill that cells of several selectors decode from (the quality suite's); None: only a
        # pinning selector's calls pin
        self.pins_always: tuple | None = None
        super().__init__(layers=[self._make_layer(config, sparse, idx, max_length) for idx in range(num_layers)])

    @property
    def selector(self) -> str | None:
        """The selector this cache runs (a registered name), None: the model's."""
        return self._selector

    @selector.setter
    def selector(self, name: str | None) -> None:
        self.rule = get_selector(name)  # resolved (and checked) once here: a forward call reads no name
        self._selector = name

    def keeps_key_bounds(self, sparse) -> bool:
        """Whether the layers keep Quest's block key bounds: the cache's selector (or the model's) scores them."""
        return sparse is not None and get_selector(self.selector or sparse.selector).key_bounds

    def _make_layer(self, config, sparse, idx: int, max_length: int | None) -> SparseCacheLayer:
        kernel, coarse = window_geometry(sparse)
        kernel = kernel or (None, None)
        block_size = sparse.block_size if sparse is not None else None
        return SparseCacheLayer(
            *kernel, coarse=coarse, max_length=max_length, block_size=block_size,
            key_bounds=self.keeps_key_bounds(sparse),
        )

    def check_model(self, config) -> None:
        """Raise if this cache was built for a model of another shape than `config`'s."""
        checked = self._checked
        if self.signature is None or (checked[0] is config and checked[1] is config.sparse):
            return  # the objects the last check passed (a reassigned sparse_config is a new object)
        theirs = model_signature(config)
        diff = {key: (value, theirs.get(key)) for key, value in self.signature.items() if theirs.get(key) != value}
        if diff or set(theirs) != set(self.signature):
            detail = (
                ", ".join(f"{key}: cache {mine!r} vs model {other!r}" for key, (mine, other) in diff.items())
                or "sparse vs dense"
            )
            raise ValueError(
                f"this {type(self).__name__} was built for another model ({detail}); "
                "build one with the model that uses it"
            )
        self._checked = (config, config.sparse)

    def sequence_lengths(self) -> torch.Tensor | None:
        """[B] stored positions per sequence on the device (None before the first token)."""
        return self.layers[0].lengths

    def reserve(self, rows: int) -> None:
        """Allocate `rows` positions per sequence when the first tokens come (what generate() will
        store at most: its max_length), so decoding never regrows a buffer; more rows still fit
        (they grow in chunks).  A cache built with max_length keeps it."""
        for layer in self.layers:
            layer.reserved = rows

    def host_lengths(self) -> list[int] | None:
        """The same count on the host (None before the first token): what decode steps decide by."""
        return self.layers[0].host_lengths

    def call_info(self, positions: torch.Tensor, sparse) -> CallInfo:
        """The host-side facts of a forward call storing `positions` [B, T]: from the host
        counters for a decode step (one token per sequence, on a cache that holds tokens), else
        from one read of the positions."""
        stored = self.host_lengths()
        if positions.shape[1] == 1 and stored is not None:
            return CallInfo.for_decode(stored, sparse)
        return CallInfo.from_positions(positions, stored, sparse)

    def begin_call(self, positions: torch.Tensor, sparse, input_ids: torch.Tensor | None = None) -> CallInfo:
        """`call_info`, the cache's record of its tokens (`token_record.py`: a decode step only
        keeps the first position it wrote), then every layer's host bookkeeping for the call
        (`prepare`): what the model does before its layers run, so the layers' part of a decode
        step reads no Python number that changes from step to step.  input_ids [B, T] or None."""
        step = call = self.call_info(positions, sparse)
        pending = self.unrecorded_from
        if call.decode and pending is not None and len(pending) == len(call.lengths_before):
            self.unrecorded_from = tuple(map(min, pending, call.lengths_before))
        else:
            note_call(self, input_ids, positions, call)
        if all([layer.is_initialized for layer in self.layers]):
            for layer in self.layers:
                layer.prepare(call, positions.shape[1])
            step = dataclasses.replace(call, prepared=True)
        self._carry_for(call, sparse)
        self._pins_for(call, sparse)
        return step

    def call_rule(self, sparse):
        """The `Selector` a call under SparseConfig `sparse` runs: the cache's own, else the config's; None for a
        dense call (sparse None)."""
        return None if sparse is None else self.rule or get_selector(sparse.selector)

    def _carry_for(self, call: CallInfo, sparse) -> None:
        """Under a selector that carries blocks (`Selector.carries`), the layers' shared `CarriedBlocks`:
        kept for a decode step holding a sparse sequence (a dense sequence's are dropped as it ends),
        forgotten by any other call (and made ready for the next decode step when the call ends,
        `finish_call`, so that a decode step allocates nothing)."""
        rule = self.call_rule(sparse)
        count = rule.carries if rule is not None else 0
        carry = self.layers[0].carry if self.layers else None
        self._carry_call = None
        if not count:
            if carry is not None:
                carry.forget()
            return
        if carry is None or carry.count != count:
            carry = CarriedBlocks(count, sparse)
            for layer in self.layers:
                layer.carry = carry
        # a decode step carries for its sparse sequences, also beside ones below dense_len (their ids are
        # dropped as it ends): each sequence carries what it would alone
        if call.decode and not call.all_dense and self.layers[0].lengths is not None:
            carry.begin(call.batch, self.layers[0].lengths.device)  # a no-op unless forgotten
            self._carry_call = "decode"
            self._carry_none = self._carries_nothing(call)
        else:
            carry.forget()
            self._carry_call = "other"

    def _carries_nothing(self, call: CallInfo) -> torch.Tensor | None:
        """bool [B]: the sequences of a decode step that carry nothing into the next (those attending densely:
        a sequence alone carries nothing out of a dense step), or None."""
        if call.dense_rows is not None:
            return call.dense_rows
        return torch.tensor(call.dense, device=self.layers[0].lengths.device) if call.any_dense else None

    def _pins_for(self, call: CallInfo, sparse) -> None:
        """Under a selector that pins blocks (`Selector.pins`), or where `pins_always` asks (a shared prefill
        that several selectors decode from), a multi-token call drops the pins and pins anew as it ends
        (`SparseCacheLayer.pin_window`, from the window's rows and its own); decode steps keep the pins and
        end the window."""
        rule = self.call_rule(sparse)
        pinning = (rule.pins, sparse) if rule is not None and rule.pins else self.pins_always
        for layer in self.layers:
            layer.pinning = pinning
            if not call.decode:
                layer.pinned = None
            if call.decode or pinning is None:
                layer.pin_rows = None

    def compiles_decode(self, step: CallInfo) -> bool:
        """Whether `compile_decode`'s graph covers this call: a decode step whose layers run fixed
        shapes (no dense row: its keys grow with the sequence)."""
        return step.decode and not step.any_dense

    def finish_call(self) -> None:
        """After the layers ran: each layer's plan counters into its step logs; the blocks a sparse decode
        step attended most carried into the next (`carry.py`)."""
        for layer in self.layers:
            layer.record_plan()
        call, self._carry_call = getattr(self, "_carry_call", None), None
        layer = self.layers[0] if self.layers else None
        if call == "decode":
            layer.carry.roll()
            if self._carry_none is not None:  # e.g. a dense sequence carries nothing into its first sparse step
                layer.carry.ids = layer.carry.ids.masked_fill(self._carry_none.view(-1, 1), -1)
        elif call == "other" and layer.lengths is not None:  # the widest layer's blocks (offloaded ones may hold more)
            blocks = sel.num_blocks(max(other.capacity_rows() for other in self.layers), layer.carry.block_size)
            layer.carry.ready(layer.lengths.shape[0], blocks, layer.lengths.device)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length()

    # -- fork -------------------------------------------------------------------------------------
    def fork(self, n: int | None = None):
        """An independent cache holding what this one holds (`fork()`), or a list of `n` of them:
        later calls on one never change another.  The resident cache copies its tensors; the
        offloaded one shares its full host blocks.  `copy.deepcopy(cache)` is `cache.fork()`."""
        if n is None:
            return self._forked(1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"fork(n): n must be a positive integer or None, got {n!r}")
        return [self._forked(1) for _ in range(n)]

    def fork_batch(self, n: int) -> "SparseCache":
        """One cache of batch B*n over this cache's B sequences: sequence b*n + j continues copy j
        of sequence b (the same document with n questions as one batch).  This cache is unchanged."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"fork_batch(n): n must be a positive integer, got {n!r}")
        return self._forked(n)

    def _forked(self, repeats: int) -> "SparseCache":
        other = copy.copy(self)
        other.layers = [layer.forked(repeats) for layer in self.layers]
        carry = self.layers[0].carry if self.layers else None
        if carry is not None:  # one shared object per cache
            carry = carry.forked(repeats)
            for layer in other.layers:
                layer.carry = carry
        return other

    def __deepcopy__(self, memo) -> "SparseCache":
        return self.fork()

    def crop(self, max_length: int) -> None:
        """Drop trailing columns of every layer (negative: that many; positive: keep that many)."""
        for layer in self.layers:
            layer.crop(max_length)

    def stats(self) -> dict:
        """Sparse decode steps seen and the mean share of stored KV blocks they read, per layer and overall."""
        per_layer = [
            float(torch.stack(layer.block_shares).float().mean()) if layer.block_shares else None
            for layer in self.layers
        ]
        seen = [share for share in per_layer if share is not None]
        return {
            "decode_steps": max((len(layer.block_shares) for layer in self.layers), default=0),
            "block_share_per_layer": per_layer,
            "block_share": sum(seen) / len(seen) if seen else None,
        }
