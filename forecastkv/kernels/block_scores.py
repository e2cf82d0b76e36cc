"""block_scores: decode-time block selection scores, ready for top-k.

One query row per sequence scored against the compressed keys, pooled to blocks, init/local blocks
forced.  The semantics live in `modeling/selection.py` (`score_blocks`); the reference here is a
thin wrapper over it and the Triton kernel is tested against that.

Kernel layout: one program per (sequence, KV head).  For softmax scores a first pass over the
compressed keys computes each head's exact log-sum-exp; the second pass walks tiles of blocks and,
for each of the `window` compressed keys a block overlaps, computes the (group-summed) score on
the fly and keeps the max, so no [C] score row is ever written to memory.
"""

from __future__ import annotations

import math

import torch

from ._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    LazyKernel,
    check_same_device,
    check_shape,
    check_tensor,
    cuda_device_guard,
    next_pow2,
    tl,
)

KINDS = ("query", "forecast")

_DOC = """Block scores of one decode row per sequence: `selection.score_blocks` with Tq = 1.

    vectors     [B, H_kv*n, d]   float32/float16/bfloat16, any strides: the queries (kind "query",
                                 n = G) or forecast vectors (kind "forecast"); head h*n + i belongs
                                 to KV head h
    ckeys       [B, C, H_kv, d]  float32/float16/bfloat16 compressed keys, any strides
    positions   [B]              int32/int64 position of each row; < 0 = padding (all -inf)
    sparse      SparseConfig     kernel_size, kernel_stride, block_size, init_blocks, local_blocks
    n_blocks    int              blocks to score (>= 0)
    kind        "query" | "forecast"
                                 query: per-head softmax of v.Kc/sqrt(d) over the visible keys (exact
                                 LSE), summed per GQA group.  forecast: the raw dot product when
                                 n = 1, the group-summed softmax when n > 1
    lag         int or None      visibility lag; default 0 for "query", 1 for "forecast"
    out         [B, H_kv, n_blocks] float32 or None  written in place when given

    Returns float32 [B, H_kv, n_blocks]: the max over each block's overlapping compressed keys
    (`selection.block_pool_geometry`), +inf for init and local blocks (`selection.force_blocks`),
    -inf where a block overlaps no visible compressed key and is not forced.
    """


def _doc(fn):
    fn.__doc__ = _DOC
    return fn


