"""selection.py against brute-force per-token references written with plain loops."""

import math

import pytest
import torch
import torch.nn.functional as F

from forecastkv.modeling import selection as sel
from forecastkv.modeling.configuration import SparseConfig, load_preset
from tests.helpers import TINY_SPARSE, tiny_model, tiny_sparse

INF = float("inf")


def compress_keys_incremental(tail: torch.Tensor, new_keys: torch.Tensor, kernel_size: int, kernel_stride: int):
    """Compression with a tail buffer of not-yet-compressed keys (how a cache extends its compressed
    keys piece by piece): tail [B, n_tail, H, d] from the first incomplete window on, new_keys
    [B, n, H, d] -> (the newly completed compressed keys [B, c_new, H, d], the new tail)."""
    keys = torch.cat([tail, new_keys], dim=1)
    compressed = sel.compress_keys(keys, kernel_size, kernel_stride)
    return compressed, keys[:, compressed.shape[1] * kernel_stride :]


# ---------------------------------------------------------------------------------------------
# brute-force references (plain Python loops over one sequence, one KV head, one query position)
# ---------------------------------------------------------------------------------------------


def ref_compress(keys, p, s):
    """keys [T, d] -> list of window means."""
    out, c = [], 0
    while c * s + p <= keys.shape[0]:
        out.append(keys[c * s : c * s + p].double().mean(0))
        c += 1
    return out


def ref_block_scores(c_scores, t, cfg, n_blocks):
    """c_scores: dict c -> score for visible c.  Returns a list of block scores with forcing."""
    p, s, bs = cfg.kernel_size, cfg.kernel_stride, cfg.block_size
    qb = t // bs
    blocks = []
    for j in range(n_blocks):
        overlapping = [c_scores[c] for c in c_scores if c * s < (j + 1) * bs and c * s + p > j * bs]
        score = max(overlapping) if overlapping else -INF
        if j < cfg.init_blocks or qb - cfg.local_blocks <= j <= qb:
            score = INF
        blocks.append(score)
    return blocks


