"""Evaluation modes: an attention mode (how blocks are chosen) paired with a cache mode (where KV lives).

Attention modes, all on one loaded model (only `config.sparse_config` changes between them):
  * ``dense``              full attention;
  * ``infllmv2-query``     InfLLM-v2, blocks chosen by the layer's own queries;
  * ``infllmv2-forecast``  InfLLM-v2, blocks chosen by the previous layer's Forecast head;
  * ``nosa`` / ``nosa-forecast``  NOSA's policy (query-aware shortlist + CIS fill); needs A/delta.
Cache modes: ``resident`` (`SparseCache`, the default) or any of `forecastkv.modes.MODES`
(`forecastkv.inference.OffloadedSparseCache.for_model(model, mode=...)`) when that package imports.

A mode is written ``<attention>`` or ``<attention>@<cache>``, e.g. ``infllmv2-forecast@forecast-offload``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import ConfigError
from ..modeling import routing
from ..modes import ATTENTION_MODES, MODE_SELECTOR, MODES
from ..selectors import get_selector

RESIDENT = "resident"


@dataclass(frozen=True)
class Mode:
    attention: str
    cache: str = RESIDENT

    @property
    def name(self) -> str:
        return self.attention if self.cache == RESIDENT else f"{self.attention}@{self.cache}"

    @property
    def sparse(self) -> bool:
        return ATTENTION_MODES[self.attention] is not None

    @property
    def selector(self) -> str | None:
        spec = ATTENTION_MODES[self.attention]
        return None if spec is None else spec[1]

    @property
    def policy(self) -> str | None:
        spec = ATTENTION_MODES[self.attention]
        return None if spec is None else spec[0]


def offload_modes() -> tuple[tuple[str, ...], str | None]:
    """(cache modes the offloaded runtime offers, why it is unavailable or None)."""
    try:
        from .. import inference  # noqa: F401 - only whether it imports
    except Exception as error:  # noqa: BLE001 - any import failure means "not available here"
        return (), f"forecastkv.inference does not import ({type(error).__name__}: {error})"
    return MODES, None


def parse_mode(text: str) -> Mode:
    """'<attention>[@<cache>]' -> Mode; a ConfigError names the unknown part and the known ones."""
    if not isinstance(text, str) or not text:
        raise ConfigError(f"a mode must be a non-empty string like 'infllmv2-query', got {text!r}")
    attention, _, cache = text.partition("@")
    if attention not in ATTENTION_MODES:
        raise ConfigError(f"unknown attention mode {attention!r} in mode {text!r}; known: {sorted(ATTENTION_MODES)}")
    cache = cache or RESIDENT
    if cache != RESIDENT:
        available, why = offload_modes()
        if why is not None:
            raise ConfigError(f"cache mode {cache!r} in mode {text!r} needs the offloaded runtime: {why}")
        if cache not in available:
            raise ConfigError(f"unknown cache mode {cache!r} in mode {text!r}; known: {[RESIDENT, *available]}")
        wants = MODE_SELECTOR.get(cache)
        selector = ATTENTION_MODES[attention][1] if ATTENTION_MODES[attention] else None
        if wants is not None and wants != selector:
            fits = sorted(a for a, spec in ATTENTION_MODES.items() if spec and spec[1] == wants)
            raise ConfigError(
                f"cache mode {cache!r} selects blocks with the {wants} selector, so mode {text!r} "
                f"cannot run; pair it with one of {fits}"
            )
    return Mode(attention, cache)


def check_model_supports(model, mode: Mode) -> None:
    """Raise a ConfigError when `model` lacks what `mode` needs (a sparse geometry, forecast heads, A/delta)."""
    if not mode.sparse:
        return
    if model.config.sparse is None:
        raise ConfigError(
            f"mode {mode.name!r} needs a sparse geometry: set model.sparse_config (a preset name or dict)"
        )
    if get_selector(mode.selector).needs_forecast_heads and not model.config.forecast_config.enabled:
        raise ConfigError(
            f"mode {mode.name!r} needs forecast heads, but the model has none: give model.forecast_weights "
            "(a train-forecast output) or model.forecast (e.g. {init: next_query}) to create them"
        )
    if mode.policy == "nosa" and not hasattr(model.model.layers[0].self_attn, "A"):
        raise ConfigError(
            f"mode {mode.name!r} needs NOSA's A/delta weights; the checkpoint has none (policy "
            f"{model.config.sparse.policy!r})"
        )


def mode_sparse_config(base: dict | None, mode: Mode) -> dict | None:
    """The `sparse_config` dict that runs `mode` on a model whose own geometry is `base`."""
    if not mode.sparse:
        return None
    return {**base, "policy": mode.policy, "selector": mode.selector}


@contextmanager
def attending_with(model, mode: Mode):
    """Run `model` in `mode` inside the block (`routing.attending_with`: on a copy of its config)."""
    check_model_supports(model, mode)
    with routing.attending_with(model, mode_sparse_config(model.config.sparse_config, mode)) as config:
        yield config


def make_cache(model, mode: Mode):
    """A fresh cache for one example: `SparseCache` or the offloaded cache of `mode.cache`."""
    if mode.cache == RESIDENT:
        from ..modeling.cache import SparseCache

        return SparseCache(model.config)
    from ..inference import OffloadedSparseCache

    return OffloadedSparseCache.for_model(model, mode=mode.cache)
