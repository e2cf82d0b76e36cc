"""Prefill attention back ends against a plain masked-softmax reference, and the model with the
FlexAttention back end (run eagerly on CPU) against the chunked one."""

import warnings

import pytest
import torch

from forecastkv import kernels
from forecastkv.modeling import attention as attention_module
from forecastkv.modeling import prefill
from tests.helpers import TINY_SPARSE, rel, tiny_model


def reference(q, keys, values, bias, positions, masks, block_size):
    """Softmax over keys <= each row's position inside its blocks (CIS added after scaling), heads
    repeated per group; rows with no key give 0.  Shapes as `prefill.chunked_sparse_attention`."""
    batch, rows, heads, dim = q.shape
    count, kv_heads = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    key_blocks = masks.repeat_interleave(block_size, dim=-1)[..., :count]  # [B, H, R, S]
    allowed = key_blocks & (torch.arange(count).view(1, 1, 1, -1) <= positions[:, None, :, None])
    allowed = allowed.repeat_interleave(group, dim=1)
    logits = q.transpose(1, 2) @ keys.transpose(1, 2).repeat_interleave(group, dim=1).transpose(-1, -2) / dim**0.5
    if bias is not None:
        logits = logits + bias.transpose(1, 2).repeat_interleave(group, dim=1)[:, :, None, :]
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return (probs @ values.transpose(1, 2).repeat_interleave(group, dim=1)).transpose(1, 2)


def random_case(seed, batch=2, rows=37, count=53, kv_heads=2, group=3, dim=8, block_size=8, with_bias=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, rows, kv_heads * group, dim, generator=gen)
    keys = torch.randn(batch, count, kv_heads, dim, generator=gen)
    values = torch.randn(batch, count, kv_heads, dim, generator=gen)
    bias = torch.randn(batch, count, kv_heads, generator=gen) if with_bias else None
    positions = torch.arange(count - rows, count).repeat(batch, 1)
    if batch > 1:
        positions[1, :5] = -1  # left padding in the second sequence
    n_blocks = -(-count // block_size)
    masks = torch.rand(batch, kv_heads, rows, n_blocks, generator=gen) < 0.4
    masks[0, 0, 3] = False  # a row that attends nothing
    return q, keys, values, bias, positions, masks, block_size


@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_sparse_matches_reference(with_bias):
    case = random_case(1, with_bias=with_bias)
    assert rel(prefill.chunked_sparse_attention(*case), reference(*case)) < 1e-5


def scattered_pages(rows: torch.Tensor, page: int, pages: int, seed: int):
    """rows [B, S, H, ...] copied into a NaN-filled pool [pages, H, page, ...] at shuffled page ids
    (an engine's pages: rows past S never written) -> (pool, table [B, ceil(S / page)])."""
    batch, count, heads = rows.shape[:3]
    width = -(-count // page)
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))[: batch * width]
    table = order.view(batch, width)
    pool = torch.full((pages, heads, page, *rows.shape[3:]), float("nan"))
    for b in range(batch):
        for column in range(width):
            part = rows[b, column * page : (column + 1) * page].transpose(0, 1)  # [H, n, ...]
            pool[table[b, column], :, : part.shape[1]] = part
    return pool, table


