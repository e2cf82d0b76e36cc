"""The one reader of a safetensors header, for every safetensors file forecastkv opens by hand.

A safetensors file is an 8-byte little-endian header length, that many bytes of JSON, then the
data: the JSON maps each tensor name to {"dtype": code, "shape": [...], "data_offsets": [begin,
end]} (offsets counted from the end of the header), plus an optional "__metadata__" entry.

Two readers use it and name a bad file in their own words: checkpoint weights
(`modeling/lazy_weights.py`, `LazyCheckpointError`) and the context store's block files
(`context/disk.py`, `ContextStoreError`).  `HeaderError.problem` tells them which check failed.

Imports neither torch nor anything else of forecastkv (the torch-free `context-cache` console
commands read block files through it).
"""

from __future__ import annotations

import json
import struct
from typing import BinaryIO

LENGTH_BYTES = 8  # the header length field: one little-endian uint64
# safetensors dtype code -> torch dtype name (the codes forecastkv reads)
DTYPE_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


class HeaderError(ValueError):
    """A safetensors header that cannot be read.  `problem` is the check that failed:

    * "short": the file has fewer than 8 bytes;
    * "length": the header length (`length`) runs past the end of the file;
    * "json": the header is not UTF-8 JSON (`detail`: the decoder's message);
    * "object": the header is JSON but not an object.
    """

    def __init__(self, problem: str, length: int | None = None, detail: str = "") -> None:
        super().__init__(f"safetensors header: {problem}" + (f" ({detail})" if detail else ""))
        self.problem, self.length, self.detail = problem, length, detail


def read_header(stream: BinaryIO, size: int) -> tuple[dict, int]:
    """(header, data start) of the safetensors file that `stream` reads from its first byte.

    size: the file's bytes (the header must fit in them).  header: {tensor name: {"dtype",
    "shape", "data_offsets"}} without "__metadata__", as the file states it (the entries are the
    caller's to check); data start: the byte offset where `data_offsets` begin.  Raises
    `HeaderError`."""
    prefix = stream.read(LENGTH_BYTES)
    if len(prefix) < LENGTH_BYTES:
        raise HeaderError("short")
    (length,) = struct.unpack("<Q", prefix)
    if length > size - LENGTH_BYTES:
        raise HeaderError("length", length)
    try:
        header = json.loads(stream.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HeaderError("json", length, str(error)) from error
    if not isinstance(header, dict):
        raise HeaderError("object", length)
    header.pop("__metadata__", None)
    return header, LENGTH_BYTES + length
