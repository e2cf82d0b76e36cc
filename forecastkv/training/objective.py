"""The Forecast training objective (the SparDA paper, §3.2-§3.4).

For one layer l and every KV group g and query row t:

Visibility: teacher and student see exactly the keys the deployed forecast selector scores,
`selection.compressed_visibility` with `selection.visibility_lag("forecast")` (window end + 1 <= t), on whichever grid.

* teacher P: the group-summed softmax of layer l's real (post-RoPE) queries over a *fine* grid of
  compressed keys (default kernel 2, stride 1), fine keys masked by the forecast rule;
  aligned onto the deployed grid with max_pool1d(kernel=ratio+1, stride=ratio, padding=1),
  ratio = deployed_stride / fine_stride (option: mean), truncated / zero-padded to the deployed
  count C, masked by the forecast rule on the deployed grid, renormalised.  No gradient.
  Computed in query chunks: memory O(chunk x T).
* student Q: softmax(f . Kc / sqrt(d)) over the deployed compressed keys Kc of layer l (forecast
  rule); f = layer l-1's forecast (layer 0: its own current_proj).  With n vectors per KV group:
  the mean over the n vectors' softmaxes (= the deployed group-summed score / n).
* the supervised set S(g, t): the aligned teacher pushed through `selection.py` (pool to blocks,
  force init/local, top-k: `budget_blocks` for infllmv2, the query-aware shortlist
  init + local + query_blocks for nosa), minus the forced blocks and -1 slots.
* loss ("topk", the default): each block of S expanded to its compressed keys
  {b*r .. b*r + r-1} (r = block_size / kernel_stride), P and Q gathered there (0 for invalid
  slots), one "rest" bucket 1 - sum appended (clamped at 0), everything clamped to >= 1e-8 and
  renormalised, KL(P~ || Q~) summed and divided by B * H_kv * T.  Option "full": KL over the whole
  row (P log P/Q, Q clamped at 1e-8).

Teacher "attention" (`ObjectiveConfig.teacher`): the layer's true attention instead of its selector,
so a student can select better than the selector it replaces.  P over the deployed grid is the exact
attention mass (the oracle's, `selectors/oracle.py:oracle_block_mass`, averaged over the KV group)
of each compressed key's stride of raw keys [c*s, (c+1)*s), masked by the forecast rule and
renormalised: a block's r compressed keys then hold exactly its share of the mass, and the
supervised set S(g, t) is the top-k blocks by that mass (summed over their r keys, not max-pooled),
forced blocks removed as before.  Same KL, same student.

Everything selection-related (compression, visibility, group softmax, pooling, forcing, top-k)
comes from `forecastkv.modeling.selection`; this module only adds the alignment and the KL.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from forecastkv.modeling import selection as sel
from forecastkv.modeling.configuration import strict_from_dict
from forecastkv.selectors.oracle import oracle_block_mass

EPS = 1e-8
TEACHERS = ("selector", "attention")


@dataclass(frozen=True)
class ObjectiveConfig:
    """teacher: "selector" (SparDA's: the layer's query selector on a fine grid, what a natively
    sparse base was trained with) | "attention" (the layer's true attention mass: see the module);
    teacher_kernel / teacher_stride: the selector teacher's fine grid; align_pooling: "max" |
    "mean"; loss: "topk" (SparDA's top-k + rest KL) | "full" (KL over the whole row); chunk_size:
    query rows per teacher chunk (memory O(chunk_size x T))."""

    teacher: str = "selector"
    teacher_kernel: int = 2
    teacher_stride: int = 1
    align_pooling: str = "max"
    loss: str = "topk"
    chunk_size: int = 256

    def __post_init__(self) -> None:
        for name in ("teacher_kernel", "teacher_stride", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"objective.{name} must be a positive integer, got {value!r}")
        if self.teacher_kernel < self.teacher_stride:
            raise ValueError(
                f"objective.teacher_kernel={self.teacher_kernel} must be >= teacher_stride={self.teacher_stride}"
            )
        if self.align_pooling not in ("max", "mean"):
            raise ValueError(f"objective.align_pooling={self.align_pooling!r} is not one of ('max', 'mean')")
        if self.loss not in ("topk", "full"):
            raise ValueError(f"objective.loss={self.loss!r} is not one of ('topk', 'full')")
        if self.teacher not in TEACHERS:
            raise ValueError(f"objective.teacher={self.teacher!r} is not one of {TEACHERS}")

    @classmethod
    def from_dict(cls, values: dict | None) -> "ObjectiveConfig":
        """Strictly, as every config section (`modeling.configuration.strict_from_dict`)."""
        return cls() if values is None else strict_from_dict(cls, values, "objective")

    def to_dict(self) -> dict:
        return asdict(self)

    def check_against(self, sparse) -> None:
        """The fine grid must tile the deployed one: kernel_stride a multiple of teacher_stride."""
        if sparse.kernel_stride % self.teacher_stride:
            raise ValueError(
                f"objective.teacher_stride={self.teacher_stride} "
                f"must divide sparse_config.kernel_stride={sparse.kernel_stride}"
            )


# ----------------------------------------------------------------------------------------------
# teacher
# ----------------------------------------------------------------------------------------------


def forecast_visibility(positions: torch.Tensor, num_keys: int, kernel_size: int, kernel_stride: int) -> torch.Tensor:
    """The deployed forecast selector's rule (`selection.visibility_lag`): [B, R] -> bool [B, R, num_keys]."""
    return sel.compressed_visibility(positions, num_keys, kernel_size, kernel_stride, sel.visibility_lag("forecast"))


def align_to_grid(probs: torch.Tensor, ratio: int, count: int, pooling: str = "max") -> torch.Tensor:
    """Fine-grid probabilities [..., Cf] -> deployed grid [..., count] (not renormalised).

    SparDA's "legacy" alignment: pool(kernel=ratio+1, stride=ratio, padding=1), then truncate or
    zero-pad to `count`.  Mean pooling counts the padding as zeros (F.avg_pool1d's default).
    """
    lead = probs.shape[:-1]
    flat = probs.reshape(-1, 1, probs.shape[-1])
    if pooling == "max":
        pooled = F.max_pool1d(flat, kernel_size=ratio + 1, stride=ratio, padding=1)
    else:
        pooled = F.avg_pool1d(flat, kernel_size=ratio + 1, stride=ratio, padding=1)
    pooled = pooled.reshape(*lead, -1)
    if pooled.shape[-1] >= count:
        return pooled[..., :count]
    return F.pad(pooled, (0, count - pooled.shape[-1]))


def renormalise(probs: torch.Tensor) -> torch.Tensor:
    """P / (sum P + 1e-8) over the last dim."""
    return probs / (probs.sum(dim=-1, keepdim=True) + EPS)


@torch.no_grad()
def teacher_keys(keys: torch.Tensor, objective: ObjectiveConfig) -> torch.Tensor:
    """What the teacher reads of a layer's post-RoPE keys [B, T, H, d], computed once per layer: the
    fine grid's compressed keys (teacher "selector") or the keys themselves ("attention")."""
    if objective.teacher == "attention":
        return keys
    return sel.compress_keys(keys, objective.teacher_kernel, objective.teacher_stride)


@torch.no_grad()
def teacher_rows(
    queries: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    sparse,
    objective: ObjectiveConfig,
    count: int,
) -> torch.Tensor:
    """The teacher for a chunk of query rows on the deployed grid.

    queries [B, R, Hq, d] (post-RoPE), keys: `teacher_keys` of the layer (selector: [B, Cf, H, d],
    attention: [B, T, H, d]), positions [B, R].  Returns fp32 [B, H, R, count], rows summing to 1
    (0 where nothing is visible).
    """
    if objective.teacher == "attention":
        return attention_teacher_rows(queries, keys, positions, sparse, count)
    fine_keys = keys
    visible = forecast_visibility(positions, fine_keys.shape[1], objective.teacher_kernel, objective.teacher_stride)
    probs = sel.group_softmax_scores(queries, fine_keys, visible).masked_fill(~visible[:, None], 0.0)
    same_grid = (objective.teacher_kernel, objective.teacher_stride) == (sparse.kernel_size, sparse.kernel_stride)
    if not same_grid:
        probs = align_to_grid(probs, sparse.kernel_stride // objective.teacher_stride, count, objective.align_pooling)
        deployed = forecast_visibility(positions, count, sparse.kernel_size, sparse.kernel_stride)
        probs = probs.masked_fill(~deployed[:, None], 0.0)
    return renormalise(probs)


@torch.no_grad()
def attention_teacher_rows(
    queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, sparse, count: int
) -> torch.Tensor:
    """The "attention" teacher: queries [B, R, Hq, d], keys [B, T, H, d] (post-RoPE), positions [B, R]
    -> fp32 [B, H, R, count]: per compressed key c the true attention mass of raw keys
    [c*s, (c+1)*s) (s = kernel_stride), group-averaged, 0 where the forecast rule hides c,
    renormalised."""
    mass = oracle_block_mass(queries, keys, positions, sparse.kernel_stride, count)
    visible = forecast_visibility(positions, count, sparse.kernel_size, sparse.kernel_stride)
    return renormalise(mass.masked_fill(~visible[:, None], 0.0))


def block_mass(teacher: torch.Tensor, visible: torch.Tensor, n_blocks: int, sparse) -> torch.Tensor:
    """An "attention" teacher [B, H, R, C] summed over each block's r = block_size / kernel_stride
    compressed keys -> [B, H, R, n_blocks]; -inf for a block none of whose keys is visible
    (visible bool [B, R, C])."""
    r = sparse.block_size // sparse.kernel_stride
    width = n_blocks * r
    pad = lambda x, value: F.pad(x, (0, max(width - x.shape[-1], 0)), value=value)[..., :width]  # noqa: E731
    mass = pad(teacher, 0.0).view(*teacher.shape[:-1], n_blocks, r).sum(-1)
    seen = pad(visible, False).view(*visible.shape[:-1], n_blocks, r).any(-1)
    return mass.masked_fill(~seen[:, None], sel.NEG_INF)


@torch.no_grad()
def teacher_selection(
    aligned: torch.Tensor, positions: torch.Tensor, sparse, n_blocks: int, teacher: str = "selector"
) -> torch.Tensor:
    """The teacher's routed blocks: aligned [B, H, R, C] -> ids [B, H, R, K] (canonical, -1 padded).

    Blocks are scored as the deployed selector pools (the max over overlapping compressed keys) for
    the "selector" teacher, by their mass for the "attention" one.  infllmv2: K = budget_blocks;
    nosa: K = init + local + query_blocks (the query-aware shortlist; the CIS-filled rest is not
    supervised).
    """
    p, s, bs = sparse.kernel_size, sparse.kernel_stride, sparse.block_size
    visible = forecast_visibility(positions, aligned.shape[-1], p, s)
    if teacher == "attention":
        blocks = block_mass(aligned, visible, n_blocks, sparse)
    else:
        scores = aligned.masked_fill(~visible[:, None], sel.NEG_INF)
        blocks = sel.pool_to_blocks(scores, n_blocks, p, s, bs)
    blocks = sel.force_blocks(blocks, positions, bs, sparse.init_blocks, sparse.local_blocks)
    if sparse.policy == "nosa":
        width = min(sparse.init_blocks + sparse.local_blocks + sparse.query_blocks, sparse.budget_blocks)
        return sel.topk_blocks(blocks, positions, width, bs)
    return sel.select_blocks(blocks, positions, sparse)


@torch.no_grad()
def supervised_keys(
    ids: torch.Tensor, positions: torch.Tensor, sparse, n_blocks: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed-key slots of the supervised blocks (selected, not forced, not -1).

    ids [B, H, R, K] -> (index [B, H, R, K*r] clamped into [0, count), valid bool [B, H, R, K*r]),
    r = block_size // kernel_stride; block b covers keys b*r .. b*r + r - 1.
    """
    r = sparse.block_size // sparse.kernel_stride
    forced = sel.forced_blocks(positions, n_blocks, sparse.block_size, sparse.init_blocks, sparse.local_blocks)
    forced_at = torch.gather(forced[:, None].expand(-1, ids.shape[1], -1, -1), -1, ids.clamp(min=0))
    keep = (ids >= 0) & ~forced_at  # [B, H, R, K]
    index = (ids.clamp(min=0).unsqueeze(-1) * r + torch.arange(r, device=ids.device)).flatten(-2)
    valid = keep.repeat_interleave(r, dim=-1) & (index < count)
    return index.clamp(max=max(count - 1, 0)), valid


def bucket(probs: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Gather the supervised slots and append the rest bucket (research §3.4).

    probs [B, H, R, C], index/valid [B, H, R, M] -> [B, H, R, M + 1]: gathered (0 where invalid),
    rest = clamp(1 - sum, 0), clamped to >= 1e-8, renormalised.
    """
    gathered = torch.gather(probs, -1, index) * valid
    rest = (1.0 - gathered.sum(dim=-1, keepdim=True)).clamp(min=0.0)
    vec = torch.cat([gathered, rest], dim=-1).clamp(min=EPS)
    return vec / vec.sum(dim=-1, keepdim=True)


# ----------------------------------------------------------------------------------------------
# student
# ----------------------------------------------------------------------------------------------


def student_rows(forecast: torch.Tensor, ckeys: torch.Tensor, positions: torch.Tensor, sparse) -> torch.Tensor:
    """The forecast's distribution over the deployed compressed keys.

    forecast [B, R, H*n, d] (post-RoPE), ckeys [B, C, H, d], positions [B, R] -> fp32 [B, H, R, C]:
    the mean over the n vectors of softmax(f . Kc / sqrt(d)) over the keys the deployed forecast
    selector sees (0 elsewhere), renormalised (Q / (sum Q + 1e-8)).  Differentiable in `forecast`.
    """
    n = forecast.shape[2] // ckeys.shape[2]
    visible = forecast_visibility(positions, ckeys.shape[1], sparse.kernel_size, sparse.kernel_stride)
    probs = sel.group_softmax_scores(forecast, ckeys, visible)
    probs = torch.where(visible[:, None], probs, torch.zeros((), device=probs.device)) / n
    return renormalise(probs)


def _kl_sum(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum P (log P - log Q), the sum F.kl_div(log Q, P, reduction="sum") computes."""
    return F.kl_div(q.log(), p, reduction="sum")


class TopkTargets(NamedTuple):
    """SparDA's top-k + rest target of some teacher rows (`topk_targets`), M = K * r supervised
    slots per row: index int64 / valid bool [B, H, R, M] (`supervised_keys`), target fp32
    [B, H, R, M + 1] (the teacher bucketed there, `bucket`).  A function of the teacher row and
    its position only, so computed once per cached row (`features.build_features`)."""

    index: torch.Tensor
    valid: torch.Tensor
    target: torch.Tensor

    def take(self, index: torch.Tensor) -> "TopkTargets":
        """Rows `index` [B, r] (int64, per sequence) of every field (the R axis, dim 2)."""

        def rows(t: torch.Tensor) -> torch.Tensor:
            view = index[:, None, :, None].expand(t.shape[0], t.shape[1], index.shape[1], t.shape[3])
            return torch.gather(t, 2, view)

        return TopkTargets(rows(self.index), rows(self.valid), rows(self.target))

    @staticmethod
    def cat(parts: list, dim: int) -> "TopkTargets":
        """Concatenate along `dim` (0: sequences, 2: query rows)."""
        return TopkTargets(*(torch.cat([getattr(p, f) for p in parts], dim=dim) for f in TopkTargets._fields))


@torch.no_grad()
def topk_targets(teacher: torch.Tensor, positions: torch.Tensor, sparse, kind: str = "selector") -> TopkTargets:
    """SparDA's top-k + rest target of teacher rows [B, H, R, C] at positions [B, R]; kind: the
    teacher's (`ObjectiveConfig.teacher`), which decides how blocks are ranked."""
    count = teacher.shape[-1]
    n_blocks = sel.num_blocks(int(positions.max()) + 1, sparse.block_size)
    ids = teacher_selection(teacher, positions, sparse, n_blocks, kind)
    index, valid = supervised_keys(ids, positions, sparse, n_blocks, count)
    return TopkTargets(index, valid, bucket(teacher, index, valid))


def rows_kl(
    forecast: torch.Tensor,
    ckeys: torch.Tensor,
    positions: torch.Tensor,
    teacher: torch.Tensor,
    sparse,
    loss: str,
    targets: TopkTargets | None = None,
) -> torch.Tensor:
    """Summed KL of some query rows: forecast [B, R, H*n, d], ckeys [B, C, H, d], positions [B, R],
    teacher [B, H, R, C] (`teacher_rows`).  loss "full": KL over the whole row; "topk": over the
    teacher's supervised keys plus the rest bucket, from `targets` (the rows' cached
    `topk_targets`) or, when None, computed here.  fp32 scalar, differentiable in `forecast`."""
    if loss == "topk":
        if targets is None:
            targets = topk_targets(teacher, positions, sparse)
        student = bucket(student_rows(forecast, ckeys, positions, sparse), targets.index, targets.valid)
        return _kl_sum(targets.target, student)
    student = student_rows(forecast, ckeys, positions, sparse).clamp(min=EPS)
    return (teacher * (teacher.clamp(min=EPS).log() - student.log())).sum()


# ----------------------------------------------------------------------------------------------
# one layer
# ----------------------------------------------------------------------------------------------


def layer_loss(
    queries: torch.Tensor,
    keys: torch.Tensor,
    ckeys: torch.Tensor,
    forecast: torch.Tensor,
    positions: torch.Tensor,
    sparse,
    objective: ObjectiveConfig | None = None,
) -> torch.Tensor:
    """The Forecast loss of one layer: sum over (b, g, t) of the KL, / (B * H_kv * T).

    queries [B, T, Hq, d]: the layer's post-RoPE queries; keys [B, T, H, d]: its post-RoPE keys;
    ckeys [B, C, H, d]: its deployed compressed keys (`compress_keys(keys, p, s)`); forecast
    [B, T, H*n, d]: the vectors scoring this layer (layer l-1's forecast_proj, layer 0's
    current_proj); positions [B, T] (0..T-1).  Returns a fp32 scalar, differentiable in `forecast`
    only.  The teacher runs under no_grad chunk by chunk; each chunk's student part runs under
    activation checkpointing, so backward too holds one chunk's [H, chunk, C] at a time.
    """
    objective = objective or ObjectiveConfig()
    batch, length = positions.shape
    count, heads = ckeys.shape[1], ckeys.shape[2]
    ckeys = ckeys.detach()
    read = teacher_keys(keys.detach(), objective)
    total = forecast.new_zeros((), dtype=torch.float32)
    for start in range(0, length, objective.chunk_size):
        rows = slice(start, start + objective.chunk_size)
        pos = positions[:, rows]
        teacher = teacher_rows(queries[:, rows].detach(), read, pos, sparse, objective, count)
        targets = topk_targets(teacher, pos, sparse, objective.teacher) if objective.loss == "topk" else None
        args = (forecast[:, rows], ckeys, pos, teacher, sparse, objective.loss, targets)
        if torch.is_grad_enabled() and forecast.requires_grad:
            total = total + checkpoint(rows_kl, *args, use_reentrant=False)
        else:
            total = total + rows_kl(*args)
    return total / (batch * heads * length)
