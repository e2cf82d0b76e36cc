"""Block selection semantics: the single source of truth (kernels and training test against this).

Notation (all tensors batch-first):
  B batch, T / S key positions, Tq query rows, Hq query heads, H KV heads (H_kv), G = Hq / H group,
  d head dim, C compressed keys, NB key blocks, K selection width.
  p = kernel_size, s = kernel_stride, bs = block_size.

Conventions (InfLLM-v2 / MiniCPM4.1 as the InfLLM-v2 and NOSA reference code does them):
  * compressed key c is the mean of post-RoPE keys [c*s, c*s + p); only complete windows exist;
  * a query at position t sees compressed key c when its window ended: c*s + p - 1 + lag <= t
    (`lag = 1` for the forecast selector, which scores the next layer's keys *before* that layer
    appends token t — exactly what the prefetching runtime sees);
  * block j pools (max) the compressed keys overlapping [j*bs, (j+1)*bs); for p = 2s and bs = 4s
    that is MiniCPM's max-pool (kernel 5, stride 4, padding 1);
  * init blocks (j < init_blocks) and the local window qb - local_blocks <= j <= qb (qb = t // bs,
    `local_blocks + 1` blocks) are forced to +inf;
  * top-k over blocks (ties: the lower block id wins), then ids in the future (j > qb) or with a
    -inf score become -1. Output rows are canonical: valid ids ascending, then -1 padding.
Scores of invisible compressed keys are -inf (MiniCPM's kernel writes 0, which ranks the same
because every visible probability is positive). Positions < 0 mark padding rows: nothing visible.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")
POS_INF = float("inf")


# ----------------------------------------------------------------------------------------------
# key compression
# ----------------------------------------------------------------------------------------------


def dense_at(key_length, sparse):
    """MiniCPM's dense / sparse rule, the one definition: a sequence attends densely while its key
    length is below `dense_len` (`dense_len <= 0`: never); a dense model (`sparse` None) always.
    key_length: an int, or a tensor of them (then a bool tensor of the same shape)."""
    if sparse is None or sparse.dense_len <= 0:
        dense = sparse is None
        return torch.full_like(key_length, dense, dtype=torch.bool) if isinstance(key_length, torch.Tensor) else dense
    return key_length < sparse.dense_len


def dense_row_blocks(lengths: torch.Tensor, dense: torch.Tensor, block_size: int, n_blocks: int, heads: int):
    """The selection [B, H, n_blocks] a decode step's dense rows attend when MiniCPM's rule is decided on
    the device (`dense_at` of a tensor, an engine's captured step): for a row marked in dense [B] every
    block up to its current one, for the others the current block only (their output is the sparse
    one: this keeps a kernel's work on them small); -1 elsewhere.  lengths [B]: keys stored, the new
    token's included.  Ascending ids, so the current block comes last (`PagedRows.attend_selected`)."""
    ids = torch.arange(n_blocks, device=lengths.device)
    current = torch.div(lengths - 1, block_size, rounding_mode="floor").view(-1, 1)
    keep = (ids == current) | (dense.view(-1, 1) & (ids < current))
    return torch.where(keep, ids, -1).unsqueeze(1).expand(-1, heads, -1)


def num_compressed(length: int, kernel_size: int, kernel_stride: int) -> int:
    """Number of complete compression windows over `length` keys."""
    return 0 if length < kernel_size else (length - kernel_size) // kernel_stride + 1


def compress_keys(keys: torch.Tensor, kernel_size: int, kernel_stride: int) -> torch.Tensor:
    """Mean of complete windows.  keys [B, T, H, ...] -> [B, C, H, ...], C = num_compressed(T)."""
    count = num_compressed(keys.shape[1], kernel_size, kernel_stride)
    if count == 0:
        return keys.new_zeros((keys.shape[0], 0, *keys.shape[2:]))
    windows = keys.unfold(1, kernel_size, kernel_stride)  # [B, C, H, ..., p]
    return windows.float().mean(dim=-1).to(keys.dtype)


def compressed_visibility(
    positions: torch.Tensor, num_keys: int, kernel_size: int, kernel_stride: int, lag: int = 0
) -> torch.Tensor:
    """positions [B, Tq] (int, -1 = padding) -> bool [B, Tq, C]: compressed key c is visible."""
    ends = torch.arange(num_keys, device=positions.device) * kernel_stride + kernel_size - 1 + lag
    return ends.view(1, 1, -1) <= positions.unsqueeze(-1)


def call_visibility(
    positions: torch.Tensor, num_keys: int, kernel_size: int, kernel_stride: int, lag: int, shared=None
) -> torch.Tensor:
    """`compressed_visibility`, made once per decode call given its `shared` indexes (`made_once`)."""
    key = ("visible", num_keys, kernel_size, kernel_stride, lag)
    return made_once(shared, key, lambda: compressed_visibility(positions, num_keys, kernel_size, kernel_stride, lag))


def visibility_lag(kind: str) -> int:
    """The visibility rule of selector `kind`, the one place it is written: the query selector
    scores its own layer's keys after the row's token was appended (lag 0); the forecast selector
    scores the next layer's keys before that layer appends token t (lag 1), what the prefetching
    runtime sees.  Deployed scoring, the decode kernels' callers and the training teacher and
    student all take it from here (with `compressed_visibility`), so training optimises exactly
    what is deployed."""
    lags = {"query": 0, "forecast": 1, "speculate": 1}  # speculate: a guess of the next layer's queries
    if kind not in lags:
        raise ValueError(f"score kind {kind!r} is not one of {tuple(lags)}")
    return lags[kind]


def score_kind(kind: str) -> str:
    """The scoring rule of selector `kind` as the kernels name it: "forecast" (the raw dot product when
    there is one vector per KV head, else the group softmax), or "query" (the group softmax) for the
    selectors that score with (guessed) queries: query and speculate."""
    return "forecast" if kind == "forecast" else "query"


def scores_are_logits(kind: str, vectors: torch.Tensor, ckeys: torch.Tensor) -> bool:
    """Whether `kind`'s block scores are raw logits (forecast with one vector per KV head: a dot product)
    rather than probability-like (summed softmax); what a top-p budget turns into mass (`block_mass`)."""
    return kind == "forecast" and vectors.shape[2] == ckeys.shape[2]


# ----------------------------------------------------------------------------------------------
# stage-1 scores
# ----------------------------------------------------------------------------------------------


# torch.bmm(a, b, out_dtype=torch.float32): CUDA only, torch >= 2.8
_BMM_FP32_OUT = "dtype" in torch.ops.aten.bmm.overloads()


def _head_logits(vectors: torch.Tensor, ckeys: torch.Tensor, scale: float) -> torch.Tensor:
    """vectors [B, Tq, H*n, d], ckeys [B, C, H, d] -> fp32 logits [B, H, n, Tq, C].

    Half-precision CUDA inputs without autograd take a tensor-core matmul with fp32 accumulation
    and output: a bf16 x bf16 (or fp16 x fp16) product is exact in fp32, so that gives the fp32
    logits (up to summation order) without upcast copies or a CUDA-core fp32 matmul."""
    batch, rows, heads_total, dim = vectors.shape
    count, heads = ckeys.shape[1], ckeys.shape[2]
    per = heads_total // heads
    tensor_cores = (
        _BMM_FP32_OUT
        and vectors.is_cuda
        and vectors.dtype in (torch.float16, torch.bfloat16)
        and ckeys.dtype == vectors.dtype
        and not (torch.is_grad_enabled() and (vectors.requires_grad or ckeys.requires_grad))
    )
    if tensor_cores:  # the n heads of a group fold into rows: K is read once
        v = vectors.view(batch, rows, heads, per, dim).permute(0, 2, 3, 1, 4).reshape(batch * heads, per * rows, dim)
        k = ckeys.permute(0, 2, 3, 1).reshape(batch * heads, dim, count)
        logits = torch.bmm(v, k, out_dtype=torch.float32)
        return (logits.mul_(scale) if scale != 1.0 else logits).view(batch, heads, per, rows, count)
    # the n heads of a group fold into rows (K read once, not expanded per head); scale the small side
    v = vectors.float().view(batch, rows, heads, per, dim).permute(0, 2, 3, 1, 4).reshape(batch, heads, -1, dim)
    k = ckeys.float().permute(0, 2, 3, 1)  # [B, H, d, C]: a transposed matrix per head where ckeys is [B, H, C, d]
    return torch.matmul(v * scale if scale != 1.0 else v, k).view(batch, heads, per, rows, count)


def _mask_invisible_(scores: torch.Tensor, visible: torch.Tensor, masked_from: int, fill: float) -> torch.Tensor:
    """scores [B, ..., Tq, C] with `fill` where `visible` [B, Tq, C] (broadcast over the middle
    dims) is False, in place.  Columns < `masked_from` are visible to every row and are skipped
    (a prefill chunk masks only the few keys its rows disagree on, not the whole [Tq, C])."""
    view = scores[..., masked_from:]
    hidden = ~visible[..., masked_from:]
    view.masked_fill_(hidden.view(hidden.shape[0], *([1] * (scores.dim() - 3)), *hidden.shape[1:]), fill)
    return scores


def group_softmax_scores(
    vectors: torch.Tensor,
    ckeys: torch.Tensor,
    visible: torch.Tensor,
    lse_keys: torch.Tensor | None = None,
    lse_visible: torch.Tensor | None = None,
    masked_from: int = 0,
    coarse_everywhere: bool = False,
) -> torch.Tensor:
    """InfLLM-v2 stage 1: per-head softmax of v.Kc/sqrt(d) over visible keys, summed per GQA group.

    vectors [B, Tq, H*n, d] (n heads per group, consecutive), ckeys [B, C, H, d], visible [B, Tq, C].
    With `lse_keys` [B, C2, H, d] (+ `lse_visible` [B, Tq, C2]) each head is normalised with the
    log-sum-exp over those coarse keys (MiniCPM4.1's estimate); rows that see no coarse key fall
    back to the exact LSE (`coarse_everywhere`: a promise that every row sees a coarse key, which
    saves computing the exact LSE).  `masked_from`: keys below it are visible to every row (a
    promise that saves masking them).  Returns fp32 [B, H, Tq, C]; invisible entries are -inf.
    """
    scale = 1.0 / math.sqrt(vectors.shape[-1])
    logits = _mask_invisible_(_head_logits(vectors, ckeys, scale), visible, masked_from, NEG_INF)
    if lse_keys is None:
        # exact LSE: one fused softmax pass (a row seeing no key gives NaN, masked to -inf below)
        probs = torch.softmax(logits, dim=-1)
    else:
        coarse = _head_logits(vectors, lse_keys, scale).masked_fill_(~lse_visible[:, None, None], NEG_INF)
        lse = torch.logsumexp(coarse, dim=-1, keepdim=True)
        if not coarse_everywhere:  # rows seeing no coarse key fall back to the exact LSE
            lse = torch.where(torch.isfinite(lse), lse, torch.logsumexp(logits, dim=-1, keepdim=True))
        probs = torch.exp(logits - lse.nan_to_num(neginf=0.0))  # exp(-inf) = 0 where invisible
    return _mask_invisible_(probs.sum(dim=2), visible, masked_from, NEG_INF)


def dot_scores(vectors: torch.Tensor, ckeys: torch.Tensor, visible: torch.Tensor, masked_from: int = 0) -> torch.Tensor:
    """SparDA forecast scoring with one vector per KV head: the raw dot product (no scale, no softmax).

    vectors [B, Tq, H, d], ckeys [B, C, H, d], visible [B, Tq, C] -> fp32 [B, H, Tq, C], -inf invisible.
    """
    return _mask_invisible_(_head_logits(vectors, ckeys, 1.0)[:, :, 0], visible, masked_from, NEG_INF)


def keys_seen(position: int, num_keys: int, kernel_size: int, kernel_stride: int, lag: int) -> int:
    """How many of `num_keys` compressed keys a row at `position` sees (`compressed_visibility`
    is a prefix: key c is visible when c * s + p - 1 + lag <= position); 0 for padding (-1)."""
    if position < 0:
        return 0
    return min(num_keys, max(0, (position - kernel_size + 1 - lag) // kernel_stride + 1))


def position_range(positions: torch.Tensor) -> tuple[int, int]:
    """(lowest, highest) entry of positions [B, Tq], read on the host in one go (one CUDA sync)."""
    low, high = torch.aminmax(positions)
    return int(low), int(high)


# ----------------------------------------------------------------------------------------------
# pooling, forcing, top-k
# ----------------------------------------------------------------------------------------------


def num_blocks(length: int, block_size: int) -> int:
    return -(-length // block_size)


def block_pool_geometry(kernel_size: int, kernel_stride: int, block_size: int) -> tuple[int, int, int]:
    """(window, stride, left padding) of the max-pool from compressed keys to blocks.

    Block j pools compressed keys c with c*s < (j+1)*bs and c*s + p > j*bs.
    """
    ratio = block_size // kernel_stride
    first = (-kernel_size) // kernel_stride + 1  # lowest c overlapping block 0 (may be < 0)
    return ratio - first, ratio, -first


def pool_to_blocks(
    scores: torch.Tensor, n_blocks: int, kernel_size: int, kernel_stride: int, block_size: int
) -> torch.Tensor:
    """Max over the compressed keys overlapping each block.  [..., C] -> [..., n_blocks] (-inf if none)."""
    lead = scores.shape[:-1]
    if n_blocks <= 0 or math.prod(lead) == 0:
        return scores.new_full((*lead, max(n_blocks, 0)), NEG_INF)
    window, stride, pad_left = block_pool_geometry(kernel_size, kernel_stride, block_size)
    needed = (n_blocks - 1) * stride + window
    pad_right = max(0, needed - pad_left - scores.shape[-1])
    padded = F.pad(scores, (pad_left, pad_right), value=NEG_INF)[..., :needed]
    # max_pool1d: ~3x faster than unfold + amax on the CPU, same values (a max is exact)
    return F.max_pool1d(padded.reshape(-1, 1, needed), window, stride).view(*lead, n_blocks)


def forced_blocks(
    positions: torch.Tensor, n_blocks: int, block_size: int, init_blocks: int, local_blocks: int
) -> torch.Tensor:
    """bool [B, Tq, NB]: init blocks and the local window qb-local..qb (padding rows: none)."""
    blocks = torch.arange(n_blocks, device=positions.device).view(1, 1, -1)
    current = torch.div(positions, block_size, rounding_mode="floor").unsqueeze(-1)
    valid = positions.unsqueeze(-1) >= 0
    forced = (blocks < init_blocks) | ((blocks >= current - local_blocks) & (blocks <= current))
    return forced & valid


def force_blocks(
    block_scores: torch.Tensor, positions: torch.Tensor, block_size: int, init_blocks: int, local_blocks: int,
    shared=None,
) -> torch.Tensor:
    """Set init and local blocks of [B, H, Tq, NB] scores to +inf (shared: `made_once`'s)."""
    n = block_scores.shape[-1]
    forced = made_once(
        shared, ("forced", n, block_size, init_blocks, local_blocks),
        lambda: forced_blocks(positions, n, block_size, init_blocks, local_blocks)[:, None],
    )
    return block_scores.masked_fill(forced, POS_INF)


def made_once(shared, key, make):
    """make(): a mask of the call's positions.  Given `shared`, a decode call's indexes that every layer
    computes alike (`serving/paged.py:CallIndexes`: the same positions in every layer), the one the
    call's first layer made."""
    return make() if shared is None else shared.get(key, make)


def descending_order(scores: torch.Tensor, take: int) -> torch.Tensor:
    """The first `take` indices of a stable descending sort of fp32 `scores` [..., N] (ties: the
    lower index first), int64 [..., take].

    A top-k over unique int64 keys (the score's order-preserving bits, then the reversed index)
    instead of a full sort: about 2x faster on the CPU, and exactly the stable sort's order.
    """
    n = scores.shape[-1]
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes +0.0 and ties with it
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # int order = float order
    keys = (ordered << 32) | (n - 1 - torch.arange(n, device=scores.device))
    return (n - 1) - (torch.topk(keys, take, dim=-1).values & 0xFFFFFFFF)


def topk_blocks(block_scores: torch.Tensor, positions: torch.Tensor, k: int, block_size: int) -> torch.Tensor:
    """Top-k block ids, [B, H, Tq, NB] -> int64 [B, H, Tq, k], canonical (ascending, -1 padded).

    Ties go to the lower block id; ids in the future of the row (j > t // bs) or with a -inf score
    become -1 after the top-k, as InfLLM-v2 does.
    """
    n_blocks = block_scores.shape[-1]
    take = min(k, n_blocks)
    order = descending_order(block_scores, take)
    chosen = torch.gather(block_scores, -1, order)
    current = torch.div(positions, block_size, rounding_mode="floor")[:, None, :, None]
    invalid = (order > current) | (chosen == NEG_INF)
    ids = order.masked_fill(invalid, n_blocks).sort(dim=-1).values  # invalid sort last
    ids = ids.masked_fill(ids == n_blocks, -1)
    if take < k:
        ids = F.pad(ids, (0, k - take), value=-1)
    return ids


def selection_mask(ids: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """ids [..., K] (-1 = none) -> bool [..., NB]."""
    mask = torch.zeros((*ids.shape[:-1], n_blocks + 1), dtype=torch.bool, device=ids.device)
    mask.scatter_(-1, ids.masked_fill(ids < 0, n_blocks), True)
    return mask[..., :n_blocks]


# ----------------------------------------------------------------------------------------------
# whole selections
# ----------------------------------------------------------------------------------------------


def key_scores(
    vectors: torch.Tensor,
    ckeys: torch.Tensor,
    positions: torch.Tensor,
    sparse,
    kind: str = "query",
    lag: int | None = None,
    lse_keys: torch.Tensor | None = None,
    masked_from: int = 0,
    coarse_everywhere: bool = False,
    shared=None,
) -> torch.Tensor:
    """Stage-1 scores per compressed key, fp32 [B, H, Tq, C] (-inf where invisible).

    vectors [B, Tq, H*n, d]: queries (kind "query") or forecast vectors (kind "forecast"; n = 1 uses
    the raw dot product, n > 1 the group-summed softmax); ckeys [B, C, H, d]; positions [B, Tq];
    lag None = the rule of `kind` (`visibility_lag`); lse_keys [B, C2, H, d] selects the coarse LSE;
    masked_from: keys below it are visible to every row (`keys_seen` of the lowest position);
    coarse_everywhere: every row sees a coarse key (`group_softmax_scores`); shared: `made_once`'s.
    """
    p, s = sparse.kernel_size, sparse.kernel_stride
    lag = visibility_lag(kind) if lag is None else lag
    count = ckeys.shape[1]
    visible = call_visibility(positions, count, p, s, lag, shared)
    if scores_are_logits(kind, vectors, ckeys):
        return dot_scores(vectors, ckeys, visible, masked_from)
    lse_visible = None
    if lse_keys is not None:
        p2, s2 = sparse.coarse_kernel
        count2 = lse_keys.shape[1]
        lse_visible = call_visibility(positions, count2, p2, s2, lag, shared)
    return group_softmax_scores(vectors, ckeys, visible, lse_keys, lse_visible, masked_from, coarse_everywhere)


def score_blocks(
    vectors: torch.Tensor,
    ckeys: torch.Tensor,
    positions: torch.Tensor,
    sparse,
    n_blocks: int,
    kind: str = "query",
    lag: int | None = None,
    lse_keys: torch.Tensor | None = None,
    bounds: tuple[int, int] | None = None,
    shared=None,
) -> torch.Tensor:
    """Block scores ready for top-k: `key_scores` pooled to blocks, init/local forced to +inf.

    Arguments as `key_scores` (lag None: the visibility rule of `kind`).  Returns fp32
    [B, H, Tq, n_blocks].  Given `bounds` (lowest, highest entry of positions, host ints), only
    the keys some row sees are scored and only those not every row sees are masked (`keys_seen`),
    what keeps a prefill chunk cheap; without them every key is scored and masked (fixed shapes,
    nothing read back: a decode step).  The scores are the same either way.  shared: a decode call's
    masks, made by its first layer (`made_once`).
    """
    lag = visibility_lag(kind) if lag is None else lag
    p, s = sparse.kernel_size, sparse.kernel_stride
    masked_from, coarse_everywhere = 0, False
    if bounds is not None:
        # keys no row sees are not scored; keys every row sees are not masked
        first, last = bounds
        masked_from = keys_seen(first, ckeys.shape[1], p, s, lag)
        ckeys = ckeys[:, : keys_seen(last, ckeys.shape[1], p, s, lag)]
        if lse_keys is not None:
            coarse_everywhere = keys_seen(first, lse_keys.shape[1], *sparse.coarse_kernel, lag) > 0
            lse_keys = lse_keys[:, : keys_seen(last, lse_keys.shape[1], *sparse.coarse_kernel, lag)]
    scores = key_scores(
        vectors, ckeys, positions, sparse, kind, lag, lse_keys, masked_from, coarse_everywhere, shared
    )
    blocks = pool_to_blocks(scores, n_blocks, p, s, sparse.block_size)
    return force_blocks(blocks, positions, sparse.block_size, sparse.init_blocks, sparse.local_blocks, shared)


def pooled_agnostic_scores(
    pooled_cis: torch.Tensor, positions: torch.Tensor, sparse, n_blocks: int, lag: int = 0, shared=None
) -> torch.Tensor:
    """NOSA's query-agnostic block score from CIS already mean-pooled over the compression windows
    (what a cache keeps incrementally, so a decode step costs O(C), not a re-pool of every token):
    max-pooled to blocks, init and local forced, -inf for blocks in the future of each row.

    pooled_cis fp32 [B, C, H] (= compress_keys(cis.float())), positions [B, Tq] -> fp32 [B, H, Tq, NB];
    shared: a decode call's masks (`made_once`).
    """
    p, s, bs = sparse.kernel_size, sparse.kernel_stride, sparse.block_size
    count = pooled_cis.shape[1]
    visible = call_visibility(positions, count, p, s, lag, shared)
    scores = pooled_cis.float().permute(0, 2, 1)[:, :, None, :].expand(-1, -1, positions.shape[1], -1)
    scores = scores.masked_fill(~visible[:, None], NEG_INF)
    blocks = force_blocks(
        pool_to_blocks(scores, n_blocks, p, s, bs), positions, bs, sparse.init_blocks, sparse.local_blocks, shared
    )

    def future():  # [B, 1, Tq, NB]: blocks past each row's own
        blocks_at = torch.arange(n_blocks, device=positions.device).view(1, 1, 1, -1)
        return blocks_at > torch.div(positions, bs, rounding_mode="floor")[:, None, :, None]

    return blocks.masked_fill(made_once(shared, ("future", n_blocks, bs), future), NEG_INF)


def agnostic_block_scores(
    cis: torch.Tensor, positions: torch.Tensor, sparse, n_blocks: int, lag: int = 0
) -> torch.Tensor:
    """`pooled_agnostic_scores` from raw CIS [B, S, H] (mean-pooled like the keys) -> fp32 [B, H, Tq, NB]."""
    return pooled_agnostic_scores(
        compress_keys(cis.float(), sparse.kernel_size, sparse.kernel_stride), positions, sparse, n_blocks, lag
    )


def nosa_fill(
    query_ids: torch.Tensor, agnostic_scores: torch.Tensor, positions: torch.Tensor, k: int, block_size: int
) -> torch.Tensor:
    """Keep the query-aware shortlist and fill the budget from the static agnostic score.

    query_ids [B, H, Tq, Kq] (-1 = none), agnostic_scores [B, H, Tq, NB] -> int64 [B, H, Tq, k].
    """
    shortlist = selection_mask(query_ids, agnostic_scores.shape[-1])
    return topk_blocks(agnostic_scores.masked_fill(shortlist, POS_INF), positions, k, block_size)


def select_blocks(
    block_scores: torch.Tensor,
    positions: torch.Tensor,
    sparse,
    agnostic_scores: torch.Tensor | None = None,
    logits: bool = False,
) -> torch.Tensor:
    """The final selection [B, H, Tq, budget_blocks] for `sparse.policy` from forced block scores.

    infllmv2: top-(topk + local_blocks), or with `sparse.top_p` the top-p budget capped at that
    (`top_p_blocks`; logits: the scores are raw dot products, made mass by a softmax).
    nosa: a shortlist of init + local + query_blocks from the block scores, filled to the budget from
    `agnostic_scores` (see `agnostic_block_scores`).
    """
    budget = sparse.budget_blocks
    if sparse.policy == "infllmv2":
        if sparse.top_p:
            return top_p_blocks(block_scores, positions, sparse.top_p, budget, sparse.block_size, logits)
        return topk_blocks(block_scores, positions, budget, sparse.block_size)
    if agnostic_scores is None:
        raise ValueError("the nosa policy needs agnostic (CIS) block scores")
    shortlist_k = min(sparse.init_blocks + sparse.local_blocks + sparse.query_blocks, budget)
    shortlist = topk_blocks(block_scores, positions, shortlist_k, sparse.block_size)
    return nosa_fill(shortlist, agnostic_scores, positions, budget, sparse.block_size)


def layer_selection(
    vectors: torch.Tensor,
    ckeys: torch.Tensor,
    positions: torch.Tensor,
    sparse,
    kind: str,
    lse_keys: torch.Tensor | None = None,
    cis: torch.Tensor | None = None,
    pooled_cis: torch.Tensor | None = None,
    bounds: tuple[int, int] | None = None,
    n_blocks: int | None = None,
    force=None,
) -> torch.Tensor:
    """One layer's deployed selection int64 [B, H, Tq, budget_blocks]: `score_blocks` with the
    visibility rule of `kind`, then `select_blocks` (what `SparseAttention.select` runs).  force:
    scores [B, H, Tq, NB] -> scores with some blocks set to +inf before the top-k (a selector's carried
    and pinned blocks, `Selector.carry_into`), or None.

    vectors [B, Tq, H*n, d]; ckeys [B, C, H, d] (the layer's compressed keys); positions [B, Tq];
    lse_keys: coarse keys for MiniCPM's LSE estimate (query kind only); nosa: the layer's raw CIS
    cis [B, S, H], or pooled_cis fp32 [B, C, H] already pooled over the windows (a cache's).
    bounds: (lowest, highest) entry of positions as host ints: only the keys some row sees are
    scored.  n_blocks: the blocks to score, fixed by the caller (a decode step scores every key
    and block its buffers hold, so its shapes never change); without either the positions are
    read once.  The selection is the same whichever is given.

    Multi-row calls (prefill chunks) score through the fused stage-1 kernel where
    `kernels.use_stage1_kernel` says so (CUDA by default; `prefill_block_scores`), else through
    `score_blocks` here; either way the top-k is `select_blocks`, so the selection is the same.
    """
    if n_blocks is None:
        bounds = position_range(positions) if bounds is None else bounds
        n_blocks = num_blocks(bounds[1] + 1, sparse.block_size)
    coarse = lse_keys if kind == "query" else None
    if sparse.policy == "nosa" and pooled_cis is None and cis is None:
        raise ValueError(
            "the nosa policy needs the layer's CIS (cis [B, S, H] or pooled_cis [B, C, H]) to fill the budget"
        )
    logits = scores_are_logits(kind, vectors, ckeys)
    if vectors.shape[1] > 1 and bounds is not None and _fused_stage1(vectors.device):
        if sparse.policy == "nosa" and pooled_cis is None:
            pooled_cis = compress_keys(cis.float(), sparse.kernel_size, sparse.kernel_stride)
        scores, agnostic = prefill_block_scores(
            vectors, ckeys, positions, sparse, n_blocks, kind, coarse, pooled_cis, bounds
        )
        return select_blocks(scores if force is None else force(scores), positions, sparse, agnostic, logits)
    scores = score_blocks(vectors, ckeys, positions, sparse, n_blocks, kind=kind, lse_keys=coarse, bounds=bounds)
    agnostic = None
    if sparse.policy == "nosa":
        lag = visibility_lag(kind)
        if pooled_cis is not None:
            agnostic = pooled_agnostic_scores(pooled_cis, positions, sparse, n_blocks, lag)
        else:
            agnostic = agnostic_block_scores(cis, positions, sparse, n_blocks, lag)
    return select_blocks(scores if force is None else force(scores), positions, sparse, agnostic, logits)


def _fused_stage1(device: torch.device) -> bool:
    from .. import kernels  # imported here: kernels never import the modeling package

    return kernels.use_stage1_kernel(device)


def prefill_block_scores(
    vectors: torch.Tensor,
    ckeys: torch.Tensor,
    positions: torch.Tensor,
    sparse,
    n_blocks: int,
    kind: str,
    lse_keys: torch.Tensor | None,
    pooled_cis: torch.Tensor | None,
    bounds: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`score_blocks` (and for NOSA `pooled_agnostic_scores`) of many rows through the fused
    stage-1 kernel (`kernels.stage1_block_scores_triton`, whose reference these two functions
    are): fp32 [B, H, Tq, n_blocks] each, agnostic None without pooled_cis [B, C, H].  As in
    `score_blocks`, only the keys some row sees (`keys_seen` of bounds[1]) are scored."""
    from .. import kernels

    p, s = sparse.kernel_size, sparse.kernel_stride
    lag = visibility_lag(kind)
    ckeys = ckeys[:, : keys_seen(bounds[1], ckeys.shape[1], p, s, lag)]
    if lse_keys is not None:
        lse_keys = lse_keys[:, : keys_seen(bounds[1], lse_keys.shape[1], *sparse.coarse_kernel, lag)]
    if pooled_cis is not None:
        if pooled_cis.shape[1] < ckeys.shape[1]:
            raise ValueError(
                f"pooled_cis holds {pooled_cis.shape[1]} compressed entries, "
                f"fewer than the {ckeys.shape[1]} compressed keys scored"
            )
        pooled_cis = pooled_cis[:, : ckeys.shape[1]]  # entries past the last seen key are invisible to every row
    return kernels.stage1_block_scores_triton(
        vectors, ckeys, positions, sparse, n_blocks, score_kind(kind), lag, lse_keys, pooled_cis
    )


# ----------------------------------------------------------------------------------------------
# forecast recall
# ----------------------------------------------------------------------------------------------


def forecast_recall_counts(
    query_ids: torch.Tensor, forecast_ids: torch.Tensor, positions: torch.Tensor, sparse
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recall of the query selector's non-forced blocks by the forecast selection, and its chance level.

    query_ids, forecast_ids [B, H, Tq, K]; positions [B, Tq].  Returns (hits, wanted, chance), each
    fp32 [B, H, Tq]: hits = |Q ∩ F| and wanted = |Q| over non-forced valid blocks; chance = the
    expected hits if F's non-forced picks were drawn uniformly from the visible non-forced blocks.
    """
    n_blocks = int(max(query_ids.max(), forecast_ids.max(), 0)) + 1
    n_blocks = max(n_blocks, num_blocks(int(positions.max()) + 1, sparse.block_size))
    forced = forced_blocks(positions, n_blocks, sparse.block_size, sparse.init_blocks, sparse.local_blocks)[:, None]
    query = selection_mask(query_ids, n_blocks) & ~forced
    forecast = selection_mask(forecast_ids, n_blocks) & ~forced
    blocks = torch.arange(n_blocks, device=positions.device)
    visible_blocks = blocks.view(1, 1, -1) <= torch.div(positions, sparse.block_size, rounding_mode="floor").unsqueeze(
        -1
    )
    free = (visible_blocks[:, None] & ~forced).sum(-1).float()
    wanted = query.sum(-1).float()
    hits = (query & forecast).sum(-1).float()
    chance = wanted * forecast.sum(-1).float() / free.clamp(min=1)
    return hits, wanted, chance


# ----------------------------------------------------------------------------------------------
# the recall protocol's sums and report (the README's "Training Forecast heads"); the runner that
# measures them on a model is `training.recall.measure_recall_counts`
# ----------------------------------------------------------------------------------------------

RECALL_FIRST_LAYER = 1  # layer 0 is scored by its own current_proj, not forecast: left out of the mean


@dataclass
class RecallReport:
    """Forecast recall per layer with its chance level, on query rows t in [start, length).

    recall / chance: per layer (index = layer); mean_recall / mean_chance: the plain mean over
    layers >= RECALL_FIRST_LAYER; rows: query rows counted (sequences x rows per sequence);
    backbone: what the frozen model attended with ("dense" | "query" | "forecast").
    """

    start: int
    length: int
    rows: int
    backbone: str
    recall: list[float]
    chance: list[float]
    mean_recall: float
    mean_chance: float

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self, name: str = "recall") -> str:
        """A Markdown table: one row per layer, then the mean over layers >= 1."""
        return recall_table({name: (self.recall, self.mean_recall)}, self.chance, self.mean_chance)


def recall_table(columns: dict[str, tuple[list[float], float]], chance: list[float], mean_chance: float) -> str:
    """A Markdown table of recall per layer: one column per named series (per-layer recall, its
    mean over layers >= RECALL_FIRST_LAYER), chance last, then the row of means."""
    names = list(columns)
    lines = ["| layer | " + " | ".join(names) + " | chance |", "|---" * (len(names) + 2) + "|"]
    for i, c in enumerate(chance):
        lines.append(f"| {i} | " + " | ".join(f"{columns[n][0][i]:.3f}" for n in names) + f" | {c:.3f} |")
    lines.append(
        f"| mean (>= {RECALL_FIRST_LAYER}) | "
        + " | ".join(f"{columns[n][1]:.3f}" for n in names)
        + f" | {mean_chance:.3f} |"
    )
    return "\n".join(lines) + "\n"


def recall_row_sums(
    query_ids: torch.Tensor, forecast_ids: torch.Tensor, positions: torch.Tensor, sparse, start: int = 0
) -> torch.Tensor:
    """`forecast_recall_counts` summed over batch, heads and the rows with position >= start.

    query_ids, forecast_ids [B, H, Tq, K]; positions [B, Tq].  Returns fp64 [3]: hits, wanted, chance.
    """
    hits, wanted, chance = forecast_recall_counts(query_ids, forecast_ids, positions, sparse)
    keep = (positions >= start)[:, None].to(hits.dtype)
    return torch.stack([(x * keep).sum().double() for x in (hits, wanted, chance)]).cpu()


def summarise_recall(counts: torch.Tensor, start: int, length: int, rows: int, backbone: str) -> RecallReport:
    """counts fp64 [L, 3] (hits, wanted, chance summed per layer) -> a `RecallReport`."""
    wanted = counts[:, 1].clamp(min=1)
    recall = (counts[:, 0] / wanted).tolist()
    chance = (counts[:, 2] / wanted).tolist()
    tail = slice(RECALL_FIRST_LAYER, None) if len(recall) > RECALL_FIRST_LAYER else slice(None)
    mean = lambda values: sum(values[tail]) / len(values[tail])  # noqa: E731
    return RecallReport(start, length, rows, backbone, recall, chance, mean(recall), mean(chance))


# ----------------------------------------------------------------------------------------------
# top-p budgets (Twilight): the mass a block holds, and the blocks that reach p
# ----------------------------------------------------------------------------------------------


def row_blocks(positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """positions [B, Tq] -> [B, 1, Tq, 1], the block of each row (-1 for padding rows)."""
    return torch.div(positions, block_size, rounding_mode="floor")[:, None, :, None]


def block_mass(block_scores: torch.Tensor, logits: bool) -> torch.Tensor:
    """The normalised score mass of the non-forced finite blocks, fp32 [B, H, Tq, NB] (0 elsewhere).

    block_scores [B, H, Tq, NB] as `score_blocks` gives them (forced +inf, invisible -inf).
    logits True: a softmax over the finite entries (raw dot-product scores); False: score / sum of
    scores over them, negatives clamped to 0 (probability-like scores).  Each row sums to 1, or to 0
    when it has no finite entry or (logits False) no positive one.
    """
    scores = block_scores.float()
    finite = torch.isfinite(scores)
    if logits:
        peak = scores.masked_fill(~finite, NEG_INF).amax(dim=-1, keepdim=True)
        peak = peak.masked_fill(peak == NEG_INF, 0.0)  # a row with no finite entry: weights are 0 anyway
        weights = torch.exp(scores.masked_fill(~finite, NEG_INF) - peak)
    else:
        weights = scores.clamp(min=0).masked_fill(~finite, 0.0)
    total = weights.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, weights / total.clamp(min=torch.finfo(torch.float32).tiny), 0.0)


def top_p_blocks(
    block_scores: torch.Tensor, positions: torch.Tensor, p: float, cap: int, block_size: int, logits: bool
) -> torch.Tensor:
    """Twilight-style top-p budget: int64 [B, H, Tq, cap], canonical (ids ascending, -1 padding).

    block_scores [B, H, Tq, NB] (`score_blocks`: forced +inf, invisible -inf), positions
    [B, Tq].  Blocks in the row's future (j > t // bs) never count, forced or not.  The forced blocks
    are always taken (the lower ids when more than cap).  The others, in descending score order (ties:
    the lower id), are taken while the `block_mass` taken before them is below p, so the crossing block
    is the last; only blocks of positive mass count, and at most cap blocks are taken in all.  A row
    with no non-forced mass takes the forced blocks only; p = 1 takes every positive-mass block up to
    the cap.  Vectorised and without host reads (fixed shapes whatever p: a decode step).
    """
    if not 0 < p <= 1:
        raise ValueError(f"top-p needs 0 < p <= 1, got p = {p}")
    if cap < 1:
        raise ValueError(f"top-p needs a cap of at least 1 block, got cap = {cap}")
    n_blocks = block_scores.shape[-1]
    blocks = torch.arange(n_blocks, device=block_scores.device).view(1, 1, 1, -1)
    scores = block_scores.float().masked_fill(blocks > row_blocks(positions, block_size), NEG_INF)
    take = min(cap, n_blocks)
    order = descending_order(scores, take)  # forced (+inf) first by id, then the rest by score
    forced = torch.gather(scores, -1, order) == POS_INF
    mass = torch.gather(block_mass(scores, logits), -1, order)
    before = torch.cumsum(mass, dim=-1) - mass  # mass taken before each candidate
    wanted = mass > 0
    if p < 1:  # p = 1: every positive-mass block (a rounded cumulative sum may reach 1 early)
        wanted = wanted & (before < p)
    keep = forced | wanted
    ids = order.masked_fill(~keep, n_blocks).sort(dim=-1).values  # dropped ids sort last
    ids = ids.masked_fill(ids == n_blocks, -1)
    return F.pad(ids, (0, cap - take), value=-1) if take < cap else ids


# ----------------------------------------------------------------------------------------------
# what the selectors that score keys themselves share (`forecastkv/selectors/quest.py`, `oracle.py`)
# ----------------------------------------------------------------------------------------------


def check_group_heads(q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, keys_name: str) -> int:
    """The group size G = Hq // H of q [B, Tq, Hq, d] against keys [B, *, H, d] and positions
    [B, Tq]; a ValueError naming the shapes when they do not fit."""
    if q.dim() != 4 or keys.dim() != 4:
        raise ValueError(f"q {tuple(q.shape)} and {keys_name} {tuple(keys.shape)} must both be 4-d [B, *, heads, d]")
    if q.shape[0] != keys.shape[0] or q.shape[-1] != keys.shape[-1]:
        raise ValueError(
            f"q {tuple(q.shape)} and {keys_name} {tuple(keys.shape)} differ in batch or head dim (dims 0 and 3)"
        )
    heads_q, heads = q.shape[2], keys.shape[2]
    if heads == 0 or heads_q % heads != 0:
        raise ValueError(f"q has {heads_q} heads, not a multiple of the {heads} KV heads of {keys_name}")
    if tuple(positions.shape) != tuple(q.shape[:2]):
        raise ValueError(f"positions {tuple(positions.shape)} must be [B, Tq] = {tuple(q.shape[:2])}")
    return heads_q // heads


def grouped_heads(q: torch.Tensor, heads: int) -> torch.Tensor:
    """q [B, Tq, H*G, d] -> fp32 [B, H, G, Tq, d] (query head h*G + i is group h, member i)."""
    batch, rows, heads_q, dim = q.shape
    return q.float().view(batch, rows, heads, heads_q // heads, dim).permute(0, 2, 3, 1, 4)


def fit_blocks(scores: torch.Tensor, n_blocks: int, fill: float) -> torch.Tensor:
    """[..., N] -> [..., n_blocks]: truncated, or padded with `fill`."""
    width = scores.shape[-1]
    if width >= n_blocks:
        return scores[..., :n_blocks]
    return F.pad(scores, (0, n_blocks - width), value=fill)


# ----------------------------------------------------------------------------------------------
# recall against the oracle
# ----------------------------------------------------------------------------------------------


def selection_recall(
    ids: torch.Tensor, mass: torch.Tensor, oracle_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """How much of the oracle a selection holds: (mass_recall, overlap), each fp32 [B, H, Tq].

    ids [B, H, Tq, K] and oracle_ids [B, H, Tq, K2] (-1 = none), mass [B, H, Tq, NB]
    (`oracle_block_mass`).  mass_recall = the mass of ids' blocks / the mass of oracle_ids' blocks
    (1 where the oracle holds none; above 1 when ids hold more blocks than the oracle's k);
    overlap = |ids ∩ oracle_ids| / |valid oracle_ids| (1 where the oracle has none).
    """
    if ids.shape[:-1] != mass.shape[:-1] or oracle_ids.shape[:-1] != mass.shape[:-1]:
        raise ValueError(
            f"ids {tuple(ids.shape)}, oracle_ids {tuple(oracle_ids.shape)} and mass {tuple(mass.shape)} "
            "must share their leading [B, H, Tq] dims"
        )
    n_blocks = mass.shape[-1]
    chosen, best = selection_mask(ids, n_blocks), selection_mask(oracle_ids, n_blocks)
    mass = mass.float()
    held, best_held = (mass * chosen).sum(-1), (mass * best).sum(-1)
    mass_recall = torch.where(best_held > 0, held / best_held.clamp(min=torch.finfo(torch.float32).tiny), 1.0)
    wanted = best.sum(-1).float()
    overlap = torch.where(wanted > 0, (chosen & best).sum(-1).float() / wanted.clamp(min=1), 1.0)
    return mass_recall, overlap