def ref_topk(block_scores, t, k, bs):
    order = sorted(range(len(block_scores)), key=lambda j: (-block_scores[j], j))[:k]
    valid = sorted(j for j in order if j <= t // bs and block_scores[j] != -INF)
    return valid + [-1] * (k - len(valid))


def ref_stage1(queries, ckeys, t, cfg, lag=0, coarse=None):
    """queries [G, d] of one group, ckeys list of [d] -> dict c -> group-summed softmax prob."""
    p, s = cfg.kernel_size, cfg.kernel_stride
    visible = [c for c in range(len(ckeys)) if c * s + p - 1 + lag <= t]
    scores = {c: 0.0 for c in visible}
    d = queries.shape[-1]
    for q in queries.double():
        logits = {c: float(q @ ckeys[c]) / math.sqrt(d) for c in visible}
        if not logits:
            continue
        lse = math.log(sum(math.exp(v) for v in logits.values()))
        if coarse is not None:
            p2, s2 = cfg.coarse_kernel
            seen = [float(q @ coarse[c]) / math.sqrt(d) for c in range(len(coarse)) if c * s2 + p2 - 1 + lag <= t]
            if seen:
                lse = math.log(sum(math.exp(v) for v in seen))
        for c in visible:
            scores[c] += math.exp(logits[c] - lse)
    return scores


def ref_select(q, k, t, cfg, kind="query", lag=0, coarse=False):
    """q [Hq or H*n, d] one row; k [T, H, d] -> per KV head selection lists."""
    heads = k.shape[1]
    per = q.shape[0] // heads
    n_blocks = sel.num_blocks(t + 1, cfg.block_size)
    out = []
    for h in range(heads):
        ckeys = ref_compress(k[:, h], cfg.kernel_size, cfg.kernel_stride)
        coarse_keys = ref_compress(k[:, h], *cfg.coarse_kernel) if coarse else None
        vectors = q[h * per : (h + 1) * per]
        if kind == "forecast" and per == 1:
            c_scores = {
                c: float(vectors[0].double() @ ckeys[c])
                for c in range(len(ckeys))
                if c * cfg.kernel_stride + cfg.kernel_size - 1 + lag <= t
            }
        else:
            c_scores = ref_stage1(vectors, ckeys, t, cfg, lag, coarse_keys)
        blocks = ref_block_scores(c_scores, t, cfg, n_blocks)
        out.append(ref_topk(blocks, t, cfg.budget_blocks, cfg.block_size))
    return out


def run_select(q, k, positions, cfg, kind="query", lag=0, coarse=False):
    """Package path: q [B, Tq, Hq, d], k [B, T, H, d], positions [B, Tq]."""
    ckeys = sel.compress_keys(k, cfg.kernel_size, cfg.kernel_stride)
    lse_keys = sel.compress_keys(k, *cfg.coarse_kernel) if coarse else None
    n_blocks = sel.num_blocks(int(positions.max()) + 1, cfg.block_size)
    scores = sel.score_blocks(q, ckeys, positions, cfg, n_blocks, kind=kind, lag=lag, lse_keys=lse_keys)
    return sel.select_blocks(scores, positions, cfg)


GEOMETRIES = [
    SparseConfig(**TINY_SPARSE),
    SparseConfig(kernel_size=6, kernel_stride=2, block_size=4, init_blocks=2, window_size=4, topk=2, dense_len=0),
    SparseConfig(kernel_size=3, kernel_stride=3, block_size=6, init_blocks=0, window_size=0, topk=4, dense_len=0),
]


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [16, 21, 5])
def test_compress_batch_and_incremental_match_loops(length):
    torch.manual_seed(length)
    keys = torch.randn(2, length, 3, 8)
    batch = sel.compress_keys(keys, 4, 2)
    expected = [ref_compress(keys[b, :, h], 4, 2) for b in range(2) for h in range(3)]
    assert batch.shape[1] == len(expected[0]) == sel.num_compressed(length, 4, 2)
    for b in range(2):
        for h in range(3):
            for c, ref in enumerate(expected[b * 3 + h]):
                torch.testing.assert_close(batch[b, c, h].double(), ref, rtol=1e-6, atol=1e-6)
    # incremental, token by token and in uneven pieces
    tail, parts = keys[:, :0], []
    for start, stop in [(0, 1), (1, 4), (4, 5), (5, length)]:
        new, tail = compress_keys_incremental(tail, keys[:, start:stop], 4, 2)
        parts.append(new)
    torch.testing.assert_close(torch.cat(parts, 1), batch)
    assert tail.shape[1] < 4


@pytest.mark.parametrize("group", [1, 3, 16])
@pytest.mark.parametrize("length", [32, 37])
@pytest.mark.parametrize("geometry", range(len(GEOMETRIES)))
def test_query_selection_matches_brute_force_prefill(group, length, geometry):
    cfg = GEOMETRIES[geometry]
    torch.manual_seed(100 * group + length + geometry)
    heads, d = 2, 8
    q = torch.randn(2, length, heads * group, d)
    k = torch.randn(2, length, heads, d)
    positions = torch.arange(length).expand(2, -1)
    ids = run_select(q, k, positions, cfg)
    assert ids.shape == (2, heads, length, cfg.budget_blocks)
    for b in range(2):
        for t in range(length):
            expected = ref_select(q[b, t], k[b, : t + 1], t, cfg)
            for h in range(heads):
                assert ids[b, h, t].tolist() == expected[h], (b, h, t)


@pytest.mark.parametrize("group", [1, 3, 16])
def test_decode_rows_match_prefill_rows_and_brute_force(group):
    cfg = GEOMETRIES[0]
    torch.manual_seed(group)
    length, heads, d = 45, 2, 8
    q = torch.randn(2, length, heads * group, d)
    k = torch.randn(2, length, heads, d)
    prefill = run_select(q, k, torch.arange(length).expand(2, -1), cfg)
    for t in (20, 31, 44):
        decode = run_select(q[:, t : t + 1], k[:, : t + 1], torch.full((2, 1), t), cfg)
        assert torch.equal(decode[:, :, 0], prefill[:, :, t])
        for b in range(2):
            assert decode[b, :, 0].tolist() == ref_select(q[b, t], k[b, : t + 1], t, cfg)


