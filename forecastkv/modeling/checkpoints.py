"""Checkpoint adapters: detect a checkpoint's format, map its config and weights onto ours.

Formats read (a local directory, or a hub id when the hub is reachable):
  * ours (`model_type: forecastkv`);
  * MiniCPM4 / 4.1 (`model_type: minicpm`: muP scalars, LongRoPE, `sparse_config`);
  * NOSA (Llama format plus `self_attn.A` / `self_attn.delta`);
  * any plain Llama-family checkpoint (sparse attention applied training-free);
  * SparDA indexer weights (`q_future_proj` -> `forecast_proj`, `q_curr_proj` -> `current_proj`).
Forecast weights also save and load on their own (`forecast.safetensors` + `forecast_config.json`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from ..bundled import resolve_heads_path
from ..errors import CheckpointError, ConfigError
from .checkpoint_dir import (
    _SPARSE_KEYS,
    FORECAST_KEY,
    SPARDA_NAME,
    open_checkpoint,
    resolve_directory,
)
from .configuration import ForecastConfig, ForecastKVConfig, resolve_sparse_config
from .head_files import (
    FORECAST_WEIGHTS,
    check_heads_geometry,
    read_forecast_side,
)
from .lazy_weights import (
    SAFETENSORS_DTYPES,
    LazyCheckpoint,
    load_into,
    read_safetensors_header,
    set_tensor,
)
from .remote_code import record_source

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "minicpm", "forecastkv")
ARCH_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
)
# SparDA's query selector (the teacher its heads were trained against) uses the exact LSE: its
# stage-1 kernel never reads MiniCPM4.1's coarse keys (plain MiniCPM4.1 runs the coarse one)
SPARDA_RULES = {"lse": "exact"}


def detect_format(raw: dict, state) -> str:
    """'forecastkv' | 'minicpm' | 'nosa' | 'llama'."""
    model_type = raw.get("model_type")
    if model_type == "forecastkv":
        return "forecastkv"
    if model_type == "minicpm":
        return "minicpm"
    if model_type not in LLAMA_FAMILY:
        raise CheckpointError(f"unsupported model_type {model_type!r}; forecastkv reads {LLAMA_FAMILY}")
    if any(key.endswith("self_attn.A") for key in state):
        return "nosa"
    return "llama"


def config_from_raw(raw: dict, fmt: str) -> dict:
    """Our config kwargs from a foreign config.json."""
    if fmt == "forecastkv":
        return {
            k: v for k, v in raw.items() if k not in ("architectures", "model_type", "transformers_version", "auto_map")
        }
    kwargs = {key: raw[key] for key in ARCH_KEYS if key in raw}
    if fmt == "minicpm":
        if "scale_emb" in raw or "scale_depth" in raw or "dim_model_base" in raw:
            kwargs["mup"] = {
                "scale_emb": float(raw.get("scale_emb", 1.0)),
                "scale_depth": float(raw.get("scale_depth", 1.0)),
                "dim_model_base": int(raw.get("dim_model_base", raw["hidden_size"])),
            }
        if raw.get("sparse_config"):
            # MiniCPM4.1 semantics: topk excludes the window, LSE estimated from the k2 keys
            given = dict(raw["sparse_config"])
            kwargs["sparse_config"] = {"lse": "coarse", **{k: v for k, v in given.items() if k in _SPARSE_KEYS}}
    if fmt == "nosa":
        kwargs["sparse_config"] = resolve_sparse_config("nosa-8b")
    if fmt == "llama" and raw.get("sparse_config") is not None:
        # a Llama-family config.json given a sparse_config by hand: forecastkv's keys and rules
        # (validated like every other source, never dropped for a dense run)
        kwargs["sparse_config"] = raw["sparse_config"]
    return kwargs


def load_model(
    cls,
    path_or_id,
    sparse_config=None,
    forecast: dict | None = None,
    forecast_weights: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    config: ForecastKVConfig | None = None,
    device_map: str | dict | None = None,
    allow_geometry_mismatch: bool = False,
    **kwargs,
):
    """Build `cls` from any supported checkpoint.  See `ForecastKVForCausalLM.from_pretrained`.

    Lean: the model is built on the meta device (no initialiser touches a real tensor), then each
    checkpoint tensor is read once, cast to `dtype` (default: torch's default dtype) and placed on
    `device` (default CPU) or on its `device_map` device ("auto" or a dict, through accelerate).
    Peak memory is about the loaded model plus its largest tensor.
    """
    directory = resolve_directory(path_or_id, **kwargs)
    forecast_weights = resolve_heads_path(forecast_weights)  # "bundled:NAME": the heads shipped for NAME
    raw = read_config_json(directory)
    checkpoint = open_checkpoint(directory)
    state = checkpoint.names  # name -> shape; the data stays on disk until load_into
    fmt = detect_format(raw, state)
    settings = config_from_raw(raw, fmt) if config is None else config.to_dict()
    heads, side = _merge_settings(
        settings, checkpoint, sparse_config, forecast, forecast_weights, allow_geometry_mismatch
    )
    _require_forecast_heads(settings, directory)
    for key in ("architectures", "model_type", "transformers_version", "auto_map", "torch_dtype", "dtype"):
        settings.pop(key, None)
    try:
        model_config = ForecastKVConfig(**settings)
    except ConfigError as error:  # name the source: the caller's arguments or the folder's config.json
        given = sparse_config is not None or forecast is not None or config is not None
        source = directory / "config.json"
        if given:
            source = "the sparse_config / forecast / config given to from_pretrained"
        raise ConfigError(f"{source}: {error}") from None
    dtype = resolve_dtype(dtype, raw, directory)
    device = torch.device("cpu" if device is None else device)
    with torch.device("meta"):
        model = cls(model_config)
    device_map = resolve_device_map(model, device_map, dtype)
    if side.get("sparda"):
        _complete_sparda_heads(model, heads)
    if heads:
        _check_heads(model, heads, forecast_weights, directory, side.get("base_model"))
    shapes = {**state, **{name: tuple(tensor.shape) for name, tensor in heads.items()}}
    created = _check_names(model, shapes, directory, created_ok=forecast is not None)
    tied_head = model_config.tie_word_embeddings
    loaded = [name for name in state if name not in heads and not (tied_head and name == "lm_head.weight")]
    load_into(model, checkpoint, loaded, dtype, device, device_map)
    for name, tensor in heads.items():
        load_into_one(model, name, tensor, dtype, device, device_map)
    materialize_rest(model, dtype, device, device_map)
    if created:
        from .forecast_init import apply_forecast_init

        apply_forecast_init(model, model_config.forecast_config.init)
    from .generation import load_generation_config

    # the checkpoint's generation defaults, its offload mode (`forecastkv_cache`) included
    model.generation_config = load_generation_config(directory) or model.generation_config
    # tensors sit on their device_map devices; the decoder loop moves activations
    return record_source(model.eval(), directory)


def read_config_json(directory: Path) -> dict:
    """The checkpoint's config.json; a missing or corrupt one is a `CheckpointError`."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"no config.json in {directory}")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"corrupt config.json in {directory}: {error}") from error


def _merge_settings(
    settings: dict,
    checkpoint: LazyCheckpoint,
    sparse_config,
    forecast: dict | None,
    forecast_weights,
    allow_geometry_mismatch: bool,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Update the config kwargs `settings` in place: the checkpoint's own heads, the caller's
    sparse_config and forecast, the heads of `forecast_weights` and SparDA's rules.  Returns those
    heads {name: tensor} and their side config (both empty without `forecast_weights`)."""
    if any(FORECAST_KEY.search(key) for key in checkpoint.names):
        settings["forecast"] = {**ForecastConfig().to_dict(), **(settings.get("forecast") or {}), "enabled": True}
    if sparse_config is not None:
        settings["sparse_config"] = resolve_sparse_config(sparse_config)
    if forecast is not None:
        settings["forecast"] = {**(settings.get("forecast") or {}), **forecast, "enabled": True}
    sparda = any(SPARDA_NAME.search(key) for key in checkpoint.stored_names)  # heads under SparDA's own names
    heads, side = {}, {}
    if forecast_weights is not None:
        heads, side = read_forecast_side(forecast_weights, settings)
        settings["forecast"] = {**side["forecast"], "enabled": True}
        if settings.get("sparse_config") is None:
            settings["sparse_config"] = side.get("sparse_config")
        check_heads_geometry(
            forecast_weights, side.get("sparse_config"), settings.get("sparse_config"), allow_geometry_mismatch
        )
        # loaded heads exist to select blocks: the forecast selector goes on (also on a base with
        # its own sparse_config, e.g. MiniCPM4.1 or NOSA) unless the caller's dict names a selector
        explicit = isinstance(sparse_config, dict) and "selector" in sparse_config
        if settings.get("sparse_config") is not None and not explicit:
            settings["sparse_config"] = {**settings["sparse_config"], "selector": "forecast"}
        sparda = sparda or side.get("sparda", False)
    if sparda and settings.get("sparse_config") is not None:
        # SparDA's rules where the caller's dict does not name them
        given = sparse_config if isinstance(sparse_config, dict) else {}
        rules = {k: v for k, v in SPARDA_RULES.items() if k not in given}
        settings["sparse_config"] = {**settings["sparse_config"], **rules}
    return dict(heads), side


def _require_forecast_heads(settings: dict, directory: Path) -> None:
    """A sparse_config that selects with the forecast selector needs heads (loaded or created)."""
    sparse = settings.get("sparse_config")
    wants_forecast = isinstance(sparse, dict) and sparse.get("selector") == "forecast"
    if wants_forecast and not (settings.get("forecast") or {}).get("enabled"):
        layers = list(range(max(int(settings.get("num_hidden_layers", 1)) - 1, 0)))
        raise CheckpointError(
            f"sparse_config selects blocks with the forecast selector but {directory} has no forecast weights: "
            f"missing forecast_proj on layers {layers} and current_proj on layer 0; "
            "pass forecast={...} to create them or forecast_weights=<dir> to load trained ones"
        )


def _complete_sparda_heads(model, heads: dict[str, torch.Tensor]) -> None:
    """SparDA may leave out the last layer's forecast head (nothing reads it): a zero one, in place."""
    last = f"model.layers.{model.config.num_hidden_layers - 1}.self_attn.forecast_proj.weight"
    expected = dict(model.named_parameters())
    if heads and last not in heads and last in expected:
        heads[last] = torch.zeros(expected[last].shape)


def resolve_dtype(dtype, raw: dict, directory: Path) -> torch.dtype:
    """The torch dtype to load into, from any value transformers' `from_pretrained` takes: None
    (torch's default dtype), a torch.dtype, its name ("bfloat16", "torch.float16") or "auto": the
    checkpoint's own dtype (config.json's `dtype` / `torch_dtype`, else its first floating tensor's)."""
    if dtype is None:
        return torch.get_default_dtype()
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        stored = raw.get("dtype") or raw.get("torch_dtype")
        if stored is not None:
            return resolve_dtype(stored, raw, directory)
        return _stored_floating_dtype(directory) or torch.get_default_dtype()
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else None
    value = getattr(torch, name, None) if name else None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not a floating torch dtype, its name (e.g. 'bfloat16') or 'auto'")
    return value


def _stored_floating_dtype(directory: Path) -> torch.dtype | None:
    """The dtype of the first floating tensor in the directory's safetensors files (headers only)."""
    for file in sorted(directory.glob("*.safetensors")):
        if file.name == FORECAST_WEIGHTS:
            continue
        header, _ = read_safetensors_header(file)
        for entry in header.values():
            if SAFETENSORS_DTYPES[entry["dtype"]].is_floating_point:
                return SAFETENSORS_DTYPES[entry["dtype"]]
    return None


def load_into_one(model, name: str, tensor: torch.Tensor, dtype, device, device_map) -> None:
    from .lazy_weights import device_for

    target = dtype if tensor.is_floating_point() else tensor.dtype
    set_tensor(model, name, tensor.to(device=device_for(name, device_map, device), dtype=target))


def resolve_device_map(model, device_map, dtype) -> dict | None:
    """None, a dict {module prefix: device}, or "auto" / "balanced" / "sequential" (accelerate
    plans it from the meta model's sizes and the free memory of every device)."""
    if isinstance(device_map, dict) and any(str(d) == "disk" for d in device_map.values()):
        raise ValueError("device_map entries 'disk' are not supported: place every module on a device or 'cpu'")
    if device_map is None or isinstance(device_map, dict):
        return device_map
    if isinstance(device_map, str):
        from accelerate import infer_auto_device_map

        if device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
            raise ValueError(
                f"device_map={device_map!r} is not a dict or one of 'auto', 'balanced', 'balanced_low_0', 'sequential'"
            )
        planned = infer_auto_device_map(model, no_split_module_classes=model._no_split_modules, dtype=dtype)
        return resolve_device_map(model, planned, dtype)
    raise TypeError(f"device_map must be None, a str or a dict, got {type(device_map).__name__}")


def materialize_rest(model, dtype, device, device_map) -> None:
    """After loading: forecast heads the checkpoint lacked get storage (their init runs next),
    rotary tables are recomputed on their device (they are not stored), tied weights are tied."""
    from .lazy_weights import device_for
    from .rotary import RotaryEmbedding

    for name, param in list(model.named_parameters()):
        if param.is_meta and FORECAST_KEY.search(name):
            set_tensor(model, name, torch.empty(param.shape, dtype=dtype, device=device_for(name, device_map, device)))
    for name, module in list(model.named_modules()):
        if isinstance(module, RotaryEmbedding):
            parent, _, attr = name.rpartition(".")
            with torch.device(device_for(name, device_map, device)):
                setattr(model.get_submodule(parent), attr, RotaryEmbedding(model.config))
    if model.config.tie_word_embeddings:
        model.tie_weights()
    still = [name for name, tensor in list(model.named_parameters()) + list(model.named_buffers()) if tensor.is_meta]
    if still:
        raise CheckpointError(f"{len(still)} model tensors were neither loaded nor created, e.g. {still[:3]}")


def _check_heads(model, heads: dict, heads_path, directory: Path, trained_on: str | None) -> None:
    """Loaded heads against the base `model`: the same layers and shapes, else an error naming the
    heads (not the base) and what to do instead."""
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items() if FORECAST_KEY.search(name)}
    config = model.config
    origin = f" (forecast_config.json: trained on {trained_on})" if trained_on else ""
    advice = (
        "heads only fit the base they were trained on: train heads for this base (forecastkv train-forecast), "
        "or leave out forecast_weights and create untrained heads "
        "(forecast={'init': 'next_query'}, --forecast-init next_query)"
    )

    def layers(names) -> list[int]:
        return sorted({int(re.search(r"layers\.(\d+)\.", name).group(1)) for name in names})

    unknown = sorted(set(heads) - set(expected), key=lambda n: (layers([n]), n))
    missing = sorted(set(expected) - set(heads), key=lambda n: (layers([n]), n))
    if unknown or missing:
        held = layers(heads)
        raise CheckpointError(
            f"the forecast heads {heads_path} hold {len(heads)} tensors for layers {held[0]}-{held[-1]}{origin}, "
            f"but the base {directory} has {config.num_hidden_layers} layers"
            + (f" (it has no {unknown[0]})" if unknown else f" (missing {missing[0]})")
            + f": {advice}"
        )
    for name, tensor in heads.items():
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"the forecast heads {heads_path}: {name} has shape {tuple(tensor.shape)}{origin}, "
                f"the base {directory} (hidden_size {config.hidden_size}, "
                f"{config.num_key_value_heads} KV heads of {config.head_dim}, "
                f"heads_per_group {config.forecast_config.heads_per_group}) needs {expected[name]}: {advice}"
            )


