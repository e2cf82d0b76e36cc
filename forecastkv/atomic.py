"""Atomic file writes: a temporary file in the target's directory, fsynced, then `os.replace`.

A reader (or a resumed run) sees either the old file or the whole new one, never a torn write.
Every file the package writes for later reading (checkpoints, results, forecast weights, reports)
goes through `write_atomic`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def write_atomic(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` to fill a temporary file beside `path`, then move it over `path`.

    The temporary file is removed if `write` raises.  Returns `path` as a Path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


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
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