@pytest.mark.parametrize("per_group", [1, 2])
def test_forecast_selection_matches_brute_force(per_group):
    cfg = GEOMETRIES[0]
    torch.manual_seed(7 + per_group)
    length, heads, d = 30, 2, 8
    f = torch.randn(1, length, heads * per_group, d)
    k = torch.randn(1, length, heads, d)
    ids = run_select(f, k, torch.arange(length).view(1, -1), cfg, kind="forecast", lag=1)
    for t in range(length):
        assert ids[0, :, t].tolist() == ref_select(f[0, t], k[0, : t + 1], t, cfg, kind="forecast", lag=1)


def test_coarse_lse_matches_brute_force():
    cfg = SparseConfig(
        kernel_size=2, kernel_stride=1, block_size=4, init_blocks=1, window_size=4, topk=3, dense_len=0, lse="coarse"
    )
    torch.manual_seed(3)
    length, heads, group, d = 30, 2, 3, 8
    q = torch.randn(1, length, heads * group, d) * 2
    k = torch.randn(1, length, heads, d)
    ids = run_select(q, k, torch.arange(length).view(1, -1), cfg, coarse=True)
    exact = run_select(q, k, torch.arange(length).view(1, -1), cfg, coarse=False)
    for t in range(length):
        assert ids[0, :, t].tolist() == ref_select(q[0, t], k[0, : t + 1], t, cfg, coarse=True)
    assert not torch.equal(ids, exact)  # the estimate does change choices on these inputs
    # a chunk whose every row sees a coarse key skips the exact LSE and chooses the same blocks
    p2, s2 = cfg.coarse_kernel
    late = torch.arange(p2 + 2, length).view(1, -1)
    assert sel.keys_seen(int(late.min()), length, p2, s2, 0) > 0
    assert torch.equal(run_select(q[:, late[0]], k, late, cfg, coarse=True), ids[:, :, late[0]])


def test_group_scores_equal_brute_force_values():
    cfg = GEOMETRIES[0]
    torch.manual_seed(11)
    q = torch.randn(1, 1, 6, 8)
    k = torch.randn(1, 20, 2, 8)
    ck = sel.compress_keys(k, cfg.kernel_size, cfg.kernel_stride)
    visible = sel.compressed_visibility(torch.tensor([[19]]), ck.shape[1], cfg.kernel_size, cfg.kernel_stride)
    scores = sel.group_softmax_scores(q, ck, visible)
    for h in range(2):
        expected = ref_stage1(q[0, 0, 3 * h : 3 * h + 3], ref_compress(k[0, :, h], 4, 2), 19, cfg)
        for c, value in expected.items():
            assert abs(scores[0, h, 0, c].item() - value) < 1e-5
        assert torch.isclose(scores[0, h, 0].sum(), torch.tensor(3.0))  # three heads, each sums to 1


