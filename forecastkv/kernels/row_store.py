"""row_store: write one new token row per sequence from the device into the host KV store.

The decode step's D2H write-back.  Each sequence stores its new K/V (and NOSA's CIS) row at its own
position, which lives on the device, so on CUDA the kernel writes *directly into pinned host
memory* through UVA (zero-copy PCIe writes): no host index, no sync, and the positions may change
from step to step inside a captured graph.  Ordering is the stream's: a later read of the host
store on another stream (the block gather) waits on an event recorded after this launch.  The host
is indexed by position ([B, S, H, d]) or paged (a pool of physical blocks and a per-sequence block
table on the device, the offloaded cache's host tier: one more load per row).

* `row_store_triton`: one program per (sequence, KV head), each storing a d-wide row;
* `row_store_reference`: plain PyTorch indexing, the semantics (and the CPU path).
"""

from __future__ import annotations

import torch

from ._common import FLOAT_DTYPES, INDEX_DTYPES, LazyKernel, check_bias_pair, check_same_dtype, check_shape, check_tensor, check_transfer_sides, cuda_device_guard, next_pow2, tl
from .block_gather import host_layout

_DOC = """Store row b of the new tokens at host position positions[b], for every sequence b.

    k_new, v_new    [B, H_kv, d]      float32/float16/bfloat16, on the device
    positions       [B]               int32/int64 on the device; -1 (or any value outside [0, S))
                                      skips the sequence: nothing is written
    k_host, v_host  [B, S, H_kv, d]   same dtype as k_new; on CUDA pinned CPU memory (UVA), else
                                      on the device of k_new; any strides; written in place.  With
                                      block_table: the pool [P, block, H_kv, d] of physical blocks
    bias_new        [B, H_kv] or None            optional per-token bias (NOSA's CIS)
    bias_host       [B, S, H_kv] (pool: [P, block, H_kv]) or None   same dtype as bias_new; both or neither
    block_table     [B, NB] or None   int32/int64 on the device: sequence b's position p lives in
                                      row p % block of physical block block_table[b, p // block]
                                      (S = NB * block; an entry -1, or out of [0, P), skips)

    Each sequence writes exactly one row, so no two writes meet.  Returns None.
    """


def _doc(fn):
    fn.__doc__ = _DOC
    return fn


def validate_row_store(k_new, v_new, positions, k_host, v_host, bias_new, bias_host, block_table=None):
    """Check every argument; returns (B, S, H_kv, d) with S the positions a sequence can hold."""
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        check_tensor(name, t, ndim=3, dtypes=FLOAT_DTYPES)
    for name, t in (("k_host", k_host), ("v_host", v_host)):
        check_tensor(name, t, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES)
    check_shape("v_host", v_host, k_host.shape, "must match k_host")
    batch, seq, heads, dim, bias_shape, bias_what = host_layout(k_host, block_table, k_host.shape[1])
    check_shape("k_new", k_new, (batch, heads, dim), "[B, H_kv, d] from k_host" if block_table is None else "[B, H_kv, d] with B from block_table")
    check_shape("v_new", v_new, k_new.shape, "must match k_new")
    check_shape("positions", positions, (batch,), "[B]")
    check_same_dtype(("k_new", "v_new", "k_host", "v_host"), (k_new, v_new, k_host, v_host))
    device_side = [("k_new", k_new), ("v_new", v_new), ("positions", positions)]
    if block_table is not None:
        device_side.append(("block_table", block_table))
    host_side = [("k_host", k_host), ("v_host", v_host)]
    if check_bias_pair(("bias_new", "bias_host"), (bias_new, bias_host), ((batch, heads), bias_shape), ("[B, H_kv]", bias_what)):
        device_side.append(("bias_new", bias_new))
        host_side.append(("bias_host", bias_host))
    check_transfer_sides(device_side, host_side, k_new)
    return batch, seq, heads, dim


def _destination(positions: torch.Tensor, block_table, seq: int, block: int, physical: int):
    """(index into dim 0 of the host, row in dim 1, keep) per sequence, every index clamped in range."""
    keep = (positions >= 0) & (positions < seq)
    index = positions.long().clamp(0, seq - 1)
    rows = torch.arange(positions.shape[0], device=positions.device)
    if block_table is None:
        return rows, index, keep
    phys = block_table.long()[rows, torch.div(index, block, rounding_mode="floor")]
    keep = keep & (phys >= 0) & (phys < physical)
    return phys.clamp(0, physical - 1), index % block, keep


