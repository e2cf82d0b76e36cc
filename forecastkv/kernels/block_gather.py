"""block_gather: move missed KV blocks from host memory into device slots.

Three implementations of one operation, all with the same signature:

* `block_gather_triton`: NOSI/SparDA's persistent UVA gather.  A fixed number of programs walk the
  task list grid-stride and load tiles *directly from pinned host memory* (zero-copy PCIe reads);
  one launch moves thousands of scattered blocks, and the ids can live on the device (graph-safe).
* `block_gather_reference`: plain PyTorch advanced indexing, the semantics the others must match.
* `block_gather_copy_engine`: the copy-engine baseline for benchmarks: gather the rows on the host
  into a pinned staging buffer, one DMA copy, `index_copy_` into the slots.

Two host layouts.  By position (no `block_table`): host [B, S, H, d], and a task (h, b, m) with id
`i = load_ids[h, b, m]` copies host tokens [i*block, i*block + block) ∩ [0, S) of head h, sequence b.
Paged (vLLM's layout, the offloaded cache's host tier): host [P, block, H, d] is a pool of physical
blocks and `block_table` [B, NB] names sequence b's physical block for each logical block, so the
task copies all rows of physical block `block_table[b, i]`: one indirection, read on the device.
Either way the rows land in slot rows [m*block, m*block + block) of head h, sequence b; id -1 (or a
table entry -1) skips the task, and slot rows not copied keep whatever they held.
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
                                      slots' device); any strides.  With block_table: the pool
                                      [P, block_size, H_kv, d] of physical blocks
    load_ids        [H_kv, B, M]      int32/int64 logical block ids, -1 = skip; values in
                                      [-1, ceil(S / block_size)) (with block_table: [-1, NB));
                                      on the slots' device
    k_slots, v_slots [B, M*block_size, H_kv, d]  same dtype as k_host; written in place
    block_size      int               tokens per block
    bias_host       [B, S, H_kv] (pool: [P, block_size, H_kv]) or None   optional per-token bias (NOSA's CIS)
    bias_slots      [B, M*block_size, H_kv] or None  same dtype as bias_host; both or neither
    num_programs    int               persistent programs (CTAs) looping over the B*H_kv*M tasks
    check_ids       bool              check the id ranges (one device sync); when False the kernel
                                      still skips out-of-range ids instead of reading past a buffer
    block_table     [B, NB] or None   int32/int64 physical block of each logical block of each
                                      sequence (-1 = none), values in [-1, P); on the slots' device

    Task (h, b, m) with id i >= 0 copies host rows [i*block, i*block+block) ∩ [0, S) of head h,
    sequence b (paged: every row of physical block block_table[b, i]) to slot rows
    [m*block, m*block+block) of head h, sequence b.  Slot rows past the end of a partial last
    block, and all rows of skipped tasks, are left untouched.  Returns None.
    """


def _doc(fn):
    fn.__doc__ = _DOC
    return fn


def host_layout(k_host: torch.Tensor, block_table, block_size: int):
    """The host side of a transfer, by position (k_host [B, S, H, d]) or paged (k_host a pool
    [P, block_size, H, d], block_table [B, NB]): (B, S, H, d, the bias's shape, its description),
    with S = NB * block_size positions per sequence when paged."""
    if block_table is None:
        batch, seq, heads, dim = k_host.shape
        return batch, seq, heads, dim, (batch, seq, heads), "[B, S, H_kv] from k_host"
    check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES)
    physical, _, heads, dim = k_host.shape
    check_shape("k_host", k_host, (physical, block_size, heads, dim), f"a pool [P, block_size, H_kv, d] with block_size={block_size}")
    batch, n_logical = block_table.shape
    return batch, n_logical * block_size, heads, dim, (physical, block_size, heads), "[P, block_size, H_kv] from k_host"


