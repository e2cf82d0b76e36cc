"""A cache's own record of the token ids it was prefilled with, so a `ContextStore.insert(cache, ids)`
can check `ids` against what the cache really holds instead of trusting them.

`SparseCache.begin_call` notes each forward call (before its layers run).  Nothing is read back
to the host there: a multi-token call keeps a copy of its positions and ids (device tensors), a
run of decode steps only marks the first position it wrote as unrecorded (decode steps are not
recorded: it costs nothing per step), and
`recorded_tokens(cache)` turns the notes into token lists when a store asks.

The record is a chain of immutable notes bound to the cache object, so a `fork()` (a shallow copy)
shares the record so far and each copy extends its own.  A position is known only if every note
since position 0 wrote it with ids: a call given `inputs_embeds`, a decode step, a gap, a change of
batch size (fork_batch, beam reordering) make the rest unknown, and a store refuses to verify what
the record does not know.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ATTRIBUTE = "_forecastkv_token_record"


@dataclass(frozen=True)
class Note:
    """One forward call: `tokens` (per row, settled) or `positions`/`ids` [B, T] device tensors
    (ids None: unknown tokens), or `decode` (per row, the one position the step wrote, unknown)."""

    previous: "Note | None"
    batch: int
    tokens: tuple[tuple[int, ...], ...] | None = None
    positions: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    decode: tuple[int, ...] | None = None


def note_call(cache, input_ids: torch.Tensor | None, positions: torch.Tensor, call) -> None:
    """Record a forward call storing `input_ids` [B, T] (None: inputs_embeds) at `positions`
    [B, T] (-1 = padding) into `cache`; `call` is its `CallInfo`.  A decode step's note only keeps
    the first position it wrote: `SparseCache.begin_call` lowers `cache.unrecorded_from` in
    place for the steps after it, without a call here, and the next note settles it."""
    _settle_decode(cache)
    if call.decode:
        cache.unrecorded_from = call.lengths_before
        return
    previous = getattr(cache, ATTRIBUTE, None)
    note = Note(
        previous,
        positions.shape[0],
        positions=positions.detach().clone(),
        ids=None if input_ids is None else input_ids.detach().clone(),
    )
    setattr(cache, ATTRIBUTE, note)


def _settle_decode(cache) -> None:
    """Turn the decode steps since the last note (`cache.unrecorded_from`: per sequence the first
    position they wrote) into one note: everything from there on is unknown."""
    start = getattr(cache, "unrecorded_from", None)
    if start is None:
        return
    cache.unrecorded_from = None
    setattr(cache, ATTRIBUTE, Note(getattr(cache, ATTRIBUTE, None), len(start), decode=start))


def set_tokens(cache, tokens: list[int]) -> None:
    """Start the record of a one-sequence cache filled with `tokens` at positions 0.. by other means
    than a forward call (a ContextStore lookup, which checked them against their blocks' names)."""
    cache.unrecorded_from = None
    setattr(cache, ATTRIBUTE, Note(None, 1, tokens=(tuple(int(t) for t in tokens),)))


def recorded_tokens(cache) -> list[list[int]] | None:
    """Per sequence, the token ids the cache is known to hold from position 0 on (possibly fewer
    than it holds, never other ones); None if the cache has no usable record (never prefilled by a
    forward call, or its batch changed since).  Truncated to the cache's current lengths (a crop)."""
    _settle_decode(cache)
    notes, note = [], getattr(cache, ATTRIBUTE, None)
    while note is not None:
        notes.append(note)
        note = note.previous
    host = cache.host_lengths()
    if not notes or host is None or any(n.batch != len(host) for n in notes):
        return None
    rows: list[list[int]] = [[] for _ in host]
    for note in reversed(notes):
        if note.tokens is not None:
            rows = [list(t) for t in note.tokens]
            continue
        if note.decode is not None:
            rows = [row[:start] for row, start in zip(rows, note.decode)]
            continue
        positions = note.positions.tolist()
        ids = None if note.ids is None else note.ids.tolist()
        for b, row in enumerate(rows):
            written = [(p, None if ids is None else ids[b][i]) for i, p in enumerate(positions[b]) if p >= 0]
            if not written:
                continue
            start = written[0][0]
            contiguous = all(p == start + i for i, (p, _) in enumerate(written))
            if ids is None or not contiguous:
                del row[start:]
            elif start <= len(row):
                row[start:] = [t for _, t in written]
            # start > len(row): a gap; the known prefix stays what it was
    rows = [row[:n] for row, n in zip(rows, host)]  # past a crop nothing is known any more
    setattr(
        cache, ATTRIBUTE, Note(None, len(host), tokens=tuple(tuple(row) for row in rows))
    )  # settled: the tensors are read once
    return rows
