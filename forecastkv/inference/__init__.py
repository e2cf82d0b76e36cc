"""The offloading runtime: host store, device slot cache, prefetcher, and the offloaded `Cache`.

    cache = OffloadedSparseCache.for_model(model, mode="forecast-offload", max_length=None)
    out = model.generate(ids, cache=cache, max_new_tokens=64)   # past_key_values= on 5.17
    cache.stats(); cache.device_nbytes(); cache.host_nbytes()

`MODES` lists the mode names, in a stable order.
"""

from .host_store import HostBlockPool, HostKVStore
from .offloaded import MODES, OffloadedLayer, OffloadedSparseCache, ResidentLayer
from .prefetch import StreamPrefetcher, SyncPrefetcher, make_prefetcher
from .slots import diff_block_map

__all__ = [
    "MODES",
    "HostBlockPool",
    "HostKVStore",
    "OffloadedLayer",
    "OffloadedSparseCache",
    "ResidentLayer",
    "StreamPrefetcher",
    "SyncPrefetcher",
    "diff_block_map",
    "make_prefetcher",
]
