"""`ContextStore`: prefilled KV blocks kept by content, so a prompt that shares a prefix with an
earlier one prefills only the rest.

    store = ContextStore(model, "ctx-cache", max_bytes=8 << 30)   # loads what the directory holds
    cache, matched = store.lookup(ids, mode="forecast-offload")   # the longest stored prefix
    out = model.generate(ids, cache=cache, max_new_tokens=64)    # prefills ids[matched:] only
    store.insert(cache, ids)                                      # keep the prompt's full blocks
    store.save()                                                  # blocks + index, atomically

A store serves one model and one selector (the K/V of a prefill depend on the blocks its selector
routed to): a block's name hashes the tokens up to and including it together with that identity
(`blocks.model_identity`).  Blocks are immutable and shared by name.  The store keeps them in one `HostBlockPool` per
layer (the paged host tier, pinned on CUDA), holding one reference on each of its blocks:

* an offloaded layer of a cache from `lookup(ids, mode=...)` points its block table at the
  store's blocks (`OffloadedSparseCache.attach`: one more holder each, no copy), and its own
  blocks (the question, the answer) come from the same pool, so N lookups of one document share
  its host blocks, and `insert` of such a cache takes its blocks by reference, not by copy;
* a resident layer gets a device copy of the rows (what a prefill would leave).

The compressed keys, pooled CIS, tail slot and ring are rebuilt from the rows exactly, with no
model forward.

Memory: a byte cap (`max_bytes`, on the stored blocks' bytes) with LRU eviction.  A block is live
while it has holders beyond the store's own in its pools: the block tables of offloaded caches,
and one hold per cache that `lookup` returned or `insert` was given, dropped by `release` or when
that cache is garbage collected.  A live block is never evicted; evicting a block evicts its descendants (they could never be
reached again), and lookups refresh a chain from its deepest block to its root, so the tips of
old chains go first.  Counters: hit tokens, miss tokens, evictions (`stats`).
"""

from __future__ import annotations

import getpass
import hashlib
import os
import re
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..inference.host_store import HostBlockPool, host_transfer
from ..modeling.cache import SparseCache
from ..modeling.token_record import recorded_tokens, set_tokens
from . import disk
from .blocks import BlockRows, chain_hashes, dtype_name, identity_differences, identity_root, layer_rows, model_identity, sequence_ids
from .disk import ContextStoreError

MAPPED_SPARE_BLOCKS = 16  # free blocks per mapped pool (at least) for the caches' own rows: address space, not memory


