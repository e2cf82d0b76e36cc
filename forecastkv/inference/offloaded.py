"""`OffloadedSparseCache`: full KV in (pinned) host memory, only the selected blocks on the device.

Per offloaded layer (the README's "Offloaded runtime"):

* a `HostKVStore` holds every position's K/V (and NOSA's CIS) in blocks of a shared, paged
  `HostBlockPool` through a block table; new tokens are written through to it;
* on the device: slots for the selected blocks, a block map, the compressed keys (and NOSA's
  pooled CIS: what selection scores) and a ring of the latest rows (`inference/layers.py`, the
  decode step's half of a layer);
* a multi-token call (prefill, draft verification) stages one layer's KV on the device for the
  chunked attention and drops it when the next layer stages (`inference/staging.py`).

`fork()` / `copy.deepcopy` / `fork_batch(n)` make independent caches (or one batch of n per
sequence) that share every full host block and copy only the tail blocks and the device state.

A decode step reads nothing back from the device (the host counters of `CallInfo` decide every
number) and touches host memory only through the transfer functions (`transfer_function`: the
gather, the staging, the write-back); tests/strict_device.py checks both on the CPU.

Modes (`MODES`): `no-offload` (every layer resident, the `SparseCache` behaviour), `sparse-offload`
(query selector, fetched at the consuming layer), `forecast-sync` (forecast selector, fetched at the
consuming layer), `forecast-offload` (forecast selector, fetched one layer ahead), `dense-offload`
(every offloaded layer's whole KV copied to the device each step; attention as the model's own).
All modes give the tokens of `SparseCache` with the same selector.  On a machine without CUDA the
"device" tensors are CPU tensors and the side stream is synchronous; the counters are the same.
"""

from __future__ import annotations

import torch

from ..modeling.cache import ResidentRows, SparseCache, SparseCacheLayer, window_geometry
from ..modeling.generation import register_offloaded_cache
from ..modes import MODE_FETCH, MODE_SELECTOR, MODES, SELECTORS
from ..selectors import get_selector
from .host_store import HostBlockPool
from .layers import OffloadedRows
from .staging import Staging
from .worker import gather_programs_for


def _nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def resolve_selector(mode: str, selector: str | None, sparse) -> str | None:
    """The selector a cache of `mode` runs: `selector` when given; else the model's own when it is one of
    the selectors beyond the modes' own two (query and forecast); else the mode's (`MODE_SELECTOR`:
    sparse-offload compares the query selector with the forecast modes on one model).  A ValueError when
    the mode cannot run it: a selector that is not deployable (the oracle reads every key) runs only in
    `no-offload`, and a mode that fetches a layer ahead needs a selector that plans ahead
    (`Selector.plans_ahead`)."""
    get_selector(selector)  # a ValueError naming the registered selectors for an unknown name
    own = sparse.selector if sparse is not None else None
    if selector is None:
        selector = own if own is not None and own not in MODE_SELECTOR.values() else MODE_SELECTOR.get(mode)
    rule = get_selector(selector)
    if rule is not None and not rule.deployable and mode != "no-offload":
        raise ValueError(
            f"the {selector} selector reads every key of every layer, so the offloaded runtime cannot run it in mode "
            f"{mode!r}: it is a measurement (use SparseCache or mode 'no-offload')"
        )
    if rule is not None and MODE_FETCH.get(mode) == "prefetch" and not rule.plans_ahead:
        ahead = sorted(name for name in SELECTORS if get_selector(name).plans_ahead)
        raise ValueError(
            f"mode {mode!r} fetches blocks a layer ahead, but the {selector!r} selector only knows them at the "
            f"consuming layer; use 'sparse-offload', or a selector that plans ahead: {ahead}"
        )
    return selector


