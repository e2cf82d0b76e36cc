"""Lean weight loading: names and shapes from the file headers, data one tensor at a time.

`LazyCheckpoint` reads a checkpoint directory (one `model.safetensors`, shards with
`model.safetensors.index.json` as MiniCPM4.1-8B ships, or `pytorch_model.bin`) without holding a
state dict: safetensors headers give every tensor's name, dtype, shape and byte range; a tensor's
bytes are read straight into its final buffer (`readinto`, no mmap, so the page cache never counts
as the process's memory).  `load_into` fills a model built on the meta device, tensor by tensor,
in the target dtype on each tensor's target device: peak memory is the model plus one tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from ..errors import UserInputError
from ..safetensors_header import DTYPE_NAMES, HeaderError, read_header

# safetensors dtype code -> torch dtype, for every code the header reader knows
SAFETENSORS_DTYPES = {code: getattr(torch, name) for code, name in DTYPE_NAMES.items()}
INDEX_FILE = "model.safetensors.index.json"


class LazyCheckpointError(UserInputError):
    """A checkpoint file that is missing, truncated or not a checkpoint."""


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """({name: {"dtype", "shape", "data_offsets"}}, byte offset of the data) of a safetensors file;
    every tensor's byte range is checked against the file size (a truncated file is an error)."""
    size = path.stat().st_size
    corrupt = f"corrupt checkpoint file {path}"
    with open(path, "rb") as f:
        try:
            header, start = read_header(f, size)
        except HeaderError as error:
            reason = {
                "short": f"{size} bytes, too short for a safetensors header",
                "length": f"header of {error.length} bytes in a {size}-byte file",
                "json": f"unreadable header ({error.detail})",
                "object": "its header is not a JSON object",
            }[error.problem]
            raise LazyCheckpointError(f"{corrupt}: {reason}") from error
    for name, entry in header.items():
        _check_tensor_entry(path, name, entry, start, size)
    return header, start


def _check_tensor_entry(path: Path, name: str, entry, start: int, size: int) -> None:
    """Raise unless header `entry` of tensor `name` has a readable dtype, an int shape and the
    byte range [start + begin, start + end) of exactly its size inside the file's `size` bytes."""
    shape = entry.get("shape") if isinstance(entry, dict) else None
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (
        isinstance(shape, list)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(v, int) for v in offsets + shape)
    ):
        raise LazyCheckpointError(
            f"corrupt checkpoint file {path}: tensor {name!r} has no valid dtype / shape / data_offsets in the header"
        )
    begin, end = offsets
    if entry.get("dtype") not in SAFETENSORS_DTYPES:
        raise LazyCheckpointError(
            f"tensor {name} in {path} has dtype {entry['dtype']}; readable: {sorted(SAFETENSORS_DTYPES)}"
        )
    expected = SAFETENSORS_DTYPES[entry["dtype"]].itemsize * _numel(shape)
    if not 0 <= begin <= end or end - begin != expected or start + end > size:
        raise LazyCheckpointError(
            f"corrupt checkpoint file {path}: tensor {name} needs bytes [{start + begin}, {start + end}) "
            f"({expected} expected) of a {size}-byte file"
        )


def _numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


