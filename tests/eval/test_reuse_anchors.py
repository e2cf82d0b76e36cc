"""Kascade-style anchors for the reuse selector: the exact dynamic programme against brute force,
and the recall matrix against a plain loop on the tiny model."""

from __future__ import annotations

import itertools

import pytest
import torch

from forecastkv.errors import ConfigError
from forecastkv.eval.reuse_anchors import (
    anchor_recall_matrices,
    anchor_recall_matrix,
    anchors_score,
    choose_anchors,
    pick_anchors,
)
from forecastkv.modeling import selection as sel
from forecastkv.modeling.configuration import SparseConfig
from forecastkv.modeling.routing import attending_with
from tests.helpers import tiny_model, tiny_sparse


def brute_force(recall: torch.Tensor, count: int) -> tuple[float, list[int]]:
    """The best score and anchor set over every `count`-subset of layers containing layer 0."""
    layers = recall.shape[0]
    best = (-float("inf"), [])
    for rest in itertools.combinations(range(1, layers), count - 1):
        anchors = [0, *rest]
        served = [max(a for a in anchors if a <= layer) for layer in range(layers)]
        score = sum(float(recall[a, layer]) for layer, a in enumerate(served))
        if score > best[0]:
            best = (score, anchors)
    return best


def random_recall(layers: int, seed: int) -> torch.Tensor:
    """A random matrix in [0, 1] with NaN below the diagonal (those entries are never meaningful)."""
    generator = torch.Generator().manual_seed(seed)
    recall = torch.rand(layers, layers, generator=generator, dtype=torch.float64)
    return recall.masked_fill(torch.ones(layers, layers, dtype=torch.bool).tril(-1), float("nan"))


@pytest.mark.parametrize("layers", [1, 2, 3, 5, 7])
def test_pick_anchors_is_the_brute_force_optimum(layers):
    for seed in range(6):
        recall = random_recall(layers, seed)
        for count in range(1, layers + 1):
            anchors = pick_anchors(recall, count)
            score, expected = brute_force(recall, count)
            assert anchors == expected, (seed, count)  # continuous random values: the optimum is unique
            assert anchors_score(recall, anchors) == pytest.approx(score, rel=1e-12)


def test_pick_anchors_edges():
    recall = random_recall(6, 0)
    assert pick_anchors(recall, 1) == [0]  # one anchor: layer 0 serves every layer
    assert pick_anchors(recall, 6) == list(range(6))  # every layer an anchor: each serves itself
    assert anchors_score(recall, list(range(6))) == pytest.approx(float(recall.diagonal().sum()))


def test_pick_anchors_follows_where_reuse_breaks():
    """Two blocks of layers that reuse well within themselves and badly across: the second anchor
    goes where the second block starts."""
    layers = 8
    recall = torch.full((layers, layers), 0.1, dtype=torch.float64)
    recall[:5, :5] = 0.9
    recall[5:, 5:] = 0.9
    assert pick_anchors(recall, 2) == [0, 5]


def test_pick_anchors_rejects_bad_input():
    recall = random_recall(4, 0)
    for count in (0, 5, 1.5, True):
        with pytest.raises(ValueError, match="anchor count must be an integer in \\[1, 4\\]"):
            pick_anchors(recall, count)
    with pytest.raises(ValueError, match="square"):
        pick_anchors(torch.zeros(3, 4), 1)
    bad = recall.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="finite on and above the diagonal"):
        pick_anchors(bad, 2)
    with pytest.raises(ValueError, match="starting with 0"):
        anchors_score(recall, [1, 2])
    with pytest.raises(ValueError, match="starting with 0"):
        anchors_score(recall, [0, 2, 2])


# ----------------------------------------------------------------------------------------------
# the recall matrix on the tiny model (blocks of 8, one local block: a budget of B blocks is topk B - 1)
# ----------------------------------------------------------------------------------------------

LENGTH = 64  # 8 blocks


def tiny_ids(count: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, 128, (count, LENGTH), generator=torch.Generator().manual_seed(seed))


