"""Anchor layers for the `reuse` selector (Kascade-style cross-layer reuse), picked on held-out text.

Kascade (cross-layer reuse of top-k): a few anchor layers select their blocks with their own query;
every later layer reuses the blocks of the last anchor at or before it, so those layers' blocks are
known a layer ahead.  Which layers to make anchors is chosen on data the evaluation never reads:

1. `anchor_recall_matrix`: R[a, l] = how much of layer l's oracle attention mass layer a's query
   selection holds (mean over rows where the budget is selective), for every a <= l;
2. `pick_anchors`: the anchor set (layer 0 always in it) maximising the sum over layers of
   R[anchor serving l, l], exactly, by dynamic programming;
3. `choose_anchors`: both, on bundled essays the study does not evaluate.
"""

from __future__ import annotations

import math
from itertools import accumulate

import torch

PLANNING_ROWS = 512  # query rows per oracle-mass chunk: bounds the [H, rows, S] attention probabilities


# ----------------------------------------------------------------------------------------------
# the exact anchor choice
# ----------------------------------------------------------------------------------------------


def _check_recall_matrix(recall: torch.Tensor) -> int:
    """The layer count L of recall [L, L]; ValueError unless it is square with finite a <= l entries."""
    if recall.dim() != 2 or recall.shape[0] != recall.shape[1] or recall.shape[0] == 0:
        raise ValueError(f"the anchor recall matrix must be a non-empty square [L, L], got shape {tuple(recall.shape)}")
    upper = torch.triu(torch.ones_like(recall, dtype=torch.bool))
    if not torch.isfinite(recall[upper]).all():
        raise ValueError("the anchor recall matrix must be finite on and above the diagonal (anchor a <= layer l)")
    return recall.shape[0]


def anchors_score(recall: torch.Tensor, anchors: list[int]) -> float:
    """The sum over layers l of recall[a(l), l], a(l) the last of `anchors` at or before l.

    recall fp [L, L]; anchors: ascending layer ids starting with 0 (ValueError otherwise)."""
    layers = _check_recall_matrix(recall)
    if not anchors or anchors[0] != 0 or any(b <= a for a, b in zip(anchors, anchors[1:])) or anchors[-1] >= layers:
        raise ValueError(f"anchors must be ascending layer ids in [0, {layers}) starting with 0, got {anchors}")
    serving = torch.zeros(layers, dtype=torch.long)
    for anchor in anchors:
        serving[anchor:] = anchor
    return float(recall.double()[serving, torch.arange(layers)].sum())


def pick_anchors(recall: torch.Tensor, count: int) -> list[int]:
    """The `count` anchor layers (layer 0 among them) maximising `anchors_score`, exactly.

    recall fp [L, L]: recall[a, l] for a <= l (entries below the diagonal are never read).
    Dynamic programming over segments: a segment [a, b) is served by anchor a and is worth
    gain(a, b) = sum of recall[a, a:b]; best[k][b] is the most k anchors can earn over layers [0, b)
    with the k-th segment ending at b.  O(count * L^2).  Ties: each segment takes its earliest start (deterministic).
    Returns ascending layer ids, exactly `count` of them (1 <= count <= L, else ValueError).
    """
    layers = _check_recall_matrix(recall)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= layers:
        raise ValueError(f"anchor count must be an integer in [1, {layers}] (the layer count), got {count!r}")
    values = torch.triu(recall.double().nan_to_num(0.0)).tolist()
    prefix = [[0.0, *accumulate(row)] for row in values]  # prefix[a][b] = sum of values[a][:b]

    def gain(a: int, b: int) -> float:
        return prefix[a][b] - prefix[a][a]

    best = [[-math.inf] * (layers + 1) for _ in range(count + 1)]
    back = [[0] * (layers + 1) for _ in range(count + 1)]
    for b in range(1, layers + 1):
        best[1][b] = gain(0, b)
    for k in range(2, count + 1):
        for b in range(k, layers + 1):
            for a in range(k - 1, b):  # the k-th anchor a: the first k - 1 cover [0, a)
                value = best[k - 1][a] + gain(a, b)
                if value > best[k][b]:
                    best[k][b], back[k][b] = value, a
    anchors, end = [], layers
    for k in range(count, 1, -1):
        end = back[k][end]
        anchors.append(end)
    return [0] + anchors[::-1]
