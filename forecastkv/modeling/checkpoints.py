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
import tempfile
from pathlib import Path

import torch

from .configuration import ForecastConfig, ForecastKVConfig, resolve_sparse_config

FORECAST_WEIGHTS = "forecast.safetensors"
FORECAST_CONFIG = "forecast_config.json"
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "minicpm", "forecastkv")
ARCH_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
    "rms_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "rope_parameters", "rope_theta", "rope_scaling",
)
RENAMES = ((re.compile(r"\.q_future_proj\."), ".forecast_proj."), (re.compile(r"\.q_curr_proj\."), ".current_proj."))
IGNORED = re.compile(r"rotary_emb\.|\.inv_freq$")
FORECAST_KEY = re.compile(r"\.(forecast_proj|current_proj)\.weight$")


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, corrupt, partial or of an unknown format."""


def resolve_directory(path_or_id: str | os.PathLike, **hub_kwargs) -> Path:
    path = Path(path_or_id)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is a file; pass the checkpoint directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path_or_id), **{k: v for k, v in hub_kwargs.items() if k in ("revision", "token", "cache_dir")}))
    except Exception as error:  # offline machines land here
        raise CheckpointError(f"{path_or_id!r} is neither a local directory nor a reachable hub id ({error})") from error


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single or sharded safetensors, or pytorch_model.bin)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / shard for shard in shards]
    else:
        files = sorted(directory.glob("*.safetensors"))
        files = [f for f in files if f.name != FORECAST_WEIGHTS]
    state: dict[str, torch.Tensor] = {}
    if not files:
        binary = directory / "pytorch_model.bin"
        if not binary.is_file():
            raise CheckpointError(f"no weights in {directory}: expected model.safetensors (or shards) or pytorch_model.bin")
        return torch.load(binary, map_location="cpu", weights_only=True)
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"partial checkpoint: shard {file.name} listed in the index is missing from {directory}")
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError, RuntimeError) as error:
            raise CheckpointError(f"corrupt checkpoint file {file}: {error}") from error
    return state


def detect_format(raw: dict, state: dict[str, torch.Tensor]) -> str:
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
        return {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "transformers_version", "auto_map")}
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
    return kwargs


_SPARSE_KEYS = set(resolve_sparse_config({}).keys())


def map_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    mapped = {}
    for key, tensor in state.items():
        if IGNORED.search(key):
            continue
        for pattern, replacement in RENAMES:
            key = pattern.sub(replacement, key)
        mapped[key] = tensor
    return mapped


def load_model(
    cls,
    path_or_id,
    sparse_config=None,
    forecast: dict | None = None,
    forecast_weights: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    config: ForecastKVConfig | None = None,
    **kwargs,
):
    """Build `cls` from any supported checkpoint.  See `ForecastKVForCausalLM.from_pretrained`."""
    directory = resolve_directory(path_or_id, **kwargs)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"no config.json in {directory}")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"corrupt config.json in {directory}: {error}") from error
    state = map_state_dict(read_state_dict(directory))
    fmt = detect_format(raw, state)
    settings = config_from_raw(raw, fmt) if config is None else config.to_dict()
    has_heads = any(FORECAST_KEY.search(key) for key in state)
    if has_heads:
        settings["forecast"] = {**ForecastConfig().to_dict(), **(settings.get("forecast") or {}), "enabled": True}
    if sparse_config is not None:
        settings["sparse_config"] = resolve_sparse_config(sparse_config)
    if forecast is not None:
        settings["forecast"] = {**(settings.get("forecast") or {}), **forecast, "enabled": True}
    heads = None
    if forecast_weights is not None:
        heads, side = read_forecast_side(forecast_weights, settings)
        settings["forecast"] = {**side["forecast"], "enabled": True}
        if settings.get("sparse_config") is None:
            settings["sparse_config"] = side.get("sparse_config")
        # loaded heads exist to select blocks: the forecast selector goes on (also on a base with
        # its own sparse_config, e.g. MiniCPM4.1 or NOSA) unless the caller's dict names a selector
        explicit = isinstance(sparse_config, dict) and "selector" in sparse_config
        if settings.get("sparse_config") is not None and not explicit:
            settings["sparse_config"] = {**settings["sparse_config"], "selector": "forecast"}
    sparse = settings.get("sparse_config")
    wants_forecast = isinstance(sparse, dict) and sparse.get("selector") == "forecast"
    if wants_forecast and not (settings.get("forecast") or {}).get("enabled"):
        layers = list(range(max(int(settings.get("num_hidden_layers", 1)) - 1, 0)))
        raise CheckpointError(
            f"sparse_config selects blocks with the forecast selector but {directory} has no forecast weights: "
            f"missing forecast_proj on layers {layers} and current_proj on layer 0; "
            "pass forecast={...} to create them or forecast_weights=<dir> to load trained ones"
        )
    for key in ("architectures", "model_type", "transformers_version", "auto_map", "torch_dtype", "dtype"):
        settings.pop(key, None)
    model_config = ForecastKVConfig(**settings)
    model = cls(model_config)
    if heads is not None:
        last = f"model.layers.{model_config.num_hidden_layers - 1}.self_attn.forecast_proj.weight"
        if last not in heads and last in model.state_dict():  # SparDA may leave out the unused last head
            heads[last] = torch.zeros_like(model.state_dict()[last])
        state.update(heads)
    created = _load_weights(model, state, directory, created_ok=forecast is not None)
    if created:
        from .forecast_init import apply_forecast_init

        apply_forecast_init(model, model_config.forecast_config.init)
    if dtype is not None:
        model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    if device is not None:
        model = model.to(device)
    return model.eval()


def _load_weights(model, state: dict[str, torch.Tensor], directory: Path, created_ok: bool) -> bool:
    """Copy `state` into `model`.  Returns True when forecast heads were absent and left to init."""
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(f"{directory} has {len(unexpected)} tensors this model does not know, e.g. {unexpected[:3]}")
    missing = sorted(set(expected) - set(state))
    missing_heads = [key for key in missing if FORECAST_KEY.search(key)]
    missing_base = [key for key in missing if key not in missing_heads]
    if missing_base:
        raise CheckpointError(f"partial checkpoint {directory}: {len(missing_base)} tensors missing, e.g. {missing_base[:3]}")
    if missing_heads and not created_ok:
        layers = sorted({int(re.search(r"layers\.(\d+)\.", key).group(1)) for key in missing_heads})
        raise CheckpointError(
            f"{directory} lacks forecast weights for layers {layers}; pass forecast={{...}} to create them"
        )
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise CheckpointError(f"tensor {key} has shape {tuple(tensor.shape)} in {directory}, the model expects {tuple(expected[key].shape)}")
    model.load_state_dict(state, strict=False)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return bool(missing_heads)


# ----------------------------------------------------------------------------------------------
# forecast weights on their own
# ----------------------------------------------------------------------------------------------


def forecast_state_dict(model) -> dict[str, torch.Tensor]:
    return {key: value.detach().cpu().contiguous() for key, value in model.state_dict().items() if FORECAST_KEY.search(key)}


def save_forecast_weights(model, directory: str | os.PathLike, base_model: str | None = None) -> Path:
    """Write `forecast.safetensors` + `forecast_config.json` (atomically: temp file, then rename)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = forecast_state_dict(model)
    if not tensors:
        raise ValueError("the model has no forecast heads to save")
    sparse = model.config.sparse_config
    # the heads exist to select blocks: reloading them onto a base turns the forecast selector on
    sparse = None if sparse is None else {**sparse, "selector": "forecast"}
    meta = {"forecast": model.config.forecast, "sparse_config": sparse, "base_model": base_model}
    for name, write in ((FORECAST_WEIGHTS, lambda p: save_file(tensors, p)), (FORECAST_CONFIG, lambda p: Path(p).write_text(json.dumps(meta, indent=2)))):
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
        os.close(fd)
        write(tmp)
        os.replace(tmp, directory / name)
    return directory


