"""`HostKVStore`: rows land where they are written and nowhere else (buffers filled with NaN first),
bytes moved and held as computed from the shapes by hand, growth keeps what was stored, and a
sequence past max_length is a clear error."""

from __future__ import annotations

import pytest
import torch

from forecastkv.inference import host_store as hs
from forecastkv.inference.host_store import HostKVStore
from forecastkv.modeling.cache import GROWTH_CHUNK

NAN = float("nan")
BATCH, HEADS, DIM = 3, 2, 5


def store(dtype=torch.float32, with_cis=True, cis_dtype=torch.float32, max_length=None, rows=16):
    """A CPU store with room for `rows` positions (capacity: a GROWTH_CHUNK multiple, or max_length),
    every buffer element NaN."""
    s = HostKVStore(BATCH, HEADS, DIM, dtype, with_cis, cis_dtype if with_cis else None, max_length, pin=False)
    s.ensure(rows)
    for t in (s.keys, s.values, s.cis):
        if t is not None:
            t.fill_(NAN)
    return s


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
    expected_k = torch.full((BATCH, s.capacity, HEADS, DIM), NAN)
    expected_v, expected_c = expected_k.clone(), torch.full((BATCH, s.capacity, HEADS), NAN)
    for i, (b, t) in enumerate(zip(batch_idx.tolist(), pos.tolist())):
        expected_k[b, t], expected_v[b, t], expected_c[b, t] = keys[i], values[i], cis[i]
    assert equal_nan(s.keys, expected_k) and equal_nan(s.values, expected_v) and equal_nan(s.cis, expected_c)


