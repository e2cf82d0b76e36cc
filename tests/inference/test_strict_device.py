"""The strict-device harness (tests/strict_device.py) and the offloaded cache run under it.

On the CPU the host and device tiers are one memory; the harness makes the two kinds of CUDA-only
bug visible here: a host-store tensor touched by an op outside the transfer functions (on CUDA: a
device-index error or a silent CPU op), and a host read of a device tensor (on CUDA: a sync).
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from forecastkv import SparseCache
from forecastkv.inference import OffloadedSparseCache
from forecastkv.inference.fill import greedy_steps
from forecastkv.inference.host_store import HostKVStore, allocate_host
from forecastkv.inference.offloaded import MODE_SELECTOR, MODES
from forecastkv.inference.worker import in_host_transfer
from forecastkv.modeling.modeling import CACHE_KWARG
from forecastkv.modeling.selection import num_compressed
from tests.helpers import left_padded, tiny_model
from tests.inference.conftest import INTERPRETED
from tests.strict_device import (
    HostTensorTouched,
    StrictHostTensor,
    count_host_reads,
    host_transfer,
    is_host,
    strict_host,
)

POLICIES = ("infllmv2", "nosa")


def new_host(shape=(2, 6, 3), dtype=torch.float32) -> torch.Tensor:
    """A host-store tensor, allocated the way the store allocates (through the wrapped hook)."""
    from forecastkv.inference import host_store

    return host_store.allocate_host(shape, dtype, False)


# -- the host-read counter ------------------------------------------------------------------------

READS = {
    "item": (lambda t: t[0].item(), "aten._local_scalar_dense"),
    "int(max)": (lambda t: int(t.max()), "aten._local_scalar_dense"),
    "bool(any)": (lambda t: bool((t > 2).any()), "aten._local_scalar_dense"),
    "float(sum)": (lambda t: float(t.sum()), "aten._local_scalar_dense"),
    "nonzero": (lambda t: t.nonzero(), "aten.nonzero"),
    "nonzero(as_tuple)": (lambda t: (t > 1).nonzero(as_tuple=True), "aten.nonzero"),
    "masked_select": (lambda t: t.masked_select(t > 1), "aten.masked_select"),
    "bool-mask index": (lambda t: t[t > 1], "aten.index(bool mask)"),
    "cpu()": (lambda t: t.cpu(), "Tensor.cpu()"),
    "to('cpu')": (lambda t: t.to("cpu", torch.float64), 'Tensor.to("cpu")'),
    "tolist()": (lambda t: t.tolist(), "Tensor.tolist()"),
    "numpy()": (lambda t: t.numpy(), "Tensor.numpy()"),
}


@pytest.mark.parametrize("kind", list(READS))
def test_counter_counts_one_host_read(kind):
    read, op = READS[kind]
    device = torch.arange(5)
    with count_host_reads() as counter:
        read(device)
    assert counter.reads == 1 and dict(counter.by_op) == {op: 1}, counter.report()
    assert counter.d2h_writes == 0
    (site,) = counter.by_site
    assert site.startswith(f"{op} @ ") and "test_strict_device.py" in site  # where the caller read


def test_counter_counts_nothing_for_tensor_ops():
    """Ops whose results stay on the device and whose shapes do not depend on values."""
    t = torch.randn(4, 6)
    ids = torch.tensor([[0, 2], [1, 3], [5, 4], [0, 1]])
    with count_host_reads() as counter:
        u = torch.where(t > 0, t * 2, t - 1).softmax(-1)
        u.topk(2, dim=-1).indices.sort(dim=-1)
        torch.gather(u, 1, ids).cumsum(-1)
        u[torch.arange(4).view(-1, 1), ids] = 0.0  # integer-index write
        torch.cat([u, t]).amax(0).argsort()
        t.to(torch.float64).to(t.device)
        t.nonzero_static(size=3)
        _ = t.shape, t.numel(), t.data_ptr()
    assert counter.reads == 0 and counter.d2h_writes == 0, counter.report()


def test_counter_counts_the_d2h_write_back_apart():
    with count_host_reads() as counter:
        host = new_host()
        device = torch.randn(2, 6, 3)
        with host_transfer():
            host[:, :2].copy_(device[:, :2])  # the span write-back
            host[torch.tensor([0, 1]), torch.tensor([3, 4])] = device[0, :2]  # the row write-back
            staged = torch.empty(2, 6, 3)
            staged.copy_(host)  # H2D: neither a read nor a write
    assert counter.reads == 0
    assert dict(counter.d2h_by_op) == {"aten.copy_": 1, "aten.index_put_": 1}, counter.report()
    assert is_host(host[:, 1:]) and not is_host(staged) and not is_host(device)


def test_counter_keeps_stacks_and_nests():
    t = torch.arange(3)
    with count_host_reads(stacks=True) as outer:
        with count_host_reads() as inner:
            int(t.sum())
        t.tolist()
    assert inner.reads == 1 and outer.reads == 2
    assert inner.events[0].stack is None
    assert any("test_counter_keeps_stacks_and_nests" in line for line in outer.events[0].stack)


# -- strict host tensors --------------------------------------------------------------------------


@pytest.mark.parametrize("touch", ["add", "gather", "slice", "setitem", "as operand", "sum", "tolist", "bool"])
def test_strict_host_tensor_raises_outside_a_transfer_function(touch):
    ops = {
        "add": lambda h: h + 1,
        "gather": lambda h: h[torch.tensor([0, 1])],
        "slice": lambda h: h[:, :2],
        "setitem": lambda h: h.__setitem__((0, 0), 1.0),
        "as operand": lambda h: torch.zeros(2, 6, 3).copy_(h),
        "sum": lambda h: h.sum(),
        "tolist": lambda h: h.tolist(),
        "bool": lambda h: bool(h[0, 0, 0]),
    }
    with strict_host():
        host = new_host()
    assert isinstance(host, StrictHostTensor)
    with pytest.raises(HostTensorTouched, match="host-store tensor touched outside a transfer function: torch"):
        ops[touch](host)


def test_strict_host_tensor_metadata_never_raises():
    with strict_host():
        host = new_host((2, 5, 3), torch.float16)
    assert host.shape == (2, 5, 3) and host.size(1) == 5 and host.dim() == 3 and host.numel() == 30
    assert host.element_size() == 2 and host.dtype == torch.float16 and host.device.type == "cpu"
    assert host.data_ptr() != 0 and host.stride() == (15, 3, 1) and host.is_contiguous() and not host.is_pinned()
    assert (
        "shape=(2, 5, 3)" in repr(host)
        and f"{host}" == str(host) == repr(host)
        and str(host.shape) == "torch.Size([2, 5, 3])"
    )
    assert not in_host_transfer()


def test_strict_host_tensor_works_inside_a_transfer_function():
    with strict_host():
        host = new_host((2, 6, 3))
    device = torch.randn(2, 6, 3)
    with host_transfer():
        view = host[:, 2:4]
        assert isinstance(view, StrictHostTensor) and isinstance(view[0], StrictHostTensor)  # views stay host
        view.copy_(device[:, :2])
        host[torch.tensor([1]), torch.tensor([5])] = device[1, 5:]
        rows = host[torch.tensor([0, 1]), torch.tensor([2, 5])]  # a gather: new memory
        moved = host.to("cpu", non_blocking=True)  # the H2D copy
        staged = torch.zeros(2, 6, 3)
        staged[:, :4].copy_(host[:, :4])
        scratch = torch.empty(3)
        same_dtype = host[:, :1].to(host.device)
    for plain in (rows, moved, staged, scratch, same_dtype):
        assert type(plain) is torch.Tensor and not is_host(plain)
    assert moved.data_ptr() != host.data_ptr() and same_dtype.data_ptr() != host.data_ptr()  # never an alias
    assert torch.equal(moved[:, 2:4], device[:, :2]) and torch.equal(moved[1, 5], device[1, 5])
    assert torch.equal(rows, torch.stack([device[0, 0], device[1, 5]]))
    assert torch.equal(staged[:, 2:4], device[:, :2])
    with pytest.raises(HostTensorTouched):
        view + 1  # a view made inside stays strict outside


def test_host_transfer_is_reentrant_and_per_thread():
    seen = []
    with host_transfer():
        with host_transfer():
            assert in_host_transfer()
        assert in_host_transfer()
        worker = threading.Thread(target=lambda: seen.append(in_host_transfer()))
        worker.start()
        worker.join()
    assert not in_host_transfer() and seen == [False]


def test_harness_restores_allocate_host():
    from forecastkv.inference import host_store

    with strict_host(), count_host_reads():
        assert host_store.allocate_host is not allocate_host
    assert host_store.allocate_host is allocate_host
    assert type(allocate_host((2,), torch.float32, False)) is torch.Tensor


def test_host_store_transfer_functions_run_strict():
    """HostKVStore's own transfer functions (write, write_span, ensure's regrowth copy, device_rows) are
    allowed; anything else that reads its buffers raises."""
    with strict_host():
        store = HostKVStore(2, 2, 4, torch.float32, True, torch.float32, None, False)
        store.blocks.ensure(3)
    keys, values, cis = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2)
    store.write_span(0, keys, values, cis)
    store.write(torch.tensor([1]), torch.tensor([3]), keys[1, :1], values[1, :1], cis[1, :1])
    with strict_host():
        store.blocks.ensure(store.blocks.capacity + 1)  # regrowth copies the old rows
    assert (
        isinstance(store.keys, StrictHostTensor) and store.nbytes() > 0 and store.row_bytes() == 2 * 2 * 4 * 4 + 2 * 4
    )
    with pytest.raises(HostTensorTouched):
        store.keys[:, :3] + 0
    with host_transfer():
        stored_k, _, stored_cis = store.device_rows(4, torch.tensor([3, 4]), torch.device("cpu"))
    assert (
        torch.equal(stored_k[:, :3], keys)
        and torch.equal(stored_k[1, 3], keys[1, 0])
        and torch.equal(stored_cis[1, 3], cis[1, 0])
    )


# -- the offloaded cache under the harness --------------------------------------------------------

PROMPT = 37  # prompt tokens; kernel 4 / stride 2 / blocks of 8 (tests/helpers.TINY_SPARSE)
NEW_TOKENS = 12


def strict_model(policy: str):
    return tiny_model({"policy": policy, "selector": "forecast"}, seed=3)


def reference_tokens(model, mode: str, ids, mask, new_tokens: int = NEW_TOKENS) -> torch.Tensor:
    """What SparseCache (same selector, no harness) generates."""
    cache = SparseCache(model.config, selector=MODE_SELECTOR.get(mode))
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **{CACHE_KWARG: cache}
        )


def assert_windows_completed_while_decoding(model, cache, shortest_prompt: int) -> None:
    """At least two compression windows completed during decode, in every sequence."""
    kernel = (model.config.sparse.kernel_size, model.config.sparse.kernel_stride)
    shortest = int(cache.layers[-1].lengths.min())
    assert num_compressed(shortest, *kernel) - num_compressed(shortest_prompt, *kernel) >= 2, (
        shortest_prompt,
        shortest,
    )


# CUDA's decode path (the sparse_decode kernels): on their references (kernels-reference), and in
# named cases through the Triton kernels in the interpreter (kernels-triton)
@pytest.mark.parametrize(
    ("mode", "policy", "runtime_backend"),
    [
        *((mode, policy, "kernels-reference") for mode in MODES for policy in POLICIES),
        pytest.param("forecast-offload", "nosa", "kernels-triton", marks=INTERPRETED),
    ],
    indirect=["runtime_backend"],
)
def test_decode_runs_under_strict_host(mode, policy, runtime_backend):
    """Item 1: a decode step must not touch the host store outside the transfer functions (on CUDA
    `append` pooled new compression windows from host rows, then indexed them with device indices,
    a crash each time a window completed).  The prefill runs inside `host_transfer()` so this test
    isolates the decode step (see the next test for the prefill); the decode attention runs through
    the kernels (the backend's decode part "kernels"), the path CUDA takes: on their references,
    and in one named case in Triton (the interpreter)."""
    model = strict_model(policy)
    ids, mask = left_padded([PROMPT])
    expected = reference_tokens(model, mode, ids, mask)[:, PROMPT:]
    with strict_host(), torch.no_grad():
        cache = OffloadedSparseCache.for_model(model, mode=mode)
        with host_transfer():
            first = model(input_ids=ids, **{CACHE_KWARG: cache}).logits[:, -1].argmax(-1, keepdim=True)
        tokens, _, _ = greedy_steps(model, cache, first, NEW_TOKENS - 1)
    assert torch.equal(torch.cat([first, tokens], 1), expected)
    assert_windows_completed_while_decoding(model, cache, PROMPT)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_generate_runs_under_strict_host(mode, policy):
    """generate() end to end (left-padded batch: the row write-back and the span write-back) with
    every host-store tensor strict, and the tokens of SparseCache."""
    model = strict_model(policy)
    ids, mask = left_padded([PROMPT, PROMPT - 9])
    expected = reference_tokens(model, mode, ids, mask)
    with strict_host(), torch.no_grad():
        cache = OffloadedSparseCache.for_model(model, mode=mode)
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **{CACHE_KWARG: cache}
        )
    assert torch.equal(out, expected)
    assert_windows_completed_while_decoding(model, cache, PROMPT - 9)


# -- host reads per decode step -------------------------------------------------------------------


def assert_no_host_reads_while_decoding(model, mode: str, steps: int = 5) -> None:
    """Prefill, then `steps` decode steps in `mode`; every step after the first (which may size
    buffers) reads nothing back.  The failure message has the per-op and per-site breakdown."""
    ids, _ = left_padded([PROMPT])
    counted = []
    with count_host_reads(), torch.no_grad():  # outer context: the cache's host tensors are known
        cache = OffloadedSparseCache.for_model(model, mode=mode)
        current = model(input_ids=ids, **{CACHE_KWARG: cache}).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            with count_host_reads() as step:
                current = model(input_ids=current, **{CACHE_KWARG: cache}).logits[:, -1].argmax(-1, keepdim=True)
            counted.append(step)
    per_step = [step.reads for step in counted[1:]]
    assert per_step == [0] * len(per_step), f"{mode}: host reads per decode step {per_step}\n{counted[-1].report()}"


@pytest.mark.parametrize(
    ("mode", "runtime_backend"),
    [
        *((mode, "kernels-reference") for mode in MODES),
        pytest.param("forecast-offload", "kernels-triton", marks=INTERPRETED),
    ],
    indirect=["runtime_backend"],
)
def test_decode_step_has_no_host_reads(mode, runtime_backend):
    """DESIGN: "Zero host reads" in the decode step (the kernels' decode path, what CUDA runs: on
    the references, and once through the Triton kernels in the interpreter)."""
    assert_no_host_reads_while_decoding(tiny_model({"policy": "infllmv2", "selector": "forecast"}, seed=3), mode)


@pytest.mark.parametrize(
    ("selector", "mode", "top_p"),
    [
        ("quest", "sparse-offload", 0.0),
        ("reuse", "forecast-offload", 0.0),
        ("speculate", "forecast-offload", 0.0),
        ("forecast", "forecast-offload", 0.8),
        ("query", "sparse-offload", 0.8),
    ],
)
@pytest.mark.parametrize("runtime_backend", ["kernels-reference"], indirect=True)
def test_every_deployable_selector_decodes_with_no_host_read(selector, mode, top_p, runtime_backend):
    """The same for Quest's bounds, reuse's handed-over blocks, speculate's guessed queries and top-p
    budgets (their varying block counts stay on the device)."""
    sparse = {"policy": "infllmv2", "selector": selector, "top_p": top_p, "reuse_anchors": [0, 2]}
    assert_no_host_reads_while_decoding(tiny_model(sparse, seed=3), mode, steps=4)


# -- the decode step at MiniCPM4.1's geometry: zero host reads, strict host store -----------------

MINICPM_WIDTHS = dict(
    num_hidden_layers=32,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    query_chunk_size=256,
)
GEOMETRY = {"infllmv2": "minicpm4.1-8b", "nosa": "nosa-8b"}
# Prompts of 254, 253, 252 tokens reach 256 at decode steps 2, 3, 4: a kernel window (32/16) and a
# coarse one (128/64) complete in every sequence within the counted steps (2..5).
DECODE_STEPS = 5


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy, lengths, dense_len",
    [
        ("infllmv2", [254, 253, 252], 0),
        ("nosa", [254, 253, 252], 0),
        ("nosa", [254], 0),
        ("infllmv2", [254, 253, 252], 256),
    ],
    ids=["infllmv2-padded3", "nosa-padded3", "nosa-batch1", "infllmv2-padded3-dense-to-sparse"],
)
def test_decode_steps_read_nothing_back_at_minicpm_geometry(policy, lengths, dense_len):
    """A 32-layer model with MiniCPM4.1's block geometry (NOSA-8B's for nosa; coarse LSE for
    infllmv2) and tiny widths, every offload mode: no decode step after the first reads anything
    back from the device, across compression-window completions (and, with dense_len 256, while
    the sequences of the batch go from dense to sparse one by one), with every host-store tensor strict; the
    tokens equal SparseCache's.  Kernels run as their references (the CPU path)."""
    from forecastkv import kernels
    from forecastkv.modeling.configuration import load_preset

    sparse = {**load_preset(GEOMETRY[policy])["sparse_config"], "dense_len": dense_len, "selector": "forecast"}
    model = tiny_model(sparse, seed=2, **MINICPM_WIDTHS)
    assert model.config.sparse.lse == ("coarse" if policy == "infllmv2" else "exact")
    ids, mask = left_padded(lengths, seed=1)
    references = {}
    for mode in MODES:
        selector = MODE_SELECTOR.get(mode)
        if selector not in references:
            references[selector] = reference_tokens(model, mode, ids, mask, DECODE_STEPS + 1)[:, ids.shape[1] :]
        expected = references[selector]
        reads = []
        with kernels.use_backend("reference"), strict_host(), torch.no_grad():  # strict_host registers the host store
            cache = OffloadedSparseCache.for_model(model, mode=mode)
            tokens = [
                model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: cache}).logits[:, -1].argmax(-1, keepdim=True)
            ]
            for step in range(DECODE_STEPS):
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
                # every step after the first is counted (the first may size buffers)
                with count_host_reads() if step else contextlib.nullcontext() as counter:
                    logits = model(input_ids=tokens[-1], attention_mask=mask, **{CACHE_KWARG: cache}).logits
                tokens.append(logits[:, -1].argmax(-1, keepdim=True))
                if step:
                    reads.append(counter)
        mask = mask[:, : ids.shape[1]]
        per_step = [step.reads for step in reads]
        assert per_step == [0] * len(per_step), f"{mode}: host reads per decode step {per_step}\n{reads[-1].report()}"
        assert torch.equal(torch.cat(tokens, 1), expected), mode
    stored = cache.layers[-1].lengths.tolist()
    for size, stride in (
        (model.config.sparse.kernel_size, model.config.sparse.kernel_stride),
        model.config.sparse.coarse_kernel,
    ):
        assert all(
            num_compressed(n, size, stride) > num_compressed(n - DECODE_STEPS + 1, size, stride) for n in stored
        ), (size, stored)
