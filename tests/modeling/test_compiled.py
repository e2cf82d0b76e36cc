"""`compile_decode`: plain generate() with the decode steps' layers compiled gives the eager tokens,
compiles one graph for all decode steps (no recompile across window and block completions), and
leaves prefill and growing-shape steps eager."""

from __future__ import annotations

import pytest
import torch

from forecastkv import SparseCache, kernels
from forecastkv.inference import OffloadedSparseCache
from forecastkv.modeling.compiled import compile_decode, uncompile_decode
from forecastkv.modeling.modeling import CACHE_KWARG
from tests.helpers import left_padded, tiny_model


class CountingBackend:
    """A torch.compile backend that counts the graphs it is given and runs them eagerly."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module.forward


def generate(model, ids, mask, cache, new_tokens=14):
    with torch.no_grad(), kernels.use_backend("reference"):
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            **{CACHE_KWARG: cache},
        )
    return out.sequences


@pytest.mark.parametrize("mode", ["resident", "forecast-offload"])
def test_generate_with_compiled_decode_matches_eager(mode):
    model = tiny_model({"policy": "infllmv2", "selector": "forecast"}, seed=4)
    ids, mask = left_padded([29, 23])
    make = (
        (lambda: SparseCache(model.config))
        if mode == "resident"
        else (lambda: OffloadedSparseCache.for_model(model, mode=mode))
    )
    eager = generate(model, ids, mask, make())
    backend = CountingBackend()
    torch._dynamo.reset()
    compile_decode(model, backend=backend)
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled = generate(model, ids, mask, make())
    finally:
        uncompile_decode(model)
        torch._dynamo.reset()
    assert torch.equal(eager, compiled)
    assert backend.graphs == 1  # 13 decode steps, one graph; the prefill ran eagerly
    assert "decode_layers" not in vars(model.model)  # uncompiled: the method again


def test_dense_offload_and_dense_rows_stay_eager():
    """dense-offload's whole-layer copy grows every step: compiling it would recompile per step."""
    model = tiny_model({"policy": "infllmv2", "selector": "query"}, seed=4)
    ids, mask = left_padded([29, 23])
    backend = CountingBackend()
    torch._dynamo.reset()
    compile_decode(model, backend=backend)
    try:
        generate(model, ids, mask, OffloadedSparseCache.for_model(model, mode="dense-offload"))
    finally:
        uncompile_decode(model)
        torch._dynamo.reset()
    assert backend.graphs == 0


def test_compile_decode_rejects_what_it_cannot_do():
    model = tiny_model({"policy": "infllmv2"})
    with pytest.raises(ValueError, match="fullgraph=False"):
        compile_decode(model, fullgraph=False)
    with pytest.raises(TypeError, match="needs a forecastkv model"):
        compile_decode(torch.nn.Linear(2, 2))
