"""sparse_decode: the Triton kernel against its reference, and the reference against the model's
gather path, `cache.gather_blocks` + `prefill.masked_attention` (the semantics it stands for)."""

from __future__ import annotations

import math

import pytest
import torch

import forecastkv.kernels as K
from forecastkv.modeling.cache import SparseCacheLayer, gather_blocks
from forecastkv.modeling.prefill import masked_attention
from tests.helpers import rel

from .conftest import CUDA, DEVICE, aot_sm90, assert_close, compile_sm90, needs_triton


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def strided_query(batch, q_heads, dim, dtype):
    """A query that is a strided view (every other head of a wider [B, 1, 2*Hq, d] tensor)."""
    return rand(batch, 1, 2 * q_heads, dim, dtype=dtype)[:, 0, ::2]


def blocks_case(batch=2, heads=2, group=3, dim=16, block=8, seq=37, width=3, dtype=torch.float32, bias=True):
    n_blocks = -(-seq // block)
    q = strided_query(batch, heads * group, dim, dtype)
    k, v = rand(batch, seq, heads, dim, dtype=dtype), rand(batch, seq, heads, dim, dtype=dtype)
    b = rand(batch, seq, heads) if bias else None
    ids = torch.stack([torch.randperm(n_blocks)[:width] for _ in range(batch * heads)]).view(batch, heads, width)
    ids[torch.rand(ids.shape) < 0.25] = -1
    ids[0, 0, 0] = n_blocks - 1  # the partial last block of sequence 0
    lengths = torch.tensor([seq] + [int(torch.randint(block, seq, ())) for _ in range(batch - 1)])
    return q, k, v, b, ids.to(DEVICE), lengths.to(DEVICE)


def slots_case(batch=2, heads=2, group=3, dim=16, block=8, slots=3, dtype=torch.float32, bias=True):
    q = strided_query(batch, heads * group, dim, dtype)
    rows = slots * block
    k, v = rand(batch, rows, heads, dim, dtype=dtype), rand(batch, rows, heads, dim, dtype=dtype)
    b = rand(batch, rows, heads) if bias else None
    lens = torch.randint(0, block + 1, (batch, heads, slots))
    lens[0, 0, 0], lens[0, 0, 1] = 0, block  # an empty and a full slot
    return q, k, v, b, lens.to(DEVICE)


def poisoned(q):
    return torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device), torch.full(
        q.shape[:2], float("nan"), device=q.device
    )


def check_pair(got, ref, dtype):
    out, lse = got
    ref_out, ref_lse = ref
    assert not out.isnan().any() and not lse.isnan().any(), "the kernel must write every output entry"
    assert_close(out.float(), ref_out.float(), dtype)
    assert_close(lse, ref_lse, torch.float32 if dtype == torch.float32 else dtype)


@needs_triton
@pytest.mark.parametrize("group", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_blocks_matches_reference(group, dtype, bias):
    q, k, v, b, ids, lengths = blocks_case(group=group, dtype=dtype, bias=bias)
    ref = K.sparse_decode_blocks_reference(q, k, v, ids, lengths, 8, bias=b)
    out, lse = poisoned(q)
    got = K.sparse_decode_blocks_triton(q, k, v, ids, lengths, 8, bias=b, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    check_pair(got, ref, dtype)


@needs_triton
@pytest.mark.parametrize("group", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_slots_matches_reference(group, dtype, bias):
    q, k, v, b, lens = slots_case(group=group, dtype=dtype, bias=bias)
    ref = K.sparse_decode_slots_reference(q, k, v, lens, 8, bias_slots=b)
    out, lse = poisoned(q)
    check_pair(K.sparse_decode_slots_triton(q, k, v, lens, 8, bias_slots=b, out=out, lse=lse), ref, dtype)


@needs_triton
def test_odd_shapes_scale_and_strided_cache():
    """Block 6, head dim 12 (padded tiles), G = 2, a custom scale, K/V views of a wider buffer."""
    batch, heads, dim, seq = 2, 3, 12, 20
    kv = rand(batch, seq, heads, 2 * dim)
    k, v = kv[..., :dim], kv[..., dim:]
    q = rand(batch, heads * 2, dim)
    bias = rand(batch, heads, seq).transpose(1, 2)
    ids = torch.tensor([[[3, 0], [1, -1], [2, 3]], [[-1, -1], [0, 2], [3, 1]]], device=DEVICE)
    lengths = torch.tensor([20, 14], device=DEVICE)
    args = (q, k, v, ids, lengths, 6)
    ref = K.sparse_decode_blocks_reference(*args, scale=0.3, bias=bias)
    check_pair(K.sparse_decode_blocks_triton(*args, scale=0.3, bias=bias), ref, torch.float32)


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=needs_triton), "reference"])
def test_no_valid_key_gives_zeros(impl):
    blocks = K.sparse_decode_blocks_triton if impl == "triton" else K.sparse_decode_blocks_reference
    slots = K.sparse_decode_slots_triton if impl == "triton" else K.sparse_decode_slots_reference
    q, k, v, b, ids, lengths = blocks_case(group=3)
    ids[1] = -1
    ids[0, 1] = 4  # block 4 = rows 32.. of sequence 0, all stored
    lengths[0] = 32  # ... but not any more: nothing valid for head 1 of sequence 0
    out, lse = blocks(q, k, v, ids, lengths, 8, bias=b)
    assert (out[1] == 0).all() and (lse[1] == float("-inf")).all()
    assert (out[0, 3:6] == 0).all() and (lse[0, 3:6] == float("-inf")).all()
    q, k, v, b, lens = slots_case(group=3)
    lens[0] = 0
    out, lse = slots(q, k, v, lens, 8, bias_slots=b)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all() and torch.isfinite(lse[1]).all()


