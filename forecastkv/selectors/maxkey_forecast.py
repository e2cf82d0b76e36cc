"""``maxkey-forecast``: the Forecast vectors of layer l-1 scored against one max-pooled key per block of
layer l (the per-channel maximum of the block's keys, the `hi` half of Quest's bounds that the cache
keeps), instead of InfLLM-v2's mean-pooled compressed keys (`forecast`) or Quest's two-sided bound
(`quest-forecast`).  Issue 38's "max rather than the mean of each window", at block granularity: the
score is v.k_max / sqrt(d), softmaxed per vector and summed per KV group, so a channel where v is negative
favours the block whose largest key is smallest, which the two-sided bound does not.  It plans a layer
ahead like the other Forecast selectors."""

from __future__ import annotations

from .quest_forecast import QuestForecast


class MaxKeyForecast(QuestForecast):
    name = "maxkey-forecast"

    def bounds(self, cache_layer):
        """(hi, hi): with lo = hi Quest's bound max(v lo, v hi) per channel is v.hi, the max-pooled key's score."""
        _, high = cache_layer.key_bounds()
        return high, high


SELECTOR = MaxKeyForecast()
