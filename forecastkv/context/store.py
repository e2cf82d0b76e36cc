"""`ContextStore`: prefilled KV blocks kept by content, so a prompt that shares a prefix with an
earlier one prefills only the rest.

    store = ContextStore(model, "ctx-cache", max_bytes=8 << 30)   # loads what the directory holds
    cache, matched = store.lookup(ids, mode="forecast-offload")   # the longest stored prefix
    out = model.generate(ids, cache=cache, max_new_tokens=64)    # prefills ids[matched:] only
    store.insert(cache, ids)                                      # keep the prompt's full blocks
    store.save()                                                  # blocks + index, atomically

A store serves one model and one selector (the K/V of a prefill depend on the blocks its selector
routed to): a block's name hashes the tokens up to and including it together with that identity
(`blocks.model_identity`).  Blocks are immutable and shared by name.  The store keeps them in one
`HostBlockPool` per layer (the paged host tier, pinned on CUDA), holding one reference on each of
its blocks:

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
that cache is garbage collected.  A live block is never evicted; evicting a block evicts its
descendants (they could never be reached again), and lookups refresh a chain from its deepest
block to its root, so the tips of old chains go first.  Counters: hit tokens, miss tokens,
evictions (`stats`).

The store is three parts, along vLLM v1 kv_offload's manager/worker line: the index and the LRU
(`context/index.py`: names, block ids, holds, eviction), the rows (`context/transfer.py`: copies
into and out of the pools) and the disk tier (`context/persist.py`: load, lazy reads, save).
"""

from __future__ import annotations

import getpass
import re
from pathlib import Path

import torch

from ..errors import UserInputError
from ..inference.host_store import HostBlockPool
from ..modeling.cache import SparseCache
from ..modeling.token_record import recorded_tokens, set_tokens
from ..modes import STORE_SELECTORS
from . import disk
from .blocks import BlockRows, dtype_name, identity_root, model_identity, sequence_ids
from .disk import ContextStoreError
from .index import BlockIndex, Entry
from .persist import DiskTier
from .transfer import copy_out, fill, take_blocks


