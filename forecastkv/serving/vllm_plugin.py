"""vLLM's plugin entry point (group `vllm.general_plugins`, declared in pyproject.toml).

vLLM calls `register` in every process it starts (engine core, workers, API server) before it
reads a model's config: importing forecastkv registers `ForecastKVConfig` with transformers'
AutoConfig (so `config.json`'s model_type "forecastkv" parses without trust_remote_code), and
the architecture name of a forecastkv checkpoint is mapped to `serving/vllm_model.py` (imported
by vLLM only when it builds that model).
"""

from __future__ import annotations

ARCHITECTURE = "ForecastKVForCausalLM"
MODEL_CLASS = "forecastkv.serving.vllm_model:ForecastKVForVLLM"


def register() -> None:
    """Register forecastkv's config and model with vLLM (idempotent: vLLM calls it per process)."""
    from vllm import ModelRegistry

    import forecastkv.modeling  # noqa: F401  (AutoConfig.register of model_type "forecastkv")

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
