"""Anchor layers for the `reuse` selector (Kascade-style cross-layer reuse), picked on held-out text.

Kascade (cross-layer reuse of top-k): a few anchor layers select their blocks with their own query;
every later layer reuses the blocks of the last anchor at or before it, so those layers' blocks are
known a layer ahead.  Which layers to make anchors is chosen on data the evaluation never reads:

1. `anchor_recall_matrix`: R[a, l] = how much of layer l's oracle attention mass layer a's query
   selection holds (mean over rows where the budget is selective), for every a <= l;
2. `pick_anchors`: the anchor set (layer 0 always in it) maximising the sum over layers of
   R[anchor serving l, l], exactly, by dynamic programming;
3. `choose_anchors`: both, on bundled essays the study's perplexity does not read (the "train"
   split; `choose_anchors` says why).

`benchmarks/reuse_anchors.py` sweeps the anchor count on the bundled SmolLM2-135M.
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


# ----------------------------------------------------------------------------------------------
# the recall matrix: each layer's query selection against every later layer's oracle
# ----------------------------------------------------------------------------------------------


def planning_geometry(sparse, budget_blocks: int, length: int) -> dict:
    """The sparse_config dict of the planning forward: `sparse`'s geometry (a preset name, dict or
    SparseConfig) with a budget of `budget_blocks` blocks (init and local included: topk =
    budget_blocks - local_blocks), the query selector at a fixed budget, and dense_len above
    `length`, so the backbone attends densely while every layer's query selection is still made
    and recorded (`SparseAttention._attend_chunks` selects all-dense calls when asked to record)."""
    from forecastkv.errors import ConfigError
    from forecastkv.modeling.configuration import SparseConfig, resolve_sparse_config

    geometry = SparseConfig.from_dict(resolve_sparse_config(sparse))
    if geometry is None:
        raise ConfigError("anchor planning needs a block geometry: pass sparse= (a preset name, dict or SparseConfig)")
    local = geometry.local_blocks
    if isinstance(budget_blocks, bool) or not isinstance(budget_blocks, int) or budget_blocks < local:
        raise ConfigError(
            f"budget_blocks={budget_blocks!r} must be an integer >= the {local} local blocks of the geometry "
            f"(window_size {geometry.window_size} / block_size {geometry.block_size})"
        )
    changes = {"topk": budget_blocks - local, "selector": "query", "top_p": 0.0, "dense_len": length + 1}
    return {**geometry.to_dict(), **changes}


def _oracle_rows(q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, sparse) -> tuple:
    """Layer-wise oracle of rows q [B, R, Hq, d] over keys [B, S, H, d]: (mass fp32 [B, H, R, NB],
    oracle ids int64 [B, H, R, budget_blocks]), NB = the blocks of S keys; PLANNING_ROWS rows at a time."""
    from forecastkv.modeling import selection as sel
    from forecastkv.selectors import oracle

    n_blocks = sel.num_blocks(keys.shape[1], sparse.block_size)
    masses, oracles = [], []
    for first in range(0, q.shape[1], PLANNING_ROWS):
        rows = slice(first, first + PLANNING_ROWS)
        mass = oracle.oracle_block_mass(q[:, rows], keys, positions[:, rows], sparse.block_size, n_blocks)
        masses.append(mass)
        oracles.append(oracle.oracle_blocks(mass, positions[:, rows], sparse.budget_blocks, sparse.block_size))
    return torch.cat(masses, dim=2), torch.cat(oracles, dim=2)


@torch.no_grad()
def _sequence_recall_sums(inner, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, int]:
    """One planning forward of ids [B, T] under the planning geometry already routed on `inner`:
    (sums fp64 [2, L, L] of the mass recall and the block overlap of layer a's query selection
    against layer l's oracle, over KV heads and rows t >= start, a <= l; the rows x heads counted)."""
    from forecastkv.modeling import selection

    sparse = inner.config.sparse
    oracles: dict[int, tuple] = {}

    def on_layer(idx, normed, positions, cos, sin, cache_layer):
        rows = slice(start, None)
        q = inner.layers[idx].self_attn.queries(normed[:, rows], cos[:, rows], sin[:, rows])
        keys = cache_layer.full()[0]
        oracles[idx] = _oracle_rows(q, keys, positions[:, rows], sparse)
        cache_layer.reset()  # nothing reads this layer's K/V again: memory stays at one layer's

    _, _, selections = inner(ids, collect_selections=True, layer_callback=on_layer)
    layers = len(selections)
    sums = torch.zeros(2, layers, layers, dtype=torch.float64)
    for layer in range(layers):
        mass, oracle_ids = oracles.pop(layer)
        for anchor in range(layer + 1):
            chosen = selections[anchor]["query"][:, :, start:]
            measures = selection.selection_recall(chosen.to(mass.device), mass, oracle_ids)
            sums[:, anchor, layer] = torch.stack([m.double().sum() for m in measures]).cpu()
    heads = selections[0]["query"].shape[1]
    return sums, ids.shape[0] * heads * (ids.shape[1] - start)


def anchor_recall_matrix(model, ids: torch.Tensor, start: int, budget_blocks: int, sparse=None) -> torch.Tensor:
    """R fp64 [L, L]: R[a, l] = the mean mass recall, over sequences, KV heads and rows t >= start,
    of layer a's query selection applied to layer l's oracle (a <= l; NaN below the diagonal).
    Arguments and cost: `anchor_recall_matrices`, whose first matrix this is."""
    return anchor_recall_matrices(model, ids, start, budget_blocks, sparse)[0]


def anchor_recall_matrices(
    model, ids: torch.Tensor, start: int, budget_blocks: int, sparse=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mass recall, block overlap), each fp64 [L, L]: entry [a, l] is the mean over sequences, KV
    heads and rows t >= start of layer a's query selection measured against layer l's oracle
    (a <= l; NaN below the diagonal).  Overlap: the share of the oracle's blocks selected.

    model: a ForecastKVForCausalLM or ForecastKVModel; ids [N, T] int64 held-out token ids, run one
    sequence at a time; start: the first row counted (rows where the budget is selective:
    budget_blocks * block_size and later); sparse: the block geometry (preset name, dict or
    SparseConfig; default the model's sparse_config), its budget set to `budget_blocks`
    (`planning_geometry`).  Layer l's oracle is the mass of its true queries over its keys per block
    (`selectors/oracle.py:oracle_block_mass`) and the recall is that mass held by the selection over the mass
    of layer l's own top-budget blocks (`selection.selection_recall`).  The backbone attends densely,
    so every layer sees the model's true hidden states.  Memory: one layer's K/V, the [L, KV heads,
    T - start, NB] oracle masses of one sequence, and PLANNING_ROWS rows of attention at a time.
    """
    from forecastkv.modeling.routing import attending_with

    inner = getattr(model, "model", model)
    ids = torch.as_tensor(ids)
    if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"ids must be a non-empty [N, T] tensor of token ids, got shape {tuple(ids.shape)}")
    length = ids.shape[1]
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < length:
        raise ValueError(f"start={start!r} must be an integer in [0, sequence length {length})")
    geometry = planning_geometry(sparse if sparse is not None else inner.config.sparse, budget_blocks, length)
    layers = inner.config.num_hidden_layers
    sums, count = torch.zeros(2, layers, layers, dtype=torch.float64), 0
    device = next(inner.parameters()).device
    with attending_with(inner, geometry):
        for row in range(ids.shape[0]):
            part, rows = _sequence_recall_sums(inner, ids[row : row + 1].to(device), start)
            sums, count = sums + part, count + rows
    below = torch.ones(layers, layers, dtype=torch.bool).tril(-1)
    mass_recall, overlap = (sums / count).masked_fill(below, float("nan"))
    return mass_recall, overlap


# ----------------------------------------------------------------------------------------------
# anchors on the bundled essays
# ----------------------------------------------------------------------------------------------

PLANNING_SPLIT = "train"  # see `choose_anchors`: the study's perplexity reads the "heldout" essays
PLANNING_SEQUENCES = 8


def planning_sequences(tokenizer, length: int, count: int = PLANNING_SEQUENCES, split: str = PLANNING_SPLIT):
    """int64 [N, length], N = min(count, all there are): bundled essays of `split` packed in storage
    order, `count` windows spread evenly over them (several essays, not the first few)."""
    from forecastkv.training.data import build_sequences

    packed = build_sequences("bundled", tokenizer, length, split=split, shuffle=False, name="anchor planning data")
    total = len(packed)
    picks = torch.linspace(0, total - 1, min(count, total)).round().long().unique()
    return packed.sequences[picks].long()


def choose_anchors(
    model,
    tokenizer_or_ids,
    count: int,
    length: int,
    budget_blocks: int,
    sequences: int = PLANNING_SEQUENCES,
    split: str = PLANNING_SPLIT,
    sparse=None,
) -> list[int]:
    """Kascade's anchor choice: `pick_anchors` of the `anchor_recall_matrix` on held-out text.

    tokenizer_or_ids: a tokenizer, to read `sequences` windows of `length` tokens from the bundled
    essays' `split` (`planning_sequences`); or token ids [N, >= length] to plan on instead.  The
    default split is "train": the study evaluates perplexity on the "heldout" essays
    (`eval.tasks.heldout_stream`), so anchors picked there would be tuned on the evaluated text;
    the needle tasks build haystacks from shuffled "train" sentences, a far weaker overlap (the
    anchors are a few layer ids fitted to an [L, L] average).  The backbone was trained on neither.
    Rows t >= budget_blocks * block_size are counted (where the budget leaves blocks out).
    sparse: the geometry (default: the model's sparse_config).  Returns ascending layer ids, 0 first.
    """
    from forecastkv.errors import ConfigError

    inner = getattr(model, "model", model)
    geometry = planning_geometry(sparse if sparse is not None else inner.config.sparse, budget_blocks, length)
    start = budget_blocks * geometry["block_size"]
    if start >= length:
        raise ConfigError(
            f"budget_blocks={budget_blocks} covers every block of length={length} (no row where the budget "
            f"leaves a block out): it must be < {-(-length // geometry['block_size'])} blocks"
        )
    if isinstance(tokenizer_or_ids, torch.Tensor):
        ids = tokenizer_or_ids
        if ids.dim() != 2 or ids.shape[1] < length:
            raise ValueError(f"ids must be [N, >= length={length}] token ids, got shape {tuple(ids.shape)}")
        ids = ids[:, :length]
    else:
        ids = planning_sequences(tokenizer_or_ids, length, sequences, split)
    return pick_anchors(anchor_recall_matrix(model, ids, start, budget_blocks, geometry), count)
