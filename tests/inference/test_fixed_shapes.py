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
    """(layer, name) -> (shape, address) of every tensor a cache layer holds."""
    out = {}
    for i, layer in enumerate(cache.layers):
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor):
                out[(i, name)] = (tuple(value.shape), value.data_ptr())
        host = getattr(layer, "host", None)
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


@pytest.mark.parametrize("policy", ["infllmv2", "nosa"])
@pytest.mark.parametrize("mode", FIXED_MODES + ["resident"])
def test_consecutive_decode_steps_run_identical_shapes(mode, policy):
    model = tiny_model({"policy": policy, "selector": "forecast", "lse": "coarse" if policy == "infllmv2" else "exact"}, seed=4)
    ids, mask = left_padded([29, 23])  # 10 steps: windows (stride 2) every other step, blocks of 8 complete
    cache = SparseCache(model.config) if mode == "resident" else OffloadedSparseCache.for_model(model, mode=mode)
    recorded, states = decode_steps(model, cache, ids, mask, steps=10)
    for step in range(1, len(recorded)):
        assert recorded[step] == recorded[0], f"{mode}: decode step {step + 1} runs other ops or shapes than step 1"
        assert states[step] == states[0], f"{mode}: a cache buffer changed shape or address at decode step {step + 1}"


def test_the_check_sees_a_growing_buffer():
    """Without a reservation past the prompt the resident cache grows mid-decode: the check fails."""
    model = tiny_model({"policy": "infllmv2", "selector": "query"}, seed=4)
    ids, mask = left_padded([29, 23])
    cache = SparseCache(model.config, max_length=None)
    cache.reserve(ids.shape[1])  # room for the prompt only: decode regrows in chunks
    with torch.no_grad():
        token = model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)
        before = buffers(cache)[(1, "keys")]
        mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
        model(input_ids=token, attention_mask=mask, **{CACHE_KWARG: cache})
    assert buffers(cache)[(1, "keys")] != before


@pytest.mark.parametrize("make", [lambda m: None, lambda m: SparseCache(m.config), lambda m: OffloadedSparseCache.for_model(m, mode="forecast-offload")],
                         ids=["default", "sparse-cache", "offloaded"])
def test_generate_reserves_its_length(make):
    """generate() reserves prompt + max_new_tokens rows in the cache it uses (its own or the
    caller's), so nothing grows while it decodes: the buffers hold exactly that many rows."""
    model = tiny_model({"policy": "infllmv2", "selector": "forecast"}, seed=4)
    ids, mask = left_padded([29, 23])
    cache = make(model)
    kwargs = {} if cache is None else {CACHE_KWARG: cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=0, return_dict_in_generate=True, **kwargs)
    cache = out.past_key_values if cache is None else cache
    assert all(layer.capacity_rows() == ids.shape[1] + 9 for layer in cache.layers)


def test_gather_programs_default_and_override():
    from forecastkv.inference.offloaded import gather_programs_for

    assert gather_programs_for("cpu", 4) == 16 and gather_programs_for("cpu", 17) == 32
    model = tiny_model({"policy": "infllmv2", "selector": "forecast"}, seed=4)
    ids, mask = left_padded([29, 23])
    cache = OffloadedSparseCache.for_model(model, mode="forecast-offload", gather_programs=3)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: cache})
    assert {layer.gather_programs for layer in cache.layers if layer.offloaded} == {3}
    with pytest.raises(ValueError, match=r"gather_programs must be a positive integer or None .* got 0"):
        OffloadedSparseCache.for_model(model, gather_programs=0)


@pytest.mark.parametrize("mode", ["forecast-offload", "sparse-offload", "resident"])
def test_a_decode_step_traces_as_one_graph(mode):
    """torch.compile(fullgraph=True) traces a whole decode step, offloaded runtime included, without
    a graph break (backend "eager": the trace is what is checked), and gives the eager logits.
    Kernels as their references (the CPU path; the interpreter cannot be traced).  Later steps
    still recompile on the Python-side step logs and host counters."""
    from forecastkv import kernels

    torch._dynamo.reset()
    model = tiny_model({"policy": "nosa", "selector": "forecast"}, seed=4)
    ids, mask = left_padded([29])
    logits = []
    for compiled in (False, True):
        cache = SparseCache(model.config) if mode == "resident" else OffloadedSparseCache.for_model(model, mode=mode)
        cache.reserve(40)
        with torch.no_grad(), kernels.use_backend("reference"):
            token = model(input_ids=ids, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)
            forward = torch.compile(model, fullgraph=True, backend="eager") if compiled else model
            logits.append(forward(input_ids=token, **{CACHE_KWARG: cache}).logits)
    assert torch.equal(logits[0], logits[1])
