"""lm-evaluation-harness support: `--model forecastkv` (`ForecastKVLM`, an `HFLM` subclass).

Importing this module imports `lm_eval` and registers the class (lm-eval 0.4.x has no plugin
discovery, so `forecastkv lm-eval ...` imports it and then runs lm-eval's own command line).

    forecastkv lm-eval --model forecastkv \\
        --model_args pretrained=bundled:smollm2-135m,sparse_config=smollm2-135m,offload=forecast-offload \\
        --tasks <task> --include_path <dir with task YAMLs> --limit 2

Model arguments besides HFLM's own (batch_size, device, dtype, max_length, ...):
  pretrained        a checkpoint directory, a hub id, `bundled:NAME`, or a loaded model (Python);
  sparse_config     a preset name (or a dict, from Python); default: the checkpoint's own;
  forecast          a dict (or its JSON) of forecast keys: creates heads the checkpoint lacks;
  forecast_init     shorthand for forecast={"init": forecast_init} ("next_query" | "kaiming");
  forecast_weights  a train-forecast output directory (trained heads);
  allow_geometry_mismatch  true: load heads trained for another block geometry (a warning);
  offload           a mode of `forecastkv.inference.MODES`: every generate() call gets a fresh
                    `OffloadedSparseCache` of that mode (None: the resident `SparseCache`);
  selector          a registered selector (`forecastkv.modes.SELECTORS`), e.g. forecast-carry-pin:
                    default the offload mode's.

The offload mode also chooses the attention mode unless `selector` names one: sparse-offload selects
blocks with the query selector, forecast-sync / forecast-offload with the Forecast heads (created with
the `next_query` init, and a warning, when the checkpoint has none and no forecast / forecast_weights
is given; so are they for a `selector` that scores Forecast vectors).
Loglikelihood requests (multiple choice, perplexity) run one forward in that attention mode on the
resident cache: where the KV lives does not change a score, only what generation moves.

Cache counters (H2D bytes per decode step, block hit rate, device and host bytes), summed over
every generate() call, go into lm-eval's results as `results["config"]["forecastkv"]`: the model's
`get_model_info()`, which `simple_evaluate` merges into `results["config"]` after the run.  From
Python they are also `lm.cache_counters.summary()`.
"""

from __future__ import annotations

import json
import logging

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from .bundled import resolve_model_path
from .errors import ConfigError
from .modeling import ForecastKVForCausalLM, SparseCache
from .modeling.modeling import CACHE_KWARG

logger = logging.getLogger(__name__)

FORECAST_INIT_DEFAULT = "next_query"
_RUNS: list = []  # the CacheCounters of every ForecastKVLM made in this process (cli_evaluate prints them)
# HFLM options that load a model some other way than ForecastKVForCausalLM.from_pretrained
UNSUPPORTED = (
    "parallelize",
    "tp_plan",
    "peft",
    "delta",
    "autogptq",
    "gptqmodel",
    "gguf_file",
    "quantization_config",
    "subfolder",
)
PASSED_TO_LOADER = ("device_map", "allow_geometry_mismatch")


