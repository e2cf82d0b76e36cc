"""Training checkpoints: only the trainable (Forecast) weights, optimizer, scheduler, RNG states,
data position and configs, written atomically (temp file in the same directory, then os.replace),
the last N kept.

Layout:  <output_dir>/checkpoints/step-000050.pt   (torch.save of one dict, see `save_checkpoint`)
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import tempfile
from pathlib import Path

import torch

CHECKPOINT_DIR = "checkpoints"
NAME = re.compile(r"^step-(\d+)\.pt$")


def model_fingerprint(model) -> str:
    """A short hash of the frozen base: architecture + sparse config + a few weight tensors, so a
    resume directory written for another model is refused."""
    config = model.config
    arch = {k: getattr(config, k, None) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_parameters", "mup", "sparse_config",
    )}
    arch["heads_per_group"] = config.forecast_config.heads_per_group
    digest = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode())
    inner = model.model
    for tensor in (inner.embed_tokens.weight, inner.layers[-1].self_attn.q_proj.weight, inner.norm.weight):
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Checkpoint files of a run, oldest first."""
    folder = Path(output_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(output_dir: str | os.PathLike, step: int, state: dict, keep_last: int = 5) -> Path:
    """Write `state` as checkpoints/step-<step>.pt atomically, then delete all but the last `keep_last`."""
    folder = Path(output_dir) / CHECKPOINT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"step-{step:06d}.pt"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if keep_last > 0:
        for old in list_checkpoints(output_dir)[:-keep_last]:
            old.unlink(missing_ok=True)
    return target


def find_checkpoint(resume: str | os.PathLike) -> Path:
    """`resume` may be a checkpoint file, a run's output directory or its checkpoints/ folder."""
    path = Path(resume)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"resume path {path} does not exist")
    run_dir = path.parent if path.name == CHECKPOINT_DIR else path
    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(f"resume directory {path} holds no checkpoints ({CHECKPOINT_DIR}/step-*.pt)")
    return found[-1]


def load_checkpoint(path: str | os.PathLike) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)
