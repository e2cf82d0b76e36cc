"""Kascade-style anchors for the reuse selector: the exact dynamic programme against brute force,
and the recall matrix against a plain loop on the tiny model."""

from __future__ import annotations

import itertools

import pytest
import torch

from forecastkv.eval.reuse_anchors import anchors_score, pick_anchors


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
