"""Forecast heads on their own, beside a checkpoint or in a train-forecast output: `forecast.safetensors` +
`forecast_config.json` written and read (`save_forecast_weights`, `read_forecast_side`, SparDA's indexer
files too), whether a path holds heads (`has_forecast_heads`), and the check that heads trained for one
block geometry meet the one they select with (`check_heads_geometry`).  `checkpoints.py` loads them
into a model.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from ..atomic import write_atomic, write_text_atomic
from ..errors import CheckpointError, ForecastKVWarning
from .checkpoint_dir import (
    _SPARSE_KEYS,
    CALLER_OF_FROM_PRETRAINED,
    FORECAST_CONFIG,
    FORECAST_KEY,
    FORECAST_WEIGHTS,
    SPARDA_NAME,
    map_state_dict,
    open_checkpoint,
    resolve_directory,
)
from .configuration import ForecastConfig, resolve_sparse_config
from .lazy_weights import LazyCheckpointError, load_pickled_weights, read_safetensors_header

# The sparse_config keys that fix what a Forecast head scores: the compressed keys it is dotted with
# (kernel, stride, RoPE or not) and the blocks they are pooled into.  Heads trained under one grid
# predict nothing useful on another.  The other keys (topk, window, init blocks, dense_len, policy,
# ...) set how many blocks are kept and which are forced; heads serve any of them.
GEOMETRY_KEYS = ("kernel_size", "kernel_stride", "block_size", "use_nope")
BUDGET_KEYS = ("topk", "window_size", "init_blocks", "dense_len", "query_blocks", "policy", "lse")


def _describe(sparse: dict, keys) -> str:
    return ", ".join(f"{key} {sparse.get(key)}" for key in keys)


def check_heads_geometry(heads_path, trained: dict | None, used: dict | None, allow_mismatch: bool = False) -> None:
    """Heads trained under sparse_config `trained` (their forecast_config.json), loaded under
    `used`.  Another block geometry (`GEOMETRY_KEYS`) is an error unless `allow_mismatch`, then a
    warning naming both; another budget (`BUDGET_KEYS`: topk, window, ...) is a warning."""
    import warnings

    if not trained or not used:
        return
    trained, used = resolve_sparse_config(trained), resolve_sparse_config(used)
    geometry = [key for key in GEOMETRY_KEYS if trained.get(key) != used.get(key)]
    if geometry:
        both = (
            f"the forecast heads {heads_path} were trained for {_describe(trained, geometry)}; "
            f"the sparse_config selects with {_describe(used, geometry)}"
        )
        if not allow_mismatch:
            raise CheckpointError(
                f"{both}: heads score blocks of the geometry they were trained on. Load them with their own geometry "
                "(leave sparse_config unset, or give one with the same kernel_size / kernel_stride / block_size), "
                "train heads for this geometry, or pass allow_geometry_mismatch=True (--allow-geometry-mismatch) "
                "to use them anyway"
            )
        warnings.warn(
            f"{both} (allowed by allow_geometry_mismatch): expect lower forecast recall",
            ForecastKVWarning,
            stacklevel=CALLER_OF_FROM_PRETRAINED,
        )
    budget = [key for key in BUDGET_KEYS if trained.get(key) != used.get(key)]
    if budget:
        why = (
            ""
            if geometry
            else " (same block geometry: the heads rank the same blocks, the selection keeps another number of them)"
        )
        warnings.warn(
            f"the forecast heads {heads_path} were trained with {_describe(trained, budget)}; "
            f"selecting with {_describe(used, budget)}{why}",
            ForecastKVWarning,
            stacklevel=CALLER_OF_FROM_PRETRAINED,
        )


def forecast_state_dict(model) -> dict[str, torch.Tensor]:
    return {
        key: value.detach().cpu().contiguous() for key, value in model.state_dict().items() if FORECAST_KEY.search(key)
    }


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
    write_atomic(directory / FORECAST_WEIGHTS, lambda tmp: save_file(tensors, str(tmp)))
    write_text_atomic(directory / FORECAST_CONFIG, json.dumps(meta, indent=2))
    return directory


def read_safetensors_file(file: Path) -> dict[str, torch.Tensor]:
    """All tensors of one (small) safetensors file; a truncated or corrupt file is a
    `CheckpointError` naming it (the header is checked against the file size first)."""
    from safetensors.torch import load_file

    try:
        read_safetensors_header(file)
        return load_file(str(file))
    except LazyCheckpointError as error:
        raise CheckpointError(str(error)) from error
    except Exception as error:  # safetensors' own SafetensorError for what the header check lets through
        raise CheckpointError(f"corrupt checkpoint file {file}: {type(error).__name__}: {error}") from error


SPARDA_HEAD = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn\.)?(q_future_proj|q_curr_proj|forecast_proj|current_proj)(?:\.weight)?$"
)


SPARDA_FILES = ("*.pt", "*.pth", "*.bin", "*.safetensors")


def _sparda_tensors(obj, found: dict) -> None:
    """Collect head tensors from a (nested) SparDA checkpoint dict under our state-dict names."""
    if not isinstance(obj, dict):
        return
    for key, value in obj.items():
        if isinstance(value, torch.Tensor) and isinstance(key, str):
            match = SPARDA_HEAD.search(key)
            if match and value.dim() == 2:
                name = {"q_future_proj": "forecast_proj", "q_curr_proj": "current_proj"}.get(
                    match.group(2), match.group(2)
                )
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
    path = Path(path)
    if path.is_dir() and (path / FORECAST_WEIGHTS).is_file():
        side_file = path / FORECAST_CONFIG
        if not side_file.is_file():
            raise CheckpointError(f"{path} has {FORECAST_WEIGHTS} but no {FORECAST_CONFIG}")
        try:
            side = json.loads(side_file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise CheckpointError(f"corrupt forecast heads file {side_file}: not JSON ({error})") from error
        if not isinstance(side, dict) or not isinstance(side.get("forecast"), dict):
            raise CheckpointError(
                f"corrupt forecast heads file {side_file}: expected a JSON object with a 'forecast' section"
            )
        return map_state_dict(read_safetensors_file(path / FORECAST_WEIGHTS)), side
    files = (
        [path]
        if path.is_file()
        else sorted(f for pattern in SPARDA_FILES for f in path.glob(pattern))
        if path.is_dir()
        else []
    )
    if not files:
        raise CheckpointError(
            f"no {FORECAST_WEIGHTS} (ours) or SparDA indexer checkpoint ({', '.join(SPARDA_FILES)}) at {path}"
        )
    found: dict[str, torch.Tensor] = {}
    meta: dict = {}
    for file in files:
        try:
            blob = (
                read_safetensors_file(file)
                if file.suffix == ".safetensors"
                else load_pickled_weights(file, state_dict=False)
            )
        except LazyCheckpointError as error:  # a pickle with foreign objects, or a corrupt file
            raise CheckpointError(f"cannot read SparDA indexer checkpoint: {error}") from error
        _sparda_tensors(blob, found)
        if isinstance(blob, dict) and isinstance(blob.get("sparse_config"), dict):
            meta = blob["sparse_config"]
    if not found:
        raise CheckpointError(f"{path} holds no q_future_proj / q_curr_proj (or forecast_proj / current_proj) weights")
    settings = settings or {}
    rows = next(iter(found.values())).shape[0]
    kv_heads = int(settings.get("num_key_value_heads") or settings.get("num_attention_heads") or 1)
    head_dim = int(
        settings.get("head_dim") or settings.get("hidden_size", rows) // int(settings.get("num_attention_heads", 1))
    )
    if rows % (kv_heads * head_dim):
        raise CheckpointError(
            f"SparDA head weight has {rows} rows, "
            f"not a multiple of num_key_value_heads x head_dim = {kv_heads} x {head_dim}"
        )
    sparse = {k: v for k, v in meta.items() if k in _SPARSE_KEYS} or None
    side = {
        "forecast": {**ForecastConfig().to_dict(), "heads_per_group": rows // (kv_heads * head_dim)},
        "sparse_config": sparse,
        "sparda": True,
    }
    return found, side


def has_forecast_heads(path_or_id: str | os.PathLike) -> bool:
    """Whether the checkpoint stores Forecast heads (ours or SparDA's names); reads headers only."""
    checkpoint = open_checkpoint(resolve_directory(path_or_id))
    return any(FORECAST_KEY.search(name) for name in checkpoint.names) or any(
        SPARDA_NAME.search(name) for name in checkpoint.stored_names
    )
