"""The oracle and Quest ops (`forecastkv/selectors/oracle.py`, `quest.py`), top-p budgets and recall
against plain-loop references of each rule.

Every reference below loops over batch, KV head, query row and block with Python floats (or fp64
scalars), with no vectorised shortcut, so it states the rule the way its paper does.
"""

import itertools
import math

import pytest
import torch

from forecastkv.modeling.selection import block_mass, force_blocks, selection_recall, top_p_blocks, topk_blocks
from forecastkv.selectors.oracle import oracle_block_mass, oracle_blocks
from forecastkv.selectors.quest import block_key_bounds, quest_block_scores
from tests.strict_device import count_host_reads

INF = math.inf
BLOCK = 4
# B = 2 with unequal positions, Tq = 4 rows at different positions; -1 = padding; 2 sees no complete block
POSITIONS = torch.tensor([[0, 5, 13, 22], [-1, 9, 17, 2]])
N_KEYS = 23  # the last block (keys 20..22) is incomplete
N_BLOCKS = 6  # ceil(23 / 4)


def make_qk(heads, group, dim=8, key_dtype=torch.float32, seed=0):
    """q [2, 4, heads*group, dim] fp32, keys [2, N_KEYS, heads, dim] in key_dtype."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, POSITIONS.shape[1], heads * group, dim, generator=gen)
    keys = torch.randn(2, N_KEYS, heads, dim, generator=gen).to(key_dtype)
    return q, keys


def row_blocks(t):
    """The row's visible blocks (j <= t // bs, and j < N_BLOCKS); none for padding."""
    return list(range(min(t // BLOCK + 1, N_BLOCKS))) if t >= 0 else []


def row_list(ids_row):
    return [int(j) for j in ids_row]


# ---------------------------------------------------------------------------------------------
# plain-loop references
# ---------------------------------------------------------------------------------------------


def ref_oracle_mass(q, keys, positions, bs, n_blocks):
    """Per query head the exact softmax over keys s <= t, summed per block, averaged over the group."""
    batch, rows, heads_q, dim = q.shape
    length, heads = keys.shape[1], keys.shape[2]
    group = heads_q // heads
    out = torch.zeros(batch, heads, rows, n_blocks, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for r in range(rows):
                t = int(positions[b, r])
                if t < 0:
                    continue
                for i in range(group):
                    head = h * group + i
                    logits = []
                    for s in range(min(t + 1, length)):
                        dot = sum(float(q[b, r, head, c]) * float(keys[b, s, h, c]) for c in range(dim))
                        logits.append(dot / math.sqrt(dim))
                    peak = max(logits)
                    total = sum(math.exp(x - peak) for x in logits)
                    for s, x in enumerate(logits):
                        if s // bs < n_blocks:
                            out[b, h, r, s // bs] += math.exp(x - peak) / total / group
    return out


def ref_bounds(keys, bs):
    batch, length, heads, dim = keys.shape
    complete = length // bs
    lo = torch.empty(batch, complete, heads, dim, dtype=keys.dtype)
    hi = torch.empty_like(lo)
    for b in range(batch):
        for j in range(complete):
            for h in range(heads):
                for c in range(dim):
                    values = [keys[b, j * bs + s, h, c] for s in range(bs)]
                    lo[b, j, h, c] = min(values)
                    hi[b, j, h, c] = max(values)
    return lo, hi


def ref_quest(q, lo, hi, positions, bs, n_blocks):
    """Quest's upper bound per query head, softmaxed over the complete blocks, summed per group."""
    batch, rows, heads_q, dim = q.shape
    complete, heads = lo.shape[1], lo.shape[2]
    group = heads_q // heads
    out = torch.full((batch, heads, rows, n_blocks), -INF, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for r in range(rows):
                t = int(positions[b, r])
                scoreable = [j for j in range(complete) if (j + 1) * bs - 1 <= t]  # the softmax's blocks
                if not scoreable:
                    continue
                for j in scoreable:
                    if j < n_blocks:
                        out[b, h, r, j] = 0.0
                for i in range(group):
                    head = h * group + i
                    upper = {}
                    for j in scoreable:
                        total = 0.0
                        for c in range(dim):
                            qc = float(q[b, r, head, c])
                            total += max(qc * float(lo[b, j, h, c]), qc * float(hi[b, j, h, c]))
                        upper[j] = total / math.sqrt(dim)
                    peak = max(upper.values())
                    norm = sum(math.exp(u - peak) for u in upper.values())
                    for j in scoreable:
                        if j < n_blocks:
                            out[b, h, r, j] += math.exp(upper[j] - peak) / norm
    return out


def ref_row_mass(scores, logits):
    """{block: mass} of the finite entries of one row's scores (a list of floats)."""
    finite = [j for j, x in enumerate(scores) if math.isfinite(x)]
    if logits:
        peak = max((scores[j] for j in finite), default=0.0)
        weights = {j: math.exp(scores[j] - peak) for j in finite}
    else:
        weights = {j: max(scores[j], 0.0) for j in finite}
    total = sum(weights.values())
    return {j: (w / total if total > 0 else 0.0) for j, w in weights.items()}


def ref_top_p(scores, t, p, cap, bs, logits):
    """Twilight's rule on one row: forced blocks, then by descending score until the mass reaches p."""
    visible = [x if j <= t // bs else -INF for j, x in enumerate(scores)]  # t = -1: nothing visible
    forced = [j for j, x in enumerate(visible) if x == INF]
    mass = ref_row_mass(visible, logits)
    taken = forced[:cap]
    held = 0.0
    for j in sorted(mass, key=lambda j: (-visible[j], j)):
        if len(taken) >= cap or mass[j] <= 0 or (p < 1 and held >= p):
            break
        taken.append(j)
        held += mass[j]
    return sorted(taken) + [-1] * (cap - len(taken))


def ref_recall(ids_row, mass_row, oracle_row):
    chosen = {j for j in ids_row if j >= 0}
    best = {j for j in oracle_row if j >= 0}
    best_mass = sum(mass_row[j] for j in best)
    mass_recall = sum(mass_row[j] for j in chosen) / best_mass if best_mass > 0 else 1.0
    overlap = len(chosen & best) / len(best) if best else 1.0
    return mass_recall, overlap


def block_scores(heads, seed, init=1, local=1, ties=False, signed=False, hidden_share=0.2):
    """Random block scores as `selection.score_blocks` gives them: [2, heads, 4, N_BLOCKS], future
    and a share of visible blocks -inf, init and local blocks +inf (init may lie in the future)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(2, heads, POSITIONS.shape[1], N_BLOCKS, generator=gen)
    raw = (raw * 2).round() / 2 if ties else raw
    raw = raw if signed else raw.abs()
    raw = raw.masked_fill(torch.rand(raw.shape, generator=gen) < hidden_share, -INF)
    return force_blocks(raw.masked_fill(future_blocks(), -INF), POSITIONS, BLOCK, init, local)


def future_blocks():
    """bool [2, 1, 4, N_BLOCKS]: block j lies past the row's own block (every block for padding)."""
    return (
        torch.arange(N_BLOCKS).view(1, 1, 1, -1) > torch.div(POSITIONS, BLOCK, rounding_mode="floor")[:, None, :, None]
    )


def each_row(tensor):
    """(b, h, r) over the leading [B, H, Tq] dims."""
    return itertools.product(*(range(n) for n in tensor.shape[:3]))


# ---------------------------------------------------------------------------------------------
# oracle
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16])
def test_oracle_mass_equals_the_loop(group, key_dtype):
    q, keys = make_qk(heads=2, group=group, key_dtype=key_dtype)
    mass = oracle_block_mass(q, keys, POSITIONS, BLOCK, N_BLOCKS)
    assert mass.dtype == torch.float32 and mass.shape == (2, 2, 4, N_BLOCKS)
    torch.testing.assert_close(
        mass.double(), ref_oracle_mass(q, keys, POSITIONS, BLOCK, N_BLOCKS), atol=1e-6, rtol=1e-5
    )
    sums = mass.sum(-1)
    valid = (POSITIONS >= 0)[:, None].expand_as(sums)
    torch.testing.assert_close(sums[valid], torch.ones_like(sums[valid]))
    assert (mass[1, :, 0] == 0).all()  # the padding row
    for b, h, r in each_row(mass):  # blocks in the row's future hold nothing
        t = int(POSITIONS[b, r])
        assert all(float(mass[b, h, r, j]) == 0.0 for j in range(N_BLOCKS) if j not in row_blocks(t))


def test_oracle_mass_with_fewer_blocks_drops_the_rest():
    q, keys = make_qk(heads=1, group=2)
    full = oracle_block_mass(q, keys, POSITIONS, BLOCK, N_BLOCKS)
    torch.testing.assert_close(oracle_block_mass(q, keys, POSITIONS, BLOCK, 3), full[..., :3])
    wide = oracle_block_mass(q, keys, POSITIONS, BLOCK, N_BLOCKS + 2)
    torch.testing.assert_close(wide[..., :N_BLOCKS], full)
    assert (wide[..., N_BLOCKS:] == 0).all()


@pytest.mark.parametrize("k", [1, 2, 3, 6, 8])
def test_oracle_blocks_hold_the_most_mass_of_any_k_subset(k):
    q, keys = make_qk(heads=2, group=3, seed=1)
    mass = oracle_block_mass(q, keys, POSITIONS, BLOCK, N_BLOCKS)
    ids = oracle_blocks(mass, POSITIONS, k, BLOCK)
    assert ids.dtype == torch.int64 and ids.shape == (2, 2, 4, k)
    for b, h, r in each_row(ids):
        visible = row_blocks(int(POSITIONS[b, r]))
        size = min(k, len(visible))
        row = row_list(ids[b, h, r])
        picked = [j for j in row if j >= 0]
        assert row == picked + [-1] * (k - len(picked)) and picked == sorted(picked)  # canonical
        assert len(picked) == size and set(picked) <= set(visible)
        values = [float(mass[b, h, r, j]) for j in range(N_BLOCKS)]
        best = max(sum(values[j] for j in subset) for subset in itertools.combinations(visible, size))
        assert sum(values[j] for j in picked) == pytest.approx(best, abs=1e-7)


def test_oracle_blocks_break_ties_to_the_lower_id():
    mass = torch.tensor([0.25, 0.25, 0.1, 0.25, 0.15]).view(1, 1, 1, -1)
    ids = oracle_blocks(mass, torch.tensor([[19]]), 2, BLOCK)
    assert row_list(ids[0, 0, 0]) == [0, 1]
    # a block past the row's own block never competes, whatever its mass
    ids = oracle_blocks(torch.tensor([0.1, 0.2, 0.9]).view(1, 1, 1, -1), torch.tensor([[5]]), 2, BLOCK)
    assert row_list(ids[0, 0, 0]) == [0, 1]


@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_oracle_recall_is_one_and_no_other_k_subset_beats_it(k):
    q, keys = make_qk(heads=2, group=1, seed=2)
    mass = oracle_block_mass(q, keys, POSITIONS, BLOCK, N_BLOCKS)
    oracle = oracle_blocks(mass, POSITIONS, k, BLOCK)
    mass_recall, overlap = selection_recall(oracle, mass, oracle)
    assert (mass_recall == 1).all() and (overlap == 1).all()
    for b, h, r in each_row(oracle):  # brute force: every other k-subset's recall is at most 1
        visible = row_blocks(int(POSITIONS[b, r]))
        for subset in itertools.combinations(visible, min(k, len(visible))):
            other = torch.tensor(list(subset) + [-1] * (k - len(subset))).view(1, 1, 1, -1)
            held, _ = selection_recall(
                other, mass[b : b + 1, h : h + 1, r : r + 1], oracle[b : b + 1, h : h + 1, r : r + 1]
            )
            assert float(held) <= 1 + 1e-6


# ---------------------------------------------------------------------------------------------
# Quest
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [N_KEYS, 8, 3])
def test_block_key_bounds_equal_the_loop(dtype, length):
    _, keys = make_qk(heads=2, group=1, key_dtype=dtype)
    keys = keys[:, :length]
    lo, hi = block_key_bounds(keys, BLOCK)
    assert lo.dtype == dtype and lo.shape == (2, length // BLOCK, 2, 8)
    ref_lo, ref_hi = ref_bounds(keys, BLOCK)
    assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16])
def test_quest_scores_equal_the_loop(group, key_dtype):
    q, keys = make_qk(heads=2, group=group, key_dtype=key_dtype, seed=3)
    lo, hi = block_key_bounds(keys, BLOCK)
    scores = quest_block_scores(q, lo, hi, POSITIONS, BLOCK, N_BLOCKS)
    assert scores.dtype == torch.float32 and scores.shape == (2, 2, 4, N_BLOCKS)
    assert not scores.isnan().any()
    ref = ref_quest(q, lo, hi, POSITIONS, BLOCK, N_BLOCKS)
    assert torch.equal(scores == -INF, ref == -INF)
    finite = ref > -INF
    torch.testing.assert_close(scores.double()[finite], ref[finite], atol=1e-6, rtol=1e-5)
    # the padding row and the row at t = 2 (no complete block) score nothing; t = 22 scores blocks 0..4
    assert (scores[1, :, 0] == -INF).all() and (scores[1, :, 3] == -INF).all()
    assert torch.isfinite(scores[0, :, 3, :5]).all() and (scores[0, :, 3, 5] == -INF).all()
    torch.testing.assert_close(scores[0, :, 3, :5].sum(-1), torch.full((2,), float(group)))


def test_quest_upper_bound_is_at_least_every_key_in_the_block():
    """Quest's premise, on the bounds: sum_c max(q_c lo_c, q_c hi_c) is never below q.k of a key in the block."""
    q, keys = make_qk(heads=1, group=1, seed=4)
    lo, hi = block_key_bounds(keys, BLOCK)
    for b in range(2):
        for j in range(lo.shape[1]):
            bound = sum(
                max(float(q[b, 0, 0, c] * lo[b, j, 0, c]), float(q[b, 0, 0, c] * hi[b, j, 0, c])) for c in range(8)
            )
            for s in range(j * BLOCK, (j + 1) * BLOCK):
                assert float(q[b, 0, 0] @ keys[b, s, 0]) <= bound + 1e-5


def test_quest_scores_pad_or_cut_to_n_blocks():
    q, keys = make_qk(heads=2, group=2)
    lo, hi = block_key_bounds(keys, BLOCK)
    full = quest_block_scores(q, lo, hi, POSITIONS, BLOCK, N_BLOCKS)
    assert torch.equal(quest_block_scores(q, lo, hi, POSITIONS, BLOCK, 2), full[..., :2])
    torch.testing.assert_close(
        quest_block_scores(q, lo, hi, POSITIONS, BLOCK, 2).double(), ref_quest(q, lo, hi, POSITIONS, BLOCK, 2)
    )
    wide = quest_block_scores(q, lo, hi, POSITIONS, BLOCK, N_BLOCKS + 3)
    assert torch.equal(wide[..., :N_BLOCKS], full) and (wide[..., N_BLOCKS:] == -INF).all()


def test_oracle_rejects_mismatched_shapes():
    q, keys = make_qk(heads=2, group=2)
    with pytest.raises(ValueError, match="batch or head dim"):
        oracle_block_mass(q[..., :4], keys, POSITIONS, BLOCK, N_BLOCKS)
    with pytest.raises(ValueError, match="4-d"):
        oracle_block_mass(q[0], keys, POSITIONS, BLOCK, N_BLOCKS)


def test_quest_rejects_mismatched_heads():
    q, keys = make_qk(heads=2, group=2)
    lo, hi = block_key_bounds(keys, BLOCK)
    with pytest.raises(ValueError, match="not a multiple of the 2 KV heads"):
        quest_block_scores(q[:, :, :3], lo, hi, POSITIONS, BLOCK, N_BLOCKS)
    with pytest.raises(ValueError, match="positions"):
        quest_block_scores(q, lo, hi, POSITIONS[:, :2], BLOCK, N_BLOCKS)
    with pytest.raises(ValueError, match="same shape"):
        quest_block_scores(q, lo, hi[:, :2], POSITIONS, BLOCK, N_BLOCKS)


# ---------------------------------------------------------------------------------------------
# top-p budgets
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("logits", [True, False])
def test_block_mass_equals_the_loop(logits):
    scores = block_scores(heads=2, seed=5, signed=logits)
    mass = block_mass(scores, logits)
    for b, h, r in each_row(mass):
        ref = ref_row_mass([float(x) for x in scores[b, h, r]], logits)
        for j in range(N_BLOCKS):
            assert float(mass[b, h, r, j]) == pytest.approx(ref.get(j, 0.0), abs=1e-6)


def test_block_mass_clamps_negatives_and_leaves_empty_rows_at_zero():
    scores = torch.tensor([[INF, -1.0, 3.0, 1.0, -INF], [INF, -2.0, -1.0, -INF, INF], [-INF] * 5]).view(1, 1, 3, 5)
    mass = block_mass(scores, logits=False)
    torch.testing.assert_close(mass[0, 0], torch.tensor([[0, 0, 0.75, 0.25, 0], [0.0] * 5, [0.0] * 5]))
    soft = block_mass(scores, logits=True)
    assert not soft.isnan().any() and (soft[0, 0, 2] == 0).all()
    torch.testing.assert_close(soft[0, 0, 1, 1:3], torch.tensor([-2.0, -1.0]).softmax(-1))


@pytest.mark.parametrize("logits", [True, False])
@pytest.mark.parametrize("p", [0.3, 0.8, 0.95, 1.0])
@pytest.mark.parametrize("cap", [1, 3, 5, 8])
@pytest.mark.parametrize("ties", [False, True])
def test_top_p_equals_the_loop(logits, p, cap, ties):
    scores = block_scores(heads=2, seed=6, ties=ties, signed=True)  # negatives: clamped when not logits
    ids = top_p_blocks(scores, POSITIONS, p, cap, BLOCK, logits)
    assert ids.dtype == torch.int64 and ids.shape == (2, 2, 4, cap)
    for b, h, r in each_row(ids):
        expected = ref_top_p([float(x) for x in scores[b, h, r]], int(POSITIONS[b, r]), p, cap, BLOCK, logits)
        assert row_list(ids[b, h, r]) == expected, (b, h, r)


@pytest.mark.parametrize("logits", [True, False])
@pytest.mark.parametrize("p", [0.5, 0.9, 1.0])
@pytest.mark.parametrize("cap", [2, 4, 8])
def test_top_p_reaches_p_with_the_fewest_blocks(logits, p, cap):
    scores = block_scores(heads=3, seed=7, init=2, local=0, signed=logits, hidden_share=0.1)
    ids = top_p_blocks(scores, POSITIONS, p, cap, BLOCK, logits)
    mass = block_mass(scores.masked_fill(future_blocks(), -INF), logits)  # init blocks may lie ahead
    for b, h, r in each_row(ids):
        t = int(POSITIONS[b, r])
        picked = [j for j in row_list(ids[b, h, r]) if j >= 0]
        forced = [j for j in row_blocks(t) if float(scores[b, h, r, j]) == INF]
        assert set(forced[:cap]) <= set(picked)  # forced kept (the lower ids past the cap)
        assert len(picked) <= cap
        chosen = [j for j in picked if j not in forced]
        held = sum(float(mass[b, h, r, j]) for j in chosen)
        total = sum(float(mass[b, h, r, j]) for j in range(N_BLOCKS))
        if len(picked) < cap and total > 0:  # the cap allowed more: the mass reached p
            assert held >= p - 1e-5
        if chosen and p < 1:  # dropping the last (lowest-scoring) pick falls below p
            last = min(chosen, key=lambda j: (float(scores[b, h, r, j]), -j))
            assert held - float(mass[b, h, r, last]) < p
        if p == 1 and len(picked) < cap:  # every positive-mass block
            assert set(chosen) == {j for j in range(N_BLOCKS) if float(mass[b, h, r, j]) > 0}


def test_top_p_keeps_the_lower_forced_ids_when_they_exceed_the_cap():
    scores = torch.tensor([INF, 0.9, INF, INF, 0.5, INF]).view(1, 1, 1, -1)
    ids = top_p_blocks(scores, torch.tensor([[23]]), 0.9, 2, BLOCK, logits=False)
    assert row_list(ids[0, 0, 0]) == [0, 2]
    ids = top_p_blocks(scores, torch.tensor([[23]]), 0.5, 6, BLOCK, logits=False)
    assert row_list(ids[0, 0, 0]) == [0, 1, 2, 3, 5, -1]  # 0.9 / 1.4 >= 0.5: block 1 crosses alone


def test_top_p_stops_once_the_mass_equals_p():
    scores = torch.tensor([0.25, 0.5, 0.25]).view(1, 1, 1, -1)  # masses exact in binary
    for p, expected in ((0.5, [1, -1, -1]), (0.75, [0, 1, -1]), (0.7, [0, 1, -1]), (1.0, [0, 1, 2])):
        ids = top_p_blocks(scores, torch.tensor([[11]]), p, 3, BLOCK, logits=False)
        assert row_list(ids[0, 0, 0]) == expected, p
    # p = 1 takes a positive mass too small to move the fp32 cumulative sum off 1
    tiny = top_p_blocks(
        torch.tensor([1.0, 1e-9]).view(1, 1, 1, -1), torch.tensor([[7]]), 1.0, 2, BLOCK, False
    )
    assert row_list(tiny[0, 0, 0]) == [0, 1]


def test_top_p_edges_single_block_padding_and_no_mass():
    one = top_p_blocks(torch.tensor([0.4]).view(1, 1, 1, 1), torch.tensor([[2]]), 1.0, 3, BLOCK, logits=False)
    assert row_list(one[0, 0, 0]) == [0, -1, -1]
    # a padding row, a row with only forced blocks, and one whose non-forced scores are all <= 0
    scores = torch.tensor([[INF, 0.7, 0.3], [INF, -INF, INF], [INF, -0.5, 0.0]]).view(1, 1, 3, 3)
    ids = top_p_blocks(scores, torch.tensor([[-1, 11, 11]]), 0.9, 3, BLOCK, logits=False)
    assert [row_list(row) for row in ids[0, 0]] == [[-1, -1, -1], [0, 2, -1], [0, -1, -1]]


def test_top_p_ignores_forced_and_scored_blocks_in_the_future():
    scores = torch.tensor([INF, INF, 0.6, 0.9]).view(1, 1, 1, -1)  # the row is in block 0
    ids = top_p_blocks(scores, torch.tensor([[2]]), 1.0, 4, BLOCK, logits=True)
    assert row_list(ids[0, 0, 0]) == [0, -1, -1, -1]


@pytest.mark.parametrize("p", [0.0, -0.1, 1.01, math.nan])
def test_top_p_rejects_p_outside_zero_one(p):
    with pytest.raises(ValueError, match=f"p = {p}"):
        top_p_blocks(block_scores(1, seed=0), POSITIONS, p, 4, BLOCK, logits=False)


def test_top_p_rejects_a_cap_below_one():
    with pytest.raises(ValueError, match="cap = 0"):
        top_p_blocks(block_scores(1, seed=0), POSITIONS, 0.9, 0, BLOCK, logits=False)


def test_top_p_is_fixed_shape_and_reads_nothing_back():
    scores = block_scores(heads=2, seed=8)
    with count_host_reads() as counter:
        shapes = {
            top_p_blocks(scores, POSITIONS, p, 5, BLOCK, logits).shape
            for p in (0.1, 0.9, 1.0)
            for logits in (True, False)
        }
    assert shapes == {torch.Size([2, 2, 4, 5])}
    assert counter.reads == 0, counter.report()


# ---------------------------------------------------------------------------------------------
# recall against the oracle
# ---------------------------------------------------------------------------------------------


def test_selection_recall_equals_the_loop():
    q, keys = make_qk(heads=2, group=3, seed=9)
    mass = oracle_block_mass(q, keys, POSITIONS, BLOCK, N_BLOCKS)
    oracle = oracle_blocks(mass, POSITIONS, 3, BLOCK)
    ids = topk_blocks(block_scores(heads=2, seed=10), POSITIONS, 4, BLOCK)
    mass_recall, overlap = selection_recall(ids, mass, oracle)
    assert mass_recall.dtype == overlap.dtype == torch.float32 and mass_recall.shape == (2, 2, 4)
    for b, h, r in each_row(ids):
        ref_mass, ref_overlap = ref_recall(
            row_list(ids[b, h, r]), [float(x) for x in mass[b, h, r]], row_list(oracle[b, h, r])
        )
        assert float(mass_recall[b, h, r]) == pytest.approx(ref_mass, rel=1e-6)
        assert float(overlap[b, h, r]) == pytest.approx(ref_overlap, rel=1e-6)
    assert (mass_recall[1, :, 0] == 1).all() and (overlap[1, :, 0] == 1).all()  # the padding row: no oracle
    assert (overlap < 1).any() and (mass_recall < 1).any()  # the fixture does test a miss


def test_selection_recall_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="leading"):
        selection_recall(
            torch.zeros(1, 1, 2, 3, dtype=torch.long), torch.ones(1, 1, 3, 4), torch.zeros(1, 1, 3, 2, dtype=torch.long)
        )


@pytest.mark.parametrize("group", [1, 3])
def test_every_selection_recalls_everything_at_a_budget_of_all_blocks(group):
    q, keys = make_qk(heads=2, group=group, seed=11)
    mass = oracle_block_mass(q, keys, POSITIONS, BLOCK, N_BLOCKS)
    oracle = oracle_blocks(mass, POSITIONS, N_BLOCKS, BLOCK)
    lo, hi = block_key_bounds(keys, BLOCK)
    quest = force_blocks(quest_block_scores(q, lo, hi, POSITIONS, BLOCK, N_BLOCKS), POSITIONS, BLOCK, 1, 0)
    selections = {
        "oracle": oracle,
        "quest": topk_blocks(quest, POSITIONS, N_BLOCKS, BLOCK),
        "quest top-p": top_p_blocks(quest, POSITIONS, 1.0, N_BLOCKS, BLOCK, logits=False),
        "logit top-p": top_p_blocks(
            block_scores(2, seed=12, signed=True, hidden_share=0.0), POSITIONS, 1.0, N_BLOCKS + 2, BLOCK, logits=True
        ),
        "wide top-k": topk_blocks(block_scores(2, seed=13, hidden_share=0.0), POSITIONS, N_BLOCKS + 1, BLOCK),
    }
    for name, ids in selections.items():
        mass_recall, overlap = selection_recall(ids, mass, oracle)
        torch.testing.assert_close(mass_recall, torch.ones_like(mass_recall), msg=name)
        assert (overlap == 1).all(), name