@pytest.mark.parametrize("page", [8, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_sparse_over_pages_matches_reference(page, with_bias):
    """A `BlockSource` over shuffled pages (one piece per page: 1 or 2 per block of 8) whose rows past
    the stored keys are NaN gives the reference's rows: blocks are read by their page ids and the
    unwritten rows of the current block never reach the softmax."""
    q, keys, values, bias, positions, masks, bs = random_case(5, with_bias=with_bias)
    pools = [scattered_pages(x, page, 40, seed=9) for x in (keys, values)]
    table = pools[0][1]
    bias_pool = None if bias is None else scattered_pages(bias, page, 40, seed=9)[0]
    heads, per, n_blocks = keys.shape[2], bs // page, masks.shape[-1]
    columns = torch.arange(n_blocks * per).clamp(max=table.shape[1] - 1)
    index = table[:, columns].view(-1, 1, n_blocks, per) * heads + torch.arange(heads).view(1, -1, 1, 1)
    flat_bias = None if bias_pool is None else bias_pool.flatten(0, 1)
    source = prefill.BlockSource(pools[0][0].flatten(0, 1), pools[1][0].flatten(0, 1), flat_bias, index)
    out = prefill.chunked_sparse_attention(q, None, None, None, positions, masks, bs, source)
    assert torch.isfinite(out).all()
    assert rel(out, reference(q, keys, values, bias, positions, masks, bs)) < 1e-5


@pytest.mark.parametrize("with_bias", [False, True])
def test_prompt_within_one_block_matches_reference(with_bias):
    """A prompt shorter than a block: every tile's union is one block (a case that once wrote
    through a stride-0 view of the mask)."""
    case = random_case(3, batch=1, rows=5, count=5, with_bias=with_bias)
    q, keys, values, bias, positions, masks, bs = case
    masks = torch.ones_like(masks)
    assert (
        rel(
            prefill.chunked_sparse_attention(q, keys, values, bias, positions, masks, bs),
            reference(q, keys, values, bias, positions, masks, bs),
        )
        < 1e-5
    )


@pytest.mark.parametrize("with_bias", [False, True])
def test_dense_matches_reference(with_bias):
    q, keys, values, bias, positions, masks, bs = random_case(2, with_bias=with_bias)
    everything = torch.ones_like(masks)
    got = prefill.dense_attention(q, keys, values, bias, positions, chunk=16)
    assert rel(got, reference(q, keys, values, bias, positions, everything, bs)) < 1e-5
    fresh = torch.arange(keys.shape[1]).repeat(2, 1)  # T == S, no padding: the one-call causal path
    q_full = torch.randn(2, keys.shape[1], q.shape[2], q.shape[3])
    assert prefill.is_fresh_prefill(fresh, keys.shape[1])
    got = prefill.dense_attention(q_full, keys, values, None, fresh, chunk=16)
    assert rel(got, reference(q_full, keys, values, None, fresh, torch.ones(2, 2, 53, 7, dtype=torch.bool), bs)) < 1e-5


def test_dense_sequences_rule():
    sparse = tiny_model({**TINY_SPARSE, "dense_len": 40}).config.sparse
    positions = torch.tensor([[-1, -1, 37, 38], [36, 37, 38, 39], [100, 101, 102, 103]])
    # key lengths 39, 40, 104: dense below 40 only
    assert prefill.dense_sequences(positions, sparse).tolist() == [True, False, False]
    assert prefill.dense_sequences(positions, None).tolist() == [True, True, True]


needs_flex = pytest.mark.skipif(not prefill.flex_available(), reason="this torch has no FlexAttention")


@needs_flex
@pytest.mark.parametrize("with_bias", [False, True])
def test_flex_matches_reference(with_bias):
    """FlexAttention (eager on CPU) with the BlockMask / mask_mod / score_mod built from row masks."""
    q, keys, values, bias, _, masks, bs = random_case(3, with_bias=with_bias, batch=1, rows=150, count=170)
    masks[..., -1] = True  # every row keeps at least one visible block (no padding on this path)
    positions = torch.arange(20, 170).view(1, -1)
    masks = masks & (torch.arange(masks.shape[-1]).view(1, 1, 1, -1) <= (positions // bs)[:, None, :, None])
    masks[..., 0] = True
    bits = prefill.pack_block_bits(masks)
    got = prefill.flex_sparse_attention(q, keys, values, bias, 20, bits, bs)
    assert rel(got, reference(q, keys, values, bias, positions, masks, bs)) < 1e-5


@needs_flex
def test_block_mask_covers_every_rows_blocks():
    """The BlockMask's per-tile KV block lists hold exactly the union of the tile's rows' blocks."""
    gen = torch.Generator().manual_seed(4)
    rows, count, bs, group = 300, 300, 8, 3
    masks = torch.rand(1, 2, rows, count // bs + 1, generator=gen) < 0.1
    bits = prefill.pack_block_bits(masks)
    assert torch.equal(((bits.unsqueeze(-1) >> torch.arange(64)) & 1).bool().flatten(-2)[..., : masks.shape[-1]], masks)
    block_mask = prefill.build_block_mask(bits, 0, rows, count, bs, group, q_tile=128)
    dense = block_mask.to_dense()[..., : masks.shape[-1]].bool()  # [1, Hq, tiles, NB]
    padded = torch.nn.functional.pad(masks, (0, 0, 0, 3 * 128 - rows)).view(1, 2, 3, 128, -1).any(dim=3)
    assert torch.equal(dense, padded.repeat_interleave(group, dim=1))


@needs_flex
@pytest.mark.parametrize("policy", ["infllmv2", "nosa"])
def test_model_flex_prefill_equals_chunked(policy):
    """The whole model, tight budget, NOSA with A != 0: FlexAttention prefill = chunked prefill."""
    model = tiny_model({"policy": policy}, seed=21)
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(22))
    with torch.no_grad():
        with kernels.use_backend(prefill="chunked"):
            chunked = model(ids).logits
        with kernels.use_backend(prefill="flex"):
            flex = model(ids).logits
    assert rel(flex, chunked) < 1e-5


def test_flex_buckets():
    """Rows: four steps per octave; keys: one.  Multiples of the tile, never below the length."""
    lengths = (1, 128, 129, 1024, 1025, 1300, 2048, 2049, 131072, 131073)
    four_per_octave = [prefill.flex_bucket(n, 128) for n in lengths]
    assert four_per_octave == [128, 128, 256, 1024, 1280, 1536, 2048, 2560, 131072, 163840]
    one_per_octave = [prefill.flex_bucket(n, 128, steps=1) for n in lengths]
    assert one_per_octave == [128, 128, 256, 1024, 2048, 2048, 2048, 4096, 131072, 262144]
    for n in range(1, 5000, 37):
        bucket = prefill.flex_bucket(n, 192)
        assert bucket >= n and bucket % 192 == 0 and bucket <= max(1.25 * n + 192, 192)
    # a chunked 128K prefill (8K rows per call): one row bucket, a key bucket per doubling
    keys = {prefill.flex_bucket(n, 128, steps=prefill.FLEX_KEY_STEPS) for n in range(8192, 131073, 8192)}
    assert keys == {8192, 16384, 32768, 65536, 131072}


@needs_flex
@pytest.mark.parametrize("policy", ["infllmv2", "nosa"])
def test_flex_compiles_once_per_bucket(policy, monkeypatch):
    """8 prompt lengths through the flex path with the compile wrapper CUDA uses (here with a
    backend that counts compiles and runs the captured graph eagerly): at most one compile per
    shape bucket, no eager fallback, and the logits of the chunked path."""
    import torch._dynamo

    compiles = []

    def counting(graph, inputs):
        compiles.append(tuple(tuple(x.shape) for x in inputs if isinstance(x, torch.Tensor))[:1])
        return graph.forward

    torch._dynamo.reset()
    monkeypatch.setattr(prefill, "FLEX_COMPILE_BACKENDS", {"cpu": counting})
    monkeypatch.setattr(prefill, "_COMPILED_FLEX", {})
    monkeypatch.setattr(prefill, "FLEX_FALLBACKS", [])
    model = tiny_model({"policy": policy}, seed=41)
    lengths = (30, 70, 100, 128, 150, 170, 300, 310)
    buckets = {prefill.flex_bucket(n, 128) for n in lengths}
    assert buckets == {128, 256, 384}  # 8 lengths, 3 row buckets (key buckets 128, 256, 512)
    gen = torch.Generator().manual_seed(42)
    with torch.no_grad():
        for length in lengths:
            ids = torch.randint(0, 128, (1, length), generator=gen)
            with kernels.use_backend(prefill="flex"):
                flex = model(ids).logits
            with kernels.use_backend(prefill="chunked"):
                chunked = model(ids).logits
            assert rel(flex, chunked) < 1e-5, length
    torch._dynamo.reset()
    assert 1 <= len(compiles) <= len(buckets), compiles
    assert prefill.FLEX_FALLBACKS == []


@needs_flex
def test_flex_fallback_warns_with_the_shape(monkeypatch):
    """Past the recompile limit flex runs eagerly; it says so, naming the shape, and records it."""
    import torch._dynamo

    torch._dynamo.reset()
    monkeypatch.setattr(prefill, "FLEX_COMPILE_BACKENDS", {"cpu": "eager"})
    monkeypatch.setattr(prefill, "_COMPILED_FLEX", {})
    monkeypatch.setattr(prefill, "FLEX_FALLBACKS", [])
    monkeypatch.setattr(prefill, "FLEX_RECOMPILE_LIMIT", 1)
    outputs = []
    # torch's own patch, not monkeypatch: monkeypatch's undo deletes the config entry, which torch then
    # hides, and every later compile in the process fails on the missing recompile_limit
    with torch._dynamo.config.patch(recompile_limit=1):
        for rows in (150, 300):  # two buckets, a limit of one compile
            q, keys, values, bias, _, masks, bs = random_case(3, batch=1, rows=rows, count=rows, with_bias=False)
            positions = torch.arange(rows).view(1, -1)
            masks = masks & (torch.arange(masks.shape[-1]).view(1, 1, 1, -1) <= (positions // bs)[:, None, :, None])
            masks[..., 0] = True
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = prefill.flex_sparse_attention(q, keys, values, bias, 0, prefill.pack_block_bits(masks), bs)
            outputs.append([str(w.message) for w in caught if "fell back to eager" in str(w.message)])
            assert rel(got, reference(q, keys, values, bias, positions, masks, bs)) < 1e-5
    torch._dynamo.reset()
    assert outputs[0] == [] and len(outputs[1]) == 1
    assert "[B, Hq, rows, keys, d] = [1, 6, 384, 512, 8]" in outputs[1][0]
    assert prefill.FLEX_FALLBACKS == [(1, 6, 384, 512, 8)]


def test_flex_only_for_long_calls_on_auto():
    q = torch.zeros(1, prefill.FLEX_MIN_ROWS - 1, 2, 4)
    with kernels.use_backend(prefill="flex"):
        assert prefill.use_flex(q) == prefill.flex_available()
    with kernels.use_backend(prefill=None):
        assert not prefill.use_flex(q)  # CPU (and short on CUDA)


@pytest.mark.parametrize("policy", ["infllmv2", "nosa"])
def test_attention_groups_of_chunks_equal_one_group(policy, monkeypatch):
    """Selection runs per query chunk (16 rows here) and attention per CHUNKED_ATTENTION_ROWS rows;
    how the chunks are grouped for attention does not change the logits."""
    from forecastkv.modeling import attention

    model = tiny_model({"policy": policy}, seed=23)
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(24))
    outputs = []
    with torch.no_grad(), kernels.use_backend(prefill="chunked"):
        for rows in (1, 20, 10_000):  # every chunk alone, groups of 2 chunks (ragged end), one group
            monkeypatch.setattr(attention, "CHUNKED_ATTENTION_ROWS", rows)
            outputs.append(model(ids).logits)
    assert rel(outputs[0], outputs[2]) < 1e-5 and rel(outputs[1], outputs[2]) < 1e-5


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown prefill backend 'fast'"):
        with kernels.use_backend(prefill="fast"):
            pass


def load_benchmark(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("with_bias", [False, True])
def test_key_block_major_variant_matches_reference(with_bias):
    """The exact per-row alternative that benchmarks/prefill_variants.py times against the union
    path computes the same attention (padding rows, a row with no block, CIS bias)."""
    variants = load_benchmark("prefill_variants")
    case = random_case(5, with_bias=with_bias)
    assert rel(variants.key_block_major_attention(*case), reference(*case)) < 1e-5


def test_benchmark_comparison_runs_on_tiny_models():
    """benchmarks/prefill.py's comparison (what gpu_check runs at 32K / 128K on CUDA) works end to
    end on CPU with tiny models: same-weight dense and sparse models, one row per length."""
    bench = load_benchmark("prefill")
    dense = tiny_model(seed=31)
    sparse = tiny_model({"policy": "infllmv2"}, seed=31)
    sparse.load_state_dict(dense.state_dict(), strict=False)
    rows = bench.prefill_comparison(dense, sparse, (64, 96), vocab_size=128, repeats=1, warmup_length=32)
    assert [r["length"] for r in rows] == [64, 96]
    for row in rows:
        assert row["dense_s"] > 0 and row["sparse_s"] > 0 and row["speedup"] == row["dense_s"] / row["sparse_s"]
        # the breakdown names where each mode spent its time: selection and the chunked back end
        # for sparse on the CPU, dense attention alone for dense
        assert set(row["sparse_phases"]) == {"select", "sparse_attention", "other"}
        assert set(row["dense_phases"]) == {"dense_attention", "other"}
    from forecastkv.modeling import attention
    from forecastkv.selectors.base import Selector

    assert Selector.select.__name__ == "select"  # the timers were removed
    assert attention.chunked_sparse_attention.__name__ == "chunked_sparse_attention"


@pytest.mark.parametrize("policy", ["infllmv2", "nosa"])
def test_select_with_host_bounds_equals_reading_them(policy):
    """Prefill chunks hand `select` their position bounds and the stored length as host ints (no
    device read per chunk); the selection equals the one that reads them itself, padding included."""
    from forecastkv.modeling import selection as sel

    model = tiny_model({"policy": policy}, seed=25)
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(26))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    attn = model.model.layers[1].self_attn
    q = torch.randn(2, 10, attn.num_heads, attn.head_dim, generator=torch.Generator().manual_seed(27))
    positions = torch.arange(60, 70).repeat(2, 1)
    positions[1, :3] = -1
    for kind in ("query", "forecast"):
        vectors = q if kind == "query" else q[:, :, :: attn.group]  # forecast: one vector per KV head
        read = attn.select(vectors, positions, cache.layers[1], kind)
        given = attn.select(
            vectors, positions, cache.layers[1], kind, bounds=sel.position_range(positions), key_count=70
        )
        assert torch.equal(read, given)
        assert (read >= 0).any()


@pytest.mark.slow  # the model's prefill through the fused stage-1 kernel, end to end in the interpreter
@pytest.mark.parametrize("policy, selector", [("infllmv2", "query"), ("nosa", "forecast")])
def test_model_prefill_with_the_fused_stage1_kernel(policy, selector, monkeypatch):
    """The kernels backend forced to triton runs prefill stage 1 through the fused kernel (the
    interpreter here): the same selections, both selectors recorded, and the same logits."""
    from forecastkv.kernels._common import interpreting, triton_available

    if not (triton_available() and interpreting()):
        pytest.skip("needs triton's interpreter (TRITON_INTERPRET=1) on the CPU")
    model = tiny_model({"policy": policy, "selector": selector}, seed=61)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(62))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding
    out, launches = {}, []
    real = kernels.stage1_block_scores_triton
    monkeypatch.setattr(kernels, "stage1_block_scores_triton", lambda *a: launches.append(a[1].shape) or real(*a))
    # the kernel's tiles are STAGE1_QUERY_ROWS (2048) rows; 16 here, so rows are selected in 3 chunks
    monkeypatch.setattr(attention_module, "STAGE1_QUERY_ROWS", 16)
    with torch.no_grad():
        for backend in ("triton", "reference"):
            with kernels.use_backend(backend, prefill="chunked"):
                assert kernels.use_stage1_kernel("cpu") == (backend == "triton")
                out[backend] = model(ids, attention_mask=mask, collect_selections=True)
    # 3 chunks of 16 rows x 3 layers x 2 selectors, in the triton run only
    assert len(launches) == 18
    assert rel(out["triton"].logits, out["reference"].logits) < 1e-5
    for fused, eager in zip(out["triton"].selections, out["reference"].selections):
        assert fused.keys() == eager.keys() == {"selected", "query", "forecast"}
        for key in fused:
            assert torch.equal(fused[key], eager[key])
