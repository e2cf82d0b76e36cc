"""Forecast-offload over pages (`serving/page_offload.py`): the toy engine of test_paged.py with a host
tier that loads only each decode step's missed blocks, and poisons (NaN) the pool rows of every
complete block a request's slot map does not hold.  Logits still equal the resident cache's (so
attention read only blocks it loaded), H2D bytes per decode step and the blocks wanted and hit equal
the HF runtime's (`OffloadedSparseCache`, the same prompt: what the connector reports to vLLM), and
under the Forecast selector every offloaded layer's blocks are requested before the layer before it
attends."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from forecastkv.serving.page_offload import PageOffload
from tests.helpers import offloaded_counts, tiny_model
from tests.serving.test_paged import ToyEngine, prompts_of, reference_logits
from tests.strict_device import count_host_reads

MODES = {
    "infllmv2-forecast": ({"selector": "forecast"}, "forecast-offload"),
    "infllmv2-query": ({"selector": "query"}, "sparse-offload"),
    "nosa-forecast": ({"policy": "nosa", "selector": "forecast"}, "forecast-offload"),
}


def tiered_engine(model, evict: bool, page: int = 4) -> ToyEngine:
    engine = ToyEngine(model, page, pages=96)
    sparse = model.config.sparse
    ring = max(size for size, _ in engine.layers[0].strides.values())
    engine.tier = PageOffload(engine.layers, sparse.budget_blocks, sparse.block_size, ring, evict=evict)
    return engine


def decode_alone(engine, prompt: list[int], steps: int, chunk: int = 5):
    """Prefill `prompt` in chunks, then `steps` greedy decode calls; logits of every row and the tokens."""
    rows, done = [], 0
    while done < len(prompt):
        rows.append(engine.step({0: prompt[done : done + chunk]})[0])
        done += chunk
    tokens = [int(rows[-1][-1].argmax())]
    for _ in range(steps):
        rows.append(engine.step({0: [tokens[-1]]})[0])
        tokens.append(int(rows[-1][-1].argmax()))
    return torch.cat(rows), tokens


def hf_runtime_bytes(model, mode: str, prompt: list[int], tokens: list[int]) -> list[int]:
    """H2D bytes per decode step of the HF runtime for the same prompt and tokens."""
    return offloaded_counts(model, mode, prompt, tokens)[0]["per_step"]


@pytest.mark.parametrize("mode", list(MODES))
def test_loaded_blocks_are_enough_and_bytes_match_the_hf_runtime(mode):
    changes, runtime_mode = MODES[mode]
    model = tiny_model(changes)
    prompt = prompts_of([45])[0]
    engine = tiered_engine(model, evict=True)
    logits, tokens = decode_alone(engine, prompt, steps=8)
    expected = reference_logits(model, prompt, tokens[:-1])
    assert torch.isfinite(logits).all(), "attention read a pool row the tier did not load"
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    stats = engine.tier.stats
    counts = {"per_step": stats.per_step, "wanted": sum(stats.wanted), "hits": sum(stats.hits)}
    assert counts == offloaded_counts(model, runtime_mode, prompt, tokens)[0], mode
    assert sum(stats.per_step) > 0 and 0 < counts["hits"] < counts["wanted"]
    assert len(stats.wanted) == len(stats.hits) == len(stats.per_step)  # one record per decode call
    stats.clear()  # what the vLLM connector does once it has handed the counts over
    assert stats.per_step == stats.wanted == stats.hits == stats.events == []


@pytest.mark.parametrize("mode", ["infllmv2-forecast", "infllmv2-query"])
def test_a_tiered_decode_call_reads_nothing_back_to_the_host(mode):
    """With the host tier, a decode call of a batch (prompts of 7 to 41 tokens, pages of 4, rows moving
    to a new page on different steps) files its slot maps, plans its loads against them, loads, writes
    through and counts its bytes without one host read: the maps live on the device and the counts stay
    there until read, once, after the calls.  Those counts then equal the same run's without the
    counter (the read-back is not lost)."""
    model = tiny_model(MODES[mode][0])
    prompts = prompts_of([7, 19, 41])
    per_step = []
    for counted in (True, False):
        with count_host_reads() if counted else nullcontext():  # the pools and the tier made inside: "device"
            engine = tiered_engine(model, evict=False)
            out = engine.step(dict(enumerate(prompts)))
            for _ in range(6):
                tokens = {r: [int(rows[-1].argmax())] for r, rows in out.items()}
                with count_host_reads() if counted else nullcontext() as step:
                    out = engine.step(tokens)
                assert not counted or step.reads == 0, step.report()
        per_step.append(engine.tier.stats.per_step)
    assert len(per_step[0]) == 6 and sum(per_step[0]) > 0
    assert per_step[0] == per_step[1]


def test_forecast_requests_each_layer_before_the_layer_before_it_attends():
    model = tiny_model({"selector": "forecast"})
    engine = tiered_engine(model, evict=False)
    decode_alone(engine, prompts_of([30])[0], steps=4)
    events = engine.tier.stats.events
    layers = model.config.num_hidden_layers
    for step in range(1, 5):
        order = [(kind, layer) for s, kind, layer in events if s == step]
        for layer in range(1, layers):
            assert order.index(("request", layer)) < order.index(("wait", layer - 1)), (step, order)


def test_the_query_selector_requests_at_the_layer_itself():
    model = tiny_model({"selector": "query"})
    engine = tiered_engine(model, evict=False)
    decode_alone(engine, prompts_of([30])[0], steps=2)
    order = [(kind, layer) for s, kind, layer in engine.tier.stats.events if s == 2]
    for layer in range(1, model.config.num_hidden_layers):
        assert order.index(("wait", layer - 1)) < order.index(("request", layer)) < order.index(("wait", layer))


def test_a_request_on_freed_pages_starts_with_empty_slot_maps():
    """Request 0 decodes and finishes; request 1 gets its pages back: its bytes per step are those of a
    fresh HF runtime run, not counted against request 0's slot maps (which a page reuse could pick up)."""
    model = tiny_model({"selector": "forecast"})
    engine = tiered_engine(model, evict=True, page=8)
    engine.free = engine.free[:12]  # few pages: request 1 must reuse request 0's
    first, second = prompts_of([40, 44], seed=8)  # both last tokens on the same page (index 5)
    decode_alone(engine, first, steps=5)
    engine.free.extend(reversed(engine.tables.pop(0)))
    engine.stored.pop(0)
    start = len(engine.tier.stats.per_step)
    rows, done = [], 0
    while done < len(second):
        rows.append(engine.step({1: second[done : done + 5]})[1])
        done += 5
    tokens = [int(rows[-1][-1].argmax())]
    for _ in range(5):
        rows.append(engine.step({1: [tokens[-1]]})[1])
        tokens.append(int(rows[-1][-1].argmax()))
    torch.testing.assert_close(torch.cat(rows), reference_logits(model, second, tokens[:-1]), rtol=1e-4, atol=1e-4)
    assert engine.tier.stats.per_step[start:] == hf_runtime_bytes(model, "forecast-offload", second, tokens)