def new_cache(model, mode: str | None, selector: str | None = None) -> SparseCache:
    """The cache `forecastkv generate` decodes into: an `OffloadedSparseCache` of `mode`, else (None) a resident
    `SparseCache`; it selects with `selector` (`--selector`; None: the mode's, else the model's own)."""
    if mode:
        return OffloadedSparseCache.for_model(model, mode=mode, selector=selector)
    return SparseCache(model.config, selector=selector)


class OffloadedSparseCache(SparseCache):
    """A transformers `Cache` with the full KV on the host and the selected blocks on the device.

    Build it with `OffloadedSparseCache.for_model(model, mode=..., max_length=None)` and pass it to
    `model.generate(ids, cache=cache)` (`past_key_values=` on transformers 5.17).
    """

    def __init__(
        self,
        config,
        mode: str = "forecast-offload",
        max_length: int | None = None,
        first_layer_resident: bool = True,
        record_selections: bool = False,
        gather_programs: int | None = None,
        pools: "list[HostBlockPool | None] | None" = None,
        selector: str | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown offload mode {mode!r}; choose one of {MODES}")
        if gather_programs is not None and (
            isinstance(gather_programs, bool) or not isinstance(gather_programs, int) or gather_programs < 1
        ):
            raise ValueError(
                "gather_programs must be a positive integer or None (sized from the SM count and batch), "
                f"got {gather_programs!r}"
            )
        self.gather_programs = gather_programs
        if max_length is not None and (not isinstance(max_length, int) or max_length <= 0):
            raise ValueError(f"max_length must be a positive integer or None, got {max_length!r}")
        sparse = config.sparse
        selector = resolve_selector(mode, selector, sparse)
        rule = get_selector(selector)
        if rule is not None and rule.needs_forecast_heads and not config.forecast_config.enabled:
            raise ValueError(
                f"mode {mode!r} selects with Forecast heads, but this model has none; "
                "load it with forecast={...} or use 'sparse-offload'"
            )
        if selector is not None and sparse is None:
            raise ValueError(
                f"mode {mode!r} needs a sparse model (sparse_config is None); use 'dense-offload' or 'no-offload'"
            )
        self.mode = mode
        self.first_layer_resident = first_layer_resident
        self.staging = Staging()
        self._build = (mode, max_length, first_layer_resident)
        super().__init__(config, max_length=max_length, selector=selector)
        if record_selections:
            for layer in self.layers:
                layer.store.log.selections = []
        if pools is not None:
            self.use_pools(pools)

    # -- the paged host tier, forks -----------------------------------------------------------
    def use_pools(self, pools: "list[HostBlockPool | None]") -> None:
        """Build each offloaded layer's host store on pools[layer] (one per layer, None for a
        resident layer or to keep a new pool): the blocks live in pools shared with other caches
        (a ContextStore, other forks).  Only before the first token."""
        if len(pools) != len(self.layers):
            raise ValueError(f"pools has {len(pools)} entries, expected one per layer ({len(self.layers)})")
        for idx, (layer, pool) in enumerate(zip(self.layers, pools)):
            if pool is None:
                continue
            if not layer.offloaded:
                raise ValueError(f"layer {idx} is resident in mode {self.mode!r}: it has no host pool (give None)")
            if layer.is_initialized:
                raise ValueError("use_pools() must come before the first token is stored")
            layer.store.given_pool = pool

    def attach(self, layers: list, length: int) -> None:
        """An empty cache of one sequence holding `length` stored positions, per layer either
        layers[l] = (pool, block ids): an offloaded layer's host blocks, held where they are
        (shared with their owner, `OffloadedStaging.attach`), or layers[l] = (keys, values, cis):
        a resident layer's rows [1, length, H, d] (cis [1, length, H] or None), appended to it.
        Device state goes where each layer's tensors are (the rows' device, or `device` of the
        pool entry: (pool, ids, device))."""
        if len(layers) != len(self.layers):
            raise ValueError(f"attach() takes one entry per layer ({len(self.layers)}), got {len(layers)}")
        for idx, (layer, entry) in enumerate(zip(self.layers, layers)):
            if layer.offloaded:
                if not isinstance(entry[0], HostBlockPool):
                    raise ValueError(f"layer {idx} is offloaded: give (pool, block ids, device), not rows")
                pool, blocks, device = entry
                layer.store.attach(layer, pool, list(blocks), length, device)
            else:
                keys, values, cis = entry
                if keys.shape[:2] != (1, length):
                    raise ValueError(
                        f"layer {idx} is resident: rows must be [1, {length}, H, d], got {tuple(keys.shape)}"
                    )
                layer.append(keys, values, cis, torch.arange(length, device=keys.device).unsqueeze(0))

    def host_pools(self) -> "list[HostBlockPool | None]":
        """Per layer, the `HostBlockPool` its host blocks live in (None: resident, or no token yet)."""
        return [layer.store.host_pool() for layer in self.layers]

    def _forked(self, repeats: int) -> "OffloadedSparseCache":
        self.staging.release()  # a staged layer is this cache's, and device memory
        other = super()._forked(repeats)
        other.staging = Staging()
        for layer in other.layers:
            store = layer.store
            if store.offloaded:
                store.staging = other.staging
                if self.gather_programs is None and store.k_slots is not None:
                    store.gather_programs = gather_programs_for(store.k_slots.device, store.k_slots.shape[0])
        return other

    def _make_layer(self, config, sparse, idx: int, max_length: int | None) -> SparseCacheLayer:
        """Layer `idx`: the window indexes of the model's geometry over a counted `ResidentRows` (layer 0,
        or every layer in no-offload) or an `OffloadedRows`."""
        kernel, coarse = window_geometry(sparse)
        mode, _, first_resident = self._build
        block_size = sparse.block_size if sparse is not None else None
        if mode == "no-offload" or (idx == 0 and first_resident):
            store = ResidentRows(counted=True)
        else:
            block_size = block_size or 64  # a dense model's host blocks
            store = OffloadedRows(
                budget=sparse.budget_blocks if sparse is not None else 1,
                fetch=MODE_FETCH.get(mode, "sync"),
                staging=self.staging,
                gather_programs=self.gather_programs,
            )
        return SparseCacheLayer(
            *(kernel or (None, None)), coarse=coarse, max_length=max_length,
            block_size=block_size, key_bounds=self.keeps_key_bounds(sparse),
            store=store,
        )  # fmt: skip

    @classmethod
    def for_model(
        cls, model, mode: str | None = None, max_length: int | None = None, **options
    ) -> "OffloadedSparseCache":
        """A cache for `model`.  mode: one of `MODES`; None picks forecast-offload for a model whose
        selector is forecast, else sparse-offload.  max_length preallocates that many positions per
        sequence (prompt + new tokens); past it the cache raises (None: generate() reserves its own
        length).  options: first_layer_resident (default True), record_selections (default False:
        keep every plan for replay tests), gather_programs (persistent programs of the block gather;
        default: about one per 8 SMs, twice that above batch 16), selector (`resolve_selector`)."""
        config = model.config
        if mode is None:
            sparse = config.sparse
            ahead = sparse is not None and get_selector(options.get("selector") or sparse.selector).plans_ahead
            mode = "forecast-offload" if ahead else "sparse-offload"
        return cls(config, mode=mode, max_length=max_length, **options)

    def compiles_decode(self, step) -> bool:
        """`SparseCache.compiles_decode`, except in dense-offload, whose whole-layer copies grow."""
        return self.mode != "dense-offload" and super().compiles_decode(step)

    # -- bytes and counters -------------------------------------------------------------------
    def device_nbytes(self) -> int:
        """Bytes of the KV tier on the device: slots, block maps, resident layers' KV and any
        staged layer.  Compressed keys are counted apart, in `index_nbytes()`."""
        return sum(_nbytes(layer.store.device_tensors()) for layer in self.layers)

    def index_nbytes(self) -> int:
        """Bytes of the selection index on the device (compressed keys, pooled CIS, lengths)."""
        return sum(_nbytes(layer.index_tensors()) for layer in self.layers)

    def host_nbytes(self) -> int:
        """Bytes of the host tier: what the pools of the offloaded layers pin (each pool once; a
        pool shared with forks or a ContextStore counts every block in it once, whoever holds it)."""
        pools = {id(pool): pool for pool in self.host_pools() if pool is not None}
        return sum(pool.nbytes() for pool in pools.values())

    def host_blocks(self) -> dict:
        """Physical host blocks this cache holds, all layers: `held` (distinct), `shared` (held by
        another cache or store too), and the pools' `allocated` / `free` blocks."""
        held = shared = 0
        for layer in self.layers:
            host = layer.store.host if layer.offloaded else None
            if host is not None:
                blocks = host.blocks.distinct_blocks()
                held += len(blocks)
                shared += sum(1 for block in blocks if host.pool.allocator.refs[block] > 1)
        pools = {id(pool): pool for pool in self.host_pools() if pool is not None}.values()
        return {
            "held": held,
            "shared": shared,
            "allocated": sum(p.capacity for p in pools),
            "free": sum(p.allocator.free_blocks() for p in pools),
        }

    def stats(self) -> dict:
        """Counters per layer and decode step (one host sync here, none while decoding).

        Blocks count (sequence, KV head, block) triples of complete blocks, the tail excluded.
        h2d_bytes_per_step: bytes moved host -> device at each decode step, all layers summed
        (block fetches, or dense-offload's whole-layer copies).  prefill/other H2D (staging for
        multi-token calls, tail refills after crop) and D2H (write-through) are totals.
        """
        steps_per_layer, fetched, hits, wanted, layer_h2d = [], [], [], [], []
        per_step: list[int] = []
        for layer in self.layers:
            log = layer.store.log
            table = log.table()
            block_bytes = layer.store.block_bytes()
            step_bytes = (table[:, 2] * block_bytes).tolist() if len(table) else []
            step_bytes = [a + b for a, b in zip(step_bytes, log.h2d_extra)]
            steps_per_layer.append(len(table))
            wanted.append(int(table[:, 0].sum()))
            hits.append(int(table[:, 1].sum()))
            fetched.append(int(table[:, 2].sum()))
            layer_h2d.append(sum(step_bytes))
            for k, value in enumerate(step_bytes):
                if k == len(per_step):
                    per_step.append(0)
                per_step[k] += value
        dense = self.mode == "dense-offload"
        hit_rate = [
            None if (dense and layer.offloaded) or not w else h / w for layer, h, w in zip(self.layers, hits, wanted)
        ]
        offloaded_wanted = sum(w for layer, w in zip(self.layers, wanted) if layer.offloaded)
        offloaded_hits = sum(h for layer, h in zip(self.layers, hits) if layer.offloaded)
        return {
            "mode": self.mode,
            "selector": self.selector,
            "decode_steps": max(steps_per_layer, default=0),
            "h2d_bytes_per_step": per_step,
            "h2d_bytes_per_step_mean": sum(per_step) / len(per_step) if per_step else 0.0,
            "h2d_bytes_per_layer": layer_h2d,
            "blocks_wanted_per_layer": wanted,
            "blocks_fetched_per_layer": fetched,
            "hits_per_layer": hits,
            "misses_per_layer": fetched,
            "hit_rate_per_layer": hit_rate,
            "hit_rate": None if dense or not offloaded_wanted else offloaded_hits / offloaded_wanted,
            "h2d_other_bytes": sum(layer.store.h2d_other for layer in self.layers),
            "d2h_bytes": sum(layer.store.d2h_bytes for layer in self.layers),
            "device_nbytes": self.device_nbytes(),
            "index_nbytes": self.index_nbytes(),
            "host_nbytes": self.host_nbytes(),
        }


register_offloaded_cache(OffloadedSparseCache)  # generate(cache_implementation=<mode>) builds it