@_doc
def row_store_reference(k_new, v_new, positions, k_host, v_host, bias_new=None, bias_host=None, block_table=None):
    batch, seq, _, _ = validate_row_store(k_new, v_new, positions, k_host, v_host, bias_new, bias_host, block_table)
    if batch == 0 or seq == 0 or k_host.shape[0] == 0:
        return
    first, row, keep = _destination(positions, block_table, seq, k_host.shape[1], k_host.shape[0])
    # a skipped sequence writes back the row it read: one write per sequence, no row selection
    for new, host in ((k_new, k_host), (v_new, v_host), (bias_new, bias_host)):
        if new is None:
            continue
        mask = keep.view(-1, *([1] * (new.dim() - 1)))
        host[first, row] = torch.where(mask, new, host[first, row])


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


def _row_store_kernel(
    k_new, v_new, bias_new, positions, table, k_host, v_host, bias_host,
    n_heads, seq_len, block, n_physical,
    nk_b, nk_h, nk_d, nv_b, nv_h, nv_d, nb_b, nb_h,
    hk_b, hk_p, hk_s, hk_h, hk_d, hv_b, hv_p, hv_s, hv_h, hv_d, hb_b, hb_p, hb_s, hb_h,
    sp_b, st_b, st_n,
    D: tl.constexpr, D_P: tl.constexpr, HAS_BIAS: tl.constexpr, PAGED: tl.constexpr,
):
    # a host row is at b*s_b + p*s_p + r*s_s: by position p is the position (r = 0), paged p is the
    # table's physical block, r the row in it, and s_b = 0
    task = tl.cast(tl.program_id(0), tl.int64)
    b = task // n_heads
    h = task % n_heads
    pos = tl.load(positions + b * sp_b).to(tl.int64)
    ok = (pos >= 0) & (pos < seq_len)
    if PAGED:
        safe = tl.where(ok, pos, 0)
        phys = tl.load(table + b * st_b + (safe // block) * st_n).to(tl.int64)
        ok = ok & (phys >= 0) & (phys < n_physical)
        row = safe % block
    else:
        phys = pos
        row = pos * 0
    cols = tl.arange(0, D_P)
    mask = ok & (cols < D)
    k = tl.load(k_new + b * nk_b + h * nk_h + cols * nk_d, mask=mask)
    tl.store(k_host + b * hk_b + phys * hk_p + row * hk_s + h * hk_h + cols * hk_d, k, mask=mask)
    v = tl.load(v_new + b * nv_b + h * nv_h + cols * nv_d, mask=mask)
    tl.store(v_host + b * hv_b + phys * hv_p + row * hv_s + h * hv_h + cols * hv_d, v, mask=mask)
    if HAS_BIAS:
        c = tl.load(bias_new + b * nb_b + h * nb_h, mask=ok)
        tl.store(bias_host + b * hb_b + phys * hb_p + row * hb_s + h * hb_h, c, mask=ok)


_KERNEL = LazyKernel(_row_store_kernel)


def _host_strides(tensor: torch.Tensor, paged: bool) -> tuple[int, ...]:
    """(s_b, s_p, s_s, rest...) for the kernel's b*s_b + p*s_p + r*s_s addressing."""
    stride = tensor.stride()
    return (0, *stride) if paged else (stride[0], stride[1], 0, *stride[2:])


@_doc
def row_store_triton(k_new, v_new, positions, k_host, v_host, bias_new=None, bias_host=None, block_table=None):
    batch, seq, heads, dim = validate_row_store(k_new, v_new, positions, k_host, v_host, bias_new, bias_host, block_table)
    if batch * heads == 0 or seq == 0 or dim == 0 or k_host.shape[0] == 0:
        return
    paged = block_table is not None
    has_bias = bias_new is not None
    nb = bias_new.stride() if has_bias else (0, 0)
    hb = _host_strides(bias_host, paged) if has_bias else (0, 0, 0, 0)
    with cuda_device_guard(k_new):
        _KERNEL[(batch * heads,)](
            k_new, v_new, bias_new if has_bias else k_new, positions, block_table if paged else positions,
            k_host, v_host, bias_host if has_bias else k_host,
            heads, seq, k_host.shape[1] if paged else 1, k_host.shape[0],
            *k_new.stride(), *v_new.stride(), *nb,
            *_host_strides(k_host, paged), *_host_strides(v_host, paged), *hb,
            *positions.stride(), *(block_table.stride() if paged else (0, 0)),
            D=dim, D_P=next_pow2(dim), HAS_BIAS=has_bias, PAGED=paged, num_warps=1,
        )
