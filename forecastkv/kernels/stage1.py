"""stage1: the fused prefill stage-1 block scores (score, LSE, group sum, pool, force, NOSA).

Many query rows per call (a prefill chunk) scored against a layer's compressed keys.  The
semantics are `modeling/selection.py`'s: the reference of `stage1_block_scores_triton` is
`selection.score_blocks` (and `selection.pooled_agnostic_scores` for NOSA), which the tests call
(kernels are leaves and import nothing from the package, so the reference is not re-written here).
`selection.layer_selection` dispatches to this kernel (`selection.prefill_block_scores`) and ends
with the same `selection.select_blocks` top-k either way, so the tie rule is selection.py's: among
equal scores the lower block id wins.

Kernel layout (two launches, neither writes the [rows, C] score matrix):
  * `_lse_kernel`, one program per (sequence, query head, tile of rows): each row's log-sum-exp
    over the compressed keys it sees (exact), or over the coarse keys (MiniCPM4.1's estimate; the
    exact pass runs only for tiles holding a row that sees no coarse key).  Writes fp32
    [B, Hq, T]: one number per row and head.
  * `_block_kernel`, one program per (sequence x KV head, row tile, tile of blocks): for each of
    the `window` compressed keys a block overlaps, the score of every row of the tile is computed
    on the fly, exp(v.k / sqrt(d) - lse) summed over the G query heads of the KV head (or the raw
    dot product for forecast vectors with one vector per KV head), and the max kept; init and
    local blocks are forced to +inf.  NOSA's agnostic score (the max of the pooled CIS, forced,
    future blocks -inf) is written by the same program.  Tiles of blocks no row of the tile sees
    skip the arithmetic.  Writes fp32 [B, H, T, NB], NB = C * s / bs (4x fewer than C).
"""

from __future__ import annotations

import math

import torch

from ._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    LazyKernel,
    check_same_device,
    check_tensor,
    cuda_device_guard,
    interpreting,
    next_pow2,
    tl,
)
from .block_scores import check_scoring_keys, pool_geometry
from .lse import online_lse

BLOCK_M = 64  # query rows per program on CUDA (tiny under the interpreter)
BLOCK_N = 32  # key blocks per program
BLOCK_C = 64  # compressed keys per step of the LSE pass


