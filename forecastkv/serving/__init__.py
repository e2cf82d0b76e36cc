"""Serving forecastkv models in an engine that pages the KV cache (vLLM).

`paged.py`: the cache-layer contract over pages and block tables; `step.py`: one engine call (flat
tokens of several requests) through the model.  `vllm_plugin.py` registers the model with vLLM.
Nothing here imports vLLM at import time.
"""

from .paged import LayerPages, PagedRows, PagedSparseCache, check_page_geometry, paged_layer
from .step import EngineBatch, forward_paged

__all__ = [
    "EngineBatch", "LayerPages", "PagedRows", "PagedSparseCache", "check_page_geometry", "forward_paged", "paged_layer",
]
