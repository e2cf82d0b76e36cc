"""forecastkv: trainable block-sparse attention with KV-cache offloading.

`import forecastkv` imports no torch, so the console script answers `--help` at once.  The first
use of a public name (`forecastkv.ForecastKVForCausalLM`, `from forecastkv import SparseCache`, ...)
imports the model classes, which registers `ForecastKVConfig` / `ForecastKVForCausalLM` with
transformers' `AutoConfig` and `AutoModelForCausalLM` (`forecastkv/modeling/__init__.py`), and the
offloaded runtime, which registers the offload modes' cache for `generate()`
(`forecastkv/modeling/generation.py`).  Sub-packages import as usual (`import forecastkv.inference`).
"""

from .lazy import lazy_attributes

__version__ = "0.1.0"

_PUBLIC = {
    "ForecastKVConfig": ".modeling",
    "ForecastKVForCausalLM": ".modeling",
    "SparseCache": ".modeling",
    "SparseConfig": ".modeling",
    "bundled_heads_path": ".bundled",
    "bundled_model_path": ".bundled",
    "bundled_texts": ".bundled",
}
__all__ = sorted(_PUBLIC)
# the runtime first: it imports the model classes and registers the offload modes' cache
__getattr__, __dir__ = lazy_attributes(__name__, _PUBLIC, first=(".inference",))
