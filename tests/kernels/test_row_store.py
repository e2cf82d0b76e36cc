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


@pytest.mark.parametrize("change, error, match", [
    (lambda c: {"positions": c[2].float()}, TypeError, r"positions has dtype torch.float32"),
    (lambda c: {"k_new": c[0][:2]}, ValueError, r"k_new has shape \(2, 2, 12\), expected \(3, 2, 12\)"),
    (lambda c: {"v_host": c[4].double()}, TypeError, r"v_host has dtype torch.float64"),
    (lambda c: {"bias_host": None}, ValueError, r"bias_new and bias_host must be given together"),
])
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


@aot_sm90
def test_compiles_for_sm90():
    """Compiled-mode errors the interpreter lets through would show here, without a GPU."""
    assert compile_sm90(__name__, "aot_launches") == 4
