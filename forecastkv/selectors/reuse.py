"""``reuse``: Kascade-style cross-layer reuse.  Anchor layers (`sparse_config.reuse_anchors`, picked on
held-out text by `eval/reuse_anchors.py`) select with their own queries; every later layer reuses the
last anchor's selection [B, H, T, K], handed down layer to layer, so those blocks are known a layer ahead."""

from __future__ import annotations

from ..errors import ConfigError
from .base import Selector
from .query import SELECTOR as QUERY


class Reuse(Selector):
    name = "reuse"
    scores_with = "blocks"
    plans_ahead = True
    anchored = True

    def at_layer(self, layer_idx: int, sparse) -> Selector:
        return QUERY if layer_idx in sparse.reuse_anchors else self

    def check(self, sparse, num_layers: int) -> None:
        if max(sparse.reuse_anchors) >= num_layers:
            raise ConfigError(
                f"sparse_config.reuse_anchors={list(sparse.reuse_anchors)} names a layer past the model's "
                f"{num_layers} layers"
            )

    def handoff(self, attn, next_layer, hidden, normed, call, given, current):
        """The anchor's selection, passed on by a reusing layer (an anchor hands over its own selection
        once it has made it: `modeling/modeling.py:DecoderLayer.forward`)."""
        return given if current is self else None

    def rows(self, vectors, rows: slice):
        return vectors[:, :, rows]  # a selection [B, H, T, K]: rows on axis 2

    def select(self, vectors, positions, cache_layer, sparse, bounds=None, key_count=None):
        return vectors

    def plan(self, vectors, positions, cache_layer, sparse):
        return cache_layer.plan(vectors[:, :, 0])


SELECTOR = Reuse()
