"""block_gather: move missed KV blocks from host memory into device slots.

Three implementations of one operation, all with the same signature:

* `block_gather_triton`: NOSI/SparDA's persistent UVA gather.  A fixed number of programs walk the
  task list grid-stride and load tiles *directly from pinned host memory* (zero-copy PCIe reads);
  one launch moves thousands of scattered blocks, and the ids can live on the device (graph-safe).
* `block_gather_reference`: plain PyTorch advanced indexing, the semantics the others must match.
* `block_gather_copy_engine`: the copy-engine baseline for benchmarks: gather the rows on the host
  into a pinned staging buffer, one DMA copy, `index_copy_` into the slots.

A task (h, b, m) with host block id `i = load_ids[h, b, m]` copies host tokens
[i*block, i*block + block) ∩ [0, S) of head h, sequence b into slot rows [m*block, m*block + block)
of head h, sequence b.  id -1 skips the task.  Rows of a partial last block (past S) are *not*
written: those slot rows keep whatever they held (callers track valid lengths separately).
"""

from __future__ import annotations

import torch

from ._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    LazyKernel,
    check_bias_pair,
    check_positive_int,
    check_range,
    check_same_dtype,
    check_shape,
    check_tensor,
    check_transfer_sides,
    cuda_device_guard,
    next_pow2,
    tl,
)

_DOC = """Copy host KV blocks into device slots, one task per (KV head, sequence, slot).

    k_host, v_host  [B, S, H_kv, d]   float32/float16/bfloat16; on CUDA: pinned CPU memory (or the
                                      slots' device); any strides
    load_ids        [H_kv, B, M]      int32/int64 host block ids, -1 = skip; values in
                                      [-1, ceil(S / block_size)); on the slots' device
    k_slots, v_slots [B, M*block_size, H_kv, d]  same dtype as k_host; written in place
    block_size      int               tokens per block
    bias_host       [B, S, H_kv] or None          optional per-token bias (NOSA's CIS)
    bias_slots      [B, M*block_size, H_kv] or None  same dtype as bias_host; both or neither
    num_programs    int               persistent programs (CTAs) looping over the B*H_kv*M tasks
    check_ids       bool              check the id range (one device sync); when False the kernel
                                      still skips out-of-range ids instead of reading past S

    Task (h, b, m) with id i >= 0 copies host rows [i*block, i*block+block) ∩ [0, S) of head h,
    sequence b to slot rows [m*block, m*block+block) of head h, sequence b.  Slot rows past the end
    of a partial last block, and all rows of skipped tasks, are left untouched.  Returns None.
    """


def _doc(fn):
    fn.__doc__ = _DOC
    return fn


