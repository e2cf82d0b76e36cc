"""The disk tier of a `ContextStore`: one private directory per namespace, blocks as safetensors.

Layout under the store's root directory:

    <root>/<namespace>/                     created 0700, must belong to the caller
    <root>/<namespace>/index.json           the identity, the block size and every block, LRU first
    <root>/<namespace>/blocks/<hash>.safetensors    keys, values [L, bs, H, d] (+ cis [L, bs, H])

Block files are named by content and never rewritten; each is written atomically
(`forecastkv.atomic`), then the index is replaced atomically, and only then are files the new index
no longer names deleted.  A kill at any point leaves the previous index and every file it names
(or the new index and every file it names) on disk.  Reading parses JSON and raw tensor bytes only;
a block's bytes are checked against the size and sha256 the index records when the store loads,
and a lookup reads a block's rows layer by layer as it fills a cache (`DiskBlock`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import struct
from pathlib import Path

import torch

from ..atomic import write_atomic, write_text_atomic
from .blocks import BlockRows

FORMAT = 1
INDEX = "index.json"
BLOCKS = "blocks"
NAMESPACE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# safetensors dtype codes <-> torch dtypes (what a KV cache can hold)
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
CODES = {dtype: code for code, dtype in DTYPES.items()}


class ContextStoreError(ValueError):
    """A store on disk that does not fit the caller: another model, geometry, dtype or namespace,
    a truncated or corrupted file, tokens that do not match their block's name."""


def check_namespace_name(namespace: str) -> str:
    if not isinstance(namespace, str) or not NAMESPACE_NAME.match(namespace):
        raise ContextStoreError(f"namespace {namespace!r} is not a valid name (letters, digits, '.', '_', '-'; at most 64; not starting with '.')")
    return namespace


def namespace_dir(root: str | os.PathLike, namespace: str, create: bool) -> Path:
    """The namespace's directory, created 0700 if `create` and missing; raises if it exists but
    belongs to another user or is readable by others."""
    path = Path(root) / check_namespace_name(namespace)
    if not path.exists():
        if not create:
            raise ContextStoreError(f"no namespace {namespace!r} in {root}")
        Path(root).mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
        return path
    check_private(path)
    return path


def check_private(path: Path) -> None:
    """Raise unless `path` is a directory owned by this user with no group/other access."""
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise ContextStoreError(f"{path} is not a directory")
    if info.st_uid != os.getuid():
        raise ContextStoreError(f"namespace directory {path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}): it is not your namespace")
    if info.st_mode & 0o077:
        raise ContextStoreError(f"namespace directory {path} has mode {oct(info.st_mode & 0o777)}; a namespace must be private (0700)")


def read_index(directory: Path, namespace: str) -> dict | None:
    """The namespace's index (None if it has none yet); raises on a torn or foreign index."""
    path = directory / INDEX
    if not path.exists():
        return None
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ContextStoreError(f"{path} is not a valid index ({error}); the file is truncated or corrupted") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ContextStoreError(f"{path} has format {index.get('format') if isinstance(index, dict) else None!r}, expected {FORMAT}")
    if index.get("namespace") != namespace:
        raise ContextStoreError(f"{path} belongs to namespace {index.get('namespace')!r}, not {namespace!r}")
    return index


def write_index(directory: Path, index: dict) -> None:
    write_text_atomic(directory / INDEX, json.dumps(index, indent=1, sort_keys=True) + "\n")


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 1 MiB pieces (no mapping: the page cache is not this process's RSS)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def block_file(name: str) -> str:
    return f"{BLOCKS}/{name}.safetensors"


def write_block(directory: Path, name: str, rows: BlockRows) -> dict:
    """Write one block file atomically (unless it exists: content-addressed files never change).
    Returns its index fields: file, bytes (file size), sha256."""
    from safetensors.torch import save_file

    relative = block_file(name)
    path = directory / relative
    if not path.exists():
        tensors = {"keys": rows.keys.contiguous(), "values": rows.values.contiguous()}
        if rows.cis is not None:
            tensors["cis"] = rows.cis.contiguous()
        write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata={"hash": name}))
    return {"file": relative, "bytes": path.stat().st_size, "sha256": file_sha256(path)}


