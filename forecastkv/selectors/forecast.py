"""``forecast``: SparDA.  The trained Forecast heads of layer l-1 (`modeling/heads.py`) score layer l's
compressed keys before layer l appends the row's token (lag 1), so the blocks are known a layer ahead and
`forecast-offload` fetches them while layer l-1 runs.  Layer 0 has no layer before it: its
`current_proj` scores it (`modeling/attention.py`).  One vector per KV head scores by the raw dot product,
more by the group-summed softmax (`selection.key_scores`)."""

from __future__ import annotations

from .base import Selector


class Forecast(Selector):
    name = "forecast"
    scores_with = "forecast"
    scoring = "forecast"
    plans_ahead = True


SELECTOR = Forecast()