class CacheCounters:
    """The counters of every cache one evaluation used, summed (one `add(cache)` per generate call).

    Offloaded caches: decode steps, H2D bytes (per decode step and other), D2H bytes, blocks wanted
    and hits on offloaded layers, and the largest device / index / host tier seen.  Resident
    caches: decode steps and the share of stored blocks a sparse step read."""

    def __init__(self, offload: str | None) -> None:
        self.offload = offload
        self.calls = 0
        self.decode_steps = 0
        self.h2d_step_bytes = 0
        self.h2d_other_bytes = 0
        self.d2h_bytes = 0
        self.wanted = 0
        self.hits = 0
        self.peak = {"device_nbytes": 0, "index_nbytes": 0, "host_nbytes": 0}
        self.share_sum = 0.0  # resident: block share x sparse decode steps
        self.share_steps = 0

    def add(self, cache) -> None:
        stats = cache.stats()
        self.calls += 1
        self.decode_steps += stats["decode_steps"]
        if hasattr(cache, "host_nbytes"):
            self.h2d_step_bytes += sum(stats["h2d_bytes_per_step"])
            self.h2d_other_bytes += stats["h2d_other_bytes"]
            self.d2h_bytes += stats["d2h_bytes"]
            offloaded = [layer.offloaded for layer in cache.layers]
            self.wanted += sum(w for w, off in zip(stats["blocks_wanted_per_layer"], offloaded) if off)
            self.hits += sum(h for h, off in zip(stats["hits_per_layer"], offloaded) if off)
            for key in self.peak:
                self.peak[key] = max(self.peak[key], stats[key])
        elif stats["block_share"] is not None:
            self.share_sum += stats["block_share"] * stats["decode_steps"]
            self.share_steps += stats["decode_steps"]

    def describe(self) -> str:
        """One line for people (the numbers of `summary`)."""
        out = self.summary()
        text = f"{out['cache']}: {out['decode_steps']} decode steps in {out['generate_calls']} generate calls"
        if self.offload is None:
            share = out["block_share"]
            return text + ("" if share is None else f", {100 * share:.1f}% of the stored blocks read per step")
        mib = 2.0**20
        rate = "n/a" if out["hit_rate"] is None else f"{100 * out['hit_rate']:.1f}%"
        per_step = 0.0 if out["h2d_bytes_per_step"] is None else out["h2d_bytes_per_step"]
        return (
            text + f", H2D {per_step / mib:.2f} MiB per step, block hit rate {rate}, "
            f"device tier {out['device_nbytes_max'] / mib:.1f} MiB, "
            f"host tier {out['host_nbytes_max'] / mib:.1f} MiB"
        )

    def summary(self) -> dict:
        """Plain numbers (JSON): what `results["config"]["forecastkv"]["cache"]` holds."""
        out = {"cache": self.offload or "resident", "generate_calls": self.calls, "decode_steps": self.decode_steps}
        if self.offload is None:
            out["block_share"] = self.share_sum / self.share_steps if self.share_steps else None
            return out
        dense = self.offload == "dense-offload"
        out.update(
            h2d_bytes_per_step=self.h2d_step_bytes / self.decode_steps if self.decode_steps else None,
            h2d_step_bytes=self.h2d_step_bytes,
            h2d_other_bytes=self.h2d_other_bytes,
            d2h_bytes=self.d2h_bytes,
            hit_rate=None if dense or not self.wanted else self.hits / self.wanted,
            **{f"{key}_max": value for key, value in self.peak.items()},
        )
        return out


def forecast_request(forecast, forecast_init) -> dict | None:
    """The `forecast=` dict for the loader from the two model arguments (a JSON string is parsed)."""
    if isinstance(forecast, str):
        try:
            forecast = json.loads(forecast)
        except json.JSONDecodeError as error:
            raise ConfigError(f"forecast={forecast!r} is not a JSON object of forecast keys ({error})") from None
    if forecast is not None and not isinstance(forecast, dict):
        raise ConfigError(f"forecast must be a dict of forecast keys (heads_per_group, init), got {forecast!r}")
    if forecast_init is not None:
        forecast = {**(forecast or {}), "init": forecast_init}
    return forecast


