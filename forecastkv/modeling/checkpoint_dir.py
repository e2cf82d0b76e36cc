"""Where a checkpoint is and what its tensors are called: a local directory or hub id resolved
(`resolve_directory`), its weights opened lazily (`open_checkpoint`), and the renames that map other
formats' tensor names onto ours (`map_state_dict`: SparDA's indexer names, rotary buffers dropped).
What `checkpoints.py` (the format adapters), `head_files.py` and `remote_code.py` share.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ..errors import CheckpointError
from .configuration import resolve_sparse_config
from .lazy_weights import LazyCheckpoint, LazyCheckpointError

FORECAST_WEIGHTS = "forecast.safetensors"  # Forecast heads on their own (`head_files.py`), beside or apart
FORECAST_CONFIG = "forecast_config.json"  # what they were trained for
RENAMES = ((re.compile(r"\.q_future_proj\."), ".forecast_proj."), (re.compile(r"\.q_curr_proj\."), ".current_proj."))


IGNORED = re.compile(r"rotary_emb\.|\.inv_freq$")


SPARDA_NAME = re.compile(r"\.(q_future_proj|q_curr_proj)\.")


FORECAST_KEY = re.compile(r"\.(forecast_proj|current_proj)\.weight$")


def resolve_directory(path_or_id: str | os.PathLike, **hub_kwargs) -> Path:
    path = Path(path_or_id)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is a file; pass the checkpoint directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                str(path_or_id), **{k: v for k, v in hub_kwargs.items() if k in ("revision", "token", "cache_dir")}
            )
        )
    except Exception as error:  # offline machines land here
        raise CheckpointError(
            f"{path_or_id!r} is neither a local directory nor a reachable hub id ({error})"
        ) from error


def _our_name(key: str) -> str | None:
    """A stored tensor name under our state-dict names (None: not a weight we load)."""
    if IGNORED.search(key):
        return None
    for pattern, replacement in RENAMES:
        key = pattern.sub(replacement, key)
    return key


def open_checkpoint(directory: Path) -> LazyCheckpoint:
    """The directory's tensors (names, shapes; data read later, one tensor at a time)."""
    try:
        return LazyCheckpoint(directory, rename=_our_name, skip=(FORECAST_WEIGHTS,))
    except LazyCheckpointError as error:
        raise CheckpointError(str(error)) from error


def map_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    mapped = {}
    for key, tensor in state.items():
        if IGNORED.search(key):
            continue
        for pattern, replacement in RENAMES:
            key = pattern.sub(replacement, key)
        mapped[key] = tensor
    return mapped


_SPARSE_KEYS = set(resolve_sparse_config({}).keys())


# the warnings' stacklevel: from_pretrained's caller (from_pretrained -> load_model -> _merge_settings -> here)
CALLER_OF_FROM_PRETRAINED = 5
