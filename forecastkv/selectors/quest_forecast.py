"""``quest-forecast``: Quest's block key bounds (`quest.py`) scored with the Forecast vectors that layer
l-1's heads make for layer l, instead of layer l's own queries.  So the blocks are known a layer ahead, as
the forecast selector's are, and `forecast-offload` can fetch them while layer l-1 runs; the bounds are
scored before layer l appends the row's token (lag 1), what that plan sees.  The Forecast vectors stand
in for queries: with n vectors per KV head, Quest's group softmax runs over those n."""

from __future__ import annotations

from .quest import Quest


class QuestForecast(Quest):
    name = "quest-forecast"
    scores_with = "forecast"
    scoring = "forecast"  # its visibility lag: 1
    plans_ahead = True


SELECTOR = QuestForecast()
