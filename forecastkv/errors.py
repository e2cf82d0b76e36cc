"""The package's user-error types.

A `UserInputError` is a value the user gave that forecastkv refuses; its message names the value
and the limit.  The console script prints it as one line, `forecastkv: error: <message>`, and exits
with status 2; any other exception is a bug and keeps its traceback.  Each subclass is a
`ValueError`, so `except ValueError` callers keep working.  This module imports nothing, so the
console script can test for these types without importing torch.
"""

from __future__ import annotations


class UserInputError(ValueError):
    """A user-supplied value that is refused (the message names the value and the limit)."""


class ConfigError(UserInputError):
    """A configuration that is unreadable or invalid: a recipe, an eval suite, a sparse_config."""


class DataError(UserInputError):
    """Training or evaluation data that cannot be read: the message names the file (and line)."""


class ForecastKVWarning(UserWarning):
    """A warning about a user's choice that forecastkv accepts (e.g. heads used under another
    selection budget); the console script prints it as one `forecastkv: warning:` line."""