def test_nosa_fill_matches_brute_force():
    cfg = SparseConfig(**tiny_sparse(topk=4, policy="nosa"))
    torch.manual_seed(5)
    length, heads, d = 60, 2, 8
    q = torch.randn(1, length, heads * 3, d)
    k = torch.randn(1, length, heads, d)
    cis = torch.randn(1, length, heads)
    positions = torch.arange(length).view(1, -1)
    ck = sel.compress_keys(k, 4, 2)
    n_blocks = sel.num_blocks(length, 8)
    scores = sel.score_blocks(q, ck, positions, cfg, n_blocks)
    agnostic = sel.agnostic_block_scores(cis, positions, cfg, n_blocks)
    ids = sel.select_blocks(scores, positions, cfg, agnostic)
    shortlist_k = cfg.init_blocks + cfg.local_blocks + cfg.query_blocks
    for t in range(length):
        for h in range(heads):
            c_scores = ref_stage1(q[0, t, 3 * h : 3 * h + 3], ref_compress(k[0, : t + 1, h], 4, 2), t, cfg)
            nb = sel.num_blocks(t + 1, 8)
            shortlist = [j for j in ref_topk(ref_block_scores(c_scores, t, cfg, nb), t, shortlist_k, 8) if j >= 0]
            cis_c = {
                c: v.item() for c, v in enumerate(ref_compress(cis[0, : t + 1, h : h + 1], 4, 2)) if c * 2 + 3 <= t
            }
            agn = ref_block_scores(cis_c, t, cfg, nb)
            agn = [INF if j in shortlist else (-INF if j > t // 8 else v) for j, v in enumerate(agn)]
            assert ids[0, h, t].tolist() == ref_topk(agn, t, cfg.budget_blocks, 8), (t, h)


def test_minicpm_preset_orderings():
    cfg = SparseConfig(**load_preset("minicpm4.1-8b")["sparse_config"])
    assert cfg.budget_blocks == 96 and cfg.local_blocks == 32
    # pooling geometry is MiniCPM's max_pool1d(kernel 5, stride 4, padding 1)
    assert sel.block_pool_geometry(32, 16, 64) == (5, 4, 1)
    torch.manual_seed(0)
    scores = torch.randn(2, 3, 61)
    n_blocks = 16
    expected = F.max_pool1d(scores, 5, 4, padding=1)[..., :n_blocks]
    torch.testing.assert_close(sel.pool_to_blocks(scores, n_blocks, 32, 16, 64)[..., : expected.shape[-1]], expected)
    # forced window is local_blocks + 1 blocks (plus the init block)
    t = 100 * 64 + 5
    forced = sel.forced_blocks(torch.tensor([[t]]), 120, 64, cfg.init_blocks, cfg.local_blocks)[0, 0]
    assert forced.nonzero().flatten().tolist() == [0] + list(range(100 - 32, 101))
    # future ids become -1 *after* the top-k: a future block that wins the top-k costs a slot
    block_scores = torch.full((1, 1, 1, 8), 0.5)
    block_scores[..., 6] = 9.0  # a future block with the best score
    ids = sel.topk_blocks(block_scores, torch.tensor([[4 * 64]]), 3, 64)
    assert ids.tolist() == [[[[0, 1, -1]]]]


def test_selection_handles_padding_rows_and_short_sequences():
    cfg = GEOMETRIES[0]
    q = torch.randn(1, 3, 6, 8)
    k = torch.randn(1, 3, 2, 8)
    ids = run_select(q, k, torch.tensor([[-1, 0, 2]]), cfg)
    assert (ids[0, :, 0] == -1).all()  # padding selects nothing
    assert ids[0, :, 1].tolist() == [[0, -1, -1, -1], [0, -1, -1, -1]]


def test_forecast_recall_counts_exclude_forced_blocks():
    cfg = SparseConfig(**TINY_SPARSE)
    positions = torch.tensor([[79]])  # qb = 9, forced = {0, 8, 9}
    query = torch.tensor([[[[0, 2, 4, 8, 9, -1]]]])
    forecast = torch.tensor([[[[0, 2, 5, 8, 9, -1]]]])
    hits, wanted, chance = sel.forecast_recall_counts(query, forecast, positions, cfg)
    assert wanted.item() == 2 and hits.item() == 1
    assert abs(chance.item() - 2 * 2 / 7) < 1e-6  # 7 free visible blocks (1..7), forecast picked 2


# ---------------------------------------------------------------------------------------------
# one visibility rule: training (teacher and student) sees exactly what deployed scoring scores
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_group", [1, 2])
def test_training_student_is_the_deployed_forecast_score(per_group):
    """The training student is a fixed function of the deployed forecast scores: softmax(score/sqrt(d))
    over the same keys for one vector per group, the group-summed score / n for n > 1.  A change of
    either side's visibility (or scoring) rule breaks the equality."""
    from forecastkv.training.objective import ObjectiveConfig, student_rows, teacher_rows

    cfg = GEOMETRIES[0]
    torch.manual_seed(11 + per_group)
    length, heads, d = 40, 2, 8
    f = torch.randn(1, length, heads * per_group, d)
    k = torch.randn(1, length, heads, d)
    ckeys = sel.compress_keys(k, cfg.kernel_size, cfg.kernel_stride)
    positions = torch.arange(length).view(1, -1)
    deployed = sel.key_scores(f, ckeys, positions, cfg, kind="forecast")  # what the runtime ranks
    student = student_rows(f, ckeys, positions, cfg)
    visible = torch.isfinite(deployed)
    assert torch.equal(student > 0, visible)
    # the boundary the issue names: the window ending at t is not visible, the one ending at t-1 is
    ends = torch.arange(ckeys.shape[1]) * cfg.kernel_stride + cfg.kernel_size - 1
    assert torch.equal(visible[0, 0], ends.view(1, -1) <= positions.view(-1, 1) - 1)
    if per_group == 1:
        expected = torch.softmax(deployed / math.sqrt(d), dim=-1).nan_to_num(0.0)
    else:
        expected = deployed.masked_fill(~visible, 0.0) / per_group
    rows = visible.any(-1)
    assert torch.allclose(student[rows], expected[rows], rtol=1e-5, atol=1e-7)
    # the teacher lives on the same keys, on the deployed grid and (aligned) from a fine grid
    q = torch.randn(1, length, heads * 3, d)
    for objective in (
        ObjectiveConfig(teacher_kernel=4, teacher_stride=2),
        ObjectiveConfig(teacher_kernel=2, teacher_stride=1),
    ):
        fine = sel.compress_keys(k, objective.teacher_kernel, objective.teacher_stride)
        teacher = teacher_rows(q, fine, positions, cfg, objective, ckeys.shape[1])
        assert not (teacher[~visible] != 0).any()
    # the deployed module path (SparseAttention.select) is layer_selection: test_module_select_is_layer_selection


@pytest.mark.parametrize("lse", ["exact", "coarse"])
@pytest.mark.parametrize("kind", ["query", "forecast"])
@pytest.mark.parametrize("policy", ["infllmv2", "nosa"])
def test_module_select_is_layer_selection(policy, kind, lse):
    """`SparseAttention.select` of a tiny model's attention module, reading a SparseCache layer that
    was filled incrementally (a left-padded prompt, then single-token steps), returns
    `layer_selection` of the raw keys compressed here (and the raw CIS), for prefill chunks (with
    and without the host bounds a prefill passes) and decode rows.  Positions a sequence never
    stored hold large random keys in the reference's buffer: a selection that saw them would differ.
    No local window (window_size 0), so that the windows ending at a row's own token, which only
    the forecast kind's lag hides, overlap a block that is not forced and can change the choice."""
    from forecastkv import SparseCache

    model = tiny_model(
        {"policy": policy, "lse": lse, "window_size": 0, "topk": 4, "query_blocks": 2}, heads_per_group=2
    )
    sparse, attn = model.config.sparse, model.model.layers[1].self_attn
    layer = SparseCache(model.config).layers[1]
    heads, d = attn.num_kv_heads, attn.head_dim
    width = attn.num_heads if kind == "query" else heads * 2
    gen = torch.Generator().manual_seed(17)
    lengths, steps, pad = [45, 30], 6, [0, 15]  # the steps cross a block boundary in both rows
    total = max(lengths) + steps
    keys = torch.randn(2, total, heads, d, generator=gen) * 3  # by position; unstored ones stay as garbage
    cis = torch.randn(2, total, heads, generator=gen)
    for b, n in enumerate(lengths):
        keys[b, n + steps :] = 100 * torch.randn(total - n - steps, heads, d, generator=gen)
        cis[b, n + steps :] = 100.0
    prompt = torch.arange(max(lengths)).expand(2, -1) - torch.tensor(pad).view(-1, 1)  # [2, 45], -1 = padding
    prompt = prompt.masked_fill(prompt < 0, -1)
    columns = prompt.clamp(min=0)
    gather = lambda x, pos: x[torch.arange(2).view(-1, 1), pos]  # noqa: E731
    values = torch.randn(2, prompt.shape[1], heads, d, generator=gen)
    layer.append(gather(keys, columns), values, gather(cis, columns) if policy == "nosa" else None, prompt)

    def reference(vectors, positions):
        ckeys = sel.compress_keys(keys, sparse.kernel_size, sparse.kernel_stride)
        coarse = sel.compress_keys(keys, *sparse.coarse_kernel) if lse == "coarse" else None
        ids = sel.layer_selection(
            vectors, ckeys, positions, sparse, kind, lse_keys=coarse, cis=cis if policy == "nosa" else None
        )
        if policy == "infllmv2" and lse == "exact":  # and layer_selection is the brute force (the forecast kind: lag 1)
            for b, t in ((b, t) for b in range(2) for t in range(positions.shape[1]) if positions[b, t] >= 0):
                pos = int(positions[b, t])
                expected = ref_select(vectors[b, t], keys[b, : pos + 1], pos, sparse, kind, lag=int(kind == "forecast"))
                assert ids[b, :, t].tolist() == expected, (b, pos)
        return ids

    for rows in (slice(0, 16), slice(16, 32), slice(32, 45)):  # prefill chunks: padding rows in the first
        positions = prompt[:, rows]
        vectors = torch.randn(2, positions.shape[1], width, d, generator=gen)
        expected = reference(vectors, positions)
        assert expected.shape == (2, heads, positions.shape[1], sparse.budget_blocks)
        assert torch.equal(attn.select(vectors, positions, layer, kind), expected), rows
        host = {"bounds": sel.position_range(positions), "key_count": int(layer.lengths.max())}
        assert torch.equal(attn.select(vectors, positions, layer, kind, **host), expected), rows
    for step in range(steps):  # decode rows after single-token appends
        positions = (torch.tensor(lengths) + step).view(-1, 1)
        one = gather(keys, positions)
        layer.append(
            one,
            torch.randn(2, 1, heads, d, generator=gen),
            gather(cis, positions) if policy == "nosa" else None,
            positions,
        )
        vectors = torch.randn(2, 1, width, d, generator=gen)
        assert torch.equal(attn.select(vectors, positions, layer, kind), reference(vectors, positions)), step


def test_recall_protocol_counts_rows_from_start_and_summarises_layers():
    cfg = SparseConfig(**TINY_SPARSE)
    positions = torch.tensor([[40, 79]])  # qb = 5 (forced 0, 4, 5) and qb = 9 (forced 0, 8, 9)
    query = torch.tensor([[[[0, 1, 2, 4, 5, -1], [0, 2, 4, 8, 9, -1]]]])
    forecast = torch.tensor([[[[0, 1, 3, 4, 5, -1], [0, 2, 5, 8, 9, -1]]]])
    every = sel.recall_row_sums(query, forecast, positions, cfg, start=0)
    late = sel.recall_row_sums(query, forecast, positions, cfg, start=41)
    assert every.tolist()[:2] == [2.0, 4.0] and late.tolist()[:2] == [1.0, 2.0]
    assert abs(late[2].item() - 2 * 2 / 7) < 1e-6  # 7 free visible blocks at t = 79 (fp32 counts)
    counts = torch.tensor([[5.0, 5.0, 1.0], [1.0, 2.0, 0.5], [2.0, 2.0, 1.0]], dtype=torch.float64)
    report = sel.summarise_recall(counts, start=41, length=80, rows=1, backbone="dense")
    assert report.recall == [1.0, 0.5, 1.0] and report.mean_recall == 0.75  # layer 0 left out
    assert report.chance == [0.2, 0.25, 0.5] and report.mean_chance == 0.375
    assert "| mean (>= 1) | 0.750 | 0.375 |" in report.table()


def test_descending_order_is_the_stable_sort_order():
    """The top-k over packed keys equals a stable descending sort's prefix, ties to the lower id,
    with +-inf, -0.0 against 0.0, negatives and many exact ties (max-pooled neighbours tie)."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(-3, 4, (5, 7, 40), generator=gen).float() / 2
    scores[0, 0, :5] = torch.tensor([-0.0, 0.0, INF, -INF, -0.0])
    scores[1, :, ::3] = INF
    scores[2, :, ::2] = -INF
    scores[3] = torch.randn(7, 40, generator=gen) * 1e30
    for take in (1, 6, 40):
        expected = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :take]
        assert torch.equal(sel.descending_order(scores, take), expected)


def test_keys_seen_bounds_the_visibility_mask():
    """Keys past what the latest row sees are invisible to every row; keys the earliest row sees
    are visible to every row; a padding row sees none."""
    p, s, lag, count = 32, 16, 1, 40
    for positions in (torch.tensor([[100, 101, 300, 47]]), torch.tensor([[-1, 200, 640]]), torch.tensor([[5, 6]])):
        first, last = sel.position_range(positions)
        assert (first, last) == (int(positions.min()), int(positions.max()))
        lo, hi = sel.keys_seen(first, count, p, s, lag), sel.keys_seen(last, count, p, s, lag)
        visible = sel.compressed_visibility(positions, count, p, s, lag)
        assert not visible[..., hi:].any() and (hi == 0 or visible[..., hi - 1].any())
        assert visible[..., :lo].all()
        assert lo == 0 or not visible[..., lo].all()
        for t in positions.flatten().tolist():
            assert sel.keys_seen(t, count, p, s, lag) == int(
                sel.compressed_visibility(torch.tensor([[t]]), count, p, s, lag).sum()
            )


def test_pool_to_blocks_edges():
    """Blocks past the scored keys are -inf; no blocks or no rows give empty results of the right shape."""
    scores = torch.arange(12.0).view(1, 2, 6)  # 6 compressed keys of stride 16 reach block 1
    pooled = sel.pool_to_blocks(scores, 4, 32, 16, 64)
    assert pooled[..., :2].tolist() == [[[3.0, 5.0], [9.0, 11.0]]]  # block 0: keys 0-3, block 1: keys 3-7
    assert torch.isneginf(pooled[..., 2:]).all()
    assert sel.pool_to_blocks(scores, 0, 32, 16, 64).shape == (1, 2, 0)
    assert sel.pool_to_blocks(scores[:, :0], 3, 32, 16, 64).shape == (1, 0, 3)
    assert torch.isneginf(sel.pool_to_blocks(scores[..., :0], 2, 32, 16, 64)).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensor_core_logits_equal_fp32(dtype):
    """On CUDA, half-precision queries and keys are scored by a tensor-core matmul with fp32
    output: the same stage-1 scores as the fp32 upcast (summation order aside), exact and coarse LSE."""
    cfg = SparseConfig(**tiny_sparse(lse="coarse"))
    torch.manual_seed(5)
    q = torch.randn(2, 40, 6, 16).to(dtype)
    k = torch.randn(2, 64, 2, 16).to(dtype)
    positions = torch.arange(24, 64).repeat(2, 1)
    ckeys, lse_keys = sel.compress_keys(k, 4, 2), sel.compress_keys(k, *cfg.coarse_kernel)
    n_blocks = sel.num_blocks(64, 8)
    assert sel._BMM_FP32_OUT  # this torch has bmm(out_dtype=fp32): `_head_logits` takes the tensor-core path
    for coarse in (None, lse_keys):
        on_cpu = sel.score_blocks(
            q.float(), ckeys.float(), positions, cfg, n_blocks, lse_keys=None if coarse is None else coarse.float()
        )
        on_gpu = sel.score_blocks(
            q.cuda(), ckeys.cuda(), positions.cuda(), cfg, n_blocks, lse_keys=None if coarse is None else coarse.cuda()
        )
        torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=1e-5, atol=1e-6)
