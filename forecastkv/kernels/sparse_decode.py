"""sparse_decode: one query token per sequence attending to its selected KV blocks.

Two layouts of the selected keys, one kernel:

* slots (the offloaded runtime): device slot buffers [B, M*block, H_kv, d] with a valid length per
  slot [B, H_kv, M] (0 = empty slot); slot order does not matter (RoPE is already applied);
* blocks (the resident cache): block ids [B, H_kv, K] (-1 = none) into a cache [B, S, H_kv, d]
  with per-sequence lengths [B] (keys at positions >= length are invalid).

Semantics are those of `modeling.attention.attend` on the keys `SparseCacheLayer.blocks()`
returns: softmax(q.k * scale + bias) over the valid keys, in fp32, GQA group g of KV head h being
query heads h*G .. h*G+G-1.  A row with no valid key returns zeros and log-sum-exp -inf, and
rows that are not keys (an empty slot, a -1 entry, positions >= length) are never read into the
result, whatever they hold (NaN included), so partial attentions merge without NaN.  A block
id listed twice is attended twice (as `blocks()` + `attend` do); canonical selections have none.
"""

from __future__ import annotations

import functools
import math

import torch

from ._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    LazyKernel,
    check_positive_int,
    check_range,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
    cuda_device_guard,
    interpreting,
    next_pow2,
    tl,
)

_ARGS_DOC = """
    q               [B, H_q, d]        float32/float16/bfloat16, any strides (e.g. a view of [B, 1, H_q, d])
    scale           float or None      logit scale, default 1/sqrt(d); the bias is added after it
    out             [B, H_q, d] or None  q.dtype; written in place when given
    lse             [B, H_q] or None     float32; written in place when given
    check_ids       bool               check every argument, index ranges included (one device
                                       sync).  False: the caller vouches for them; the reference
                                       then checks nothing (its indexing cannot leave the buffers),
                                       the kernel still checks shapes and clamps every index

    Returns (out [B, H_q, d] in q.dtype, lse [B, H_q] float32): softmax attention over the valid
    keys in fp32 (online softmax in the kernel), lse = natural log-sum-exp of the scaled and biased
    logits; a row with no valid key gives zeros and lse = -inf.  H_q must be a multiple of H_kv.
    """

_SLOTS_DOC = (
    """Decode attention over device slot buffers (the offloaded runtime's layout).

    k_slots, v_slots [B, M*block_size, H_kv, d]  q.dtype, any strides
    slot_lens       [B, H_kv, M]      int32/int64 valid rows of each slot, in [0, block_size];
                                      rows m*block .. m*block + slot_lens - 1 are keys, 0 = empty
    block_size      int               rows per slot
    bias_slots      [B, M*block_size, H_kv] or None  additive per-key bias (NOSA's CIS), any float dtype"""
    + _ARGS_DOC
)

_BLOCKS_DOC = (
    """Decode attention over selected blocks of a resident cache.

    k_cache, v_cache [B, S, H_kv, d]  q.dtype, any strides
    block_ids       [B, H_kv, K]      int32/int64 block ids, -1 = none; in [-1, ceil(S / block_size))
    lengths         [B]               int32/int64 keys stored per sequence, in [0, S]; keys at
                                      positions >= length are invalid (a partial last block)
    block_size      int               tokens per block
    bias            [B, S, H_kv] or None  additive per-key bias (NOSA's CIS), any float dtype"""
    + _ARGS_DOC
)


_SPLITS_DOC = """
    num_splits      int or None        (Triton only) selection entries are split across this many
                                       programs per (sequence, KV head) and the partial results
                                       combined by their LSE (flash-decoding); None: enough to fill
                                       the GPU about twice (1 off CUDA)
    """


def _doc(text):
    def apply(fn):
        fn.__doc__ = text
        return fn

    return apply


