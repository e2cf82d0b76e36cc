"""``query``: InfLLM-v2 (Zhao et al. 2025, MiniCPM4) and NOSA: the layer's own queries score its compressed
keys after the row's token was appended (lag 0), with MiniCPM4.1's coarse LSE where the config asks
for it.  The whole rule is `base.Selector`'s."""

from __future__ import annotations

from .base import Selector


class Query(Selector):
    name = "query"


SELECTOR = Query()
