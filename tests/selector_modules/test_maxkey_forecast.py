"""maxkey-forecast (`forecastkv/selectors/maxkey_forecast.py`): the Forecast vectors of the layer before
against each block's max-pooled key, against a plain loop of that rule; planned a layer ahead, so
forecast-offload runs it and its tokens equal the resident cache's."""

from __future__ import annotations

import pytest
import torch

from forecastkv import SparseCache
from forecastkv.inference import OffloadedSparseCache
from forecastkv.selectors import get_selector
from tests.helpers import left_padded, rel, tiny_model
from tests.inference.test_offloaded import generate
from tests.selector_modules.test_quest_forecast import check_every_layer_against_the_loop, new_cache, selections_differ

GEOMETRY = {"policy": "infllmv2", "topk": 4, "selector": "maxkey-forecast"}


@pytest.fixture(autouse=True)
def _tiny_models_on_one_thread(one_thread):
    """One intra-op thread for tiny models (why: tests/inference/conftest.py:one_thread)."""
    yield


def max_key_score(v, lo, hi):
    """v . (the block's per-channel key maximum), channel by channel: the max-pooled key's score."""
    return v * hi


def test_it_is_registered_as_a_layer_ahead_rule_on_the_quest_bounds():
    rule = get_selector("maxkey-forecast")
    assert (rule.name, rule.scores_with, rule.lag) == ("maxkey-forecast", "forecast", 1)
    assert rule.plans_ahead and rule.key_bounds and rule.needs_forecast_heads and rule.deployable


@pytest.mark.parametrize("cache_kind", ["resident", "forecast-offload"])
def test_each_layer_selects_the_blocks_of_the_largest_max_key_scores(cache_kind):
    model = tiny_model(GEOMETRY, seed=8)
    check_every_layer_against_the_loop(model, new_cache(model, cache_kind), max_key_score)


def test_it_chooses_otherwise_than_quest_forecast():
    """The one-sided score is another rule: on one prompt the two select differently somewhere."""
    assert selections_differ("quest-forecast", "maxkey-forecast")


@pytest.mark.parametrize("lengths", [[70, 52], [5, 3]], ids=["two-blocks", "shorter-than-a-block"])
def test_offloaded_tokens_and_logits_equal_the_resident_caches(lengths):
    model = tiny_model(GEOMETRY, seed=8)
    ids, mask = left_padded(lengths)
    ref = generate(model, ids, mask, SparseCache(model.config), 6)
    cache = OffloadedSparseCache.for_model(model, mode="forecast-offload")
    out = generate(model, ids, mask, cache, 6)
    assert torch.equal(out.sequences, ref.sequences)
    assert rel(torch.stack(out.logits, 1), torch.stack(ref.logits, 1)) < 1e-5
    assert all(torch.isfinite(step).all() for step in ref.logits)