def aot_launches():
    """Sum-reduce (G <= 2) and tensor-core tl.dot (G > 2, bf16) variants, both layouts, at d 128,
    block 64; then the split (flash-decoding) launch and its combine kernel."""
    for group in (2, 16):
        q, k, v, b, ids, lengths = blocks_case(
            heads=2, group=group, dim=128, block=64, seq=300, width=3, dtype=torch.bfloat16
        )
        K.sparse_decode_blocks_triton(q, k, v, ids, lengths, 64, bias=b)
        K.sparse_decode_slots_triton(q, k[:, :192], v[:, :192], torch.full((2, 2, 3), 64), 64)
    K.sparse_decode_blocks_triton(q, k, v, ids, lengths, 64, bias=b, num_splits=2)


@aot_sm90
def test_compiles_for_sm90():
    """Compiled-mode errors the interpreter lets through would show here, without a GPU."""
    assert compile_sm90(__name__, "aot_launches") == 6


@needs_triton
@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [2, 3])
def test_split_blocks_combine_to_the_reference(splits, dtype, group):
    """Flash-decoding: entries split across programs, partials combined by their LSE (8 splits >
    5 entries: some splits are empty)."""
    q, k, v, b, ids, lengths = blocks_case(group=group, dtype=dtype, seq=45, width=5)
    ids[1, 0] = -1  # a row whose first split has no key
    ref = K.sparse_decode_blocks_reference(q, k, v, ids, lengths, 8, bias=b)
    out, lse = poisoned(q)
    check_pair(
        K.sparse_decode_blocks_triton(q, k, v, ids, lengths, 8, bias=b, out=out, lse=lse, num_splits=splits), ref, dtype
    )


@needs_triton
@pytest.mark.parametrize("splits", [2, 4])
def test_split_slots_combine_to_the_reference(splits):
    q, k, v, b, lens = slots_case(group=3, slots=5)
    lens[1, 1] = 0  # an empty head row: zeros and -inf
    ref = K.sparse_decode_slots_reference(q, k, v, lens, 8, bias_slots=b)
    out, lse = poisoned(q)
    got = K.sparse_decode_slots_triton(q, k, v, lens, 8, bias_slots=b, out=out, lse=lse, num_splits=splits)
    assert (got[0][1, 3:6] == 0).all() and (got[1][1, 3:6] == float("-inf")).all()
    finite = torch.isfinite(ref[1])
    assert_close(got[0].float(), ref[0].float(), torch.float32)
    assert torch.equal(finite, torch.isfinite(got[1])) and rel(got[1][finite], ref[1][finite]) < 1e-5


def test_split_choice_fills_the_gpu_only_on_cuda():
    from forecastkv.kernels.sparse_decode import choose_splits

    assert choose_splits(1, 8, 96, torch.device("cpu")) == 1


# ----------------------------------------------------------------------------------------------
# the reference is the model's semantics
# ----------------------------------------------------------------------------------------------