def default_namespace() -> str:
    """The caller's login name as a namespace (characters a namespace may not hold become '_')."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container)
        name = "default"
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "default"


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
    used: float = 0.0  # when a lookup or insert last used it (time.time()): the LRU order shared through the index


class ContextStore:
    """Content-addressed KV blocks of one model, in memory and (with `dir`) on disk.

    model: the ForecastKVForCausalLM whose caches it fills.  dir: the store's root directory; the
    namespace's blocks are loaded from it (validated: model, geometry, dtype, sizes, checksums,
    tokens) and `save()` writes them back.  max_bytes: cap on the blocks' bytes (None: no cap).
    namespace: this user's private part of `dir` (default: the login name).  selector: the
    selector whose prefills the store keeps (default: the model's; "query" serves sparse-offload,
    "forecast" the forecast modes).
    """

    def __init__(self, model, dir: str | Path | None = None, *, max_bytes: int | None = None, namespace: str | None = None, selector: str | None = None) -> None:
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
            raise ValueError(f"max_bytes must be a non-negative integer or None (no cap), got {max_bytes!r}")
        sparse = model.config.sparse
        if selector not in (None, "query", "forecast"):
            raise ValueError(f"selector={selector!r} is not one of (None, 'query', 'forecast')")
        self.model = model
        self.selector = (selector or sparse.selector) if sparse is not None else None
        self.block_size = sparse.block_size if sparse is not None else 64
        self.identity = model_identity(model, self.selector)
        self.root = identity_root(self.identity)
        self.max_bytes = max_bytes
        self.namespace = disk.check_namespace_name(namespace if namespace is not None else default_namespace())
        self.dir = None if dir is None else Path(dir)
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.hit_tokens = self.miss_tokens = self.evictions = self.rejected = self.dropped = 0
        self._holders: dict[int, tuple[dict[str, int], weakref.finalize]] = {}  # cache -> (block name -> its block in pools[0], finalizer)
        self._evicted: set[str] = set()   # blocks on disk this store evicted (or found bad) since it last saved: its save drops them
        self._seen: tuple[int, str | None] | None = None  # (generation, stamp) of the index this store last read or wrote
        self.pools = self._new_pools()
        if self.dir is not None:
            self._load()

    # -- shapes ---------------------------------------------------------------------------------
    def _dtypes(self) -> tuple[torch.dtype, torch.dtype | None]:
        """(K/V dtype, CIS dtype or None) of this store's blocks, from its identity."""
        names = self.identity["dtype"]
        return getattr(torch, names["kv"]), None if names["cis"] is None else getattr(torch, names["cis"])

    def block_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of a block's tensors for this model."""
        config = self.model.config
        kv, cis = self._dtypes()
        shape = (config.num_hidden_layers, self.block_size, config.num_key_value_heads, config.head_dim)
        shapes = {"keys": (shape, kv), "values": (shape, kv)}
        if cis is not None:
            shapes["cis"] = (shape[:3], cis)
        return shapes

    def _new_pools(self) -> list[HostBlockPool]:
        """One empty pool per layer, of this model's geometry (pinned where the model runs on CUDA)."""
        config = self.model.config
        kv, cis = self._dtypes()
        pin = any(device.type == "cuda" for device in self._devices())
        return [HostBlockPool(self.block_size, config.num_key_value_heads, config.head_dim, kv, cis is not None, cis, pin)
                for _ in range(config.num_hidden_layers)]

    def _devices(self) -> list[torch.device]:
        return [layer.input_layernorm.weight.device for layer in self.model.model.layers]

    # -- caches ---------------------------------------------------------------------------------
    def new_cache(self, mode: str | None = None, max_length: int | None = None):
        """An empty cache for this store's model and selector: a resident `SparseCache` (mode None)
        or an `OffloadedSparseCache` of `mode`."""
        if mode is None:
            return SparseCache(self.model.config, max_length=max_length, selector=self.selector)
        from ..inference.offloaded import MODE_SELECTOR, OffloadedSparseCache

        selector = MODE_SELECTOR.get(mode) or self.selector
        if self.selector is not None and selector != self.selector:
            raise ValueError(f"mode {mode!r} selects with the {selector} selector, but this store keeps prefills routed by the {self.selector} selector; "
                             f"open a ContextStore with selector={selector!r} for it")
        return OffloadedSparseCache.for_model(self.model, mode=mode, max_length=max_length)

    def lookup(self, ids, mode: str | None = None, max_length: int | None = None, reserve: int | None = None):
        """The longest stored prefix of `ids` ([T] or [1, T] token ids) in a fresh cache.

        Returns (cache, matched): the cache holds positions 0..matched-1, matched a multiple of the
        block size and at most T - 1 (generate() needs one token to prefill); pass the cache with
        the whole `ids` to generate(), which prefills ids[matched:] only.  mode/max_length: as
        `new_cache`; reserve: rows the cache allocates at once (prompt + new tokens)."""
        tokens = sequence_ids(ids)
        if not tokens:
            raise ValueError("lookup needs at least one token id")
        usable = (len(tokens) - 1) // self.block_size
        found = []
        for position, name in enumerate(chain_hashes(self.root, tokens, self.block_size, usable)):
            entry = self.entries.get(name)
            if entry is None:
                break
            expected = tokens[position * self.block_size : (position + 1) * self.block_size]
            if entry.tokens != expected:
                raise ContextStoreError(f"token mismatch: stored block {name[:16]} (block {position}) holds other tokens than its name covers; the store is corrupted")
            found.append(entry)
        found = self._load_blocks(found)  # a block that is gone or bad on disk ends the match there
        cache = self.new_cache(mode, max_length)
        if reserve is not None:
            cache.reserve(reserve)
        matched = self._fill(cache, [entry.blocks for entry in found])
        set_tokens(cache, tokens[:matched])  # the cache's record: these tokens hash to the blocks' names
        self._hold(cache, [entry.name for entry in found])
        self._touch(found)
        self.hit_tokens += matched
        self.miss_tokens += len(tokens) - matched
        return cache, matched

    def insert(self, cache, ids) -> int:
        """Keep the full blocks of `ids` ([T] or [1, T]: the tokens the one sequence of `cache`
        holds, from position 0) that the store lacks.  Returns the blocks added; blocks that would
        not fit under max_bytes once every unreferenced block is gone are not added (`stats()`
        counts them as rejected).  The cache references its blocks until it is released."""
        tokens = sequence_ids(ids)
        self._check_cache(cache, len(tokens))
        self._check_tokens(cache, tokens)
        full = len(tokens) // self.block_size
        names = chain_hashes(self.root, tokens, self.block_size, full)
        stored = []
        for name in names:
            if name not in self.entries:
                break
            stored.append(self.entries[name])
        first = len(self._load_blocks(stored))  # blocks gone or bad on disk are taken from the cache again
        self._hold(cache, names[:first])  # held from the start: making room never evicts the chain it extends
        per_block = self.block_nbytes()
        added = 0
        while first + added < full and self._make_room((added + 1) * per_block):
            added += 1
        self.rejected += full - first - added
        for position, blocks in enumerate(self._take_blocks(cache, first, added), start=first):
            parent = names[position - 1] if position else None
            chunk = tokens[position * self.block_size : (position + 1) * self.block_size]
            self._add(Entry(names[position], parent, position, chunk, blocks, None, per_block))
            self._hold(cache, [names[position]])
        self._touch([self.entries[name] for name in names[: first + added]])
        return added

    # -- the pools ------------------------------------------------------------------------------
    def block_nbytes(self) -> int:
        """Bytes of one stored block, every layer (K + V + CIS)."""
        return sum(pool.block_nbytes() for pool in self.pools)

    def _fill(self, cache, chain: list[list[int]]) -> int:
        """Give an empty `cache` the positions stored in `chain` (per block, its id per layer):
        offloaded layers attach to the store's blocks and take their new blocks from its pools;
        resident layers get the rows appended on their device.  Returns the positions given."""
        devices, length = self._devices(), len(chain) * self.block_size
        offloaded = [getattr(layer, "offloaded", False) for layer in cache.layers]
        if any(offloaded):
            cache.use_pools([pool if off else None for pool, off in zip(self.pools, offloaded)])
        if not chain:
            return 0
        entries = []
        with host_transfer():
            for index, (pool, device, off) in enumerate(zip(self.pools, devices, offloaded)):
                ids = [blocks[index] for blocks in chain]
                if off:
                    entries.append((pool, ids, device))
                else:
                    entries.append(tuple(None if t is None else t.unsqueeze(0).to(device) for t in pool.read_rows(ids, length)))
        if any(offloaded):
            cache.attach(entries, length)
        else:
            for layer, (keys, values, cis) in zip(cache.layers, entries):
                layer.append(keys, values, cis, torch.arange(length, device=keys.device).unsqueeze(0))
        return length

    def _take_blocks(self, cache, first: int, count: int) -> list[list[int]]:
        """Blocks first..first+count-1 of the one sequence of `cache` into the store, per block
        its id per layer: an offloaded layer on the store's pool gives its full blocks by
        reference (one more holder: the store's); any other layer's rows are copied into new blocks."""
        per_layer, size = [], self.block_size
        for layer, pool in zip(cache.layers, self.pools):
            host = getattr(layer, "host", None)
            if host is not None and host.pool is pool:
                ids = host.sequence_blocks(0)[first : first + count]
                pool.retain(ids)
            else:
                rows = layer_rows(layer, first * size, (first + count) * size) if count else ()
                pool.reserve(count)
                ids = pool.allocate(count)
                with host_transfer():
                    for position, block in enumerate(ids):
                        for target, source in zip(pool.block(block), rows):
                            if target is not None:
                                target.copy_(source[position * size : (position + 1) * size])
            per_layer.append(ids)
        return [list(blocks) for blocks in zip(*per_layer)] if count else []

    def _load_blocks(self, chain: list[Entry]) -> list[Entry]:
        """Read the blocks of `chain` (root first) that are on disk only into the pools, under the
        namespace's shared lock, after revalidating against the index if another process changed
        it.  Returns the leading part of `chain` that is now in the pools: a block that is gone
        (removed by another process) or bad (with a warning) ends it, and leaves the store."""
        if all(entry.blocks is not None for entry in chain):
            return chain
        loaded = []
        try:
            with disk.Namespace(self.dir, self.namespace, create=False) as space, space.lock(exclusive=False):
                if disk.index_head(space) != self._seen:
                    self._revalidate(space)
                missing = [entry for entry in chain if entry.blocks is None]
                for pool in self.pools:
                    pool.reserve(len(missing))
                for entry in chain:
                    if self.entries.get(entry.name) is not entry:
                        break
                    if entry.blocks is None:
                        block = self._read_block(space, entry)
                        if block is None:
                            break
                        entry.blocks = []
                        for index, pool in enumerate(self.pools):
                            (target,) = pool.allocate(1)
                            with host_transfer():
                                for view, rows in zip(pool.block(target), block.layer(index)):
                                    if view is not None:
                                        view.copy_(rows)
                            entry.blocks.append(target)
                    loaded.append(entry)
        except (OSError, ContextStoreError) as error:  # the namespace itself is gone or refused: what is not in memory is a miss
            disk.warn(f"context store {self.dir}/{self.namespace} could not be read ({error}); blocks not in memory are misses")
        return loaded

    def _read_block(self, space: disk.Namespace, entry: Entry) -> disk.DiskBlock | None:
        """A block's verified file, or None (the block and its descendants dropped, with a warning)."""
        try:
            return disk.DiskBlock(disk.verified_block(space, entry.disk, self._shape_names()), str(space.path / entry.disk["file"]))
        except (OSError, ContextStoreError) as error:
            disk.warn(f"block {entry.name[:16]} of {space.path} skipped ({error}): a miss for its chain; the next save drops it")
            self._drop(entry, forget_on_disk=True)
            return None

    def _shape_names(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {name: (shape, dtype_name(dtype)) for name, (shape, dtype) in self.block_shapes().items()}

    def _map_blocks(self, space: disk.Namespace, entries: list[Entry]) -> None:
        """CPU: back each layer's pool by a file of the loaded blocks in pool order, mapped
        copy-on-write (`HostBlockPool.map_file`), so a lookup and a decode make resident only the
        pages they touch (the blocks a decode step selects, the cache's own blocks), not the host
        tier.  The files are unnamed temporary files in the namespace directory (gone with the
        process, never seen by `save`), written once from the block files, each verified as it
        is read (a bad one is dropped with its chain); the pools keep `spare` free blocks for the
        caches' own rows (past them a pool moves to anonymous memory)."""
        spare = max(MAPPED_SPARE_BLOCKS, len(entries) // 8)
        capacity = len(entries) + spare
        files = [space.temporary_file() for _ in self.pools]
        layouts = [pool.file_layout(capacity) for pool in self.pools]
        mapped = []
        for entry in entries:
            if self.entries.get(entry.name) is not entry:
                continue  # dropped with a bad ancestor
            block = self._read_block(space, entry)
            if block is None:
                continue
            for index, (file, layout) in enumerate(zip(files, layouts)):
                for (offset, size), rows in zip(layout, block.layer(index)):
                    if rows is not None:
                        raw = rows.reshape(-1).view(torch.uint8).numpy()
                        os.pwrite(file.fileno(), raw, offset + len(mapped) * (size // capacity))
            mapped.append(entry)
        for pool, file in zip(self.pools, files):
            pool.map_file(file, len(mapped), capacity)
        for position, entry in enumerate(mapped):
            if self.entries.get(entry.name) is entry:
                entry.blocks = [position] * len(self.pools)
            else:  # its parent turned out bad after it was read
                for pool in self.pools:
                    pool.release([position])

    def block_rows(self, name: str) -> BlockRows:
        """A copy of stored block `name`'s rows, every layer: keys, values [L, bs, H, d], cis or None."""
        entry = self.entries[name]
        if not self._load_blocks([entry]):
            raise ContextStoreError(f"block {name[:16]} could not be read from disk")
        with host_transfer():
            parts = [pool.read_rows([block], self.block_size) for pool, block in zip(self.pools, entry.blocks)]
        return BlockRows(*(None if parts[0][i] is None else torch.stack([p[i] for p in parts]) for i in range(3)))

    def _live(self, entry: Entry) -> bool:
        """Whether anything beyond the store holds one of `entry`'s blocks (a live cache)."""
        return entry.blocks is not None and any(pool.refs[block] > 1 for pool, block in zip(self.pools, entry.blocks))

    def _check_cache(self, cache, count: int) -> None:
        """Raise unless `cache` holds one sequence of at least `count` tokens of this model,
        prefilled with this store's selector, in its dtype."""
        if not isinstance(cache, SparseCache):
            raise TypeError(f"insert takes a SparseCache or OffloadedSparseCache, got {type(cache).__name__}")
        cache.check_model(self.model.config)
        selector = (getattr(cache, "selector", None) or self.model.config.sparse.selector) if self.selector is not None else None
        if selector != self.selector:
            raise ContextStoreError(f"the cache was prefilled with the {selector} selector, but this store keeps prefills of the {self.selector} selector")
        layer = cache.layers[0]
        held = cache.host_lengths()
        if held is None:
            raise ValueError("the cache holds no tokens yet")
        if len(held) != 1:
            raise ValueError(f"insert takes a cache of one sequence, this one holds {len(held)}")
        if dtype_name(layer.dtype) != self.identity["dtype"]["kv"]:
            raise ContextStoreError(f"the cache holds {dtype_name(layer.dtype)} K/V, this store keeps {self.identity['dtype']['kv']}")
        if count > held[0]:
            raise ContextStoreError(f"token mismatch: ids has {count} tokens but the cache holds {held[0]}")

    @staticmethod
    def _check_tokens(cache, tokens: list[int]) -> None:
        """Raise unless `tokens` are the tokens `cache` was prefilled with (its own record,
        `modeling/token_record.py`), from position 0."""
        record = recorded_tokens(cache)
        if record is None:
            raise ContextStoreError("the cache has no record of the tokens it holds (it was filled without a forward call of the model, "
                                    "or its batch changed since): insert cannot check ids against it")
        known = record[0]
        if len(tokens) > len(known):
            raise ContextStoreError(f"the cache's record knows its first {len(known)} tokens (prefilled ones; decode steps and inputs_embeds "
                                    f"calls are not recorded), ids has {len(tokens)}: insert ids[:{len(known)}] or fewer")
        differ = next((i for i, (a, b) in enumerate(zip(tokens, known)) if a != b), None)
        if differ is not None:
            raise ContextStoreError(f"token mismatch: ids[{differ}] = {tokens[differ]}, but the cache was prefilled with {known[differ]} there; "
                                    "insert takes the ids the cache was prefilled with")

    # -- references -----------------------------------------------------------------------------
    def _hold(self, cache, names: list[str]) -> None:
        """Count `cache` as a reference of each named block (once per cache)."""
        key = id(cache)
        if key not in self._holders:
            self._holders[key] = ({}, weakref.finalize(cache, self._release_key, key))
        held = self._holders[key][0]
        for name in names:
            if name not in held:
                held[name] = self.entries[name].blocks[0]  # in the pools: lookup and insert load their chains first
                self.pools[0].retain([held[name]])

    def release(self, cache) -> None:
        """Drop `cache`'s references (also done when the cache is garbage collected)."""
        record = self._holders.get(id(cache))
        if record is not None:
            record[1].detach()
            self._release_key(id(cache))

    def _release_key(self, key: int) -> None:
        held, _ = self._holders.pop(key, ({}, None))
        self.pools[0].release(list(held.values()))  # the blocks held, even if the store dropped their entries since

    # -- LRU ------------------------------------------------------------------------------------
    def _touch(self, chain: list[Entry]) -> None:
        """Mark a chain used, its root last (most recent): LRU then evicts tips before roots."""
        now = time.time()
        for entry in reversed(chain):
            entry.used = now
            self.entries.move_to_end(entry.name)

    def _add(self, entry: Entry) -> None:
        self._evicted.discard(entry.name)
        self.entries[entry.name] = entry
        self.nbytes += entry.nbytes
        if entry.parent is not None:
            self.entries[entry.parent].children.add(entry.name)

    def _make_room(self, nbytes: int) -> bool:
        """Evict unreferenced blocks, least recently used first, until `nbytes` more fit under
        the cap; False if they cannot."""
        if self.max_bytes is None:
            return True
        for name in list(self.entries):
            if self.nbytes + nbytes <= self.max_bytes:
                break
            entry = self.entries.get(name)
            if entry is not None and not self._live(entry):
                self._evict(entry)
        return self.nbytes + nbytes <= self.max_bytes

    def _evict(self, entry: Entry) -> None:
        """Remove `entry` and its descendants (a block is referenced only with its ancestors, so
        none of them is referenced).  Files on disk go at the next `save()`."""
        self.evictions += self._remove(entry, forget_on_disk=True)

    def _drop(self, entry: Entry, forget_on_disk: bool) -> None:
        """Remove `entry` and its descendants because of the disk: another process removed them
        (forget_on_disk False: the index no longer names them) or the file is bad (True: the next
        save drops it from the index).  Caches built from them keep their own references."""
        self.dropped += self._remove(entry, forget_on_disk)

    def _remove(self, entry: Entry, forget_on_disk: bool) -> int:
        """Remove `entry` and its descendants from the store and its pools; returns how many."""
        removed = 0
        for child in list(entry.children):
            if child in self.entries:
                removed += self._remove(self.entries[child], forget_on_disk)
        del self.entries[entry.name]
        if forget_on_disk and entry.disk is not None:
            self._evicted.add(entry.name)
        if entry.blocks is not None:
            for pool, block in zip(self.pools, entry.blocks):
                pool.release([block])
        self.nbytes -= entry.nbytes
        if entry.parent is not None and entry.parent in self.entries:
            self.entries[entry.parent].children.discard(entry.name)
        return removed + 1

    def stats(self) -> dict:
        """Counters and sizes: hit/miss tokens of lookups, evictions, blocks rejected by the cap,
        blocks and bytes held, blocks referenced by live caches."""
        return {
            "hit_tokens": self.hit_tokens, "miss_tokens": self.miss_tokens, "evictions": self.evictions, "rejected_blocks": self.rejected,
            "blocks": len(self.entries), "tokens": len(self.entries) * self.block_size, "bytes": self.nbytes, "max_bytes": self.max_bytes,
            "referenced_blocks": sum(1 for entry in self.entries.values() if self._live(entry)),
            "dropped_blocks": self.dropped,
        }

    # -- disk -----------------------------------------------------------------------------------
    def save(self) -> Path:
        """Merge this store into the namespace on disk under its exclusive lock: read the index,
        keep what other processes saved there (their blocks join this store, on disk only), drop
        what they removed, drop what this store evicted, evict under max_bytes, write the new
        blocks, replace the index atomically (next generation), then delete the files it does not
        name.  Returns the namespace directory."""
        if self.dir is None:
            raise ValueError("this ContextStore has no directory: build it with ContextStore(model, dir)")
        with disk.Namespace(self.dir, self.namespace, create=True) as space, space.lock(exclusive=True):
            try:
                index = disk.read_index(space)
            except disk.BrokenIndex as error:
                disk.warn(f"{error}: this save rebuilds it from this store's blocks")
                index = None
            self._merge(space, index)
            records = []
            for entry in self.entries.values():
                if entry.disk is None:
                    rows = self.block_rows(entry.name)
                    tensors = {"keys": rows.keys.contiguous(), "values": rows.values.contiguous()}
                    if rows.cis is not None:
                        tensors["cis"] = rows.cis.contiguous()
                    data = disk.block_bytes(tensors, entry.name)
                    space.write(disk.block_file(entry.name), data)
                    entry.disk = {"file": disk.block_file(entry.name), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                records.append({"hash": entry.name, "parent": entry.parent, "position": entry.position, "tokens": entry.tokens,
                                "nbytes": entry.nbytes, **entry.disk, "used": entry.used})
            generation = (index or {}).get("generation", 0) + 1
            written = disk.new_index(self.namespace, self.identity, self.block_size, records, generation)
            disk.write_index(space, written)
            self._seen, self._evicted = (generation, written["stamp"]), set()
            disk.remove_unlisted(space, {record["file"] for record in records})
            return space.path

    def _order(self) -> None:
        """Entries least recently used first; within one use, tips before roots."""
        order = sorted(self.entries.values(), key=lambda entry: (entry.used, -entry.position))
        self.entries = OrderedDict((entry.name, entry) for entry in order)

    def _check_identity(self, space: disk.Namespace, index: dict) -> None:
        differences = identity_differences(self.identity, index.get("identity") or {})
        if differences and index["entries"]:
            named = {line.split(":")[0] for line in differences}
            parts = [part for part in ("model", "geometry", "dtype") if part in named] + sorted(named - {"model", "geometry", "dtype"})
            raise ContextStoreError(f"{space.path} holds blocks of another {' / '.join(parts)}: " + "; ".join(differences))

    def _good_records(self, space: disk.Namespace, index: dict | None) -> list[dict]:
        """The index's well-formed entries of this store's identity (problems warned about)."""
        if index is None or not index["entries"]:
            return []
        self._check_identity(space, index)
        good, problems = disk.check_entries(index, self.root)
        if problems:
            shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
            disk.warn(f"{space.path / disk.INDEX}: {len(problems)} entries skipped (misses; the next save drops them): {shown}")
        return good

    def _revalidate(self, space: disk.Namespace) -> None:
        """Under the shared lock, after another process changed the index: drop what it removed."""
        try:
            index = disk.read_index(space)
        except disk.BrokenIndex:
            index = None
        names = {record["hash"] for record in self._good_records(space, index)}
        for entry in list(self.entries.values()):
            if self.entries.get(entry.name) is entry and entry.disk is not None and entry.name not in names:
                self._drop(entry, forget_on_disk=False)
        self._seen = None if index is None else (index.get("generation", 0), index.get("stamp"))

    def _merge(self, space: disk.Namespace, index: dict | None) -> None:
        """Under the exclusive lock: this store becomes the index's blocks (other processes' join,
        on disk only) minus what this store evicted, plus its own new blocks; then the cap."""
        records = self._good_records(space, index)
        on_disk = {record["hash"]: record for record in records}
        for entry in list(self.entries.values()):
            if self.entries.get(entry.name) is entry and entry.disk is not None and entry.name not in on_disk:
                self._drop(entry, forget_on_disk=False)  # removed by another process (rm, eviction)
        for record in sorted(records, key=lambda record: record["position"]):  # parents first
            name = record["hash"]
            entry = self.entries.get(name)
            fields = {key: record[key] for key in ("file", "bytes", "sha256")}
            used = float(record.get("used") or 0.0)
            if entry is not None:
                entry.used = max(entry.used, used)
                if entry.disk is None:
                    entry.disk = fields  # the same block, saved by another process: its file serves
            elif name not in self._evicted and (record["parent"] is None or record["parent"] in self.entries) and space.size(record["file"]) == record["bytes"]:
                self._add(Entry(name, record["parent"], record["position"], list(record["tokens"]), None, fields, record["nbytes"], used=used))
        self._order()
        self._make_room(0)

    def _load(self) -> None:
        """Read the namespace's index under the shared lock and its blocks (each verified; on the
        CPU mapped, on CUDA read when a lookup needs them).  Bad or missing blocks are misses for
        their chains (with a warning), an unreadable index an empty store."""
        try:
            space = disk.Namespace(self.dir, self.namespace, create=False)
        except FileNotFoundError:
            return
        with space, space.lock(exclusive=False):
            try:
                index = disk.read_index(space)
            except disk.BrokenIndex as error:
                disk.warn(f"{error}: the store starts empty; the next save rebuilds the index (or run `forecastkv context-cache repair`)")
                return
            if index is None:
                return
            self._seen = (index.get("generation", 0), index.get("stamp"))
            for record in sorted(self._good_records(space, index), key=lambda record: record["position"]):  # parents first
                fields = {key: record[key] for key in ("file", "bytes", "sha256")}
                if record["parent"] is None or record["parent"] in self.entries:
                    self._add(Entry(record["hash"], record["parent"], record["position"], list(record["tokens"]), None, fields, record["nbytes"],
                                    used=float(record.get("used") or 0.0)))
            self._order()
            if self.entries and not self.pools[0].pin:
                self._map_blocks(space, list(self.entries.values()))
            for entry in list(self.entries.values()):  # lazily read (pinned pools): at least the sizes now
                if self.entries.get(entry.name) is entry and entry.blocks is None and space.size(entry.disk["file"]) != entry.disk["bytes"]:
                    disk.warn(f"block {entry.name[:16]} of {space.path} is missing or has another size than its index records: a miss for its chain")
                    self._drop(entry, forget_on_disk=True)
        self._make_room(0)
