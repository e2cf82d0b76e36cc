"""`Selector`: what one block-selection rule owns, and the rule of scoring a layer's compressed keys.

The base class is the compressed-index rule that query, forecast and speculate share (InfLLM-v2's stage 1:
`modeling/selection.py`), scored with what `scores_with` names.  A selector that scores the keys or an
index of its own (Quest's bounds, the oracle's exact mass) is a `KeyScoringSelector` and defines
`selection`; reuse, which takes an anchor's blocks, overrides `select` and `plan`.  Shapes:
vectors [B, Tq, H*n, d], positions [B, Tq] (-1 = padding), a selection int64 [B, H, Tq, budget] of
canonical rows (`modeling/selection.py`), a decode `Plan` (`modeling/cache.py`) of its [B, H, budget].
"""

from __future__ import annotations

import abc

from ..modeling import selection as sel
from ..modeling.carry import force_ids

# what a selector scores with: the layer's own queries, the Forecast vectors the layer before makes,
# the queries the layer before guesses for it, or the blocks an anchor layer selected
SCORES_WITH = ("queries", "forecast", "guessed-queries", "blocks")


class Selector:
    """One selection rule.  Attributes (class-level, read by attention, the decoder loop, caches and runtime):

    name            the registered name (`forecastkv.selectors.REGISTERED`)
    scores_with     one of `SCORES_WITH`
    scoring         the stage-1 score kind of `modeling/selection.py` ("query", "forecast", "speculate"):
                    the group softmax or the raw dot product, and its visibility lag (`selection.visibility_lag`)
    plans_ahead     it knows a layer's blocks before that layer runs, so `forecast-offload` can fetch them
                    a layer ahead (the layer before plans them: `plan` on the next layer's cache)
    key_bounds      the cache keeps Quest's per-block key bounds for it (a window index)
    deployable      the offloaded runtime can run it (the oracle reads every key: it cannot)
    anchored        its layers take the blocks of anchor layers (`sparse_config.reuse_anchors`)
    carries         blocks a decode step carries into the next: the ones it attended most, in any layer,
                    forced into every layer's selection (`modeling/carry.py`); 0: none
    pins            blocks per layer and KV head the prompt's last rows attended most, forced into every
                    decode step's selection of that layer and head (`modeling/pins.py`); 0: none
    """

    name = ""
    scores_with = "queries"
    scoring = "query"
    plans_ahead = False
    key_bounds = False
    deployable = True
    anchored = False
    carries = 0
    pins = 0
    # derived once per class from the above (class attributes: a decode step reads them without a call)
    lag = 0  # the visibility lag of `scoring`: 0 after the row's token is stored, 1 before it (a layer ahead)
    needs_forecast_heads = False  # it scores with Forecast vectors: the model must carry Forecast heads

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.lag = sel.visibility_lag(cls.scoring)
        cls.needs_forecast_heads = cls.scores_with == "forecast"

    def __repr__(self) -> str:
        return f"<selector {self.name}>"

    # one object per rule: a copied or unpickled config (or cache) holds the registered one
    def __copy__(self) -> "Selector":
        return self

    def __deepcopy__(self, memo) -> "Selector":
        return self

    def __reduce__(self):
        from . import get_selector

        return get_selector, (self.name,)

    # -- the rule per layer -------------------------------------------------------------------
    def at_layer(self, layer_idx: int, sparse) -> "Selector":
        """The rule layer `layer_idx` selects by under this selector (the same on every layer here)."""
        return self

    def check(self, sparse, num_layers: int) -> None:
        """Raise a ConfigError when `sparse` does not fit a model of `num_layers` layers (nothing here)."""

    def handoff(self, attn, next_layer, hidden, normed, call, given, current: "Selector | None"):
        """What the layer before (module `attn`, its rule `current`, what it was given `given`) hands the
        layer this rule selects for: the Forecast vectors [B, T, H*n, d] when the call makes them."""
        if not call.want_forecast:
            return None
        return attn.project_forecast(normed, call.cos, call.sin)

    def rows(self, vectors, rows: slice):
        """The rows `rows` of what this rule scores with (a prefill chunk)."""
        return vectors[:, rows]

    # -- selection ----------------------------------------------------------------------------
    def select(self, vectors, positions, cache_layer, sparse, bounds=None, key_count=None):
        """The selection [B, H, Tq, budget] of `vectors` against `cache_layer`'s compressed keys.

        bounds (lowest, highest entry of positions) and key_count (the longest stored sequence): host
        ints the caller already holds; a prefill passes them so that its query chunks read nothing
        back from the device (else each is read, one CUDA sync each)."""
        # the incrementally pooled CIS: a decode step never re-pools every token, and an
        # offloaded cache keeps the raw CIS on the host
        ckeys, coarse, pooled = cache_layer.compressed(key_count)
        return sel.layer_selection(
            vectors,
            ckeys,
            positions,
            sparse,
            self.scoring,
            lse_keys=coarse if self.scoring == "query" else None,
            pooled_cis=pooled if sparse.policy == "nosa" else None,
            bounds=bounds,
            # a decode step beside sequences below dense_len selects here, not in `plan`: the same forced blocks
            force=lambda scores: self.carry_into(scores, cache_layer),
        )

    def plan(self, vectors, positions, cache_layer, sparse):
        """Select `cache_layer`'s blocks for a decode step and plan their fetch (vectors [B, 1, H*n, d],
        positions [B, 1]): the one place a decode `Plan` is made, for the layer itself or, a layer ahead,
        by the layer before.  Scores every key and block the buffers hold, masked by visibility: the
        same selection as the current length's, at shapes that stay fixed from step to step.  The
        cache layer's kernel choices decide between the decode-time scoring kernels and
        `selection.score_blocks` (what `select` runs)."""
        ckeys, coarse, pooled, stored = cache_layer.decode_index()
        n_blocks = sel.num_blocks(stored, sparse.block_size)
        coarse = coarse if self.scoring == "query" else None
        pooled = pooled if sparse.policy == "nosa" else None
        ops, lag, shared = cache_layer.kernels, self.lag, cache_layer.call_indexes()
        if ops.decode_kernels:  # the decode-time scoring kernels (Triton on CUDA), equal at one row
            pos = positions[:, 0]
            # the cache's own buffers, in range by construction: no Python-level checks per step
            scores = ops.block_scores(vectors[:, 0], ckeys, pos, sparse, n_blocks, sel.score_kind(self.scoring), lag,
                                      lse_keys=coarse, check_ids=False)
            agnostic = None
            if pooled is not None:
                agnostic = ops.agnostic_scores(pooled, pos, sparse, n_blocks, lag, check_ids=False).unsqueeze(2)
            scores = scores.unsqueeze(2)
        else:
            scores = sel.score_blocks(vectors, ckeys, positions, sparse, n_blocks, self.scoring, lag, lse_keys=coarse,
                                      shared=shared)
            agnostic = None if pooled is None else sel.pooled_agnostic_scores(
                pooled, positions, sparse, n_blocks, lag, shared=shared
            )
        logits = bool(sparse.top_p) and sel.scores_are_logits(self.scoring, vectors, ckeys)  # read by top-p only
        selection = sel.select_blocks(self.carry_into(scores, cache_layer), positions, sparse, agnostic, logits)
        return cache_layer.plan(selection[:, :, 0])

    def carry_into(self, scores, cache_layer):
        """Block scores [B, H, Tq, NB] with the blocks carried from the last decode step (`carries`) and the
        layer's pinned blocks (`pins`) forced; before a decode step nothing is carried or pinned yet."""
        carry = getattr(cache_layer, "carry", None)
        if self.carries and carry is not None:
            scores = carry.force(scores)
        return force_ids(scores, cache_layer.pinned) if self.pins and cache_layer.pinned is not None else scores


class KeyScoringSelector(Selector, abc.ABC):
    """A selector that scores the keys (or an index of its own) rather than the compressed index, through
    `selection(vectors, positions, cache_layer, sparse, n_blocks)` -> [B, H, Tq, budget]: a prefill chunk
    scores the blocks its rows reach, a decode step every block the buffers hold (fixed shapes)."""

    def select(self, vectors, positions, cache_layer, sparse, bounds=None, key_count=None):
        bounds = sel.position_range(positions) if bounds is None else bounds
        n_blocks = sel.num_blocks(bounds[1] + 1, sparse.block_size)
        return self.selection(vectors, positions, cache_layer, sparse, n_blocks)

    def plan(self, vectors, positions, cache_layer, sparse):
        n_blocks = sel.num_blocks(cache_layer.decode_index()[3], sparse.block_size)
        return cache_layer.plan(self.selection(vectors, positions, cache_layer, sparse, n_blocks)[:, :, 0])

    @abc.abstractmethod
    def selection(self, vectors, positions, cache_layer, sparse, n_blocks: int):
        """The selection [B, H, Tq, budget] of vectors [B, Tq, H*n, d] over `n_blocks` blocks (a subclass's
        rule: a selector module that leaves it out fails when it makes its `SELECTOR`)."""
