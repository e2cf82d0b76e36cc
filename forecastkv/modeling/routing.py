"""Run a model with another `sparse_config` for a while, without mutating its config.

Training routes the frozen backbone densely or with either selector, the eval harness compares
attention modes on one loaded model, and the recall protocol scores both selectors on one
forward.  All of them go through `attending_with`.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

from ..modes import BACKBONES  # re-exported: the trainer and recall import it from here


@contextmanager
def attending_with(model, sparse_config):
    """Inside the block, `model` attends with `sparse_config` (a preset name, a dict, or None for
    dense attention).  Every module holding the model's config gets a copy carrying the new
    sparse_config, and the original object back on exit: the caller's config is never changed,
    even if the block raises.  Yields the copy."""
    original = model.config
    swapped = copy.copy(original)  # a shallow copy with its own __dict__: the parsed parts are rebuilt below
    swapped.sparse_config = sparse_config
    holders = [module for module in model.modules() if getattr(module, "config", None) is original]
    for module in holders:
        module.config = swapped
    try:
        yield swapped
    finally:
        for module in holders:
            module.config = original


def backbone_sparse_config(backbone: str, sparse) -> dict | None:
    """The sparse_config that routes a frozen model as `backbone`: "dense" (None), or the geometry
    `sparse` (a SparseConfig) with the "query" or the "forecast" selector."""
    if backbone not in BACKBONES:
        raise ValueError(f"backbone {backbone!r} is not one of {BACKBONES}")
    return None if backbone == "dense" else {**sparse.to_dict(), "selector": backbone}
