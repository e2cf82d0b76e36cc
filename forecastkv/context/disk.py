"""The disk tier of a `ContextStore`: one private directory per namespace, blocks as safetensors,
shared safely by many processes.

Layout under the store's root directory:

    <root>/                                 created 0700 (whatever the umask) if missing
    <root>/<namespace>/                     created 0700; must be a real directory (never a
                                            symlink) owned by the caller with no group/other access
    <root>/<namespace>/.lock                the namespace's lock (`fcntl.flock`)
    <root>/<namespace>/index.json           generation, identity, block size, every block (LRU first)
    <root>/<namespace>/blocks/<hash>.safetensors    keys, values [L, bs, H, d] (+ cis [L, bs, H])

Safety against other users (`Namespace`): the namespace is opened once per operation with
O_NOFOLLOW | O_DIRECTORY, its owner and mode are checked on that descriptor (fstat), and every
later access (index, lock, block files, deletions) is relative to it (`dir_fd=`),
so swapping the namespace for a symlink or another directory after the check reaches nothing.
An index's `file` field must be exactly `blocks/<its hash>.safetensors`: anything else is a bad
entry, never opened.

Safety between processes (the protocol):
* writers (`ContextStore.save`, `context-cache rm`, `repair`) hold the exclusive lock; a save reads
  the index under it and merges (other writers' blocks stay, blocks removed by others stay removed),
  writes new block files, replaces the index with the next `generation`, and only then deletes files
  the new index does not name;
* readers (a store's load, a lazy block read) hold the shared lock; a store remembers the
  generation (and a random stamp) it last saw and re-reads the index when it changed;
* every write is atomic (a temporary file, fsync, rename, fsync of the directory): a kill at any
  point leaves the previous index and every file it names, or the new index and every file it names.

A bad or missing block is a miss for its chain (with a `ContextStoreWarning`), never a refusal of
the store; an unreadable index is an empty store for readers, rebuilt by the next save, and
`context-cache rm --all` / `repair` work on any broken store.

Importing this module imports no torch (the console script's `context-cache` commands use it).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import secrets
import stat
import struct
import warnings
from pathlib import Path

from ..safetensors_header import DTYPE_NAMES, HeaderError, read_header

FORMAT = 1
INDEX = "index.json"
BLOCKS = "blocks"
LOCK = ".lock"
NAMESPACE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
HASH = re.compile(r"^[0-9a-f]{64}$")
HEAD_BYTES = 4096  # the index's generation and stamp are within its first bytes (`index_head`)
O_DIR = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class ContextStoreError(ValueError):
    """A store on disk that does not fit the caller: another model, geometry, dtype or namespace,
    a namespace that is not private or is a symlink, a truncated or corrupted file, tokens that do
    not match their block's name."""


class ContextStoreWarning(UserWarning):
    """Something on disk was skipped: a bad or missing block (a miss for its chain), an unreadable
    index (an empty store until the next save rebuilds it)."""


def warn(message: str) -> None:
    warnings.warn(message, ContextStoreWarning, stacklevel=3)


def check_namespace_name(namespace: str) -> str:
    if not isinstance(namespace, str) or not NAMESPACE_NAME.match(namespace):
        raise ContextStoreError(
            f"namespace {namespace!r} is not a valid name "
            "(letters, digits, '.', '_', '-'; at most 64; not starting with '.')"
        )
    return namespace


# -- names --------------------------------------------------------------------------------------
def identity_root(identity: dict) -> str:
    """The root of the hash chain: sha256 of the identity's canonical JSON."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def block_hash(parent: str, tokens: list[int]) -> str:
    """The name of a block: sha256 over its parent's name and its token ids (int64 little-endian)."""
    digest = hashlib.sha256(parent.encode())
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return digest.hexdigest()


def block_file(name: str) -> str:
    """The one `file` an index entry of block `name` may have."""
    return f"{BLOCKS}/{name}.safetensors"


# -- the namespace directory ----------------------------------------------------------------------
def make_root(root: str | os.PathLike) -> None:
    """Create `root` (and missing parents) mode 0700 whatever the umask; an existing one is kept as
    it is (make it 1777 by hand to share it between users: namespaces stay private inside)."""
    missing, path = [], Path(root)
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        fd = os.open(path, O_DIR)
        try:
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)


