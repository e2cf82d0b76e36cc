"""The one safetensors header reader (`forecastkv/safetensors_header.py`) and how its two callers
name a bad file: checkpoint weights (`modeling/lazy_weights.py`) and context-store block files
(`context/disk.py`)."""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch
from safetensors.torch import save

from forecastkv.context import disk
from forecastkv.modeling.lazy_weights import SAFETENSORS_DTYPES, LazyCheckpointError, read_safetensors_header
from forecastkv.safetensors_header import DTYPE_NAMES, HeaderError, read_header


def _good() -> bytes:
    tensors = {"keys": torch.arange(6, dtype=torch.float32).reshape(2, 3), "ids": torch.arange(4)}
    return save(tensors, metadata={"hash": "abc"})


def _with_header(text: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(text) if length is None else length) + text + b"\0" * 16


# problem -> bytes that fail that check
BAD = {
    "short": b"\x05\0\0",
    "length": _with_header(b"{}", length=1 << 20),
    "json": _with_header(b"{not json"),
    "object": _with_header(b"[1, 2]"),
}


def test_a_good_header_reads_as_safetensors_wrote_it():
    data = _good()
    header, start = read_header(io.BytesIO(data), len(data))
    assert set(header) == {"keys", "ids"}  # no __metadata__
    assert header["keys"]["dtype"] == "F32" and header["keys"]["shape"] == [2, 3]
    (length,) = struct.unpack("<Q", data[:8])
    assert start == 8 + length
    begin, end = header["keys"]["data_offsets"]
    assert torch.equal(
        torch.frombuffer(bytearray(data[start + begin : start + end]), dtype=torch.float32).reshape(2, 3),
        torch.arange(6, dtype=torch.float32).reshape(2, 3),
    )
    assert {code: str(dtype).removeprefix("torch.") for code, dtype in SAFETENSORS_DTYPES.items()} == DTYPE_NAMES


@pytest.mark.parametrize("problem", list(BAD))
def test_each_bad_header_names_its_problem(problem):
    data = BAD[problem]
    with pytest.raises(HeaderError) as caught:
        read_header(io.BytesIO(data), len(data))
    assert caught.value.problem == problem


CHECKPOINT_MESSAGES = {
    "short": r"corrupt checkpoint file .*x.safetensors: 3 bytes, too short for a safetensors header",
    "length": r"corrupt checkpoint file .*x.safetensors: header of 1048576 bytes in a 26-byte file",
    "json": r"corrupt checkpoint file .*x.safetensors: unreadable header \(Expecting property name",
    "object": r"corrupt checkpoint file .*x.safetensors: its header is not a JSON object",
}
BLOCK_MESSAGES = {
    "short": r"^block x is truncated \(3 bytes\)$",
    "length": r"^block x has a corrupted safetensors header$",
    "json": r"^block x has a corrupted safetensors header$",
    "object": r"^block x has a corrupted safetensors header$",
}


@pytest.mark.parametrize("problem", list(BAD))
def test_each_caller_names_a_bad_header_in_its_own_words(tmp_path, problem):
    path = tmp_path / "x.safetensors"
    path.write_bytes(BAD[problem])
    with pytest.raises(LazyCheckpointError, match=CHECKPOINT_MESSAGES[problem]):
        read_safetensors_header(path)
    with pytest.raises(disk.ContextStoreError, match=BLOCK_MESSAGES[problem]):
        disk.parse_header(BAD[problem], "block x")


def test_the_checkpoint_reader_checks_every_tensor_entry(tmp_path):
    data = _good()
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    header, start = read_safetensors_header(path)
    assert (header, start) == disk.parse_header(data, "block x")
    path.write_bytes(data[:-4])  # the last tensor's bytes run past the end
    with pytest.raises(LazyCheckpointError, match=r"corrupt checkpoint file .*: tensor \w+ needs bytes"):
        read_safetensors_header(path)
    text = json.dumps({"t": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}}).encode()
    path.write_bytes(_with_header(text))
    with pytest.raises(LazyCheckpointError, match=r"tensor t in .* has dtype F8_E4M3; readable: \['BF16'"):
        read_safetensors_header(path)
