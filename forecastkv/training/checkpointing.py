"""Training checkpoints: only the trainable (Forecast) weights, optimizer, scheduler, RNG states,
data position and configs, written atomically (`forecastkv.atomic`), the last N kept, loaded
without unpickling anything.

Layout:  <output_dir>/checkpoints/step-000050.safetensors

One safetensors file per checkpoint: every tensor of the state (trainable weights, optimizer
moments, the torch / CUDA RNG states, ...) under its path in the state ("trainable/<name>",
"optimizer/state/0/exp_avg"), and the rest of the state as JSON in the header's metadata
(`STATE_KEY`), each tensor replaced by a reference to its name.  JSON has no tuples, no
non-string keys and no arrays, so those are tagged (`_encode`) and come back as they were
(`random.setstate` needs its tuples, the optimizer its integer state keys).  Reading parses JSON
and raw tensor bytes only; a pickled file (older `.pt` checkpoints, or anything else) is refused.

Integrity: the metadata also holds a sha256 (`CHECKSUM_KEY`) of the JSON state and of every
tensor's name, dtype, shape and bytes; `load_checkpoint` recomputes it and refuses a file whose
bytes changed (`CheckpointCorrupt`), and one without a checksum unless asked
(`CheckpointUnchecked`).  `load_intact` resumes from the newest checkpoint that loads and
verifies, warning about each newer one it skips (a truncated, bit-flipped or unchecked newest
checkpoint falls back to the previous one).  `remove_stale_temporaries` deletes what a kill inside an atomic
write left behind (`.step-*.safetensors.*.tmp`, ...).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import warnings
from pathlib import Path

import torch

from forecastkv.atomic import remove_temporaries, write_atomic
from forecastkv.errors import UserInputError

CHECKPOINT_DIR = "checkpoints"
SUFFIX = ".safetensors"
NAME = re.compile(r"^step-(\d+)\.safetensors$")
STATE_KEY = "forecastkv.checkpoint"  # the metadata entry holding the JSON state
CHECKSUM_KEY = "forecastkv.sha256"  # the metadata entry holding `state_checksum`
FORMAT = 2  # bumped when the layout changes (2: checksummed)
READABLE = (1, 2)  # format 1 (no checksum) loads only when asked: `allow_unchecked`
# the files a run directory holds, which `write_atomic` writes through `.<name>.<random>.tmp`
RUN_FILES = ("forecast.safetensors", "forecast_config.json", "metrics.jsonl", "recall.md", "recipe.json")


class CheckpointUnusable(UserInputError):
    """A training checkpoint that cannot be resumed from (the message names the file and why)."""


class CheckpointCorrupt(CheckpointUnusable):
    """A checkpoint whose bytes do not match its checksum, or that cannot be read at all."""


class CheckpointUnchecked(CheckpointUnusable):
    """A checkpoint without a checksum (format 1, or one whose checksum was removed): refused
    unless the caller allows unchecked checkpoints."""


class CheckpointMissing(UserInputError, FileNotFoundError):
    """A resume path that does not exist or holds no checkpoint."""


# JSON tags of what JSON cannot hold as is (a dict with one of these keys is a tagged value)
TENSOR, TUPLE, ITEMS, NDARRAY = "__tensor__", "__tuple__", "__items__", "__ndarray__"
TAGS = (TENSOR, TUPLE, ITEMS, NDARRAY)


# the config fields of a base model's fingerprint (with heads_per_group and a few weight tensors)
FINGERPRINT_KEYS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
    "max_position_embeddings rope_parameters mup sparse_config"
).split()


def model_fingerprint(model) -> str:
    """A short hash of the frozen base: architecture + sparse config + a few weight tensors, so a
    resume directory written for another model is refused."""
    config = model.config
    arch = {k: getattr(config, k, None) for k in FINGERPRINT_KEYS}
    arch["heads_per_group"] = config.forecast_config.heads_per_group
    digest = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode())
    inner = model.model
    for tensor in (inner.embed_tokens.weight, inner.layers[-1].self_attn.q_proj.weight, inner.norm.weight):
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def rng_state() -> dict:
    """Every random stream a step may draw from: torch CPU, python `random`, numpy, CUDA (when present)."""
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


# ----------------------------------------------------------------------------------------------
# state <-> (JSON, tensors)
# ----------------------------------------------------------------------------------------------


def _join(path: str, key) -> str:
    return f"{path}/{key}" if path else str(key)


def _encode(value, path: str, tensors: dict):
    """`value` as JSON-able data; its tensors go into `tensors` under their path ("a/b/0")."""
    if isinstance(value, torch.Tensor):
        if path in tensors:
            raise ValueError(f"checkpoint state: two tensors at path {path!r}")
        tensors[path] = value.detach().cpu().contiguous().clone()  # own storage: safetensors refuses shared ones
        return {TENSOR: path}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            clash = [k for k in value if k in TAGS]
            if clash:
                raise ValueError(f"checkpoint state at {path!r} uses the reserved key {clash[0]!r}")
            return {k: _encode(v, _join(path, k), tensors) for k, v in value.items()}
        items = [
            [_encode(k, _join(path, f"key{i}"), tensors), _encode(v, _join(path, k), tensors)]
            for i, (k, v) in enumerate(value.items())
        ]
        return {ITEMS: items}
    if isinstance(value, tuple):
        return {TUPLE: [_encode(v, _join(path, i), tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, _join(path, i), tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    kind = type(value)
    if kind.__module__ == "numpy":
        if kind.__name__ == "ndarray":
            return {NDARRAY: value.tolist(), "dtype": str(value.dtype)}
        if hasattr(value, "item"):  # a numpy scalar
            return value.item()
    raise TypeError(
        f"checkpoint state at {path!r} is a {kind.__module__}.{kind.__qualname__}; a checkpoint holds tensors, "
        "numbers, strings, None, lists, tuples and dicts only"
    )


def check_storable(value, where: str = "state") -> None:
    """Raise the TypeError `save_checkpoint` would for `value` (a recipe, say), before a run starts."""
    _encode(value, where, {})


def _decode(value, tensors: dict):
    """The inverse of `_encode`."""
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if TENSOR in value:
        return tensors[value[TENSOR]]
    if TUPLE in value:
        return tuple(_decode(v, tensors) for v in value[TUPLE])
    if ITEMS in value:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value[ITEMS]}
    if NDARRAY in value:
        import numpy

        return numpy.asarray(value[NDARRAY], dtype=value["dtype"])
    return {k: _decode(v, tensors) for k, v in value.items()}


# ----------------------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------------------


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Checkpoint files of a run, oldest first."""
    folder = Path(output_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def state_checksum(meta: str, tensors: dict) -> str:
    """sha256 of the JSON state `meta` and of every tensor (name, dtype, shape, bytes), in name order."""
    digest = hashlib.sha256(meta.encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def remove_stale_temporaries(output_dir: str | os.PathLike) -> list[Path]:
    """Delete the temporaries a kill inside an atomic write left in a run directory (its
    checkpoints and its own output files only); returns them."""
    folder = Path(output_dir)
    removed = remove_temporaries(folder / CHECKPOINT_DIR, f"step-*{SUFFIX}")
    for name in RUN_FILES:
        removed += remove_temporaries(folder, name)
    return removed


def save_checkpoint(output_dir: str | os.PathLike, step: int, state: dict, keep_last: int = 5) -> Path:
    """Write `state` (tensors, numbers, strings, lists, tuples, dicts) as
    checkpoints/step-<step>.safetensors atomically, with its checksum, then delete all but the
    last `keep_last`."""
    from safetensors.torch import save_file

    tensors: dict = {}
    meta = json.dumps({"format": FORMAT, "state": _encode(state, "", tensors)})
    metadata = {STATE_KEY: meta, CHECKSUM_KEY: state_checksum(meta, tensors)}
    target = Path(output_dir) / CHECKPOINT_DIR / f"step-{step:06d}{SUFFIX}"
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values()) + len(meta)  # refused early without room
    write_atomic(target, lambda tmp: save_file(tensors, str(tmp), metadata=metadata), nbytes)
    if keep_last > 0:
        for old in list_checkpoints(output_dir)[:-keep_last]:
            old.unlink(missing_ok=True)
    return target


def _run_dir(path: Path) -> Path:
    return path.parent if path.name == CHECKPOINT_DIR else path


def find_checkpoint(resume: str | os.PathLike) -> Path:
    """`resume` may be a checkpoint file, a run's output directory or its checkpoints/ folder
    (then its newest checkpoint, intact or not: see `load_intact`)."""
    path = Path(resume)
    if path.is_file():
        return path
    if not path.is_dir():
        raise CheckpointMissing(f"resume path {path} does not exist")
    run_dir = _run_dir(path)
    found = list_checkpoints(run_dir)
    if not found:
        legacy = sorted((run_dir / CHECKPOINT_DIR).glob("step-*.pt"))
        note = (
            f"; {len(legacy)} pickled .pt checkpoint(s) of an older version are not loaded (unpickling can run code)"
            if legacy
            else ""
        )
        raise CheckpointMissing(f"resume directory {path} holds no checkpoints ({CHECKPOINT_DIR}/step-*{SUFFIX}){note}")
    return found[-1]


def load_checkpoint(path: str | os.PathLike, allow_unchecked: bool = False) -> dict:
    """The state `save_checkpoint` wrote (tensors on the CPU).  Reads JSON and tensor bytes only:
    a file that is not such a checkpoint (a pickle, say) is refused with a ValueError.

    The checksum covers the whole JSON state (its `format` field included) and every tensor, and
    is checked whenever the file carries one, whatever its format says: editing the format
    cannot switch it off.  A file without a checksum is refused (`CheckpointUnchecked`) unless
    `allow_unchecked` (the CLI's `--allow-unchecked`): older format-1 checkpoints load only so."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, RuntimeError) as error:
        raise CheckpointCorrupt(
            f"{path} is not a forecastkv checkpoint (a safetensors file): {error}; pickled checkpoints "
            "(.pt, older versions) are not loaded, since unpickling can run arbitrary code"
        ) from error
    if STATE_KEY not in meta:
        raise CheckpointUnusable(
            f"{path} is a safetensors file without a forecastkv checkpoint state ({STATE_KEY!r} metadata)"
        )
    try:
        payload = json.loads(meta[STATE_KEY])
    except json.JSONDecodeError as error:
        raise CheckpointCorrupt(f"{path} is corrupt: its checkpoint state is not JSON ({error})") from None
    if payload.get("format") not in READABLE:
        raise CheckpointUnusable(
            f"{path} has checkpoint format {payload.get('format')!r}; this version reads formats {READABLE}"
        )
    expected = meta.get(CHECKSUM_KEY)
    if expected is not None:
        if state_checksum(meta[STATE_KEY], tensors) != expected:
            raise CheckpointCorrupt(f"{path} is corrupt: its bytes do not match the checksum written with it")
    elif payload["format"] >= 2 or not allow_unchecked:
        raise CheckpointUnchecked(
            f"{path} carries no checksum (format {payload['format']}): its bytes cannot be verified, so it is "
            "refused; a format-1 checkpoint of an older version loads with --allow-unchecked "
            "(train_forecast(..., allow_unchecked=True))"
        )
    return _decode(payload["state"], tensors)


def load_intact(resume: str | os.PathLike, allow_unchecked: bool = False) -> tuple[Path, dict]:
    """(path, state) of the checkpoint `resume` names: that file, or in a run directory the newest
    checkpoint that loads and matches its checksum.  Each newer one skipped (truncated, bit-flipped,
    without a checksum) gets a warning; none intact is a ValueError naming why each failed."""
    path = Path(resume)
    newest = find_checkpoint(path)
    if path.is_file():
        return newest, load_checkpoint(newest, allow_unchecked)
    failures = []
    for candidate in reversed(list_checkpoints(_run_dir(path))):
        try:
            state = load_checkpoint(candidate, allow_unchecked)
        except ValueError as error:
            failures.append(str(error))
            continue
        for failure in failures:
            warnings.warn(f"skipping a damaged checkpoint, resuming from {candidate.name}: {failure}", stacklevel=2)
        return candidate, state
    raise CheckpointUnusable(f"no intact checkpoint in {_run_dir(path)}: " + "; ".join(failures))
