"""A round's cached features (what `trainer.py` builds every `train.steps_per_round` steps): the frozen model
runs once over the round's sequences (`features.build_features`) and its rows are kept, per micro-batch,
in `<output_dir>/features/` under a key of everything they depend on (`feature_identity`,
`feature_key`), so a resumed or repeated run reads them back instead of building them again.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .features import Features, build_features, cached_rows, load_part, save_part
from .objective import ObjectiveConfig
from .step import forecast_heads, seeded

FEATURE_DIR = "features"  # <output_dir>/features/: the current round's cached features


FEATURE_FORMAT = 1  # bumped when what a feature file holds changes


@dataclass
class RoundCache:
    """Where and under what identity a run keeps its rounds' features (`build_round`); None
    `folder`: no disk cache.  identity: what every feature file's key covers besides its own
    tokens and rows (`feature_identity`)."""

    folder: Path | None
    identity: dict
    built: int = 0  # micro-batches built by this call
    loaded: int = 0  # micro-batches read from the cache
    load_s: float = 0.0  # seconds those reads took
    saved_s: float = 0.0  # seconds their builds had taken: the time the cache saved


def feature_identity(recipe: dict, model, fingerprint: str, device, mixed: str) -> dict:
    """What a micro-batch's cached features depend on besides its tokens and round: the base model
    (fingerprint, path / random config), its dtype and device, the geometry, the objective, the
    backbone, the cached rows' range and seed, the torch version."""
    data, train, model_cfg = recipe["data"], recipe["train"], recipe["model"]
    identity = {
        "format": FEATURE_FORMAT,
        "fingerprint": fingerprint,
        "path": model_cfg["path"],
        "config": model_cfg["config"],
        "model_seed": model_cfg["seed"],
        "dtype": str(next(model.parameters()).dtype),
        "device": torch.device(device).type,
        "mixed_precision": mixed,
        "sparse": model.config.sparse.to_dict(),
        "objective": recipe["objective"],
        "backbone": model_cfg["backbone"],
        "seq_len": data["seq_len"],
        "row_start": data["row_start"],
        "cache_rows": data["cache_rows"],
        "seed": train["seed"],
        "torch": torch.__version__,
    }
    return json.loads(json.dumps(identity, default=str))


def feature_key(identity: dict, ids: torch.Tensor, round_index: int, chunk: int, model) -> str:
    """sha256 over `identity`, the round and micro-batch (which seed the cached rows), the token
    ids, and -- when the frozen model attends with the heads themselves (backbone "forecast") --
    the heads' current bytes."""
    digest = hashlib.sha256(json.dumps({**identity, "round": round_index, "chunk": chunk}, sort_keys=True).encode())
    digest.update(ids.detach().cpu().to(torch.int64).contiguous().numpy().tobytes())
    if identity["backbone"] == "forecast":
        for _, p in forecast_heads(model):
            digest.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _part_path(folder: Path, round_index: int, chunk: int, key: str) -> Path:
    return folder / f"round-{round_index:06d}-chunk-{chunk:05d}-{key[:16]}.safetensors"


def _drop_older_rounds(folder: Path, chunks: range, round_index: int) -> None:
    """Delete this process's cached micro-batches of rounds before `round_index`: a run keeps one round."""
    for chunk in chunks:
        for path in folder.glob(f"round-*-chunk-{chunk:05d}-*.safetensors"):
            if int(path.name.split("-")[1]) < round_index:
                path.unlink(missing_ok=True)


def build_round(
    model,
    batch: torch.Tensor,
    first_chunk: int,
    round_index: int,
    recipe: dict,
    objective: ObjectiveConfig,
    device,
    cache: RoundCache | None = None,
    on_layer_done=None,
) -> list[Features]:
    """Cached features of this process's sequences batch [n, T], one `Features` per micro-batch
    (`Features.merge` joins them); micro-batch k (global index first_chunk + k) caches rows drawn
    with seed (seed, round, chunk).  With a `cache` folder each micro-batch is read from it when
    its key matches, else built and written there; on_layer_done(layers) is called as layers are
    done (read ones count whole)."""
    data, train = recipe["data"], recipe["train"]
    sparse = model.config.sparse
    layers = model.config.num_hidden_layers
    micro, parts = train["micro_batch"], []
    folder = cache.folder if cache is not None else None
    if folder is not None:
        _drop_older_rounds(folder, range(first_chunk, first_chunk + -(-batch.shape[0] // micro)), round_index)
    for k, start in enumerate(range(0, batch.shape[0], micro)):
        chunk = first_chunk + k
        ids = batch[start : start + micro]
        path = None
        if folder is not None:
            key = feature_key(cache.identity, ids, round_index, chunk, model)
            path = _part_path(folder, round_index, chunk, key)
            found = load_part(path, key, device)
            if found is not None:
                part, cache.saved_s, cache.load_s = found[0], cache.saved_s + found[1], cache.load_s + found[2]
                cache.loaded += 1
                parts.append(part)
                if on_layer_done is not None:
                    on_layer_done(layers)
                continue
        started = time.perf_counter()
        rows = cached_rows(
            batch.shape[1], data["row_start"], data["cache_rows"], seeded(train["seed"], round_index, chunk)
        )
        done = None if on_layer_done is None else (lambda idx: on_layer_done(1))
        part = build_features(model, ids.to(device), rows, sparse, objective, recipe["model"]["backbone"], done)
        parts.append(part)
        if path is not None:
            save_part(path, part, key, time.perf_counter() - started)
            cache.built += 1
    return parts
