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


def _register_auto_classes() -> None:
    """Let `AutoConfig` / `AutoModelForCausalLM.from_pretrained` load model_type "forecastkv"
    (a checkpoint's `auto_map` does the same for a process that never imports forecastkv)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(ForecastKVConfig.model_type, ForecastKVConfig, exist_ok=True)
    AutoModelForCausalLM.register(ForecastKVConfig, ForecastKVForCausalLM, exist_ok=True)


_register_auto_classes()