def _check_names(model, state: dict, directory: Path, created_ok: bool) -> bool:
    """Check the checkpoint's names and shapes `state` {name: shape} against `model`.  Returns
    True when forecast heads are absent and will be created."""
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    state = dict(state)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"{directory} has {len(unexpected)} tensors this model does not know, e.g. {unexpected[:3]}"
        )
    missing = sorted(set(expected) - set(state))
    missing_heads = [key for key in missing if FORECAST_KEY.search(key)]
    missing_base = [key for key in missing if key not in missing_heads]
    if missing_base:
        raise CheckpointError(
            f"partial checkpoint {directory}: {len(missing_base)} tensors missing, e.g. {missing_base[:3]}"
        )
    if missing_heads and not created_ok:
        layers = sorted({int(re.search(r"layers\.(\d+)\.", key).group(1)) for key in missing_heads})
        raise CheckpointError(
            f"{directory} lacks forecast weights for layers {layers}; pass forecast={{...}} to create them"
        )
    for key, shape in state.items():
        if tuple(shape) != expected[key]:
            raise CheckpointError(
                f"tensor {key} has shape {tuple(shape)} in {directory}, the model expects {expected[key]}"
            )
    return bool(missing_heads)


# ----------------------------------------------------------------------------------------------
# forecast weights on their own
# ----------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------
# plain transformers loading: auto_map, remote-code modules, tokenizer files
# ----------------------------------------------------------------------------------------------