@register_model("forecastkv")
class ForecastKVLM(HFLM):
    """HFLM over a `ForecastKVForCausalLM`, with an attention mode and an offload mode (see the
    module docstring for the arguments)."""

    def __init__(
        self,
        pretrained="bundled:smollm2-135m",
        sparse_config=None,
        forecast=None,
        forecast_init=None,
        forecast_weights=None,
        offload=None,
        selector=None,
        device=None,
        backend="causal",
        **kwargs,
    ) -> None:
        from .inference import MODES
        from .inference.offloaded import MODE_SELECTOR, resolve_selector
        from .selectors import get_selector

        if offload is not None and offload not in MODES:
            raise ConfigError(
                f"offload={offload!r} is not an offload mode; choose one of {MODES} "
                "(or leave it out for the resident cache)"
            )
        if selector is not None:
            try:
                get_selector(selector) if offload is None else resolve_selector(offload, selector, None)
            except ValueError as error:
                raise ConfigError(f"selector={selector!r}, offload={offload!r}: {error}") from None
        extra = sorted(set(kwargs) - set(PASSED_TO_LOADER) - _hflm_arguments())
        if extra:
            raise ConfigError(
                f"unknown model_args {extra} for --model forecastkv; its own are pretrained, sparse_config, forecast, "
                f"forecast_init, forecast_weights, offload, selector (and HFLM's: batch_size, device, dtype, "
                "max_length, ...)"
            )
        self.offload = offload
        self.selector = selector if selector is not None else MODE_SELECTOR.get(offload)
        # what chose the selector, for the errors below
        self.asked = f"selector={selector!r}" if selector is not None else f"offload={offload!r}"
        self.needs_heads = self.selector is not None and get_selector(self.selector).needs_forecast_heads
        self.forecast_note = None
        forecast = forecast_request(forecast, forecast_init)
        if isinstance(pretrained, str):
            pretrained = resolve_model_path(pretrained)
            if self.needs_heads and forecast is None and forecast_weights is None:
                from .modeling.head_files import has_forecast_heads

                if not has_forecast_heads(pretrained):
                    forecast = {"init": FORECAST_INIT_DEFAULT}
                    self.forecast_note = (
                        f"created: untrained heads ({FORECAST_INIT_DEFAULT} init); "
                        "pass forecast_weights=<dir> for trained ones"
                    )
                    logger.warning(
                        "%s selects blocks with Forecast heads and %s has none: %s",
                        self.asked,
                        pretrained,
                        self.forecast_note,
                    )
        elif sparse_config is not None or forecast is not None or forecast_weights is not None:
            raise ConfigError(
                "sparse_config, forecast, forecast_init and forecast_weights apply when pretrained is a path; "
                "a loaded model is evaluated as it is"
            )
        self._load_args = {"sparse_config": sparse_config, "forecast": forecast, "forecast_weights": forecast_weights}
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(pretrained=pretrained, device=device, backend=backend, **kwargs)
        self._apply_selector(loaded_here=isinstance(pretrained, str))
        self.cache_counters = CacheCounters(offload)
        _RUNS.append(self.cache_counters)

    def _apply_selector(self, loaded_here: bool) -> None:
        """Attend in the offload mode's attention mode (its selector) in every request type.  A
        model the caller loaded is not changed: its selector must already be the mode's."""
        config = self.model.config
        if self.selector is None or (config.sparse is not None and config.sparse.selector == self.selector):
            return
        if not loaded_here:
            raise ConfigError(
                f"{self.asked} selects blocks with the {self.selector} selector, and the model passed as "
                f"pretrained does not ({'dense' if config.sparse is None else config.sparse.selector!r}); load it with "
                f"sparse_config={{..., 'selector': {self.selector!r}}} or pass a path"
            )
        if config.sparse is None:
            raise ConfigError(
                f"{self.asked} needs a sparse model, and this one is dense: "
                "pass sparse_config=<preset> (e.g. smollm2-135m)"
            )
        if self.needs_heads and not config.forecast_config.enabled:
            raise ConfigError(
                f"{self.asked} selects blocks with Forecast heads and the model has none: "
                "pass forecast_init=next_query or forecast_weights=<dir>"
            )
        config.sparse_config = {**config.sparse_config, "selector": self.selector}

    def _create_model(
        self,
        pretrained,
        revision="main",
        dtype="auto",
        trust_remote_code=False,
        gpus=None,
        max_memory_per_gpu=None,
        max_cpu_memory=None,
        offload_folder=None,
        **kwargs,
    ) -> None:
        asked = sorted(name for name in UNSUPPORTED if kwargs.pop(name, None))
        if asked:
            raise ConfigError(f"--model forecastkv does not support the HFLM options {asked}")
        self._model = ForecastKVForCausalLM.from_pretrained(
            pretrained, revision=revision, dtype=dtype, device=self.device, **self._load_args, **kwargs
        )

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        """HFLM's generate with a fresh cache for this call (generation kwargs are deep-copied per
        batch, so a cache cannot be handed in through them); its counters are added up."""
        if self.offload is None:
            cache = SparseCache(self.model.config)
        else:
            from .inference import OffloadedSparseCache

            cache = OffloadedSparseCache.for_model(self.model, mode=self.offload, selector=self.selector)
        with torch.no_grad():
            out = super()._model_generate(context, max_length, stop, **{**generation_kwargs, CACHE_KWARG: cache})
        self.cache_counters.add(cache)
        return out

    def forecastkv_info(self) -> dict:
        """What this run was and what its caches moved (JSON)."""
        config = self.model.config
        sparse = config.sparse
        info = {
            "attention": "dense" if sparse is None else f"{sparse.policy}-{sparse.selector}",
            "offload": self.offload,
            "selector": self.selector,
            "sparse_config": config.sparse_config,
            "forecast": config.forecast if config.forecast_config.enabled else None,
            "loglikelihood": (
                "one forward in the attention mode above on the resident cache "
                "(the offload mode does not change the scores)"
            ),
            "cache": self.cache_counters.summary(),
        }
        if self.forecast_note:
            info["forecast_heads"] = self.forecast_note
        return info

    def get_model_info(self) -> dict:
        """HFLM's model info plus `forecastkv` (simple_evaluate puts both in results["config"])."""
        return {**super().get_model_info(), "forecastkv": self.forecastkv_info()}


def _hflm_arguments() -> set[str]:
    import inspect

    return {name for name in inspect.signature(HFLM.__init__).parameters if name not in ("self", "kwargs")}


def cli_evaluate(argv: list[str]) -> int:
    """Run lm-eval's command line with `argv` (its own arguments) and `--model forecastkv` known.
    Returns its exit status."""
    import sys

    from lm_eval.__main__ import cli_evaluate as lm_eval_main

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    _RUNS.clear()
    try:
        lm_eval_main()
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        raise
    finally:
        sys.argv = saved
    for counters in _RUNS:  # also in the results file (--output_path): config.forecastkv.cache
        print(f"forecastkv: cache counters ({counters.describe()})", file=sys.stderr)
    return 0
