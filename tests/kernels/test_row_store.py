"""row_store (the decode step's D2H write-back): Triton kernel against the reference, the reference
against plain per-sequence assignment, validation."""

from __future__ import annotations

import pytest
import torch

import forecastkv.kernels as K

from .conftest import DEVICE, aot_sm90, compile_sm90, host, needs_triton

STORES = {
    "reference": pytest.param(K.row_store_reference, id="reference"),
    "triton": pytest.param(K.row_store_triton, marks=needs_triton, id="triton"),
}


def make_case(batch=3, seq=21, heads=2, dim=12, dtype=torch.float32, bias=True):
    """NaN-filled host stores (every untouched row must stay NaN), new rows, positions incl. -1,
    the last row and one past the end (both skip or hit the edge)."""
    nan = float("nan")
    k_host = host(torch.full((batch, seq, heads, dim), nan, dtype=dtype))
    v_host = host(torch.full((batch, seq, heads, dim), nan, dtype=dtype))
    b_host = host(torch.full((batch, seq, heads), nan, dtype=dtype)) if bias else None
    k_new = torch.randn(batch, heads, dim, device=DEVICE).to(dtype)
    v_new = torch.randn(batch, heads, dim, device=DEVICE).to(dtype)
    b_new = torch.randn(batch, heads, device=DEVICE).to(dtype) if bias else None
    positions = torch.tensor([5, -1, seq - 1][:batch] + [seq] * max(0, batch - 3), device=DEVICE)
    return k_new, v_new, positions, k_host, v_host, b_new, b_host


def expected(k_new, v_new, positions, k_host, v_host, b_new, b_host):
    """Plain per-sequence assignment on host copies."""
    outs = [k_host.clone(), v_host.clone(), None if b_host is None else b_host.clone()]
    for b, pos in enumerate(positions.tolist()):
        if 0 <= pos < k_host.shape[1]:
            outs[0][b, pos] = k_new[b].cpu()
            outs[1][b, pos] = v_new[b].cpu()
            if b_host is not None:
                outs[2][b, pos] = b_new[b].cpu()
    return outs


@pytest.mark.parametrize("fn", STORES.values())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_store_matches_assignment(fn, dtype, bias):
    case = make_case(dtype=dtype, bias=bias)
    want = expected(*case)
    fn(*case)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    for got, ref in zip(case[3:5] + (case[6],), want):
        if ref is not None:
            assert torch.equal(got.isnan(), ref.isnan())  # exactly the stored rows changed
            assert torch.equal(got.nan_to_num(), ref.nan_to_num())


@pytest.mark.parametrize("fn", STORES.values())
def test_strided_host_store(fn):
    """A host store that is a view (heads-major, a slice of a larger buffer) is written in place."""
    k_new, v_new, positions, k_host, v_host, _, _ = make_case(bias=False)
    big = host(torch.full((3, 2, 30, 12), float("nan")))
    k_view = big.permute(0, 2, 1, 3)[:, :21]  # [B, S, H, d] with non-standard strides
    want = expected(k_new, v_new, positions, k_view, v_host, None, None)
    fn(k_new, v_new, positions, k_view, v_host)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(k_view.nan_to_num(), want[0].nan_to_num())
    assert big.permute(0, 2, 1, 3)[:, 21:].isnan().all()  # nothing written outside the view


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda c: {"positions": c[2].float()}, TypeError, r"positions has dtype torch.float32"),
        (lambda c: {"k_new": c[0][:2]}, ValueError, r"k_new has shape \(2, 2, 12\), expected \(3, 2, 12\)"),
        (lambda c: {"v_host": c[4].double()}, TypeError, r"v_host has dtype torch.float64"),
        (lambda c: {"bias_host": None}, ValueError, r"bias_new and bias_host must be given together"),
    ],
)
def test_bad_input_is_named(change, error, match):
    case = make_case()
    names = ("k_new", "v_new", "positions", "k_host", "v_host", "bias_new", "bias_host")
    args = dict(zip(names, case))
    args.update(change(case))
    with pytest.raises(error, match=match):
        K.row_store(**args)


