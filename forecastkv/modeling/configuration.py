"""`ForecastKVConfig` and its three parts: `sparse_config`, `forecast` and `mup`.

The parts are stored on the config as plain dicts (so `config.json` stays plain JSON) and read
through the validated dataclasses `SparseConfig`, `ForecastConfig` and `MupConfig`.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from importlib import resources
from typing import Any, TypeVar

from transformers import PreTrainedConfig

from ..errors import ConfigError
from ..modes import SELECTORS
from ..selectors import get_selector

# Presets are package data (forecastkv/presets/*.json), so any install -- wheel, sdist or editable --
# finds them; `configs/` at the repository root holds only run recipes.
PRESET_DIR = resources.files("forecastkv") / "presets"


Config = TypeVar("Config")


def strict_from_dict(cls: type[Config], values: Mapping | Config, what: str) -> Config:
    """`cls(**values)` for the config dataclass `cls`, strictly: `values` is a mapping (or a `cls`
    already, returned as it is) whose keys are all fields of `cls`.  Anything else is a
    `ConfigError` naming `what` (the section, e.g. "sparse_config") and the allowed keys; the
    values themselves are checked by `cls.__post_init__`.  The one `from_dict` of `SparseConfig`,
    `ForecastConfig`, `MupConfig` and `training.objective.ObjectiveConfig`."""
    if isinstance(values, cls):
        return values
    if not isinstance(values, Mapping):
        raise ConfigError(f"{what} must be a mapping of {what} keys, got {values!r}")
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ConfigError(f"unknown {what} key(s) {unknown}; allowed keys are {sorted(allowed)}")
    return cls(**values)


@dataclass(frozen=True)
class SparseConfig:
    """Block-sparse attention geometry and policy (MiniCPM4.1 `sparse_config` semantics).

    `topk` counts the blocks selected *besides* the local window, so one query attends to at most
    `topk + window_size // block_size` blocks; init and local (`local_blocks + 1`) blocks are forced.
    """

    kernel_size: int = 32
    kernel_stride: int = 16
    block_size: int = 64
    init_blocks: int = 1
    window_size: int = 2048
    topk: int = 64
    dense_len: int = 8192
    use_nope: bool = False
    lse: str = "exact"  # "exact" | "coarse" (MiniCPM4.1's k2 estimate)
    policy: str = "infllmv2"  # "infllmv2" | "nosa"
    query_blocks: int = 16  # NOSA: query-aware blocks besides init + local
    selector: str = "query"  # one of SELECTORS (forecastkv/modes.py documents each)
    # Twilight-style top-p budget: 0 = the fixed budget; else per KV head the fewest non-forced blocks
    # holding p of their score mass, forced blocks kept, at most budget_blocks in all
    top_p: float = 0.0
    # the `reuse` selector (Kascade): layers that select with their own query; the others reuse the
    # blocks of the last anchor before them
    reuse_anchors: tuple = (0,)
    # NOSA: whether dense attention (below dense_len) adds the CIS bias as sparse attention does;
    # SparDA-NOSA's dense fallback adds none (its preset sets False)
    dense_cis_bias: bool = True

    def __post_init__(self) -> None:
        for name in ("kernel_size", "kernel_stride", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"sparse_config.{name} must be a positive integer, got {value!r}")
        for name in ("init_blocks", "window_size", "topk", "query_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"sparse_config.{name} must be a non-negative integer, got {value!r}")
        if self.kernel_size < self.kernel_stride:
            raise ConfigError(
                f"sparse_config.kernel_size={self.kernel_size} must be >= kernel_stride={self.kernel_stride}"
            )
        if self.block_size % self.kernel_stride:
            raise ConfigError(
                f"sparse_config.block_size={self.block_size} must be a multiple of kernel_stride={self.kernel_stride}"
            )
        if self.window_size % self.block_size:
            raise ConfigError(
                f"sparse_config.window_size={self.window_size} must be a multiple of block_size={self.block_size}"
            )
        if not isinstance(self.dense_len, int) or self.dense_len < -1:
            raise ConfigError(f"sparse_config.dense_len must be an integer >= -1, got {self.dense_len!r}")
        choices = {"lse": ("exact", "coarse"), "policy": ("infllmv2", "nosa"), "selector": SELECTORS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"sparse_config.{name}={getattr(self, name)!r} is not one of {allowed}")
        if not isinstance(self.dense_cis_bias, bool):
            raise ConfigError(f"sparse_config.dense_cis_bias must be true or false, got {self.dense_cis_bias!r}")
        if self.use_nope:
            raise ConfigError("sparse_config.use_nope=True is not supported: selection uses post-RoPE keys")
        self._check_budget_rules()
        # the registered Selector of `selector`, resolved once here, so a forward call reads no name
        object.__setattr__(self, "rule", get_selector(self.selector))

    def _check_budget_rules(self) -> None:
        """top_p in [0, 1] (0: off), and reuse_anchors a list of distinct layer ids holding 0 (stored as a tuple)."""
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ConfigError(f"sparse_config.top_p must be a number in [0, 1] (0 = the fixed budget), got {p!r}")
        if p and self.policy != "infllmv2":
            raise ConfigError(f"sparse_config.top_p={p!r} needs policy 'infllmv2' (NOSA fills a fixed budget), "
                              f"got policy {self.policy!r}")
        anchors = self.reuse_anchors
        if isinstance(anchors, (str, bytes)) or not isinstance(anchors, (list, tuple)):
            raise ConfigError(f"sparse_config.reuse_anchors must be a list of layer ids, got {anchors!r}")
        if any(isinstance(a, bool) or not isinstance(a, int) or a < 0 for a in anchors):
            raise ConfigError(f"sparse_config.reuse_anchors must hold non-negative layer ids, got {list(anchors)!r}")
        if 0 not in anchors or len(set(anchors)) != len(anchors):
            raise ConfigError(
                f"sparse_config.reuse_anchors must hold layer 0 (it has no layer before it to reuse) and no id "
                f"twice, got {list(anchors)!r}"
            )
        object.__setattr__(self, "reuse_anchors", tuple(sorted(anchors)))
        object.__setattr__(self, "top_p", float(p))

    # cached: computed at the first read, then a plain attribute (selection reads them every step)
    @functools.cached_property
    def local_blocks(self) -> int:
        return self.window_size // self.block_size

    @functools.cached_property
    def budget_blocks(self) -> int:
        """Most blocks one query attends to (`topk` + the local window)."""
        return self.topk + self.local_blocks

    @functools.cached_property
    def coarse_kernel(self) -> tuple[int, int]:
        """MiniCPM4.1's second compression level (4x kernel, 4x stride), used only for the LSE."""
        return 4 * self.kernel_size, 4 * self.kernel_stride

    @classmethod
    def from_dict(cls, values: dict | None) -> "SparseConfig | None":
        return None if values is None else strict_from_dict(cls, values, "sparse_config")

    def to_dict(self) -> dict:
        values = asdict(self)
        values["reuse_anchors"] = list(self.reuse_anchors)  # plain JSON, and equal to what was read
        return values


