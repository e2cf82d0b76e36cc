"""Package attributes imported on first use (PEP 562), so that importing a package for its
command line parser does not import torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_attributes(package: str, names: dict[str, str], first=()) -> tuple[Callable, Callable]:
    """(`__getattr__`, `__dir__`) for `package`: `names` maps each public name to the module
    (relative, e.g. ".report") that defines it; `first`: modules imported before any of them.
    A name, once looked up, is set on the package, so the hook runs once per name."""
    module = importlib.import_module(package)

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        for before in first:
            importlib.import_module(before, package)
        value = getattr(importlib.import_module(names[name], package), name)
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(module), *names})

    return __getattr__, __dir__
