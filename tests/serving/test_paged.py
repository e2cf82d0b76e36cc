"""The paged cache (what a serving engine stores) against the resident `SparseCache`.

A toy engine hands out pages from a shuffled free list (so no sequence's pages are contiguous),
prefills prompts in chunks that cut blocks and windows anywhere, then decodes all requests as one
batch.  Every logit must equal a per-request run of the model on a `SparseCache`, in every mode,
for prompts shorter than a window, a block and a page, and across page sizes that divide the
selection block (and an error for those that do not).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from forecastkv import kernels
from forecastkv.errors import ConfigError
from forecastkv.modeling.cache import SparseCache
from forecastkv.serving import EngineBatch, LayerPages, check_page_geometry, forward_paged
from forecastkv.serving.paged import head_page_attention, head_pages
from tests.helpers import tiny_model, tiny_sparse
from tests.strict_device import count_host_reads

MODES = {
    "dense": None,
    "infllmv2-query": {"selector": "query"},
    "infllmv2-forecast": {"selector": "forecast"},
    "nosa": {"policy": "nosa", "selector": "query"},
    "nosa-forecast": {"policy": "nosa", "selector": "forecast"},
    "coarse-lse": {"selector": "query", "lse": "coarse"},
    "infllmv2-query-carry": {"selector": "query-carry"},
    "infllmv2-forecast-carry": {"selector": "forecast-carry"},
    "infllmv2-forecast-carry-pin": {"selector": "forecast-carry-pin"},
}


class ToyEngine:
    """Pages of `page` tokens from a shuffled free list, a block table per request, chunked prefill.
    table_width: every call's block table this many pages wide (vLLM's: max_model_len / page), else
    as wide as the call's longest request needs."""

    def __init__(
        self, model, page: int, pages: int = 64, seed: int = 0, heads_inside: bool = False, kernel: bool = False,
        table_width: int | None = None, captured: bool = False,
    ):
        config, device = model.config, model.device
        heads, dim = config.num_key_value_heads, config.head_dim
        nosa = config.sparse is not None and config.sparse.policy == "nosa"
        # captured: a call of one token per request is described as a captured CUDA graph sees it
        # (`EngineBatch.captured_decode`: no host length, a one-token prompt included)
        self.model, self.page, self.table_width, self.captured = model, page, table_width, captured

        def pool():  # never-written rows: NaN; heads_inside: a CUDA backend's [P, page, H, d] pages
            if heads_inside:
                return torch.full((pages, page, heads, dim), float("nan"), device=device).transpose(1, 2)
            return torch.full((pages, heads, page, dim), float("nan"), device=device)

        self.layers = [
            LayerPages.around(pool(), pool(), config.sparse, nosa) for _ in range(config.num_hidden_layers)
        ]
        if kernel:  # decode through an engine's page-attention kernel: here its PyTorch reference
            for layer in self.layers:
                layer.attend = partial(head_page_attention, head_pages(layer.keys), head_pages(layer.values))
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(pages, generator=gen).tolist()
        self.tables: dict[int, list[int]] = {}
        self.stored: dict[int, int] = {}
        self.tier = None  # forecast-offload's host tier (test_page_offload.py)
        self.watch = nullcontext  # a context around forward_paged (a test's recorder)

    def step(self, work: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """work: request -> its new tokens this call.  Returns request -> logits [n, vocab]."""
        order = list(work)
        starts, seq_lens = [0], []
        for r in order:
            self.stored.setdefault(r, 0)
            total = self.stored[r] + len(work[r])
            table = self.tables.setdefault(r, [])
            while len(table) * self.page < total:
                table.append(self.free.pop())
            starts.append(starts[-1] + len(work[r]))
            seq_lens.append(total)
        width = self.table_width or max(len(self.tables[r]) for r in order)
        device = self.model.device
        table = torch.tensor([self.tables[r] + [0] * (width - len(self.tables[r])) for r in order], device=device)
        tokens = torch.tensor([t for r in order for t in work[r]], device=device)
        batch = EngineBatch(starts, seq_lens, table, torch.tensor(seq_lens, device=device))
        if self.captured and starts[-1] == len(order):
            batch = EngineBatch.captured_decode(table, batch.device_seq_lens, bound=width * self.page)
        with self.watch():  # the engine made its inputs: watch forecastkv's part of the call
            hidden = forward_paged(self.model.model, tokens, batch, self.layers, tier=self.tier)
        logits = self.model.lm_head(hidden)
        for r, n in zip(order, seq_lens):
            self.stored[r] = n
        return {r: logits[starts[i] : starts[i + 1]] for i, r in enumerate(order)}


def reference_logits(model, prompt: list[int], continuation: list[int], chunk: int | None = None) -> torch.Tensor:
    """Logits [len(prompt) + len(continuation), vocab] of one request on a resident SparseCache: the
    prompt in one call (or in calls of `chunk` tokens), then one call per continuation token
    (generate()'s calls)."""
    cache = SparseCache(model.config)
    chunk = chunk or max(len(prompt), 1)
    rows = [model(torch.tensor([prompt[i : i + chunk]]), cache=cache).logits[0] for i in range(0, len(prompt), chunk)]
    for token in continuation:
        rows.append(model(torch.tensor([[token]]), cache=cache).logits[0])
    return torch.cat(rows)


def run_engine(
    model, prompts: list[list[int]], chunk: int, steps: int, page: int, heads_inside: bool = False, kernel=False
):
    """Chunked prefill of every prompt (all requests in each call), then `steps` greedy decode calls
    of the whole batch.  Returns (request -> logits of every row, request -> tokens generated)."""
    engine = ToyEngine(model, page, heads_inside=heads_inside, kernel=kernel)
    logits = {r: [] for r in range(len(prompts))}
    done = {r: 0 for r in range(len(prompts))}
    while any(done[r] < len(p) for r, p in enumerate(prompts)):
        work = {r: p[done[r] : done[r] + chunk] for r, p in enumerate(prompts) if done[r] < len(p)}
        for r, rows in engine.step(work).items():
            logits[r].append(rows)
            done[r] += len(work[r])
    generated = {r: [int(logits[r][-1][-1].argmax())] for r in logits}
    for _ in range(steps):
        out = engine.step({r: [tokens[-1]] for r, tokens in generated.items()})
        for r, rows in out.items():
            logits[r].append(rows)
            generated[r].append(int(rows[-1].argmax()))
    return {r: torch.cat(parts) for r, parts in logits.items()}, generated


def prompts_of(lengths, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize(
    "mode,page,heads_inside,kernel",
    [(mode, page, False, False) for mode in MODES for page in (8, 4)]
    + [("infllmv2-forecast", 4, True, False), ("nosa", 8, True, False)]
    + [(mode, page, False, True) for mode in ("infllmv2-query", "infllmv2-forecast", "coarse-lse", "nosa")
       for page in (8, 4)],
)
def test_engine_logits_equal_resident_cache(mode, page, heads_inside, kernel):
    """Prompts from 1 token (less than a window) to 5 blocks, prefilled in chunks of 5 tokens (cutting
    pages, windows and blocks), then 6 decode steps in one batch: every logit equals the resident
    cache's run of that request alone, and so does every greedy token.  heads_inside: pages laid out
    [P, page, H, d] (a CUDA backend's), which the page-wise block gather cannot flatten.  kernel: decode
    through a page-attention kernel (`PagedRows.attend_selected`; NOSA's bias keeps the gather).  A
    selector that carries blocks is compared with the same calls (a prompt's last chunk of one token
    is a decode step, in `generate()` too, and its heat is carried into the next)."""
    model = tiny_model(MODES[mode])
    prompts = prompts_of([1, 3, 7, 8, 19, 41])
    logits, generated = run_engine(
        model, prompts, chunk=5, steps=6, page=page, heads_inside=heads_inside, kernel=kernel
    )
    same_calls = 5 if "-carry" in mode else None
    for r, prompt in enumerate(prompts):
        continuation = generated[r][:-1]
        expected = reference_logits(model, prompt, continuation, chunk=same_calls)
        assert torch.isfinite(logits[r]).all(), f"request {r} (prompt of {len(prompt)}) has non-finite logits"
        torch.testing.assert_close(logits[r], expected, rtol=1e-4, atol=1e-4, msg=f"{mode}, request {r}")
        assert generated[r] == expected[len(prompt) - 1 :].argmax(-1).tolist()


@pytest.mark.parametrize("mode,kernel", [(mode, False) for mode in MODES] + [("infllmv2-forecast", True)])
def test_a_decode_call_reads_nothing_back_to_the_host(mode, kernel):
    """A decode call of the whole batch over the pages makes no host read of a device tensor (what a
    GPU pays for with a sync), through 8 steps in which rows complete windows and blocks on different
    steps (prompts of 1 to 41 tokens, windows of 4 every 2, pages of 4): stores, window filing
    (`PagedWindows.file_one`), selection and attention (gathered, or by a page-attention kernel's
    block tables).  The engine's host ints (lengths, starts) are its own."""
    model = tiny_model(MODES[mode])
    prompts = prompts_of([1, 7, 8, 19, 41])
    with count_host_reads():  # the pool and the model are made inside: every tensor is "device"
        engine = ToyEngine(model, page=4, kernel=kernel)
        out = engine.step(dict(enumerate(prompts)))
        for _ in range(8):
            tokens = {r: [int(rows[-1].argmax())] for r, rows in out.items()}
            with count_host_reads() as step:
                out = engine.step(tokens)
            assert step.reads == 0, step.report()


def engine_decode(model, kernel: bool, steps: int, compiled: bool = False):
    """Prompts of 29 and 23 tokens prefilled in one call on block tables 16 pages of 4 wide (an
    engine's fixed width), then `steps` decode calls of both, each recorded (`OpShapes`); compiled:
    the decode calls' layers under torch.compile(fullgraph=True, backend="eager") with
    error_on_recompile (then nothing is recorded).  Returns (tokens per step, recorded ops per step)."""
    from tests.inference.test_fixed_shapes import OpShapes

    engine = ToyEngine(model, page=4, kernel=kernel, table_width=16)
    original, tokens, recorded = model.model.decode_layers, [], []
    patch = torch._dynamo.config.patch(error_on_recompile=True)
    with torch.no_grad(), kernels.use_backend("reference"), patch:
        out = engine.step(dict(enumerate(prompts_of([29, 23]))))
        if compiled:
            torch._dynamo.reset()
            model.model.decode_layers = torch.compile(original, fullgraph=True, backend="eager")
        try:
            for _ in range(steps):
                step = {r: [int(rows[-1].argmax())] for r, rows in out.items()}
                with nullcontext() if compiled else OpShapes() as ops:  # dynamo runs under no dispatch mode
                    out = engine.step(step)
                tokens.append(step)
                recorded.append(None if compiled else ops.calls)
        finally:
            model.model.decode_layers = original
    return tokens, recorded


@pytest.mark.parametrize(
    "mode,kernel",
    [(mode, False)
     for mode in ("infllmv2-query", "infllmv2-forecast", "nosa", "coarse-lse", "infllmv2-forecast-carry-pin")]
    + [("infllmv2-forecast", True)],
)
def test_a_decode_call_runs_fixed_shapes_and_compiles_once(mode, kernel):
    """On an engine's fixed-width block tables, consecutive decode calls run the same aten ops on
    tensors of the same shapes across window (every 2 tokens) and block (every 8) completions: the
    compressed keys are scored over the table's width, not the longest sequence's.  And torch.compile
    takes the calls' layers whole, once (no graph break, no recompile: no Python number that changes
    from call to call reaches them), with the eager calls' tokens: what a captured CUDA graph needs."""
    model = tiny_model(MODES[mode], seed=4)
    eager, recorded = engine_decode(model, kernel, steps=10)
    for step in range(1, len(recorded)):
        assert recorded[step] == recorded[0], f"{mode}: decode call {step + 1} runs other ops or shapes than call 1"
    compiled, _ = engine_decode(model, kernel, steps=10, compiled=True)
    assert compiled == eager


class HostMadeTensors(TorchDispatchMode):
    """Records the shape of every tensor made from Python numbers (`aten.lift_fresh`: torch.tensor of a
    list) but scalars (constants such as -inf, the same at every step)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.lift_fresh.default and args[0].dim():
            self.made.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["infllmv2-query", "infllmv2-forecast", "nosa", "infllmv2-forecast-carry"])
def test_a_decode_only_call_makes_no_tensor_from_host_numbers(mode):
    """A decode-only call takes every tensor from the engine's (token ids, block table, device
    sequence lengths): it makes none from its host ints, which a captured step would replay as they
    were at capture.  A prefill call still does (its rows' offsets): the check sees it."""
    model = tiny_model(MODES[mode], seed=4)
    engine = ToyEngine(model, page=4, table_width=16)
    recorder = HostMadeTensors()
    engine.watch = lambda: recorder
    with torch.no_grad():
        out = engine.step(dict(enumerate(prompts_of([29, 23]))))
        assert recorder.made, "the prefill call's host-made tensors were not seen"
        for _ in range(4):
            recorder.made.clear()
            out = engine.step({r: [int(rows[-1].argmax())] for r, rows in out.items()})
            assert recorder.made == [], recorder.made


@pytest.mark.parametrize("mode", ["infllmv2-forecast", "nosa-forecast", "coarse-lse"])
def test_a_decode_call_makes_its_indexes_once(mode, monkeypatch):
    """Every layer of a decode call stores its token at the same places, files the same windows and masks
    the same keys: the call's first layer makes those index tensors (`CallIndexes`) and the others
    reuse them, so their count does not grow with the layers (made per layer, they were most of the time
    a decode step spent storing its token).  The logits stay the resident cache's (the tests above)."""
    import forecastkv.modeling.selection as sel
    import forecastkv.serving.paged as paged

    def counted(module, name):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            made[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counts = []
    for layers in (2, 4):
        model = tiny_model(MODES[mode], num_hidden_layers=layers)
        engine = ToyEngine(model, page=4)
        out = engine.step(dict(enumerate(prompts_of([7, 19, 41]))))
        made = {"page_slots": 0, "compressed_visibility": 0, "forced_blocks": 0}
        counted(paged, "page_slots"), counted(sel, "compressed_visibility"), counted(sel, "forced_blocks")
        engine.step({r: [int(rows[-1].argmax())] for r, rows in out.items()})
        monkeypatch.undo()
        assert all(made.values()), made  # the decode call ran these paths
        counts.append(made)
    assert counts[0] == counts[1], f"index tensors per decode call with 2 layers {counts[0]}, with 4 {counts[1]}"


@pytest.mark.parametrize("mode", ["infllmv2-query-carry", "infllmv2-forecast-carry", "infllmv2-forecast-carry-pin"])
def test_carried_blocks_follow_each_request_across_calls(mode):
    """The blocks a request's decode step carries into its next (`modeling/carry.py`) are kept in the
    pages between the engine's calls, under the page of its last token: requests arrive while others
    decode (a call holding one request's prompt and the others' decode tokens, listed in a new order
    each call), one finishes and a later one gets its pages, and every request's logits still equal
    its own run on a resident cache, which carries in memory."""
    model = tiny_model(MODES[mode], seed=2)
    engine = ToyEngine(model, page=4, pages=48)
    prompts = dict(enumerate(prompts_of([41, 19, 30, 26], seed=7)))
    arrive, leave = {0: 0, 1: 2, 2: 3, 3: 8}, {0: 7}  # call -> request arriving / finishing after it
    arrivals = {call: r for r, call in arrive.items()}
    logits, generated, live = {r: [] for r in prompts}, {r: [] for r in prompts}, []
    with torch.no_grad():
        for call in range(13):
            work = {r: [generated[r][-1]] for r in reversed(live)}  # another row order each call
            if call in arrivals:
                work = {arrivals[call]: prompts[arrivals[call]], **work}
                live.append(arrivals[call])
            for r, rows in engine.step(work).items():
                logits[r].append(rows)
                generated[r].append(int(rows[-1].argmax()))
            for r in [r for r in live if leave.get(r) == call]:
                live.remove(r)
                engine.free.extend(engine.tables.pop(r))  # its pages go to the next request
    for r, prompt in prompts.items():
        expected = reference_logits(model, prompt, generated[r][:-1])
        torch.testing.assert_close(torch.cat(logits[r]), expected, rtol=1e-4, atol=1e-4, msg=f"{mode}, request {r}")


def test_a_decode_batch_reads_only_its_pages():
    """The window slots of a freed page are overwritten before its next owner reads them: two
    requests one after the other on the same pages give the second one's own logits."""
    model = tiny_model({"selector": "query"})
    engine = ToyEngine(model, page=8, pages=8)
    first, second = prompts_of([40, 40], seed=5)
    engine.step({0: first})
    engine.free.extend(reversed(engine.tables.pop(0)))  # request 0 finishes: its pages go back
    out = engine.step({1: second})[1]
    torch.testing.assert_close(out, reference_logits(model, second, []), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "block,stride,page,ok",
    [(8, 2, 8, True), (8, 2, 2, True), (8, 2, 1, True), (8, 2, 16, False), (8, 2, 3, False),
     (12, 4, 12, True), (12, 4, 4, True), (12, 4, 6, False)],
)
def test_page_geometry(block, stride, page, ok):
    """A page must divide the selection block and nest with the kernel stride (one divides the
    other); both sides of each boundary."""
    sparse = tiny_model(tiny_sparse(block_size=block, kernel_stride=stride, window_size=block)).config.sparse
    if ok:
        check_page_geometry(page, sparse)
    else:
        with pytest.raises(ConfigError, match=f"block_size={page}"):
            check_page_geometry(page, sparse)


@pytest.mark.parametrize("selector", ["quest", "quest-forecast", "quest-forecast-carry-pin", "maxkey-forecast"])
def test_selectors_over_key_bounds_equal_the_resident_cache(selector):
    """Quest's block key bounds are window indexes of one block (min and max per channel), kept in the pages'
    slots like the compressed keys where the sparse_config's selector scores them (`LayerPages.around`): the
    engine's logits equal each request's own resident run; pages made without them refuse such a selector by
    name before any call."""
    model = tiny_model({"policy": "infllmv2", "selector": selector, "topk": 4}, seed=3)
    prompts = prompts_of([1, 7, 19, 41])
    logits, generated = run_engine(model, prompts, chunk=5, steps=6, page=4)
    same_calls = 5 if "-carry" in selector else None
    for r, prompt in enumerate(prompts):
        expected = reference_logits(model, prompt, generated[r][:-1], chunk=same_calls)
        torch.testing.assert_close(logits[r], expected, rtol=1e-4, atol=1e-4, msg=f"{selector}, request {r}")
    plain = tiny_model({"policy": "infllmv2", "selector": "query"}, seed=3).config.sparse
    engine = ToyEngine(model, page=4)
    engine.layers = [LayerPages.around(layer.keys, layer.values, plain, False) for layer in engine.layers]
    with pytest.raises(ConfigError, match=f"selector '{selector}' scores Quest's block key bounds"):
        engine.step({0: list(range(3, 20))})


PIN_MODE = {"policy": "infllmv2", "selector": "forecast-carry-pin", "topk": 6}


def engine_pins(engine: ToyEngine, request: int) -> list[torch.Tensor]:
    """Each layer's pins [H, 2] the pages keep for `request` (under the page of its last token)."""
    position = engine.stored[request] - 1
    page = engine.tables[request][position // engine.page]
    return [layer.pinned[page] for layer in engine.layers]


def resident_pins(model, prompt: list[int], cuts: tuple = ()) -> list[torch.Tensor]:
    """Each layer's pins [H, 2] after the prompt on a resident cache, in one call or cut at `cuts`."""
    cache = SparseCache(model.config)
    with torch.no_grad():
        for start, end in zip((0, *cuts), (*cuts, len(prompt))):
            model(torch.tensor([prompt[start:end]]), cache=cache)
    return [layer.pinned[0] for layer in cache.layers]


@pytest.mark.parametrize("chunk", [6, 13, 40])
def test_a_prompt_pins_the_same_blocks_however_it_is_cut(chunk):
    """The pins read the prompt's last 32 query rows (`modeling/pins.py`); prefilled in chunks shorter than that,
    beside other requests (right-padded batches), each layer's rows of a request's chunk are kept in the pages
    for its next (`LayerPages.pin_rows`), so every request pins what its whole prompt pins in one call on a
    resident cache, and decodes alike.  (No chunk of one token: that is a decode step.)"""
    model = tiny_model(PIN_MODE, seed=4)
    prompts = prompts_of([40, 45, 50, 71], seed=9)  # 6, 13 and 40 cut none of them into a last chunk of one
    engine = ToyEngine(model, page=4, pages=96)
    done = {r: 0 for r in range(len(prompts))}
    with torch.no_grad():
        while any(done[r] < len(p) for r, p in enumerate(prompts)):
            work = {r: p[done[r] : done[r] + chunk] for r, p in enumerate(prompts) if done[r] < len(p)}
            engine.step(work)
            done = {r: done[r] + len(work.get(r, [])) for r in done}
    checked = 0
    for r, prompt in enumerate(prompts):
        want = resident_pins(model, prompt)
        for layer, (got, expected) in enumerate(zip(engine_pins(engine, r), want)):
            assert torch.equal(got, expected), f"chunk {chunk}, request {r}, layer {layer}"
            checked += int((expected >= 0).sum())
    assert checked >= len(prompts) * len(want) * 2  # most heads pinned blocks: the comparison is not of -1s


def test_the_pin_rows_kept_are_the_latest_calls_chunks(monkeypatch):
    """`KEPT_PIN_ROWS` bounds the rows the pages keep (device memory the engine did not profile), but never below
    one call's chunks: two prompts cut in the same calls both pin what they pin whole; a prompt whose next chunk
    comes after another call's chunk, with room for one, has lost its earlier rows."""
    from forecastkv.serving import paged

    monkeypatch.setattr(paged, "KEPT_PIN_ROWS", 1)
    model = tiny_model(PIN_MODE, seed=4)
    first, second = prompts_of([45, 50], seed=9)
    together = ToyEngine(model, page=4, pages=96)
    with torch.no_grad():
        together.step({0: first[:30], 1: second[:30]})
        together.step({0: first[30:], 1: second[30:]})
        apart = ToyEngine(model, page=4, pages=96)
        apart.step({0: first[:30]})
        apart.step({1: second[:30]})  # request 0's rows are dropped here
        apart.step({0: first[30:]})
    whole = resident_pins(model, first)
    assert all(torch.equal(a, b) for a, b in zip(engine_pins(together, 0), whole))
    assert all(torch.equal(a, b) for a, b in zip(engine_pins(together, 1), resident_pins(model, second)))
    assert not all(torch.equal(a, b) for a, b in zip(engine_pins(apart, 0), whole))
    assert all(len(layer.pin_rows) == 1 for layer in apart.layers)


def test_a_refilled_page_does_not_hand_over_another_requests_pin_rows():
    """A request aborted mid-prompt leaves its chunk's rows under the page and position of its last token.  The
    next request given the same pages stores its prompt in calls of 19 tokens, 1 (a decode step, which ends the
    rows its pins read) and the rest: its last call looks where the aborted chunk ended and must not take those
    rows (its own key is there now).  Its pins equal a resident cache's after the same calls."""
    model = tiny_model(PIN_MODE, seed=4)
    first, second = prompts_of([30, 45], seed=11)
    engine = ToyEngine(model, page=4, pages=24)
    with torch.no_grad():
        engine.step({0: first[:20]})
        pages = engine.tables.pop(0)
        engine.free.extend(reversed(pages))  # aborted: its pages go back, to be taken in the same order
        for start, end in ((0, 19), (19, 20), (20, 45)):
            engine.step({1: second[start:end]})
        assert engine.tables[1][:5] == pages  # its decode step stored where the aborted chunk ended, same page
    want = resident_pins(model, second, cuts=(19, 20))
    whole = resident_pins(model, second)  # the rows before the last call change the pins: extra rows would show
    assert any(not torch.equal(a, b) for a, b in zip(want, whole))
    for layer, (got, expected) in enumerate(zip(engine_pins(engine, 1), want)):
        assert torch.equal(got, expected), f"layer {layer}"


# MiniCPM's dense rule mid-decode: prompts below, across and above dense_len = 40 (5 blocks of 8; topk 3)
CAPTURED_MODES = {
    "infllmv2-query": {"selector": "query"},
    "infllmv2-forecast dense_len": {"selector": "forecast", "dense_len": 40},
    "nosa dense_len": {"policy": "nosa", "selector": "query", "dense_len": 40},
    "nosa-forecast dense_len, no dense bias": {
        "policy": "nosa", "selector": "forecast", "dense_len": 40, "dense_cis_bias": False,
    },
    "infllmv2-forecast-carry dense_len": {"selector": "forecast-carry", "dense_len": 40},
    "infllmv2-forecast-carry-pin dense_len": {"selector": "forecast-carry-pin", "dense_len": 40},
}


def captured_run(model, kernel: bool, recorder=None, arrival: bool = True, compiled: bool = False):
    """Requests 0-3 (prompts of 3, 7, 33 and 41 tokens) prefilled in one call, then 10 decode calls
    described as a captured graph sees them (`EngineBatch.captured_decode`, tables 16 pages of 4 wide);
    request 4, a one-token prompt, arrives in the fourth decode call, inside it.  recorder: a context
    around forecastkv's part of each decode call; arrival False: no request 4; compiled: the decode calls'
    layers under torch.compile(fullgraph=True, backend="eager") with error_on_recompile.  Returns (prompts,
    request -> logits of every row, request -> tokens)."""
    prompts = prompts_of([3, 7, 33, 41, 1], seed=6)
    engine = ToyEngine(model, page=4, kernel=kernel, table_width=16, captured=True)
    logits = {r: [] for r in range(5)}
    generated = {r: [] for r in range(5)}
    work = {r: prompts[r] for r in range(4)}
    original = model.model.decode_layers
    patch = torch._dynamo.config.patch(error_on_recompile=True)
    with torch.no_grad(), kernels.use_backend("reference") if compiled else nullcontext(), patch:
        try:
            for call in range(11):
                if call == 4 and arrival:
                    work[4] = prompts[4]
                if call == 1 and recorder is not None:
                    engine.watch = recorder
                if call == 1 and compiled:
                    torch._dynamo.reset()
                    model.model.decode_layers = torch.compile(original, fullgraph=True, backend="eager")
                out = engine.step(work)
                for r, rows in out.items():
                    logits[r].append(rows)
                    generated[r].append(int(rows[-1].argmax()))
                work = {r: [generated[r][-1]] for r in out}
        finally:
            model.model.decode_layers = original
    return prompts, {r: torch.cat(rows) for r, rows in logits.items() if rows}, generated


@pytest.mark.parametrize(
    "mode,kernel", [(mode, False) for mode in CAPTURED_MODES] + [("infllmv2-forecast dense_len", True)]
)
def test_a_captured_decode_call_equals_each_requests_own_run(mode, kernel):
    """A decode call with no host length (what a CUDA graph captured at one call replays at the next):
    each request's dense or sparse rule is decided on the device, so requests below dense_len attend every
    block, one crosses it mid-decode, one is above it from the start, and a one-token prompt arriving
    inside a decode call is a decode step on nothing stored.  Every logit equals the request's own run on
    a resident cache (whose rule is its host ints'), carried blocks included."""
    model = tiny_model(CAPTURED_MODES[mode], seed=3)
    prompts, logits, generated = captured_run(model, kernel)
    for r, prompt in enumerate(prompts):
        expected = reference_logits(model, prompt, generated[r][:-1])
        assert torch.isfinite(logits[r]).all(), f"request {r} (prompt of {len(prompt)}) has non-finite logits"
        torch.testing.assert_close(logits[r], expected, rtol=1e-4, atol=1e-4, msg=f"{mode}, request {r}")


@pytest.mark.parametrize("mode", ["infllmv2-forecast-carry", "infllmv2-forecast-carry-pin"])
def test_a_prompt_from_the_prefix_cache_reads_no_other_requests_slots(mode):
    """vLLM serves a repeated prompt from its prefix cache and recomputes only its last token; where that token
    opens a page it is a decode step on pages another request computed, and the carried and pinned slots under
    its last cached page are whatever a request decoding through that page left (here request 0, whose pages
    request 1 then took).  It reads none of them (`PagedSparseCache._read_slots`): carrying, it equals a
    resident cache given the same calls (the prompt but its last token, then that token, a decode step); its
    pins stay empty (the rows they read were another request's computation), never request 0's."""
    model = tiny_model({**MODES[mode], "topk": 8}, seed=4)
    decoded, prompt = prompts_of([77, 81], seed=13)  # 81 = 20 pages of 4 + 1: the last token opens a page
    engine = ToyEngine(model, page=4, pages=64)
    with torch.no_grad():
        out = engine.step({0: decoded})
        for _ in range(6):  # request 0 decodes through its 20th page, leaving its slots there
            out = engine.step({0: [int(out[0][-1].argmax())]})
        pages = engine.tables.pop(0)
        assert (engine.layers[0].carried[pages[19]] >= 0).any()
        engine.free.extend(reversed(pages))  # request 1 takes them in the same order
        engine.step({1: prompt})
        assert engine.tables[1][:20] == pages[:20]
        engine.tables[2], engine.stored[2] = engine.tables[1][:20], 80  # request 2: the prompt again, cached
        logits = [engine.step({2: prompt[80:]})[2]]
        generated = [int(logits[-1][-1].argmax())]
        for _ in range(5):
            logits.append(engine.step({2: generated[-1:]})[2])
            generated.append(int(logits[-1][-1].argmax()))
    if mode.endswith("-pin"):
        assert all(torch.equal(pins, torch.full_like(pins, -1)) for pins in engine_pins(engine, 2))
        return
    expected = reference_logits(model, prompt, generated[:-1], chunk=80)[80:]
    torch.testing.assert_close(torch.cat(logits), expected, rtol=1e-4, atol=1e-4)


def test_a_one_token_prompt_in_a_captured_call_takes_no_pins_from_its_pages_last_owner():
    """A captured decode call reads each request's pins from the page of its last token; a one-token prompt
    arriving in one has no stored token, and its page's slot holds what the page's last owner pinned.  It pins
    nothing, as its own prefill of one row on a resident cache does (that row's block is the init block)."""
    model = tiny_model(PIN_MODE, seed=4)
    first, other = prompts_of([41, 30], seed=12)
    engine = ToyEngine(model, page=4, pages=32, table_width=16, captured=True)
    with torch.no_grad():
        engine.step({0: first, 1: other})
        left = engine_pins(engine, 0)
        assert any((pins >= 0).any() for pins in left)
        pages = engine.tables.pop(0)
        engine.free.extend(pages)  # request 0 finishes: its last page, holding its pins, is the next one taken
        out = engine.step({1: [5], 2: [7]})  # request 2: a one-token prompt, in a captured decode call
        assert engine.tables[2] == [pages[-1]]
        for _ in range(3):
            out = engine.step({r: [int(rows[-1].argmax())] for r, rows in out.items()})
    assert all(torch.equal(pins, torch.full_like(pins, -1)) for pins in engine_pins(engine, 2))
    assert all(torch.equal(a, b) for a, b in zip(engine_pins(engine, 1), resident_pins(model, other)))


@pytest.mark.parametrize(
    "mode", ["infllmv2-forecast dense_len", "nosa dense_len", "infllmv2-forecast-carry-pin dense_len"]
)
def test_a_captured_decode_call_reads_nothing_and_makes_no_host_tensor(mode):
    """The captured decode calls above read no device value back to the host and make no tensor from a
    host number (either would freeze a captured graph at its capture), across the dense_len crossing and
    the arrival of a one-token prompt."""
    model = tiny_model(CAPTURED_MODES[mode], seed=3)
    made, counters = HostMadeTensors(), []

    @contextmanager
    def recorder():
        with count_host_reads() as counter, made:
            counters.append(counter)
            yield

    with count_host_reads():  # the engine's pool and model are made inside: every tensor is "device"
        captured_run(model, kernel=False, recorder=recorder)
    assert len(counters) == 10
    assert all(counter.reads == 0 for counter in counters), [c.report() for c in counters if c.reads]
    assert made.made == [], made.made


@pytest.mark.parametrize("mode", ["infllmv2-forecast dense_len", "infllmv2-forecast-carry dense_len"])
def test_a_captured_decode_call_compiles_once_across_dense_len(mode):
    """torch.compile takes the captured decode calls' layers whole and once (no graph break, no
    recompile) while one request crosses dense_len and others stay below it: no Python number that
    changes from call to call, the dense rule included, reaches them; the tokens are the eager calls'."""
    model = tiny_model(CAPTURED_MODES[mode], seed=3)
    _, _, eager = captured_run(model, kernel=False, arrival=False)
    _, _, compiled = captured_run(model, kernel=False, arrival=False, compiled=True)
    assert compiled == eager