def validate_block_scores(vectors, ckeys, positions, sparse, n_blocks, kind="query", lag=None, out=None):
    """Check every argument; returns (lag, group size n)."""
    check_tensor("vectors", vectors, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("ckeys", ckeys, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES)
    if kind not in KINDS:
        raise ValueError(f"score kind {kind!r} is not one of {KINDS}")
    if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 0:
        raise ValueError(f"n_blocks must be a non-negative integer, got {n_blocks!r}")
    batch, vec_heads, dim = vectors.shape
    if ckeys.shape[0] != batch or ckeys.shape[3] != dim:
        raise ValueError(f"ckeys has shape {tuple(ckeys.shape)}; expected [B={batch}, C, H_kv, d={dim}] to match vectors {tuple(vectors.shape)}")
    heads = ckeys.shape[2]
    if heads == 0 or vec_heads % heads:
        raise ValueError(f"vectors has {vec_heads} heads, which is not a multiple of H_kv={heads} (from ckeys)")
    check_shape("positions", positions, (batch,), "[B]")
    tensors = [("vectors", vectors), ("ckeys", ckeys), ("positions", positions)]
    if out is not None:
        check_tensor("out", out, dtypes=(torch.float32,))
        check_shape("out", out, (batch, heads, n_blocks), "[B, H_kv, n_blocks]")
        tensors.append(("out", out))
    check_same_device(*zip(*tensors))
    for name in ("kernel_size", "kernel_stride", "block_size", "init_blocks", "local_blocks"):
        if not isinstance(getattr(sparse, name, None), int):
            raise TypeError(f"sparse.{name} must be an int, got {getattr(sparse, name, None)!r}")
    lag = (0 if kind == "query" else 1) if lag is None else lag
    if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
        raise ValueError(f"lag must be a non-negative integer, got {lag!r}")
    return lag, vec_heads // heads


@_doc
def block_scores_reference(vectors, ckeys, positions, sparse, n_blocks, kind="query", lag=None, out=None):
    from ..modeling import selection  # lazy: modeling may import kernels

    lag, _ = validate_block_scores(vectors, ckeys, positions, sparse, n_blocks, kind, lag, out)
    scores = selection.score_blocks(vectors.unsqueeze(1), ckeys, positions.long().unsqueeze(1), sparse, n_blocks, kind=kind, lag=lag)[:, :, 0]
    if out is None:
        return scores.contiguous()
    out.copy_(scores)
    return out


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


def _block_scores_kernel(
    vec_ptr, ck_ptr, pos_ptr, out_ptr,
    n_ckeys, n_blocks, scale, lag,
    kernel_size, kernel_stride, block_size, init_blocks, local_blocks, pool_stride, pool_pad,
    sv_b, sv_h, sv_d, sc_b, sc_c, sc_h, sc_d, so_b, so_h, so_n,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, WINDOW: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, SOFTMAX: tl.constexpr, USE_DOT: tl.constexpr,
):
    b = tl.cast(tl.program_id(0), tl.int64)
    h = tl.cast(tl.program_id(1), tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    g = tl.arange(0, GP)
    g_ok = g < GROUP
    dd = tl.arange(0, D_P)
    d_ok = dd < D
    vec = tl.load(vec_ptr + b * sv_b + (h * GROUP + g)[:, None] * sv_h + dd[None, :] * sv_d,
                  mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    lse = tl.zeros([GP], tl.float32)
    if SOFTMAX:  # pass 1: exact log-sum-exp of each head over its visible compressed keys
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        cc = tl.arange(0, BLOCK_C)
        for c0 in range(0, n_ckeys, BLOCK_C):
            c = tl.cast(c0, tl.int64) + cc
            vis = (c < n_ckeys) & (c * kernel_stride + kernel_size - 1 + lag <= pos)
            key = tl.load(ck_ptr + b * sc_b + c[:, None] * sc_c + h * sc_h + dd[None, :] * sc_d,
                          mask=vis[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            if USE_DOT:
                s = tl.dot(vec, tl.trans(key), input_precision="ieee")
            else:
                s = tl.sum(vec[:, None, :] * key[None, :, :], axis=2)
            s = tl.where(vis[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
            m_i = m_new
        lse = tl.where(l_i > 0.0, m_i + tl.log(tl.where(l_i > 0.0, l_i, 1.0)), 0.0)
    # pass 2: block j max-pools compressed keys c = j*pool_stride - pool_pad + w, w < WINDOW
    nn = tl.arange(0, BLOCK_N)
    current = pos // block_size  # only used where pos >= 0
    for j0 in range(0, n_blocks, BLOCK_N):
        j = tl.cast(j0, tl.int64) + nn
        best = tl.full([BLOCK_N], float("-inf"), tl.float32)
        for w in tl.static_range(WINDOW):
            c = j * pool_stride - pool_pad + w
            vis = (j < n_blocks) & (c >= 0) & (c < n_ckeys) & (c * kernel_stride + kernel_size - 1 + lag <= pos)
            key = tl.load(ck_ptr + b * sc_b + c[:, None] * sc_c + h * sc_h + dd[None, :] * sc_d,
                          mask=vis[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            if USE_DOT:
                s = tl.dot(vec, tl.trans(key), input_precision="ieee")
            else:
                s = tl.sum(vec[:, None, :] * key[None, :, :], axis=2)
            if SOFTMAX:
                s = tl.exp(s * scale - lse[:, None])
            score = tl.sum(tl.where(g_ok[:, None], s, 0.0), axis=0)
            best = tl.maximum(best, tl.where(vis, score, float("-inf")))
        local = (j >= current - local_blocks) & (j <= current)
        forced = (pos >= 0) & ((j < init_blocks) | local)
        best = tl.where(forced, float("inf"), best)
        tl.store(out_ptr + b * so_b + h * so_h + j * so_n, best, mask=j < n_blocks)


_KERNEL = LazyKernel(_block_scores_kernel)


@_doc
def block_scores_triton(vectors, ckeys, positions, sparse, n_blocks, kind="query", lag=None, out=None):
    from ..modeling.selection import block_pool_geometry

    lag, group = validate_block_scores(vectors, ckeys, positions, sparse, n_blocks, kind, lag, out)
    batch, _, dim = vectors.shape
    n_ckeys, heads = ckeys.shape[1], ckeys.shape[2]
    out = torch.empty((batch, heads, n_blocks), dtype=torch.float32, device=vectors.device) if out is None else out
    if batch == 0 or n_blocks == 0:
        return out
    window, pool_stride, pool_pad = block_pool_geometry(sparse.kernel_size, sparse.kernel_stride, sparse.block_size)
    softmax = kind == "query" or group > 1  # score_blocks: forecast with one vector per head = raw dot
    use_dot = group > 2  # pad the group to 16 rows for tl.dot; tiny groups use a sum-reduce
    min_tile = 16 if use_dot else 1
    with cuda_device_guard(vectors):
        _KERNEL[(batch, heads)](
            vectors, ckeys, positions, out,
            n_ckeys, n_blocks, 1.0 / math.sqrt(dim), lag,
            sparse.kernel_size, sparse.kernel_stride, sparse.block_size, sparse.init_blocks, sparse.local_blocks,
            pool_stride, pool_pad,
            *vectors.stride(), *ckeys.stride(), *out.stride(),
            GROUP=group, GP=next_pow2(group, min_tile), D=dim, D_P=next_pow2(dim, min_tile), WINDOW=window,
            BLOCK_C=min(64, next_pow2(max(n_ckeys, 1), 16)) if use_dot else min(32, next_pow2(max(n_ckeys, 1))),
            BLOCK_N=min(32, next_pow2(n_blocks, 16)) if use_dot else min(32, next_pow2(n_blocks)),
            SOFTMAX=softmax, USE_DOT=use_dot, num_warps=8,
        )
    return out
