"""Atomic file writes: a temporary file in the target's directory, fsynced, then `os.replace`.

A reader (or a resumed run) sees either the old file or the whole new one, never a torn write.
Every file the package writes for later reading (checkpoints, results, forecast weights, reports)
goes through `write_atomic`; the logs it appends to (results shards, metrics.jsonl) through
`append_line`.

A full disk (ENOSPC) or quota (EDQUOT) is a `DiskFullError` naming the path and the bytes: the
temporary file is removed (or the appended line cut off), so what was on disk before is intact.
A write whose size is known is refused before it starts when the file system has less free.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path
from typing import Callable

from .errors import DiskFullError

NO_ROOM = {errno.ENOSPC, errno.EDQUOT}
# how libraries that wrap the OS error in their own type (safetensors' SafetensorError) say it
NO_ROOM_TEXT = ("No space left on device", "Disk quota exceeded", "(os error 28)", "(os error 122)")


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of `path` (or of its nearest
    existing parent); None where the platform cannot tell."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        info = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return info.f_bavail * info.f_frsize


def check_room(path: str | os.PathLike, needed: int | None) -> None:
    """Refuse a write of `needed` bytes to `path` before it starts when its file system has less free."""
    if needed is None:
        return
    free = free_bytes(path)
    if free is not None and needed > free:
        raise DiskFullError(path, needed, free)


def is_no_room(error: BaseException) -> bool:
    """Whether `error` is a full disk or an exceeded quota (an OSError's errno, or the text of a
    library's own error type)."""
    if isinstance(error, OSError) and error.errno in NO_ROOM:
        return True
    return not isinstance(error, OSError) and any(text in str(error) for text in NO_ROOM_TEXT)


@contextlib.contextmanager
def room_checked(path: str | os.PathLike, needed: int | None = None):
    """Turn a full disk or quota inside the block into a `DiskFullError` naming `path` and `needed`."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as error:
        if not is_no_room(error):
            raise
        quota = isinstance(error, OSError) and error.errno == errno.EDQUOT or "quota" in str(error).lower()
        raise DiskFullError(path, needed, free_bytes(path), quota=quota) from error


def file_mode() -> int:
    """The mode `open()` gives a new file under this process's umask (0644 under the usual 022):
    what written files get, as `mkstemp` makes its temporary files 0600."""
    try:  # Linux reports the umask without changing it (os.umask would, for every thread)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def write_atomic(path: str | os.PathLike, write: Callable[[Path], None], nbytes: int | None = None) -> Path:
    """Call `write(tmp)` to fill a temporary file beside `path`, then move it over `path`.

    The temporary file is removed if `write` raises.  nbytes: the size about to be written, if
    known (refused at once when the file system has less free).  A full disk is a
    `DiskFullError`.  Returns `path` as a Path.
    """
    path = Path(path)
    check_room(path, nbytes)
    with room_checked(path, nbytes):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
        try:
            write(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.chmod(tmp, file_mode())  # mkstemp makes it 0600
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return path


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append `line` (text ending in a newline) to `path`, fsynced.  On any failure (a full disk:
    `DiskFullError`) the file is cut back to its length before, so it never ends in a torn line."""
    data = line.encode("utf-8")
    with room_checked(path, len(data)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            start = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            except BaseException:
                os.ftruncate(fd, start)  # shrinking needs no room
                raise
        finally:
            os.close(fd)


def remove_temporaries(folder: str | os.PathLike, name: str) -> list[Path]:
    """Delete the temporaries `write_atomic` left for files matching `name` (a glob) in `folder`:
    what a kill inside a write leaves (`.<name>.<random>.tmp`).  Returns the paths removed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = [p for p in folder.glob(f".{name}.*.tmp") if p.is_file()]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """`write_atomic` for a UTF-8 text file."""
    data = text.encode("utf-8")
    return write_atomic(path, lambda tmp: tmp.write_bytes(data), len(data))
