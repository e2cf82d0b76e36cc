"""Fixed shapes in the decode step: once generate() has reserved its length, consecutive decode
steps run the same aten ops on tensors of the same shapes (across compression-window and block
completions), and no cache buffer changes shape or address, in every offload mode but
dense-offload (whose whole-layer copy grows with the context by design).  What a captured CUDA
graph, or a compiled step without recompiles, needs."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from forecastkv import SparseCache
from forecastkv.inference import OffloadedSparseCache
from forecastkv.inference.offloaded import MODES
from forecastkv.modeling.modeling import CACHE_KWARG
from tests.helpers import left_padded, tiny_model

FIXED_MODES = [mode for mode in MODES if mode != "dense-offload"]


class OpShapes(TorchDispatchMode):
    """Records (op, shapes and dtypes of every tensor argument) of each aten call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = tree_leaves((args, kwargs or {}))
        self.calls.append((str(func), tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def buffers(cache) -> dict:
    """(layer, name) -> (shape, address) of every tensor a cache layer holds: its own, its store's, its
    window indexes' and its host store's."""
    out = {}
    for i, layer in enumerate(cache.layers):
        for prefix, part in (("", layer), ("store.", layer.store)):
            for name, value in vars(part).items():
                if isinstance(value, torch.Tensor):
                    out[(i, prefix + name)] = (tuple(value.shape), value.data_ptr())
        for window in layer.windows:
            if window.buffer is not None:
                out[(i, "window." + window.name)] = (tuple(window.buffer.shape), window.buffer.data_ptr())
        host = getattr(layer.store, "host", None)
        if host is not None:
            for name in ("keys", "values", "cis"):
                tensor = getattr(host, name)
                if tensor is not None:
                    out[(i, "host." + name)] = (tuple(tensor.shape), tensor.data_ptr())
    return out


def decode_steps(model, cache, ids, mask, steps: int):
    """Prefill, reserve as generate() does, then `steps` one-token steps, each recorded."""
    cache.reserve(ids.shape[1] + steps + 1)
    recorded, states = [], []
    with torch.no_grad():
        token = model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            with OpShapes() as ops:
                token = model(input_ids=token, attention_mask=mask, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)
            recorded.append(ops.calls)
            states.append({key: value for key, value in buffers(cache).items() if key[1] not in ("planned", "staged")})
    return recorded, states


def assert_identical_steps(model, cache, label: str) -> None:
    ids, mask = left_padded([29, 23])  # 10 steps: windows (stride 2) every other step, blocks of 8 complete
    recorded, states = decode_steps(model, cache, ids, mask, steps=10)
    for step in range(1, len(recorded)):
        assert recorded[step] == recorded[0], f"{label}: decode step {step + 1} runs other ops or shapes than step 1"
        assert states[step] == states[0], f"{label}: a cache buffer changed shape or address at decode step {step + 1}"


# (policy, top_p): a top-p budget is infllmv2's (a NOSA config with one is refused: test_selector_rules.py)
BUDGETS = [("infllmv2", 0.0), ("nosa", 0.0), ("infllmv2", 0.7)]


@pytest.mark.parametrize(("policy", "top_p"), BUDGETS)
@pytest.mark.parametrize("mode", FIXED_MODES + ["resident"])
def test_consecutive_decode_steps_run_identical_shapes(mode, policy, top_p):
    """Also with a top-p budget: the blocks per step vary, the shapes (the cap) do not."""
    lse = "coarse" if policy == "infllmv2" else "exact"
    model = tiny_model({"policy": policy, "selector": "forecast", "lse": lse, "top_p": top_p}, seed=4)
    cache = SparseCache(model.config) if mode == "resident" else OffloadedSparseCache.for_model(model, mode=mode)
    assert_identical_steps(model, cache, mode)


@pytest.mark.parametrize(
    ("selector", "mode"),
    [("quest", "sparse-offload"), ("reuse", "forecast-offload"), ("speculate", "forecast-offload"),
     ("query-carry", "sparse-offload"), ("quest-forecast-carry", "forecast-offload"),
     ("forecast-carry-pin", "forecast-offload")],
)
def test_every_deployable_selector_runs_identical_shapes(selector, mode):
    """Quest's block bounds, reuse's handed-over blocks, speculate's guessed queries and the blocks carried
    from step to step keep the step fixed (the oracle reads every stored key, so its step grows with the
    context: a measurement, not deployable)."""
    model = tiny_model({"policy": "infllmv2", "selector": selector, "reuse_anchors": [0, 2]}, seed=4)
    assert_identical_steps(model, OffloadedSparseCache.for_model(model, mode=mode), f"{selector} in {mode}")


def test_the_check_sees_a_growing_buffer():
    """Without a reservation past the prompt the resident cache grows mid-decode: the check fails."""
    model = tiny_model({"policy": "infllmv2", "selector": "query"}, seed=4)
    ids, mask = left_padded([29, 23])
    cache = SparseCache(model.config, max_length=None)
    cache.reserve(ids.shape[1])  # room for the prompt only: decode regrows in chunks
    with torch.no_grad():
        token = model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)
        before = buffers(cache)[(1, "store.keys")]
        mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
        model(input_ids=token, attention_mask=mask, **{CACHE_KWARG: cache})
    assert buffers(cache)[(1, "store.keys")] != before


@pytest.mark.parametrize(
    "make",
    [
        lambda m: None,
        lambda m: SparseCache(m.config),
        lambda m: OffloadedSparseCache.for_model(m, mode="forecast-offload"),
    ],
    ids=["default", "sparse-cache", "offloaded"],
)
def test_generate_reserves_its_length(make):
    """generate() reserves prompt + max_new_tokens rows in the cache it uses (its own or the
    caller's), so nothing grows while it decodes: the buffers hold exactly that many rows."""
    model = tiny_model({"policy": "infllmv2", "selector": "forecast"}, seed=4)
    ids, mask = left_padded([29, 23])
    cache = make(model)
    kwargs = {} if cache is None else {CACHE_KWARG: cache}
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=9,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            **kwargs,
        )
    cache = out.past_key_values if cache is None else cache
    assert all(layer.capacity_rows() == ids.shape[1] + 9 for layer in cache.layers)


