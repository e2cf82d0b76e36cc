"""block_scores / agnostic_scores: the Triton kernels and their plain-PyTorch references, both
against `selection.py` (the single source of selection semantics), in every scoring mode:
query (exact and MiniCPM4.1's coarse LSE), forecast (raw dot, multi-vector softmax), NOSA agnostic."""

from __future__ import annotations

import pytest
import torch

import forecastkv.kernels as K
from forecastkv.modeling import selection as sel
from forecastkv.modeling.configuration import SparseConfig

from .conftest import CUDA, DEVICE, aot_sm90, assert_close, compile_sm90, needs_triton

# MiniCPM-like ratios at toy scale (p = 2s, bs = 4s), and a geometry with p = s and bs = 2s
SPARSE = SparseConfig(kernel_size=4, kernel_stride=2, block_size=8, init_blocks=1, window_size=8, topk=2, dense_len=0)
SPARSE_ALT = SparseConfig(
    kernel_size=3, kernel_stride=3, block_size=6, init_blocks=2, window_size=12, topk=2, dense_len=0
)


def case(
    kind, group, dtype=torch.float32, batch=3, heads=2, dim=16, sparse=SPARSE, positions=(45, 13, -1), strided=True
):
    """Vectors [B, H*n, d] and compressed keys for the longest row (strided views unless
    `strided=False`), positions."""
    pos = torch.tensor(positions[:batch], device=DEVICE)
    count = sel.num_compressed(int(pos.max()) + 1, sparse.kernel_size, sparse.kernel_stride)
    n_blocks = sel.num_blocks(int(pos.max()) + 1, sparse.block_size)
    width = heads * group
    vectors = torch.randn(batch, 2 * width, dim, device=DEVICE).to(dtype)
    vectors = vectors[:, ::2] if strided else vectors[:, :width]
    ckeys = torch.randn(batch, heads, count, dim, device=DEVICE).to(dtype)
    ckeys = ckeys.transpose(1, 2) if strided else ckeys.transpose(1, 2).contiguous()  # [B, C, H, d]
    return vectors, ckeys, pos, n_blocks


def poisoned_out(vectors, ckeys, n_blocks):
    return torch.full((vectors.shape[0], ckeys.shape[2], n_blocks), float("nan"), device=vectors.device)