def validate_block_gather(k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host, bias_slots, num_programs, check_ids=True, block_table=None):
    """Check every argument; returns (B, S, H_kv, d, M, logical blocks, physical blocks), where a
    paged host has S = NB * block_size logical rows and P physical blocks (else P = B * blocks)."""
    check_positive_int("block_size", block_size)
    check_positive_int("num_programs", num_programs)
    for name, t in (("k_host", k_host), ("v_host", v_host), ("k_slots", k_slots), ("v_slots", v_slots)):
        check_tensor(name, t, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("load_ids", load_ids, ndim=3, dtypes=INDEX_DTYPES)
    check_shape("v_host", v_host, k_host.shape, "must match k_host")
    batch, seq, heads, dim, bias_shape, bias_what = host_layout(k_host, block_table, block_size)
    heads_ids, batch_ids, slots = load_ids.shape
    check_shape("load_ids", load_ids, (heads, batch, slots), "[H_kv, B, M] with H_kv, B from k_host" if block_table is None else "[H_kv, B, M] with B from block_table")
    check_shape("k_slots", k_slots, (batch, slots * block_size, heads, dim), f"[B, M*block_size, H_kv, d] with M={slots}, block_size={block_size}")
    check_shape("v_slots", v_slots, k_slots.shape, "must match k_slots")
    check_same_dtype(("k_host", "v_host", "k_slots", "v_slots"), (k_host, v_host, k_slots, v_slots))
    device_side = [("k_slots", k_slots), ("v_slots", v_slots), ("load_ids", load_ids)]
    if block_table is not None:
        device_side.append(("block_table", block_table))
    host_side = [("k_host", k_host), ("v_host", v_host)]
    if check_bias_pair(("bias_host", "bias_slots"), (bias_host, bias_slots), (bias_shape, (batch, slots * block_size, heads)),
                       (bias_what, "[B, M*block_size, H_kv]")):
        device_side.append(("bias_slots", bias_slots))
        host_side.append(("bias_host", bias_host))
    check_transfer_sides(device_side, host_side, k_slots)
    n_host_blocks = -(-seq // block_size)
    n_physical = batch * n_host_blocks if block_table is None else k_host.shape[0]
    if check_ids:
        limit = f"ceil(S / block_size) with S={seq}, block_size={block_size}" if block_table is None else f"the block table's {n_host_blocks} logical blocks"
        check_range("load_ids", load_ids, -1, n_host_blocks, limit)
        if block_table is not None:
            check_range("block_table", block_table, -1, n_physical, f"the pool's {n_physical} physical blocks")
    return batch, seq, heads, dim, slots, n_host_blocks, n_physical


def _task_sources(ids: torch.Tensor, b: torch.Tensor, block_table, seq: int, block_size: int, n_host_blocks: int, n_physical: int):
    """For tasks with logical ids `ids` of sequences `b` (same shape [...]): (physical block [...]
    or None by position, first host row [..., bs] within it (by position: the row in [0, S)),
    keep [..., bs]) with every index clamped in range."""
    offsets = torch.arange(block_size, device=ids.device)
    ok = (ids >= 0) & (ids < n_host_blocks)
    if block_table is None:
        src = ids.clamp(min=0).unsqueeze(-1) * block_size + offsets
        return None, src.clamp(max=max(seq - 1, 0)), ok.unsqueeze(-1) & (src < seq)
    phys = block_table.to(ids.device).long()[b, ids.clamp(0, max(n_host_blocks - 1, 0))]
    ok = ok & (phys >= 0) & (phys < n_physical)
    keep = ok.unsqueeze(-1).expand(*ok.shape, block_size)
    return phys.clamp(0, max(n_physical - 1, 0)), offsets.expand(*ok.shape, block_size), keep


def _task_rows(load_ids: torch.Tensor, block_table, seq: int, heads: int, block_size: int, n_host_blocks: int, n_physical: int):
    """(b, h, flat host row, slot row), one entry per token row to copy, as int64 vectors; the flat
    host row indexes the host viewed as [rows * H_kv, ...] (by position: B*S rows, paged: P*block)."""
    ids = load_ids.long()
    n_heads, batch, slots = ids.shape
    b = torch.arange(batch, device=ids.device).view(1, -1, 1).expand_as(ids)
    h = torch.arange(n_heads, device=ids.device).view(-1, 1, 1).expand_as(ids).unsqueeze(-1)
    m = torch.arange(slots, device=ids.device).view(1, 1, -1).expand_as(ids).unsqueeze(-1)
    blk, row, keep = _task_sources(ids, b, block_table, seq, block_size, n_host_blocks, n_physical)
    first = b.unsqueeze(-1) * seq if blk is None else blk.unsqueeze(-1) * block_size
    flat = (first + row) * heads + h
    dst = m * block_size + torch.arange(block_size, device=ids.device)
    expand = lambda x: x.expand_as(keep)[keep]  # noqa: E731
    return expand(b.unsqueeze(-1)), expand(h), flat[keep], dst.expand_as(keep)[keep]


@_doc
def block_gather_reference(k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host=None, bias_slots=None, num_programs=16, check_ids=True, block_table=None):
    # Every task's rows are read and written back (the old value where a task or row is skipped):
    # fixed shapes and no row selection, so the reference reads nothing back from the device.
    batch, seq, heads, dim, slots, n_host_blocks, n_physical = validate_block_gather(
        k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host, bias_slots, num_programs, check_ids, block_table
    )
    if heads * batch * slots == 0 or seq == 0:
        return
    source, target = k_host.device, k_slots.device
    ids = load_ids.to(source).long()                                        # [H, B, M]
    b_src = torch.arange(batch, device=source).view(1, -1, 1)
    blk, row, keep = _task_sources(ids, b_src.expand_as(ids), block_table, seq, block_size, n_host_blocks, n_physical)  # row, keep [H, B, M, bs]
    h_src = torch.arange(heads, device=source).view(-1, 1, 1, 1)
    first = b_src.unsqueeze(-1) if blk is None else blk.unsqueeze(-1)      # dim 0 of the host: sequence or physical block
    dst = (torch.arange(slots, device=target).view(1, 1, -1, 1) * block_size + torch.arange(block_size, device=target))
    h_dst, b_dst = torch.arange(heads, device=target).view(-1, 1, 1, 1), torch.arange(batch, device=target).view(1, -1, 1, 1)
    keep = keep.to(target)
    for host, dest in ((k_host, k_slots), (v_host, v_slots), (bias_host, bias_slots)):
        if host is None:
            continue
        rows = host[first, row, h_src].to(target)                            # [H, B, M, bs, ...]
        mask = keep.view(*keep.shape, *([1] * (rows.dim() - keep.dim())))
        dest[b_dst, dst, h_dst] = torch.where(mask, rows, dest[b_dst, dst, h_dst])


@_doc
def block_gather_copy_engine(k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host=None, bias_slots=None, num_programs=16, check_ids=True, block_table=None):
    # Host-side gather into a pinned staging buffer, one DMA per tensor, then a device scatter.
    # The ids (and the table) come to the host first (a sync): the price of the copy-engine path.
    batch, seq, heads, dim, slots, n_host_blocks, n_physical = validate_block_gather(
        k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host, bias_slots, num_programs, check_ids, block_table
    )
    table = None if block_table is None else block_table.to(k_host.device)
    b, h, host_rows, dst = _task_rows(load_ids.to(k_host.device), table, seq, heads, block_size, n_host_blocks, n_physical)
    if host_rows.numel() == 0:
        return
    pin = k_slots.device.type == "cuda" and k_host.device.type == "cpu"
    dev_rows = ((b * slots * block_size + dst) * heads + h).to(k_slots.device, non_blocking=pin)
    pairs = [(k_host, k_slots), (v_host, v_slots)]
    if bias_host is not None:
        pairs.append((bias_host, bias_slots))
    for host, dest in pairs:
        flat = host.reshape(host.shape[0] * host.shape[1] * heads, -1)  # a view for the usual contiguous host store
        staging = torch.empty((host_rows.numel(), flat.shape[1]), dtype=host.dtype, pin_memory=pin)
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
    k_src, v_src, bias_src, ids, table, k_dst, v_dst, bias_dst,
    n_tasks, n_seq, n_slots, seq_len, n_host_blocks, n_physical,
    sk_b, sk_p, sk_s, sk_h, sk_d, sv_b, sv_p, sv_s, sv_h, sv_d,
    dk_b, dk_s, dk_h, dk_d, dv_b, dv_s, dv_h, dv_d,
    sc_b, sc_p, sc_s, sc_h, dc_b, dc_s, dc_h,
    si_h, si_b, si_m, st_b, st_n,
    BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
    HAS_BIAS: tl.constexpr, PAGED: tl.constexpr, NUM_PROGS: tl.constexpr,
):
    # a host row is at b*s_b + p*s_p + r*s_s: by position p is the logical block (s_p = BLOCK rows),
    # paged p is the table's physical block and s_b = 0
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
        if PAGED:
            phys = tl.load(table + b * st_b + tl.where(ok, blk, 0) * st_n).to(tl.int64)
            ok = ok & (phys >= 0) & (phys < n_physical)
        else:
            phys = blk
        row_ok = ok & (rows < BLOCK) & (blk * BLOCK + rows < seq_len)
        dst_row = m * BLOCK + rows
        tile = row_ok[:, None] & (cols < D)[None, :]
        k = tl.load(k_src + b * sk_b + phys * sk_p + rows[:, None] * sk_s + h * sk_h + cols[None, :] * sk_d, mask=tile)
        tl.store(k_dst + b * dk_b + dst_row[:, None] * dk_s + h * dk_h + cols[None, :] * dk_d, k, mask=tile)
        v = tl.load(v_src + b * sv_b + phys * sv_p + rows[:, None] * sv_s + h * sv_h + cols[None, :] * sv_d, mask=tile)
        tl.store(v_dst + b * dv_b + dst_row[:, None] * dv_s + h * dv_h + cols[None, :] * dv_d, v, mask=tile)
        if HAS_BIAS:
            c = tl.load(bias_src + b * sc_b + phys * sc_p + rows * sc_s + h * sc_h, mask=row_ok)
            tl.store(bias_dst + b * dc_b + dst_row * dc_s + h * dc_h, c, mask=row_ok)


_KERNEL = LazyKernel(_block_gather_kernel)


def _host_strides(tensor: torch.Tensor, paged: bool, block_size: int) -> tuple[int, ...]:
    """(s_b, s_p, s_s, rest...) of a host tensor for the kernel's b*s_b + p*s_p + r*s_s addressing."""
    stride = tensor.stride()
    if paged:
        return (0, *stride)
    return (stride[0], block_size * stride[1], *stride[1:])


@_doc
def block_gather_triton(k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host=None, bias_slots=None, num_programs=16, check_ids=True, block_table=None):
    batch, seq, heads, dim, slots, n_host_blocks, n_physical = validate_block_gather(
        k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host, bias_slots, num_programs, check_ids, block_table
    )
    n_tasks = heads * batch * slots
    if n_tasks == 0 or seq == 0 or dim == 0:
        return
    paged = block_table is not None
    has_bias = bias_host is not None
    bias_src = bias_host if has_bias else k_slots  # placeholders, never dereferenced
    bias_dst = bias_slots if has_bias else k_slots
    sc = _host_strides(bias_host, paged, block_size) if has_bias else (0, 0, 0, 0)
    dc = bias_slots.stride() if has_bias else (0, 0, 0)
    table = block_table if paged else load_ids  # a placeholder, never read by position
    st = block_table.stride() if paged else (0, 0)
    with cuda_device_guard(k_slots):
        _KERNEL[(num_programs,)](
            k_host, v_host, bias_src, load_ids, table, k_slots, v_slots, bias_dst,
            n_tasks, batch, slots, seq, n_host_blocks, n_physical,
            *_host_strides(k_host, paged, block_size), *_host_strides(v_host, paged, block_size), *k_slots.stride(), *v_slots.stride(),
            *sc, *dc, *load_ids.stride(), *st,
            BLOCK=block_size, BLOCK_P=next_pow2(block_size), D=dim, D_P=next_pow2(dim),
            HAS_BIAS=has_bias, PAGED=paged, NUM_PROGS=num_programs, num_warps=8,
        )
