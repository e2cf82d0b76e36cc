"""`ContextStore`: prefilled KV blocks kept by content, so a prompt that shares a prefix with an
earlier one prefills only the rest.

    store = ContextStore(model, "ctx-cache", max_bytes=8 << 30)   # loads what the directory holds
    cache, matched = store.lookup(ids, mode="forecast-offload")   # the longest stored prefix
    out = model.generate(ids, cache=cache, max_new_tokens=64)    # prefills ids[matched:] only
    store.insert(cache, ids)                                      # keep the prompt's full blocks
    store.save()                                                  # blocks + index, atomically

A store serves one model and one selector (the K/V of a prefill depend on the blocks its selector
routed to): a block's name hashes the tokens up to and including it together with that identity
(`blocks.model_identity`).  Blocks are immutable and shared by name; `lookup` copies them into a
fresh cache (resident `SparseCache`, or an `OffloadedSparseCache` of the given mode) by replaying
a prefill's appends, which gives the compressed keys and every derived state exactly.

Memory: a byte cap (`max_bytes`) with LRU eviction.  A block a live cache holds (one returned by
`lookup`, or given to `insert`) is referenced until that cache is released (`release`) or garbage
collected, and is never evicted; evicting a block evicts its descendants (they could never be
reached again), and lookups refresh a chain from its deepest block to its root, so the tips of
old chains go first.  Counters: hit tokens, miss tokens, evictions (`stats`).
"""

from __future__ import annotations

