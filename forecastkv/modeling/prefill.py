"""Multi-token attention (prefill, chunked continuation): MiniCPM's dense/sparse rule, dense
attention, and block-sparse attention whose cost follows the selected blocks, not T x S.

Shapes: B batch, T new rows, S stored keys, Hq query heads, H KV heads, G = Hq / H, d head dim,
NB key blocks of `block_size`, K selection width.  Keys, values and NOSA's CIS bias stay in the
cache's [B, S, H, ...] layout: GQA is handled by folding each group's G query heads into rows,
never by repeating K/V per query head.

Three attention back ends, one semantics (a row at position t attends keys <= t, inside its
selected blocks when sparse, with the CIS bias added after the 1/sqrt(d) scaling):
  * `dense_attention`: flash-attn when installed on CUDA, else SDPA (one causal call for a fresh
    prefill, query chunks with a [R, S] mask otherwise);
  * `chunked_sparse_attention`: the reference and CPU path.  Rows are cut into tiles of
    `block_size` rows; a tile gathers the union of its rows' selected blocks (rows of one query
    block share the forced init and local blocks) and each row is masked to its own set;
  * `flex_sparse_attention`: CUDA, PyTorch's FlexAttention with a BlockMask built from the same
    selections (a query tile's KV blocks = the union of its rows' selections, `mask_mod` checks
    each row's own set from a bit mask, `score_mod` adds the CIS bias).  Compiled once per shape
    bucket (`flex_bucket`: rows and keys zero-padded, `start` a tensor), used on auto for calls
    of at least FLEX_MIN_ROWS rows; an eager fallback warns with its shape (`FLEX_FALLBACKS`).

Cost notes (SmolLM2 at 8K on one CPU thread, benchmarks/prefill.py): of dense prefill's ~40 s,
~18 s is outside attention (projections, MLP) and stays; causal attention is ~22-27 s.  The sparse
path spends ~3.5-4 s in stage-1 selection and ~12-14 s in attention.  At layer 10 a row attends
11.5 blocks on average (budget 12) while a 64-row tile's union is 19.0 blocks (6.9 shared by
every row of the tile), and the masked SDPA over the union runs at about causal flash's cost per
key.  Two exact alternatives were measured on captured layers and found level with the union,
not faster: key-block-major attention (each KV block attends only the rows that chose it, merged
by log-sum-exp) and a hybrid (the tile's shared blocks as one matmul, the rest block-major).
Their matmuls reach the selected-FLOP floor (~150 ms per layer at ~90 GFLOP/s), but the eager
per-block ops cost as much as the union saves; floor plus stage 1 is ~0.27 s per layer, so even
with zero overhead CPU prefill would sit near 0.7x dense.  Beating that needs a fused CPU kernel.
At 128K on CUDA stage 1 ([Hq, T, C] scores, C ~ T / kernel_stride) is the expected bottleneck:
half-precision logits go through a tensor-core matmul with fp32 output, chunks whose rows all
see a coarse key skip the exact LSE, query chunks take their position bounds from one host copy
per call (no CUDA sync per chunk), and on CUDA the fused stage-1 kernel (`kernels/stage1.py`:
score, LSE, group sum, pool, force and NOSA's agnostic score without materialising the [rows, C]
scores; the top-k then runs on the 4x smaller [rows, NB] block scores) replaces the eager ops.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import kernels
from . import selection as sel

FLEX_Q_TILE = 128  # FlexAttention query tile (rows per BlockMask row)
CHUNKED_ATTENTION_ROWS = 1024  # rows per chunked_sparse_attention call: ~15% less attention time than 256 on CPU


# ----------------------------------------------------------------------------------------------
# MiniCPM's dense / sparse rule
# ----------------------------------------------------------------------------------------------


def dense_sequences(positions: torch.Tensor, sparse) -> torch.Tensor:
    """bool [B]: which sequences attend densely in this call.

    MiniCPM decides once per forward call from the key length; here it is decided per sequence,
    from that sequence's key length in this call (stored + new tokens = its last position + 1,
    because the cache stores positions 0..t contiguously): dense when `key length < dense_len`
    (`dense_len <= 0`: never), and every row of the sequence follows that one decision.  For
    batch 1 this is exactly MiniCPM's rule, and a sequence decides the same alone or in a batch.
    positions [B, T] (-1 = padding).  A dense model (`sparse` None) is dense everywhere.
    """
    return sel.dense_at(positions.amax(dim=1) + 1, sparse)


# ----------------------------------------------------------------------------------------------
# shared helpers
# ----------------------------------------------------------------------------------------------


def _fold_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [B, R, Hq, d] -> [B, H, G*R, d] (row g*R + r = head h*G + g at row r)."""
    batch, rows, heads, dim = q.shape
    return q.permute(0, 2, 1, 3).reshape(batch, kv_heads, (heads // kv_heads) * rows, dim)


def _unfold_output(out: torch.Tensor, rows: int) -> torch.Tensor:
    """[B, H, G*R, d] -> [B, R, Hq, d]."""
    batch, kv_heads, _, dim = out.shape
    return out.view(batch, kv_heads, -1, rows, dim).flatten(1, 2).transpose(1, 2)


def masked_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    bias: torch.Tensor | None,
    group: int,
) -> torch.Tensor:
    """Masked softmax attention over explicit keys, the G query heads of a KV head folded into rows:
    the one masked-SDPA of the package (prefill chunks, decode over gathered blocks).

    query [..., G*R, d], keys/values [..., L, d], allowed bool [..., R, L] (shared by the G heads),
    bias [..., L] (added after the 1/sqrt(d) scaling: NOSA's CIS) or None -> [..., G*R, d].
    Rows with no allowed key (padding) return zeros, not NaN.
    """
    empty = ~allowed.any(dim=-1, keepdim=True)
    allowed = allowed | empty
    logit_bias = (
        torch.zeros((), dtype=query.dtype, device=query.device) if bias is None else bias.unsqueeze(-2).to(query.dtype)
    )
    # a float mask runs the fused CPU kernel (about 2x faster than a bool mask there)
    mask = torch.where(allowed, logit_bias, torch.tensor(float("-inf"), dtype=query.dtype, device=query.device))
    shape = mask.shape
    mask = mask.unsqueeze(-3).expand(*shape[:-2], group, *shape[-2:]).reshape(*shape[:-2], group * shape[-2], shape[-1])
    if query.dim() > 4:  # the fused kernels take 4-D inputs
        lead = query.shape[:-3]
        flat = lambda t: t.expand(*lead, *t.shape[-3:]).reshape(-1, *t.shape[-3:])
        out = F.scaled_dot_product_attention(flat(query), flat(keys), flat(values), attn_mask=flat(mask)).view(
            query.shape
        )
    else:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
    empty = empty.unsqueeze(-3).expand(*empty.shape[:-2], group, *empty.shape[-2:]).reshape(*empty.shape[:-2], -1, 1)
    return out.masked_fill(empty, 0.0)


def is_fresh_prefill(positions: torch.Tensor, key_count: int) -> bool:
    """True when every sequence's rows are exactly positions 0..T-1 and T == S (no padding, no cache)."""
    rows = positions.shape[1]
    if rows != key_count:
        return False
    return bool((positions == torch.arange(rows, device=positions.device)).all())


def _flash_attn_available(tensor: torch.Tensor) -> bool:
    return (
        tensor.is_cuda
        and tensor.dtype in (torch.float16, torch.bfloat16)
        and importlib.util.find_spec("flash_attn") is not None
    )


# ----------------------------------------------------------------------------------------------
# dense
# ----------------------------------------------------------------------------------------------


def dense_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """Causal attention by position.  q [B, T, Hq, d], keys/values [B, S, H, d], bias [B, S, H] or
    None, positions [B, T] (-1 = padding) -> [B, T, Hq, d] (padding rows 0)."""
    batch, rows, heads, dim = q.shape
    kv_heads, count = keys.shape[2], keys.shape[1]
    group = heads // kv_heads
    if bias is None and is_fresh_prefill(positions, count):
        if _flash_attn_available(q):  # flash-attn takes [B, T, H, d] and GQA natively
            from flash_attn import flash_attn_func

            return flash_attn_func(q, keys, values, causal=True)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return out.transpose(1, 2)
    k, v = keys.transpose(1, 2), values.transpose(1, 2)  # [B, H, S, d] views
    b_t = None if bias is None else bias.transpose(1, 2)[:, :, None]  # [B, H, 1, S]
    key_pos = torch.arange(count, device=q.device)
    outputs = []
    for start in range(0, rows, chunk):
        pos = positions[:, start : start + chunk]
        allowed = (key_pos.view(1, 1, -1) <= pos.unsqueeze(-1)).unsqueeze(1)  # [B, 1, R, S]
        query = _fold_queries(q[:, start : start + chunk], kv_heads)
        out = masked_attention(
            query, k, v, allowed.expand(-1, kv_heads, -1, -1), None if b_t is None else b_t[:, :, 0], group
        )
        outputs.append(_unfold_output(out, pos.shape[1]))
    return torch.cat(outputs, dim=1)


def masked_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    masks: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """A decode step over every stored key, each row allowed only the keys of its blocks (a dense
    sequence's masks hold every block up to its own): the decode path of a batch that mixes dense
    and sparse sequences.  Fixed shapes, nothing read back from the device.

    q [B, 1, Hq, d], keys/values [B, S, H, d], bias [B, S, H] or None, positions [B, 1],
    masks bool [B, H, 1, NB] (`row_block_masks`, NB * block_size >= S) -> [B, 1, Hq, d].
    """
    batch, _, heads, dim = q.shape
    kv_heads, count = keys.shape[2], keys.shape[1]
    key_pos = torch.arange(count, device=q.device)
    allowed = masks.repeat_interleave(block_size, dim=-1)[..., :count] & (key_pos <= positions.view(-1, 1, 1, 1))
    query = q.view(batch, kv_heads, heads // kv_heads, dim)  # the G heads of a KV head as rows
    b_t = None if bias is None else bias.transpose(1, 2)
    out = masked_attention(query, keys.transpose(1, 2), values.transpose(1, 2), allowed, b_t, heads // kv_heads)
    return out.reshape(batch, 1, heads, dim)


# ----------------------------------------------------------------------------------------------
# block-sparse, chunked (reference and CPU path)
# ----------------------------------------------------------------------------------------------


def row_block_masks(
    ids: torch.Tensor, positions: torch.Tensor, n_blocks: int, block_size: int, dense_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """bool [B, H, R, NB]: the blocks each row attends.  ids [B, H, R, K] (-1 = none), positions
    [B, R]; rows of sequences marked in `dense_rows` [B] attend every block up to their own."""
    masks = sel.selection_mask(ids, n_blocks)
    if dense_rows is not None:  # the caller passes it only when some sequence is dense
        visible = torch.arange(n_blocks, device=ids.device).view(1, 1, -1) <= torch.div(
            positions, block_size, rounding_mode="floor"
        ).unsqueeze(-1)
        masks = torch.where(
            dense_rows.view(-1, 1, 1, 1), visible.unsqueeze(1) & (positions >= 0)[:, None, :, None], masks
        )
    return masks


def _tile_unions(masks: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tile of `tile` rows, the union of its rows' blocks, highest block first, padded.

    masks bool [B, H, R, NB] -> (tiled row masks [B, H, n, tile, NB], union ids int64 [B, H, n, U]
    (padding -> 0), union valid bool [B, H, n, U]); U = the largest union in this call.  Highest
    first: the blocks holding the tile's own rows (the only ones needing a per-key causal test)
    come first.
    """
    batch, heads, rows, n_blocks = masks.shape
    n_tiles = -(-rows // tile)
    if n_tiles * tile != rows:
        masks = F.pad(masks, (0, 0, 0, n_tiles * tile - rows))
    tiled = masks.view(batch, heads, n_tiles, tile, n_blocks)
    union = tiled.any(dim=3)  # [B, H, n, NB]
    width = max(int(union.sum(dim=-1).max()), 1)
    ranked = torch.where(union, torch.arange(n_blocks, device=masks.device), -1)
    ids = torch.topk(ranked, width, dim=-1).values  # descending, -1 = padding
    valid = ids >= 0
    return tiled, ids.clamp(min=0), valid


def block_layout(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, S, H, ...] -> contiguous [B, H, NB, block_size, ...], zero padded past S (one copy per
    layer call, per KV head: what the chunks gather whole blocks from)."""
    batch, count, heads = x.shape[:3]
    n_blocks = -(-count // block_size)
    out = x.new_zeros((batch, heads, n_blocks * block_size, *x.shape[3:]))
    out[:, :, :count] = x.transpose(1, 2)
    return out.view(batch, heads, n_blocks, block_size, *x.shape[3:])


@dataclass(frozen=True)
class BlockSource:
    """Where `chunked_sparse_attention` reads key blocks from.  keys/values [N, unit, d] and bias
    [N, unit] or None hold pieces of `unit` rows; index int64 [B, H, NB, per] names the per =
    block_size / unit pieces of block j of sequence b, KV head h, in position order.

    `laid_out` copies a cache's [B, S, H, ...] rows into `block_layout` (one piece per block); an
    engine's pages are a source as they are (`serving/paged.py:PagedRows.block_source`: one piece
    per page), so a prefill chunk over a long stored context copies only the blocks its rows chose."""

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor | None
    index: torch.Tensor

    @classmethod
    def laid_out(cls, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, block_size: int):
        """keys/values [B, S, H, d], bias [B, S, H] or None -> a source of whole blocks (zero past S)."""
        k, v = block_layout(keys, block_size), block_layout(values, block_size)
        batch, heads, n_blocks = k.shape[:3]
        b = None if bias is None else block_layout(bias, block_size).view(-1, block_size)
        index = torch.arange(batch * heads * n_blocks, device=keys.device).view(batch, heads, n_blocks, 1)
        return cls(k.view(-1, block_size, k.shape[-1]), v.view(-1, block_size, v.shape[-1]), b, index)

    @property
    def n_blocks(self) -> int:
        return self.index.shape[2]

    def gather(self, entry: torch.Tensor, blocks: torch.Tensor) -> tuple:
        """entry [m] (b * H + h), blocks int64 [m, w] -> fresh copies of those blocks' keys and values
        [m, 1, w * block_size, d] and bias [m, 1, w * block_size] or None."""
        members, width = blocks.shape
        flat = self.index.flatten(0, 1)[entry.unsqueeze(1), blocks].flatten()  # [m * w * per]
        rows = width * self.index.shape[3] * self.keys.shape[1]
        k, v = (x.index_select(0, flat).view(members, 1, rows, x.shape[-1]) for x in (self.keys, self.values))
        bias = None if self.bias is None else self.bias.index_select(0, flat).view(members, 1, rows)
        return k, v, bias


def chunked_sparse_attention(
    q: torch.Tensor,
    keys: torch.Tensor | None,
    values: torch.Tensor | None,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    masks: torch.Tensor,
    block_size: int,
    blocks: BlockSource | None = None,
) -> torch.Tensor:
    """Rows attend only their own blocks; work and memory follow the union of a tile's blocks.

    q [B, R, Hq, d], keys/values [B, S, H, d], bias [B, S, H] or None, positions [B, R] (-1 =
    padding), masks bool [B, H, R, NB] (`row_block_masks`; blocks after a row's own are ignored)
    -> [B, R, Hq, d].  `blocks`: where the key blocks are read (`BlockSource`), given by the caller
    once per layer; without it keys/values/bias are laid out here (`BlockSource.laid_out`).

    Rows are cut into tiles of `block_size` rows.  An entry is one (sequence, KV head, tile): its
    G query heads share one gather of the union's blocks (expanded over the heads, never copied)
    and one [tile, U * block_size] mask.  Entries are attended in groups of equal union width U,
    so no entry pays for another's larger union.
    """
    batch, rows, heads, dim = q.shape
    if blocks is None:
        blocks = BlockSource.laid_out(keys, values, bias, block_size)
    kv_heads = blocks.index.shape[1]
    group = heads // kv_heads
    if blocks.n_blocks < masks.shape[-1]:
        raise ValueError(f"the block source holds {blocks.n_blocks} blocks, the masks select among {masks.shape[-1]}")
    tile = min(block_size, rows)
    current = torch.div(positions, block_size, rounding_mode="floor")[:, None, :, None]
    masks = masks & (torch.arange(masks.shape[-1], device=q.device) <= current)  # nothing after a row's own block
    tiled, union, valid = _tile_unions(masks, tile)
    n_tiles = union.shape[2]
    entries = batch * kv_heads * n_tiles
    pad_rows = n_tiles * tile - rows
    pos = positions if pad_rows == 0 else F.pad(positions, (0, pad_rows), value=-1)
    entry_pos = pos.view(batch, 1, n_tiles, tile).expand(-1, kv_heads, -1, -1).reshape(entries, tile)
    entry_head = torch.arange(batch * kv_heads, device=q.device).repeat_interleave(n_tiles)  # b * H + h
    qt = q if pad_rows == 0 else F.pad(q, (0, 0, 0, 0, 0, pad_rows))
    query = (
        qt.view(batch, n_tiles, tile, kv_heads, group, dim)
        .permute(0, 3, 1, 4, 2, 5)
        .reshape(entries, group * tile, dim)
    )
    tiled, union, valid = tiled.reshape(entries, tile, -1), union.reshape(entries, -1), valid.reshape(entries, -1)
    widths = valid.sum(dim=-1)
    out = query.new_zeros(entries, group * tile, dim)  # entries without blocks (padding tiles) stay 0
    for width in widths.unique().tolist():
        if width == 0:
            continue
        members = (widths == width).nonzero().flatten()
        out[members] = _attend_entries(
            query[members], entry_pos[members], union[members, :width], tiled[members], entry_head[members],
            blocks, group, block_size,
        )
    out = (
        out.view(batch, kv_heads, n_tiles, group, tile, dim)
        .permute(0, 2, 4, 1, 3, 5)
        .reshape(batch, n_tiles * tile, heads, dim)
    )
    return out if pad_rows == 0 else out[:, :rows]


def _attend_entries(
    query, pos, union, tiled, entry_head, blocks: BlockSource, group: int, block_size: int
) -> torch.Tensor:
    """Attention of m entries that share a union width w.

    query [m, G*tile, d] (folded heads), pos [m, tile] (-1 = padding), union int64 [m, w] (block
    ids, highest first, all valid), tiled bool [m, tile, NB] (each row's blocks), entry_head int64
    [m] (b * H + h: where `blocks` finds the entry's blocks) -> [m, G*tile, d].
    """
    members, tile = pos.shape
    width = union.shape[1]
    dim = query.shape[-1]
    k, v, bias = blocks.gather(entry_head, union)  # [m, 1, w * bs, d], bias [m, 1, w * bs]
    own = torch.gather(tiled, -1, union.unsqueeze(1).expand(-1, tile, -1))  # [m, tile, w]
    empty = ~own.any(dim=-1, keepdim=True)  # padding rows: no block
    neg_inf = torch.tensor(float("-inf"), dtype=query.dtype, device=query.device)
    # repeat_interleave allocates: the in-place causal masking below must not write through a view
    mask = torch.where(own, torch.zeros((), dtype=query.dtype, device=query.device), neg_inf).repeat_interleave(
        block_size, dim=-1
    )
    if bias is not None:  # CIS, added after the 1/sqrt(d) scaling
        mask = mask + bias.to(query.dtype)
    # causality inside blocks: a tile of <= block_size rows spans <= 2 blocks, the union's two highest
    near = min(2, width) * block_size
    near_pos = (union[:, :2].unsqueeze(-1) * block_size + torch.arange(block_size, device=query.device)).flatten(-2)
    future = near_pos.unsqueeze(1) > pos.unsqueeze(-1)  # [m, tile, near]
    mask[..., :near].masked_fill_(future, float("-inf"))
    # keys past every row of the tile (past the stored rows, in a source that holds stale or unwritten
    # rows there: an engine's pages) are masked for all rows; zero them so that NaN cannot leak in
    beyond = future.all(dim=1).view(members, 1, near, 1)
    for x in (k, v):  # fresh copies
        x[:, :, :near].masked_fill_(beyond, 0.0)
    has_empty = bool(empty.any())
    if has_empty:  # rows with no key: attend anything finite, zeroed below
        mask.masked_fill_(empty, 0.0)
    # the G heads read the same K/V (a stride-0 expand, no copy) and share one [tile, w*bs] mask
    k, v = k.expand(-1, group, -1, -1), v.expand(-1, group, -1, -1)
    out = F.scaled_dot_product_attention(query.view(members, group, tile, dim), k, v, attn_mask=mask.unsqueeze(1))
    out = out.reshape(members, group * tile, dim)
    if has_empty:
        out = out.view(members, group, tile, dim).masked_fill(empty.unsqueeze(1), 0.0).view(members, group * tile, dim)
    return out


# ----------------------------------------------------------------------------------------------
# block-sparse, FlexAttention (CUDA)
# ----------------------------------------------------------------------------------------------


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def pack_block_bits(masks: torch.Tensor) -> torch.Tensor:
    """bool [..., NB] -> int64 [..., ceil(NB / 64)]: bit j % 64 of word j // 64 = block j."""
    n_blocks = masks.shape[-1]
    words = -(-n_blocks // 64)
    padded = F.pad(masks, (0, words * 64 - n_blocks)).view(*masks.shape[:-1], words, 64)
    weights = torch.ones((), dtype=torch.int64, device=masks.device) << torch.arange(64, device=masks.device)
    return (padded.long() * weights).sum(dim=-1)  # distinct bits: the sum is the bitwise OR


FLEX_ROW_STEPS, FLEX_KEY_STEPS = 4, 1  # bucket steps per octave of rows and of keys


def flex_bucket(n: int, multiple: int, minimum: int = 0, steps: int = FLEX_ROW_STEPS) -> int:
    """`n` rounded up to a FlexAttention shape bucket: `steps` steps per octave (1, 2, 4, ...; 4:
    at most ~25% padding), a multiple of `multiple`, at least `minimum`.

    Padding costs no attention work (padded rows select no block, padded keys are in no block
    list), only the padded copies: rows (q and the output, Hq heads) get 4 steps per octave, keys
    (K/V, H heads) one, so a chunked 128K prefill whose key count grows chunk by chunk compiles
    once per doubling, not once per chunk."""
    n = max(n, minimum, 1)
    step = max(1 << max(n.bit_length() - 1 - (steps.bit_length() - 1), 0), multiple)
    step = -(-step // multiple) * multiple
    return -(-n // step) * step


def build_block_mask(
    bits: torch.Tensor, start, rows: int, key_count: int, block_size: int, group: int, q_tile: int = FLEX_Q_TILE
):
    """A FlexAttention BlockMask for rows at positions start..start+rows-1 of every sequence.

    bits int64 [B, H, rows, W] from `pack_block_bits` (rows and W may be padded with zeros:
    padded rows attend nothing); `start` an int or a 0-d int tensor (a tensor: the compiled
    FlexAttention sees it as an input, not a constant to recompile for).  A query tile's KV
    blocks are the union of its rows' blocks (mask_mod then checks each row's own bit and
    causality); heads are the Hq query heads, head hq reads KV head hq // group.
    """
    from torch.nn.attention.flex_attention import BlockMask

    batch, kv_heads, _, words = bits.shape
    n_blocks = -(-key_count // block_size)
    n_tiles = -(-rows // q_tile)
    pad = n_tiles * q_tile - bits.shape[2]
    tile_bits = F.pad(bits, (0, 0, 0, pad)).view(batch, kv_heads, n_tiles, q_tile, words)
    union_words = tile_bits[..., 0, :]
    for r in range(1, q_tile):  # OR over the tile's rows (q_tile small ops, no [rows, NB] tensor)
        union_words = union_words | tile_bits[..., r, :]
    shifts = torch.arange(64, device=bits.device)
    union = ((union_words.unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)[..., :n_blocks]  # [B, H, n, NB]
    if union.shape[-1] < n_blocks:
        union = F.pad(union, (0, n_blocks - union.shape[-1]))
    counts = union.sum(dim=-1).to(torch.int32)
    order = torch.sort((~union).to(torch.uint8), dim=-1, stable=True).indices.to(torch.int32)
    counts = counts.repeat_interleave(group, dim=1).contiguous()
    order = order.repeat_interleave(group, dim=1).contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        blk = kv_idx // block_size
        word = bits[b, h // group, q_idx, blk // 64]
        return (((word >> (blk % 64)) & 1) == 1) & (kv_idx <= q_idx + start)

    return BlockMask.from_kv_blocks(
        counts, order, BLOCK_SIZE=(q_tile, block_size), mask_mod=mask_mod, seq_lengths=(rows, key_count)
    )


# device type -> torch.compile backend of FlexAttention; a device type not named runs flex eagerly
# (unfused, O(T x S): CPU tests only).  Tests add "cpu" with a backend that counts compiles.
FLEX_COMPILE_BACKENDS: dict = {"cuda": "inductor"}
FLEX_RECOMPILE_LIMIT = 64  # compiled shape buckets kept per process (dynamo's default is 8)
FLEX_MIN_ROWS = 1024  # auto backend: flex for calls of at least this many rows, the chunked path below
FLEX_FALLBACKS: list[tuple] = []  # shapes (B, Hq, rows, keys, d) that ran flex eagerly: gpu_check reports them
_COMPILED_FLEX: dict = {}


def _dynamo_failures() -> tuple:
    """What a compiled flex call raises instead of running eagerly (fullgraph): the recompile
    limit (not a TorchDynamoException subclass) or anything dynamo cannot take whole."""
    import torch._dynamo.exc as exc

    return tuple(
        cls
        for cls in (getattr(exc, name, None) for name in ("TorchDynamoException", "FailOnRecompileLimitHit"))
        if cls is not None
    )


def _eager_flex(*args, **kwargs):
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():  # its warning says what the caller already knows: unfused
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


def _run_flex(query, key, value, **kwargs):
    """FlexAttention compiled once per shape bucket where `FLEX_COMPILE_BACKENDS` names the device
    (fullgraph, static shapes, the recompile limit raised to FLEX_RECOMPILE_LIMIT), eager elsewhere.
    Past the limit (or if dynamo cannot take the call whole) it warns with the shape, records it
    in FLEX_FALLBACKS and runs eagerly: O(T x S) memory, the fallback that runs out at long context."""
    backend = FLEX_COMPILE_BACKENDS.get(query.device.type)
    if backend is None:
        return _eager_flex(query, key, value, **kwargs)
    if backend not in _COMPILED_FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX[backend] = torch.compile(flex_attention, dynamic=False, fullgraph=True, backend=backend)
    try:
        with torch._dynamo.config.patch(
            recompile_limit=max(FLEX_RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
        ):
            return _COMPILED_FLEX[backend](query, key, value, **kwargs)
    except Exception as error:
        if not isinstance(error, _dynamo_failures()):
            raise
        shape = (query.shape[0], query.shape[1], query.shape[2], key.shape[2], query.shape[3])
        FLEX_FALLBACKS.append(shape)
        warnings.warn(
            f"FlexAttention fell back to eager (unfused, O(T x S) memory) for shape "
            f"[B, Hq, rows, keys, d] = {list(shape)}: "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
            RuntimeWarning,
            stacklevel=3,
        )
        return _eager_flex(query, key, value, **kwargs)


def _heads_first(x: torch.Tensor, length: int) -> torch.Tensor:
    """[B, L, H, d] -> a fresh contiguous [B, H, length, d], zero past L: one layout (strides
    included, which dynamo guards on) per bucket, whatever view of the cache x is."""
    out = x.new_zeros((x.shape[0], x.shape[2], length, x.shape[3]))
    out[:, :, : x.shape[1]] = x.transpose(1, 2)
    return out


def flex_sparse_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None,
    start: int,
    bits: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Block-sparse attention through FlexAttention.  q [B, T, Hq, d] at positions start..start+T-1
    of every sequence (no padding), keys/values [B, S, H, d], bias [B, S, H] or None, bits int64
    [B, H, T, W] (`pack_block_bits` of the row masks) -> [B, T, Hq, d].

    Rows and keys are zero-padded up to `flex_bucket`s and `start` is passed as a tensor, so the
    compiled kernel is built once per bucket, not per prompt length, chunk or start: padded keys
    lie after every real row's position (causally invisible), padded rows select no block.
    """
    batch, rows, heads, dim = q.shape
    count, kv_heads = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    rows_b = flex_bucket(rows, FLEX_Q_TILE)
    keys_b = flex_bucket(count, math.lcm(FLEX_Q_TILE, block_size), steps=FLEX_KEY_STEPS)
    words_b = -(-(keys_b // block_size) // 64)
    pad_rows, pad_keys = rows_b - rows, keys_b - count
    bits = F.pad(bits, (0, words_b - bits.shape[-1], 0, pad_rows))
    q_t, k_t, v_t = (_heads_first(x, n) for x, n in ((q, rows_b), (keys, keys_b), (values, keys_b)))
    start_t = torch.tensor(start, dtype=torch.int64, device=q.device)
    block_mask = build_block_mask(bits, start_t, rows_b, keys_b, block_size, group)
    score_mod = None
    if bias is not None:
        bias_t = F.pad(bias.transpose(1, 2).float(), (0, pad_keys)).contiguous()  # [B, H, S_b]

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias_t[b, h // group, kv_idx]

    out = _run_flex(
        q_t, k_t, v_t, score_mod=score_mod, block_mask=block_mask, scale=1.0 / math.sqrt(dim), enable_gqa=True
    )
    return out.transpose(1, 2)[:, :rows]


def use_flex(q: torch.Tensor) -> bool:
    """Whether block-sparse prefill of q [B, T, Hq, d] runs through FlexAttention: forced by the
    backend setting's prefill part, else (auto) on CUDA for calls of at least FLEX_MIN_ROWS rows
    (below that the chunked path is as fast and compiles nothing)."""
    backend = kernels.get_backend("prefill")  # the backend setting's prefill part
    if backend == "chunked":
        return False
    if backend == "flex":
        if not flex_available():
            raise RuntimeError("sparse prefill backend 'flex' was forced but this torch has no FlexAttention")
        return True
    return q.is_cuda and q.shape[1] >= FLEX_MIN_ROWS and flex_available()
