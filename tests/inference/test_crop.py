"""crop(): assisted decoding (a dense draft model) and prompt-lookup decoding return exactly the
plain greedy tokens with SparseCache and OffloadedSparseCache."""

from __future__ import annotations

import pytest
import torch

from forecastkv import SparseCache
from forecastkv.inference import OffloadedSparseCache
from forecastkv.modeling.cache import SparseCacheLayer
from forecastkv.modeling.modeling import CACHE_KWARG
from tests.helpers import rel, tiny_model

CACHES = {
    "sparse-cache": lambda model: SparseCache(model.config),
    "forecast-offload": lambda model: OffloadedSparseCache.for_model(model, mode="forecast-offload"),
    "dense-offload": lambda model: OffloadedSparseCache.for_model(
        model, mode="dense-offload", first_layer_resident=False
    ),
}


@pytest.fixture(scope="module")
def setup():
    model = tiny_model({"policy": "nosa", "selector": "forecast"}, seed=11)
    draft = tiny_model(None, seed=12)  # dense, its own SparseCache (cropped too)
    base = torch.randint(3, 128, (12,), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([base, base, base, base[:7]])[None]  # repeats, so prompt lookup proposes real candidates
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=14, do_sample=False)
    return model, draft, ids, greedy


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("method", ["assisted", "prompt-lookup"])
def test_speculative_decoding_gives_greedy_tokens(setup, cache, method, monkeypatch):
    model, draft, ids, greedy = setup
    dropped = []
    crop = SparseCacheLayer.crop

    def counting_crop(layer, tokens):
        before = layer.columns
        crop(layer, tokens)
        dropped.append(before - layer.columns)

    monkeypatch.setattr(SparseCacheLayer, "crop", counting_crop)
    extra = {"assistant_model": draft} if method == "assisted" else {"prompt_lookup_num_tokens": 3}
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=14, do_sample=False, **extra, **{CACHE_KWARG: CACHES[cache](model)})
    assert torch.equal(out, greedy)
    assert sum(dropped) > 0  # rejected candidates were really cropped away


def test_crop_forms():
    """Negative = drop that many columns (transformers 5.24), positive = keep that many (legacy), 0 = nothing."""
    model = tiny_model({"policy": "infllmv2", "selector": "forecast"}, seed=2)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    for make in CACHES.values():
        cache = make(model)
        with torch.no_grad():
            model(ids, **{CACHE_KWARG: cache})
        cache.crop(0)
        assert cache.get_seq_length() == 30 and cache.sequence_lengths().tolist() == [30]
        cache.crop(-4)
        assert cache.get_seq_length() == 26 and all(layer.lengths.tolist() == [26] for layer in cache.layers)
        cache.crop(20)
        assert cache.get_seq_length() == 20 and cache.sequence_lengths().tolist() == [20]
        # after cropping, a step equals a fresh run over the kept prefix
        fresh = make(model)
        step = torch.tensor([[7]])
        with torch.no_grad():
            a = model(step, **{CACHE_KWARG: cache}).logits
            model(ids[:, :20], **{CACHE_KWARG: fresh})
            b = model(step, **{CACHE_KWARG: fresh}).logits
        assert rel(a, b) < 1e-5
