"""The context store's index: which blocks it holds, under which names, in which pool blocks, who
holds them and which go first when the store is full.

This is the manager half of the split vLLM v1's kv_offload draws between a manager and a worker:
it works on names and block ids only and never reads or writes a row.  The rows move in
`context/transfer.py`, files in `context/persist.py`; `ContextStore` (store.py) composes them.

Reference counts are the pools' own (`HostBlockPool.retain` / `release` / `refs`): the store
holds one reference on each of its blocks, a cache from `lookup` (or given to `insert`) holds one
on the first layer's block of each block it uses (`hold`), and offloaded caches hold the blocks
their block tables point at.  A block with holders beyond the store's is live and never evicted.
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

from .blocks import chain_hashes
from .disk import ContextStoreError


@dataclass
class Entry:
    """One stored block: its name, its parent's (None for a chain's first block), its index in the
    chain (block `position` covers tokens position*bs .. position*bs + bs - 1), its token ids, its
    block id per layer in the store's pools (or None: on disk only, read into the pools when a
    lookup needs it), its disk record, bytes, children."""

    name: str
    parent: str | None
    position: int
    tokens: list[int]
    blocks: list[int] | None
    disk: dict | None
    nbytes: int
    children: set[str] = field(default_factory=set)
    # when a lookup or insert last used it (time.time()): the LRU order shared through the index file
    used: float = 0.0


class BlockIndex:
    """The stored blocks of one identity, least recently used first, and their holders.

    pools: the store's `HostBlockPool` per layer (only their reference counts are used here).
    root: the hash chain's root (`blocks.identity_root`).  max_bytes: cap on the blocks' bytes
    (None: no cap).  Counters: evictions (by the cap) and dropped blocks (gone or bad on disk)."""

    def __init__(self, pools: list, root: str, block_size: int, max_bytes: int | None) -> None:
        self.pools, self.root, self.block_size, self.max_bytes = pools, root, block_size, max_bytes
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.evictions = self.dropped = 0
        # blocks on disk this store evicted (or found bad) since it last saved: its save drops them
        self.forgotten: set[str] = set()
        # id(cache) -> (block name -> its block in pools[0], the finalizer that releases them)
        self._holders: dict[int, tuple[dict[str, int], weakref.finalize]] = {}

    # -- names ----------------------------------------------------------------------------------
    def chunk(self, tokens: list[int], position: int) -> list[int]:
        """The token ids of block `position` of `tokens`."""
        return tokens[position * self.block_size : (position + 1) * self.block_size]

    def names(self, tokens: list[int], count: int) -> list[str]:
        """Names of the first `count` full blocks of `tokens`."""
        return chain_hashes(self.root, tokens, self.block_size, count)

    def stored_prefix(self, tokens: list[int], count: int) -> list[Entry]:
        """The stored entries of the first `count` blocks of `tokens`, up to the first missing one.
        Raises `ContextStoreError` if a stored block holds other tokens than its name covers."""
        found = []
        for position, name in enumerate(self.names(tokens, count)):
            entry = self.entries.get(name)
            if entry is None:
                break
            if entry.tokens != self.chunk(tokens, position):
                raise ContextStoreError(
                    f"token mismatch: stored block {name[:16]} (block {position}) holds other tokens than its name "
                    "covers; the store is corrupted"
                )
            found.append(entry)
        return found

    def leading(self, names: list[str]) -> list[Entry]:
        """The entries of `names` up to the first one the index lacks."""
        found = []
        for name in names:
            if name not in self.entries:
                break
            found.append(self.entries[name])
        return found

    def current(self, entry: Entry) -> bool:
        """Whether `entry` is still in the index (not removed with a bad ancestor since)."""
        return self.entries.get(entry.name) is entry

    # -- holders --------------------------------------------------------------------------------
    def hold(self, cache, names: list[str]) -> None:
        """Count `cache` as a reference of each named block (once per cache); the blocks must be in
        the pools (lookup and insert load their chains first)."""
        key = id(cache)
        if key not in self._holders:
            self._holders[key] = ({}, weakref.finalize(cache, self._release_key, key))
        held = self._holders[key][0]
        for name in names:
            if name not in held:
                held[name] = self.entries[name].blocks[0]
                self.pools[0].allocator.retain([held[name]])

    def release(self, cache) -> None:
        """Drop `cache`'s references (also done when the cache is garbage collected)."""
        record = self._holders.get(id(cache))
        if record is not None:
            record[1].detach()
            self._release_key(id(cache))

    def _release_key(self, key: int) -> None:
        held, _ = self._holders.pop(key, ({}, None))
        self.pools[0].allocator.release(list(held.values()))  # the blocks held, even if their entries went since

    def live(self, entry: Entry) -> bool:
        """Whether anything beyond the store holds one of `entry`'s blocks (a live cache)."""
        return entry.blocks is not None and any(
            pool.allocator.refs[block] > 1 for pool, block in zip(self.pools, entry.blocks)
        )

    def referenced(self) -> int:
        """How many stored blocks live caches hold."""
        return sum(1 for entry in self.entries.values() if self.live(entry))

    # -- LRU ------------------------------------------------------------------------------------
    def touch(self, chain: list[Entry]) -> None:
        """Mark a chain used, its root last (most recent): LRU then evicts tips before roots."""
        now = time.time()
        for entry in reversed(chain):
            entry.used = now
            self.entries.move_to_end(entry.name)

    def order(self) -> None:
        """Entries least recently used first; within one use, tips before roots."""
        ordered = sorted(self.entries.values(), key=lambda entry: (entry.used, -entry.position))
        self.entries = OrderedDict((entry.name, entry) for entry in ordered)

    def make_room(self, nbytes: int) -> bool:
        """Evict unreferenced blocks, least recently used first, until `nbytes` more fit under
        the cap; False if they cannot."""
        if self.max_bytes is None:
            return True
        for name in list(self.entries):
            if self.nbytes + nbytes <= self.max_bytes:
                break
            entry = self.entries.get(name)
            if entry is not None and not self.live(entry):
                self.evictions += self._remove(entry, forget_on_disk=True)
        return self.nbytes + nbytes <= self.max_bytes

    # -- membership -----------------------------------------------------------------------------
    def add(self, entry: Entry) -> None:
        """Store `entry` (its parent, if any, is stored already)."""
        self.forgotten.discard(entry.name)
        self.entries[entry.name] = entry
        self.nbytes += entry.nbytes
        if entry.parent is not None:
            self.entries[entry.parent].children.add(entry.name)

    def add_record(self, record: dict, used: float) -> None:
        """Store the block of an index file's `record` (a checked entry), on disk only."""
        fields = {key: record[key] for key in ("file", "bytes", "sha256")}
        tokens = list(record["tokens"])
        self.add(
            Entry(
                record["hash"], record["parent"], record["position"], tokens, None, fields, record["nbytes"], used=used
            )
        )

    def drop(self, entry: Entry, forget_on_disk: bool) -> None:
        """Remove `entry` and its descendants because of the disk: another process removed them
        (forget_on_disk False: the index no longer names them) or the file is bad (True: the next
        save drops it from the index).  Caches built from them keep their own references."""
        self.dropped += self._remove(entry, forget_on_disk)

    def _remove(self, entry: Entry, forget_on_disk: bool) -> int:
        """Remove `entry` and its descendants (a block is referenced only with its ancestors, so
        none of them is referenced) from the index and its pools; returns how many."""
        removed = 0
        for child in list(entry.children):
            if child in self.entries:
                removed += self._remove(self.entries[child], forget_on_disk)
        del self.entries[entry.name]
        if forget_on_disk and entry.disk is not None:
            self.forgotten.add(entry.name)
        if entry.blocks is not None:
            for pool, block in zip(self.pools, entry.blocks):
                pool.allocator.release([block])
        self.nbytes -= entry.nbytes
        if entry.parent is not None and entry.parent in self.entries:
            self.entries[entry.parent].children.discard(entry.name)
        return removed + 1