def _validate_common(q, k, v, bias, out, lse, scale, names):
    kname, vname, bname = names
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor(kname, k, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor(vname, v, ndim=4, dtypes=FLOAT_DTYPES)
    batch, q_heads, dim = q.shape
    if k.shape[0] != batch or k.shape[3] != dim:
        expected = f"[B={batch}, *, H_kv, d={dim}] to match q {tuple(q.shape)}"
        raise ValueError(f"{kname} has shape {tuple(k.shape)}; expected {expected}")
    check_shape(vname, v, k.shape, f"must match {kname}")
    check_same_dtype(("q", kname, vname), (q, k, v))
    heads = k.shape[2]
    if heads == 0 or q_heads % heads:
        raise ValueError(f"q has H_q={q_heads} heads, which is not a multiple of H_kv={heads} (from {kname})")
    tensors = [("q", q), (kname, k), (vname, v)]
    if bias is not None:
        check_tensor(bname, bias, ndim=3, dtypes=FLOAT_DTYPES)
        check_shape(bname, bias, k.shape[:3], f"[B, rows, H_kv] from {kname}")
        tensors.append((bname, bias))
    if out is not None:
        check_tensor("out", out, dtypes=(q.dtype,))
        check_shape("out", out, q.shape, "like q")
        tensors.append(("out", out))
    if lse is not None:
        check_tensor("lse", lse, dtypes=(torch.float32,))
        check_shape("lse", lse, (batch, q_heads), "[B, H_q]")
        tensors.append(("lse", lse))
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
    return tensors


def validate_slots(
    q, k_slots, v_slots, slot_lens, block_size, scale=None, bias_slots=None, out=None, lse=None, check_ids=True
):
    """Check every argument of `sparse_decode_slots`; returns the number of slots M."""
    check_positive_int("block_size", block_size)
    tensors = _validate_common(q, k_slots, v_slots, bias_slots, out, lse, scale, ("k_slots", "v_slots", "bias_slots"))
    rows = k_slots.shape[1]
    if rows % block_size:
        raise ValueError(f"k_slots has {rows} rows, not a multiple of block_size={block_size}")
    check_tensor("slot_lens", slot_lens, ndim=3, dtypes=INDEX_DTYPES)
    slots = rows // block_size
    what = f"[B, H_kv, M] with M = rows / block_size = {slots}"
    check_shape("slot_lens", slot_lens, (q.shape[0], k_slots.shape[2], slots), what)
    check_same_device(*zip(*tensors, ("slot_lens", slot_lens)))
    if check_ids:
        check_range("slot_lens", slot_lens, 0, block_size + 1, f"at most block_size={block_size} rows per slot")
    return slots


def validate_blocks(
    q, k_cache, v_cache, block_ids, lengths, block_size, scale=None, bias=None, out=None, lse=None, check_ids=True
):
    """Check every argument of `sparse_decode_blocks`; returns the number of cache blocks."""
    check_positive_int("block_size", block_size)
    tensors = _validate_common(q, k_cache, v_cache, bias, out, lse, scale, ("k_cache", "v_cache", "bias"))
    batch, seq, heads, _ = k_cache.shape
    check_tensor("block_ids", block_ids, ndim=3, dtypes=INDEX_DTYPES)
    check_tensor("lengths", lengths, ndim=1, dtypes=INDEX_DTYPES)
    if block_ids.shape[:2] != (batch, heads):
        raise ValueError(f"block_ids has shape {tuple(block_ids.shape)}, expected [B={batch}, H_kv={heads}, K]")
    check_shape("lengths", lengths, (batch,), "[B]")
    check_same_device(*zip(*tensors, ("block_ids", block_ids), ("lengths", lengths)))
    n_blocks = -(-seq // block_size)
    if check_ids:
        check_range("block_ids", block_ids, -1, n_blocks, f"ceil(S / block_size) with S={seq}, block_size={block_size}")
        check_range("lengths", lengths, 0, seq + 1, f"at most S={seq} stored keys")
    return n_blocks


# ----------------------------------------------------------------------------------------------
# reference
# ----------------------------------------------------------------------------------------------


def _attend_fp32(q, keys, values, allowed, bias, scale, out, lse):
    """q [B, Hq, d]; keys/values [B, H, L, d]; allowed [B, H, L]; bias [B, H, L] or None.

    Rows that are not allowed contribute nothing whatever they hold (an empty slot may be NaN):
    their logits become -inf by masked_fill and their values 0, since 0 * NaN would be NaN."""
    batch, q_heads, dim = q.shape
    heads = keys.shape[1]
    qf = q.float().reshape(batch, heads, q_heads // heads, dim)
    logits = torch.einsum("bhgd,bhld->bhgl", qf, keys.float()) * scale
    if bias is not None:
        logits = logits + bias.float().unsqueeze(2)
    logits = logits.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    row_lse = torch.logsumexp(logits, dim=-1)  # -inf where no key is valid
    probs = torch.exp(logits - row_lse.nan_to_num(neginf=0.0).unsqueeze(-1))
    values = values.float().masked_fill(~allowed.unsqueeze(-1), 0.0)
    result = torch.einsum("bhgl,bhld->bhgd", probs, values).reshape(batch, q_heads, dim)
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    lse = torch.empty((batch, q_heads), dtype=torch.float32, device=q.device) if lse is None else lse
    out.copy_(result)
    lse.copy_(row_lse.reshape(batch, q_heads))
    return out, lse


@_doc(_SLOTS_DOC)
def sparse_decode_slots_reference(
    q, k_slots, v_slots, slot_lens, block_size, scale=None, bias_slots=None, out=None, lse=None, check_ids=True
):
    if check_ids:
        validate_slots(q, k_slots, v_slots, slot_lens, block_size, scale, bias_slots, out, lse, check_ids)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    batch, rows, heads, _ = k_slots.shape
    offsets = torch.arange(block_size, device=q.device)
    allowed = (offsets < slot_lens.long().clamp(0, block_size).unsqueeze(-1)).reshape(batch, heads, rows)
    bias = None if bias_slots is None else bias_slots.transpose(1, 2)
    return _attend_fp32(q, k_slots.transpose(1, 2), v_slots.transpose(1, 2), allowed, bias, scale, out, lse)


@_doc(_BLOCKS_DOC)
def sparse_decode_blocks_reference(
    q, k_cache, v_cache, block_ids, lengths, block_size, scale=None, bias=None, out=None, lse=None, check_ids=True
):
    if check_ids:
        validate_blocks(q, k_cache, v_cache, block_ids, lengths, block_size, scale, bias, out, lse, check_ids)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    batch, seq, heads, dim = k_cache.shape
    n_blocks = -(-seq // block_size)
    ids = block_ids.long()
    width = ids.shape[-1]
    # the same gather as SparseCacheLayer.blocks(): positions of every selected row, then validity
    offsets = torch.arange(block_size, device=q.device)
    pos = (ids.clamp(min=0).unsqueeze(-1) * block_size + offsets).reshape(batch, heads, width * block_size)
    exists = ((ids >= 0) & (ids < n_blocks)).repeat_interleave(block_size, dim=-1)
    allowed = exists & (pos < lengths.long().clamp(0, seq).view(-1, 1, 1))
    index = pos.clamp(0, max(seq - 1, 0))
    if seq == 0:  # nothing stored: every key is invalid, gather from a dummy row
        k_cache, v_cache = q.new_zeros(batch, 1, heads, dim), q.new_zeros(batch, 1, heads, dim)
        bias = None if bias is None else bias.new_zeros(batch, 1, heads)
    gather_idx = index.unsqueeze(-1).expand(-1, -1, -1, dim)
    keys = torch.gather(k_cache.transpose(1, 2), 2, gather_idx)
    values = torch.gather(v_cache.transpose(1, 2), 2, gather_idx)
    key_bias = None if bias is None else torch.gather(bias.transpose(1, 2), 2, index)
    return _attend_fp32(q, keys, values, allowed, key_bias, scale, out, lse)


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


def _sparse_decode_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, sel_ptr, len_ptr, out_ptr, lse_ptr,
    n_sel, per_split, n_rows, n_blocks, scale,
    sq_b, sq_h, sq_d, sk_b, sk_s, sk_h, sk_d, sv_b, sv_s, sv_h, sv_d, sc_b, sc_s, sc_h,
    ss_b, ss_h, ss_k, so_b, so_h, so_s, so_d, sl_b, sl_h, sl_s,
    GROUP: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
    D: tl.constexpr, D_P: tl.constexpr, SLOTS: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
):
    """Program (b, h, split): the GQA group of KV head h over selection entries
    [split * per_split, (split + 1) * per_split).  Writes that split's normalised output and LSE
    (out/lse carry a split stride; with one split they are the final result)."""
    b = tl.cast(tl.program_id(0), tl.int64)
    h = tl.cast(tl.program_id(1), tl.int64)
    split = tl.cast(tl.program_id(2), tl.int64)
    g = tl.arange(0, GP)
    g_ok = g < GROUP
    qh = h * GROUP + g
    dd = tl.arange(0, D_P)
    d_ok = dd < D
    rows = tl.arange(0, BLOCK_P)
    q_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * sq_b + qh[:, None] * sq_h + dd[None, :] * sq_d, mask=q_mask, other=0.0)
    if not NATIVE_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D_P], tl.float32)
    if SLOTS:
        length = 0
    else:
        length = tl.minimum(tl.load(len_ptr + b).to(tl.int64), n_rows)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_sel)
    for i in range(lo, hi):
        idx = tl.cast(i, tl.int64)
        entry = tl.load(sel_ptr + b * ss_b + h * ss_h + idx * ss_k).to(tl.int64)
        if SLOTS:  # entry = valid rows of slot i
            start = idx * BLOCK
            count = tl.minimum(tl.maximum(entry, 0), BLOCK)
        else:  # entry = block id; clamp so a bad id reads nothing
            ok = (entry >= 0) & (entry < n_blocks)
            start = tl.where(ok, entry, 0) * BLOCK
            count = tl.where(ok, tl.minimum(tl.maximum(length - start, 0), BLOCK), 0)
        key_ok = rows < count
        pos = start + rows
        tile = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + b * sk_b + pos[:, None] * sk_s + h * sk_h + dd[None, :] * sk_d, mask=tile, other=0.0)
        v = tl.load(v_ptr + b * sv_b + pos[:, None] * sv_s + h * sv_h + dd[None, :] * sv_d, mask=tile, other=0.0)
        if NATIVE_DOT:  # bf16/fp16 tensor cores, fp32 accumulation
            s = tl.dot(q, tl.trans(k))
        elif USE_DOT:  # group padded to 16 rows; ieee keeps fp32 exact (no tf32)
            k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            k = k.to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        s = s * scale
        if HAS_BIAS:
            s = s + tl.load(bias_ptr + b * sc_b + pos * sc_s + h * sc_h, mask=key_ok, other=0.0).to(tl.float32)[None, :]
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked so far: avoid inf - inf
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if NATIVE_DOT:
            pv = tl.dot(p.to(v.dtype), v)
        elif USE_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    row_lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    o_ptrs = out_ptr + b * so_b + qh[:, None] * so_h + split * so_s + dd[None, :] * so_d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(lse_ptr + b * sl_b + qh * sl_h + split * sl_s, row_lse, mask=g_ok)


