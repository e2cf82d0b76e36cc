"""What the console script's commands share: the usage error and its one-line report, argparse types
that name the value and its limit, and the checks that word the library's errors for the command line
(a checkpoint path, a preset, what an offload mode needs).  The parsers (`forecastkv/cli.py`) and the
command bodies in the sub-packages (`inference/cli.py`, `modeling/cli.py`, `eval/study_cli.py`) import
them from here.  Importing this module imports no torch.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from .errors import UserInputError
from .modes import FORECAST_MODES, SELECTING_MODES, STORE_SELECTORS

USAGE_STATUS = 2


class UsageError(UserInputError):
    """A user error worded for the command line (names the option to change)."""


def print_error(message: str, kind: str = "error") -> None:
    print(f"forecastkv: {kind}: {' '.join(str(message).split())}", file=sys.stderr)


def argument_type(convert, ok, limit: str, expected: str):
    """An argparse type: `convert(text)` (a ValueError: "expected <expected>"), which must pass
    `ok` (else "<limit>, got <text>")."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{limit}, got {text}")
        return value

    return parse


positive_int = argument_type(int, lambda value: value >= 1, "must be at least 1", "a positive integer")


positive_float = argument_type(
    float, lambda value: math.isfinite(value) and value > 0, "must be a finite number > 0", "a number"
)


probability = argument_type(float, lambda value: 0 < value <= 1, "must lie in (0, 1]", "a number in (0, 1]")


seed = argument_type(int, lambda value: 0 <= value < 2**63, "must lie in [0, 2**63)", "an integer")


def model_path(option: str, value: str) -> str:
    """The checkpoint directory (or hub id) an option names: `smollm2-135m` and `bundled:NAME` are
    the bundled model; a local-looking path must exist."""
    from .bundled import bundled_model_path, resolve_model_path

    if value == "smollm2-135m":
        return bundled_model_path(value)
    path = resolve_model_path(value)
    local = Path(path).expanduser()
    if path.startswith((".", "/", "~")) or local.exists():
        if not local.is_dir():
            raise UsageError(
                f"{option} {value}: no such checkpoint directory"
                if not local.exists()
                else f"{option} {value}: not a directory"
            )
        if not (local / "config.json").is_file():
            raise UsageError(f"{option} {value}: no config.json in that directory (not a checkpoint)")
    return str(local) if local.exists() else path


def check_preset(option: str, name: str | None) -> None:
    if name is None:
        return
    from .modeling.configuration import list_presets

    if name not in list_presets():
        raise UsageError(f"{option} {name!r} is not a preset; known presets: {', '.join(list_presets())}")


def selector_option(mode: str | None, selector: str | None) -> str:
    """The option that chose the selector, for a message: `--selector NAME`, else `--offload MODE`."""
    return f"--selector {selector}" if selector is not None else f"--offload {mode}"


def check_selector(mode: str | None, selector: str | None, context_cache: str | None = None) -> None:
    """Before loading: `--selector` against `--offload` (`inference/offloaded.py:resolve_selector`: a mode that
    fetches a layer ahead needs a selector that plans ahead, the oracle runs resident only) and against
    `--context-cache` (a store keeps the prefills of the query and forecast selectors only)."""
    if selector is None:
        return
    if context_cache is not None and selector not in STORE_SELECTORS:
        raise UsageError(
            f"--selector {selector} with --context-cache: a context store keeps the prefills of the query and "
            "forecast selectors only; leave out --context-cache or pick one of those"
        )
    if mode is not None:
        from .inference.offloaded import resolve_selector

        try:
            resolve_selector(mode, selector, None)
        except ValueError as error:
            raise UsageError(f"--selector {selector} with --offload {mode}: {error}") from None


def check_offload_needs(
    mode: str | None, model_option: str, model: str, path: str, forecast_given: bool, selector: str | None = None
) -> str | None:
    """Before loading: a forecast offload mode, or a `selector` that scores Forecast vectors, needs Forecast
    heads (created or loaded).  Returns the heads to load where none were given and the checkpoint has none
    but is a bundled model with heads shipped for it (`"bundled:NAME"`), else None."""
    if selector is not None:
        from .selectors import get_selector

        needs = get_selector(selector).needs_forecast_heads
    else:
        needs = mode in FORECAST_MODES
    if not needs or forecast_given:
        return None
    from .bundled import shipped_heads_for
    from .modeling.head_files import has_forecast_heads

    if has_forecast_heads(path):
        return None
    shipped = shipped_heads_for(model)
    if shipped is not None:
        return shipped
    raise UsageError(
        f"{selector_option(mode, selector)} selects blocks with Forecast heads, and {model_option} {model} has none: "
        "add --forecast-init next_query (untrained heads made from the next layer's queries) "
        "or --forecast-weights DIR (a train-forecast output)"
    )


def check_heads_option(option: str, value: str | None) -> None:
    """A `--heads DIR` option names a train-forecast output directory or the shipped `bundled:NAME`."""
    if value is None:
        return
    if value.startswith("bundled:"):
        from .bundled import resolve_heads_path
        from .errors import ConfigError

        try:
            resolve_heads_path(value)
        except ConfigError as error:
            raise UsageError(f"{option} {value}: {error}") from None
    elif not Path(value).expanduser().is_dir():
        raise UsageError(f"{option} {value}: no such directory (a train-forecast output, or bundled:NAME)")


def check_sparse(mode: str | None, model, selector: str | None = None) -> None:
    if (mode in SELECTING_MODES or selector is not None) and model.config.sparse is None:
        raise UsageError(
            f"{selector_option(mode, selector)} needs a sparse model, and this checkpoint is dense: "
            "add --sparse-config PRESET (e.g. smollm2-135m)"
        )
