"""forecastkv: trainable block-sparse attention with KV-cache offloading.

Importing the package registers `ForecastKVConfig` / `ForecastKVForCausalLM` with transformers'
`AutoConfig` and `AutoModelForCausalLM`.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from . import inference  # noqa: F401  (registers the offload modes' cache for generate(): modeling/generation.py)
from .bundled import bundled_model_path, bundled_texts
from .modeling import ForecastKVConfig, ForecastKVForCausalLM, SparseCache, SparseConfig

AutoConfig.register(ForecastKVConfig.model_type, ForecastKVConfig, exist_ok=True)
AutoModelForCausalLM.register(ForecastKVConfig, ForecastKVForCausalLM, exist_ok=True)

__version__ = "0.1.0"
__all__ = [
    "ForecastKVConfig",
    "ForecastKVForCausalLM",
    "SparseCache",
    "SparseConfig",
    "bundled_model_path",
    "bundled_texts",
]
