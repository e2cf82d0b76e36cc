"""`CallInfo`: the host-side facts of one forward call, fixed before any layer runs.

A decode step adds exactly one token to every sequence, at its stored length, so everything a
layer must decide on the host (dense or sparse, how many keys and blocks exist, the positions'
bounds) follows from the cache's host counters: a decode step reads nothing back from the device.
A multi-token call (prefill, draft verification) reads its positions to the host once, here, and
every layer and query chunk takes its bounds from that copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CallInfo:
    """lengths_before / lengths_after: stored positions per sequence before and after the call;
    positions: the call's positions as a CPU int64 [B, T] copy (None for a decode step, whose
    positions are lengths_before); dense: per sequence, whether it attends densely in this call
    (MiniCPM's rule, `prefill.dense_sequences`); stores: whether it stores a token in this call."""

    lengths_before: tuple[int, ...]
    lengths_after: tuple[int, ...]
    positions: torch.Tensor | None
    dense: tuple[bool, ...]
    stores: tuple[bool, ...]
    prepared: bool = False  # the cache did this call's host bookkeeping already (`SparseCache.begin_call`)

    @classmethod
    def for_decode(cls, lengths: list[int] | tuple[int, ...], sparse) -> "CallInfo":
        """One token per sequence at position lengths[b] (no device read)."""
        before = tuple(int(n) for n in lengths)
        after = tuple(n + 1 for n in before)
        return cls(before, after, None, tuple(_is_dense(n, sparse) for n in after), (True,) * len(before))

    @classmethod
    def from_positions(cls, positions: torch.Tensor, lengths: list[int] | tuple[int, ...] | None, sparse) -> "CallInfo":
        """A multi-token call: positions [B, T] (-1 = padding) read to the host once."""
        host = positions.detach().to("cpu", torch.int64)
        last = host.amax(dim=1).tolist() if host.shape[1] else [-1] * host.shape[0]
        before = tuple(int(n) for n in lengths) if lengths is not None else (0,) * host.shape[0]
        after = tuple(max(n, p + 1) for n, p in zip(before, last))
        return cls(before, after, host, tuple(_is_dense(p + 1, sparse) for p in last), tuple(p >= 0 for p in last))

    @property
    def decode(self) -> bool:
        return self.positions is None

    @property
    def batch(self) -> int:
        return len(self.lengths_after)

    @property
    def key_count(self) -> int:
        """The longest sequence after the call (rows any layer holds)."""
        return max(self.lengths_after, default=0)

    @property
    def any_dense(self) -> bool:
        """Whether a sequence that stores a token in this call attends densely."""
        return any(d and s for d, s in zip(self.dense, self.stores))

    @property
    def all_dense(self) -> bool:
        return all(self.dense)

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


def _is_dense(key_length: int, sparse) -> bool:
    """MiniCPM's rule per sequence: dense when its key length is below dense_len (`dense_len <= 0`:
    never); a dense model is dense everywhere."""
    if sparse is None:
        return True
    return sparse.dense_len > 0 and key_length < sparse.dense_len
