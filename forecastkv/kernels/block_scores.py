"""block_scores: decode-time block selection scores, ready for top-k.

One query row per sequence scored against the compressed keys, pooled to blocks, init/local blocks
forced.  The semantics are `modeling/selection.py`'s (`score_blocks`, `agnostic_block_scores`);
kernels are leaves, so the reference here is written out in plain PyTorch and both the reference
and the Triton kernel are tested against `selection.py` from the tests.

Kinds: "query" (InfLLM-v2 stage 1: per-head softmax, exact LSE or MiniCPM4.1's coarse LSE from
`lse_keys`, summed per GQA group), "forecast" (raw dot product with one vector per KV head, else
as "query" with the exact LSE), and NOSA's query-agnostic score (`agnostic_scores_*`: the
mean-pooled CIS, max-pooled to blocks, forced, future blocks -inf).

Kernel layout: one program per (sequence, KV head).  For softmax scores a first pass over the
compressed keys computes each head's exact log-sum-exp (and, with coarse keys, the coarse one);
the second pass walks tiles of blocks and, for each of the `window` compressed keys a block
overlaps, computes the (group-summed) score on the fly and keeps the max, so no [C] score row is
ever written to memory.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

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
from .lse import online_lse

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
    lse_keys    [B, C2, H_kv, d] or None  kind "query" only: MiniCPM4.1's coarse keys (kernel
                                 `sparse.coarse_kernel`); each head is normalised by the LSE over
                                 the coarse keys it sees (the exact LSE where it sees none)
    check_ids   bool             check every argument.  False: the caller vouches for them; the
                                 reference then checks nothing, the kernel still checks them

    Returns float32 [B, H_kv, n_blocks]: the max over each block's overlapping compressed keys
    (`selection.block_pool_geometry`), +inf for init and local blocks (`selection.force_blocks`),
    -inf where a block overlaps no visible compressed key and is not forced.
    """


def _doc(fn):
    fn.__doc__ = _DOC
    return fn


def pool_geometry(kernel_size: int, kernel_stride: int, block_size: int) -> tuple[int, int, int]:
    """(window, stride, left padding) of the max-pool from compressed keys to blocks: block j
    pools compressed keys c with c*s < (j+1)*bs and c*s + p > j*bs (`selection.block_pool_geometry`)."""
    ratio = block_size // kernel_stride
    first = (-kernel_size) // kernel_stride + 1
    return ratio - first, ratio, -first


def validate_block_scores(vectors, ckeys, positions, sparse, n_blocks, kind="query", lag=None, out=None, lse_keys=None):
    """Check every argument; returns (lag, group size n)."""
    check_tensor("vectors", vectors, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES)
    if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 0:
        raise ValueError(f"n_blocks must be a non-negative integer, got {n_blocks!r}")
    group = check_scoring_keys(vectors, ckeys, kind, lse_keys)
    batch, heads = vectors.shape[0], ckeys.shape[2]
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
    if lag is None:  # the visibility rule lives in modeling.selection, which kernels do not import
        raise ValueError(f"lag is required for kind {kind!r}: pass selection.visibility_lag(kind)")
    if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
        raise ValueError(f"lag must be a non-negative integer, got {lag!r}")
    if lse_keys is not None:
        check_same_device(("vectors", "lse_keys"), (vectors, lse_keys))
    return lag, group


def check_scoring_keys(vectors, ckeys, kind: str, lse_keys=None) -> int:
    """The checks decode and prefill scoring share: vectors [B, ..., H_kv*n, d] against ckeys
    [B, C, H_kv, d] and the coarse lse_keys [B, C2, H_kv, d] (kind "query" only); returns n."""
    check_tensor("ckeys", ckeys, ndim=4, dtypes=FLOAT_DTYPES)
    if kind not in KINDS:
        raise ValueError(f"score kind {kind!r} is not one of {KINDS}")
    batch, vec_heads, dim = vectors.shape[0], vectors.shape[-2], vectors.shape[-1]
    if ckeys.shape[0] != batch or ckeys.shape[3] != dim:
        raise ValueError(
            f"ckeys has shape {tuple(ckeys.shape)}; expected [B={batch}, C, H_kv, d={dim}] to match vectors "
            f"{tuple(vectors.shape)}"
        )
    heads = ckeys.shape[2]
    if heads == 0 or vec_heads % heads:
        raise ValueError(f"vectors has {vec_heads} heads, which is not a multiple of H_kv={heads} (from ckeys)")
    if lse_keys is not None:
        if kind != "query":
            raise ValueError(f"lse_keys (the coarse LSE) applies to kind 'query' only, got kind {kind!r}")
        check_tensor("lse_keys", lse_keys, ndim=4, dtypes=FLOAT_DTYPES)
        if (lse_keys.shape[0], lse_keys.shape[2], lse_keys.shape[3]) != (batch, heads, dim):
            expected = f"[B={batch}, C2, H_kv={heads}, d={dim}]"
            raise ValueError(f"lse_keys has shape {tuple(lse_keys.shape)}; expected {expected}")
    return vec_heads // heads


