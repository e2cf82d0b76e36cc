"""Ops on plain tensors: one layer's decode step rebuilt from its keys, values and lengths alone.

Compressed keys (`selection.compress_keys`), block scores (`selection.score_blocks`, and the
decode-time `kernels.block_scores_reference`), the selection (`selection.select_blocks`, and
`selection.layer_selection` in one call) and the sparse decode attention
(`kernels.sparse_decode_blocks_reference`) take tensors, never a cache object, and give what
`SparseCache` and the model give for the same prompt: the cache layer's compressed keys, the
selection the step used and the layer's attention output (the input of `o_proj`).
"""

from __future__ import annotations

import pytest
import torch

from forecastkv import SparseCache, kernels
from forecastkv.modeling import selection as sel
from tests.helpers import rel, tiny_model

LAYER = 1  # a middle layer: with the forecast selector its vectors come from layer 0


def run_decode_step(model, prompt: torch.Tensor, layer: int) -> dict:
    """Prefill `prompt` [B, T] into a fresh SparseCache, then one decode step that records, for
    `layer`: the layer callback's arguments, the selections the model collected and the input of
    the layer's o_proj (its attention output [B, 1, Hq*d])."""
    seen: dict = {}

    def callback(idx, normed, positions, cos, sin, cache_layer):
        seen.setdefault("normed", {})[idx] = normed
        if idx == layer:
            seen.update(positions=positions, cos=cos, sin=sin, cache_layer=cache_layer)

    def o_proj_input(module, args):
        seen["attention"] = args[0]

    cache = SparseCache(model.config)
    inner = model.model
    with torch.no_grad():
        inner(prompt, cache=cache)
        hook = inner.layers[layer].self_attn.o_proj.register_forward_pre_hook(o_proj_input)
        try:
            step = torch.randint(3, 128, (prompt.shape[0], 1), generator=torch.Generator().manual_seed(5))
            _, _, selections = inner(step, cache=cache, collect_selections=True, layer_callback=callback)
        finally:
            hook.remove()
    seen["selections"] = selections[layer]
    return seen


def scoring_vectors(model, seen: dict, selector: str) -> torch.Tensor:
    """The vectors that score LAYER at the step, [B, 1, H*n, d]: its own queries, or the forecast
    vectors layer LAYER - 1 projects from its post-norm input."""
    cos, sin = seen["cos"], seen["sin"]
    layers = model.model.layers
    if selector == "query":
        return layers[LAYER].self_attn.queries(seen["normed"][LAYER], cos, sin)
    return layers[LAYER - 1].self_attn.project_forecast(seen["normed"][LAYER - 1], cos, sin)


@pytest.mark.parametrize("decode", ["gather", "kernels"])
@pytest.mark.parametrize(
    "policy, selector, prompt_length",
    [
        ("infllmv2", "query", 61),
        ("nosa", "query", 61),
        ("infllmv2", "forecast", 61),
        ("nosa", "forecast", 45),
        ("infllmv2", "query", 5),  # shorter than one block: one block, two compressed keys
        ("nosa", "query", 5),
    ],
)
@torch.no_grad()
def test_one_layer_from_tensors_equals_the_cache(policy, selector, prompt_length, decode):
    """Both decode paths (gather + SDPA, the sparse_decode kernel's reference) and both selectors."""
    model = tiny_model(mode={"policy": policy, "selector": selector})
    prompt = torch.randint(3, 128, (2, prompt_length), generator=torch.Generator().manual_seed(4))
    with kernels.use_backend("reference", decode=decode):
        seen = run_decode_step(model, prompt, LAYER)
    sparse = model.config.sparse
    layer = seen["cache_layer"]
    positions = seen["positions"]  # [B, 1]
    lengths = layer.lengths.clone()  # [B]: the prompt and the step's token
    assert lengths.tolist() == [prompt_length + 1] * 2 and positions[:, 0].tolist() == [prompt_length] * 2

    # the plain tensors: keys, values [B, S, H, d], NOSA's CIS [B, S, H]
    stored = int(lengths.max())
    keys, values = layer.store.keys[:, :stored], layer.store.values[:, :stored]
    cis = layer.store.cis[:, :stored] if policy == "nosa" else None

    ckeys = sel.compress_keys(keys, sparse.kernel_size, sparse.kernel_stride)
    assert ckeys.shape[1] == sel.num_compressed(stored, sparse.kernel_size, sparse.kernel_stride) > 0
    assert torch.equal(ckeys, layer.ckeys[:, : ckeys.shape[1]])

    vectors = scoring_vectors(model, seen, selector)
    n_blocks = sel.num_blocks(stored, sparse.block_size)
    lag = sel.visibility_lag(selector)
    scores = sel.score_blocks(vectors, ckeys, positions, sparse, n_blocks, kind=selector)  # [B, H, 1, NB]
    decode_scores = kernels.block_scores_reference(
        vectors[:, 0], ckeys, positions[:, 0], sparse, n_blocks, selector, lag
    )
    assert rel(decode_scores[scores[:, :, 0].isfinite()], scores[:, :, 0][scores[:, :, 0].isfinite()]) < 1e-6
    assert torch.equal(decode_scores.isinf(), scores[:, :, 0].isinf())
    agnostic = None if cis is None else sel.agnostic_block_scores(cis, positions, sparse, n_blocks, lag)
    selection = sel.select_blocks(scores, positions, sparse, agnostic)  # [B, H, 1, budget]
    assert torch.equal(selection, seen["selections"][selector])
    one_call = sel.layer_selection(vectors, ckeys, positions, sparse, selector, cis=cis)
    assert torch.equal(one_call, selection)
    assert (selection >= 0).any() and int(selection.max()) < n_blocks
    current = prompt_length // sparse.block_size
    if current > sparse.init_blocks + sparse.local_blocks:  # a free choice, not only forced blocks
        assert ((selection >= sparse.init_blocks) & (selection < current - sparse.local_blocks)).any()

    q = model.model.layers[LAYER].self_attn.queries(seen["normed"][LAYER], seen["cos"], seen["sin"])[:, 0]
    out, lse = kernels.sparse_decode_blocks_reference(
        q, keys, values, selection[:, :, 0], lengths, sparse.block_size, bias=cis
    )
    attention = seen["attention"].view(out.shape)
    assert torch.isfinite(lse).all()
    if decode == "kernels":  # the cache ran this very reference on its own buffers
        assert torch.equal(out, attention)
    else:
        assert rel(out, attention) < 1e-5
