"""``forecast-carry``: the Forecast vectors of the layer before score its compressed keys, a
layer ahead (`forecast.py`); and the blocks the last decode step attended most, in any layer,
are carried into every layer's selection (`modeling/carry.py`: why and how).  Carried blocks are known a
whole step ahead, so a rule that plans a layer ahead still does."""

from __future__ import annotations

from ..modeling.carry import CARRIED
from .forecast import Forecast


class ForecastCarry(Forecast):
    name = "forecast-carry"
    carries = CARRIED


SELECTOR = ForecastCarry()
