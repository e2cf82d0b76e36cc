"""row_store: write one new token row per sequence from the device into the host KV store.

The decode step's D2H write-back.  Each sequence stores its new K/V (and NOSA's CIS) row at its own
position, which lives on the device, so on CUDA the kernel writes *directly into pinned host
memory* through UVA (zero-copy PCIe writes): no host index, no sync, and the positions may change
from step to step inside a captured graph.  Ordering is the stream's: a later read of the host
store on another stream (the block gather) waits on an event recorded after this launch.

* `row_store_triton`: one program per (sequence, KV head), each storing a d-wide row;
* `row_store_reference`: plain PyTorch indexing, the semantics (and the CPU path).
"""

from __future__ import annotations

import torch

from ._common import FLOAT_DTYPES, INDEX_DTYPES, LazyKernel, check_bias_pair, check_same_dtype, check_shape, check_tensor, check_transfer_sides, cuda_device_guard, next_pow2, tl

_DOC = """Store row b of the new tokens at host position positions[b], for every sequence b.

    k_new, v_new    [B, H_kv, d]      float32/float16/bfloat16, on the device
    positions       [B]               int32/int64 on the device; -1 (or any value outside [0, S))
                                      skips the sequence: nothing is written
    k_host, v_host  [B, S, H_kv, d]   same dtype as k_new; on CUDA pinned CPU memory (UVA), else
                                      on the device of k_new; any strides; written in place
    bias_new        [B, H_kv] or None            optional per-token bias (NOSA's CIS)
    bias_host       [B, S, H_kv] or None         same dtype as bias_new; both or neither

    Each sequence writes exactly one row, so no two writes meet.  Returns None.
    """


def _doc(fn):
    fn.__doc__ = _DOC
    return fn


def validate_row_store(k_new, v_new, positions, k_host, v_host, bias_new, bias_host):
    """Check every argument; returns (B, S, H_kv, d)."""
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        check_tensor(name, t, ndim=3, dtypes=FLOAT_DTYPES)
    for name, t in (("k_host", k_host), ("v_host", v_host)):
        check_tensor(name, t, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES)
    batch, seq, heads, dim = k_host.shape
    check_shape("v_host", v_host, k_host.shape, "must match k_host")
    check_shape("k_new", k_new, (batch, heads, dim), "[B, H_kv, d] from k_host")
    check_shape("v_new", v_new, k_new.shape, "must match k_new")
    check_shape("positions", positions, (batch,), "[B]")
    check_same_dtype(("k_new", "v_new", "k_host", "v_host"), (k_new, v_new, k_host, v_host))
    device_side = [("k_new", k_new), ("v_new", v_new), ("positions", positions)]
    host_side = [("k_host", k_host), ("v_host", v_host)]
    if check_bias_pair(("bias_new", "bias_host"), (bias_new, bias_host), ((batch, heads), (batch, seq, heads)), ("[B, H_kv]", "[B, S, H_kv] from k_host")):
        device_side.append(("bias_new", bias_new))
        host_side.append(("bias_host", bias_host))
    check_transfer_sides(device_side, host_side, k_new)
    return batch, seq, heads, dim


@_doc
def row_store_reference(k_new, v_new, positions, k_host, v_host, bias_new=None, bias_host=None):
    batch, seq, _, _ = validate_row_store(k_new, v_new, positions, k_host, v_host, bias_new, bias_host)
    if batch == 0 or seq == 0:
        return
    keep = (positions >= 0) & (positions < seq)
    index = positions.long().clamp(0, seq - 1)
    rows = torch.arange(batch, device=positions.device)
    # a skipped sequence writes back the row it read: one write per sequence, no row selection
    for new, host in ((k_new, k_host), (v_new, v_host), (bias_new, bias_host)):
        if new is None:
            continue
        mask = keep.view(-1, *([1] * (new.dim() - 1)))
        host[rows, index] = torch.where(mask, new, host[rows, index])


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


def _row_store_kernel(
    k_new, v_new, bias_new, positions, k_host, v_host, bias_host,
    n_heads, seq_len,
    nk_b, nk_h, nk_d, nv_b, nv_h, nv_d, nb_b, nb_h,
    hk_b, hk_s, hk_h, hk_d, hv_b, hv_s, hv_h, hv_d, hb_b, hb_s, hb_h,
    sp_b,
    D: tl.constexpr, D_P: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    task = tl.cast(tl.program_id(0), tl.int64)
    b = task // n_heads
    h = task % n_heads
    pos = tl.load(positions + b * sp_b).to(tl.int64)
    ok = (pos >= 0) & (pos < seq_len)
    cols = tl.arange(0, D_P)
    row = ok & (cols < D)
    k = tl.load(k_new + b * nk_b + h * nk_h + cols * nk_d, mask=row)
    tl.store(k_host + b * hk_b + pos * hk_s + h * hk_h + cols * hk_d, k, mask=row)
    v = tl.load(v_new + b * nv_b + h * nv_h + cols * nv_d, mask=row)
    tl.store(v_host + b * hv_b + pos * hv_s + h * hv_h + cols * hv_d, v, mask=row)
    if HAS_BIAS:
        c = tl.load(bias_new + b * nb_b + h * nb_h, mask=ok)
        tl.store(bias_host + b * hb_b + pos * hb_s + h * hb_h, c, mask=ok)


_KERNEL = LazyKernel(_row_store_kernel)


@_doc
def row_store_triton(k_new, v_new, positions, k_host, v_host, bias_new=None, bias_host=None):
    batch, seq, heads, dim = validate_row_store(k_new, v_new, positions, k_host, v_host, bias_new, bias_host)
    if batch * heads == 0 or seq == 0 or dim == 0:
        return
    has_bias = bias_new is not None
    nb = bias_new.stride() if has_bias else (0, 0)
    hb = bias_host.stride() if has_bias else (0, 0, 0)
    with cuda_device_guard(k_new):
        _KERNEL[(batch * heads,)](
            k_new, v_new, bias_new if has_bias else k_new, positions, k_host, v_host, bias_host if has_bias else k_host,
            heads, seq,
            *k_new.stride(), *v_new.stride(), *nb,
            *k_host.stride(), *v_host.stride(), *hb,
            *positions.stride(),
            D=dim, D_P=next_pow2(dim), HAS_BIAS=has_bias, num_warps=1,
        )