def default_namespace() -> str:
    """The caller's login name as a namespace (characters a namespace may not hold become '_')."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container)
        name = "default"
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "default"


def _check_max_bytes(max_bytes) -> None:
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
        raise UserInputError(f"max_bytes must be a non-negative integer or None (no cap), got {max_bytes!r}")


class ContextStore:
    """Content-addressed KV blocks of one model, in memory and (with `dir`) on disk.

    model: the ForecastKVForCausalLM whose caches it fills.  dir: the store's root directory; the
    namespace's blocks are loaded from it (validated: model, geometry, dtype, sizes, checksums,
    tokens) and `save()` writes them back.  max_bytes: cap on the blocks' bytes (None: no cap).
    namespace: this user's private part of `dir` (default: the login name).  selector: the
    selector whose prefills the store keeps (default: the model's; "query" serves sparse-offload,
    "forecast" the forecast modes).
    """

    def __init__(
        self,
        model,
        dir: str | Path | None = None,
        *,
        max_bytes: int | None = None,
        namespace: str | None = None,
        selector: str | None = None,
    ) -> None:
        _check_max_bytes(max_bytes)
        sparse = model.config.sparse
        if selector is not None and selector not in STORE_SELECTORS:
            raise UserInputError(f"selector={selector!r} is not None or one of {STORE_SELECTORS}")
        self.model = model
        self.selector = (selector or sparse.selector) if sparse is not None else None
        self.block_size = sparse.block_size if sparse is not None else 64
        self.identity = model_identity(model, self.selector)
        self.root = identity_root(self.identity)
        namespace = disk.check_namespace_name(namespace if namespace is not None else default_namespace())
        self.hit_tokens = self.miss_tokens = self.rejected = 0
        self.pools = self._new_pools()
        self.index = BlockIndex(self.pools, self.root, self.block_size, max_bytes)
        shapes = {name: (shape, dtype_name(dtype)) for name, (shape, dtype) in self.block_shapes().items()}
        self.disk_tier = DiskTier(None if dir is None else Path(dir), namespace, self.identity, self.index, shapes)
        if self.dir is not None:
            self.disk_tier.load()

    # -- where it lives on disk (the disk tier's; setting them moves the next read or save) ------
    @property
    def dir(self) -> Path | None:
        """The store's root directory (None: in memory only)."""
        return self.disk_tier.root

    @dir.setter
    def dir(self, value: Path | None) -> None:
        self.disk_tier.root = value

    @property
    def namespace(self) -> str:
        """This user's private part of `dir`."""
        return self.disk_tier.namespace

    @namespace.setter
    def namespace(self, value: str) -> None:
        self.disk_tier.namespace = value

    # -- what the index holds -------------------------------------------------------------------
    @property
    def entries(self) -> dict[str, Entry]:
        """Stored block name -> its `Entry`, least recently used first."""
        return self.index.entries

    @property
    def nbytes(self) -> int:
        """Bytes of the stored blocks."""
        return self.index.nbytes

    @property
    def max_bytes(self) -> int | None:
        """Cap on the stored blocks' bytes (None: no cap)."""
        return self.index.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int | None) -> None:
        _check_max_bytes(value)
        self.index.max_bytes = value

    @property
    def evictions(self) -> int:
        return self.index.evictions

    @property
    def dropped(self) -> int:
        return self.index.dropped

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
        heads, head_dim = config.num_key_value_heads, config.head_dim
        return [
            HostBlockPool(self.block_size, heads, head_dim, kv, cis is not None, cis, pin)
            for _ in range(config.num_hidden_layers)
        ]

    def _devices(self) -> list[torch.device]:
        return [layer.input_layernorm.weight.device for layer in self.model.model.layers]

    def block_nbytes(self) -> int:
        """Bytes of one stored block, every layer (K + V + CIS)."""
        return sum(pool.block_nbytes() for pool in self.pools)

    # -- caches ---------------------------------------------------------------------------------
    def new_cache(self, mode: str | None = None, max_length: int | None = None):
        """An empty cache for this store's model and selector: a resident `SparseCache` (mode None)
        or an `OffloadedSparseCache` of `mode`."""
        if mode is None:
            return SparseCache(self.model.config, max_length=max_length, selector=self.selector)
        from ..inference.offloaded import MODE_SELECTOR, OffloadedSparseCache

        selector = MODE_SELECTOR.get(mode) or self.selector
        if self.selector is not None and selector != self.selector:
            raise UserInputError(
                f"mode {mode!r} selects with the {selector} selector, but this store keeps prefills routed by the "
                f"{self.selector} selector; open a ContextStore with selector={selector!r} for it"
            )
        return OffloadedSparseCache.for_model(self.model, mode=mode, selector=selector, max_length=max_length)

    def lookup(self, ids, mode: str | None = None, max_length: int | None = None, reserve: int | None = None):
        """The longest stored prefix of `ids` ([T] or [1, T] token ids) in a fresh cache.

        Returns (cache, matched): the cache holds positions 0..matched-1, matched a multiple of the
        block size and at most T - 1 (generate() needs one token to prefill); pass the cache with
        the whole `ids` to generate(), which prefills ids[matched:] only.  mode/max_length: as
        `new_cache`; reserve: rows the cache allocates at once (prompt + new tokens)."""
        tokens = sequence_ids(ids)
        if not tokens:
            raise UserInputError("lookup needs at least one token id")
        found = self.index.stored_prefix(tokens, (len(tokens) - 1) // self.block_size)
        found = self.disk_tier.load_blocks(found)  # a block that is gone or bad on disk ends the match there
        cache = self.new_cache(mode, max_length)
        if reserve is not None:
            cache.reserve(reserve)
        matched = fill(cache, self.pools, self._devices(), [entry.blocks for entry in found], self.block_size)
        set_tokens(cache, tokens[:matched])  # the cache's record: these tokens hash to the blocks' names
        self.index.hold(cache, [entry.name for entry in found])
        self.index.touch(found)
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
        _check_tokens(cache, tokens)
        full = len(tokens) // self.block_size
        names = self.index.names(tokens, full)
        first = len(self.disk_tier.load_blocks(self.index.leading(names)))  # gone or bad on disk: taken from the cache
        self.index.hold(cache, names[:first])  # held from the start: making room never evicts the chain it extends
        per_block = self.block_nbytes()
        added = 0
        while first + added < full and self.index.make_room((added + 1) * per_block):
            added += 1
        self.rejected += full - first - added
        for position, blocks in enumerate(take_blocks(cache, self.pools, first, added, self.block_size), start=first):
            parent = names[position - 1] if position else None
            chunk = self.index.chunk(tokens, position)
            self.index.add(Entry(names[position], parent, position, chunk, blocks, None, per_block))
            self.index.hold(cache, [names[position]])
        self.index.touch([self.entries[name] for name in names[: first + added]])
        return added

    def release(self, cache) -> None:
        """Drop `cache`'s references (also done when the cache is garbage collected)."""
        self.index.release(cache)

    def block_rows(self, name: str) -> BlockRows:
        """A copy of stored block `name`'s rows, every layer: keys, values [L, bs, H, d], cis or None."""
        entry = self.entries[name]
        if not self.disk_tier.load_blocks([entry]):
            raise ContextStoreError(f"block {name[:16]} could not be read from disk")
        return copy_out(self.pools, entry.blocks, self.block_size)

    def stats(self) -> dict:
        """Counters and sizes: hit/miss tokens of lookups, evictions, blocks rejected by the cap,
        blocks and bytes held, blocks referenced by live caches."""
        return {
            "hit_tokens": self.hit_tokens,
            "miss_tokens": self.miss_tokens,
            "evictions": self.evictions,
            "rejected_blocks": self.rejected,
            "blocks": len(self.entries),
            "tokens": len(self.entries) * self.block_size,
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "referenced_blocks": self.index.referenced(),
            "dropped_blocks": self.dropped,
        }

    def save(self) -> Path:
        """Merge this store into the namespace on disk under its exclusive lock (`DiskTier.save`:
        other processes' blocks join it, what they removed or this store evicted goes, new blocks
        are written, the index replaced atomically).  Returns the namespace directory."""
        if self.dir is None:
            raise UserInputError("this ContextStore has no directory: build it with ContextStore(model, dir)")
        return self.disk_tier.save(self.block_rows)

    # -- checks ---------------------------------------------------------------------------------
    def _check_cache(self, cache, count: int) -> None:
        """Raise unless `cache` holds one sequence of at least `count` tokens of this model,
        prefilled with this store's selector, in its dtype."""
        if not isinstance(cache, SparseCache):
            raise TypeError(f"insert takes a SparseCache or OffloadedSparseCache, got {type(cache).__name__}")
        cache.check_model(self.model.config)
        selector = None
        if self.selector is not None:
            selector = getattr(cache, "selector", None) or self.model.config.sparse.selector
        if selector != self.selector:
            raise ContextStoreError(
                f"the cache was prefilled with the {selector} selector, but this store keeps prefills of the "
                f"{self.selector} selector"
            )
        layer = cache.layers[0]
        held = cache.host_lengths()
        if held is None:
            raise UserInputError("the cache holds no tokens yet")
        if len(held) != 1:
            raise UserInputError(f"insert takes a cache of one sequence, this one holds {len(held)}")
        if dtype_name(layer.dtype) != self.identity["dtype"]["kv"]:
            raise ContextStoreError(
                f"the cache holds {dtype_name(layer.dtype)} K/V, this store keeps {self.identity['dtype']['kv']}"
            )
        if count > held[0]:
            raise ContextStoreError(f"token mismatch: ids has {count} tokens but the cache holds {held[0]}")


def _check_tokens(cache, tokens: list[int]) -> None:
    """Raise unless `tokens` are the tokens `cache` was prefilled with (its own record,
    `modeling/token_record.py`), from position 0."""
    record = recorded_tokens(cache)
    if record is None:
        raise ContextStoreError(
            "the cache has no record of the tokens it holds (it was filled without a forward call of the model, "
            "or its batch changed since): insert cannot check ids against it"
        )
    known = record[0]
    if len(tokens) > len(known):
        raise ContextStoreError(
            f"the cache's record knows its first {len(known)} tokens (prefilled ones; decode steps and inputs_embeds "
            f"calls are not recorded), ids has {len(tokens)}: insert ids[:{len(known)}] or fewer"
        )
    differ = next((i for i, (a, b) in enumerate(zip(tokens, known)) if a != b), None)
    if differ is not None:
        raise ContextStoreError(
            f"token mismatch: ids[{differ}] = {tokens[differ]}, but the cache was prefilled with {known[differ]} "
            "there; insert takes the ids the cache was prefilled with"
        )
