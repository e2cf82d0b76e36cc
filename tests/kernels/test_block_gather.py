"""block_gather: Triton UVA gather and copy-engine path against the reference; validation; dispatch."""

from __future__ import annotations

import pytest
import torch

import forecastkv.kernels as K

from .conftest import CUDA, DEVICE, aot_sm90, compile_sm90, host, needs_triton

GATHERS = {
    "triton": pytest.param(K.block_gather_triton, marks=needs_triton, id="triton"),
    "copy_engine": pytest.param(K.block_gather_copy_engine, id="copy_engine"),
}


def make_case(batch=2, seq=29, heads=2, dim=16, block=8, slots=3, dtype=torch.float32, bias=True, skip_frac=0.3):
    """Host K/V(/bias) with a partial last block, random ids incl. -1 and the last (partial) block."""
    n_blocks = -(-seq // block)
    k_host = host(torch.randn(batch, seq, heads, dim).to(dtype))
    v_host = host(torch.randn(batch, seq, heads, dim).to(dtype))
    b_host = host(torch.randn(batch, seq, heads).to(dtype)) if bias else None
    ids = torch.randint(0, n_blocks, (heads, batch, slots))
    ids[torch.rand(ids.shape) < skip_frac] = -1
    ids[0, 0, 0] = n_blocks - 1  # always exercise the partial last block
    ids[-1, -1, -1] = -1  # and a skipped task
    return k_host, v_host, b_host, ids.to(DEVICE)


def poisoned_slots(batch, rows, heads, dim, dtype, bias):
    nan = float("nan")
    k = torch.full((batch, rows, heads, dim), nan, dtype=dtype, device=DEVICE)
    b = torch.full((batch, rows, heads), nan, dtype=dtype, device=DEVICE) if bias else None
    return k, k.clone(), b


def run(fn, k_host, v_host, b_host, ids, block, num_programs=4):
    batch, _, heads, dim = k_host.shape
    rows = ids.shape[2] * block
    k_slots, v_slots, b_slots = poisoned_slots(batch, rows, heads, dim, k_host.dtype, b_host is not None)
    fn(k_host, v_host, ids, k_slots, v_slots, block, b_host, b_slots, num_programs=num_programs)
    return k_slots, v_slots, b_slots


def expected_written(ids, seq, block):
    """bool [B, M*block, H]: the slot rows a correct gather writes."""
    heads, batch, slots = ids.shape
    written = torch.zeros(batch, slots * block, heads, dtype=torch.bool)
    for h in range(heads):
        for b in range(batch):
            for m in range(slots):
                i = int(ids[h, b, m])
                if i >= 0:
                    n = max(0, min(block, seq - i * block))
                    written[b, m * block : m * block + n, h] = True
    return written


def assert_same(outs, refs):
    for out, ref in zip(outs, refs):
        if ref is None:
            assert out is None
        else:
            assert torch.equal(out.isnan(), ref.isnan())
            assert torch.equal(out.nan_to_num(), ref.nan_to_num())  # a copy: exact


@pytest.mark.parametrize("fn", GATHERS.values())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_reference(fn, dtype, bias):
    k_host, v_host, b_host, ids = make_case(dtype=dtype, bias=bias)
    refs = run(K.block_gather_reference, k_host, v_host, b_host, ids, 8)
    outs = run(fn, k_host, v_host, b_host, ids, 8)
    assert_same(outs, refs)
    # written exactly where a task lands, untouched (still NaN) everywhere else
    written = expected_written(ids.cpu(), k_host.shape[1], 8)
    assert torch.equal(~outs[0].isnan().all(-1).cpu(), written)
    assert torch.equal(~outs[0].isnan().any(-1).cpu(), written)
    if bias:
        assert torch.equal(~outs[2].isnan().cpu(), written)


def test_reference_values():
    """The reference itself, on a hand-checked case: block 3 of a 29-token store is rows 24..28."""
    k_host, v_host, b_host, _ = make_case(batch=1, heads=1, slots=2, seq=29, block=8)
    ids = torch.tensor([[[3, 1]]], device=DEVICE)
    k_slots, v_slots, b_slots = run(K.block_gather_reference, k_host, v_host, b_host, ids, 8)
    assert torch.equal(k_slots[0, :5, 0].cpu(), k_host[0, 24:29, 0])
    assert k_slots[0, 5:8].isnan().all()
    assert torch.equal(v_slots[0, 8:16, 0].cpu(), v_host[0, 8:16, 0])
    assert torch.equal(b_slots[0, 8:16, 0].cpu(), b_host[0, 8:16, 0])


@needs_triton
@pytest.mark.parametrize("num_programs", [1, 5, 40])  # 12 tasks: fewer, a non-divisor, more
def test_program_counts(num_programs):
    k_host, v_host, b_host, ids = make_case(batch=2, heads=2, slots=3)
    refs = run(K.block_gather_reference, k_host, v_host, b_host, ids, 8)
    outs = run(K.block_gather_triton, k_host, v_host, b_host, ids, 8, num_programs=num_programs)
    assert_same(outs, refs)


@needs_triton
def test_odd_block_and_head_dim():
    """Block and head dim that are not powers of two (padded tiles, masked)."""
    k_host, v_host, b_host, ids = make_case(seq=23, dim=12, block=6, slots=2)
    assert_same(
        run(K.block_gather_triton, k_host, v_host, b_host, ids, 6),
        run(K.block_gather_reference, k_host, v_host, b_host, ids, 6),
    )


@pytest.mark.parametrize("fn", GATHERS.values())
def test_non_contiguous(fn):
    """Strided host store (a view of a wider buffer), strided slots and transposed ids."""
    batch, seq, heads, dim, block, slots = 2, 21, 2, 8, 4, 3
    wide = host(torch.randn(batch, seq, heads, 2 * dim))
    k_host, v_host = wide[..., :dim], wide[..., dim:]
    b_host = host(torch.randn(batch, heads, seq)).transpose(1, 2)
    ids = torch.randint(-1, -(-seq // block), (batch, heads, slots), device=DEVICE).transpose(0, 1)
    outs, refs = [], []
    for impl, sink in ((fn, outs), (K.block_gather_reference, refs)):
        k_big = torch.full((batch, slots * block, heads, 2 * dim), float("nan"), device=DEVICE)
        b_big = torch.full((batch, heads, slots * block), float("nan"), device=DEVICE)
        k_slots, v_slots, b_slots = k_big[..., :dim], k_big[..., dim:], b_big.transpose(1, 2)
        impl(k_host, v_host, ids, k_slots, v_slots, block, b_host, b_slots, num_programs=3)
        sink.extend([k_slots, v_slots, b_slots])
    assert_same(outs, refs)


@needs_triton
def test_unchecked_bad_ids_are_skipped():
    """With check_ids=False an out-of-range id is skipped by the kernel, never read."""
    k_host, v_host, b_host, ids = make_case(bias=True)
    ids[0, 0, 1] = 10_000
    ids[1, 0, 0] = -7
    k_slots, v_slots, b_slots = poisoned_slots(2, 24, 2, 16, torch.float32, True)
    K.block_gather_triton(k_host, v_host, ids, k_slots, v_slots, 8, b_host, b_slots, num_programs=4, check_ids=False)
    assert k_slots[0, 8:16, 0].isnan().all() and b_slots[0, 0:8, 1].isnan().all()
    good = ids.masked_fill((ids < -1) | (ids >= 4), -1)  # 29 tokens = 4 blocks of 8
    refs = run(K.block_gather_reference, k_host, v_host, b_host, good, 8)
    assert_same((k_slots, v_slots, b_slots), refs)


def test_empty_store_all_skipped():
    k_host, v_host, _, _ = make_case(seq=16, bias=False)
    ids = torch.full((2, 2, 3), -1, device=DEVICE)
    for fn in (K.block_gather_reference, K.block_gather_copy_engine, K.block_gather):
        k_slots, v_slots, _ = run(fn, k_host, v_host, None, ids, 8)
        assert k_slots.isnan().all() and v_slots.isnan().all()


def aot_launches():
    """The NOSI geometry (block 64, d 128), fp32 and bf16, with and without bias."""
    for dtype in (torch.float32, torch.bfloat16):
        k_host, v_host, b_host, ids = make_case(batch=2, seq=300, heads=2, dim=128, block=64, slots=4, dtype=dtype)
        k_slots, v_slots, b_slots = poisoned_slots(2, 256, 2, 128, dtype, True)
        K.block_gather_triton(k_host, v_host, ids, k_slots, v_slots, 64, b_host, b_slots, num_programs=16)
        K.block_gather_triton(k_host, v_host, ids, k_slots, v_slots, 64, num_programs=32)
    # paged (the offloaded cache's host tier), bf16, with and without bias
    k_pool, v_pool, b_pool, ids, table = make_paged_case(
        batch=3, logical=5, physical=12, heads=2, dim=128, block=64, slots=4, dtype=torch.bfloat16
    )
    k_slots, v_slots, b_slots = poisoned_slots(3, 256, 2, 128, torch.bfloat16, True)
    K.block_gather_triton(
        k_pool, v_pool, ids, k_slots, v_slots, 64, b_pool, b_slots, num_programs=16, block_table=table
    )
    K.block_gather_triton(k_pool, v_pool, ids, k_slots, v_slots, 64, num_programs=16, block_table=table)
    # a pool destination (vLLM's pages [Q, H, page, d] through a transposed view), page 16, bf16 + CIS
    k_pool, v_pool, b_pool, ids, table = make_paged_case(
        batch=3, logical=5, physical=12, heads=2, dim=128, block=16, slots=4, dtype=torch.bfloat16
    )
    k_dev = torch.empty(12, 2, 16, 128, dtype=torch.bfloat16, device=DEVICE)
    b_dev = torch.empty(12, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    K.block_gather_triton(
        k_pool, v_pool, ids, k_dev.transpose(1, 2), k_dev.clone().transpose(1, 2), 16, b_pool, b_dev.transpose(1, 2),
        num_programs=16, block_table=table, dest_table=table,
    )  # fmt: skip


@aot_sm90
def test_compiles_for_sm90():
    """Compiled-mode errors the interpreter lets through would show here, without a GPU."""
    assert compile_sm90(__name__, "aot_launches") == 7


# ----------------------------------------------------------------------------------------------
# validation: rejected before launch, with the value and the limit in the message
# ----------------------------------------------------------------------------------------------

IMPLS = [K.block_gather_reference, K.block_gather_triton, K.block_gather_copy_engine, K.block_gather]


GATHER_ARGS = ("k_host", "v_host", "load_ids", "k_slots", "v_slots", "block_size", "bias_host", "bias_slots")


def named_args(*values, **rest) -> dict:
    """block_gather's arguments by name, the positional ones in order: tests change one of them."""
    return dict(zip(GATHER_ARGS, values), **rest)


def _args(**changes):
    k_host, v_host, b_host, ids = make_case(seq=29, block=8, slots=3)
    k_slots, v_slots, b_slots = poisoned_slots(2, 24, 2, 16, torch.float32, True)
    args = named_args(k_host, v_host, ids, k_slots, v_slots, 8, b_host, b_slots, num_programs=4)
    args.update(changes)
    return args


@pytest.mark.parametrize("fn", IMPLS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "changes, error, match",
    [
        (
            lambda a: {"load_ids": a["load_ids"].fill_(4)},
            ValueError,
            r"load_ids has value 4 >= 4, the limit .*S=29, block_size=8",
        ),
        (lambda a: {"load_ids": a["load_ids"].fill_(-2)}, ValueError, r"load_ids has value -2 < -1"),
        (lambda a: {"load_ids": a["load_ids"].float()}, TypeError, r"load_ids has dtype torch.float32"),
        (
            lambda a: {"load_ids": a["load_ids"][:, :1]},
            ValueError,
            r"load_ids has shape \(2, 1, 3\), expected \(2, 2, 3\)",
        ),
        (lambda a: {"k_slots": a["k_slots"].half()}, TypeError, r"dtypes must be equal: .*k_slots=torch.float16"),
        (
            lambda a: {"k_slots": a["k_slots"][:, :20]},
            ValueError,
            r"k_slots has shape \(2, 20, 2, 16\), expected \(2, 24, 2, 16\)",
        ),
        (lambda a: {"v_host": a["v_host"][:, :-1]}, ValueError, r"v_host has shape .*must match k_host"),
        (lambda a: {"bias_slots": None}, ValueError, r"bias_host and bias_slots must be given together"),
        (lambda a: {"bias_slots": a["bias_slots"].double()}, TypeError, r"bias_slots has dtype torch.float64"),
        (lambda a: {"block_size": 0}, ValueError, r"block_size must be a positive integer, got 0"),
        (lambda a: {"num_programs": 0}, ValueError, r"num_programs must be a positive integer, got 0"),
    ],
)
def test_rejects_bad_inputs(fn, changes, error, match):
    args = _args()
    args.update(changes(args))
    with pytest.raises(error, match=match):
        fn(**args)
    assert args["k_slots"].isnan().all(), "nothing may be written before the error"


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_rejects_pageable_host_memory():
    args = _args()
    args["k_host"] = torch.randn(args["k_host"].shape)  # pageable
    assert not args["k_host"].is_pinned()
    for fn in (K.block_gather_triton, K.block_gather):
        with pytest.raises(ValueError, match=r"k_host is pageable host memory.*pinned"):
            fn(**args)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("num_programs", [16, 32, 64])
def test_realistic_sizes_cuda(num_programs):
    """NOSI geometry from pinned host memory (block 64, d 128, 64 slots, bf16), compiled: exact."""
    k_host, v_host, b_host, ids = make_case(
        batch=4, seq=4000, heads=8, dim=128, block=64, slots=64, dtype=torch.bfloat16, skip_frac=0.5
    )
    refs = run(K.block_gather_reference, k_host, v_host, b_host, ids, 64)
    outs = run(K.block_gather_triton, k_host, v_host, b_host, ids, 64, num_programs=num_programs)
    assert_same(outs, refs)


# ----------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------


@needs_triton
def test_dispatch_runs_the_kernel(monkeypatch):
    """Forced triton and forced reference give the same slots through the public entry point."""
    k_host, v_host, b_host, ids = make_case()
    with K.use_backend("triton"):
        outs = run(K.block_gather, k_host, v_host, b_host, ids, 8)
    with K.use_backend("reference"):
        refs = run(K.block_gather, k_host, v_host, b_host, ids, 8)
    assert_same(outs, refs)


# ----------------------------------------------------------------------------------------------
# paged host (a pool of physical blocks and a block table): the offloaded cache's host tier
# ----------------------------------------------------------------------------------------------


def make_paged_case(batch=3, logical=4, physical=7, heads=2, dim=16, block=8, slots=3, dtype=torch.float32, bias=True):
    """A pool [P, block, H, d], a table in which two sequences share physical blocks (a fork) and
    one entry is -1, and logical ids incl. -1, a block whose table entry is -1, and the last one."""
    k_pool = host(torch.randn(physical, block, heads, dim).to(dtype))
    v_pool = host(torch.randn(physical, block, heads, dim).to(dtype))
    b_pool = host(torch.randn(physical, block, heads).to(dtype)) if bias else None
    table = torch.stack([torch.randperm(physical)[:logical] for _ in range(batch)])
    table[1, :2] = table[0, :2]  # sequence 1 shares sequence 0's first two blocks
    table[2, 1] = -1
    ids = torch.randint(-1, logical, (heads, batch, slots))
    ids[0, 2, 0], ids[1, 0, 2] = 1, logical - 1
    return k_pool, v_pool, b_pool, ids.to(DEVICE), table.to(DEVICE)


def run_paged(fn, k_pool, v_pool, b_pool, ids, table, block, num_programs=4, check_ids=True):
    batch, heads, dim = table.shape[0], k_pool.shape[2], k_pool.shape[3]
    k_slots, v_slots, b_slots = poisoned_slots(
        batch, ids.shape[2] * block, heads, dim, k_pool.dtype, b_pool is not None
    )
    fn(
        k_pool,
        v_pool,
        ids,
        k_slots,
        v_slots,
        block,
        b_pool,
        b_slots,
        num_programs=num_programs,
        check_ids=check_ids,
        block_table=table,
    )
    return k_slots, v_slots, b_slots


def test_paged_reference_reads_through_the_table():
    """Task (h, b, m) with logical id i copies all rows of physical block table[b, i] (by a loop
    over tasks); -1 ids and -1 table entries leave the slot rows untouched."""
    k_pool, v_pool, b_pool, ids, table = make_paged_case()
    outs = run_paged(K.block_gather_reference, k_pool, v_pool, b_pool, ids, table, 8)
    expected = [torch.full_like(o.cpu(), float("nan")) for o in outs]
    for h, b, m in zip(
        *[x.flatten().tolist() for x in torch.meshgrid(*(torch.arange(n) for n in ids.shape), indexing="ij")]
    ):
        i = int(ids[h, b, m])
        phys = int(table[b, i]) if i >= 0 else -1
        if phys >= 0:
            for out, pool in zip(expected, (k_pool, v_pool, b_pool)):
                out[b, m * 8 : m * 8 + 8, h] = pool[phys, :, h].cpu()
    assert_same([o.cpu() for o in outs], expected)
    assert outs[0][2].isnan().any()  # the -1 entry of sequence 2 skipped its task


@pytest.mark.parametrize("fn", GATHERS.values())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_paged_matches_reference(fn, dtype, bias):
    k_pool, v_pool, b_pool, ids, table = make_paged_case(dtype=dtype, bias=bias)
    assert_same(
        run_paged(fn, k_pool, v_pool, b_pool, ids, table, 8),
        run_paged(K.block_gather_reference, k_pool, v_pool, b_pool, ids, table, 8),
    )


@needs_triton
def test_paged_odd_block_strided_pool_and_table():
    """Block 6 and head dim 12 (padded tiles), a pool that is a view of a wider buffer, a transposed table."""
    wide = host(torch.randn(5, 6, 2, 24))
    k_pool, v_pool = wide[..., :12], wide[..., 12:]
    b_pool = host(torch.randn(5, 2, 6)).transpose(1, 2)
    table = torch.randint(-1, 5, (3, 2), device=DEVICE).t()  # [B=2, NB=3], strides (1, 2)
    ids = torch.randint(-1, 3, (2, 2, 2), device=DEVICE)
    assert_same(
        run_paged(K.block_gather_triton, k_pool, v_pool, b_pool, ids, table, 6),
        run_paged(K.block_gather_reference, k_pool, v_pool, b_pool, ids, table, 6),
    )


@needs_triton
def test_paged_unchecked_bad_table_entries_are_skipped():
    k_pool, v_pool, b_pool, ids, table = make_paged_case()
    bad = table.clone()
    bad[0, :] = 99  # past the pool's 7 blocks
    outs = run_paged(K.block_gather_triton, k_pool, v_pool, b_pool, ids, bad, 8, check_ids=False)
    good = bad.masked_fill(bad >= 7, -1)
    assert_same(outs, run_paged(K.block_gather_reference, k_pool, v_pool, b_pool, ids, good, 8))
    assert outs[0][0].isnan().all()


@pytest.mark.parametrize(
    "fn", [K.block_gather_reference, K.block_gather_triton, K.block_gather_copy_engine], ids=lambda f: f.__name__
)
@pytest.mark.parametrize(
    "change, error, match",
    [
        (
            lambda c: {"block_table": c["block_table"].fill_(7)},
            ValueError,
            r"block_table has value 7 >= 7, the limit \(the pool's 7 physical blocks\)",
        ),
        (
            lambda c: {"load_ids": c["load_ids"].fill_(4)},
            ValueError,
            r"load_ids has value 4 >= 4, the limit \(the block table's 4 logical blocks\)",
        ),
        (
            lambda c: {"k_host": c["k_host"][:, :4], "v_host": c["v_host"][:, :4]},
            ValueError,
            r"k_host has shape \(7, 4, 2, 16\), expected \(7, 8, 2, 16\) \(a pool",
        ),
        (lambda c: {"block_table": c["block_table"].float()}, TypeError, r"block_table has dtype torch.float32"),
        (
            lambda c: {"block_table": c["block_table"][:2]},
            ValueError,
            r"load_ids has shape \(2, 3, 3\), expected \(2, 2, 3\)",
        ),
    ],
)
def test_paged_rejects_bad_inputs(fn, change, error, match):
    k_pool, v_pool, b_pool, ids, table = make_paged_case()
    k_slots, v_slots, b_slots = poisoned_slots(3, 24, 2, 16, torch.float32, True)
    args = named_args(k_pool, v_pool, ids, k_slots, v_slots, 8, b_pool, b_slots, num_programs=4, block_table=table)
    args.update(change(args))
    with pytest.raises(error, match=match):
        fn(**args)
    assert k_slots.isnan().all(), "nothing may be written before the error"


# ----------------------------------------------------------------------------------------------
# pool destination (`dest_table`): vLLM's pages, written in place
# ----------------------------------------------------------------------------------------------


def run_into_pool(fn, k_pool, v_pool, b_pool, ids, table, dest, pages, block, layout="pages", check_ids=True):
    """Gather into a NaN device pool of `pages` blocks; layout "pages" is vLLM's [Q, H, page, d]
    read through a transposed view (what the connector hands the kernel)."""
    heads, dim = k_pool.shape[2], k_pool.shape[3]
    shape = (pages, heads, block, dim) if layout == "pages" else (pages, block, heads, dim)
    k_dev = torch.full(shape, float("nan"), dtype=k_pool.dtype, device=DEVICE)
    v_dev = torch.full_like(k_dev, float("nan"))
    b_dev = None if b_pool is None else torch.full(shape[:3], float("nan"), dtype=k_pool.dtype, device=DEVICE)
    views = [None if t is None else (t.transpose(1, 2) if layout == "pages" else t) for t in (k_dev, v_dev, b_dev)]
    fn(k_pool, v_pool, ids, views[0], views[1], block, b_pool, views[2], num_programs=3, check_ids=check_ids,
       block_table=table, dest_table=dest)  # fmt: skip
    return views


def test_pool_destination_reference_by_a_loop():
    """Task (h, b, m) with logical id i copies head h of host block table[b, i] into head h of device
    block dest[b, i]; -1 ids and -1 entries of either table copy nothing."""
    k_pool, v_pool, b_pool, ids, table = make_paged_case()
    dest = torch.stack([torch.randperm(9)[:4] for _ in range(3)]).to(DEVICE)
    dest[0, 3] = -1
    outs = run_into_pool(K.block_gather_reference, k_pool, v_pool, b_pool, ids, table, dest, 9, 8)
    expected = [torch.full_like(o.cpu(), float("nan")) for o in outs]
    for h, b, m in zip(
        *[x.flatten().tolist() for x in torch.meshgrid(*(torch.arange(n) for n in ids.shape), indexing="ij")]
    ):
        i = int(ids[h, b, m])
        source, target = (int(table[b, i]), int(dest[b, i])) if i >= 0 else (-1, -1)
        if source >= 0 and target >= 0:
            for out, pool in zip(expected, (k_pool, v_pool, b_pool)):
                out[target, :, h] = pool[source, :, h].cpu()
    assert_same([o.cpu() for o in outs], expected)
    assert not all(torch.isnan(o).all() for o in outs) and outs[0].isnan().any()


@pytest.mark.parametrize("copying", ["some", "none"])
def test_pool_destination_reference_reads_nothing_back(copying):
    """The pool reference writes every task at fixed shapes (the connector's decode step on the CPU makes
    no host read): skipped tasks repeat the first copying one, and when none copies the pool is unchanged."""
    from tests.strict_device import count_host_reads

    k_pool, v_pool, b_pool, ids, table = make_paged_case()
    if copying == "none":
        ids = torch.full_like(ids, -1)
    dest = torch.stack([torch.randperm(9)[:4] for _ in range(3)]).to(DEVICE)
    expected = run_into_pool(K.block_gather_reference, k_pool, v_pool, b_pool, ids, table, dest, 9, 8, check_ids=True)
    with count_host_reads() as counter:
        outs = run_into_pool(K.block_gather_reference, k_pool, v_pool, b_pool, ids, table, dest, 9, 8, check_ids=False)
    assert counter.reads == 0, counter.report()
    assert_same(outs, expected)
    assert all(o.isnan().all() for o in outs) == (copying == "none")


@pytest.mark.parametrize("fn", GATHERS.values())
@pytest.mark.parametrize("layout", ["pages", "blocks"])
@pytest.mark.parametrize("bias", [True, False])
def test_pool_destination_matches_reference(fn, layout, bias):
    k_pool, v_pool, b_pool, ids, table = make_paged_case(bias=bias)
    dest = table.clone()  # the connector's case: host block ids are the device page ids
    assert_same(
        run_into_pool(fn, k_pool, v_pool, b_pool, ids, table, dest, 7, 8, layout),
        run_into_pool(K.block_gather_reference, k_pool, v_pool, b_pool, ids, table, dest, 7, 8, layout),
    )


@needs_triton
def test_pool_destination_unchecked_bad_entries_are_skipped():
    k_pool, v_pool, b_pool, ids, table = make_paged_case()
    dest = table.clone()
    dest[1, :] = 50  # past the device pool's 7 blocks
    outs = run_into_pool(K.block_gather_triton, k_pool, v_pool, b_pool, ids, table, dest, 7, 8, check_ids=False)
    good = dest.masked_fill(dest >= 7, -1)
    assert_same(outs, run_into_pool(K.block_gather_reference, k_pool, v_pool, b_pool, ids, table, good, 7, 8))


@pytest.mark.parametrize(
    "fn", [K.block_gather_reference, K.block_gather_triton, K.block_gather_copy_engine], ids=lambda f: f.__name__
)
@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda c: {"dest_table": c["dest_table"].fill_(5)}, ValueError, r"dest_table has value 5 >= 5, the limit"),
        (lambda c: {"dest_table": c["dest_table"][:, :2]}, ValueError, r"dest_table has shape \(3, 2\), expected"),
        (lambda c: {"block_table": None}, ValueError, r"dest_table \(a pool destination\) needs a block_table"),
        (
            lambda c: {"k_slots": c["k_slots"][:, :4], "v_slots": c["v_slots"][:, :4]},
            ValueError,
            r"k_slots has shape \(5, 4, 2, 16\), expected \(5, 8, 2, 16\) \(a device pool",
        ),
    ],
)
def test_pool_destination_rejects_bad_inputs(fn, change, error, match):
    k_pool, v_pool, b_pool, ids, table = make_paged_case()
    k_dev = torch.full((5, 8, 2, 16), float("nan"), device=DEVICE)
    v_dev, b_dev = k_dev.clone(), k_dev[..., 0].clone()
    args = named_args(k_pool, v_pool, ids, k_dev, v_dev, 8, b_pool, b_dev, num_programs=4, block_table=table,
                      dest_table=table.clamp(max=4))  # fmt: skip
    args.update(change(args))
    with pytest.raises(error, match=match):
        fn(**args)
    assert k_dev.isnan().all(), "nothing may be written before the error"
