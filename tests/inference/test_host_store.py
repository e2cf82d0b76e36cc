"""The paged host tier.  `HostKVStore`: rows land where they are written and nowhere else (buffers
filled with NaN first, read back by position through the block tables), bytes moved and held as
computed from the shapes by hand, growth keeps what was stored, and a sequence past max_length is a
clear error.  `HostBlockPool`: reference counts, reuse of freed blocks.  Forks share full blocks,
copy the tail, and a crop makes shared blocks private before they are written again."""

from __future__ import annotations

import pytest
import torch

from forecastkv.inference import host_store as hs
from forecastkv.inference.host_store import HostBlockPool, HostKVStore
from forecastkv.inference.worker import TransferWorker
from forecastkv.modeling.cache import GROWTH_CHUNK

NAN = float("nan")
BATCH, HEADS, DIM = 3, 2, 5
BLOCK = 4  # GROWTH_CHUNK and the max_lengths below are not all multiples: partial last blocks too


def store(dtype=torch.float32, with_cis=True, cis_dtype=torch.float32, max_length=None, rows=16, block=BLOCK):
    """A CPU store with room for `rows` positions (capacity: a GROWTH_CHUNK multiple, or max_length),
    every buffer element NaN."""
    s = HostKVStore(
        BATCH, HEADS, DIM, dtype, with_cis, cis_dtype if with_cis else None, max_length, pin=False, block_size=block
    )
    s.blocks.ensure(rows)
    for t in s.tensors():
        t.fill_(NAN)
    return s