@dataclass(frozen=True)
class ForecastConfig:
    """Forecast heads: `heads_per_group` vectors per KV head on every layer, `current_proj` on layer 0."""

    enabled: bool = False
    heads_per_group: int = 1
    init: str = "kaiming"  # "kaiming" | "next_query"

    def __post_init__(self) -> None:
        if not isinstance(self.heads_per_group, int) or self.heads_per_group < 1:
            raise ConfigError(f"forecast.heads_per_group must be a positive integer, got {self.heads_per_group!r}")
        if self.init not in ("kaiming", "next_query"):
            raise ConfigError(f"forecast.init={self.init!r} is not one of ('kaiming', 'next_query')")

    @classmethod
    def from_dict(cls, values: dict | None) -> "ForecastConfig":
        return cls() if values is None else strict_from_dict(cls, values, "forecast")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MupConfig:
    """MiniCPM's muP scalars: embeddings x scale_emb, residual branches x scale_depth/sqrt(L),
    logits / (hidden_size / dim_model_base)."""

    scale_emb: float = 1.0
    scale_depth: float = 1.0
    dim_model_base: int = 1

    def __post_init__(self) -> None:
        for name in ("scale_emb", "scale_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"mup.{name} must be a finite number, got {value!r}")
        if isinstance(self.dim_model_base, bool) or not isinstance(self.dim_model_base, int) or self.dim_model_base < 1:
            raise ConfigError(f"mup.dim_model_base must be a positive integer, got {self.dim_model_base!r}")

    @classmethod
    def from_dict(cls, values: dict | None) -> "MupConfig | None":
        return None if values is None else strict_from_dict(cls, values, "mup")

    def to_dict(self) -> dict:
        return asdict(self)


def list_presets() -> list[str]:
    """Names of the shipped presets (`forecastkv/presets/<name>.json`)."""
    return sorted(entry.name[: -len(".json")] for entry in PRESET_DIR.iterdir() if entry.name.endswith(".json"))


def load_preset(name: str) -> dict:
    """The shipped preset `forecastkv/presets/<name>.json` as a dict (keys: `sparse_config`,
    optional `forecast`, and optional architecture fields)."""
    entry = PRESET_DIR / f"{name}.json"
    if not isinstance(name, str) or "/" in name or not entry.is_file():
        raise ConfigError(f"unknown sparse_config preset {name!r}; known presets: {list_presets()}")
    return json.loads(entry.read_text())


def resolve_sparse_config(value: str | dict | SparseConfig | None) -> dict | None:
    """A preset name, a dict of `sparse_config` keys, a `SparseConfig` or None -> validated dict."""
    if value is None:
        return None
    if isinstance(value, str):
        value = load_preset(value)["sparse_config"]
    if isinstance(value, SparseConfig):
        return value.to_dict()
    return SparseConfig.from_dict(dict(value)).to_dict()


# How alike an unknown key must be to one of ours to be taken for a misspelling of it (difflib's
# ratio; "prefill_chunk_size" ~ "query_chunk_size" is 0.71).
MISSPELT_KEY_RATIO = 0.7


def _check_misspelt_keys(extra: dict) -> None:
    """Raise for a key of `extra` (the kwargs `ForecastKVConfig` does not name) that is close to one
    of ours and is no config key transformers knows: a misspelt key would otherwise be stored and
    silently ignored.  The extras of real checkpoints (`layer_norm_eps`, `num_kv_heads`, ... of
    other architectures, MiniCPM's `scale_emb`) stay accepted."""
    ours = [name for name in inspect.signature(ForecastKVConfig.__init__).parameters if name not in ("self", "kwargs")]
    for key in extra:
        if key.startswith("_"):
            continue
        close = difflib.get_close_matches(key, ours, n=2, cutoff=MISSPELT_KEY_RATIO)
        if close and key not in _transformers_keys():
            raise ConfigError(f"unknown ForecastKVConfig key {key!r}; did you mean {' or '.join(map(repr, close))}?")


@functools.cache
def _transformers_keys() -> frozenset[str]:
    """Every config key some transformers architecture defines (the init arguments of all the
    registered config classes, ~2K names).  Built once, and only when an unknown key is close to
    one of ours (a few seconds: it imports every config module)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    keys = set(inspect.signature(PreTrainedConfig.__init__).parameters) | set(PreTrainedConfig().to_dict())
    for model_type in list(CONFIG_MAPPING.keys()):
        try:
            keys |= set(inspect.signature(CONFIG_MAPPING[model_type].__init__).parameters)
        except Exception:  # noqa: BLE001 - an optional architecture that fails to import has no keys to add
            continue
    return frozenset(keys)


class ForecastKVConfig(PreTrainedConfig):
    """A Llama-family decoder with block-sparse attention and optional Forecast heads."""

    model_type = "forecastkv"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 4096,
        intermediate_size: int = 11008,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 2048,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | list[int] | None = 2,
        tie_word_embeddings: bool = False,
        rope_parameters: dict | None = None,
        attention_bias: bool = False,
        mlp_bias: bool = False,
        mup: dict | None = None,
        sparse_config: str | dict | None = None,
        forecast: dict | None = None,
        query_chunk_size: int = 256,
        prefill_chunk: int = 0,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        _check_misspelt_keys(kwargs)
        legacy_theta = kwargs.pop("rope_theta", None)
        legacy_scaling = kwargs.pop("rope_scaling", None)
        if rope_parameters is None:
            rope_parameters = dict(legacy_scaling or {})
            rope_parameters.setdefault("rope_type", rope_parameters.pop("type", "default"))
            rope_parameters.setdefault("rope_theta", legacy_theta if legacy_theta is not None else 10000.0)
        self.rope_parameters = rope_parameters
        self.mup = mup  # validated and parsed in __setattr__
        self.sparse_config = sparse_config  # a preset name, a dict, a SparseConfig or None
        self.forecast = forecast
        if not isinstance(query_chunk_size, int) or query_chunk_size < 1:
            raise ConfigError(f"query_chunk_size must be a positive integer, got {query_chunk_size!r}")
        self.query_chunk_size = query_chunk_size
        # rows per forward call of a long prefill (ForecastKVModel.forward_chunked); 0 = one call
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 0:
            raise ConfigError(
                "prefill_chunk must be a non-negative integer (0 = the whole prompt in one call), "
                f"got {prefill_chunk!r}"
            )
        self.prefill_chunk = prefill_chunk
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self._check_forecast_fits()

    def _check_forecast_fits(self) -> None:
        group = self.num_attention_heads // self.num_key_value_heads
        per_group = self.forecast_config.heads_per_group
        if per_group > group:
            raise ConfigError(f"forecast.heads_per_group={per_group} exceeds the GQA group size {group}")
        sparse = self.sparse
        positions = getattr(self, "max_position_embeddings", None)
        for name in ("kernel_size", "block_size"):
            value = None if sparse is None else getattr(sparse, name)
            if value is not None and isinstance(positions, int) and value > positions:
                raise ConfigError(
                    f"sparse_config.{name}={value} exceeds max_position_embeddings={positions}: "
                    "no sequence of this model fills one"
                )
        heads = sparse is not None and get_selector(sparse.selector).needs_forecast_heads
        if heads and not self.forecast_config.enabled:
            raise ConfigError(
                f"sparse_config.selector={sparse.selector!r} needs forecast heads: "
                "pass forecast={'enabled': True, ...}"
            )

    # What `from_pretrained(..., sparse_config=, forecast=, forecast_weights=)` asks of the loader
    # (create heads, load heads, switch the geometry), so the Auto classes must hand them on to
    # `ForecastKVForCausalLM.from_pretrained` instead of setting them on the config.
    LOAD_ARGUMENTS = ("sparse_config", "forecast", "forecast_weights", "allow_geometry_mismatch")

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs: Any):
        """transformers' `from_dict`, except that when the caller collects the unused kwargs (the
        Auto classes' `from_pretrained` does) the `LOAD_ARGUMENTS` stay unused: set on the config,
        `forecast={...}` would be stored without creating any head."""
        if not kwargs.get("return_unused_kwargs"):
            return super().from_dict(config_dict, **kwargs)
        held = {key: kwargs.pop(key) for key in cls.LOAD_ARGUMENTS if key in kwargs}
        config, unused = super().from_dict(config_dict, **kwargs)
        return config, {**unused, **held}

    # The three parts are validated and parsed once, when assigned, into plain attributes
    # (`sparse`, `forecast_config`, `mup_config`): a decode step reads them without a call.
    _PARSED = {"sparse_config": "sparse", "forecast": "forecast_config", "mup": "mup_config"}

    def __setattr__(self, key: str, value: Any) -> None:
        if key == "sparse_config":
            value = resolve_sparse_config(value)
            super().__setattr__("sparse", SparseConfig.from_dict(value))
        elif key == "forecast":
            parsed = ForecastConfig.from_dict(value)
            value = parsed.to_dict()
            super().__setattr__("forecast_config", parsed)
        elif key == "mup":
            parsed = MupConfig.from_dict(value)
            value = None if parsed is None else parsed.to_dict()
            super().__setattr__("mup_config", parsed)
        super().__setattr__(key, value)

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        for private in self._PARSED.values():
            output.pop(private, None)
        return output