import getpass
import re
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..modeling.cache import SparseCache
from . import disk
from .blocks import BlockRows, block_hash, chain_hashes, dtype_name, fill_cache, identity_differences, identity_root, model_identity, read_blocks, sequence_ids
from .disk import ContextStoreError


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
    rows in memory (or None: on disk only, mapped when used), its disk record, bytes, references."""

    name: str
    parent: str | None
    position: int
    tokens: list[int]
    rows: BlockRows | None
    disk: dict | None
    nbytes: int
    refs: int = 0
    children: set[str] = field(default_factory=set)


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
        self.hit_tokens = self.miss_tokens = self.evictions = self.rejected = 0
        self._holders: dict[int, tuple[set[str], weakref.finalize]] = {}
        if self.dir is not None:
            self._load()

    # -- shapes ---------------------------------------------------------------------------------
    def block_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of a block's tensors for this model."""
        config = self.model.config
        kv = getattr(torch, self.identity["dtype"]["kv"])
        shape = (config.num_hidden_layers, self.block_size, config.num_key_value_heads, config.head_dim)
        shapes = {"keys": (shape, kv), "values": (shape, kv)}
        if self.identity["dtype"]["cis"] is not None:
            shapes["cis"] = (shape[:3], getattr(torch, self.identity["dtype"]["cis"]))
        return shapes

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
        cache = self.new_cache(mode, max_length)
        if reserve is not None:
            cache.reserve(reserve)
        matched = fill_cache(cache, [self._rows(entry) for entry in found], self._devices(), self.block_size)
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
        full = len(tokens) // self.block_size
        names = chain_hashes(self.root, tokens, self.block_size, full)
        first = next((i for i, name in enumerate(names) if name not in self.entries), full)
        added = 0
        self._hold(cache, names[:first])  # held from the start: making room never evicts the chain it extends
        rows = read_blocks(cache, first, full - first, self.block_size) if first < full else []
        for position, block in enumerate(rows, start=first):
            if not self._make_room(block.nbytes()):
                self.rejected += full - position
                break
            parent = names[position - 1] if position else None
            chunk = tokens[position * self.block_size : (position + 1) * self.block_size]
            self._add(Entry(names[position], parent, position, chunk, block, None, block.nbytes()))
            self._hold(cache, [names[position]])
            added += 1
        self._touch([self.entries[name] for name in names[: first + added]])
        return added

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

    # -- references -----------------------------------------------------------------------------
    def _hold(self, cache, names: list[str]) -> None:
        """Count `cache` as a reference of each named block (once per cache)."""
        key = id(cache)
        if key not in self._holders:
            self._holders[key] = (set(), weakref.finalize(cache, self._release_key, key))
        held = self._holders[key][0]
        for name in names:
            if name not in held:
                held.add(name)
                self.entries[name].refs += 1

    def release(self, cache) -> None:
        """Drop `cache`'s references (also done when the cache is garbage collected)."""
        record = self._holders.get(id(cache))
        if record is not None:
            record[1].detach()
            self._release_key(id(cache))

    def _release_key(self, key: int) -> None:
        names, _ = self._holders.pop(key, (set(), None))
        for name in names:
            entry = self.entries.get(name)
            if entry is not None:
                entry.refs -= 1

    # -- LRU ------------------------------------------------------------------------------------
    def _touch(self, chain: list[Entry]) -> None:
        """Mark a chain used, its root last (most recent): LRU then evicts tips before roots."""
        for entry in reversed(chain):
            self.entries.move_to_end(entry.name)

    def _add(self, entry: Entry) -> None:
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
            if entry is not None and entry.refs == 0:
                self._evict(entry)
        return self.nbytes + nbytes <= self.max_bytes

    def _evict(self, entry: Entry) -> None:
        """Remove `entry` and its descendants (a block is referenced only with its ancestors, so
        none of them is referenced).  Files on disk go at the next `save()`."""
        for child in list(entry.children):
            self._evict(self.entries[child])
        del self.entries[entry.name]
        self.nbytes -= entry.nbytes
        self.evictions += 1
        if entry.parent is not None and entry.parent in self.entries:
            self.entries[entry.parent].children.discard(entry.name)

    def _rows(self, entry: Entry) -> "BlockRows | disk.DiskBlock":
        """A block's rows: in memory, or its file, read layer by layer as a cache is filled."""
        if entry.rows is not None:
            return entry.rows
        return disk.DiskBlock(self._directory(create=False) / entry.disk["file"])

    def stats(self) -> dict:
        """Counters and sizes: hit/miss tokens of lookups, evictions, blocks rejected by the cap,
        blocks and bytes held, blocks referenced by live caches."""
        return {
            "hit_tokens": self.hit_tokens, "miss_tokens": self.miss_tokens, "evictions": self.evictions, "rejected_blocks": self.rejected,
            "blocks": len(self.entries), "tokens": len(self.entries) * self.block_size, "bytes": self.nbytes, "max_bytes": self.max_bytes,
            "referenced_blocks": sum(1 for entry in self.entries.values() if entry.refs > 0),
        }

    # -- disk -----------------------------------------------------------------------------------
    def _directory(self, create: bool) -> Path:
        if self.dir is None:
            raise ValueError("this ContextStore has no directory: build it with ContextStore(model, dir)")
        return disk.namespace_dir(self.dir, self.namespace, create)

    def save(self) -> Path:
        """Write new blocks, then the index, atomically; then delete files of evicted blocks.
        Returns the namespace directory."""
        directory = self._directory(create=True)
        with disk.namespace_lock(directory):  # one saver at a time per namespace
            records = []
            for entry in self.entries.values():
                if entry.disk is None or (entry.rows is not None and not (directory / entry.disk["file"]).exists()):
                    entry.disk = disk.write_block(directory, entry.name, entry.rows)
                records.append({"hash": entry.name, "parent": entry.parent, "position": entry.position, "tokens": entry.tokens, "nbytes": entry.nbytes, **entry.disk})
            index = {"format": disk.FORMAT, "namespace": self.namespace, "identity": self.identity, "block_size": self.block_size, "entries": records}
            disk.write_index(directory, index)
            disk.remove_unlisted(directory, {record["file"] for record in records})
        return directory

    def _load(self) -> None:
        """Read the namespace's index and check every block (nothing is kept unless all pass)."""
        if not (self.dir / self.namespace).exists():
            return
        directory = self._directory(create=False)
        index = disk.read_index(directory, self.namespace)
        if index is None:
            return
        differences = identity_differences(self.identity, index.get("identity") or {})
        if differences:
            parts = sorted({line.split(":")[0] for line in differences}, key=["model", "geometry", "dtype"].index)
            raise ContextStoreError(f"{directory} holds blocks of another {' / '.join(parts)}: " + "; ".join(differences))
        shapes = self.block_shapes()
        loaded: OrderedDict[str, Entry] = OrderedDict()
        for record in index["entries"]:
            name, parent, position, tokens = record["hash"], record["parent"], record["position"], record["tokens"]
            if len(tokens) != self.block_size or block_hash(parent or self.root, tokens) != name:
                raise ContextStoreError(f"token mismatch: block {name[:16]} in {directory / disk.INDEX} lists tokens that do not hash to its name")
            if (parent is None) != (position == 0):
                raise ContextStoreError(f"block {name[:16]} is at position {position} with parent {parent!r}: the index is corrupted")
            disk.verify_block(directory, record, shapes)
            entry = Entry(name, parent, position, list(tokens), None, {key: record[key] for key in ("file", "bytes", "sha256")}, record["nbytes"])
            loaded[name] = entry
        for entry in loaded.values():
            if entry.parent is not None:
                if entry.parent not in loaded:
                    raise ContextStoreError(f"block {entry.name[:16]} names a parent {entry.parent[:16]} the index does not hold")
                loaded[entry.parent].children.add(entry.name)
        self.entries = loaded
        self.nbytes = sum(entry.nbytes for entry in loaded.values())
        self._make_room(0)