def _filled_cache_layer(batch, heads, dim, lengths, with_cis):
    """A SparseCacheLayer holding sequences of different lengths (left padding = position -1)."""
    longest = max(lengths)
    positions = torch.stack([torch.cat([torch.full((longest - n,), -1), torch.arange(n)]) for n in lengths])
    keys, values = torch.randn(batch, longest, heads, dim), torch.randn(batch, longest, heads, dim)
    cis = torch.randn(batch, longest, heads) if with_cis else None
    layer = SparseCacheLayer()
    layer.append(keys, values, cis, positions)
    return layer


@pytest.mark.parametrize("with_cis", [False, True])
@pytest.mark.parametrize("group", [1, 3])
def test_reference_equals_gathered_blocks_attended(with_cis, group):
    batch, heads, dim, block = 2, 2, 16, 8
    lengths = [29, 21]
    layer = _filled_cache_layer(batch, heads, dim, lengths, with_cis)
    selection = torch.tensor([[[0, 3, -1], [1, 2, 3]], [[2, -1, -1], [0, 1, 2]]])
    q = torch.randn(batch, heads * group, dim)
    # the model's gather path: the selected blocks, then masked attention per query row
    rows = layer.store
    keys, values, key_pos, bias = gather_blocks(rows.keys, rows.values, rows.cis, selection, layer.lengths, block)
    positions = torch.tensor(lengths) - 1
    allowed = ((key_pos >= 0) & (key_pos <= positions.view(-1, 1, 1))).unsqueeze(2).expand(-1, -1, group, -1)
    expected = masked_attention(q.view(batch, heads, group, dim), keys, values, allowed, bias, group=1)
    expected = expected.reshape(batch, heads * group, dim)
    # the kernel reference on the raw cache
    full_k, full_v, cis, _ = layer.full()
    out, lse = K.sparse_decode_blocks_reference(q, full_k, full_v, selection, layer.lengths, block, bias=cis)
    assert rel(out, expected) < 1e-5
    # lse is the log-sum-exp of the scaled (+ biased) logits over the same keys
    logits = torch.einsum("bhgd,bhld->bhgl", q.view(batch, heads, group, dim), keys) / math.sqrt(dim)
    if bias is not None:
        logits = logits + bias.unsqueeze(2)
    expected_lse = logits.masked_fill(~allowed, float("-inf")).logsumexp(-1).reshape(batch, -1)
    assert rel(lse, expected_lse) < 1e-5


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=needs_triton), "reference"])
def test_slots_equal_blocks_after_gather(impl):
    """Gathering the selected blocks into slots and attending there equals attending in place."""
    q, k, v, b, ids, lengths = blocks_case(group=3, seq=37)
    batch, seq, heads, dim = k.shape
    block, width = 8, ids.shape[-1]
    k_slots = torch.zeros(batch, width * block, heads, dim, device=DEVICE)
    v_slots, b_slots = torch.zeros_like(k_slots), torch.zeros(batch, width * block, heads, device=DEVICE)
    # the resident store is "host" here (same device): keys past each length are never valid
    K.block_gather_reference(k, v, ids.permute(1, 0, 2), k_slots, v_slots, block, b, b_slots)
    start = ids.clamp(min=0) * block
    slot_lens = torch.where(ids >= 0, (lengths.view(-1, 1, 1) - start).clamp(0, block), 0)
    blocks_fn = K.sparse_decode_blocks_triton if impl == "triton" else K.sparse_decode_blocks_reference
    slots_fn = K.sparse_decode_slots_triton if impl == "triton" else K.sparse_decode_slots_reference
    in_place = blocks_fn(q, k, v, ids, lengths, block, bias=b)
    in_slots = slots_fn(q, k_slots, v_slots, slot_lens, block, bias_slots=b_slots)
    check_pair(in_slots, in_place, torch.float32)


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------

BLOCK_FNS = [K.sparse_decode_blocks_reference, K.sparse_decode_blocks_triton, K.sparse_decode_blocks]
SLOT_FNS = [K.sparse_decode_slots_reference, K.sparse_decode_slots_triton, K.sparse_decode_slots]