class LazyCheckpoint:
    """The tensors of a checkpoint directory, read on demand.

    `names` maps each (renamed) tensor name to its shape; `load_into` reads them into a model.
    `rename` maps a stored name to ours (None drops it).
    """

    def __init__(
        self, directory: Path, rename: Callable[[str], str | None] = lambda name: name, skip: tuple[str, ...] = ()
    ) -> None:
        self.directory = directory
        index = directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as error:
                raise LazyCheckpointError(f"corrupt index {index}: {error}") from error
            files = [directory / name for name in sorted(set(weight_map.values()))]
            for file in files:
                if not file.is_file():
                    raise LazyCheckpointError(
                        f"partial checkpoint: shard {file.name} listed in the index is missing from {directory}"
                    )
        else:
            files = sorted(f for f in directory.glob("*.safetensors") if f.name not in skip)
        self._sources: dict[str, tuple[Path, str]] = {}  # our name -> (file, stored name)
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._headers: dict[Path, tuple[dict, int]] = {}
        self._binary: dict[str, torch.Tensor] | None = None
        if not files:
            binary = directory / "pytorch_model.bin"
            if not binary.is_file():
                raise LazyCheckpointError(
                    f"no weights in {directory}: expected model.safetensors (or shards) or pytorch_model.bin"
                )
            self._binary = load_pickled_weights(binary)
            for stored, tensor in self._binary.items():
                self._add(rename(stored), binary, stored, tuple(tensor.shape))
            return
        for file in files:
            header, start = read_safetensors_header(file)
            self._headers[file] = (header, start)
            for stored, entry in header.items():
                self._add(rename(stored), file, stored, tuple(entry["shape"]))

    def _add(self, name: str | None, file: Path, stored: str, shape: tuple[int, ...]) -> None:
        if name is None:
            return
        self._sources[name] = (file, stored)
        self._shapes[name] = shape

    @property
    def names(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    @property
    def stored_names(self) -> list[str]:
        """The tensor names as the files store them (before `rename`)."""
        return [stored for _, stored in self._sources.values()]

    def nbytes(self) -> int:
        """Bytes of tensor data in the files."""
        total = 0
        for header, _ in self._headers.values():
            total += sum(entry["data_offsets"][1] - entry["data_offsets"][0] for entry in header.values())
        if self._binary is not None:
            total += sum(t.numel() * t.element_size() for t in self._binary.values())
        return total

    def tensors(self, names) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, CPU tensor in the stored dtype) for `names`, file by file, in file order."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._sources[name][0], []).append(name)
        for file, wanted in by_file.items():
            if self._binary is not None:
                for name in wanted:
                    yield name, self._binary[self._sources[name][1]]
                continue
            header, start = self._headers[file]
            wanted.sort(key=lambda name: header[self._sources[name][1]]["data_offsets"][0])
            with open(file, "rb", buffering=0) as f:
                for name in wanted:
                    entry = header[self._sources[name][1]]
                    tensor = torch.empty(entry["shape"], dtype=SAFETENSORS_DTYPES[entry["dtype"]])
                    begin, end = entry["data_offsets"]
                    if end > begin:
                        f.seek(start + begin)
                        view = memoryview(tensor.view(-1).view(torch.uint8).numpy())
                        got = 0
                        while got < end - begin:  # readinto may return short counts on large reads
                            count = f.readinto(view[got:])
                            if not count:
                                raise LazyCheckpointError(f"corrupt checkpoint file {file}: tensor {name} ends early")
                            got += count
                    yield name, tensor
                if hasattr(os, "posix_fadvise"):  # drop this shard from the page cache: it is read once
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def load_pickled_weights(path: Path, state_dict: bool = True):
    """A `pytorch_model.bin` state dict, read with `torch.load(weights_only=True)` (mmap: tensors
    are paged in when copied, one at a time).  A pickle that holds more than tensors is refused
    (unpickling it could run code), as is a file that is no torch checkpoint at all.
    state_dict=False: return whatever (weights-only) object the file holds."""
    import pickle
    import re
    import zipfile

    try:
        # the legacy (non-zip) format cannot be memory-mapped: it is read whole
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as error:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
        if found is None:  # not a pickle torch wrote (e.g. "Unsupported operand 103")
            raise LazyCheckpointError(
                f"corrupt checkpoint file {path}: not a torch checkpoint that torch.load can read"
            ) from error
        raise LazyCheckpointError(
            f"{path} is a pickle that torch.load(weights_only=True) refuses (it stores {found.group(1)}): "
            "unpickling it could run code; load it in code you trust and save the weights as model.safetensors"
        ) from error
    except (RuntimeError, OSError, EOFError, ValueError) as error:
        raise LazyCheckpointError(
            f"corrupt checkpoint file {path}: torch.load cannot read it ({type(error).__name__}: {error})"
        ) from error
    if state_dict and not (
        isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())
    ):
        raise LazyCheckpointError(f"{path} is not a state dict of named tensors (it holds a {type(state).__name__})")
    return state


def set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` in place of the parameter or buffer `name` (no copy into an old buffer; a
    parameter keeps its requires_grad)."""
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    if attr in module._parameters:
        old = module._parameters[attr]
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=old.requires_grad if old is not None else True)
    elif attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        raise KeyError(f"{name} is neither a parameter nor a buffer of the model")


def device_for(name: str, device_map: dict | None, default: torch.device) -> torch.device:
    """The device of tensor `name` under an accelerate-style `device_map` (longest module prefix)."""
    if not device_map:
        return default
    module = name
    while True:
        if module in device_map:
            target = device_map[module]
            return torch.device(f"cuda:{target}" if isinstance(target, int) else target)
        if not module:
            raise ValueError(f"device_map places no module holding {name}")
        module = module.rpartition(".")[0]


def load_into(
    model: nn.Module,
    checkpoint: LazyCheckpoint,
    names,
    dtype: torch.dtype,
    device: torch.device,
    device_map: dict | None = None,
) -> None:
    """Read `names` from `checkpoint` into `model` (built on the meta device): each tensor cast to
    `dtype` (floating tensors only) and moved to its device, one at a time."""
    for name, tensor in checkpoint.tensors(names):
        target = dtype if tensor.is_floating_point() else tensor.dtype
        set_tensor(model, name, tensor.to(device=device_for(name, device_map, device), dtype=target))
