"""Empty rows in every attention path, as property tests: random shapes, lengths (zero included),
empty slot sets and selections padded with -1, each reference against its Triton kernel (the
interpreter without CUDA) and the model's eager decode path (`gather_blocks` + `masked_attention`).

The rule: attention over an empty key set contributes nothing, output 0 and LSE -inf, and rows that
are not keys never reach the result whatever they hold, so every non-key row is NaN here.  Each
test draws `CASES` seeded cases and prints how many ran and how many heads saw no key.
"""

from __future__ import annotations

import torch

import forecastkv.kernels as K
from forecastkv.modeling import selection as sel
from forecastkv.modeling.cache import gather_blocks
from forecastkv.modeling.configuration import SparseConfig
from forecastkv.modeling.prefill import masked_attention

from .conftest import DEVICE, assert_close, needs_triton

CASES = 60
NAN = float("nan")


def draw(gen, low, high):
    """An int in [low, high] from `gen`."""
    return int(torch.randint(low, high + 1, (), generator=gen))


def rand(gen, *shape):
    return torch.randn(*shape, generator=gen).to(DEVICE)


def check_empty(out, lse, empty, label):
    """Heads marked in `empty` [B, Hq] give output 0 and LSE -inf; nothing is NaN."""
    assert not out.isnan().any() and not lse.isnan().any(), f"{label}: NaN"
    assert (out[empty] == 0).all() and (lse[empty] == float("-inf")).all(), f"{label}: an empty head contributes"
    assert torch.isfinite(lse[~empty]).all(), f"{label}: a head with keys has no finite LSE"


