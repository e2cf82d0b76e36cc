"""The offloading runtime: host store (`host_store.py`), the layers' decode half (slots, fetch:
`layers.py`) and multi-token half (staging, attach, fork: `staging.py`), and the offloaded
`Cache` (`offloaded.py`).

    cache = OffloadedSparseCache.for_model(model, mode="forecast-offload", max_length=None)
    out = model.generate(ids, cache=cache, max_new_tokens=64)   # past_key_values= on 5.17
    cache.stats(); cache.device_nbytes(); cache.host_nbytes()

`MODES` lists the mode names, in a stable order.
"""

from .host_store import HostBlockPool, HostKVStore
from .layers import (
    OffloadedLayer,
    ResidentLayer,
    RuntimePlan,
    StreamPrefetcher,
    SyncPrefetcher,
    diff_block_map,
    make_prefetcher,
)
from .offloaded import MODES, OffloadedSparseCache

__all__ = [
    "MODES",
    "HostBlockPool",
    "HostKVStore",
    "OffloadedLayer",
    "OffloadedSparseCache",
    "ResidentLayer",
    "RuntimePlan",
    "StreamPrefetcher",
    "SyncPrefetcher",
    "diff_block_map",
    "make_prefetcher",
]
