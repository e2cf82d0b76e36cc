"""The selectors and the offloaded runtime's cache modes, named once.

A selector is the rule that picks each layer's blocks (`sparse_config.selector`); every one fills the same
budget (`budget_blocks` blocks of `block_size` tokens, init and local blocks included), or a top-p budget
capped at it (`sparse_config.top_p`):

  * ``query``      InfLLM-v2 (Zhao et al. 2025, MiniCPM4) and NOSA: the layer's own queries score its
                   compressed keys (`modeling/selection.py`).
  * ``forecast``   SparDA: the previous layer's trained Forecast heads score this layer's compressed keys,
                   so the blocks are known a layer ahead (`modeling/heads.py`).
  * ``oracle``     the exact top-k blocks by the query's true attention mass over every key
                   (`modeling/selectors.py:oracle_block_mass`): the upper bound the others are measured
                   against. It reads every key, so it is never deployable and the offloaded runtime refuses it.
  * ``quest``      Quest (Tang et al., ICML 2024): per block and channel the min and max key; the upper bound
                   of q.k over the block is the score (`modeling/selectors.py:quest_block_scores`).
  * ``reuse``      Kascade-style cross-layer reuse: anchor layers (`sparse_config.reuse_anchors`, picked on
                   held-out text by `eval/reuse_anchors.py`) select with their queries; each later layer reuses
                   the last anchor's blocks, so those are known a layer ahead.
  * ``speculate``  InfiniGen-style (Lee et al., OSDI 2024): layer l+1's input norm and query projection
                   applied to the residual entering layer l guess layer l+1's queries, with no training; layer
                   0 selects with its own queries.


The runtime (`forecastkv.inference`), the console script (`--offload`), the eval suites (`<attention>@<mode>`),
lm-eval (`offload=`) and the context store all read these names from here.  This module imports nothing, so
the console script can offer the modes without importing torch.

A mode says which selector picks the blocks and when an offloaded layer fetches them:

  * ``no-offload``        every layer resident (the `SparseCache` behaviour);
  * ``sparse-offload``    query selector, blocks fetched at the consuming layer;
  * ``forecast-sync``     forecast selector, blocks fetched at the consuming layer;
  * ``forecast-offload``  forecast selector, blocks fetched one layer ahead;
  * ``dense-offload``     every offloaded layer's whole KV copied to the device each step.
"""

from __future__ import annotations

SELECTORS = ("query", "forecast", "oracle", "quest", "reuse", "speculate")

# attention mode -> (policy, selector), None = dense: what the eval suites (`eval/modes.py`) and vLLM's
# `forecastkv_mode` (`serving/vllm_model.py`) name a model's way of attending by
ATTENTION_MODES = {
    "dense": None,
    "infllmv2-query": ("infllmv2", "query"),
    "infllmv2-forecast": ("infllmv2", "forecast"),
    "nosa": ("nosa", "query"),
    "nosa-forecast": ("nosa", "forecast"),
}

# selector -> whether it knows a layer's blocks before that layer runs (so `forecast-offload` can fetch them a
# layer ahead); reuse does for every layer but its anchors
SELECTOR_PREFETCH = {
    "query": False,
    "forecast": True,
    "oracle": False,
    "quest": False,
    "reuse": True,
    "speculate": True,
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

# what a layer attends with while forecast recall or training scores the heads (`modeling/routing.py`)
BACKBONES = ("dense", "query", "forecast")
