"""The block selectors: one module per rule, registered here by name.

A selector is the rule that picks each layer's blocks (`sparse_config.selector`); every one fills the same
budget (`budget_blocks` blocks of `block_size` tokens, init and local blocks included), or a top-p budget
capped at it (`sparse_config.top_p`).  Each module defines `SELECTOR`, a `base.Selector` that owns
everything about its rule: what it scores with (the layer's own queries, vectors the layer before hands
over, or the blocks of an anchor), how it scores, whether it knows a layer's blocks a layer ahead, which
window index a cache keeps for it, and whether the offloaded runtime can run it.  Attention, the decoder
loop, the caches and the runtime ask it; none of them names a selector.

  * ``query``           InfLLM-v2 (Zhao et al. 2025, MiniCPM4) and NOSA: the layer's own queries score its
                        compressed keys (`query.py`).
  * ``forecast``        SparDA: the previous layer's trained Forecast heads score this layer's compressed
                        keys, so the blocks are known a layer ahead (`forecast.py`).
  * ``oracle``          the exact top-k blocks by the query's true attention mass over every key
                        (`oracle.py`): the upper bound the others are measured against. It reads every key,
                        so it is never deployable and the offloaded runtime refuses it.
  * ``quest``           Quest (Tang et al., ICML 2024): per block and channel the min and max key; the upper
                        bound of q.k over the block is the score (`quest.py`).
  * ``reuse``           Kascade-style cross-layer reuse: anchor layers (`sparse_config.reuse_anchors`) select
                        with their queries; each later layer reuses the last anchor's blocks (`reuse.py`).
  * ``speculate``       InfiniGen-style (Lee et al., OSDI 2024): layer l+1's input norm and query projection
                        applied to the residual entering layer l guess layer l+1's queries (`speculate.py`).
  * ``quest-forecast``  Quest's block bounds scored with the Forecast vectors of the layer before, so it
                        plans a layer ahead (`quest_forecast.py`).
  * ``maxkey-forecast`` the Forecast vectors scored against each block's max-pooled key (the per-channel
                        maximum, the upper half of Quest's bounds): a one-sided key summary, a layer ahead
                        (`maxkey_forecast.py`).
  * ``query-carry``, ``forecast-carry``, ``quest-forecast-carry``
                        those rules with the blocks the last decode step attended most carried into every
                        layer (`modeling/carry.py`): what a copy head needs and pooled keys do not show.
  * ``forecast-carry-pin``, ``quest-forecast-carry-pin``
                        the two carrying rules that plan a layer ahead, with each layer's and KV head's blocks
                        the prompt's last rows attended most pinned for every decode step (`modeling/pins.py`):
                        what a layer ahead misses at the first answer token.

A new selector is one module here plus its line in `REGISTERED`.  This module imports nothing, so the
console script can offer the names without importing torch.
"""

from __future__ import annotations

# selector name -> its module in this package (each defines SELECTOR)
REGISTERED = {
    "query": "query",
    "forecast": "forecast",
    "oracle": "oracle",
    "quest": "quest",
    "reuse": "reuse",
    "speculate": "speculate",
    "quest-forecast": "quest_forecast",
    "maxkey-forecast": "maxkey_forecast",
    "query-carry": "query_carry",
    "forecast-carry": "forecast_carry",
    "quest-forecast-carry": "quest_forecast_carry",
    "forecast-carry-pin": "forecast_carry_pin",
    "quest-forecast-carry-pin": "quest_forecast_carry_pin",
}


def get_selector(name):
    """The `Selector` registered as `name`; None for None, and a `Selector` is returned as it is.
    A ValueError naming the registered selectors for any other name."""
    if name is None or not isinstance(name, str):
        return name
    if name not in REGISTERED:
        raise ValueError(f"selector={name!r} is not None or one of {tuple(REGISTERED)}")
    import importlib

    return importlib.import_module(f"{__name__}.{REGISTERED[name]}").SELECTOR
