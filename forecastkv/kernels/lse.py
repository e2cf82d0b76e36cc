"""The online log-sum-exp pass over compressed keys, one Triton device function for every kernel
that normalises block scores: `block_scores` (decode, one row per sequence) and `stage1` (prefill,
a tile of rows).  Kernels call it by name and list it in their `LazyKernel(..., helpers=...)`, which
jits it with them in the same mode (compiler or interpreter).
"""

from __future__ import annotations

from ._common import tl


def online_lse(
    lse, vec, pos, keys_ptr, st_c, st_d, n_keys, size, stride, lag, scale, dd, d_ok,
    ROWS: tl.constexpr, BLOCK_C: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Each row's natural log-sum-exp of scale * vec . key over the keys it sees.

    lse [ROWS] fp32          returned where a row sees no key (0 for the exact pass, the exact LSE
                             under the coarse one)
    vec [ROWS, D_P]          the rows' vectors: fp32 with UPCAST, else their loaded dtype
    pos [ROWS] int64         each row's position; key c (window [c*stride, c*stride + size)) is
                             seen once c*stride + size - 1 + lag <= pos
    keys_ptr, st_c, st_d     key c, dim i at keys_ptr + c*st_c + i*st_d, c < n_keys
    dd, d_ok                 the dims tl.arange(0, D_P) and which are < d
    DOT, UPCAST              tl.dot (rows padded to >= 16), on keys upcast to fp32 with ieee
                             precision, or without UPCAST on the loaded dtypes (half-precision tensor
                             cores, fp32 accumulation); no DOT: a broadcast sum in fp32 (tiny row
                             counts, needs UPCAST)

    Keys no row sees are not loaded.  Returns fp32 [ROWS].
    """
    last = tl.max(pos, axis=0)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    cc = tl.arange(0, BLOCK_C)
    for c0 in range(0, n_keys, BLOCK_C):
        c = tl.cast(c0, tl.int64) + cc
        ends = c * stride + size - 1 + lag
        c_ok = (c < n_keys) & (ends <= last)
        key = tl.load(keys_ptr + c[:, None] * st_c + dd[None, :] * st_d, mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        if not UPCAST:
            s = tl.dot(vec, tl.trans(key))
        elif DOT:
            s = tl.dot(vec, tl.trans(key.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.sum(vec[:, None, :] * key.to(tl.float32)[None, :, :], axis=2)
        seen = c_ok[None, :] & (ends[None, :] <= pos[:, None])
        s = tl.where(seen, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: avoid inf - inf
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
        m_i = m_new
    return tl.where(l_i > 0.0, m_i + tl.log(tl.where(l_i > 0.0, l_i, 1.0)), lse)