def eager_decode(q, keys, values, bias, selection, lengths, block_size, rows=None):
    """The model's decode path without kernels (`SparseAttention._decode_blocks`): gather, then
    masked SDPA with the G query heads of a KV head as rows.  q [B, Hq, d] -> [B, Hq, d]."""
    batch, q_heads, dim = q.shape
    heads = selection.shape[1]
    k, v, key_pos, b = gather_blocks(keys, values, bias, selection, lengths, block_size, rows=rows)
    allowed = (key_pos >= 0).unsqueeze(2)
    out = masked_attention(
        q.view(batch, heads, q_heads // heads, dim).float(),
        k.float(),
        v.float(),
        allowed,
        None if b is None else b.float(),
        q_heads // heads,
    )
    return out.reshape(batch, q_heads, dim)


def slots_case(seed):
    """Slot buffers with random valid lengths (whole heads empty, M = 0 possible), NaN past them."""
    gen = torch.Generator().manual_seed(seed)
    batch, heads, group, dim, block, slots = (
        draw(gen, 1, 3),
        draw(gen, 1, 2),
        draw(gen, 1, 4),
        draw(gen, 1, 16),
        draw(gen, 1, 8),
        draw(gen, 0, 4),
    )
    q = rand(gen, batch, heads * group, dim)
    lens = torch.randint(0, block + 1, (batch, heads, slots), generator=gen)
    lens[torch.rand(lens.shape, generator=gen) < 0.4] = 0  # empty slots
    lens[torch.rand(batch, heads, generator=gen) < 0.4] = 0  # heads with no key at all
    lens = lens.to(DEVICE)
    rows = slots * block
    valid = (
        (torch.arange(block, device=DEVICE) < lens.unsqueeze(-1)).reshape(batch, heads, rows).transpose(1, 2)
    )  # [B, rows, H]
    k, v = (rand(gen, batch, rows, heads, dim).masked_fill(~valid.unsqueeze(-1), NAN) for _ in range(2))
    bias = rand(gen, batch, rows, heads).masked_fill(~valid, NAN) if draw(gen, 0, 1) else None
    empty = (lens.sum(-1) == 0).repeat_interleave(group, dim=1)
    return q, k, v, bias, lens, block, empty, draw(gen, 1, 3)


def blocks_case(seed):
    """A cache of S >= 0 keys with per-sequence lengths (0 included), NaN past them, and a
    selection of K >= 0 ids with -1 entries anywhere (whole rows -1 too)."""
    gen = torch.Generator().manual_seed(seed)
    batch, heads, group, dim, block = (
        draw(gen, 1, 3),
        draw(gen, 1, 2),
        draw(gen, 1, 4),
        draw(gen, 1, 16),
        draw(gen, 1, 8),
    )
    seq, width = draw(gen, 0, 5 * block), draw(gen, 0, 4)
    n_blocks = -(-seq // block)
    q = rand(gen, batch, heads * group, dim)
    lengths = torch.randint(0, seq + 1, (batch,), generator=gen)
    lengths[torch.rand(batch, generator=gen) < 0.3] = 0
    ids = torch.randint(-1, max(n_blocks, 1), (batch, heads, width), generator=gen).clamp(max=n_blocks - 1)
    ids[torch.rand(batch, heads, generator=gen) < 0.3] = -1
    lengths, ids = lengths.to(DEVICE), ids.to(DEVICE)
    stored = (torch.arange(seq, device=DEVICE) < lengths.view(-1, 1)).unsqueeze(-1)  # [B, S, 1]
    k, v = (rand(gen, batch, seq, heads, dim).masked_fill(~stored.unsqueeze(-1), NAN) for _ in range(2))
    bias = rand(gen, batch, seq, heads).masked_fill(~stored, NAN) if draw(gen, 0, 1) else None
    # a head sees a key when one of its ids is a block holding a stored key
    sees = ((ids >= 0) & (ids * block < lengths.view(-1, 1, 1))).any(-1)
    empty = (~sees).repeat_interleave(group, dim=1)
    return q, k, v, bias, ids, lengths, block, empty, draw(gen, 1, 3)


@needs_triton
def test_sparse_decode_slots_empty_rows():
    ran = empty_heads = eager_runs = 0
    for seed in range(CASES):
        q, k, v, bias, lens, block, empty, splits = slots_case(seed)
        label = f"slots case {seed}: q {tuple(q.shape)}, {k.shape[1] // block} slots of {block}"
        ref = K.sparse_decode_slots_reference(q, k, v, lens, block, bias_slots=bias)
        out = torch.full_like(q, NAN)
        lse = torch.full(q.shape[:2], NAN, device=DEVICE)
        got = K.sparse_decode_slots_triton(q, k, v, lens, block, bias_slots=bias, out=out, lse=lse, num_splits=splits)
        for result in (ref, got):
            check_empty(*result, empty, label)
        assert_close(got[0], ref[0], torch.float32)
        assert_close(got[1], ref[1], torch.float32)
        # the eager path reads the same slots: slot m of head h serves "block" m
        batch, heads, slots = lens.shape
        selection = torch.arange(slots, device=DEVICE).expand(batch, heads, slots)
        # one length per sequence cannot give every slot its own count of stored rows: the eager
        # path runs on the sequences whose slots are all full or empty (empty ones selected as -1)
        whole = ((lens == 0) | (lens == block)).all(-1).all(-1)
        if whole.any() and slots:
            sub = whole.nonzero().flatten()
            sel_ = torch.where(lens[sub] > 0, selection[sub], -1)
            eager = eager_decode(
                q[sub],
                k[sub],
                v[sub],
                None if bias is None else bias[sub],
                sel_,
                torch.full((len(sub),), slots * block, device=DEVICE),
                block,
            )
            assert_close(eager, ref[0][sub], torch.float32)
            eager_runs += 1
        ran += 1
        empty_heads += int(empty.sum())
    print(
        f"\nsparse_decode_slots: {ran} cases ({eager_runs} also on the eager path), "
        f"{empty_heads} query heads with no key"
    )
    assert ran == CASES and empty_heads > 0 and eager_runs > 0


@needs_triton
def test_sparse_decode_blocks_empty_rows():
    ran = empty_heads = 0
    for seed in range(CASES):
        q, k, v, bias, ids, lengths, block, empty, splits = blocks_case(seed)
        label = (
            f"blocks case {seed}: q {tuple(q.shape)}, S {k.shape[1]}, block {block}, ids {ids.tolist()}, "
            f"lengths {lengths.tolist()}"
        )
        ref = K.sparse_decode_blocks_reference(q, k, v, ids, lengths, block, bias=bias)
        out = torch.full_like(q, NAN)
        lse = torch.full(q.shape[:2], NAN, device=DEVICE)
        got = K.sparse_decode_blocks_triton(
            q, k, v, ids, lengths, block, bias=bias, out=out, lse=lse, num_splits=splits
        )
        for result in (ref, got):
            check_empty(*result, empty, label)
        assert_close(got[0], ref[0], torch.float32)
        assert_close(got[1], ref[1], torch.float32)
        if k.shape[1]:  # the eager path (gather_blocks reads row 0 for -1 ids: it needs one)
            eager = eager_decode(q, k, v, bias, ids, lengths, block)
            assert not eager.isnan().any(), label
            assert (eager[empty] == 0).all(), label
            assert_close(eager, ref[0], torch.float32)
        ran += 1
        empty_heads += int(empty.sum())
    print(f"\nsparse_decode_blocks: {ran} cases, {empty_heads} query heads with no key")
    assert ran == CASES and empty_heads > 0


def scores_case(seed):
    """A geometry, positions (padding -1 and rows before the first compressed key included),
    compressed keys / pooled CIS for the longest row, NaN in the columns no row sees."""
    gen = torch.Generator().manual_seed(seed)
    stride = draw(gen, 1, 3)
    kernel = stride * draw(gen, 1, 2)
    block = kernel * draw(gen, 1, 2)
    sparse = SparseConfig(
        kernel_size=kernel,
        kernel_stride=stride,
        block_size=block,
        init_blocks=draw(gen, 0, 1),
        window_size=block * draw(gen, 0, 1),
        topk=2,
        dense_len=0,
    )
    batch, heads, group, dim = draw(gen, 1, 3), draw(gen, 1, 2), draw(gen, 1, 3), draw(gen, 1, 16)
    positions = torch.randint(-1, 5 * block, (batch,), generator=gen)
    positions[torch.rand(batch, generator=gen) < 0.3] = -1
    positions[torch.rand(batch, generator=gen) < 0.3] = draw(gen, 0, kernel - 1)  # no complete window yet
    count = sel.num_compressed(int(positions.max()) + 1 + draw(gen, 0, 2) * stride, kernel, stride)
    n_blocks = sel.num_blocks(int(positions.max()) + 1, block) + draw(gen, 0, 2)
    return gen, sparse, batch, heads, group, dim, positions.to(DEVICE), count, n_blocks


def poison_unseen(x, positions, sparse, lag):
    """NaN in the compressed columns (dim 1 of x) that no row sees."""
    seen = (
        int(sel.num_compressed(int(positions.max()) + 1 - lag, sparse.kernel_size, sparse.kernel_stride))
        if int(positions.max()) + 1 > lag
        else 0
    )
    x = x.clone()
    x[:, seen:] = NAN
    return x


@needs_triton
def test_block_scores_empty_rows():
    """block_scores (both kinds) and agnostic_scores: rows seeing no compressed key score only their
    forced blocks (+inf), padding rows nothing (-inf); reference == kernel, exact non-finite patterns."""
    ran = empty_rows = 0
    for seed in range(CASES):
        gen, sparse, batch, heads, group, dim, positions, count, n_blocks = scores_case(seed)
        kind = ("query", "forecast")[seed % 2]
        lag = sel.visibility_lag(kind)
        vectors = rand(gen, batch, heads * group, dim)
        ckeys = poison_unseen(rand(gen, batch, count, heads, dim), positions, sparse, lag)
        label = f"scores case {seed}: {kind}, {sparse}, positions {positions.tolist()}, C {count}, NB {n_blocks}"
        ref = K.block_scores_reference(vectors, ckeys, positions, sparse, n_blocks, kind, lag)
        out = torch.full((batch, heads, n_blocks), NAN, device=DEVICE)
        got = K.block_scores_triton(vectors, ckeys, positions, sparse, n_blocks, kind, lag, out=out)
        assert not ref.isnan().any() and not got.isnan().any(), label
        assert_close(got, ref, torch.float32)
        assert (ref[positions < 0] == float("-inf")).all(), label
        pooled = poison_unseen(rand(gen, batch, count, heads), positions, sparse, 0)
        ref_a = K.agnostic_scores_reference(pooled, positions, sparse, n_blocks, 0)
        got_a = K.agnostic_scores_triton(
            pooled, positions, sparse, n_blocks, 0, out=torch.full((batch, heads, n_blocks), NAN, device=DEVICE)
        )
        assert not ref_a.isnan().any() and not got_a.isnan().any(), label
        assert_close(got_a, ref_a, torch.float32)
        ran += 1
        sees = torch.tensor([p + 1 - lag >= sparse.kernel_size for p in positions.tolist()])
        empty_rows += int((~sees).sum())
    print(f"\nblock_scores / agnostic_scores: {ran} cases, {empty_rows} rows seeing no compressed key")
    assert ran == CASES and empty_rows > 0


STAGE1_CASES = 12  # the fused prefill kernel is the slowest in the interpreter


@needs_triton
def test_stage1_empty_rows():
    """The fused stage-1 kernel against `selection.score_blocks` on chunks whose rows are padding
    or see no compressed key yet."""
    ran = empty_rows = 0
    for seed in range(STAGE1_CASES):
        gen, sparse, batch, heads, group, dim, _, count, n_blocks = scores_case(1000 + seed)
        kind = ("query", "forecast")[seed % 2]
        rows = draw(gen, 1, 6)
        start = draw(gen, 0, 2 * sparse.kernel_size)
        positions = (start + torch.arange(rows)).repeat(batch, 1)
        pad = draw(gen, 0, rows)
        positions[0, :pad] = -1  # a left-padded sequence
        positions = positions.to(DEVICE)
        length = start + rows
        count = sel.num_compressed(length, sparse.kernel_size, sparse.kernel_stride)
        n_blocks = sel.num_blocks(length, sparse.block_size)
        vectors = rand(gen, batch, rows, heads * group, dim)
        ckeys = rand(gen, batch, count, heads, dim)
        label = f"stage1 case {seed}: {kind}, {sparse}, positions {positions.tolist()}"
        lag = sel.visibility_lag(kind)
        expected = sel.score_blocks(vectors, ckeys, positions, sparse, n_blocks, kind=kind, lag=lag)
        out = torch.full((batch, heads, rows, n_blocks), NAN, device=DEVICE)
        got, _ = K.stage1_block_scores_triton(vectors, ckeys, positions, sparse, n_blocks, kind, lag, out=out)
        assert not expected.isnan().any() and not got.isnan().any(), label
        assert_close(got, expected, torch.float32)
        ran += 1
        empty_rows += int((positions + 1 - lag < sparse.kernel_size).sum())
    print(f"\nstage1: {ran} cases, {empty_rows} rows seeing no compressed key")
    assert ran == STAGE1_CASES and empty_rows > 0
