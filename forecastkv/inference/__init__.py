"""The offloading runtime, split as vLLM v1 splits its KV offload:

* the manager (`host_pool.py`): block tables, reference counts, and the slot-map diff that turns a
  plan into a transfer spec (`plan_loads`);
* the worker (`host_store.py`'s pinned buffers, `worker.py`'s `TransferWorker`: the UVA row store
  and block gather, the side stream and its events), which `generate()`'s cache and vLLM's
  connector (`serving/page_offload.py`) share;
* the offloaded layers' `KVStore` (`OffloadedRows`): its decode half (slots, fetch: `layers.py`) and
  multi-token half (staging, attach, fork: `staging.py`), and the offloaded `Cache` (`offloaded.py`),
  whose layers are `modeling/cache.py:SparseCacheLayer`s over it.

    cache = OffloadedSparseCache.for_model(model, mode="forecast-offload", max_length=None)
    out = model.generate(ids, cache=cache, max_new_tokens=64)   # past_key_values= on 5.17
    cache.stats(); cache.device_nbytes(); cache.host_nbytes()

`MODES` lists the mode names, in a stable order.
"""

from .host_pool import LoadSpec, diff_block_map, plan_loads
from .host_store import HostBlockPool, HostKVStore
from .layers import OffloadedRows, RuntimePlan
from .offloaded import MODES, OffloadedSparseCache
from .worker import TransferWorker

__all__ = [
    "MODES",
    "HostBlockPool",
    "HostKVStore",
    "LoadSpec",
    "OffloadedRows",
    "OffloadedSparseCache",
    "RuntimePlan",
    "TransferWorker",
    "diff_block_map",
    "plan_loads",
]
