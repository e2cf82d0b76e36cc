"""``query-carry``: the layer's own queries score its compressed keys (`query.py`); and the blocks the
last decode step attended most, in any layer, are carried into every layer's selection
(`modeling/carry.py`: why and how)."""

from __future__ import annotations

from ..modeling.carry import CARRIED
from .query import Query


class QueryCarry(Query):
    name = "query-carry"
    carries = CARRIED


SELECTOR = QueryCarry()