def test_write_converts_to_the_store_dtype():
    """bf16 K/V and fp32 CIS from fp32 inputs: stored = the input rounded to bf16 (a cast, no other
    change); bytes moved count the inputs."""
    s = store(dtype=torch.bfloat16, cis_dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    keys, values, cis = torch.randn(2, HEADS, DIM, generator=gen), torch.randn(2, HEADS, DIM, generator=gen), torch.randn(2, HEADS, generator=gen)
    moved = s.write(torch.tensor([1, 0]), torch.tensor([4, 9]), keys, values, cis)
    assert moved == 2 * 2 * HEADS * DIM * 4 + 2 * HEADS * 4
    assert s.keys.dtype == torch.bfloat16 and s.cis.dtype == torch.float32
    assert torch.equal(s.keys[1, 4], keys[0].bfloat16()) and torch.equal(s.values[0, 9], values[1].bfloat16())
    assert torch.equal(s.cis[0, 9], cis[1])
    assert s.keys.isnan().sum() == s.keys.numel() - 2 * HEADS * DIM


def test_write_span_fills_positions_of_every_sequence():
    s = store()
    gen = torch.Generator().manual_seed(2)
    keys, values = torch.randn(BATCH, 4, HEADS, DIM, generator=gen), torch.randn(BATCH, 4, HEADS, DIM, generator=gen)
    cis = torch.randn(BATCH, 4, HEADS, generator=gen)
    moved = s.write_span(5, keys, values, cis)
    assert moved == 2 * BATCH * 4 * HEADS * DIM * 4 + BATCH * 4 * HEADS * 4
    assert torch.equal(s.keys[:, 5:9], keys) and torch.equal(s.values[:, 5:9], values) and torch.equal(s.cis[:, 5:9], cis)
    for t in (s.keys, s.values, s.cis):
        assert t[:, :5].isnan().all() and t[:, 9:].isnan().all()
    # without CIS: nothing else written, bytes of K and V only
    assert s.write_span(0, keys[:, :1], values[:, :1], None) == 2 * BATCH * HEADS * DIM * 4
    assert s.cis[:, 0].isnan().all()


def test_device_rows_are_copies_with_rows_past_each_length_zeroed():
    """The H2D staging: copies (not views) of the first positions; host rows past a sequence's
    length (here NaN: the store is allocated uninitialised) arrive as zeros, also in extra rows."""
    s = store()
    s.write_span(0, torch.ones(BATCH, 3, HEADS, DIM), torch.full((BATCH, 3, HEADS, DIM), 2.0), torch.full((BATCH, 3, HEADS), 3.0))
    lengths = torch.tensor([3, 1, 0])
    keys, values, cis = s.device_rows(3, lengths, torch.device("cpu"), rows=5)
    assert keys.shape == values.shape == (BATCH, 5, HEADS, DIM) and cis.shape == (BATCH, 5, HEADS)
    assert keys.data_ptr() != s.keys.data_ptr()
    for t, value in ((keys, 1.0), (values, 2.0), (cis, 3.0)):
        assert not t.isnan().any()
        for b, n in enumerate(lengths.tolist()):
            assert (t[b, :n] == value).all() and (t[b, n:] == 0).all()
    assert store(with_cis=False).device_rows(4, torch.tensor([4, 4, 4]), torch.device("cpu"))[2] is None


def test_write_rows_stores_one_row_per_sequence():
    """The decode write-back (`row_store`): row b at positions[b], -1 skips the sequence."""
    s = store()
    keys, values, cis = torch.randn(BATCH, HEADS, DIM), torch.randn(BATCH, HEADS, DIM), torch.randn(BATCH, HEADS)
    moved = s.write_rows(torch.tensor([4, -1, 0]), keys, values, cis)
    assert moved == BATCH * HEADS * DIM * 4 * 2 + BATCH * HEADS * 4
    assert torch.equal(s.keys[0, 4], keys[0]) and torch.equal(s.values[2, 0], values[2]) and torch.equal(s.cis[0, 4], cis[0])
    assert s.keys[1].isnan().all() and s.keys[0, :4].isnan().all() and s.cis[2, 1:].isnan().all()


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
    """Pinned memory is registered at the buffers' exact size (no power-of-two rounding), nbytes()
    reports exactly that, and it is unpinned when the store lets go of it."""
    import gc

    fake = FakeCudart()
    monkeypatch.setattr(hs.torch.cuda, "cudart", lambda: fake)
    s = HostKVStore(BATCH, HEADS, DIM, torch.bfloat16, True, torch.float32, 37, pin=True)
    s.ensure(5)
    expected = BATCH * 37 * (HEADS * DIM * 2 * 2 + HEADS * 4)
    assert sum(fake.registered.values()) == s.nbytes() == expected
    assert sorted(fake.registered) == sorted(t.data_ptr() for t in (s.keys, s.values, s.cis))
    del s
    gc.collect()
    assert sorted(fake.unregistered) == sorted(fake.registered)


@pytest.mark.parametrize("dtype, with_cis, cis_dtype, row", [
    (torch.float32, True, torch.float32, HEADS * DIM * 2 * 4 + HEADS * 4),
    (torch.bfloat16, True, torch.float32, HEADS * DIM * 2 * 2 + HEADS * 4),
    (torch.float16, False, None, HEADS * DIM * 2 * 2),
])
def test_row_bytes_and_nbytes(dtype, with_cis, cis_dtype, row):
    s = HostKVStore(BATCH, HEADS, DIM, dtype, with_cis, cis_dtype, None, pin=False)
    assert s.row_bytes() == row
    assert s.nbytes() == 0  # nothing allocated before the first ensure
    s.ensure(10)
    assert s.capacity == GROWTH_CHUNK and s.nbytes() == BATCH * GROWTH_CHUNK * row
    assert (s.cis is None) == (not with_cis)


def test_ensure_grows_in_chunks_and_keeps_what_was_stored():
    s = store(rows=5)
    assert s.capacity == GROWTH_CHUNK
    gen = torch.Generator().manual_seed(4)
    keys, values, cis = torch.randn(BATCH, 6, HEADS, DIM, generator=gen), torch.randn(BATCH, 6, HEADS, DIM, generator=gen), torch.randn(BATCH, 6, HEADS, generator=gen)
    s.write_span(GROWTH_CHUNK - 3, keys[:, :3], values[:, :3], cis[:, :3])     # the old buffer's last rows
    before = [t.clone() for t in (s.keys, s.values, s.cis)]
    s.ensure(GROWTH_CHUNK)                                                   # fits: nothing moves
    assert s.capacity == GROWTH_CHUNK and all(equal_nan(t, b) for t, b in zip((s.keys, s.values, s.cis), before))
    s.ensure(GROWTH_CHUNK + 1)
    assert s.capacity == 2 * GROWTH_CHUNK
    assert s.keys.shape == (BATCH, 2 * GROWTH_CHUNK, HEADS, DIM) and s.cis.shape == (BATCH, 2 * GROWTH_CHUNK, HEADS)
    for t, b in zip((s.keys, s.values, s.cis), before):
        assert equal_nan(t[:, :GROWTH_CHUNK], b)                             # NaN where nothing was written, too
    s.write_span(GROWTH_CHUNK, keys[:, 3:], values[:, 3:], cis[:, 3:])       # the span across the old end
    assert torch.equal(s.keys[:, GROWTH_CHUNK - 3 : GROWTH_CHUNK + 3], keys) and torch.equal(s.cis[:, GROWTH_CHUNK - 3 : GROWTH_CHUNK + 3], cis)
    s.ensure(3 * GROWTH_CHUNK - 7)
    assert s.capacity == 3 * GROWTH_CHUNK and torch.equal(s.values[:, GROWTH_CHUNK - 3 : GROWTH_CHUNK + 3], values)


def test_max_length_preallocates_and_rejects_longer_sequences():
    s = store(max_length=40, rows=1)
    assert s.capacity == 40 and s.keys.shape == (BATCH, 40, HEADS, DIM)
    s.write_span(36, torch.ones(BATCH, 4, HEADS, DIM), torch.ones(BATCH, 4, HEADS, DIM), torch.ones(BATCH, 4, HEADS))
    s.ensure(40)
    with pytest.raises(ValueError, match="sequence of 41 tokens exceeds this cache's max_length=40"):
        s.ensure(41)
    assert s.capacity == 40 and (s.keys[:, 36:] == 1).all() and s.keys[:, :36].isnan().all()  # unchanged by the refusal


def test_pinning_failure_names_the_bytes(monkeypatch):
    monkeypatch.setattr(hs.torch.cuda, "cudart", lambda: FakeCudart(fail=True))
    s = HostKVStore(2, 4, 64, torch.bfloat16, False, None, 2**20, pin=True)
    with pytest.raises(MemoryError, match=r"could not pin 1\.00 GiB of host memory .*cudaHostRegister: 2.*ulimit -l"):
        s.ensure(1)  # K: 2 x 2^20 x 4 x 64 bf16 = 1 GiB
