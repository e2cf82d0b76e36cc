"""`ForecastLookaheadConnector`: forecast-offload inside vLLM, as an out-of-tree KV connector.

    LLM(model=DIR, hf_overrides={"forecastkv_mode": "infllmv2-forecast"},
        kv_transfer_config={"kv_connector": "ForecastLookaheadConnector",
                            "kv_connector_module_path": "forecastkv.serving.vllm_connector",
                            "kv_role": "kv_both"})

The worker side owns a `serving/lookahead.py:LookaheadTier` over vLLM's page pools: every stored
row is written through to the host tier, layer m's Forecast plan starts the load of layer m+1's
missed blocks (`PagedCacheLayer.plan`), and `wait_for_layer_load(m + 1)` is where layer m+1's
attention starts; it records whether those blocks were requested before it.  The scheduler side
loads nothing from outside (no external prefix cache): every method says so.

kv_connector_extra_config {"evict": true} poisons the pool rows a request's slot maps do not hold
(a test aid: attention that read a block it did not load shows at once; not with prefix caching).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .lookahead import LookaheadTier


class ConnectorTier(LookaheadTier):
    """A `LookaheadTier` whose waits go through the connector's `wait_for_layer_load`, by layer name."""

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
        self.found_requested: list[tuple[str, bool]] = []  # per wait: (layer name, its blocks were requested)

    # -- worker side ----------------------------------------------------------------------------------
    def attach(self, names: list[str], pools, sparse, ring: int) -> ConnectorTier:
        """The tier over `pools` (one `LayerPages` per layer, named `names`), made once per pool set."""
        if self.tier is None or self.tier.pools is not pools:
            self.tier = ConnectorTier(self, names, pools, sparse.budget_blocks, sparse.block_size, ring,
                                      evict=self.evict)
        return self.tier

    def register_kv_caches(self, kv_caches) -> None:
        """vLLM hands over the pools; the model builds the tier over its own views of them (`attach`)."""

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Nothing to load before the call: each layer's blocks are loaded when the layer before plans them."""

    def wait_for_layer_load(self, layer_name: str) -> bool:
        """Layer `layer_name` is about to attend: on the CPU its loads ran when they were requested.
        Records and returns whether they were requested before this wait."""
        if self.tier is None:
            return False
        found = LookaheadTier.wait(self.tier, self.tier.names.index(layer_name))
        self.found_requested.append((layer_name, found))
        return found

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        """Rows are written through to the host tier as they are stored (`PagedCacheLayer.append`)."""

    def wait_for_save(self) -> None:
        """The write-through is synchronous on the CPU."""

    # -- scheduler side ---------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # no tokens come from outside the engine

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Nothing is loaded at allocation."""

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()
