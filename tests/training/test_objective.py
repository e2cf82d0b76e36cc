"""The Forecast loss against a plain-loops reference (the SparDA paper §3.2-§3.4)."""

import math

import pytest
import torch

from forecastkv.modeling import SparseConfig
from forecastkv.modeling.selection import compress_keys
from forecastkv.training.objective import (
    ObjectiveConfig,
    TopkTargets,
    align_to_grid,
    layer_loss,
    rows_kl,
    teacher_rows,
    topk_targets,
)
from tests.helpers import TRAINING_SPARSE as TINY_SPARSE

EPS = 1e-8


# ----------------------------------------------------------------------------------------------
# reference, one (sequence, KV group, row) at a time
# ----------------------------------------------------------------------------------------------


def ref_window_means(keys, kernel, stride):
    """keys [T, d] -> list of mean windows (complete ones only)."""
    count = 0 if keys.shape[0] < kernel else (keys.shape[0] - kernel) // stride + 1
    return [keys[j * stride : j * stride + kernel].mean(dim=0) for j in range(count)]


def ref_softmax_visible(vec, keys, visible):
    """softmax over the visible keys of vec.k/sqrt(d); 0 elsewhere."""
    d = vec.shape[0]
    logits = [torch.dot(vec, k) / math.sqrt(d) for k in keys]
    idx = [j for j in range(len(keys)) if visible[j]]
    out = [torch.zeros(())] * len(keys)
    if idx:
        m = max(logits[j] for j in idx)
        z = sum(torch.exp(logits[j] - m) for j in idx)
        for j in idx:
            out[j] = torch.exp(logits[j] - m) / z
    return torch.stack(out) if out else torch.zeros(0)


def ref_align(fine, ratio, count):
    """max over fine j in [i*ratio - 1, i*ratio + ratio - 1] (kernel ratio+1, stride ratio, pad 1)."""
    cf = fine.shape[0]
    out_len = (cf + 2 - (ratio + 1)) // ratio + 1
    out = []
    for i in range(count):
        if i >= out_len:
            out.append(torch.zeros(()))
            continue
        window = [fine[j] for j in range(i * ratio - 1, i * ratio + ratio) if 0 <= j < cf]
        out.append(max(window))
    return torch.stack(out)