def validate_stage1(vectors, ckeys, positions, kind, lse_keys=None, pooled_cis=None) -> int:
    """Check the tensors; returns n, the vectors per KV head."""
    check_tensor("vectors", vectors, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("positions", positions, ndim=2, dtypes=INDEX_DTYPES)
    group = check_scoring_keys(vectors, ckeys, kind, lse_keys)
    batch, rows, heads = vectors.shape[0], vectors.shape[1], ckeys.shape[2]
    if tuple(positions.shape) != (batch, rows):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, expected [B={batch}, T={rows}]")
    tensors = [("vectors", vectors), ("ckeys", ckeys), ("positions", positions)]
    if lse_keys is not None:
        tensors.append(("lse_keys", lse_keys))
    if pooled_cis is not None:
        check_tensor("pooled_cis", pooled_cis, ndim=3, dtypes=FLOAT_DTYPES)
        if pooled_cis.shape[0] != batch or pooled_cis.shape[2] != heads:
            expected = f"[B={batch}, C, H_kv={heads}]"
            raise ValueError(f"pooled_cis has shape {tuple(pooled_cis.shape)}; expected {expected}")
        tensors.append(("pooled_cis", pooled_cis))
    check_same_device(*zip(*tensors))
    return group


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


def _lse_kernel(
    vec_ptr, ck_ptr, ck2_ptr, pos_ptr, lse_ptr,
    n_rows, n_ckeys, n_coarse, scale, lag, kernel_size, kernel_stride, coarse_size, coarse_stride,
    sv_b, sv_t, sv_h, sv_d, sc_b, sc_c, sc_h, sc_d, s2_b, s2_c, s2_h, s2_d, sp_b, sp_t, sl_b, sl_h, sl_t,
    GROUP: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
    COARSE: tl.constexpr, UPCAST: tl.constexpr,
):
    b = tl.cast(tl.program_id(0), tl.int64)
    hq = tl.cast(tl.program_id(1), tl.int64)
    h = hq // GROUP
    m = tl.cast(tl.program_id(2), tl.int64) * BM + tl.arange(0, BM)
    m_ok = m < n_rows
    pos = tl.load(pos_ptr + b * sp_b + m * sp_t, mask=m_ok, other=-1).to(tl.int64)
    dd = tl.arange(0, D_P)
    d_ok = dd < D
    vec_mask = m_ok[:, None] & d_ok[None, :]
    vec = tl.load(vec_ptr + b * sv_b + m[:, None] * sv_t + hq * sv_h + dd[None, :] * sv_d, mask=vec_mask, other=0.0)
    if UPCAST:
        vec = vec.to(tl.float32)
    lse = tl.zeros([BM], tl.float32)  # 0 where a row sees nothing (selection's nan_to_num(neginf=0))
    # the exact pass is needed where a real row sees no coarse key (or there are no coarse keys)
    need_exact = 1
    if COARSE:
        blind = m_ok & (pos >= 0) & ((pos < coarse_size - 1 + lag) | (n_coarse == 0))
        need_exact = tl.max(blind.to(tl.int32), axis=0)
    if need_exact > 0:
        lse = online_lse(lse, vec, pos, ck_ptr + b * sc_b + h * sc_h, sc_c, sc_d, n_ckeys, kernel_size, kernel_stride,
                         lag, scale, dd, d_ok, BM, BC, True, UPCAST)
    if COARSE:  # the coarse LSE wherever the row sees a coarse key
        lse = online_lse(lse, vec, pos, ck2_ptr + b * s2_b + h * s2_h, s2_c, s2_d, n_coarse, coarse_size, coarse_stride,
                         lag, scale, dd, d_ok, BM, BC, True, UPCAST)
    tl.store(lse_ptr + b * sl_b + hq * sl_h + m * sl_t, lse, mask=m_ok)


def _block_kernel(
    vec_ptr, ck_ptr, pos_ptr, lse_ptr, out_ptr, cis_ptr, ag_ptr,
    n_rows, n_ckeys, n_blocks, n_heads, scale, lag,
    kernel_size, kernel_stride, block_size, init_blocks, local_blocks, pool_stride, pool_pad,
    sv_b, sv_t, sv_h, sv_d, sc_b, sc_c, sc_h, sc_d, sp_b, sp_t, sl_b, sl_h, sl_t,
    so_b, so_h, so_t, so_n, si_b, si_c, si_h, sa_b, sa_h, sa_t, sa_n,
    GROUP: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    WINDOW: tl.constexpr, SOFTMAX: tl.constexpr, NOSA: tl.constexpr, UPCAST: tl.constexpr,
):
    bh = tl.cast(tl.program_id(0), tl.int64)
    b = bh // n_heads
    h = bh % n_heads
    m = tl.cast(tl.program_id(1), tl.int64) * BM + tl.arange(0, BM)
    j = tl.cast(tl.program_id(2), tl.int64) * BN + tl.arange(0, BN)
    m_ok = m < n_rows
    j_ok = j < n_blocks
    pos = tl.load(pos_ptr + b * sp_b + m * sp_t, mask=m_ok, other=-1).to(tl.int64)
    dd = tl.arange(0, D_P)
    d_ok = dd < D
    best = tl.full([BM, BN], float("-inf"), tl.float32)
    agnostic = tl.full([BM, BN], float("-inf"), tl.float32)
    # the tile's lowest compressed key is first visible to the tile's highest row: skip otherwise
    first_key = tl.maximum(tl.cast(tl.program_id(2), tl.int64) * BN * pool_stride - pool_pad, 0)
    if first_key * kernel_stride + kernel_size - 1 + lag <= tl.max(pos, axis=0):
        for w in tl.static_range(WINDOW):
            c = j * pool_stride - pool_pad + w
            c_ok = j_ok & (c >= 0) & (c < n_ckeys)
            vis = c_ok[None, :] & (c[None, :] * kernel_stride + kernel_size - 1 + lag <= pos[:, None])
            key_ptrs = ck_ptr + b * sc_b + c[:, None] * sc_c + h * sc_h + dd[None, :] * sc_d
            key = tl.load(key_ptrs, mask=c_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                key = key.to(tl.float32)
            score = tl.zeros([BM, BN], tl.float32)
            for g in range(GROUP):
                hq = h * GROUP + g
                vec_ptrs = vec_ptr + b * sv_b + m[:, None] * sv_t + hq * sv_h + dd[None, :] * sv_d
                vec = tl.load(vec_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
                if UPCAST:
                    s = tl.dot(vec.to(tl.float32), tl.trans(key), input_precision="ieee")
                else:
                    s = tl.dot(vec, tl.trans(key))
                if SOFTMAX:
                    lse = tl.load(lse_ptr + b * sl_b + hq * sl_h + m * sl_t, mask=m_ok, other=0.0)
                    score += tl.exp(s * scale - lse[:, None])
                else:
                    score += s
            best = tl.maximum(best, tl.where(vis, score, float("-inf")))
            if NOSA:
                value = tl.load(cis_ptr + b * si_b + c * si_c + h * si_h, mask=c_ok, other=0.0).to(tl.float32)
                agnostic = tl.maximum(agnostic, tl.where(vis, value[None, :], float("-inf")))
    current = pos // block_size  # only read where pos >= 0
    local = (j[None, :] >= current[:, None] - local_blocks) & (j[None, :] <= current[:, None])
    forced = (pos >= 0)[:, None] & ((j < init_blocks)[None, :] | local)
    mask = m_ok[:, None] & j_ok[None, :]
    out_ptrs = out_ptr + b * so_b + h * so_h + m[:, None] * so_t + j[None, :] * so_n
    tl.store(out_ptrs, tl.where(forced, float("inf"), best), mask=mask)
    if NOSA:
        agnostic = tl.where(forced, float("inf"), agnostic)
        # future blocks after forcing, as selection.py does
        agnostic = tl.where(j[None, :] > current[:, None], float("-inf"), agnostic)
        tl.store(ag_ptr + b * sa_b + h * sa_h + m[:, None] * sa_t + j[None, :] * sa_n, agnostic, mask=mask)


_LSE_KERNEL = LazyKernel(_lse_kernel, helpers=(online_lse,))
_BLOCK_KERNEL = LazyKernel(_block_kernel)


def stage1_block_scores_triton(
    vectors, ckeys, positions, sparse, n_blocks, kind, lag, lse_keys=None, pooled_cis=None, out=None, agnostic_out=None
):
    """The fused kernels' block scores: `selection.score_blocks` (and, given pooled_cis [B, C, H],
    `selection.pooled_agnostic_scores`) of every row.

    vectors [B, T, H*n, d], ckeys [B, C, H, d], positions [B, T], lag: the visibility lag (kernels
    do not import the rule: pass `selection.visibility_lag(kind)`), lse_keys: coarse keys (kind
    "query").  out / agnostic_out: fp32 [B, H, T, n_blocks] written in place when given.
    Returns (block scores fp32 [B, H, T, n_blocks], agnostic scores or None).
    """
    group = validate_stage1(vectors, ckeys, positions, kind, lse_keys, pooled_cis)
    if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
        raise ValueError(f"lag must be a non-negative integer, got {lag!r}")
    if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 0:
        raise ValueError(f"n_blocks must be a non-negative integer, got {n_blocks!r}")
    batch, rows, vec_heads, dim = vectors.shape
    n_ckeys, heads = ckeys.shape[1], ckeys.shape[2]
    shape = (batch, heads, rows, n_blocks)
    out = _output("out", out, shape, vectors.device)
    nosa = pooled_cis is not None
    agnostic = _output("agnostic_out", agnostic_out, shape, vectors.device) if nosa else None
    if batch == 0 or rows == 0 or n_blocks == 0:
        return out, agnostic
    window, pool_stride, pool_pad = pool_geometry(sparse.kernel_size, sparse.kernel_stride, sparse.block_size)
    softmax = kind == "query" or group > 1  # selection.key_scores: forecast with one vector per head = raw dot
    # half-precision operands go to tl.dot as they are (exact products, fp32 accumulation) when
    # they agree; fp32, mixed dtypes and the interpreter upcast after loading
    dtypes = {vectors.dtype, ckeys.dtype, *(() if lse_keys is None else (lse_keys.dtype,))}
    upcast = interpreting() or len(dtypes) > 1 or torch.float32 in dtypes
    tiny = interpreting()
    bm, bn, bc = (16, 16, 16) if tiny else (BLOCK_M, BLOCK_N, BLOCK_C)
    d_p = next_pow2(dim, 16)
    grid_rows = -(-rows // bm)
    lse = torch.empty((batch, vec_heads, rows), dtype=torch.float32, device=vectors.device)
    with cuda_device_guard(vectors):
        if softmax:
            coarse = lse_keys is not None
            ck2 = lse_keys if coarse else ckeys  # a valid pointer either way; unread without COARSE
            coarse_size, coarse_stride = sparse.coarse_kernel if coarse else (1, 1)
            _LSE_KERNEL[(batch, vec_heads, grid_rows)](
                vectors, ckeys, ck2, positions, lse,
                rows, n_ckeys, ck2.shape[1], 1.0 / math.sqrt(dim), lag, sparse.kernel_size, sparse.kernel_stride,
                coarse_size, coarse_stride,
                *vectors.stride(), *ckeys.stride(), *ck2.stride(), *positions.stride(), *lse.stride(),
                GROUP=group, D=dim, D_P=d_p, BM=bm, BC=bc, COARSE=coarse, UPCAST=upcast, num_warps=4,
            )
        cis = pooled_cis if nosa else lse  # a valid pointer; unread without NOSA
        ag = agnostic if nosa else out
        cis_strides = pooled_cis.stride() if nosa else (0, 0, 0)
        _BLOCK_KERNEL[(batch * heads, grid_rows, -(-n_blocks // bn))](
            vectors, ckeys, positions, lse, out, cis, ag,
            rows, n_ckeys, n_blocks, heads, 1.0 / math.sqrt(dim), lag,
            sparse.kernel_size, sparse.kernel_stride, sparse.block_size, sparse.init_blocks, sparse.local_blocks,
            pool_stride, pool_pad,
            *vectors.stride(), *ckeys.stride(), *positions.stride(), *lse.stride(),
            *out.stride(), *cis_strides, *ag.stride(),
            GROUP=group, D=dim, D_P=d_p, BM=bm, BN=bn, WINDOW=window, SOFTMAX=softmax, NOSA=nosa, UPCAST=upcast,
            num_warps=4,
        )
    return out, agnostic


def _output(name: str, given, shape: tuple, device) -> torch.Tensor:
    if given is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    check_tensor(name, given, dtypes=(torch.float32,))
    if tuple(given.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(given.shape)}, expected {shape} ([B, H_kv, T, n_blocks])")
    if given.device != torch.device(device):
        raise ValueError(f"{name} is on {given.device}, the inputs on {device}")
    return given