def _visible(positions: torch.Tensor, count: int, size: int, stride: int, lag: int) -> torch.Tensor:
    """bool [B, C]: compressed key c (window [c*stride, c*stride + size)) has ended before the row."""
    ends = torch.arange(count, device=positions.device) * stride + size - 1 + lag
    return ends.view(1, -1) <= positions.long().view(-1, 1)


def _pool_and_force(scores: torch.Tensor, positions: torch.Tensor, sparse, n_blocks: int) -> torch.Tensor:
    """[B, H, C] key scores (-inf invisible) -> [B, H, n_blocks]: max over each block's keys,
    init and local (qb - local_blocks .. qb) blocks +inf for rows with a position >= 0."""
    window, stride, pad = pool_geometry(sparse.kernel_size, sparse.kernel_stride, sparse.block_size)
    needed = max(n_blocks - 1, 0) * stride + window
    padded = F.pad(scores, (pad, max(0, needed - pad - scores.shape[-1])), value=float("-inf"))[..., :needed]
    pooled = padded.unfold(-1, window, stride).amax(dim=-1) if n_blocks else scores.new_zeros((*scores.shape[:2], 0))
    blocks = torch.arange(n_blocks, device=scores.device).view(1, -1)
    current = torch.div(positions.long(), sparse.block_size, rounding_mode="floor").view(-1, 1)
    forced = (blocks < sparse.init_blocks) | ((blocks >= current - sparse.local_blocks) & (blocks <= current))
    forced &= positions.long().view(-1, 1) >= 0
    return pooled.masked_fill(forced[:, None], float("inf"))


@_doc
def block_scores_reference(
    vectors, ckeys, positions, sparse, n_blocks, kind="query", lag=None, out=None, lse_keys=None, check_ids=True
):
    if check_ids:
        validate_block_scores(vectors, ckeys, positions, sparse, n_blocks, kind, lag, out, lse_keys)
    batch, _, dim = vectors.shape
    heads = ckeys.shape[2]
    group = vectors.shape[1] // heads
    p, s = sparse.kernel_size, sparse.kernel_stride
    visible = _visible(positions, ckeys.shape[1], p, s, lag)[:, None, None]           # [B, 1, 1, C]
    vec = vectors.float().view(batch, heads, group, dim)
    logits = vec @ ckeys.float().permute(0, 2, 3, 1)                                    # [B, H, n, C]
    if kind == "forecast" and group == 1:
        scores = logits[:, :, 0]
    else:
        logits = (logits / math.sqrt(dim)).masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        if lse_keys is not None:
            p2, s2 = sparse.coarse_kernel
            coarse = (vec @ lse_keys.float().permute(0, 2, 3, 1)) / math.sqrt(dim)
            coarse_visible = _visible(positions, lse_keys.shape[1], p2, s2, lag)[:, None, None]
            coarse = coarse.masked_fill(~coarse_visible, float("-inf"))
            coarse_lse = torch.logsumexp(coarse, dim=-1, keepdim=True)
            lse = torch.where(torch.isfinite(coarse_lse), coarse_lse, lse)
        scores = torch.exp(logits - lse.nan_to_num(neginf=0.0)).sum(dim=2)
    scores = scores.masked_fill(~visible[:, :, 0], float("-inf"))
    result = _pool_and_force(scores, positions, sparse, n_blocks)
    if out is None:
        return result.contiguous()
    out.copy_(result)
    return out


def validate_agnostic(pooled_cis, positions, sparse, n_blocks, lag=0, out=None):
    check_tensor("pooled_cis", pooled_cis, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES)
    check_shape("positions", positions, (pooled_cis.shape[0],), "[B]")
    if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 0:
        raise ValueError(f"n_blocks must be a non-negative integer, got {n_blocks!r}")
    if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
        raise ValueError(f"lag must be a non-negative integer, got {lag!r}")
    tensors = [("pooled_cis", pooled_cis), ("positions", positions)]
    if out is not None:
        check_tensor("out", out, dtypes=(torch.float32,))
        check_shape("out", out, (pooled_cis.shape[0], pooled_cis.shape[2], n_blocks), "[B, H_kv, n_blocks]")
        tensors.append(("out", out))
    check_same_device(*zip(*tensors))