def aot_launches() -> None:
    """The launches the sm_90 compile check traces: with and without bias, bf16 and fp32."""
    for dtype in (torch.float32, torch.bfloat16):
        for bias in (True, False):
            K.row_store_triton(*make_case(dtype=dtype, bias=bias))
    for bias in (True, False):  # paged (the offloaded cache's host tier)
        case = make_paged_case(dtype=torch.bfloat16, bias=bias)
        K.row_store_triton(*case[:7], block_table=case[7])


@aot_sm90
def test_compiles_for_sm90():
    """Compiled-mode errors the interpreter lets through would show here, without a GPU."""
    assert compile_sm90(__name__, "aot_launches") == 6


# -- paged host (a pool of physical blocks and a block table) -------------------------------------


def make_paged_case(batch=4, logical=3, physical=9, block=4, heads=2, dim=12, dtype=torch.float32, bias=True):
    """A NaN pool, a table with a -1 entry and an id past the pool, positions that land in a
    mapped block, the -1 entry, the bad id, past the table's end and -1."""
    nan = float("nan")
    k_pool = host(torch.full((physical, block, heads, dim), nan, dtype=dtype))
    v_pool = host(torch.full((physical, block, heads, dim), nan, dtype=dtype))
    b_pool = host(torch.full((physical, block, heads), nan, dtype=dtype)) if bias else None
    table = torch.tensor([[4, 0, 7], [2, -1, 5], [1, 3, physical + 2], [6, 8, 0]])[:batch, :logical].to(DEVICE)
    positions = torch.tensor(
        [9, 5, 8, 12][:batch], device=DEVICE
    )  # block 2 row 1; the -1 block; the bad id; past 3 blocks of 4
    k_new = torch.randn(batch, heads, dim, device=DEVICE).to(dtype)
    v_new = torch.randn(batch, heads, dim, device=DEVICE).to(dtype)
    b_new = torch.randn(batch, heads, device=DEVICE).to(dtype) if bias else None
    return k_new, v_new, positions, k_pool, v_pool, b_new, b_pool, table


@pytest.mark.parametrize("fn", STORES.values())
@pytest.mark.parametrize("bias", [True, False])
def test_paged_store_writes_through_the_table(fn, bias):
    """Only sequence 0 has a valid destination: row 9 % 4 = 1 of physical block table[0, 2] = 7."""
    k_new, v_new, positions, k_pool, v_pool, b_new, b_pool, table = make_paged_case(bias=bias)
    fn(k_new, v_new, positions, k_pool, v_pool, b_new, b_pool, block_table=table)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(k_pool[7, 1], k_new[0].cpu()) and torch.equal(v_pool[7, 1], v_new[0].cpu())
    assert k_pool.isnan().sum() == k_pool.numel() - k_new[0].numel()  # nothing else written
    if bias:
        assert torch.equal(b_pool[7, 1], b_new[0].cpu()) and b_pool.isnan().sum() == b_pool.numel() - b_new[0].numel()


@pytest.mark.parametrize("fn", STORES.values())
def test_paged_store_matches_assignment_at_random_positions(fn):
    k_new, v_new, _, k_pool, v_pool, b_new, b_pool, _ = make_paged_case()
    table = torch.randperm(9)[:8].view(4, 2).to(DEVICE)
    positions = torch.tensor([0, 7, 3, 5], device=DEVICE)
    want = [k_pool.clone(), b_pool.clone()]
    for b, pos in enumerate(positions.tolist()):
        want[0][int(table[b, pos // 4]), pos % 4] = k_new[b].cpu()
        want[1][int(table[b, pos // 4]), pos % 4] = b_new[b].cpu()
    fn(k_new, v_new, positions, k_pool, v_pool, b_new, b_pool, block_table=table)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    for got, ref in zip((k_pool, b_pool), want):
        assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.nan_to_num(), ref.nan_to_num())


def test_paged_bad_input_is_named():
    case = make_paged_case()
    with pytest.raises(TypeError, match=r"block_table has dtype torch.float32"):
        K.row_store_reference(*case[:7], block_table=case[7].float())
    with pytest.raises(
        ValueError,
        match=r"k_new has shape \(4, 2, 12\), expected \(2, 2, 12\) \(\[B, H_kv, d\] with B from block_table\)",
    ):
        K.row_store_triton(*case[:7], block_table=case[7][:2])
