"""The package's user-error types.

A `UserInputError` is a value the user gave that forecastkv refuses; its message names the value
and the limit.  The console script prints it as one line, `forecastkv: error: <message>`, and exits
with status 2; any other exception is a bug and keeps its traceback (plus a line asking to file
it).  Each subclass is a `ValueError`, so `except ValueError` callers keep working.  This module
imports nothing at its top (yaml only inside `read_yaml_mapping`), so the console script can test
for these types without importing torch.
"""

from __future__ import annotations


class UserInputError(ValueError):
    """A user-supplied value that is refused (the message names the value and the limit)."""


class ConfigError(UserInputError):
    """A configuration that is unreadable or invalid: a recipe, an eval suite, a sparse_config."""


class CheckpointError(UserInputError):
    """A checkpoint directory that is missing, corrupt, partial or of an unknown format."""


class DataError(UserInputError):
    """Training or evaluation data that cannot be read: the message names the file (and line)."""


class MissingExtraError(UserInputError, ImportError):
    """An optional package the user's choice needs is not installed (the message says what to
    `pip install`).  Also an ImportError, so `except ImportError` callers keep working."""


class DiskFullError(UserInputError, OSError):
    """A write that found no room on its file system (ENOSPC, or EDQUOT: a quota), or a large
    write refused before it began.  The message names the path, the bytes the write needed (when
    known) and the bytes free; what was on disk before is intact and the write's temporary file
    is gone (`forecastkv.atomic`).  An OSError too (errno ENOSPC or EDQUOT, filename the path), so
    `except OSError` callers that treat a failed write as a miss keep doing so."""

    def __init__(self, path, needed: int | None, free: int | None, quota: bool = False) -> None:
        import errno
        import os

        self.path, self.needed, self.free = os.fspath(path), needed, free
        need = "" if needed is None else f" (needs {needed:,} bytes"
        have = "" if free is None else (f", {free:,} free)" if need else f" ({free:,} bytes free)")
        why = "the disk quota is exceeded" if quota else "no space left on its file system"
        self.message = f"cannot write {self.path}: {why}{need}{have}; nothing already on disk was changed"
        super().__init__(self.message)
        self.errno = errno.EDQUOT if quota else errno.ENOSPC
        self.filename = self.path

    def __str__(self) -> str:
        return self.message


class ForecastKVWarning(UserWarning):
    """A warning about a user's choice that forecastkv accepts (e.g. heads used under another
    selection budget); the console script prints it as one `forecastkv: warning:` line."""


def read_yaml_mapping(path, what: str) -> dict:
    """The YAML mapping in the file `path` (an empty file is {}): a missing or unreadable file,
    text that is not YAML, or YAML that is not a mapping is a `ConfigError` naming `what` and the
    file, with the line of a syntax error.  The one reader of users' config files."""
    import os

    import yaml

    name = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            given = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{what} {name!r}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {name!r} is a directory, not a YAML file") from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{what} {name!r} is not a YAML file: "
            f"byte {error.object[error.start]:#04x} at offset {error.start} is not UTF-8"
        ) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{what} {name!r} is not valid YAML{where}: {problem}") from None
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise ConfigError(f"{what} {name!r} must be a YAML mapping, got a {type(given).__name__}")
    return given