def validate_block_gather(k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host, bias_slots, num_programs, check_ids=True):
    """Check every argument; returns (B, S, H_kv, d, M, number of host blocks)."""
    check_positive_int("block_size", block_size)
    check_positive_int("num_programs", num_programs)
    for name, t in (("k_host", k_host), ("v_host", v_host), ("k_slots", k_slots), ("v_slots", v_slots)):
        check_tensor(name, t, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("load_ids", load_ids, ndim=3, dtypes=INDEX_DTYPES)
    batch, seq, heads, dim = k_host.shape
    heads_ids, batch_ids, slots = load_ids.shape
    check_shape("v_host", v_host, k_host.shape, "must match k_host")
    check_shape("load_ids", load_ids, (heads, batch, slots), "[H_kv, B, M] with H_kv, B from k_host")
    check_shape("k_slots", k_slots, (batch, slots * block_size, heads, dim), f"[B, M*block_size, H_kv, d] with M={slots}, block_size={block_size}")
    check_shape("v_slots", v_slots, k_slots.shape, "must match k_slots")
    check_same_dtype(("k_host", "v_host", "k_slots", "v_slots"), (k_host, v_host, k_slots, v_slots))
    device_side = [("k_slots", k_slots), ("v_slots", v_slots), ("load_ids", load_ids)]
    host_side = [("k_host", k_host), ("v_host", v_host)]
    if check_bias_pair(("bias_host", "bias_slots"), (bias_host, bias_slots), ((batch, seq, heads), (batch, slots * block_size, heads)),
                       ("[B, S, H_kv] from k_host", "[B, M*block_size, H_kv]")):
        device_side.append(("bias_slots", bias_slots))
        host_side.append(("bias_host", bias_host))
    check_transfer_sides(device_side, host_side, k_slots)
    n_host_blocks = -(-seq // block_size)
    if check_ids:
        check_range("load_ids", load_ids, -1, n_host_blocks, f"ceil(S / block_size) with S={seq}, block_size={block_size}")
    return batch, seq, heads, dim, slots, n_host_blocks


def _task_rows(load_ids: torch.Tensor, seq: int, block_size: int, n_host_blocks: int):
    """(b, h, host row, slot row), one entry per token row to copy, as int64 vectors."""
    ids = load_ids.long()
    h, b, m = ((ids >= 0) & (ids < n_host_blocks)).nonzero(as_tuple=True)
    offsets = torch.arange(block_size, device=ids.device)
    src = ids[h, b, m].unsqueeze(1) * block_size + offsets
    dst = m.unsqueeze(1) * block_size + offsets
    keep = src < seq  # a partial last block copies only its real rows
    expand = lambda x: x.unsqueeze(1).expand_as(src)[keep]
    return expand(b), expand(h), src[keep], dst[keep]


@_doc
def block_gather_reference(k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host=None, bias_slots=None, num_programs=16, check_ids=True):
    # Every task's rows are read and written back (the old value where a task or row is skipped):
    # fixed shapes and no row selection, so the reference reads nothing back from the device.
    batch, seq, heads, dim, slots, n_host_blocks = validate_block_gather(
        k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host, bias_slots, num_programs, check_ids
    )
    if heads * batch * slots == 0 or seq == 0:
        return
    source, target = k_host.device, k_slots.device
    ids = load_ids.to(source).long()                                        # [H, B, M]
    offsets = torch.arange(block_size, device=source)
    src = ids.clamp(min=0).unsqueeze(-1) * block_size + offsets              # [H, B, M, bs] host rows
    keep = ((ids >= 0) & (ids < n_host_blocks)).unsqueeze(-1) & (src < seq)
    src = src.clamp(max=seq - 1)
    h_src, b_src = torch.arange(heads, device=source).view(-1, 1, 1, 1), torch.arange(batch, device=source).view(1, -1, 1, 1)
    dst = (torch.arange(slots, device=target).view(1, 1, -1, 1) * block_size + torch.arange(block_size, device=target))
    h_dst, b_dst = torch.arange(heads, device=target).view(-1, 1, 1, 1), torch.arange(batch, device=target).view(1, -1, 1, 1)
    keep = keep.to(target)
    for host, dest in ((k_host, k_slots), (v_host, v_slots), (bias_host, bias_slots)):
        if host is None:
            continue
        rows = host[b_src, src, h_src].to(target)                            # [H, B, M, bs, ...]
        mask = keep.view(*keep.shape, *([1] * (rows.dim() - keep.dim())))
        dest[b_dst, dst, h_dst] = torch.where(mask, rows, dest[b_dst, dst, h_dst])


@_doc
def block_gather_copy_engine(k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host=None, bias_slots=None, num_programs=16, check_ids=True):
    # Host-side gather into a pinned staging buffer, one DMA per tensor, then a device scatter.
    # The ids come to the host first (a sync): that is the price of the copy-engine path.
    batch, seq, heads, dim, slots, n_host_blocks = validate_block_gather(
        k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host, bias_slots, num_programs, check_ids
    )
    b, h, src, dst = _task_rows(load_ids.to(k_host.device), seq, block_size, n_host_blocks)
    if src.numel() == 0:
        return
    pin = k_slots.device.type == "cuda" and k_host.device.type == "cpu"
    dev_rows = ((b * slots * block_size + dst) * heads + h).to(k_slots.device, non_blocking=pin)
    host_rows = (b * seq + src) * heads + h
    pairs = [(k_host, k_slots), (v_host, v_slots)]
    if bias_host is not None:
        pairs.append((bias_host, bias_slots))
    for host, dest in pairs:
        flat = host.reshape(batch * seq * heads, -1)  # a view for the usual contiguous host store
        staging = torch.empty((src.numel(), flat.shape[1]), dtype=host.dtype, pin_memory=pin)
        torch.index_select(flat, 0, host_rows, out=staging)
        moved = staging.to(dest.device, non_blocking=pin)
        if dest.is_contiguous():
            dest.view(-1, flat.shape[1]).index_copy_(0, dev_rows, moved)
        else:
            rows_b, rows_h, rows_dst = (x.to(dest.device) for x in (b, h, dst))
            dest[rows_b, rows_dst, rows_h] = moved.view(-1, *dest.shape[3:])


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


def _block_gather_kernel(
    k_src, v_src, bias_src, ids, k_dst, v_dst, bias_dst,
    n_tasks, n_seq, n_slots, seq_len, n_host_blocks,
    sk_b, sk_s, sk_h, sk_d, sv_b, sv_s, sv_h, sv_d,
    dk_b, dk_s, dk_h, dk_d, dv_b, dv_s, dv_h, dv_d,
    sc_b, sc_s, sc_h, dc_b, dc_s, dc_h,
    si_h, si_b, si_m,
    BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
    HAS_BIAS: tl.constexpr, NUM_PROGS: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_P)
    cols = tl.arange(0, D_P)
    # grid-stride over tasks t = (h * B + b) * M + m: no program ever waits for another
    for t in tl.range(pid, n_tasks, NUM_PROGS):
        task = tl.cast(t, tl.int64)
        m = task % n_slots
        b = (task // n_slots) % n_seq
        h = task // (n_slots * n_seq)
        blk = tl.load(ids + h * si_h + b * si_b + m * si_m).to(tl.int64)
        # skipped (-1) and out-of-range ids become an all-false mask: nothing is read or written
        ok = (blk >= 0) & (blk < n_host_blocks)
        src_row = blk * BLOCK + rows
        row_ok = ok & (rows < BLOCK) & (src_row < seq_len)
        dst_row = m * BLOCK + rows
        tile = row_ok[:, None] & (cols < D)[None, :]
        k = tl.load(k_src + b * sk_b + src_row[:, None] * sk_s + h * sk_h + cols[None, :] * sk_d, mask=tile)
        tl.store(k_dst + b * dk_b + dst_row[:, None] * dk_s + h * dk_h + cols[None, :] * dk_d, k, mask=tile)
        v = tl.load(v_src + b * sv_b + src_row[:, None] * sv_s + h * sv_h + cols[None, :] * sv_d, mask=tile)
        tl.store(v_dst + b * dv_b + dst_row[:, None] * dv_s + h * dv_h + cols[None, :] * dv_d, v, mask=tile)
        if HAS_BIAS:
            c = tl.load(bias_src + b * sc_b + src_row * sc_s + h * sc_h, mask=row_ok)
            tl.store(bias_dst + b * dc_b + dst_row * dc_s + h * dc_h, c, mask=row_ok)


_KERNEL = LazyKernel(_block_gather_kernel)


@_doc
def block_gather_triton(k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host=None, bias_slots=None, num_programs=16, check_ids=True):
    batch, seq, heads, dim, slots, n_host_blocks = validate_block_gather(
        k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host, bias_slots, num_programs, check_ids
    )
    n_tasks = heads * batch * slots
    if n_tasks == 0 or seq == 0 or dim == 0:
        return
    has_bias = bias_host is not None
    bias_src = bias_host if has_bias else k_slots  # placeholders, never dereferenced
    bias_dst = bias_slots if has_bias else k_slots
    sc = bias_host.stride() if has_bias else (0, 0, 0)
    dc = bias_slots.stride() if has_bias else (0, 0, 0)
    with cuda_device_guard(k_slots):
        _KERNEL[(num_programs,)](
            k_host, v_host, bias_src, load_ids, k_slots, v_slots, bias_dst,
            n_tasks, batch, slots, seq, n_host_blocks,
            *k_host.stride(), *v_host.stride(), *k_slots.stride(), *v_slots.stride(),
            *sc, *dc, *load_ids.stride(),
            BLOCK=block_size, BLOCK_P=next_pow2(block_size), D=dim, D_P=next_pow2(dim),
            HAS_BIAS=has_bias, NUM_PROGS=num_programs, num_warps=8,
        )
