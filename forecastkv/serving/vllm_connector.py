"""`ForecastLookaheadConnector`: forecast-offload inside vLLM, as an out-of-tree KV connector.

    LLM(model=DIR, hf_overrides={"forecastkv_mode": "infllmv2-forecast"},
        kv_transfer_config={"kv_connector": "ForecastLookaheadConnector",
                            "kv_connector_module_path": "forecastkv.serving.vllm_connector",
                            "kv_role": "kv_both"})

The worker side owns a `serving/page_offload.py:PageOffload` over vLLM's page pools: the offload
runtime of `generate()` (its manager's `plan_loads`, its `TransferWorker` and pinned
`HostBlockPool`s) run over the pages.  Every stored row is written through to the host with the
UVA row store, layer m's Forecast plan starts the load of layer m+1's missed blocks on the worker's
side stream through the UVA block gather, straight into the pages (`PagedRows.plan`), and
`wait_for_layer_load(m + 1)` is where layer m+1's attention starts: the stream waits for that load
and it records whether the load was requested before it.  The scheduler side
loads nothing from outside (no external prefix cache): every method says so.

kv_connector_extra_config {"evict": true} poisons the pool rows a request's slot maps do not hold
(a test aid: attention that read a block it did not load shows at once; not with prefix caching).

Its counts reach a `vllm serve` user through vLLM's KV-connector stats: after each model call the
worker hands over `LookaheadStats` (`get_kv_connector_stats`), which vLLM ships to its stats loggers:
the `vllm:forecastkv_*` series of `/metrics` (`LookaheadPromMetrics`) and the periodic
"KV Transfer metrics: ..." log line (`LookaheadStats.reduce`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .page_offload import PageOffload

# bucket bounds of the bytes-per-decode-call histogram: 4 KiB .. 1 GiB, by factors of 4
STEP_BYTE_BUCKETS = [float(4**k) for k in range(6, 16)]


@dataclass
class LookaheadStats(KVConnectorStats):
    """The connector's counts over some decode calls, as vLLM ships them worker -> scheduler -> stats
    loggers (a plain dict, so msgpack and pickle carry it).

    data: {"h2d_bytes": [bytes host -> pool of each decode call], "blocks_wanted": int,
    "block_hits": int}; blocks are the offloaded layers' (request, KV head, block) triples of
    complete blocks, counted as the HF runtime's `OffloadedSparseCache.stats()` counts them."""

    def __post_init__(self) -> None:
        # a copy: vLLM hands the same dict to every stats logger, and `aggregate` extends in place
        given = self.data or {}
        self.data = {
            "h2d_bytes": [int(b) for b in given.get("h2d_bytes", ())],
            "blocks_wanted": int(given.get("blocks_wanted", 0)),
            "block_hits": int(given.get("block_hits", 0)),
        }

    def reset(self) -> None:
        self.data = {"h2d_bytes": [], "blocks_wanted": 0, "block_hits": 0}

    def aggregate(self, other: KVConnectorStats) -> "LookaheadStats":
        """These counts followed by `other`'s (in place; returns self)."""
        more = LookaheadStats(data=other.data)
        self.data["h2d_bytes"].extend(more.data["h2d_bytes"])
        self.data["blocks_wanted"] += more.data["blocks_wanted"]
        self.data["block_hits"] += more.data["block_hits"]
        return self

    def reduce(self) -> dict[str, int | float]:
        """The log line's fields for the interval: decode calls, their H2D bytes (total and mean), and
        the hit rate when a plan wanted any complete block (short prompts have none to offload)."""
        steps, wanted = self.data["h2d_bytes"], self.data["blocks_wanted"]
        fields: dict[str, int | float] = {
            "forecastkv_decode_steps": len(steps),
            "h2d_bytes": sum(steps),
            "h2d_bytes_per_step": round(sum(steps) / len(steps)) if steps else 0,
        }
        if wanted:
            fields["block_hit_rate"] = round(self.data["block_hits"] / wanted, 4)
        return fields

    def is_empty(self) -> bool:
        return not self.data["h2d_bytes"] and not self.data["blocks_wanted"]