def test_gather_programs_default_and_override():
    from forecastkv.inference.worker import gather_programs_for

    assert gather_programs_for("cpu", 4) == 16 and gather_programs_for("cpu", 17) == 32
    model = tiny_model({"policy": "infllmv2", "selector": "forecast"}, seed=4)
    ids, mask = left_padded([29, 23])
    cache = OffloadedSparseCache.for_model(model, mode="forecast-offload", gather_programs=3)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: cache})
    assert {layer.store.gather_programs for layer in cache.layers if layer.offloaded} == {3}
    with pytest.raises(ValueError, match=r"gather_programs must be a positive integer or None .* got 0"):
        OffloadedSparseCache.for_model(model, gather_programs=0)


@pytest.mark.parametrize(
    ("mode", "policy", "selector"),
    [(mode, policy, "forecast") for policy in ("infllmv2", "nosa") for mode in FIXED_MODES + ["resident"]]
    + [("resident", "infllmv2", "quest-forecast-carry"), ("forecast-offload", "infllmv2", "forecast-carry"),
       ("resident", "infllmv2", "forecast-carry-pin")],
)
def test_decode_layers_compile_once_for_every_step(mode, policy, selector):
    """torch.compile(fullgraph=True) takes a decode step's layers whole (the offloaded runtime
    included: no graph break), and 12 consecutive steps across window and block completions run
    that one graph (error_on_recompile), with the eager path's tokens.  Backend "eager": the trace
    and its guards are what is checked; kernels as their references (the CPU path).  The carrying
    selectors too: what they carry is forced, observed and rolled without a break; and the pinned blocks."""
    from forecastkv import kernels

    model = tiny_model({"policy": policy, "selector": selector}, seed=4)
    ids, mask = left_padded([29, 23])
    tokens = []
    for compiled in (False, True):
        torch._dynamo.reset()
        cache = SparseCache(model.config) if mode == "resident" else OffloadedSparseCache.for_model(model, mode=mode)
        cache.reserve(ids.shape[1] + 13)
        original, steps, step_mask = model.model.decode_layers, [], mask
        with torch.no_grad(), kernels.use_backend("reference"), torch._dynamo.config.patch(error_on_recompile=True):
            token = model(input_ids=ids, attention_mask=step_mask, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)
            if compiled:
                model.model.decode_layers = torch.compile(original, fullgraph=True, backend="eager")
            try:
                for _ in range(12):
                    step_mask = torch.cat([step_mask, step_mask.new_ones(2, 1)], dim=1)
                    token = (
                        model(input_ids=token, attention_mask=step_mask, **{CACHE_KWARG: cache})
                        .logits[:, -1:]
                        .argmax(-1)
                    )
                    steps.append(token)
            finally:
                model.model.decode_layers = original
        tokens.append(torch.cat(steps, 1))
    assert torch.equal(tokens[0], tokens[1])
