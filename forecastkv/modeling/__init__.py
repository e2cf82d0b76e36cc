"""Config, attention, cache and model classes; `selection.py` holds the selection semantics."""

from .cache import SparseCache, SparseCacheLayer
from .configuration import ForecastConfig, ForecastKVConfig, MupConfig, SparseConfig, list_presets, load_preset
from .modeling import ForecastKVForCausalLM, ForecastKVModel, ForecastKVOutput

__all__ = [
    "ForecastConfig",
    "ForecastKVConfig",
    "ForecastKVForCausalLM",
    "ForecastKVModel",
    "ForecastKVOutput",
    "MupConfig",
    "SparseCache",
    "SparseCacheLayer",
    "SparseConfig",
    "list_presets",
    "load_preset",
]