def read_header(path: Path) -> tuple[dict, int]:
    """(the safetensors header, the offset of its data) of a block file."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ContextStoreError(f"{path} is truncated ({len(prefix)} bytes)")
        (size,) = struct.unpack("<Q", prefix)
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ContextStoreError(f"{path} has a corrupted safetensors header") from None
    return header, 8 + size


def verify_block(directory: Path, entry: dict, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Check a block file against its index entry: size, sha256, then the tensors' names, shapes
    and dtypes (`shapes`: name -> (shape, dtype)).  Raises `ContextStoreError` naming what differs."""
    path = directory / entry["file"]
    if not path.exists():
        raise ContextStoreError(f"block {entry['hash'][:16]} is missing its file {path}")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise ContextStoreError(f"{path} is truncated or extended: {size} bytes, the index records {entry['bytes']}")
    if file_sha256(path) != entry["sha256"]:
        raise ContextStoreError(f"{path} fails its checksum (sha256 differs from the index): the file is corrupted")
    header, _ = read_header(path)
    header.pop("__metadata__", None)
    if set(header) != set(shapes):
        raise ContextStoreError(f"{path} holds tensors {sorted(header)}, expected {sorted(shapes)}")
    for name, (shape, dtype) in shapes.items():
        got_shape, got_dtype = tuple(header[name]["shape"]), DTYPES.get(header[name]["dtype"])
        if got_dtype != dtype:
            raise ContextStoreError(f"{path}: {name} has dtype {header[name]['dtype']}, this model's cache holds {dtype}")
        if got_shape != shape:
            raise ContextStoreError(f"{path}: {name} has shape {list(got_shape)}, this model's blocks are {list(shape)}")


class DiskBlock:
    """A verified block file read lazily, one layer at a time (`layer(l)`), with plain reads: no
    mapping or descriptor outlives a read, and the page cache it fills is not this process's RSS,
    so a store larger than RAM stays usable."""

    def __init__(self, path: Path) -> None:
        self.path = path
        header, self.start = read_header(path)
        header.pop("__metadata__", None)
        self.tensors = {name: (DTYPES[info["dtype"]], tuple(info["shape"]), info["data_offsets"][0]) for name, info in header.items()}

    def _read(self, handle, name: str, index: int) -> torch.Tensor:
        dtype, shape, begin = self.tensors[name]
        row = shape[1:]
        size = torch.Size(row).numel() * torch.empty((), dtype=dtype).element_size()
        handle.seek(self.start + begin + index * size)
        buffer = bytearray(size)
        if handle.readinto(buffer) != size:
            raise ContextStoreError(f"{self.path} ended early while reading {name} of layer {index}: the file was truncated after loading")
        return torch.frombuffer(buffer, dtype=dtype).view(row)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Layer `index`'s rows: keys, values [bs, H, d], cis [bs, H] or None (fresh host tensors)."""
        with open(self.path, "rb") as handle:
            return tuple(self._read(handle, name, index) if name in self.tensors else None for name in ("keys", "values", "cis"))

    def rows(self) -> BlockRows:
        """Every layer's rows in memory."""
        parts = [self.layer(index) for index in range(self.tensors["keys"][1][0])]
        stack = [None if parts[0][i] is None else torch.stack([p[i] for p in parts]) for i in range(3)]
        return BlockRows(*stack)


def remove_unlisted(directory: Path, keep: set[str]) -> int:
    """Delete block files (and leftover temporary files) the index does not list.  Returns bytes freed."""
    freed = 0
    folder = directory / BLOCKS
    if not folder.exists():
        return 0
    for path in folder.iterdir():
        relative = f"{BLOCKS}/{path.name}"
        if relative not in keep:
            freed += path.stat().st_size
            path.unlink(missing_ok=True)
    for path in directory.glob(f".{INDEX}.*.tmp"):
        path.unlink(missing_ok=True)
    return freed


LOCK = ".lock"


@contextlib.contextmanager
def namespace_lock(directory: Path):
    """An exclusive advisory lock on the namespace (`fcntl.flock`; none where fcntl is missing),
    held while a save writes, so two processes never delete each other's new files."""
    with open(directory / LOCK, "a") as handle:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - non-POSIX: saves are still atomic, not serialised
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def list_namespaces(root: str | os.PathLike) -> list[str]:
    """The namespaces under `root` that hold an index (sorted)."""
    root = Path(root)
    if not root.exists():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and NAMESPACE_NAME.match(p.name) and (p / INDEX).exists())
