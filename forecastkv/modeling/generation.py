"""The offload modes as a transformers `cache_implementation`: any `generate()` caller (a
`pipeline`, lm-eval's `--model hf`, plain `model.generate`) gets the offloaded runtime without
building a cache by hand.

    model.generation_config.cache_implementation = "forecast-offload"    # this process
    model.generate(ids, cache_implementation="forecast-offload")         # one call
    pipeline("text-generation", model=dir, cache_implementation="forecast-offload")
    set_default_cache(model, "forecast-offload"); model.save_pretrained(dir)   # kept in generation_config.json

What transformers allows (5.17 and 5.24, `generation/configuration_utils.py` and
`generation/utils.py`): there is no registry of cache implementations.  `ALL_CACHE_IMPLEMENTATIONS`
is a module-level tuple, `GenerationConfig.validate()` raises `ValueError("Invalid
cache_implementation ...")` for any other name, and it runs in `GenerationConfig.__init__` (so in
`from_pretrained` / `from_dict` of a generation_config.json), in `GenerationConfig.update()` (which
`GenerationMixin._prepare_generation_config` calls on every `generate()`) and, strictly, in
`GenerationConfig.save_pretrained`.  `GenerationMixin._prepare_cache_for_generation` is a fixed
if/elif over those names that falls back to `DynamicCache`.  Both are methods of the model, so a
model class may override them; `ForecastKVForCausalLM` does:

* `_prepare_generation_config` takes one of our `MODES` out of the call's `cache_implementation=`,
  out of a passed `generation_config` and out of `model.generation_config` before transformers
  validates them, and records it on the prepared config as the custom entry `forecastkv_cache`
  (custom entries pass validation, survive `copy.deepcopy` and are written to JSON);
* `_prepare_cache_for_generation` builds `OffloadedSparseCache.for_model(model, mode=...)` for it.

A generation_config.json therefore stores the switch as `"forecastkv_cache": "<mode>"`:
transformers itself cannot load one whose `cache_implementation` is a name it does not know, nor
save one (`save_pretrained` validates strictly).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from ..errors import UserInputError
from ..modes import MODES

GENERATION_KEY = "forecastkv_cache"  # the custom generation_config entry that carries the mode
CACHE_IMPLEMENTATIONS = MODES


def _ours(value) -> bool:
    return isinstance(value, str) and value in CACHE_IMPLEMENTATIONS


def _take(config) -> str | None:
    """The mode a GenerationConfig names (its `cache_implementation` if it is ours, else its
    `forecastkv_cache` entry); a `cache_implementation` of ours is cleared so transformers accepts
    the config."""
    if config is None:
        return None
    if _ours(config.cache_implementation):
        mode, config.cache_implementation = config.cache_implementation, None
        return mode
    return getattr(config, GENERATION_KEY, None)


def prepare_generation_config(model, parent, generation_config=None, *args, **kwargs):
    """`GenerationMixin._prepare_generation_config` (`parent`, bound) with our modes taken out
    before transformers validates, and the chosen one recorded as `forecastkv_cache` on the
    prepared config.  Priority as in transformers: the call's kwargs, then a passed
    generation_config, then the model's.  Returns what `parent` returns: (config, model kwargs)."""
    called = kwargs.pop(GENERATION_KEY, None)
    if _ours(kwargs.get("cache_implementation")):
        called = kwargs.pop("cache_implementation")
    elif kwargs.get("cache_implementation") is not None:
        called = "none"  # the call names a transformers cache: no offload
    if called is not None and called != "none" and not _ours(called):
        raise ValueError(f"{GENERATION_KEY}={called!r}: choose one of {CACHE_IMPLEMENTATIONS}")
    if generation_config is not None:
        generation_config = copy.deepcopy(generation_config)
    passed = _take(generation_config)
    own = model.generation_config
    saved = own.cache_implementation
    model_mode = _take(own)
    try:
        prepared, model_kwargs = parent(generation_config, *args, **kwargs)
    finally:
        own.cache_implementation = saved
    mode = called if called is not None else passed if passed is not None else model_mode
    setattr(prepared, GENERATION_KEY, None if mode == "none" else mode)
    return prepared, model_kwargs


# the cache class of the offload modes: the runtime registers `OffloadedSparseCache` when it is
# imported (the first use of a public name of `forecastkv` does), so this module never imports the runtime
_OFFLOADED_CACHE: list = []


def register_offloaded_cache(cache_class) -> None:
    """`cache_class.for_model(model, mode=...)` builds the cache of an offload mode
    (`inference/offloaded.py`); looked up at each build, so a patched `for_model` is the one used."""
    _OFFLOADED_CACHE[:] = [cache_class]


def cache_for_generation(model, generation_config):
    """The cache `generate()` builds when the caller passed none: the offloaded runtime's cache in
    the config's `forecastkv_cache` mode, else the resident `SparseCache`."""
    from .cache import SparseCache

    mode = getattr(generation_config, GENERATION_KEY, None)
    if mode is None:
        return SparseCache(model.config)
    if not _OFFLOADED_CACHE:
        raise UserInputError(f"{GENERATION_KEY}={mode!r} needs the offloaded runtime: import forecastkv.inference")
    return _OFFLOADED_CACHE[0].for_model(model, mode=mode)


def set_default_cache(model, mode: str | None) -> None:
    """Make `mode` (one of `MODES`, or None for the resident cache) the cache every `generate()`
    of `model` builds; `model.save_pretrained(dir)` writes it to generation_config.json as
    `"forecastkv_cache"`, which a load through `load_generation_config` puts back."""
    if mode is not None and not _ours(mode):
        raise ValueError(f"unknown offload mode {mode!r}; choose one of {CACHE_IMPLEMENTATIONS}")
    if _ours(model.generation_config.cache_implementation):
        model.generation_config.cache_implementation = None
    setattr(model.generation_config, GENERATION_KEY, mode)
    # a config made from the model config loses its custom entries when it is read back
    # (`GenerationConfig.__init__` keeps them only when `_from_model_config` is false)
    model.generation_config._from_model_config = False


def load_generation_config(directory):
    """The GenerationConfig of a checkpoint directory (None without a generation_config.json),
    with our mode accepted under either key: `"forecastkv_cache"`, or a `"cache_implementation"`
    naming one of `MODES` (which transformers' own `GenerationConfig.from_pretrained` refuses)."""
    from transformers import GenerationConfig

    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    if _ours(raw.get("cache_implementation")):
        raw[GENERATION_KEY] = raw.pop("cache_implementation")
    mode = raw.pop(GENERATION_KEY, None)
    if mode is not None and not _ours(mode):
        raise ValueError(f"{path}: {GENERATION_KEY}={mode!r} is not one of {CACHE_IMPLEMENTATIONS}")
    config = GenerationConfig.from_dict(raw)  # drops custom entries of a config made from the model config
    setattr(config, GENERATION_KEY, mode)
    return config