def ref_selection(teacher, t, sp, n_blocks, width, kind="selector"):
    """Top-`width` blocks of the pooled, forced teacher; future / -inf ones dropped.  A selector
    teacher's block is the max over the compressed keys overlapping it, an attention teacher's the
    sum over its own r keys (its mass)."""
    p, s, bs = sp["kernel_size"], sp["kernel_stride"], sp["block_size"]
    local = sp["window_size"] // bs
    qb = t // bs
    scores = []
    for j in range(n_blocks):
        if kind == "attention":
            mine = [c for c in range(j * bs // s, (j + 1) * bs // s) if c < teacher.shape[0] and c * s + p <= t]
            score = sum(float(teacher[c]) for c in mine) if mine else -math.inf
            scores.append(math.inf if j < sp["init_blocks"] or qb - local <= j <= qb else score)
            continue
        vals = [
            float(teacher[c])
            for c in range(teacher.shape[0])
            if c * s < (j + 1) * bs and c * s + p > j * bs and c * s + p <= t
        ]
        score = max(vals) if vals else -math.inf
        if j < sp["init_blocks"] or qb - local <= j <= qb:
            score = math.inf
        scores.append(score)
    order = sorted(range(n_blocks), key=lambda j: (-scores[j], j))[:width]
    chosen = [j for j in order if j <= qb and scores[j] != -math.inf]
    return sorted(chosen), width


def ref_forced(j, t, sp):
    local = sp["window_size"] // sp["block_size"]
    qb = t // sp["block_size"]
    return j < sp["init_blocks"] or qb - local <= j <= qb


def ref_bucket(probs, slots):
    """slots: list of compressed indices or None (invalid) -> renormalised vector with rest bucket."""
    gathered = [probs[c] if c is not None else torch.zeros(()) for c in slots]
    total = sum(gathered) if gathered else torch.zeros(())
    rest = torch.clamp(1 - total, min=0.0)
    vec = torch.stack(gathered + [rest]).clamp(min=EPS)
    return vec / vec.sum()


def reference_loss(q, k, f, sp, objective, policy="infllmv2"):
    """Plain loops over sequences, KV groups and rows.  q [B,T,Hq,d], k [B,T,H,d], f [B,T,H*n,d]."""
    batch, length, hq, d = q.shape
    heads = k.shape[2]
    group, n = hq // heads, f.shape[2] // heads
    p, s, bs = sp["kernel_size"], sp["kernel_stride"], sp["block_size"]
    kf, sf = objective.teacher_kernel, objective.teacher_stride
    r = bs // s
    n_blocks = -(-length // bs)
    local = sp["window_size"] // bs
    budget = sp["topk"] + local
    width = budget if policy == "infllmv2" else min(sp["init_blocks"] + local + sp["query_blocks"], budget)
    total = torch.zeros(())
    for b in range(batch):
        for g in range(heads):
            fine = ref_window_means(k[b, :, g], kf, sf)
            coarse = ref_window_means(k[b, :, g], p, s)
            count = len(coarse)
            for t in range(length):
                # the forecast selector's rule on either grid: a window is visible once it ended
                # before t (end + 1 <= t), the next layer's keys before it appends token t
                vis_f = [j * sf + kf <= t for j in range(len(fine))]
                vis_c = [i * s + p <= t for i in range(count)]
                if objective.teacher == "attention":
                    # the true attention over keys 0..t, group-averaged, summed per stride slice
                    seen = [j <= t for j in range(length)]
                    attention = sum(ref_softmax_visible(q[b, t, g * group + h], k[b, :, g], seen) for h in range(group))
                    tp = torch.stack([attention[i * s : (i + 1) * s].sum() / group for i in range(count)])
                else:  # group-summed softmax over the fine grid, aligned
                    tp = sum(ref_softmax_visible(q[b, t, g * group + h], fine, vis_f) for h in range(group))
                    tp = ref_align(tp, s // sf, count)
                tp = tp * torch.tensor(vis_c, dtype=torch.float32)  # masked by the forecast rule, renormalised
                tp = tp / (tp.sum() + EPS)
                # student: mean over the n vectors on the deployed grid
                sq = sum(ref_softmax_visible(f[b, t, g * n + v], coarse, vis_c) for v in range(n)) / n
                sq = sq / (sq.sum() + EPS)
                if objective.loss == "full":
                    total = total + sum(
                        tp[i] * (torch.log(tp[i].clamp(min=EPS)) - torch.log(sq[i].clamp(min=EPS)))
                        for i in range(count)
                    )
                    continue
                chosen, width_ = ref_selection(tp, t, sp, n_blocks, width, objective.teacher)
                slots = []
                for slot in range(width_):
                    block = chosen[slot] if slot < len(chosen) else None
                    for c_off in range(r):
                        c = None if block is None or ref_forced(block, t, sp) else block * r + c_off
                        slots.append(c if c is not None and c < count else None)
                pt, qt = ref_bucket(tp, slots), ref_bucket(sq, slots)
                total = total + (pt * (pt.log() - qt.log())).sum()
    return total / (batch * heads * length)


# ----------------------------------------------------------------------------------------------


def random_inputs(seed, batch=2, length=40, hq=6, heads=2, n=1, d=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, hq, d, generator=g) * 2
    k = torch.randn(batch, length, heads, d, generator=g) * 2
    f = torch.randn(batch, length, heads * n, d, generator=g) * 2
    return q, k, f


def ours(q, k, f, sp, objective):
    sparse = SparseConfig(**sp)
    ckeys = compress_keys(k, sparse.kernel_size, sparse.kernel_stride)
    positions = torch.arange(q.shape[1]).expand(q.shape[0], -1)
    return layer_loss(q, k, ckeys, f, positions, sparse, objective)


CASES = [
    ("infllmv2, n=1, chunked", dict(TINY_SPARSE), 1, ObjectiveConfig(chunk_size=16)),
    ("infllmv2, n=2, one chunk", dict(TINY_SPARSE), 2, ObjectiveConfig(chunk_size=64)),
    ("nosa shortlist", dict(TINY_SPARSE, policy="nosa", topk=6, query_blocks=2), 1, ObjectiveConfig(chunk_size=7)),
    (
        "wider fine grid 4/2 on 8/4",
        dict(TINY_SPARSE, kernel_size=8, kernel_stride=4, block_size=16, window_size=16, topk=4),
        1,
        ObjectiveConfig(teacher_kernel=4, teacher_stride=2, chunk_size=13),
    ),
    ("full-row KL", dict(TINY_SPARSE), 1, ObjectiveConfig(loss="full", chunk_size=16)),
    ("attention teacher, n=1, chunked", dict(TINY_SPARSE), 1, ObjectiveConfig(teacher="attention", chunk_size=16)),
    (
        "attention teacher, n=2, 8/4 grid",
        dict(TINY_SPARSE, kernel_size=8, kernel_stride=4, block_size=16, window_size=16, topk=4),
        2,
        ObjectiveConfig(teacher="attention", chunk_size=13),
    ),
    (
        "attention teacher, nosa",
        dict(TINY_SPARSE, policy="nosa", topk=6, query_blocks=2),
        1,
        ObjectiveConfig(teacher="attention", chunk_size=7),
    ),
    ("attention teacher, full-row KL", dict(TINY_SPARSE), 1, ObjectiveConfig(teacher="attention", loss="full")),
]


@pytest.mark.parametrize("name, sp, n, objective", CASES, ids=[c[0] for c in CASES])
def test_loss_matches_loops_reference(name, sp, n, objective):
    q, k, f = random_inputs(1, n=n, length=72 if sp["block_size"] > 8 else 40)
    f.requires_grad_(True)
    loss = ours(q, k, f, sp, objective)
    (grad,) = torch.autograd.grad(loss, f)
    f_ref = f.detach().clone().requires_grad_(True)
    expected = reference_loss(q, k, f_ref, sp, objective, policy=sp.get("policy", "infllmv2"))
    (grad_ref,) = torch.autograd.grad(expected, f_ref)
    assert loss.item() > 1e-3
    assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())  # fp32, rel 1e-5
    assert (grad - grad_ref).norm() / grad_ref.norm() < 1e-4


def test_forced_blocks_and_rest_bucket_matter():
    """The reference is sensitive to what it claims to check: including forced blocks or dropping
    the rest bucket gives a different number."""
    q, k, f = random_inputs(2)
    objective = ObjectiveConfig(chunk_size=16)
    base = ours(q, k, f, dict(TINY_SPARSE), objective).item()
    assert abs(base - reference_loss(q, k, f, dict(TINY_SPARSE), objective).item()) <= 1e-5 * base
    # a wider window forces more blocks, so fewer are supervised: a different loss
    wider = ours(q, k, f, dict(TINY_SPARSE, window_size=16), objective).item()
    assert abs(wider - base) > 1e-3 * base
    # a student equal to the teacher has zero loss (rest bucket included)
    sparse = SparseConfig(**dict(TINY_SPARSE, kernel_size=2, kernel_stride=1, block_size=4, window_size=4))
    same = ObjectiveConfig(teacher_kernel=2, teacher_stride=1, chunk_size=16)
    q1 = q[:, :, ::3]  # one query per KV group: group softmax = the single head's softmax
    ckeys = compress_keys(k, 2, 1)
    positions = torch.arange(q.shape[1]).expand(q.shape[0], -1)
    assert layer_loss(q1, k, ckeys, q1, positions, sparse, same).item() < 1e-6


def test_chunking_does_not_change_the_loss():
    q, k, f = random_inputs(3, length=48)
    values = [ours(q, k, f, dict(TINY_SPARSE), ObjectiveConfig(chunk_size=c)).item() for c in (5, 16, 48, 100)]
    assert max(values) - min(values) <= 1e-6 * values[0]


def test_topk_targets_are_row_local():
    """What the feature cache relies on: a row's top-k target depends on its teacher row and
    position only.  Targets computed once over all rows, in chunks, then taken at a few early rows
    (fewer blocks exist there) equal those computed on those rows, and `rows_kl` with them is
    bitwise the loss it computes without them."""
    sparse, objective = SparseConfig(**TINY_SPARSE), ObjectiveConfig(chunk_size=16)
    q, k, f = random_inputs(4, length=48)
    ckeys = compress_keys(k, sparse.kernel_size, sparse.kernel_stride)
    fine = compress_keys(k, objective.teacher_kernel, objective.teacher_stride)
    positions = torch.arange(48).expand(2, -1)
    teacher = teacher_rows(q, fine, positions, sparse, objective, ckeys.shape[1])
    cached = TopkTargets.cat(
        [topk_targets(teacher[:, :, s : s + 16], positions[:, s : s + 16], sparse) for s in range(0, 48, 16)], dim=2
    )
    assert all(torch.equal(a, b) for a, b in zip(cached, topk_targets(teacher, positions, sparse)))
    index = torch.tensor([[25, 30, 33, 39], [24, 31, 36, 38]])  # rows < 40: 5 blocks, not the 6 of all rows
    rows_teacher = torch.stack([teacher[b][:, index[b]] for b in range(2)])
    rows_f, rows_pos = torch.stack([f[b, index[b]] for b in range(2)]), torch.gather(positions, 1, index)
    taken, direct = cached.take(index), topk_targets(rows_teacher, rows_pos, sparse)
    assert all(torch.equal(a, b) for a, b in zip(taken, direct))
    assert taken.valid.any() and not taken.valid.all()
    with_cache = rows_kl(rows_f, ckeys, rows_pos, rows_teacher, sparse, "topk", taken)
    assert with_cache.item() > 0 and torch.equal(
        with_cache, rows_kl(rows_f, ckeys, rows_pos, rows_teacher, sparse, "topk")
    )


def test_align_to_grid_geometry():
    fine = torch.arange(1.0, 12.0)  # Cf = 11, ratio 4: windows [-1..3], [3..7], [7..11]
    assert align_to_grid(fine, 4, 3).tolist() == [4.0, 8.0, 11.0]
    assert align_to_grid(fine, 4, 5).tolist() == [4.0, 8.0, 11.0, 0.0, 0.0]  # zero-padded
    assert align_to_grid(fine, 4, 2).tolist() == [4.0, 8.0]  # truncated
    assert torch.allclose(align_to_grid(fine, 4, 1, "mean"), torch.tensor([(1 + 2 + 3 + 4) / 5]))


def test_objective_config_errors():
    with pytest.raises(ValueError, match="teacher_stride=3 must divide sparse_config.kernel_stride=2"):
        ObjectiveConfig(teacher_kernel=3, teacher_stride=3).check_against(SparseConfig(**TINY_SPARSE))
    with pytest.raises(ValueError, match=r"objective.loss='kl' is not one of"):
        ObjectiveConfig(loss="kl")
    with pytest.raises(ValueError, match=r"objective.teacher='oracle' is not one of \('selector', 'attention'\)"):
        ObjectiveConfig(teacher="oracle")
    with pytest.raises(ValueError, match=r"unknown objective key\(s\) \['chunk'\]"):
        ObjectiveConfig.from_dict({"chunk": 4})


def test_attention_teacher_ranks_blocks_by_their_true_mass():
    """The attention teacher's supervised blocks are the oracle's: for rows far enough from the start,
    the non-forced blocks it routes are the top blocks of `oracle_block_mass` among the visible,
    non-forced ones (the query teacher's are not, on the same inputs)."""
    from forecastkv.selectors.oracle import oracle_block_mass

    sp = dict(TINY_SPARSE)
    sparse = SparseConfig(**sp)
    q, k, _ = random_inputs(5, length=72)
    positions = torch.arange(72).expand(2, -1)
    count = compress_keys(k, sparse.kernel_size, sparse.kernel_stride).shape[1]
    objective = ObjectiveConfig(teacher="attention")
    teacher = teacher_rows(q, k, positions, sparse, objective, count)
    targets = topk_targets(teacher, positions, sparse, "attention")
    n_blocks = -(-72 // sparse.block_size)
    mass = oracle_block_mass(q, k, positions, sparse.block_size, n_blocks)
    r = sparse.block_size // sparse.kernel_stride
    checked = 0
    for b, g, t in ((b, g, t) for b in range(2) for g in range(2) for t in range(40, 72)):
        chosen = sorted({int(i) // r for i, v in zip(targets.index[b, g, t], targets.valid[b, g, t]) if v})
        qb, local = t // sparse.block_size, sparse.window_size // sparse.block_size
        # blocks whose compressed keys the forecast rule lets the row see, and that are not forced
        seen = [j * r * sparse.kernel_stride + sparse.kernel_size <= t for j in range(n_blocks)]
        eligible = [j for j in range(n_blocks) if j >= sparse.init_blocks and not qb - local <= j <= qb and seen[j]]
        best = sorted(eligible, key=lambda j: -float(mass[b, g, t, j]))[: len(chosen)]
        assert chosen == sorted(best), (b, g, t, chosen, best)
        checked += len(chosen)
    assert checked > 0


@pytest.mark.parametrize("loss", ["topk", "full"])
def test_attention_teacher_kl_falls_under_training(loss):
    """A linear head over what determines the layer's attention (here its queries themselves, the
    input a trained head approximates) learns the attention teacher: its KL (the objective's own
    number, on the same rows) falls by more than half in 80 Adam steps on the tiny geometry."""
    torch.manual_seed(0)
    sparse = SparseConfig(**TINY_SPARSE)
    q, k, _ = random_inputs(6, length=64, heads=2, hq=6, d=8)
    hidden = q.flatten(2)
    head = torch.nn.Linear(48, 2 * 8, bias=False)
    ckeys = compress_keys(k, sparse.kernel_size, sparse.kernel_stride)
    positions = torch.arange(64).expand(2, -1)
    objective = ObjectiveConfig(teacher="attention", loss=loss, chunk_size=32)
    optimizer = torch.optim.Adam(head.parameters(), lr=0.05)
    losses = []
    for _ in range(80):
        value = layer_loss(q, k, ckeys, head(hidden).view(2, 64, 2, 8), positions, sparse, objective)
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
        losses.append(value.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_oracle_recall_reference_by_a_loop():
    """What the attention teacher's heads are measured against (`recall.oracle_selection`): per row the
    init and local blocks, then the visible blocks of most true attention mass, `budget_blocks` in all."""
    from forecastkv.selectors.oracle import oracle_block_mass
    from forecastkv.training.recall import oracle_selection

    sparse = SparseConfig(**TINY_SPARSE)
    q, k, _ = random_inputs(7, length=70)
    positions = torch.arange(70).expand(2, -1)
    got = oracle_selection(q, k, positions, sparse)
    bs, budget = sparse.block_size, sparse.budget_blocks
    mass = oracle_block_mass(q, k, positions, bs, -(-70 // bs))
    for b, g, t in ((0, 0, 69), (1, 1, 40), (0, 1, 23), (1, 0, 5)):
        qb, local = t // bs, sparse.window_size // bs
        forced = [j for j in range(qb + 1) if j < sparse.init_blocks or qb - local <= j]
        rest = sorted((j for j in range(qb + 1) if j not in forced), key=lambda j: (-float(mass[b, g, t, j]), j))
        expected = sorted(forced + rest[: max(budget - len(forced), 0)])
        assert sorted(int(i) for i in got[b, g, t] if i >= 0) == expected, (b, g, t)