def captured_layers(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (post-RoPE queries [1, T, Hq, d], keys [1, T, H, d]) of a dense forward of ids [1, T]."""
    inner, captured = model.model, []

    def on_layer(idx, normed, positions, cos, sin, cache_layer):
        captured.append((inner.layers[idx].self_attn.queries(normed, cos, sin), cache_layer.full()[0].clone()))

    with torch.no_grad(), attending_with(inner, None):
        inner(ids, layer_callback=on_layer)
    return captured


def loop_block_mass(q: torch.Tensor, keys: torch.Tensor, t: int, head: int, block_size: int) -> list[float]:
    """The true attention mass per visible block of row t for KV head `head`, averaged over its
    query heads: one softmax per query head over keys 0..t, summed block by block."""
    group = q.shape[2] // keys.shape[2]
    blocks = [0.0] * (t // block_size + 1)
    for member in range(group):
        logits = [float(q[0, t, head * group + member] @ keys[0, s, head]) / q.shape[-1] ** 0.5 for s in range(t + 1)]
        probs = torch.softmax(torch.tensor(logits, dtype=torch.float64), dim=0).tolist()
        for s, p in enumerate(probs):
            blocks[s // block_size] += p / group
    return blocks


def loop_recall_matrices(model, ids: torch.Tensor, start: int, budget: int) -> torch.Tensor:
    """(mass recall, overlap) [2, L, L] by plain loops: each layer's query selection (the deployed
    rule, `layer_selection`) against every later layer's oracle (top-`budget` blocks by
    loop-computed mass, ties to the lower id)."""
    sparse = SparseConfig.from_dict(tiny_sparse(topk=budget - 1))
    layers = model.config.num_hidden_layers
    sums, count = torch.zeros(2, layers, layers, dtype=torch.float64), 0
    for row in range(ids.shape[0]):
        captured = captured_layers(model, ids[row : row + 1])
        positions = torch.arange(LENGTH).view(1, -1)
        chosen = []
        for q, keys in captured:
            ckeys = sel.compress_keys(keys, sparse.kernel_size, sparse.kernel_stride)
            chosen.append(sel.layer_selection(q, ckeys, positions, sparse, "query"))
        for layer, (q, keys) in enumerate(captured):
            for t in range(start, LENGTH):
                for head in range(keys.shape[2]):
                    mass = loop_block_mass(q, keys, t, head, sparse.block_size)
                    oracle = sorted(range(len(mass)), key=lambda j: (-mass[j], j))[:budget]
                    best = sum(mass[j] for j in oracle)
                    for anchor in range(layer + 1):
                        picked = [j for j in chosen[anchor][0, head, t].tolist() if j >= 0]
                        sums[0, anchor, layer] += sum(mass[j] for j in picked) / best
                        sums[1, anchor, layer] += len(set(picked) & set(oracle)) / len(oracle)
        count += keys.shape[2] * (LENGTH - start)
    return sums / count


def test_recall_matrix_matches_plain_loops():
    # a budget of 5 blocks: 3 forced (init, window, current) and 2 chosen by the query
    model, ids, budget = tiny_model(), tiny_ids(), 5
    start = budget * 8  # the first row that sees more blocks than the budget
    recall, overlap = anchor_recall_matrices(model, ids, start, budget, sparse=tiny_sparse())
    expected = loop_recall_matrices(model, ids, start, budget)
    upper = torch.ones(3, 3, dtype=torch.bool).triu()
    assert torch.allclose(recall[upper], expected[0][upper], atol=1e-5)
    assert torch.allclose(overlap[upper], expected[1][upper], atol=1e-6)
    assert torch.isnan(recall[~upper]).all() and torch.isnan(overlap[~upper]).all()  # no anchor after its layer
    assert torch.equal(
        anchor_recall_matrix(model, ids, start, budget, sparse=tiny_sparse()).nan_to_num(), recall.nan_to_num()
    )
    # not vacuous: the budget is selective, and an earlier layer's blocks serve a layer differently from its own
    assert (recall[upper] < 1).all()
    assert (recall[0, 1:] - recall.diagonal()[1:]).abs().min() > 1e-4


def test_recall_matrix_is_one_when_the_budget_holds_every_block():
    """Every selection holds every visible block, so it holds all of the oracle's mass."""
    model, ids = tiny_model(), tiny_ids(1)
    for measure in anchor_recall_matrices(model, ids, 0, LENGTH // 8, sparse=tiny_sparse()):
        upper = torch.ones(3, 3, dtype=torch.bool).triu()
        assert torch.allclose(measure[upper], torch.ones(6, dtype=torch.float64), atol=1e-6)


def test_recall_matrix_leaves_the_model_config_alone():
    model = tiny_model()
    before = model.config.to_dict()
    anchor_recall_matrix(model, tiny_ids(1), 40, 3, sparse=tiny_sparse())
    assert model.config.to_dict() == before and model.config.sparse is None


def test_recall_matrix_rejects_bad_input():
    model, ids = tiny_model(), tiny_ids(1)
    with pytest.raises(ValueError, match="start=64 must be an integer in \\[0, sequence length 64\\)"):
        anchor_recall_matrix(model, ids, LENGTH, 3, sparse=tiny_sparse())
    with pytest.raises(ValueError, match="non-empty \\[N, T\\]"):
        anchor_recall_matrix(model, ids[0], 0, 3, sparse=tiny_sparse())
    with pytest.raises(ConfigError, match="budget_blocks=0 must be an integer >= the 1 local blocks"):
        anchor_recall_matrix(model, ids, 0, 0, sparse=tiny_sparse())
    with pytest.raises(ConfigError, match="needs a block geometry"):
        anchor_recall_matrix(model, ids, 0, 3)  # a dense model and no sparse=


def test_choose_anchors_picks_the_optimum_of_the_recall_matrix():
    model, ids = tiny_model(), tiny_ids()
    recall = anchor_recall_matrix(model, ids, 40, 5, sparse=tiny_sparse())
    for count in (1, 2, 3):
        anchors = choose_anchors(model, ids, count, LENGTH, 5, sparse=tiny_sparse())
        assert anchors == pick_anchors(recall, count)


def test_choose_anchors_rejects_a_budget_without_choice_and_short_ids():
    model, ids = tiny_model(), tiny_ids(1)
    with pytest.raises(ConfigError, match="budget_blocks=8 covers every block of length=64.*must be < 8 blocks"):
        choose_anchors(model, ids, 1, LENGTH, 8, sparse=tiny_sparse())
    with pytest.raises(ValueError, match="ids must be \\[N, >= length=64\\]"):
        choose_anchors(model, ids[:, :32], 1, LENGTH, 5, sparse=tiny_sparse())