_AGNOSTIC_DOC = """NOSA's query-agnostic block scores of one decode row per sequence:
    `selection.agnostic_block_scores` with Tq = 1, from the already pooled CIS.

    pooled_cis  [B, C, H_kv]     float32/float16/bfloat16: CIS mean-pooled like the keys (window
                                 kernel_size, stride kernel_stride), as the cache keeps it
    positions   [B]              int32/int64; < 0 = padding (all -inf)
    sparse, n_blocks, lag        as `block_scores` (lag 0 for the query selector, 1 for forecast)
    out         [B, H_kv, n_blocks] float32 or None
    check_ids   bool             as `block_scores`

    Returns float32 [B, H_kv, n_blocks]: max of the visible pooled CIS over each block's compressed
    keys, +inf for init and local blocks, then -inf for blocks after the row's own (j > pos // bs).
    """


def agnostic_scores_reference(pooled_cis, positions, sparse, n_blocks, lag=0, out=None, check_ids=True):
    if check_ids:
        validate_agnostic(pooled_cis, positions, sparse, n_blocks, lag, out)
    visible = _visible(positions, pooled_cis.shape[1], sparse.kernel_size, sparse.kernel_stride, lag)
    scores = pooled_cis.float().permute(0, 2, 1).masked_fill(~visible[:, None], float("-inf"))
    result = _pool_and_force(scores, positions, sparse, n_blocks)
    current = torch.div(positions.long(), sparse.block_size, rounding_mode="floor").view(-1, 1, 1)
    result = result.masked_fill(torch.arange(n_blocks, device=result.device).view(1, 1, -1) > current, float("-inf"))
    if out is None:
        return result.contiguous()
    out.copy_(result)
    return out


agnostic_scores_reference.__doc__ = _AGNOSTIC_DOC


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