def _open_dir(name: str, dir_fd: int, where: str) -> int:
    """Open directory `name` relative to `dir_fd` without following a symlink."""
    try:
        return os.open(name, O_DIR, dir_fd=dir_fd)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise ContextStoreError(
                f"{where} is a symbolic link or not a directory: refused "
                "(a namespace must be a real directory of its own)"
            ) from None
        raise


def _check_owned(fd: int, where: str) -> None:
    info = os.fstat(fd)
    if not stat.S_ISDIR(info.st_mode):
        raise ContextStoreError(f"{where} is not a directory")
    if info.st_uid != os.geteuid():
        raise ContextStoreError(
            f"namespace directory {where} belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()}): "
            "it is not your namespace"
        )
    if info.st_mode & 0o077:
        raise ContextStoreError(
            f"namespace directory {where} has mode {oct(info.st_mode & 0o777)}; a namespace must be private (0700)"
        )


class Namespace:
    """One namespace directory, opened for one operation: `fd` (the namespace) and `blocks_fd`
    (its blocks/, None while it has none); every access goes through them.  Use as a context
    manager.  create: make the root, the namespace and blocks/ if missing (0700)."""

    def __init__(self, root: str | os.PathLike, namespace: str, create: bool) -> None:
        self.name = check_namespace_name(namespace)
        self.path = Path(root) / namespace
        self.fd = self.blocks_fd = None
        if create:
            make_root(root)
        try:
            root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"no namespace {namespace!r}: {root} does not exist") from None
        try:
            try:
                self.fd = _open_dir(namespace, root_fd, str(self.path))
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(namespace, 0o700, dir_fd=root_fd)
                self.fd = _open_dir(namespace, root_fd, str(self.path))
                if os.fstat(self.fd).st_uid == os.geteuid():
                    os.fchmod(self.fd, 0o700)  # mkdir's mode went through the umask
            _check_owned(self.fd, str(self.path))
            try:
                self.blocks_fd = _open_dir(BLOCKS, self.fd, str(self.path / BLOCKS))
            except FileNotFoundError:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(BLOCKS, 0o700, dir_fd=self.fd)
                    self.blocks_fd = _open_dir(BLOCKS, self.fd, str(self.path / BLOCKS))
            if self.blocks_fd is not None:
                _check_owned(self.blocks_fd, str(self.path / BLOCKS))
        except BaseException:
            self.close()
            raise
        finally:
            os.close(root_fd)

    def close(self) -> None:
        for fd in (self.fd, self.blocks_fd):
            if fd is not None:
                os.close(fd)
        self.fd = self.blocks_fd = None

    def __enter__(self) -> "Namespace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def lock(self, exclusive: bool):
        """The namespace's lock: exclusive for writers, shared for readers (`fcntl.flock`)."""
        import fcntl

        fd = os.open(
            LOCK,
            os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
            0o600,
            dir_fd=self.fd,
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield self
        finally:
            os.close(fd)  # closing the only descriptor of the lock file releases the lock

    # -- files ----------------------------------------------------------------------------------
    def _fd_for(self, relative: str) -> tuple[int, str]:
        """(directory fd, basename) of `index.json` or `blocks/<hash>.safetensors`; anything else is refused."""
        if relative == INDEX:
            return self.fd, INDEX
        folder, _, base = relative.partition("/")
        if folder != BLOCKS or not re.fullmatch(r"[0-9a-f]{64}\.safetensors", base):
            raise ContextStoreError(f"{relative!r} is not a block file of this namespace (blocks/<hash>.safetensors)")
        if self.blocks_fd is None:
            raise FileNotFoundError(
                errno.ENOENT, f"{self.path / relative} does not exist (the namespace has no blocks/)"
            )
        return self.blocks_fd, base

    def read(self, relative: str, limit: int | None = None) -> bytes:
        """The bytes of `index.json` or a block file (at most `limit`), never through a symlink."""
        dir_fd, base = self._fd_for(relative)
        fd = os.open(base, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ContextStoreError(f"{self.path / relative} is not a regular file")
            return handle.read() if limit is None else handle.read(limit)

    def size(self, relative: str) -> int | None:
        """The size of a regular file (None if missing or not a regular file)."""
        dir_fd, base = self._fd_for(relative)
        try:
            info = os.stat(base, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return info.st_size if stat.S_ISREG(info.st_mode) else None

    def write(self, relative: str, data: bytes) -> None:
        """Replace `index.json` or a block file atomically (`write_atomic_at`).  A full disk is a
        `DiskFullError` naming the file and its bytes; its temporary file is gone."""
        from ..atomic import check_room, room_checked

        dir_fd, base = self._fd_for(relative)
        where = self.path / relative
        check_room(where, len(data))
        with room_checked(where, len(data)):
            write_atomic_at(dir_fd, base, data)

    def block_names(self) -> list[str]:
        """Every name in blocks/ (block files and leftover temporary files)."""
        return [] if self.blocks_fd is None else os.listdir(self.blocks_fd)


def write_atomic_at(dir_fd: int, name: str, data: bytes) -> None:
    """Write `data` to `name` in the directory `dir_fd` atomically: a new temporary file beside it
    (O_EXCL | O_NOFOLLOW), fsync, rename over `name`, fsync of the directory."""
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
        0o600,
        dir_fd=dir_fd,
    )
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)


def remove_unlisted(namespace: Namespace, keep: set[str]) -> int:
    """Delete every file in blocks/ (and leftover temporary index files) that `keep` (index
    `file` fields) does not name: only under the exclusive lock.  Returns bytes freed."""
    freed = 0
    for base in namespace.block_names():
        if f"{BLOCKS}/{base}" in keep:
            continue
        with contextlib.suppress(FileNotFoundError):
            info = os.stat(base, dir_fd=namespace.blocks_fd, follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                continue
            os.unlink(base, dir_fd=namespace.blocks_fd)
            freed += info.st_size
    for base in os.listdir(namespace.fd):
        if base.startswith(f".{INDEX}.") and base.endswith(".tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(base, dir_fd=namespace.fd)
    return freed


# -- the index ------------------------------------------------------------------------------------
class BrokenIndex(ContextStoreError):
    """An index that cannot be read at all (truncated, not JSON, not an index's structure)."""


def read_index(namespace: Namespace) -> dict | None:
    """The namespace's index (None if it has none yet).  Raises `BrokenIndex` on an unreadable
    one, `ContextStoreError` on another format or another namespace's index."""
    try:
        raw = namespace.read(INDEX)
    except FileNotFoundError:
        return None
    path = namespace.path / INDEX
    try:
        index = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BrokenIndex(f"{path} is not a valid index ({error}); the file is truncated or corrupted") from None
    if not isinstance(index, dict) or not isinstance(index.get("entries"), list):
        raise BrokenIndex(f"{path} is not an index (no list of entries); the file is corrupted")
    if index.get("format") != FORMAT:
        raise ContextStoreError(f"{path} has format {index.get('format')!r}, expected {FORMAT}")
    if index.get("namespace") != namespace.name:
        raise ContextStoreError(f"{path} belongs to namespace {index.get('namespace')!r}, not {namespace.name!r}")
    return index


def index_head(namespace: Namespace) -> tuple[int, str | None] | None:
    """(generation, stamp) of the namespace's index from its first bytes (None: no index)."""
    try:
        raw = namespace.read(INDEX, HEAD_BYTES).decode("utf-8", "replace")
    except FileNotFoundError:
        return None
    found = re.search(r'"generation": (\d+),\s*"stamp": "([0-9a-f]+)"', raw)
    return (int(found.group(1)), found.group(2)) if found else (0, None)


def write_index(namespace: Namespace, index: dict) -> None:
    """Replace the index atomically; generation and stamp first, so `index_head` finds them."""
    ordered = {"format": FORMAT, "generation": index["generation"], "stamp": index["stamp"]}
    ordered.update((key, value) for key, value in index.items() if key not in ordered)
    namespace.write(INDEX, (json.dumps(ordered, indent=1) + "\n").encode("utf-8"))


def new_index(
    namespace: str, identity: dict | None, block_size: int | None, entries: list[dict], generation: int
) -> dict:
    return {
        "format": FORMAT,
        "generation": generation,
        "stamp": secrets.token_hex(8),
        "namespace": namespace,
        "identity": identity,
        "block_size": block_size,
        "entries": entries,
    }


RECORD_KEYS = ("hash", "parent", "position", "tokens", "nbytes", "file", "bytes", "sha256")


def check_entries(index: dict, root: str | None = None) -> tuple[list[dict], list[str]]:
    """The entries of an index that are well formed, in index order: every field of the right
    type, `file` exactly `blocks/<hash>.safetensors`, tokens that hash to the name (with `root`:
    the chain root of this store's identity; default: the index's own identity), position and
    parent consistent, the parent present.  Returns (good entries, one line per problem)."""
    block_size = index.get("block_size")
    if root is None:
        identity = index.get("identity")
        root = identity_root(identity) if isinstance(identity, dict) else None
    formed, problems = [], []
    for number, record in enumerate(index.get("entries") or []):
        label = f"entry {number}"
        if not isinstance(record, dict) or any(key not in record for key in RECORD_KEYS):
            problems.append(f"{label} lacks fields of an index entry")
            continue
        name, parent, position, tokens = record["hash"], record["parent"], record["position"], record["tokens"]
        if not isinstance(name, str) or not HASH.match(name):
            problems.append(f"{label} has a malformed hash {str(name)[:20]!r}")
            continue
        label = f"block {name[:16]}"
        if record["file"] != block_file(name):
            problems.append(
                f"{label} names the file {str(record['file'])[:80]!r}, not {block_file(name)!r} "
                "(paths outside blocks/ are refused)"
            )
            continue
        if not (
            isinstance(tokens, list)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)
            and len(tokens) == block_size
        ):
            problems.append(f"{label} does not list {block_size} token ids")
            continue
        if not (
            isinstance(position, int)
            and position >= 0
            and (parent is None) == (position == 0)
            and (parent is None or (isinstance(parent, str) and HASH.match(parent)))
        ):
            problems.append(
                f"{label} is at position {position!r} with parent {str(parent)[:16]!r}: the index is corrupted"
            )
            continue
        if not all(isinstance(record[key], int) and record[key] >= 0 for key in ("bytes", "nbytes")) or not (
            isinstance(record["sha256"], str) and HASH.match(record["sha256"])
        ):
            problems.append(f"{label} has a malformed size or checksum")
            continue
        if root is None or block_hash(parent or root, tokens) != name:
            problems.append(f"token mismatch: {label} lists tokens that do not hash to its name")
            continue
        formed.append(record)
    kept: dict[str, dict] = {}
    for record in sorted(formed, key=lambda record: record["position"]):  # parents before children
        parent = record["parent"]
        if parent is not None and (parent not in kept or kept[parent]["position"] != record["position"] - 1):
            problems.append(f"block {record['hash'][:16]} names a parent {parent[:16]} the index does not hold")
            continue
        kept[record["hash"]] = record
    good = [record for record in formed if kept.get(record["hash"]) is record]
    return good, problems


# -- block files ----------------------------------------------------------------------------------
def block_bytes(tensors: dict, name: str) -> bytes:
    """A block file's bytes: safetensors of `tensors` (name -> contiguous CPU tensor)."""
    from safetensors.torch import save

    return save(tensors, metadata={"hash": name})


def parse_header(data: bytes, where: str) -> tuple[dict, int]:
    """(the safetensors header without metadata, the offset of its data) of a block file's bytes
    (`safetensors_header.read_header`); `where` names the file in the `ContextStoreError`."""
    try:
        return read_header(io.BytesIO(data), len(data))
    except HeaderError as error:
        if error.problem == "short":
            raise ContextStoreError(f"{where} is truncated ({len(data)} bytes)") from None
        raise ContextStoreError(f"{where} has a corrupted safetensors header") from None


def verified_block(namespace: Namespace, entry: dict, shapes: dict[str, tuple[tuple[int, ...], str]]) -> bytes:
    """A block file's bytes, checked against its index entry (size, sha256) and `shapes` (tensor
    name -> (shape, torch dtype name)).  Raises `ContextStoreError` naming what differs (or
    FileNotFoundError)."""
    where = namespace.path / entry["file"]
    data = namespace.read(entry["file"])
    if len(data) != entry["bytes"]:
        raise ContextStoreError(
            f"{where} is truncated or extended: {len(data)} bytes, the index records {entry['bytes']}"
        )
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ContextStoreError(f"{where} fails its checksum (sha256 differs from the index): the file is corrupted")
    header, start = parse_header(data, str(where))
    if set(header) != set(shapes):
        raise ContextStoreError(f"{where} holds tensors {sorted(header)}, expected {sorted(shapes)}")
    for name, (shape, dtype) in shapes.items():
        info = header[name]
        if DTYPE_NAMES.get(info.get("dtype")) != dtype:
            raise ContextStoreError(f"{where}: {name} has dtype {info.get('dtype')}, this model's cache holds {dtype}")
        if tuple(info.get("shape", ())) != tuple(shape):
            raise ContextStoreError(
                f"{where}: {name} has shape {list(info.get('shape', ()))}, this model's blocks are {list(shape)}"
            )
        begin, end = info["data_offsets"]
        if not 0 <= begin <= end <= len(data) - start:
            raise ContextStoreError(f"{where}: {name} lies outside the file")
    return data


class DiskBlock:
    """A verified block file's bytes, read a layer at a time (`layer(l)`)."""

    def __init__(self, data: bytes, where: str = "block") -> None:
        import torch

        header, start = parse_header(data, where)
        self.data = bytearray(data)
        self.tensors = {
            name: (getattr(torch, DTYPE_NAMES[info["dtype"]]), tuple(info["shape"]), start + info["data_offsets"][0])
            for name, info in header.items()
        }

    def _read(self, name: str, index: int):
        import torch

        dtype, shape, begin = self.tensors[name]
        row = shape[1:]
        size = torch.Size(row).numel() * torch.empty((), dtype=dtype).element_size()
        return (
            torch.frombuffer(
                self.data,
                dtype=dtype,
                count=size // torch.empty((), dtype=dtype).element_size(),
                offset=begin + index * size,
            )
            .view(row)
            .clone()
        )

    def layer(self, index: int):
        """Layer `index`'s rows: keys, values [bs, H, d], cis [bs, H] or None (fresh host tensors)."""
        return tuple(self._read(name, index) if name in self.tensors else None for name in ("keys", "values", "cis"))


# -- repair ---------------------------------------------------------------------------------------
def repair(root: str | os.PathLike, namespace: str) -> tuple[int, int, list[str]]:
    """Make a namespace's store consistent whatever state it is in, under the exclusive lock: keep
    every entry whose index record is well formed and whose file has its recorded size, checksum
    and a readable header (with its parent kept), rewrite the index, delete every other file.  An
    unreadable index keeps nothing.  Returns (blocks kept, blocks dropped, problems)."""
    with Namespace(root, namespace, create=False) as space, space.lock(exclusive=True):
        try:
            index = read_index(space)
            generation = (index or {}).get("generation", 0)
        except BrokenIndex as error:
            index, generation, broken = None, 0, [str(error)]
        else:
            broken = []
        if index is None:
            fresh = new_index(namespace, None, None, [], generation + 1)
            if broken or space.block_names():
                write_index(space, fresh)
            remove_unlisted(space, set())
            return 0, 0, broken
        good, problems = check_entries(index)
        names = set()
        for record in sorted(good, key=lambda record: record["position"]):  # parents first
            if record["parent"] is not None and record["parent"] not in names:
                problems.append(f"block {record['hash'][:16]} lost its parent")
                continue
            try:
                data = space.read(record["file"])
                if len(data) != record["bytes"] or hashlib.sha256(data).hexdigest() != record["sha256"]:
                    raise ContextStoreError(f"{record['file']} does not have its recorded size and checksum")
                parse_header(data, record["file"])
            except (OSError, ContextStoreError) as error:
                problems.append(f"block {record['hash'][:16]}: {error}")
                continue
            names.add(record["hash"])
        kept = [record for record in good if record["hash"] in names]
        dropped = len(index["entries"]) - len(kept)
        fixed = new_index(namespace, index.get("identity"), index.get("block_size"), kept, generation + 1)
        write_index(space, fixed)
        remove_unlisted(space, {record["file"] for record in kept})
        return len(kept), dropped, problems


def list_namespaces(root: str | os.PathLike) -> list[str]:
    """The namespaces under `root` that hold an index (sorted); symlinks are not namespaces."""
    try:
        items = list(os.scandir(root))
    except FileNotFoundError:
        return []
    names = []
    for item in items:
        if (
            item.is_dir(follow_symlinks=False)
            and NAMESPACE_NAME.match(item.name)
            and os.path.lexists(os.path.join(item.path, INDEX))
        ):
            names.append(item.name)
    return sorted(names)
