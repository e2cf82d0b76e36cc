"""The offload modes as a `cache_implementation` (modeling/generation.py): a plain `generate()`
call, a model whose generation_config names a mode, a generation_config.json and a transformers
`pipeline` get the offloaded runtime without a cache built by hand, with the resident tokens."""

import json

import pytest
import torch

from forecastkv.inference import OffloadedSparseCache
from forecastkv.modeling.cache import SparseCache
from forecastkv.modeling.generation import GENERATION_KEY, load_generation_config, set_default_cache
from forecastkv.modeling.modeling import CACHE_KWARG
from tests.helpers import tiny_model


@pytest.fixture
def built(monkeypatch):
    """Every OffloadedSparseCache that `for_model` builds in the test, in order."""
    caches = []
    original = OffloadedSparseCache.for_model.__func__

    def spy(cls, *args, **kwargs):
        caches.append(original(cls, *args, **kwargs))
        return caches[-1]

    monkeypatch.setattr(OffloadedSparseCache, "for_model", classmethod(spy))
    return caches


def _ids(length=90, seed=3):
    return torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("mode", ["sparse-offload", "forecast-offload", "dense-offload"])
def test_cache_implementation_in_the_call_builds_the_offloaded_cache(built, mode):
    model = tiny_model({"selector": "forecast"})
    ids = _ids()
    selector = {"sparse-offload": "query"}.get(mode)
    reference = _generate(model, ids, **{CACHE_KWARG: SparseCache(model.config, selector=selector)})
    out = _generate(model, ids, cache_implementation=mode)
    assert [cache.mode for cache in built] == [mode]
    assert torch.equal(out, reference)
    stats = built[0].stats()
    assert stats["decode_steps"] == 7 and built[0].host_nbytes() > 0
    if mode != "dense-offload":  # only the selected blocks move: never more than the budget per layer and step
        budget = model.config.sparse.budget_blocks * model.config.num_key_value_heads * 7
        assert all(fetched <= budget for fetched in stats["blocks_fetched_per_layer"])
        assert sum(stats["blocks_fetched_per_layer"][1:]) > 0
    assert model.generation_config.cache_implementation is None


def test_model_generation_config_names_the_mode(built):
    model = tiny_model({"selector": "forecast"})
    ids = _ids()
    reference = _generate(model, ids)
    model.generation_config.cache_implementation = "forecast-offload"
    assert torch.equal(_generate(model, ids), reference)
    assert [cache.mode for cache in built] == ["forecast-offload"]
    assert model.generation_config.cache_implementation == "forecast-offload"  # left as the user set it
    # the call wins over the model's setting: a transformers name means no offload
    assert torch.equal(_generate(model, ids, cache_implementation="dynamic"), reference) and len(built) == 1
    # a cache passed by hand wins over both
    assert torch.equal(_generate(model, ids, **{CACHE_KWARG: SparseCache(model.config)}), reference) and len(built) == 1


def test_generation_config_json_round_trip(tmp_path, built):
    from transformers import GenerationConfig

    model = tiny_model({"selector": "forecast"})
    set_default_cache(model, "forecast-offload")
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved[GENERATION_KEY] == "forecast-offload" and saved.get("cache_implementation") is None
    # plain transformers keeps it
    assert getattr(GenerationConfig.from_pretrained(tmp_path), GENERATION_KEY) == "forecast-offload"

    loaded = type(model).from_pretrained(tmp_path)  # reads the saved mode itself
    _generate(loaded, _ids())
    assert [cache.mode for cache in built] == ["forecast-offload"]

    # transformers refuses a cache_implementation it does not know, in a JSON file and on save:
    # the reason the switch is stored under its own key
    saved["cache_implementation"] = saved.pop(GENERATION_KEY)
    (tmp_path / "generation_config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="cache_implementation"):
        GenerationConfig.from_pretrained(tmp_path)
    assert getattr(load_generation_config(tmp_path), GENERATION_KEY) == "forecast-offload"
    model.generation_config.cache_implementation = "forecast-offload"
    with pytest.raises(ValueError, match="cache_implementation"):
        model.generation_config.save_pretrained(tmp_path / "refused")


def test_unknown_mode_is_refused():
    model = tiny_model({"selector": "forecast"})
    with pytest.raises(ValueError, match="forecast-offload"):
        set_default_cache(model, "forecast-ofload")
    with pytest.raises(ValueError, match="cache_implementation"):  # transformers' own message
        _generate(model, _ids(), cache_implementation="forecast-ofload")


@pytest.mark.slow  # a 1K-token prompt through a pipeline, about a minute on 2 shared cores
@pytest.mark.bundled
def test_pipeline_on_a_converted_checkpoint_moves_only_selected_blocks(bundled_path, tmp_path, built):
    from transformers import pipeline

    from forecastkv import ForecastKVForCausalLM, bundled_texts
    from forecastkv.modeling.remote_code import copy_tokenizer_files

    sparse = {
        "kernel_size": 32,
        "kernel_stride": 16,
        "block_size": 64,
        "init_blocks": 1,
        "window_size": 128,
        "topk": 4,
        "dense_len": 0,
        "selector": "forecast",
    }
    model = ForecastKVForCausalLM.from_pretrained(bundled_path, sparse_config=sparse, forecast={"init": "next_query"})
    model.save_pretrained(tmp_path)
    copy_tokenizer_files(bundled_path, tmp_path)
    prompt = bundled_texts("heldout")[0][:3000]  # ~700 tokens: 11 blocks, a 7-block budget

    pipe = pipeline("text-generation", model=str(tmp_path), cache_implementation="forecast-offload")
    text = pipe(prompt, max_new_tokens=8, do_sample=False, return_full_text=False)[0]["generated_text"]
    assert [cache.mode for cache in built] == ["forecast-offload"]
    cache = built[0]
    stats = cache.stats()
    kv_heads = model.config.num_key_value_heads
    prompt_tokens = pipe.tokenizer(prompt, return_tensors="pt").input_ids.shape[1]
    blocks = -(-(prompt_tokens + 8) // 64)
    budget = model.config.sparse.budget_blocks
    assert budget < blocks
    print(
        f"pipeline, forecast-offload: {prompt_tokens}-token prompt, {stats['decode_steps']} decode steps, "
        f"H2D per step {stats['h2d_bytes_per_step']}, hit rate {stats['hit_rate']:.3f}, "
        f"blocks wanted / fetched per layer {stats['blocks_wanted_per_layer'][:4]} / "
        f"{stats['blocks_fetched_per_layer'][:4]}, "
        f"device {cache.device_nbytes()} B, host {cache.host_nbytes()} B"
    )
    assert stats["decode_steps"] == 7
    # only the selected blocks: every offloaded layer asks for at most its budget per KV head and
    # step, fetches only what its slots miss, and a step moves far less than the layers' KV
    for wanted, fetched in zip(stats["blocks_wanted_per_layer"][1:], stats["blocks_fetched_per_layer"][1:]):
        assert 0 < wanted <= budget * kv_heads * 7 and fetched <= wanted
    assert stats["hit_rate"] > 0.5
    assert max(stats["h2d_bytes_per_step"][1:]) < 0.1 * cache.host_nbytes()

    resident = pipeline("text-generation", model=str(tmp_path))
    assert (
        resident(prompt, max_new_tokens=8, do_sample=False, return_full_text=False)[0]["generated_text"] == text
        and len(built) == 1
    )
