"""The selectors and the offloaded runtime's cache modes, named once.

The selectors are registered in `forecastkv/selectors/__init__.py`, one module each (what each does is
written there); `SELECTORS` is their names.

The runtime (`forecastkv.inference`), the console script (`--offload`), the eval suites (`<attention>@<mode>`),
lm-eval (`offload=`) and the context store all read these names from here.  This module imports nothing but the
registry's names, so the console script can offer the modes without importing torch.

A mode says which selector picks the blocks and when an offloaded layer fetches them:

  * ``no-offload``        every layer resident (the `SparseCache` behaviour);
  * ``sparse-offload``    query selector, blocks fetched at the consuming layer;
  * ``forecast-sync``     forecast selector, blocks fetched at the consuming layer;
  * ``forecast-offload``  forecast selector, blocks fetched one layer ahead;
  * ``dense-offload``     every offloaded layer's whole KV copied to the device each step.
"""

from __future__ import annotations

from .selectors import REGISTERED

SELECTORS = tuple(REGISTERED)

# attention mode -> (policy, selector), None = dense: what the eval suites (`eval/modes.py`) and vLLM's
# `forecastkv_mode` (`serving/vllm_model.py`) name a model's way of attending by
ATTENTION_MODES = {
    "dense": None,
    "infllmv2-query": ("infllmv2", "query"),
    "infllmv2-forecast": ("infllmv2", "forecast"),
    # the blocks a decode step attended most carried into the next (`modeling/carry.py`)
    "infllmv2-query-carry": ("infllmv2", "query-carry"),
    "infllmv2-forecast-carry": ("infllmv2", "forecast-carry"),
    # and the blocks the prompt's last rows attended most pinned per layer and KV head (`modeling/pins.py`)
    "infllmv2-forecast-carry-pin": ("infllmv2", "forecast-carry-pin"),
    # Quest's per-block key bounds (a window index of one block), scored by the query or the Forecast vectors
    "infllmv2-quest": ("infllmv2", "quest"),
    "infllmv2-quest-forecast-carry-pin": ("infllmv2", "quest-forecast-carry-pin"),
    "nosa": ("nosa", "query"),
    "nosa-forecast": ("nosa", "forecast"),
}

MODES = ("no-offload", "sparse-offload", "forecast-sync", "forecast-offload", "dense-offload")

# mode -> the selector that picks its blocks ("query": the layer's own queries; "forecast": the previous
# layer's Forecast heads); a mode not listed attends as the model's own config says
MODE_SELECTOR = {"sparse-offload": "query", "forecast-sync": "forecast", "forecast-offload": "forecast"}

# mode -> how an offloaded layer gets its blocks: "sync" (at the consuming layer), "prefetch" (one layer
# ahead) or "dense" (every block, every step)
MODE_FETCH = {
    "sparse-offload": "sync",
    "forecast-sync": "sync",
    "forecast-offload": "prefetch",
    "dense-offload": "dense",
}

# the modes that select blocks (so need a sparse model), and those that select with Forecast heads
SELECTING_MODES = tuple(mode for mode in MODES if mode in MODE_SELECTOR)
FORECAST_MODES = tuple(mode for mode in MODES if MODE_SELECTOR.get(mode) == "forecast")
# the selectors whose prefills a context store keeps (`context/store.py`): the modes' own two
STORE_SELECTORS = ("query", "forecast")

# what a layer attends with while forecast recall or training scores the heads (`modeling/routing.py`)
BACKBONES = ("dense", "query", "forecast")