def read_forecast_weights(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The head tensors of `directory` (our forecast.safetensors) or of a SparDA indexer file."""
    return read_forecast_side(directory)[0]


SPARDA_HEAD = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn\.)?(q_future_proj|q_curr_proj|forecast_proj|current_proj)(?:\.weight)?$")
SPARDA_FILES = ("*.pt", "*.pth", "*.bin", "*.safetensors")


def _sparda_tensors(obj, found: dict) -> None:
    """Collect head tensors from a (nested) SparDA checkpoint dict under our state-dict names."""
    if not isinstance(obj, dict):
        return
    for key, value in obj.items():
        if isinstance(value, torch.Tensor) and isinstance(key, str):
            match = SPARDA_HEAD.search(key)
            if match and value.dim() == 2:
                name = {"q_future_proj": "forecast_proj", "q_curr_proj": "current_proj"}.get(match.group(2), match.group(2))
                found[f"model.layers.{int(match.group(1))}.self_attn.{name}.weight"] = value
        elif isinstance(value, dict):
            _sparda_tensors(value, found)


def read_forecast_side(path: str | os.PathLike, settings: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(head tensors, {"forecast": ..., "sparse_config": ...}) from forecast weights saved alone.

    `path`: a directory written by `save_forecast_weights`; or SparDA's indexer checkpoint (a
    `torch.save` file holding `q_future_proj` / `q_curr_proj` weights, optionally `sparse_config`;
    no base), given as the file or a directory holding one.  For SparDA files heads_per_group is
    read from the weight shape and the base `settings` (num_key_value_heads, head_dim).
    """
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir() and (path / FORECAST_WEIGHTS).is_file():
        side_file = path / FORECAST_CONFIG
        if not side_file.is_file():
            raise CheckpointError(f"{path} has {FORECAST_WEIGHTS} but no {FORECAST_CONFIG}")
        return map_state_dict(load_file(str(path / FORECAST_WEIGHTS))), json.loads(side_file.read_text())
    files = [path] if path.is_file() else sorted(f for pattern in SPARDA_FILES for f in path.glob(pattern)) if path.is_dir() else []
    if not files:
        raise CheckpointError(f"no {FORECAST_WEIGHTS} (ours) or SparDA indexer checkpoint ({', '.join(SPARDA_FILES)}) at {path}")
    found: dict[str, torch.Tensor] = {}
    meta: dict = {}
    for file in files:
        try:
            blob = load_file(str(file)) if file.suffix == ".safetensors" else torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:  # a pickle with foreign objects, or a corrupt file
            raise CheckpointError(f"cannot read SparDA indexer checkpoint {file}: {error}") from error
        _sparda_tensors(blob, found)
        if isinstance(blob, dict) and isinstance(blob.get("sparse_config"), dict):
            meta = blob["sparse_config"]
    if not found:
        raise CheckpointError(f"{path} holds no q_future_proj / q_curr_proj (or forecast_proj / current_proj) weights")
    settings = settings or {}
    rows = next(iter(found.values())).shape[0]
    kv_heads = int(settings.get("num_key_value_heads") or settings.get("num_attention_heads") or 1)
    head_dim = int(settings.get("head_dim") or settings.get("hidden_size", rows) // int(settings.get("num_attention_heads", 1)))
    if rows % (kv_heads * head_dim):
        raise CheckpointError(f"SparDA head weight has {rows} rows, not a multiple of num_key_value_heads x head_dim = {kv_heads} x {head_dim}")
    sparse = {k: v for k, v in meta.items() if k in _SPARSE_KEYS} or None
    side = {"forecast": {**ForecastConfig().to_dict(), "heads_per_group": rows // (kv_heads * head_dim)}, "sparse_config": sparse}
    return found, side