class LookaheadPromMetrics(KVConnectorPromMetrics):
    """`LookaheadStats` as Prometheus series (per engine, vLLM's labels): a histogram of H2D bytes per
    decode call (its _sum: bytes, its _count: decode calls) and counters of blocks wanted and hit
    (the hit rate is block_hits_total / blocks_wanted_total)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        step_bytes = self._histogram_cls(
            name="vllm:forecastkv_h2d_bytes_per_step",
            documentation="forecast-offload: bytes copied host -> KV pages in each decode call, all layers "
            "and requests of the call summed (ForecastLookaheadConnector)",
            labelnames=labelnames,
            buckets=STEP_BYTE_BUCKETS,
        )
        wanted = self._counter_cls(
            name="vllm:forecastkv_blocks_wanted",
            documentation="forecast-offload: complete blocks (request, KV head, block) the offloaded layers' "
            "plans selected at decode calls",
            labelnames=labelnames,
        )
        hits = self._counter_cls(
            name="vllm:forecastkv_block_hits",
            documentation="forecast-offload: of those, blocks already in the request's slot map (not copied)",
            labelnames=labelnames,
        )
        self.series = {
            engine: (step_bytes.labels(*values), wanted.labels(*values), hits.labels(*values))
            for engine, values in per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        step_bytes, wanted, hits = self.series[engine_idx]
        stats = LookaheadStats(data=transfer_stats_data)
        for count in stats.data["h2d_bytes"]:
            step_bytes.observe(count)
        wanted.inc(stats.data["blocks_wanted"])
        hits.inc(stats.data["block_hits"])


class ConnectorTier(PageOffload):
    """A `PageOffload` whose waits go through the connector's `wait_for_layer_load`, by layer name."""

    def __init__(self, connector: "ForecastLookaheadConnector", names: list[str], *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.connector, self.names = connector, names

    def wait(self, layer: int) -> bool:
        return self.connector.wait_for_layer_load(self.names[layer])


class ForecastLookaheadConnector(KVConnectorBase_V1):
    """vLLM's KV connector API over forecastkv's host tier (worker side); the scheduler side is inert."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.evict = bool(extra.get("evict", False))
        self.tier: ConnectorTier | None = None
        # bounded, so a long-running server does not grow: the latest decode calls' bytes, and per
        # wait whether its blocks were requested before it (counted)
        self.recent_h2d: deque[int] = deque(maxlen=4096)
        self.waits = self.waits_found = 0

    # -- worker side ----------------------------------------------------------------------------------
    def attach(self, names: list[str], pools, sparse, ring: int) -> ConnectorTier:
        """The tier over `pools` (one `LayerPages` per layer, named `names`), made once per pool set."""
        if self.tier is None or self.tier.pools is not pools:
            self.tier = ConnectorTier(
                self, names, pools, sparse.budget_blocks, sparse.block_size, ring, evict=self.evict
            )
        return self.tier

    def register_kv_caches(self, kv_caches) -> None:
        """vLLM hands over the pools; the model builds the tier over its own views of them (`attach`)."""

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Nothing to load before the call: each layer's blocks are loaded when the layer before plans them."""

    def wait_for_layer_load(self, layer_name: str) -> bool:
        """Layer `layer_name` is about to attend: the current stream waits for its load (on the CPU the
        load ran when it was requested).  Records and returns whether it was requested before this wait."""
        if self.tier is None:
            return False
        found = PageOffload.wait(self.tier, self.tier.names.index(layer_name))
        self.waits += 1
        self.waits_found += found
        return found

    def get_kv_connector_stats(self) -> LookaheadStats | None:
        """The decode calls since the last call (vLLM asks after every model call, worker side), taken
        out of the tier so its records stay bounded; None when there were none (the scheduler side)."""
        if self.tier is None or not self.tier.stats.per_step:
            return None
        counts = self.tier.stats
        stats = LookaheadStats(
            data={"h2d_bytes": counts.per_step, "blocks_wanted": sum(counts.wanted), "block_hits": sum(counts.hits)}
        )
        self.recent_h2d.extend(counts.per_step)
        counts.clear()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LookaheadStats:
        """vLLM's stats loggers rebuild the worker's `LookaheadStats` from its dict."""
        return LookaheadStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> LookaheadPromMetrics:
        """The `/metrics` series of the API server (`LookaheadPromMetrics`)."""
        return LookaheadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        """Rows are written through to the host as they are stored (`PagedRows.append`)."""

    def wait_for_save(self) -> None:
        """The write-through is ordered on the current stream (UVA writes on CUDA, synchronous on the CPU)."""

    # -- scheduler side ---------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # no tokens come from outside the engine

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Nothing is loaded at allocation."""

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()
