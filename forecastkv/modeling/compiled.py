"""`compile_decode(model)`: decode steps run the decoder layers compiled, once, for plain `generate()`.

A decode step's device part (`ForecastKVModel.decode_layers`) reads no Python number that changes
from step to step once the cache has reserved its length (generate() does), so
`torch.compile(fullgraph=True)` takes it whole and every later step replays the same graph: on
the CPU an inductor kernel per fused region, on CUDA with `mode="reduce-overhead"` a CUDA graph.
Everything else stays eager: the host side of each call (`SparseCache.begin_call` / `finish_call`),
multi-token calls (prefill, draft verification: their shapes change call to call) and decode steps
whose shapes grow by design (a dense row below `dense_len`, `dense-offload`'s whole-layer copy):
the cache says which calls the graph covers (`SparseCache.compiles_decode`).
"""

from __future__ import annotations

import torch

EAGER_ATTRIBUTE = "_eager_decode_layers"


def compile_decode(model, **compile_options):
    """Compile `model`'s decode steps (a ForecastKVForCausalLM or its ForecastKVModel), in place.

    compile_options go to `torch.compile` (fullgraph=True is fixed: a graph break would mean a host
    read in the step); e.g. `mode="reduce-overhead"` on CUDA, `backend="eager"` to check the trace
    only.  Returns the model.  `uncompile_decode(model)` undoes it.  Calling it twice recompiles
    with the new options.
    """
    inner = getattr(model, "model", model)
    if not hasattr(inner, "decode_layers"):
        raise TypeError(f"compile_decode needs a forecastkv model, got {type(model).__name__}")
    if "fullgraph" in compile_options and not compile_options["fullgraph"]:
        raise ValueError("compile_decode compiles the decode step whole: fullgraph=False is not supported")
    uncompile_decode(model)
    eager = inner.decode_layers
    compiled = torch.compile(eager, **{**compile_options, "fullgraph": True})

    def decode_layers(hidden, call, cache, collect_selections=False):
        run = compiled if cache.compiles_decode(call.step) and call.layer_callback is None else eager
        return run(hidden, call, cache, collect_selections)

    setattr(inner, EAGER_ATTRIBUTE, eager)
    inner.decode_layers = decode_layers  # the instance attribute shadows the method
    return model


def uncompile_decode(model):
    """Back to eager decode steps (a no-op if `compile_decode` was not applied)."""
    inner = getattr(model, "model", model)
    if hasattr(inner, EAGER_ATTRIBUTE):
        del inner.decode_layers
        delattr(inner, EAGER_ATTRIBUTE)
    return model
