"""transfer: the two host <-> device kernels of the offloaded cache, which share its host addressing.

* block_gather (H2D): move missed KV blocks from host memory into device slots.
  - `block_gather_triton`: NOSI/SparDA's persistent UVA gather.  A fixed number of programs walk
    the task list grid-stride and load tiles *directly from pinned host memory* (zero-copy PCIe
    reads); one launch moves thousands of scattered blocks, and the ids can live on the device
    (graph-safe).
  - `block_gather_reference`: plain PyTorch advanced indexing, the semantics the others must match.
  - `block_gather_copy_engine`: the copy-engine baseline for benchmarks: gather the rows on the
    host into a pinned staging buffer, one DMA copy, `index_copy_` into the slots.
* row_store (D2H): write one new token row per sequence into the host store, at a position that
  lives on the device.  On CUDA the kernel writes *directly into pinned host memory* through UVA:
  no host index, no sync, and the positions may change from step to step inside a captured graph.
  Ordering is the stream's: a later read of the host store on another stream (the block gather)
  waits on an event recorded after this launch.
  - `row_store_triton`: one program per (sequence, KV head), each storing a d-wide row;
  - `row_store_reference`: plain PyTorch indexing, the semantics (and the CPU path).

Two host layouts, shared by both directions.  By position (no `block_table`): host [B, S, H, d].
Paged (vLLM's layout, the offloaded cache's host tier): host [P, block, H, d] is a pool of physical
blocks and `block_table` [B, NB] names sequence b's physical block for each logical block: one
indirection, read on the device.  Both kernels address a host row as b*s_b + p*s_p + r*s_s
(`_host_strides`): by position p counts units of `rows_per_index` rows of sequence b, paged p is
the table's physical block, r the row in it, and s_b = 0.

The gather's destination is either per-sequence slots [B, M*block, H, d] (the offloaded cache's
working set) or, with `dest_table`, a device pool of the same paged layout (vLLM's KV pages, which
the engine's attention reads in place): the block a task loads lands in the physical block the
destination table names for it.
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

# ----------------------------------------------------------------------------------------------
# host addressing, shared by both directions
# ----------------------------------------------------------------------------------------------


def host_layout(k_host: torch.Tensor, block_table, block_size: int):
    """The host side of a transfer, by position (k_host [B, S, H, d]) or paged (k_host a pool
    [P, block_size, H, d], block_table [B, NB]): (B, S, H, d, the bias's shape, its description),
    with S = NB * block_size positions per sequence when paged."""
    if block_table is None:
        batch, seq, heads, dim = k_host.shape
        return batch, seq, heads, dim, (batch, seq, heads), "[B, S, H_kv] from k_host"
    check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES)
    physical, _, heads, dim = k_host.shape
    pool = f"a pool [P, block_size, H_kv, d] with block_size={block_size}"
    check_shape("k_host", k_host, (physical, block_size, heads, dim), pool)
    batch, n_logical = block_table.shape
    return batch, n_logical * block_size, heads, dim, (physical, block_size, heads), "[P, block_size, H_kv] from k_host"


def _host_strides(tensor: torch.Tensor, paged: bool, rows_per_index: int) -> tuple[int, ...]:
    """(s_b, s_p, s_s, rest...) of a host tensor for the kernels' b*s_b + p*s_p + r*s_s addressing:
    paged, p is the physical block; by position, p counts `rows_per_index` rows of sequence b."""
    stride = tensor.stride()
    if paged:
        return (0, *stride)
    return (stride[0], rows_per_index * stride[1], *stride[1:])


# ----------------------------------------------------------------------------------------------
# block_gather (H2D)
# ----------------------------------------------------------------------------------------------

_GATHER_DOC = """Copy host KV blocks into device slots, one task per (KV head, sequence, slot).

    k_host, v_host  [B, S, H_kv, d]   float32/float16/bfloat16; on CUDA: pinned CPU memory (or the
                                      slots' device); any strides.  With block_table: the pool
                                      [P, block_size, H_kv, d] of physical blocks
    load_ids        [H_kv, B, M]      int32/int64 logical block ids, -1 = skip; values in
                                      [-1, ceil(S / block_size)) (with block_table: [-1, NB));
                                      on the slots' device
    k_slots, v_slots [B, M*block_size, H_kv, d]  same dtype as k_host; written in place
    block_size      int               tokens per block
    bias_host       [B, S, H_kv] (pool: [P, block_size, H_kv]) or None   optional per-token bias
                                      (NOSA's CIS)
    bias_slots      [B, M*block_size, H_kv] or None  same dtype as bias_host; both or neither
    num_programs    int               persistent programs (CTAs) looping over the B*H_kv*M tasks
    check_ids       bool              check every argument, id ranges included (one device sync).
                                      False: the caller vouches for them; the reference then checks
                                      nothing (its indexing cannot leave the buffers), the kernel
                                      still checks shapes and skips out-of-range ids
    block_table     [B, NB] or None   int32/int64 physical block of each logical block of each
                                      sequence (-1 = none), values in [-1, P); on the slots' device
    dest_table      [B, NB] or None   int32/int64, with block_table only: k_slots, v_slots are then a
                                      device pool [Q, block_size, H_kv, d] (bias_slots
                                      [Q, block_size, H_kv]) and logical block i of sequence b lands
                                      in its physical block dest_table[b, i] (-1 = none), values in
                                      [-1, Q); on the slots' device

    Task (h, b, m) with id i >= 0 copies host rows [i*block, i*block+block) ∩ [0, S) of head h,
    sequence b (paged: every row of physical block block_table[b, i]) to slot rows
    [m*block, m*block+block) of head h, sequence b (with dest_table: every row of head h of pool
    block dest_table[b, i]).  Slot rows past the end of a partial last block, and all rows of
    skipped tasks, are left untouched.  Returns None.
    """


def _gather_doc(fn):
    fn.__doc__ = _GATHER_DOC
    return fn


def gather_geometry(k_host, load_ids, block_size: int, block_table):
    """(B, S, H_kv, d, M, logical blocks per sequence, physical blocks) of a gather, read from the
    shapes alone (no checks); by position there are B * logical physical blocks."""
    heads, batch, slots = load_ids.shape
    if block_table is None:
        seq, dim = k_host.shape[1], k_host.shape[3]
        n_logical = -(-seq // block_size)
        return batch, seq, heads, dim, slots, n_logical, batch * n_logical
    n_logical = block_table.shape[1]
    return batch, n_logical * block_size, heads, k_host.shape[3], slots, n_logical, k_host.shape[0]


def validate_block_gather(
    k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host, bias_slots, num_programs,
    check_ids=True, block_table=None, dest_table=None,
):
    """Check every argument (the id ranges only with check_ids); returns `gather_geometry`."""
    check_positive_int("block_size", block_size)
    check_positive_int("num_programs", num_programs)
    if dest_table is not None and block_table is None:
        raise ValueError("dest_table (a pool destination) needs a block_table: a pool-to-pool gather")
    for name, t in (("k_host", k_host), ("v_host", v_host), ("k_slots", k_slots), ("v_slots", v_slots)):
        check_tensor(name, t, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("load_ids", load_ids, ndim=3, dtypes=INDEX_DTYPES)
    check_shape("v_host", v_host, k_host.shape, "must match k_host")
    batch, seq, heads, dim, bias_shape, bias_what = host_layout(k_host, block_table, block_size)
    slots = load_ids.shape[2]
    ids_what = "[H_kv, B, M] with " + ("H_kv, B from k_host" if block_table is None else "B from block_table")
    check_shape("load_ids", load_ids, (heads, batch, slots), ids_what)
    device_side = [("k_slots", k_slots), ("v_slots", v_slots), ("load_ids", load_ids)]
    if dest_table is None:
        slots_shape, slots_what = (batch, slots * block_size, heads, dim), f"[B, M*block_size, H_kv, d] with M={slots}"
        bias_slots_what = "[B, M*block_size, H_kv]"
    else:
        check_tensor("dest_table", dest_table, ndim=2, dtypes=INDEX_DTYPES)
        check_shape("dest_table", dest_table, block_table.shape, "[B, NB] like block_table")
        slots_shape, slots_what = (k_slots.shape[0], block_size, heads, dim), "a device pool [Q, block_size, H_kv, d]"
        bias_slots_what = "[Q, block_size, H_kv] like k_slots"
        device_side.append(("dest_table", dest_table))
    check_shape("k_slots", k_slots, slots_shape, f"{slots_what}, block_size={block_size}")
    check_shape("v_slots", v_slots, k_slots.shape, "must match k_slots")
    check_same_dtype(("k_host", "v_host", "k_slots", "v_slots"), (k_host, v_host, k_slots, v_slots))
    if block_table is not None:
        device_side.append(("block_table", block_table))
    host_side = [("k_host", k_host), ("v_host", v_host)]
    bias_shapes, bias_whats = (bias_shape, slots_shape[:3]), (bias_what, bias_slots_what)
    if check_bias_pair(("bias_host", "bias_slots"), (bias_host, bias_slots), bias_shapes, bias_whats):
        device_side.append(("bias_slots", bias_slots))
        host_side.append(("bias_host", bias_host))
    check_transfer_sides(device_side, host_side, k_slots)
    geometry = gather_geometry(k_host, load_ids, block_size, block_table)
    if check_ids:
        n_logical, n_physical = geometry[5:]
        if block_table is None:
            limit = f"ceil(S / block_size) with S={seq}, block_size={block_size}"
        else:
            limit = f"the block table's {n_logical} logical blocks"
        check_range("load_ids", load_ids, -1, n_logical, limit)
        if block_table is not None:
            check_range("block_table", block_table, -1, n_physical, f"the pool's {n_physical} physical blocks")
        if dest_table is not None:
            pool = k_slots.shape[0]
            check_range("dest_table", dest_table, -1, pool, f"the destination pool's {pool} blocks")
    return geometry


def _task_sources(
    ids: torch.Tensor, b: torch.Tensor, block_table, seq: int, block_size: int, n_logical: int, n_physical: int
):
    """For tasks with logical ids `ids` of sequences `b` (same shape [...]): (physical block [...]
    or None by position, first host row [..., bs] within it (by position: the row in [0, S)),
    keep [..., bs]) with every index clamped in range."""
    offsets = torch.arange(block_size, device=ids.device)
    ok = (ids >= 0) & (ids < n_logical)
    if block_table is None:
        src = ids.clamp(min=0).unsqueeze(-1) * block_size + offsets
        return None, src.clamp(max=max(seq - 1, 0)), ok.unsqueeze(-1) & (src < seq)
    phys = block_table.to(ids.device).long()[b, ids.clamp(0, max(n_logical - 1, 0))]
    ok = ok & (phys >= 0) & (phys < n_physical)
    keep = ok.unsqueeze(-1).expand(*ok.shape, block_size)
    return phys.clamp(0, max(n_physical - 1, 0)), offsets.expand(*ok.shape, block_size), keep


def _task_rows(
    load_ids: torch.Tensor, block_table, seq: int, heads: int, block_size: int, n_logical: int, n_physical: int
):
    """(b, h, flat host row, slot row), one entry per token row to copy, as int64 vectors; the flat
    host row indexes the host viewed as [rows * H_kv, ...] (by position: B*S rows, paged: P*block)."""
    ids = load_ids.long()
    n_heads, batch, slots = ids.shape
    b = torch.arange(batch, device=ids.device).view(1, -1, 1).expand_as(ids)
    h = torch.arange(n_heads, device=ids.device).view(-1, 1, 1).expand_as(ids).unsqueeze(-1)
    m = torch.arange(slots, device=ids.device).view(1, 1, -1).expand_as(ids).unsqueeze(-1)
    blk, row, keep = _task_sources(ids, b, block_table, seq, block_size, n_logical, n_physical)
    first = b.unsqueeze(-1) * seq if blk is None else blk.unsqueeze(-1) * block_size
    flat = (first + row) * heads + h
    dst = m * block_size + torch.arange(block_size, device=ids.device)
    expand = lambda x: x.expand_as(keep)[keep]  # noqa: E731
    return expand(b.unsqueeze(-1)), expand(h), flat[keep], dst.expand_as(keep)[keep]


def _gather_into_pool(k_host, v_host, bias_host, load_ids, block_table, dest_table, k_pool, v_pool, bias_pool):
    """The reference of a pool destination (`dest_table`), at fixed shapes with no host read: every task
    writes.  A skipped task must not write back an old value where another task fills a block (the
    write order of duplicates is undefined), so it repeats the first task that copies, same source, same
    place, same value; when none copies, every task writes one valid place's own value back to it."""
    target = k_pool.device
    ids = load_ids.to(target).long()  # [H, B, M]
    heads, batch, _ = ids.shape
    n_logical = block_table.shape[1]
    b = torch.arange(batch, device=target).view(1, -1, 1).expand_as(ids)
    h = torch.arange(heads, device=target).view(-1, 1, 1).expand_as(ids)
    logical = ids.clamp(0, max(n_logical - 1, 0))
    source = block_table.to(target).long()[b, logical]
    dest = dest_table.to(target).long()[b, logical]
    ok = (ids >= 0) & (ids < n_logical) & (source >= 0) & (source < k_host.shape[0])
    ok &= (dest >= 0) & (dest < k_pool.shape[0])
    ok, h, source, dest = ok.reshape(-1), h.reshape(-1), source.reshape(-1), dest.reshape(-1)
    first = ok.int().argmax().view(1)  # the first task that copies (0 when none does), on the device
    copies = ok.any()
    h = torch.where(ok, h, h.index_select(0, first))
    source = torch.where(ok, source, source.index_select(0, first)).clamp(0, k_host.shape[0] - 1)
    dest = torch.where(ok, dest, dest.index_select(0, first)).clamp(0, k_pool.shape[0] - 1)
    for host, pool in ((k_host, k_pool), (v_host, v_pool), (bias_host, bias_pool)):
        if host is not None:
            rows = host[source.to(host.device), :, h.to(host.device)].to(target)
            mask = copies.view(*([1] * rows.dim()))
            pool[dest, :, h] = torch.where(mask, rows, pool[dest, :, h])


@_gather_doc
def block_gather_reference(
    k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host=None, bias_slots=None, num_programs=16,
    check_ids=True, block_table=None, dest_table=None,
):
    # Every task's rows are read and written back (the old value where a task or row is skipped):
    # fixed shapes and no row selection, so the reference reads nothing back from the device.
    if check_ids:
        validate_block_gather(
            k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host, bias_slots, num_programs, check_ids,
            block_table, dest_table,
        )
    batch, seq, heads, _, slots, n_logical, n_physical = gather_geometry(k_host, load_ids, block_size, block_table)
    if heads * batch * slots == 0 or seq == 0:
        return
    if dest_table is not None:
        _gather_into_pool(k_host, v_host, bias_host, load_ids, block_table, dest_table, k_slots, v_slots, bias_slots)
        return
    source, target = k_host.device, k_slots.device
    ids = load_ids.to(source).long()  # [H, B, M]
    b_src = torch.arange(batch, device=source).view(1, -1, 1)
    # row, keep [H, B, M, bs]
    blk, row, keep = _task_sources(ids, b_src.expand_as(ids), block_table, seq, block_size, n_logical, n_physical)
    h_src = torch.arange(heads, device=source).view(-1, 1, 1, 1)
    first = b_src.unsqueeze(-1) if blk is None else blk.unsqueeze(-1)  # dim 0 of the host: sequence or physical block
    dst = torch.arange(slots, device=target).view(1, 1, -1, 1) * block_size + torch.arange(block_size, device=target)
    h_dst = torch.arange(heads, device=target).view(-1, 1, 1, 1)
    b_dst = torch.arange(batch, device=target).view(1, -1, 1, 1)
    keep = keep.to(target)
    for host, dest in ((k_host, k_slots), (v_host, v_slots), (bias_host, bias_slots)):
        if host is None:
            continue
        rows = host[first, row, h_src].to(target)  # [H, B, M, bs, ...]
        mask = keep.view(*keep.shape, *([1] * (rows.dim() - keep.dim())))
        dest[b_dst, dst, h_dst] = torch.where(mask, rows, dest[b_dst, dst, h_dst])


@_gather_doc
def block_gather_copy_engine(
    k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host=None, bias_slots=None, num_programs=16,
    check_ids=True, block_table=None, dest_table=None,
):
    # Host-side gather into a pinned staging buffer, one DMA per tensor, then a device scatter.
    # The ids (and the table) come to the host first (a sync): the price of the copy-engine path.
    batch, seq, heads, dim, slots, n_logical, n_physical = validate_block_gather(
        k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host, bias_slots, num_programs, check_ids,
        block_table, dest_table,
    )
    if dest_table is not None:  # a pool destination: the indexing copy (a baseline, no staging buffer)
        _gather_into_pool(k_host, v_host, bias_host, load_ids, block_table, dest_table, k_slots, v_slots, bias_slots)
        return
    table = None if block_table is None else block_table.to(k_host.device)
    b, h, host_rows, dst = _task_rows(load_ids.to(k_host.device), table, seq, heads, block_size, n_logical, n_physical)
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


def _block_gather_kernel(
    k_src, v_src, bias_src, ids, table, dtable, k_dst, v_dst, bias_dst,
    n_tasks, n_seq, n_slots, seq_len, n_logical, n_physical, n_dest,
    sk_b, sk_p, sk_s, sk_h, sk_d, sv_b, sv_p, sv_s, sv_h, sv_d,
    dk_b, dk_s, dk_h, dk_d, dv_b, dv_s, dv_h, dv_d,
    sc_b, sc_p, sc_s, sc_h, dc_b, dc_s, dc_h,
    si_h, si_b, si_m, st_b, st_n, sd_b, sd_n,
    BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
    HAS_BIAS: tl.constexpr, PAGED: tl.constexpr, DEST_PAGED: tl.constexpr, NUM_PROGS: tl.constexpr,
):  # fmt: skip
    # by position p is the logical block (s_p = BLOCK rows); paged p is the table's physical block;
    # the destination's dim 0 is the sequence (slots) or, DEST_PAGED, the pool block dtable names
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
        ok = (blk >= 0) & (blk < n_logical)
        if PAGED:
            phys = tl.load(table + b * st_b + tl.where(ok, blk, 0) * st_n).to(tl.int64)
            ok = ok & (phys >= 0) & (phys < n_physical)
        else:
            phys = blk
        if DEST_PAGED:
            dst = tl.load(dtable + b * sd_b + tl.where(ok, blk, 0) * sd_n).to(tl.int64)
            ok = ok & (dst >= 0) & (dst < n_dest)
            dst_row = rows
        else:
            dst = b
            dst_row = m * BLOCK + rows
        row_ok = ok & (rows < BLOCK) & (blk * BLOCK + rows < seq_len)
        tile = row_ok[:, None] & (cols < D)[None, :]
        k = tl.load(k_src + b * sk_b + phys * sk_p + rows[:, None] * sk_s + h * sk_h + cols[None, :] * sk_d, mask=tile)
        tl.store(k_dst + dst * dk_b + dst_row[:, None] * dk_s + h * dk_h + cols[None, :] * dk_d, k, mask=tile)
        v = tl.load(v_src + b * sv_b + phys * sv_p + rows[:, None] * sv_s + h * sv_h + cols[None, :] * sv_d, mask=tile)
        tl.store(v_dst + dst * dv_b + dst_row[:, None] * dv_s + h * dv_h + cols[None, :] * dv_d, v, mask=tile)
        if HAS_BIAS:
            c = tl.load(bias_src + b * sc_b + phys * sc_p + rows * sc_s + h * sc_h, mask=row_ok)
            tl.store(bias_dst + dst * dc_b + dst_row * dc_s + h * dc_h, c, mask=row_ok)


_GATHER_KERNEL = LazyKernel(_block_gather_kernel)


@_gather_doc
def block_gather_triton(
    k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host=None, bias_slots=None, num_programs=16,
    check_ids=True, block_table=None, dest_table=None,
):
    batch, seq, heads, dim, slots, n_logical, n_physical = validate_block_gather(
        k_host, v_host, load_ids, k_slots, v_slots, block_size, bias_host, bias_slots, num_programs, check_ids,
        block_table, dest_table,
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
    dest_paged = dest_table is not None
    dtable = dest_table if dest_paged else load_ids  # a placeholder, never read into slots
    sd = dest_table.stride() if dest_paged else (0, 0)
    with cuda_device_guard(k_slots):
        _GATHER_KERNEL[(num_programs,)](
            k_host, v_host, bias_src, load_ids, table, dtable, k_slots, v_slots, bias_dst,
            n_tasks, batch, slots, seq, n_logical, n_physical, k_slots.shape[0],
            *_host_strides(k_host, paged, block_size), *_host_strides(v_host, paged, block_size),
            *k_slots.stride(), *v_slots.stride(), *sc, *dc, *load_ids.stride(), *st, *sd,
            BLOCK=block_size, BLOCK_P=next_pow2(block_size), D=dim, D_P=next_pow2(dim),
            HAS_BIAS=has_bias, PAGED=paged, DEST_PAGED=dest_paged, NUM_PROGS=num_programs, num_warps=8,
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# row_store (D2H)
# ----------------------------------------------------------------------------------------------

_STORE_DOC = """Store row b of the new tokens at host position positions[b], for every sequence b.

    k_new, v_new    [B, H_kv, d]      float32/float16/bfloat16, on the device
    positions       [B]               int32/int64 on the device; -1 (or any value outside [0, S))
                                      skips the sequence: nothing is written
    k_host, v_host  [B, S, H_kv, d]   same dtype as k_new; on CUDA pinned CPU memory (UVA), else
                                      on the device of k_new; any strides; written in place.  With
                                      block_table: the pool [P, block, H_kv, d] of physical blocks
    bias_new        [B, H_kv] or None            optional per-token bias (NOSA's CIS)
    bias_host       [B, S, H_kv] (pool: [P, block, H_kv]) or None   same dtype as bias_new; both
                                      or neither
    block_table     [B, NB] or None   int32/int64 on the device: sequence b's position p lives in
                                      row p % block of physical block block_table[b, p // block]
                                      (S = NB * block; an entry -1, or out of [0, P), skips)
    check_ids       bool              check every argument.  False: the caller vouches for them; the
                                      reference then checks nothing (its indexing cannot leave the
                                      buffers), the kernel still checks them

    Each sequence writes exactly one row, so no two writes meet.  Returns None.
    """


def _store_doc(fn):
    fn.__doc__ = _STORE_DOC
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
    new_what = "[B, H_kv, d] from k_host" if block_table is None else "[B, H_kv, d] with B from block_table"
    check_shape("k_new", k_new, (batch, heads, dim), new_what)
    check_shape("v_new", v_new, k_new.shape, "must match k_new")
    check_shape("positions", positions, (batch,), "[B]")
    check_same_dtype(("k_new", "v_new", "k_host", "v_host"), (k_new, v_new, k_host, v_host))
    device_side = [("k_new", k_new), ("v_new", v_new), ("positions", positions)]
    if block_table is not None:
        device_side.append(("block_table", block_table))
    host_side = [("k_host", k_host), ("v_host", v_host)]
    bias_shapes = ((batch, heads), bias_shape)
    if check_bias_pair(("bias_new", "bias_host"), (bias_new, bias_host), bias_shapes, ("[B, H_kv]", bias_what)):
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


@_store_doc
def row_store_reference(
    k_new, v_new, positions, k_host, v_host, bias_new=None, bias_host=None, block_table=None, check_ids=True
):
    if check_ids:
        validate_row_store(k_new, v_new, positions, k_host, v_host, bias_new, bias_host, block_table)
    seq = k_host.shape[1] if block_table is None else block_table.shape[1] * k_host.shape[1]
    if k_new.shape[0] == 0 or seq == 0 or k_host.shape[0] == 0:
        return
    first, row, keep = _destination(positions, block_table, seq, k_host.shape[1], k_host.shape[0])
    # a skipped sequence writes back the row it read: one write per sequence, no row selection
    for new, host in ((k_new, k_host), (v_new, v_host), (bias_new, bias_host)):
        if new is None:
            continue
        mask = keep.view(-1, *([1] * (new.dim() - 1)))
        host[first, row] = torch.where(mask, new, host[first, row])


def _row_store_kernel(
    k_new, v_new, bias_new, positions, table, k_host, v_host, bias_host,
    n_heads, seq_len, block, n_physical,
    nk_b, nk_h, nk_d, nv_b, nv_h, nv_d, nb_b, nb_h,
    hk_b, hk_p, hk_s, hk_h, hk_d, hv_b, hv_p, hv_s, hv_h, hv_d, hb_b, hb_p, hb_s, hb_h,
    sp_b, st_b, st_n,
    D: tl.constexpr, D_P: tl.constexpr, HAS_BIAS: tl.constexpr, PAGED: tl.constexpr,
):  # fmt: skip
    # by position p is the position (r = 0); paged p is the table's physical block, r the row in it
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


_STORE_KERNEL = LazyKernel(_row_store_kernel)


@_store_doc
def row_store_triton(
    k_new, v_new, positions, k_host, v_host, bias_new=None, bias_host=None, block_table=None, check_ids=True
):
    # the kernel writes through raw host pointers: its arguments are checked whatever check_ids says
    batch, seq, heads, dim = validate_row_store(
        k_new, v_new, positions, k_host, v_host, bias_new, bias_host, block_table
    )
    if batch * heads == 0 or seq == 0 or dim == 0 or k_host.shape[0] == 0:
        return
    paged = block_table is not None
    has_bias = bias_new is not None
    nb = bias_new.stride() if has_bias else (0, 0)
    hb = _host_strides(bias_host, paged, 1) if has_bias else (0, 0, 0, 0)
    with cuda_device_guard(k_new):
        _STORE_KERNEL[(batch * heads,)](
            k_new, v_new, bias_new if has_bias else k_new, positions, block_table if paged else positions,
            k_host, v_host, bias_host if has_bias else k_host,
            heads, seq, k_host.shape[1] if paged else 1, k_host.shape[0],
            *k_new.stride(), *v_new.stride(), *nb,
            *_host_strides(k_host, paged, 1), *_host_strides(v_host, paged, 1), *hb,
            *positions.stride(), *(block_table.stride() if paged else (0, 0)),
            D=dim, D_P=next_pow2(dim), HAS_BIAS=has_bias, PAGED=paged, num_warps=1,
        )  # fmt: skip
