"""reset, crop and fork keep every selector's window indexes (Quest's block bounds, the compressed
and coarse keys, NOSA's pooled CIS): after each, a cache decodes exactly as a fresh resident one fed the
same tokens, for the resident cache and the offloaded runtime in the mode the selector runs in.
(`SparseCacheLayer.reset` once rebuilt itself without the bounds, so a resident Quest cache failed its
first step after a reset.)"""

import pytest
import torch

from forecastkv.inference import OffloadedSparseCache
from forecastkv.modeling.cache import SparseCache
from forecastkv.modeling.modeling import CACHE_KWARG
from forecastkv.modes import SELECTORS
from forecastkv.selectors import get_selector
from tests.helpers import tiny_model

PROMPT, STEPS = 44, 3  # five blocks of 8 and a partial one: every selector has a choice


def model_for(selector: str, policy: str = "infllmv2"):
    return tiny_model({"selector": selector, "policy": policy})


def tokens(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def decode_logits(model, cache, prompt: torch.Tensor, steps: torch.Tensor, unpin: bool = False) -> list[torch.Tensor]:
    """Prefill `prompt` [1, T] into `cache`, then feed `steps` [1, S] one token at a time: the logits of each call.
    unpin: drop what the prompt pinned (`modeling/pins.py`) before the steps, as a crop does."""
    with torch.no_grad():
        out = [model(prompt, **{CACHE_KWARG: cache}).logits[:, -1]]
        for layer in cache.layers if unpin else ():
            layer.pinned = None
        for i in range(steps.shape[1]):
            out.append(model(steps[:, i : i + 1], **{CACHE_KWARG: cache}).logits[:, -1])
    return out


def fresh(model, prompt, steps, unpin: bool = False):
    return decode_logits(model, SparseCache(model.config), prompt, steps, unpin)


SELECTOR_CASES = [(selector, "infllmv2") for selector in SELECTORS] + [("query", "nosa"), ("quest", "nosa")]
# the resident cache for every case, the offloaded runtime for every selector it can run
CASES = [(*case, "resident") for case in SELECTOR_CASES] + [
    (*case, "offloaded") for case in SELECTOR_CASES if get_selector(case[0]).deployable
]


def make_cache(model, kind: str):
    """A resident cache, or the offloaded runtime in the mode the model's selector runs in."""
    if kind == "resident":
        return SparseCache(model.config)
    rule = get_selector(model.config.sparse.selector)
    return OffloadedSparseCache.for_model(model, mode="forecast-offload" if rule.plans_ahead else "sparse-offload")


@pytest.mark.parametrize(("selector", "policy", "kind"), CASES)
def test_reset_then_reuse_equals_a_fresh_cache(selector, policy, kind):
    model = model_for(selector, policy)
    cache = make_cache(model, kind)
    decode_logits(model, cache, tokens(1, PROMPT + 8), tokens(2, STEPS))  # another text first
    cache.reset()
    again = decode_logits(model, cache, tokens(3, PROMPT), tokens(4, STEPS))
    for got, want in zip(again, fresh(model, tokens(3, PROMPT), tokens(4, STEPS))):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(("selector", "policy", "kind"), CASES)
def test_crop_then_decode_equals_the_shorter_run(selector, policy, kind):
    model = model_for(selector, policy)
    cache = make_cache(model, kind)
    prompt, extra, steps = tokens(5, PROMPT), tokens(6, 6), tokens(7, STEPS)
    decode_logits(model, cache, torch.cat([prompt, extra], dim=1), steps[:, :0])
    cache.crop(PROMPT)  # keep the prompt's columns, drop the 6 guessed ones
    with torch.no_grad():
        after = [model(steps[:, i : i + 1], **{CACHE_KWARG: cache}).logits[:, -1] for i in range(STEPS)]
    # a pinning selector's pins came from the rows cropped: the crop drops them, and the next multi-token call
    # pins anew (`modeling/pins.py`); until then it decodes as the shorter run with nothing pinned
    unpin = get_selector(selector).pins > 0
    for got, want in zip(after, fresh(model, prompt, steps, unpin)[1:]):
        # the prompt was prefilled in another chunking (50 columns, not 44): float rounding differs
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("selector", "policy", "kind"), CASES)
def test_a_fork_decodes_as_the_original_and_leaves_it_alone(selector, policy, kind):
    model = model_for(selector, policy)
    cache = make_cache(model, kind)
    prompt, steps, other = tokens(8, PROMPT), tokens(9, STEPS), tokens(10, STEPS)
    decode_logits(model, cache, prompt, steps[:, :0])
    forked = cache.fork()
    with torch.no_grad():
        for i in range(STEPS):  # the fork reads other tokens: the original must not see them
            model(other[:, i : i + 1], **{CACHE_KWARG: forked})
        on_original = [model(steps[:, i : i + 1], **{CACHE_KWARG: cache}).logits[:, -1] for i in range(STEPS)]
    for got, want in zip(on_original, fresh(model, prompt, steps)[1:]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["no-offload", "sparse-offload"])
def test_a_recording_cache_records_after_a_reset(mode):
    """reset empties the store's step log but keeps it recording, in every store: the runtime's resident
    layers once came back from a reset with recording off (their plans then went unrecorded)."""
    model = model_for("query")
    cache = OffloadedSparseCache.for_model(model, mode=mode, record_selections=True)
    decode_logits(model, cache, tokens(11, PROMPT), tokens(12, STEPS))
    cache.reset()
    assert all(layer.store.log.selections == [] for layer in cache.layers)
    decode_logits(model, cache, tokens(13, PROMPT), tokens(14, STEPS))
    assert all(len(layer.store.log.selections) == STEPS for layer in cache.layers)