def test_generate_and_the_pages_run_one_offload_runtime(monkeypatch):
    """One host tier and one transfer path: `generate()`'s offloaded layers and the page runtime hold the
    same worker type over the same pool type, and every row they store and every block they load goes
    through `TransferWorker.store_rows` and `TransferWorker.gather` (counted per path)."""
    from forecastkv.inference import HostBlockPool, TransferWorker

    calls = {"store_rows": [], "gather": []}
    for name in calls:
        original = getattr(TransferWorker, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            calls[_name].append(self)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(TransferWorker, name, spy)
    model = tiny_model({"selector": "forecast"})
    prompt = prompts_of([45])[0]
    engine = tiered_engine(model, evict=True)
    decode_alone(engine, prompt, steps=4)
    paged = set(map(id, calls["store_rows"] + calls["gather"]))
    _, cache = offloaded_counts(model, "forecast-offload", prompt, [0] * 4)
    offloaded = [layer for layer in cache.layers if layer.offloaded]
    assert {type(engine.tier.worker)} == {type(layer.store.worker) for layer in offloaded} == {TransferWorker}
    assert {type(pool) for pool in engine.tier.host if pool is not None} == {HostBlockPool}
    assert {type(layer.store.host.pool) for layer in offloaded} == {HostBlockPool}
    ours = {id(engine.tier.worker)}
    theirs = {id(layer.store.worker) for layer in offloaded}
    assert paged == ours, "the page runtime moved rows outside its worker"
    for name, seen in calls.items():
        assert ours & set(map(id, seen)) and theirs & set(map(id, seen)), f"{name}: both paths must go through it"


def test_one_host_tier_and_one_transfer_path_in_the_package():
    """What the runtime's split promises, read from the source: the transfer kernels are called only by
    the worker, and host buffers are allocated only by the host store."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "forecastkv"
    launches, allocations = [], []
    for path in root.rglob("*.py"):
        name = str(path.relative_to(root))
        text = path.read_text()
        if not name.startswith("kernels/") and any(k in text for k in (".block_gather(", ".row_store(", "pin_memory")):
            launches.append(name)
        if "allocate_host(" in text or "cudaHostRegister" in text:
            allocations.append(name)
    assert launches == ["inference/worker.py"]
    assert allocations == ["inference/host_store.py"]


@pytest.mark.cuda
def test_on_cuda_the_loads_run_on_the_side_stream_through_the_uva_gather(monkeypatch):
    """On CUDA the page runtime is the mission's: pinned host pools, the Triton row store and block
    gather, each load on the worker's side stream with an event the layer's wait joins; logits equal
    the resident cache's (on the CPU) with unloaded blocks poisoned, bytes equal the HF runtime's."""
    from forecastkv.inference import TransferWorker

    cpu_model = tiny_model({"selector": "forecast"})
    model = tiny_model({"selector": "forecast"}).cuda()
    engine = tiered_engine(model, evict=True)
    worker = engine.tier.worker
    assert worker.stream is not None and worker.ops.triton
    assert all(t.is_pinned() for pool in engine.tier.host if pool is not None for t in pool.tensors())
    seen = []
    original = TransferWorker.gather

    def spy(self, *args, **kwargs):
        seen.append(torch.cuda.current_stream(self.device) == self.stream)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TransferWorker, "gather", spy)
    prompt = prompts_of([45])[0]
    logits, tokens = decode_alone(engine, prompt, steps=8)
    torch.cuda.synchronize()
    assert seen and all(seen), "a load ran off the side stream"
    torch.testing.assert_close(logits.cpu(), reference_logits(cpu_model, prompt, tokens[:-1]), rtol=1e-4, atol=1e-4)
    assert engine.tier.stats.per_step == hf_runtime_bytes(cpu_model, "forecast-offload", prompt, tokens)