def _combine_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, lse_ptr, n_splits,
    sp_b, sp_h, sp_s, sp_d, spl_b, spl_h, spl_s, so_b, so_h, so_d, sl_b, sl_h,
    S_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
):
    """Program (b, query head): out = sum_s exp(lse_s - lse) * o_s, lse = logsumexp_s lse_s."""
    b = tl.cast(tl.program_id(0), tl.int64)
    qh = tl.cast(tl.program_id(1), tl.int64)
    sp = tl.arange(0, S_P)
    s_ok = sp < n_splits
    dd = tl.arange(0, D_P)
    d_ok = dd < D
    part_lse = tl.load(part_lse_ptr + b * spl_b + qh * spl_h + sp * spl_s, mask=s_ok, other=float("-inf"))
    top = tl.max(part_lse, axis=0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(part_lse - top_safe)  # 0 for splits without keys
    total = tl.sum(weight, axis=0)
    part_ptrs = part_o_ptr + b * sp_b + qh * sp_h + sp[:, None] * sp_s + dd[None, :] * sp_d
    part_o = tl.load(part_ptrs, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(weight[:, None] * part_o, axis=0) / tl.where(total > 0.0, total, 1.0)
    row_lse = tl.where(total > 0.0, top_safe + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    tl.store(out_ptr + b * so_b + qh * so_h + dd * so_d, o.to(out_ptr.dtype.element_ty), mask=d_ok)
    tl.store(lse_ptr + b * sl_b + qh * sl_h, row_lse)


_KERNEL = LazyKernel(_sparse_decode_kernel)
_COMBINE = LazyKernel(_combine_kernel)
MIN_ENTRIES_PER_SPLIT = 4  # a split below this costs more in its partial write than it saves


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_splits(batch: int, heads: int, n_sel: int, device: torch.device) -> int:
    """Splits of the selection per (sequence, KV head) so the grid fills the GPU about twice
    (flash-decoding); 1 off CUDA.  A host-side choice from shapes only: no device sync."""
    if device.type != "cuda" or n_sel <= MIN_ENTRIES_PER_SPLIT:
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    wanted = -(-2 * _sm_count(index) // max(batch * heads, 1))
    return max(1, min(wanted, -(-n_sel // MIN_ENTRIES_PER_SPLIT)))


def _launch(q, k, v, bias, sel, lengths, block_size, scale, out, lse, slots: bool, n_blocks: int, num_splits=None):
    batch, q_heads, dim = q.shape
    heads = k.shape[2]
    group = q_heads // heads
    n_sel = sel.shape[2]
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    lse = torch.empty((batch, q_heads), dtype=torch.float32, device=q.device) if lse is None else lse
    if batch == 0 or q_heads == 0 or dim == 0:
        return out, lse
    splits = choose_splits(batch, heads, n_sel, q.device) if num_splits is None else int(num_splits)
    check_positive_int("num_splits", splits)
    splits = min(splits, max(n_sel, 1))
    per_split = -(-n_sel // splits)
    use_dot = group > 2  # tl.dot needs >= 16 rows: pad the group; tiny groups use a sum-reduce
    native_dot = use_dot and q.dtype in (torch.bfloat16, torch.float16) and not interpreting()
    gp = next_pow2(group, 16 if use_dot else 1)
    has_bias = bias is not None
    sc = bias.stride() if has_bias else (0, 0, 0)
    len_arg = lengths if lengths is not None else sel  # placeholder in slot mode
    if splits == 1:
        target_o, target_lse = out, lse
        so = (out.stride(0), out.stride(1), 0, out.stride(2))
        sl = (lse.stride(0), lse.stride(1), 0)
    else:  # fp32 partials [B, Hq, splits, d] and [B, Hq, splits], combined below
        target_o = torch.empty((batch, q_heads, splits, dim), dtype=torch.float32, device=q.device)
        target_lse = torch.empty((batch, q_heads, splits), dtype=torch.float32, device=q.device)
        so = (target_o.stride(0), target_o.stride(1), target_o.stride(2), target_o.stride(3))
        sl = target_lse.stride()
    d_p = next_pow2(dim, 16 if use_dot else 1)
    with cuda_device_guard(q):
        _KERNEL[(batch, heads, splits)](
            q, k, v, bias if has_bias else k, sel, len_arg, target_o, target_lse,
            n_sel, per_split, k.shape[1], n_blocks, scale,
            *q.stride(), *k.stride(), *v.stride(), *sc, *sel.stride(), *so, *sl,
            GROUP=group, GP=gp, BLOCK=block_size, BLOCK_P=next_pow2(block_size, 16 if use_dot else 1),
            D=dim, D_P=d_p, SLOTS=slots, HAS_BIAS=has_bias, USE_DOT=use_dot, NATIVE_DOT=native_dot,
            num_warps=4 if use_dot else 8,  # the sum-reduce tile [GP, BLOCK, D] needs more threads
        )
        if splits > 1:
            _COMBINE[(batch, q_heads)](
                target_o, target_lse, out, lse, splits,
                *target_o.stride(), *target_lse.stride(), *out.stride(), *lse.stride(),
                S_P=next_pow2(splits), D=dim, D_P=next_pow2(dim), num_warps=4,
            )
    return out, lse


@_doc(_SLOTS_DOC + _SPLITS_DOC)
def sparse_decode_slots_triton(
    q, k_slots, v_slots, slot_lens, block_size, scale=None, bias_slots=None, out=None, lse=None, check_ids=True,
    num_splits=None,
):
    slots = validate_slots(q, k_slots, v_slots, slot_lens, block_size, scale, bias_slots, out, lse, check_ids)
    return _launch(
        q, k_slots, v_slots, bias_slots, slot_lens, None, block_size, scale, out, lse, True, slots, num_splits
    )


@_doc(_BLOCKS_DOC + _SPLITS_DOC)
def sparse_decode_blocks_triton(
    q, k_cache, v_cache, block_ids, lengths, block_size, scale=None, bias=None, out=None, lse=None, check_ids=True,
    num_splits=None,
):
    n_blocks = validate_blocks(q, k_cache, v_cache, block_ids, lengths, block_size, scale, bias, out, lse, check_ids)
    return _launch(
        q, k_cache, v_cache, bias, block_ids, lengths, block_size, scale, out, lse, False, n_blocks, num_splits
    )
