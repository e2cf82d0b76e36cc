"""The fused prefill stage-1 kernel (`kernels.stage1_block_scores_triton`) against selection.py,
its reference: block scores against `selection.score_blocks` / `pooled_agnostic_scores` into
NaN-poisoned outputs, and whole selections (`layer_selection`, the kernel forced by the backend
setting) against the eager ones, in every stage-1 mode: InfLLM-v2 with the exact and the coarse
LSE, NOSA, forecast vectors, GQA groups 1 / 3 / 16, left padding, a chunk starting mid-sequence,
and ties (the lower block id wins)."""

from __future__ import annotations

import pytest
import torch

import forecastkv.kernels as K
from forecastkv.modeling import selection as sel
from forecastkv.modeling.configuration import SparseConfig

from .conftest import DEVICE, aot_sm90, assert_close, compile_sm90, needs_triton

# MiniCPM-like ratios at toy scale (p = 2s, bs = 4s); topk 3 + 1 local block, NOSA shortlist 1
SPARSE = dict(
    kernel_size=4, kernel_stride=2, block_size=8, init_blocks=1, window_size=8, topk=3, dense_len=0, query_blocks=1
)


def config(**changes) -> SparseConfig:
    return SparseConfig(**{**SPARSE, **changes})


def chunk(group, heads=2, dim=16, rows=20, start=40, padded=0, batch=2, seed=0):
    """A prefill chunk: vectors [B, rows, H*group, d] at positions start.. (sequence 1 of the
    batch is `padded` rows shorter, left padded), compressed keys and raw CIS for the longest."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(start, start + rows).repeat(batch, 1)
    if padded:
        positions[1] = torch.arange(start - padded, start + rows - padded)
        positions[1, : max(padded - start, 0)] = -1  # rows before the sequence began: padding
    length = start + rows
    vectors = torch.randn(batch, rows, heads * group, dim, generator=gen)
    count = sel.num_compressed(length, 4, 2)
    ckeys = torch.randn(batch, count, heads, dim, generator=gen)
    cis = torch.randn(batch, length, heads, generator=gen)
    return vectors.to(DEVICE), ckeys.to(DEVICE), positions.to(DEVICE), cis.to(DEVICE)


def coarse_keys(ckeys, sparse, length, seed=1):
    p2, s2 = sparse.coarse_kernel
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(
        ckeys.shape[0], sel.num_compressed(length, p2, s2), ckeys.shape[2], ckeys.shape[3], generator=gen
    ).to(DEVICE)


def poisoned(vectors, ckeys, n_blocks):
    return torch.full((vectors.shape[0], ckeys.shape[2], vectors.shape[1], n_blocks), float("nan"), device=DEVICE)


def kernel_scores(vectors, ckeys, positions, sparse, n_blocks, kind, lse_keys=None, pooled=None):
    """The kernel into NaN-poisoned outputs; asserts every entry was written."""
    out = poisoned(vectors, ckeys, n_blocks)
    ag_out = poisoned(vectors, ckeys, n_blocks) if pooled is not None else None
    got, agnostic = K.stage1_block_scores_triton(
        vectors,
        ckeys,
        positions,
        sparse,
        n_blocks,
        kind,
        sel.visibility_lag(kind),
        lse_keys,
        pooled,
        out=out,
        agnostic_out=ag_out,
    )
    assert got is out and not out.isnan().any()
    if pooled is not None:
        assert agnostic is ag_out and not ag_out.isnan().any()
    return got, agnostic


def selections(vectors, ckeys, positions, sparse, kind, lse_keys=None, cis=None):
    """(kernel, eager) `layer_selection` of the chunk, both given the host bounds as prefill does."""
    bounds = sel.position_range(positions)
    out = []
    for backend in ("triton", "reference"):
        with K.use_backend(backend):
            assert K.use_stage1_kernel(vectors.device) == (backend == "triton")
            out.append(
                sel.layer_selection(vectors, ckeys, positions, sparse, kind, lse_keys=lse_keys, cis=cis, bounds=bounds)
            )
    return out


MODES = [  # (kind, group, sparse changes, coarse LSE)
    ("query", 1, {}, False),
    ("query", 3, {}, False),
    ("query", 16, {}, False),
    ("query", 3, {}, True),
    ("query", 16, {}, True),
    ("query", 3, {"policy": "nosa"}, False),
    ("forecast", 1, {}, False),
    ("forecast", 3, {}, False),
    ("forecast", 1, {"policy": "nosa"}, False),
]


@needs_triton
@pytest.mark.parametrize(
    "kind, group, changes, coarse",
    MODES,
    ids=[f"{k}-g{g}-{c.get('policy', 'infllmv2')}{'-coarse' if x else ''}" for k, g, c, x in MODES],
)
@pytest.mark.parametrize("layout", ["mid-sequence", "left-padded", "from-zero"])
def test_matches_selection(kind, group, changes, coarse, layout):
    start, padded, rows = {"mid-sequence": (40, 0, 20), "left-padded": (30, 37, 20), "from-zero": (0, 0, 34)}[layout]
    sparse = config(lse="coarse" if coarse else "exact", **changes)
    vectors, ckeys, positions, cis = chunk(group, rows=rows, start=start, padded=padded, heads=1 if group == 16 else 2)
    length = start + rows
    lse_keys = coarse_keys(ckeys, sparse, length) if coarse else None
    bounds = sel.position_range(positions)
    n_blocks = sel.num_blocks(bounds[1] + 1, sparse.block_size)
    lag = sel.visibility_lag(kind)
    nosa = sparse.policy == "nosa"
    pooled = sel.compress_keys(cis.float(), 4, 2) if nosa else None
    # block scores: the kernel on exactly the keys selection.score_blocks keeps for these bounds
    seen = sel.keys_seen(bounds[1], ckeys.shape[1], 4, 2, lag)
    seen2 = (
        None
        if lse_keys is None
        else lse_keys[:, : sel.keys_seen(bounds[1], lse_keys.shape[1], *sparse.coarse_kernel, lag)]
    )
    got, agnostic = kernel_scores(
        vectors, ckeys[:, :seen], positions, sparse, n_blocks, kind, seen2, None if pooled is None else pooled[:, :seen]
    )
    expected = sel.score_blocks(
        vectors, ckeys, positions, sparse, n_blocks, kind=kind, lse_keys=lse_keys, bounds=bounds
    )
    assert_close(got, expected, torch.float32)
    assert (expected == float("inf")).any() and (expected == float("-inf")).any() and torch.isfinite(expected).any()
    if nosa:
        assert_close(agnostic, sel.pooled_agnostic_scores(pooled, positions, sparse, n_blocks, lag), torch.float32)
    fused, eager = selections(vectors, ckeys, positions, sparse, kind, lse_keys, cis if nosa else None)
    assert torch.equal(fused, eager)
    assert (eager >= 0).any()
    if layout != "mid-sequence":  # early rows and padding rows leave budget unfilled
        assert (eager == -1).any()
    if layout == "left-padded":
        assert (positions < 0).any() and (eager[1, :, positions[1] < 0] == -1).all()


@needs_triton
def test_coarse_lse_changes_the_scores():
    """The coarse LSE is a different normalisation than the exact one (the parity above is not
    trivially met by computing the exact LSE in both)."""
    sparse = config(lse="coarse")
    vectors, ckeys, positions, _ = chunk(3, start=60)
    n_blocks = sel.num_blocks(80, 8)
    coarse, _ = kernel_scores(vectors, ckeys, positions, sparse, n_blocks, "query", coarse_keys(ckeys, sparse, 80))
    exact, _ = kernel_scores(vectors, ckeys, positions, sparse, n_blocks, "query")
    finite = torch.isfinite(exact)
    assert (coarse[finite] - exact[finite]).abs().max() > 1e-3


@needs_triton
@pytest.mark.parametrize("policy", ["infllmv2", "nosa"])
def test_ties_go_to_the_lower_block(policy):
    """Every compressed key equal (and NOSA's CIS constant): all free blocks tie exactly, and the
    lowest free block ids win, in the kernel as in selection.py."""
    sparse = config(policy=policy)
    vectors, ckeys, positions, cis = chunk(3, start=60)
    ckeys = ckeys[:, :1].expand_as(ckeys).contiguous()
    cis = torch.ones_like(cis)
    fused, eager = selections(vectors, ckeys, positions, sparse, "query", cis=cis if policy == "nosa" else None)
    assert torch.equal(fused, eager)
    # row at position 79: init block 0, local blocks 8 and 9 forced; the free picks are 1, 2 (, 3)
    free = sparse.budget_blocks - 3
    assert fused[0, 0, -1].tolist() == [0, *range(1, 1 + free), 8, 9]


@needs_triton
def test_bfloat16_inputs():
    """Half-precision chunks (what CUDA runs): upcast after loading in the interpreter."""
    sparse = config()
    vectors, ckeys, positions, _ = chunk(3)
    vectors, ckeys = vectors.bfloat16(), ckeys.bfloat16()
    bounds = sel.position_range(positions)
    n_blocks = sel.num_blocks(bounds[1] + 1, 8)
    got, _ = kernel_scores(vectors, ckeys, positions, sparse, n_blocks, "query")
    assert_close(
        got, sel.score_blocks(vectors, ckeys, positions, sparse, n_blocks, kind="query", bounds=bounds), torch.bfloat16
    )


def test_cpu_default_stays_eager():
    """auto: the fused kernel runs on CUDA only; the eager path stays the CPU one, even under the
    interpreter; forcing the reference backend turns it off everywhere."""
    with K.use_backend(None):
        assert K.use_stage1_kernel("cpu") is False
    with K.use_backend("reference"):
        assert K.use_stage1_kernel("cuda") is False


def test_bad_input_is_named():
    sparse = config()
    vectors, ckeys, positions, _ = chunk(3)
    with pytest.raises(ValueError, match="positions has shape"):
        K.stage1_block_scores_triton(vectors, ckeys, positions[:, :3], sparse, 4, "query", 0)
    with pytest.raises(ValueError, match="lag must be a non-negative integer"):
        K.stage1_block_scores_triton(vectors, ckeys, positions, sparse, 4, "query", -1)
    with pytest.raises(ValueError, match="not a multiple of H_kv"):
        K.stage1_block_scores_triton(vectors[..., :5, :], ckeys, positions, sparse, 4, "query", 0)


def aot_launches():
    """MiniCPM4.1 geometry (pooling window 5, d 128), bf16, the CUDA tile sizes: G = 16 with the
    coarse LSE, NOSA, forecast raw dot (one launch) and forecast softmax."""
    sparse = SparseConfig()
    for kind, group, policy, coarse in (
        ("query", 16, "infllmv2", True),
        ("query", 16, "nosa", False),
        ("forecast", 1, "infllmv2", False),
        ("forecast", 2, "infllmv2", False),
    ):
        gen = torch.Generator().manual_seed(0)
        vectors = torch.randn(1, 300, 2 * group, 128, generator=gen).bfloat16()
        ckeys = torch.randn(
            1, sel.num_compressed(1300, sparse.kernel_size, sparse.kernel_stride), 2, 128, generator=gen
        ).bfloat16()
        positions = torch.arange(1000, 1300).view(1, -1)
        lse_keys = coarse_keys(ckeys, sparse, 1300).bfloat16() if coarse else None
        pooled = torch.randn(1, ckeys.shape[1], 2, generator=gen) if policy == "nosa" else None
        K.stage1_block_scores_triton(
            vectors,
            ckeys,
            positions,
            sparse,
            sel.num_blocks(1300, sparse.block_size),
            kind,
            sel.visibility_lag(kind),
            lse_keys,
            pooled,
        )


@aot_sm90
def test_compiles_for_sm90():
    """Compiled-mode errors the interpreter lets through would show here, without a GPU."""
    assert compile_sm90(__name__, "aot_launches") == 7