@pytest.mark.parametrize("fn", BLOCK_FNS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "change, error, match",
    [
        (
            lambda a: {"block_ids": a["block_ids"].fill_(5)},
            ValueError,
            r"block_ids has value 5 >= 5, the limit .*S=37, block_size=8",
        ),
        (lambda a: {"block_ids": a["block_ids"].fill_(-3)}, ValueError, r"block_ids has value -3 < -1"),
        (
            lambda a: {"lengths": a["lengths"] + 100},
            ValueError,
            r"lengths has value 13\d >= 38, the limit \(at most S=37",
        ),
        (lambda a: {"lengths": a["lengths"].float()}, TypeError, r"lengths has dtype torch.float32"),
        (lambda a: {"q": a["q"][:, :5]}, ValueError, r"q has H_q=5 heads, which is not a multiple of H_kv=2"),
        (lambda a: {"q": a["q"].double()}, TypeError, r"q has dtype torch.float64"),
        (
            lambda a: {"k_cache": a["k_cache"].bfloat16()},
            TypeError,
            r"dtypes must be equal: q=torch.float32, k_cache=torch.bfloat16",
        ),
        (
            lambda a: {"v_cache": a["v_cache"][:, :-1]},
            ValueError,
            r"v_cache has shape \(2, 36, 2, 16\), expected \(2, 37, 2, 16\)",
        ),
        (lambda a: {"bias": a["bias"][:, :-1]}, ValueError, r"bias has shape \(2, 36, 2\), expected \(2, 37, 2\)"),
        (
            lambda a: {"block_ids": a["block_ids"][:1]},
            ValueError,
            r"block_ids has shape \(1, 2, 3\), expected \[B=2, H_kv=2, K\]",
        ),
        (
            lambda a: {"out": a["q"].new_zeros(2, 6, 16, dtype=torch.bfloat16)},
            TypeError,
            r"out has dtype torch.bfloat16",
        ),
        (lambda a: {"lse": a["q"].new_zeros(2, 5)}, ValueError, r"lse has shape \(2, 5\), expected \(2, 6\)"),
        (lambda a: {"block_size": -8}, ValueError, r"block_size must be a positive integer, got -8"),
    ],
)
def test_blocks_rejects_bad_inputs(fn, change, error, match):
    q, k, v, b, ids, lengths = blocks_case(group=3, seq=37)
    args = dict(q=q, k_cache=k, v_cache=v, block_ids=ids, lengths=lengths, block_size=8, bias=b)
    args.update(change(args))
    with pytest.raises(error, match=match):
        fn(**args)


@pytest.mark.parametrize("fn", SLOT_FNS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "change, error, match",
    [
        (
            lambda a: {"slot_lens": a["slot_lens"].fill_(9)},
            ValueError,
            r"slot_lens has value 9 >= 9, the limit \(at most block_size=8",
        ),
        (lambda a: {"slot_lens": a["slot_lens"].fill_(-1)}, ValueError, r"slot_lens has value -1 < 0"),
        (
            lambda a: {"slot_lens": a["slot_lens"][..., :2]},
            ValueError,
            r"slot_lens has shape \(2, 2, 2\), expected \(2, 2, 3\)",
        ),
        (
            lambda a: {
                "k_slots": a["k_slots"][:, :20],
                "v_slots": a["v_slots"][:, :20],
                "bias_slots": a["bias_slots"][:, :20],
            },
            ValueError,
            r"k_slots has 20 rows, not a multiple of block_size=8",
        ),
        (
            lambda a: {"bias_slots": a["bias_slots"][..., :1]},
            ValueError,
            r"bias_slots has shape \(2, 24, 1\), expected \(2, 24, 2\)",
        ),
    ],
)
def test_slots_rejects_bad_inputs(fn, change, error, match):
    q, k, v, b, lens = slots_case(group=3)
    args = dict(q=q, k_slots=k, v_slots=v, slot_lens=lens, block_size=8, bias_slots=b)
    args.update(change(args))
    with pytest.raises(error, match=match):
        fn(**args)


# ----------------------------------------------------------------------------------------------
# realistic sizes, compiled (CUDA only)
# ----------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("group", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_realistic_sizes_cuda(group, dtype):
    """MiniCPM-like geometry (d 128, block 64, 32 selected blocks) through the compiled kernel."""
    q, k, v, b, ids, lengths = blocks_case(
        batch=4, heads=8, group=group, dim=128, block=64, seq=8192, width=32, dtype=dtype
    )
    ref = K.sparse_decode_blocks_reference(q, k, v, ids, lengths, 64, bias=b)
    check_pair(K.sparse_decode_blocks_triton(q, k, v, ids, lengths, 64, bias=b), ref, dtype)
    q, k, v, b, lens = slots_case(batch=4, heads=8, group=group, dim=128, block=64, slots=32, dtype=dtype)
    ref = K.sparse_decode_slots_reference(q, k, v, lens, 64, bias_slots=b)
    check_pair(K.sparse_decode_slots_triton(q, k, v, lens, 64, bias_slots=b), ref, dtype)