def _block_scores_kernel(
    vec_ptr, ck_ptr, pos_ptr, out_ptr, ck2_ptr,
    n_ckeys, n_blocks, scale, lag,
    kernel_size, kernel_stride, block_size, init_blocks, local_blocks, pool_stride, pool_pad,
    n_coarse, coarse_size, coarse_stride,
    sv_b, sv_h, sv_d, sc_b, sc_c, sc_h, sc_d, so_b, so_h, so_n, s2_b, s2_c, s2_h, s2_d,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, WINDOW: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, SOFTMAX: tl.constexpr, USE_DOT: tl.constexpr,
    COARSE: tl.constexpr,
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
    if SOFTMAX:
        # pass 1: each head's log-sum-exp over the compressed keys it sees (exact), then, for
        # MiniCPM4.1, over the coarse keys, used wherever the row sees one
        rows_pos = tl.zeros([GP], tl.int64) + pos
        lse = online_lse(lse, vec, rows_pos, ck_ptr + b * sc_b + h * sc_h, sc_c, sc_d, n_ckeys, kernel_size,
                         kernel_stride, lag, scale, dd, d_ok, GP, BLOCK_C, USE_DOT, True)
        if COARSE:
            lse = online_lse(lse, vec, rows_pos, ck2_ptr + b * s2_b + h * s2_h, s2_c, s2_d, n_coarse, coarse_size,
                             coarse_stride, lag, scale, dd, d_ok, GP, BLOCK_C, USE_DOT, True)
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


_KERNEL = LazyKernel(_block_scores_kernel, helpers=(online_lse,))


@_doc
def block_scores_triton(
    vectors, ckeys, positions, sparse, n_blocks, kind="query", lag=None, out=None, lse_keys=None, check_ids=True
):
    # the kernel reads through raw pointers: its arguments are checked whatever check_ids says
    lag, group = validate_block_scores(vectors, ckeys, positions, sparse, n_blocks, kind, lag, out, lse_keys)
    batch, _, dim = vectors.shape
    n_ckeys, heads = ckeys.shape[1], ckeys.shape[2]
    out = torch.empty((batch, heads, n_blocks), dtype=torch.float32, device=vectors.device) if out is None else out
    if batch == 0 or n_blocks == 0:
        return out
    window, pool_stride, pool_pad = pool_geometry(sparse.kernel_size, sparse.kernel_stride, sparse.block_size)
    coarse = lse_keys is not None
    ck2 = lse_keys if coarse else ckeys  # a valid pointer either way; unread without COARSE
    coarse_size, coarse_stride = sparse.coarse_kernel if coarse else (1, 1)
    softmax = kind == "query" or group > 1  # score_blocks: forecast with one vector per head = raw dot
    use_dot = group > 2  # pad the group to 16 rows for tl.dot; tiny groups use a sum-reduce
    min_tile = 16 if use_dot else 1
    with cuda_device_guard(vectors):
        _KERNEL[(batch, heads)](
            vectors, ckeys, positions, out, ck2,
            n_ckeys, n_blocks, 1.0 / math.sqrt(dim), lag,
            sparse.kernel_size, sparse.kernel_stride, sparse.block_size, sparse.init_blocks, sparse.local_blocks,
            pool_stride, pool_pad, ck2.shape[1], coarse_size, coarse_stride,
            *vectors.stride(), *ckeys.stride(), *out.stride(), *ck2.stride(),
            GROUP=group, GP=next_pow2(group, min_tile), D=dim, D_P=next_pow2(dim, min_tile), WINDOW=window,
            BLOCK_C=min(64, next_pow2(max(n_ckeys, 1), 16)) if use_dot else min(32, next_pow2(max(n_ckeys, 1))),
            BLOCK_N=min(32, next_pow2(n_blocks, 16)) if use_dot else min(32, next_pow2(n_blocks)),
            SOFTMAX=softmax, USE_DOT=use_dot, COARSE=coarse, num_warps=8,
        )
    return out


def _agnostic_kernel(
    cis_ptr, pos_ptr, out_ptr, n_ckeys, n_blocks, lag,
    kernel_size, kernel_stride, block_size, init_blocks, local_blocks, pool_stride, pool_pad,
    s_b, s_c, s_h, so_b, so_h, so_n,
    WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.cast(tl.program_id(0), tl.int64)
    h = tl.cast(tl.program_id(1), tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    nn = tl.arange(0, BLOCK_N)
    current = pos // block_size
    for j0 in range(0, n_blocks, BLOCK_N):
        j = tl.cast(j0, tl.int64) + nn
        best = tl.full([BLOCK_N], float("-inf"), tl.float32)
        for w in tl.static_range(WINDOW):
            c = j * pool_stride - pool_pad + w
            vis = (j < n_blocks) & (c >= 0) & (c < n_ckeys) & (c * kernel_stride + kernel_size - 1 + lag <= pos)
            value = tl.load(cis_ptr + b * s_b + c * s_c + h * s_h, mask=vis, other=0.0).to(tl.float32)
            best = tl.maximum(best, tl.where(vis, value, float("-inf")))
        forced = (pos >= 0) & ((j < init_blocks) | ((j >= current - local_blocks) & (j <= current)))
        best = tl.where(forced, float("inf"), best)
        best = tl.where(j > current, float("-inf"), best)  # after forcing, as selection.py does
        tl.store(out_ptr + b * so_b + h * so_h + j * so_n, best, mask=j < n_blocks)


_AGNOSTIC_KERNEL = LazyKernel(_agnostic_kernel)


def agnostic_scores_triton(pooled_cis, positions, sparse, n_blocks, lag=0, out=None, check_ids=True):
    validate_agnostic(pooled_cis, positions, sparse, n_blocks, lag, out)
    batch, n_ckeys, heads = pooled_cis.shape
    out = torch.empty((batch, heads, n_blocks), dtype=torch.float32, device=pooled_cis.device) if out is None else out
    if batch == 0 or n_blocks == 0 or heads == 0:
        return out
    window, pool_stride, pool_pad = pool_geometry(sparse.kernel_size, sparse.kernel_stride, sparse.block_size)
    with cuda_device_guard(pooled_cis):
        _AGNOSTIC_KERNEL[(batch, heads)](
            pooled_cis, positions, out, n_ckeys, n_blocks, lag,
            sparse.kernel_size, sparse.kernel_stride, sparse.block_size, sparse.init_blocks, sparse.local_blocks,
            pool_stride, pool_pad, *pooled_cis.stride(), *out.stride(),
            WINDOW=window, BLOCK_N=min(64, next_pow2(n_blocks)),
        )
    return out


agnostic_scores_triton.__doc__ = _AGNOSTIC_DOC
