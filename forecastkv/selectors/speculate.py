"""``speculate``: InfiniGen-style (Lee et al., OSDI 2024).  Layer l+1's input norm and query projection
applied to the residual entering layer l guess layer l+1's queries, with no training
(`modeling/modeling.py:DecoderLayer.guess_queries`); they score layer l+1's compressed keys before it
appends the row's token (lag 1), so the blocks are known a layer ahead.  Layer 0 has no layer before it
and selects with its own queries."""

from __future__ import annotations

from .base import Selector
from .query import SELECTOR as QUERY


class Speculate(Selector):
    name = "speculate"
    scores_with = "guessed-queries"
    scoring = "speculate"
    plans_ahead = True

    def at_layer(self, layer_idx: int, sparse) -> Selector:
        return QUERY if layer_idx == 0 else self

    def handoff(self, attn, next_layer, hidden, normed, call, given, current):
        """The next layer's guessed queries [B, T, Hq, d], on that layer's device (a device_map)."""
        device = next_layer.input_layernorm.weight.device
        return next_layer.guess_queries(hidden.to(device), call if device == hidden.device else call.to(device))


SELECTOR = Speculate()