@needs_triton
@pytest.mark.parametrize(
    "kind, group",
    [("query", 1), ("query", 3), ("query", 16), ("forecast", 1), ("forecast", 3)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(kind, group, dtype):
    vectors, ckeys, pos, n_blocks = case(kind, group, dtype)
    ref = K.block_scores_reference(vectors, ckeys, pos, SPARSE, n_blocks, kind, sel.visibility_lag(kind))
    out = poisoned_out(vectors, ckeys, n_blocks)
    got = K.block_scores_triton(vectors, ckeys, pos, SPARSE, n_blocks, kind, sel.visibility_lag(kind), out=out)
    assert got is out and not out.isnan().any()
    assert_close(got, ref, dtype)
    # the case covers every kind of entry: forced, pooled, invisible / padding
    assert (ref == float("inf")).any() and (ref == float("-inf")).any() and torch.isfinite(ref).any()


@needs_triton
@pytest.mark.parametrize("kind, group", [("query", 3), ("forecast", 1)])
def test_other_geometry_more_blocks_and_lag(kind, group):
    """p = s, bs = 2s, two init blocks, extra (future) blocks, an explicit lag, odd head dim."""
    vectors, ckeys, pos, n_blocks = case(kind, group, dim=12, sparse=SPARSE_ALT, positions=(40, 2, 17), strided=False)
    for lag in (0, 2):
        ref = K.block_scores_reference(vectors, ckeys, pos, SPARSE_ALT, n_blocks + 3, kind, lag=lag)
        assert_close(
            K.block_scores_triton(vectors, ckeys, pos, SPARSE_ALT, n_blocks + 3, kind, lag=lag), ref, torch.float32
        )


@pytest.mark.parametrize(
    "impl",
    [
        pytest.param(K.block_scores_triton, marks=needs_triton, id="triton"),
        pytest.param(K.block_scores_reference, id="reference"),
    ],
)
def test_no_compressed_keys_yet(impl):
    """Early decode: C = 0, only forced blocks are finite (+inf)."""
    vectors, _, pos, _ = case("query", 3, positions=(9, 0, -1))
    ckeys = torch.randn(3, 0, 2, 16, device=DEVICE)
    got = impl(vectors, ckeys, pos, SPARSE, 2, "query", 0)
    expected = torch.tensor([[float("inf")] * 2, [float("inf"), float("-inf")], [float("-inf")] * 2], device=DEVICE)
    assert torch.equal(got, expected.unsqueeze(1).expand(-1, 2, -1))


def coarse_keys_for(ckeys_like, pos, sparse, dim=16, dtype=torch.float32):
    """Random coarse (k2) keys [B, C2, H, d] for the longest row."""
    p2, s2 = sparse.coarse_kernel
    count = sel.num_compressed(int(pos.max()) + 1, p2, s2)
    return torch.randn(ckeys_like.shape[0], count, ckeys_like.shape[2], dim, device=DEVICE).to(dtype)


IMPLS = [
    pytest.param(K.block_scores_reference, id="reference"),
    pytest.param(K.block_scores_triton, marks=needs_triton, id="triton"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "kind, group, coarse",
    [("query", 3, False), ("query", 3, True), ("query", 1, True), ("forecast", 1, False), ("forecast", 3, False)],
)
def test_matches_selection(impl, kind, group, coarse):
    """Reference and kernel equal `selection.score_blocks` on one row (lag 0 / 1 by kind)."""
    vectors, ckeys, pos, n_blocks = case(kind, group, positions=(45, 30, -1))
    lse_keys = coarse_keys_for(ckeys, pos, SPARSE) if coarse else None
    if coarse:
        assert lse_keys.shape[1] > 0  # rows 45 and 30 see coarse keys (window 16, stride 8)
    expected = sel.score_blocks(
        vectors[:, None],
        ckeys,
        pos[:, None],
        SPARSE,
        n_blocks,
        kind=kind,
        lag=0 if kind == "query" else 1,
        lse_keys=lse_keys,
    )[:, :, 0]
    out = poisoned_out(vectors, ckeys, n_blocks)
    got = impl(vectors, ckeys, pos, SPARSE, n_blocks, kind, sel.visibility_lag(kind), out=out, lse_keys=lse_keys)
    assert got is out and not out.isnan().any()
    assert_close(got, expected, torch.float32)
    if coarse:  # the coarse LSE is a different normalisation: it must change the scores
        exact = sel.score_blocks(vectors[:, None], ckeys, pos[:, None], SPARSE, n_blocks, kind=kind)[:, :, 0]
        finite = torch.isfinite(exact)
        assert (got[finite] - exact[finite]).abs().max() > 1e-3


AGNOSTIC = [
    pytest.param(K.agnostic_scores_reference, id="reference"),
    pytest.param(K.agnostic_scores_triton, marks=needs_triton, id="triton"),
]


@pytest.mark.parametrize("impl", AGNOSTIC)
@pytest.mark.parametrize(
    "sparse, lag", [(SPARSE, 0), (SPARSE, 1), (SPARSE_ALT, 0)], ids=["minicpm-like", "lag1", "alt-geometry"]
)
def test_agnostic_matches_selection(impl, sparse, lag):
    """NOSA's agnostic score from the pooled CIS equals `selection.agnostic_block_scores`."""
    pos = torch.tensor([45, 13, 0, -1], device=DEVICE)
    cis = torch.randn(4, 46, 2, device=DEVICE)  # [B, S, H]
    pooled = sel.compress_keys(cis.float(), sparse.kernel_size, sparse.kernel_stride)  # [B, C, H]
    n_blocks = sel.num_blocks(46, sparse.block_size) + 1
    expected = sel.agnostic_block_scores(cis, pos[:, None], sparse, n_blocks, lag=lag)[:, :, 0]
    out = poisoned_out(pooled.transpose(1, 2), pooled.unsqueeze(-1), n_blocks)
    got = impl(pooled, pos, sparse, n_blocks, lag, out=out)
    assert got is out and not out.isnan().any()
    assert_close(got, expected, torch.float32)
    assert (expected == float("inf")).any() and (expected == float("-inf")).any() and torch.isfinite(expected).any()


def test_kernels_are_leaves():
    """kernels/ imports nothing from the rest of the package (the model calls the kernels)."""
    import ast
    from pathlib import Path

    for path in (Path(K.__file__).parent).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                raise AssertionError(f"{path.name} imports from the package: from {'.' * node.level}{node.module}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(n and n.startswith("forecastkv") for n in names), (path.name, names)


@needs_triton
def test_topk_on_kernel_scores_matches():
    """Selections built from kernel scores equal the reference selections (the point of the scores)."""
    vectors, ckeys, pos, n_blocks = case("query", 3, positions=(45, 30, 20))
    ref = K.block_scores_reference(vectors, ckeys, pos, SPARSE, n_blocks, "query", 0)
    got = K.block_scores_triton(vectors, ckeys, pos, SPARSE, n_blocks, "query", 0)
    pick = lambda s: sel.topk_blocks(s[:, :, None], pos[:, None], 4, SPARSE.block_size)
    assert torch.equal(pick(got), pick(ref))


def aot_launches():
    """MiniCPM4.1 geometry (pooling window 5, d 128), bf16: softmax with tl.dot, raw dot, small-group
    softmax, coarse LSE, agnostic scores."""
    sparse = SparseConfig()
    for kind, group in (("query", 4), ("forecast", 1), ("forecast", 2)):
        vectors, ckeys, pos, n_blocks = case(
            kind, group, torch.bfloat16, batch=2, dim=128, sparse=sparse, positions=(1000, 500)
        )
        K.block_scores_triton(vectors, ckeys, pos, sparse, n_blocks, kind, sel.visibility_lag(kind))
    # MiniCPM4.1's coarse LSE (G = 16) and NOSA's agnostic score
    vectors, ckeys, pos, n_blocks = case(
        "query", 16, torch.bfloat16, batch=2, dim=128, sparse=sparse, positions=(1000, 500)
    )
    K.block_scores_triton(
        vectors,
        ckeys,
        pos,
        sparse,
        n_blocks,
        "query",
        0,
        lse_keys=coarse_keys_for(ckeys, pos, sparse, 128, torch.bfloat16),
    )
    K.agnostic_scores_triton(torch.randn(2, 61, 2, device=DEVICE).to(torch.bfloat16), pos, sparse, n_blocks)


@aot_sm90
def test_compiles_for_sm90():
    """Compiled-mode errors the interpreter lets through would show here, without a GPU."""
    assert compile_sm90(__name__, "aot_launches") == 5


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn", [K.block_scores_reference, K.block_scores_triton, K.block_scores], ids=lambda f: f.__name__
)
@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: {"kind": "keys"}, ValueError, r"score kind 'keys' is not one of \('query', 'forecast'\)"),
        (
            lambda a: {"vectors": a["vectors"][:, :5]},
            ValueError,
            r"vectors has 5 heads, which is not a multiple of H_kv=2",
        ),
        (lambda a: {"vectors": a["vectors"][..., :8]}, ValueError, r"ckeys has shape .* d=8"),
        (lambda a: {"positions": a["positions"][:2]}, ValueError, r"positions has shape \(2,\), expected \(3,\)"),
        (lambda a: {"positions": a["positions"].float()}, TypeError, r"positions has dtype torch.float32"),
        (lambda a: {"ckeys": a["ckeys"].double()}, TypeError, r"ckeys has dtype torch.float64"),
        (lambda a: {"n_blocks": -1}, ValueError, r"n_blocks must be a non-negative integer, got -1"),
        (
            lambda a: {"out": torch.zeros(3, 2, 1, device=DEVICE)},
            ValueError,
            r"out has shape \(3, 2, 1\), expected \(3, 2, 6\)",
        ),
        (lambda a: {"lag": -1}, ValueError, r"lag must be a non-negative integer, got -1"),
        (
            lambda a: {"lag": None},
            ValueError,
            r"lag is required for kind 'query': pass selection.visibility_lag\(kind\)",
        ),
    ],
)
def test_rejects_bad_inputs(fn, change, error, match):
    vectors, ckeys, pos, n_blocks = case("query", 3)
    args = dict(vectors=vectors, ckeys=ckeys, positions=pos, sparse=SPARSE, n_blocks=n_blocks, kind="query", lag=0)
    args.update(change(args))
    with pytest.raises(error, match=match):
        fn(**args)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("kind, group", [("query", 4), ("query", 16), ("forecast", 1), ("forecast", 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_realistic_sizes_cuda(kind, group, dtype):
    """MiniCPM4.1 geometry (p 32, s 16, bs 64, window 2048) at 16K tokens, compiled."""
    sparse = SparseConfig()
    vectors, ckeys, pos, n_blocks = case(
        kind, group, dtype, batch=4, heads=8, dim=128, sparse=sparse, positions=(16383, 9000, 100, -1)
    )
    ref = K.block_scores_reference(vectors, ckeys, pos, sparse, n_blocks, kind, sel.visibility_lag(kind))
    assert_close(
        K.block_scores_triton(vectors, ckeys, pos, sparse, n_blocks, kind, sel.visibility_lag(kind)), ref, dtype
    )
