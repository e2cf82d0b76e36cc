"""``forecast-carry-pin``: ``forecast-carry`` (`forecast_carry.py`), and per layer and KV head the blocks the
prompt's last rows attended most pinned into every decode step's selection (`modeling/pins.py`: why and how).
Pins are known when the prompt ends, so the rule still plans a layer ahead."""

from __future__ import annotations

from ..modeling.pins import PINNED
from .forecast_carry import ForecastCarry


class ForecastCarryPin(ForecastCarry):
    name = "forecast-carry-pin"
    pins = PINNED


SELECTOR = ForecastCarryPin()