def by_position(s, tensor):
    """One of the pool's buffers as [B, capacity, ...] by position: a copy, read through the host
    tables row by row (an independent reading of the layout)."""
    size = s.blocks.block_size
    rows = [
        [s.blocks.tables[b][t // size] * size + t % size for t in range(s.blocks.capacity)]
        for b in range(len(s.blocks.tables))
    ]
    return tensor.reshape(-1, *tensor.shape[2:])[torch.tensor(rows)]


def K(s):
    return by_position(s, s.keys)


def V(s):
    return by_position(s, s.values)


def C(s):
    return by_position(s, s.cis)


def equal_nan(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


def test_write_stores_exactly_the_given_rows():
    s = store()
    gen = torch.Generator().manual_seed(0)
    batch_idx, pos = torch.tensor([0, 2, 2, 1]), torch.tensor([3, 0, 15, 7])
    keys, values = torch.randn(4, HEADS, DIM, generator=gen), torch.randn(4, HEADS, DIM, generator=gen)
    cis = torch.randn(4, HEADS, generator=gen)
    moved = s.write(batch_idx, pos, keys, values, cis)
    assert moved == 2 * 4 * HEADS * DIM * 4 + 4 * HEADS * 4  # K + V + CIS, fp32 inputs
    expected_k = torch.full((BATCH, s.blocks.capacity, HEADS, DIM), NAN)
    expected_v, expected_c = expected_k.clone(), torch.full((BATCH, s.blocks.capacity, HEADS), NAN)
    for i, (b, t) in enumerate(zip(batch_idx.tolist(), pos.tolist())):
        expected_k[b, t], expected_v[b, t], expected_c[b, t] = keys[i], values[i], cis[i]
    assert equal_nan(K(s), expected_k) and equal_nan(V(s), expected_v) and equal_nan(C(s), expected_c)


def test_write_converts_to_the_store_dtype():
    """bf16 K/V and fp32 CIS from fp32 inputs: stored = the input rounded to bf16 (a cast, no other
    change); bytes moved count the inputs."""
    s = store(dtype=torch.bfloat16, cis_dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    keys, values, cis = (
        torch.randn(2, HEADS, DIM, generator=gen),
        torch.randn(2, HEADS, DIM, generator=gen),
        torch.randn(2, HEADS, generator=gen),
    )
    moved = s.write(torch.tensor([1, 0]), torch.tensor([4, 9]), keys, values, cis)
    assert moved == 2 * 2 * HEADS * DIM * 4 + 2 * HEADS * 4
    assert s.keys.dtype == torch.bfloat16 and s.cis.dtype == torch.float32
    assert torch.equal(K(s)[1, 4], keys[0].bfloat16()) and torch.equal(V(s)[0, 9], values[1].bfloat16())
    assert torch.equal(C(s)[0, 9], cis[1])
    assert K(s).isnan().sum() == K(s).numel() - 2 * HEADS * DIM


def test_write_span_fills_positions_of_every_sequence():
    s = store()
    gen = torch.Generator().manual_seed(2)
    keys, values = torch.randn(BATCH, 4, HEADS, DIM, generator=gen), torch.randn(BATCH, 4, HEADS, DIM, generator=gen)
    cis = torch.randn(BATCH, 4, HEADS, generator=gen)
    moved = s.write_span(5, keys, values, cis)
    assert moved == 2 * BATCH * 4 * HEADS * DIM * 4 + BATCH * 4 * HEADS * 4
    assert torch.equal(K(s)[:, 5:9], keys) and torch.equal(V(s)[:, 5:9], values) and torch.equal(C(s)[:, 5:9], cis)
    for t in (K(s), V(s), C(s)):
        assert t[:, :5].isnan().all() and t[:, 9:].isnan().all()
    # without CIS: nothing else written, bytes of K and V only
    assert s.write_span(0, keys[:, :1], values[:, :1], None) == 2 * BATCH * HEADS * DIM * 4
    assert C(s)[:, 0].isnan().all()


def test_device_rows_are_copies_with_rows_past_each_length_zeroed():
    """The H2D staging: copies (not views) of the first positions; host rows past a sequence's
    length (here NaN: the store is allocated uninitialised) arrive as zeros, also in extra rows."""
    s = store()
    s.write_span(
        0, torch.ones(BATCH, 3, HEADS, DIM), torch.full((BATCH, 3, HEADS, DIM), 2.0), torch.full((BATCH, 3, HEADS), 3.0)
    )
    lengths = torch.tensor([3, 1, 0])
    keys, values, cis = s.device_rows(3, lengths, torch.device("cpu"), rows=5)
    assert keys.shape == values.shape == (BATCH, 5, HEADS, DIM) and cis.shape == (BATCH, 5, HEADS)
    assert keys.data_ptr() != s.keys.data_ptr()
    for t, value in ((keys, 1.0), (values, 2.0), (cis, 3.0)):
        assert not t.isnan().any()
        for b, n in enumerate(lengths.tolist()):
            assert (t[b, :n] == value).all() and (t[b, n:] == 0).all()
    assert store(with_cis=False).device_rows(4, torch.tensor([4, 4, 4]), torch.device("cpu"))[2] is None


def write_rows(s: HostKVStore, positions, keys, values, cis) -> None:
    """A decode step's write-back into store `s`: the worker's `row_store` through its block table."""
    TransferWorker("cpu", overlap=False).store_rows(s.pool, s.blocks.block_table, positions, keys, values, cis)


def test_write_rows_stores_one_row_per_sequence():
    """The decode write-back (`row_store`): row b at positions[b], -1 skips the sequence."""
    s = store()
    keys, values, cis = torch.randn(BATCH, HEADS, DIM), torch.randn(BATCH, HEADS, DIM), torch.randn(BATCH, HEADS)
    write_rows(s, torch.tensor([4, -1, 0]), keys, values, cis)
    assert torch.equal(K(s)[0, 4], keys[0]) and torch.equal(V(s)[2, 0], values[2]) and torch.equal(C(s)[0, 4], cis[0])
    assert K(s)[1].isnan().all() and K(s)[0, :4].isnan().all() and C(s)[2, 1:].isnan().all()


class FakeCudart:
    """cudaHostRegister / Unregister that record their calls (no CUDA here); `fail` makes
    registration return an error code (2 = cudaErrorMemoryAllocation)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.registered, self.unregistered = fail, {}, []

    def cudaHostRegister(self, ptr, size, flags):
        if self.fail:
            return 2
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def test_pinned_bytes_are_exactly_what_is_allocated_and_freed_with_the_store(monkeypatch):
    """Pinned memory is registered at the buffers' exact size (no power-of-two rounding: whole
    blocks of 4 for max_length 37), nbytes() reports exactly that, and it is unpinned when the
    store (and with it the pool) is let go."""
    import gc

    fake = FakeCudart()
    monkeypatch.setattr(hs.torch.cuda, "cudart", lambda: fake)
    s = HostKVStore(BATCH, HEADS, DIM, torch.bfloat16, True, torch.float32, 37, pin=True, block_size=BLOCK)
    s.blocks.ensure(5)
    expected = BATCH * 40 * (HEADS * DIM * 2 * 2 + HEADS * 4)
    assert sum(fake.registered.values()) == s.nbytes() == expected
    assert sorted(fake.registered) == sorted(t.data_ptr() for t in (s.keys, s.values, s.cis))
    del s
    gc.collect()
    assert sorted(fake.unregistered) == sorted(fake.registered)


@pytest.mark.parametrize(
    "dtype, with_cis, cis_dtype, row",
    [
        (torch.float32, True, torch.float32, HEADS * DIM * 2 * 4 + HEADS * 4),
        (torch.bfloat16, True, torch.float32, HEADS * DIM * 2 * 2 + HEADS * 4),
        (torch.float16, False, None, HEADS * DIM * 2 * 2),
    ],
)
def test_row_bytes_and_nbytes(dtype, with_cis, cis_dtype, row):
    s = HostKVStore(BATCH, HEADS, DIM, dtype, with_cis, cis_dtype, None, pin=False, block_size=BLOCK)
    assert s.row_bytes() == row
    assert s.nbytes() == 0  # nothing allocated before the first ensure
    s.blocks.ensure(10)
    assert s.blocks.capacity == GROWTH_CHUNK and s.nbytes() == BATCH * GROWTH_CHUNK * row
    assert (s.cis is None) == (not with_cis)


def test_ensure_grows_in_chunks_and_keeps_what_was_stored():
    s = store(rows=5)
    assert s.blocks.capacity == GROWTH_CHUNK
    gen = torch.Generator().manual_seed(4)
    keys, values, cis = (
        torch.randn(BATCH, 6, HEADS, DIM, generator=gen),
        torch.randn(BATCH, 6, HEADS, DIM, generator=gen),
        torch.randn(BATCH, 6, HEADS, generator=gen),
    )
    s.write_span(GROWTH_CHUNK - 3, keys[:, :3], values[:, :3], cis[:, :3])  # the old buffer's last rows
    before = [t.clone() for t in (K(s), V(s), C(s))]
    s.blocks.ensure(GROWTH_CHUNK)  # fits: nothing moves
    assert s.blocks.capacity == GROWTH_CHUNK and all(equal_nan(t, b) for t, b in zip((K(s), V(s), C(s)), before))
    s.blocks.ensure(GROWTH_CHUNK + 1)
    assert s.blocks.capacity == 2 * GROWTH_CHUNK
    assert K(s).shape == (BATCH, 2 * GROWTH_CHUNK, HEADS, DIM) and C(s).shape == (BATCH, 2 * GROWTH_CHUNK, HEADS)
    for t, b in zip((K(s), V(s), C(s)), before):
        assert equal_nan(t[:, :GROWTH_CHUNK], b)  # NaN where nothing was written, too
    s.write_span(GROWTH_CHUNK, keys[:, 3:], values[:, 3:], cis[:, 3:])  # the span across the old end
    assert torch.equal(K(s)[:, GROWTH_CHUNK - 3 : GROWTH_CHUNK + 3], keys) and torch.equal(
        C(s)[:, GROWTH_CHUNK - 3 : GROWTH_CHUNK + 3], cis
    )
    s.blocks.ensure(3 * GROWTH_CHUNK - 7)
    assert s.blocks.capacity == 3 * GROWTH_CHUNK and torch.equal(V(s)[:, GROWTH_CHUNK - 3 : GROWTH_CHUNK + 3], values)


def test_max_length_preallocates_and_rejects_longer_sequences():
    s = store(max_length=40, rows=1)
    assert s.blocks.capacity == 40 and K(s).shape == (BATCH, 40, HEADS, DIM)
    s.write_span(36, torch.ones(BATCH, 4, HEADS, DIM), torch.ones(BATCH, 4, HEADS, DIM), torch.ones(BATCH, 4, HEADS))
    s.blocks.ensure(40)
    with pytest.raises(ValueError, match="sequence of 41 tokens exceeds this cache's max_length=40"):
        s.blocks.ensure(41)
    assert (
        s.blocks.capacity == 40 and (K(s)[:, 36:] == 1).all() and K(s)[:, :36].isnan().all()
    )  # unchanged by the refusal


def test_pinning_failure_names_the_bytes(monkeypatch):
    monkeypatch.setattr(hs.torch.cuda, "cudart", lambda: FakeCudart(fail=True))
    s = HostKVStore(2, 4, 64, torch.bfloat16, False, None, 2**20, pin=True)
    with pytest.raises(MemoryError, match=r"could not pin 1\.00 GiB of host memory .*cudaHostRegister: 2.*ulimit -l"):
        s.blocks.ensure(1)  # K: 2 x 2^20 x 4 x 64 bf16 = 1 GiB


# -- the pool -------------------------------------------------------------------------------------


def test_pool_counts_holders_and_reuses_freed_blocks():
    pool = HostBlockPool(BLOCK, HEADS, DIM, torch.float32, False, None, pin=False)
    assert pool.capacity == 0 and pool.nbytes() == 0
    first = pool.allocator.allocate(3)
    assert first == [0, 1, 2] and pool.capacity == 3 and [pool.allocator.refcount(b) for b in first] == [1, 1, 1]
    assert pool.nbytes() == 3 * pool.block_nbytes() == 3 * BLOCK * HEADS * DIM * 2 * 4
    pool.allocator.retain([1, 1])
    pool.allocator.release([0, 1])
    assert (
        [pool.allocator.refcount(b) for b in first] == [0, 2, 1]
        and pool.allocator.free_blocks() == 1
        and pool.allocator.used_blocks() == 2
    )
    assert pool.allocator.allocate(2) == [0, 3] and pool.capacity == 4  # the freed block first, then exactly one more
    with pytest.raises(ValueError, match="block 2 has 1 holders, fewer than the 2 releases asked"):
        pool.allocator.release([2, 2])
    assert pool.allocator.refcount(2) == 1  # a refused release changes nothing
    with pytest.raises(ValueError, match="block id 9 is outside the pool's 4 blocks"):
        pool.allocator.retain([9])
    pool.allocator.release([2])
    with pytest.raises(ValueError, match="block 2 is already free"):
        pool.allocator.release([2])
    with pytest.raises(ValueError, match="block 2 is free; only an allocated block can be retained"):
        pool.allocator.retain([2])


def test_a_store_refuses_a_pool_of_another_geometry():
    pool = HostBlockPool(8, HEADS, DIM, torch.float32, True, torch.float32, pin=False)
    with pytest.raises(
        ValueError,
        match=r"another geometry \(block_size: pool 8 vs layer 4; dtype: pool torch.float32 vs layer torch.bfloat16\)",
    ):
        HostKVStore(BATCH, HEADS, DIM, torch.bfloat16, True, torch.float32, None, False, block_size=4, pool=pool)


def filled(lengths, rows=12):
    """A store of len(lengths) sequences, capacity `rows`, sequence b holding lengths[b] random rows."""
    s = HostKVStore(len(lengths), HEADS, DIM, torch.float32, True, torch.float32, rows, pin=False, block_size=BLOCK)
    s.blocks.ensure(rows)
    for t in s.tensors():
        t.fill_(NAN)
    gen = torch.Generator().manual_seed(7)
    for b, n in enumerate(lengths):
        s.write(
            torch.full((n,), b),
            torch.arange(n),
            torch.randn(n, HEADS, DIM, generator=gen),
            torch.randn(n, HEADS, DIM, generator=gen),
            torch.randn(n, HEADS, generator=gen),
        )
    return s


def test_fork_shares_full_blocks_and_copies_the_tail():
    """Sequence 0 holds 10 rows (blocks 0, 1 full, block 2 partial), sequence 1 holds 8 (two full):
    forked twice each, the full blocks are the source's (held three times), each tail a copy; the
    fork reads the same rows, and writes to a fork reach neither the source nor the other fork."""
    s = filled([10, 8])
    fork = s.forked([10, 8], repeats=2)
    src = s.blocks.sequence_blocks(0)
    for j in range(2):
        assert fork.blocks.sequence_blocks(j, 8) == src[:2] and fork.blocks.sequence_blocks(j)[2] not in src
        assert fork.blocks.sequence_blocks(2 + j, 8) == s.blocks.sequence_blocks(1, 8)
    assert [s.pool.allocator.refcount(b) for b in src[:2]] == [3, 3] and s.pool.allocator.refcount(src[2]) == 1
    fork.blocks.ensure(12)  # blocks past each tail are assigned now, private
    # the two copied tails, the 8-row sequences' third blocks
    assert len(fork.blocks.distinct_blocks() - s.blocks.distinct_blocks()) == 2 + 2
    before = (K(s).clone(), V(s).clone(), C(s).clone())
    lengths = torch.tensor([10, 10, 8, 8])
    keys, _, cis = fork.device_rows(10, lengths, torch.device("cpu"))
    for b, src_b in enumerate([0, 0, 1, 1]):
        n = int(lengths[b])
        assert torch.equal(keys[b, :n], before[0][src_b, :n]) and torch.equal(cis[b, :n], before[2][src_b, :n])
    new = torch.randn(4, HEADS, DIM)
    forked_before = K(fork).clone()
    write_rows(fork, torch.tensor([10, -1, 8, 11]), new, new + 1, new[..., 0])
    assert (
        torch.equal(K(fork)[0, 10], new[0])
        and torch.equal(K(fork)[2, 8], new[2])
        and torch.equal(V(fork)[3, 11], new[3] + 1)
    )
    assert equal_nan(K(fork)[1], forked_before[1])  # the other fork of sequence 0 did not see the write
    assert all(equal_nan(a, b) for a, b in zip((K(s), V(s), C(s)), before))


def test_crop_makes_shared_blocks_private_before_they_are_written():
    """A fork of 12 rows (3 full blocks, all shared) cropped to 6 rows: its block 1 becomes its
    own copy (rows 4, 5 kept), block 2 is let go; the source keeps its blocks and rows."""
    s = filled([12])
    fork = s.forked([12])
    src = s.blocks.sequence_blocks(0)
    fork.blocks.make_writable([6])
    mine = fork.blocks.sequence_blocks(0)
    assert mine[0] == src[0] and mine[1] not in src and mine[2] == -1 and not fork.blocks.complete
    assert [s.pool.allocator.refcount(b) for b in src] == [2, 1, 1]
    fork.blocks.ensure(12)
    before = K(s).clone()
    fork.write_span(6, torch.ones(1, 4, HEADS, DIM), torch.ones(1, 4, HEADS, DIM), torch.ones(1, 4, HEADS))
    assert (K(fork)[0, 6:10] == 1).all() and equal_nan(K(s), before)
    assert torch.equal(K(fork)[0, :6], before[0, :6])


def test_a_store_lets_go_of_its_blocks_when_freed():
    import gc

    s = filled([10, 3])
    pool = s.pool
    fork = s.forked([10, 3])
    held = pool.allocator.used_blocks()
    del fork
    gc.collect()
    assert pool.allocator.used_blocks() == held - 2  # its two copied tails; the shared blocks stay with s
    del s
    gc.collect()
    assert pool.allocator.used_blocks() == 0 and pool.allocator.free_blocks() == pool.capacity
