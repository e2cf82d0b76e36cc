"""The selector study's measurement engine: `run_study(model, tokenizer, spec, out=path)`, one record per cell.

Cells: per context length, one "dense" record, then for each selector (`forecastkv.modes.SELECTORS`) one
record per fixed budget (`spec.budgets`, in blocks) and per top-p value (`spec.top_p`, capped at the
largest fixed budget).  A budget of N blocks is N blocks of `block_size` tokens, init and local blocks
included: `sparse_config.topk = N - window_size // block_size`.

Protocol per length L (the same for every cell of that length):

* Text: L + 1 consecutive tokens of the held-out essays (`eval.tasks` "perplexity" example, seeded; the
  training windows come from the "train" split).  Needle: a `spec.needle_task` example of the same size
  (`eval.tasks`) whose answer tokens end the sequence.
* One dense prefill of all but the tail (L - N tokens, N = `spec.tail_tokens`; the needle's tail is
  max(N, answer tokens) so every answer token is predicted by a decode step).  Each cell's cache is
  filled from it by `inference.fill.copy_into` (what that cache's own prefill would store: compressed
  keys, Quest's key bounds); `SparseCache.fork` cannot serve, since a cache is tied to its budget
  (`model_signature`) and keeps only the index its own selector needs.  The dense record forks it.
* The tail is teacher-forced one token per forward call: real decode steps on the sparse decode path,
  with the cell's sparse_config (`dense_len` 0, every row sparse).  The last step sees L keys.
* Recall against the oracle: at every step and layer >= 1, the layer's true queries (from its
  post-norm input, through a `layer_callback`) over its stored keys give `selectors/oracle.py:oracle_block_mass`;
  the blocks the layer attended with (`collect_selections`' "selected") are compared with
  `oracle_blocks` of the same size by `selection.selection_recall`.  Size rule: a fixed
  budget compares with the oracle's top `budget_blocks`; a top-p row compares with the oracle's top
  k, k = the blocks that row actually selected (equal sizes, so recall 1 means "the best k blocks").
  `recall_mass` / `overlap` average the rows where the budget is selective (the row sees more blocks
  than the budget or cap); `*_all` average every row (1 when a selector takes every visible block).
* Perplexity of the N tail tokens and its ratio to the dense record's; needle accuracy: the share of
  answer tokens the argmax predicts under teacher forcing.
* Bytes and hits: the same tail decoded in the offloaded runtime (`OffloadedSparseCache`, mode
  "forecast-offload" for a selector that knows its blocks a layer ahead (`Selector.plans_ahead`),
  else "sparse-offload"; the dense record in "dense-offload"; oracle cannot run offloaded), filled from
  the same dense prefill.  The first step fills empty slots (`h2d_cold_bytes`); `h2d_bytes_per_step`
  and `hit_rate` are over the steps after it, as the demo's curves count them
  (`inference/report.py:stats_between`).  For the
  first cell of each selector the offloaded logits are checked against the resident run's.

Record schema (every key is present; a metric not measured is None):

    key                 "L/selector/kind/budget/p": what `out=` resumes by (with `fingerprint`)
    fingerprint         hash of the model, the heads and every spec field that changes the numbers
    length              L, tokens of context at the last step
    block_size          tokens per block
    context_blocks      ceil(L / block_size)
    selector            "dense" (the baseline) or one of `forecastkv.modes.SELECTORS`
    budget_kind         "dense", "blocks" (a fixed budget) or "top_p" (capped at budget_blocks)
    budget_blocks       blocks attended at most, init and local included (dense: context_blocks)
    topk                sparse_config.topk of the cell (budget_blocks - local blocks; None for dense)
    p                   the top-p mass (None otherwise)
    budget_tokens       budget_blocks x block_size
    budget_share        budget_blocks / context_blocks
    prefetch            whether the selector knows a layer's blocks a layer ahead (None for dense)
    offload_mode        mode of the offloaded run that measured bytes and hits (None: not run)
    offload_note        why there are no bytes (None when measured)
    recall_mass, overlap, recall_rows               mean over selective rows (None when there are none)
    recall_mass_all, overlap_all, recall_rows_all   mean over every row of layers >= 1
    selected_blocks     mean blocks attended per step, layer and KV head (below the cap under top-p)
    ppl, nll            perplexity (and mean NLL) of the N tail tokens
    ppl_ratio           ppl / the dense record's ppl (1.0 for dense)
    needle_accuracy     share of the needle's answer tokens predicted (None without a needle)
    needle_tokens       answer tokens scored
    h2d_bytes_per_step  bytes host -> device per decode step after the first (offloaded run)
    hit_rate            share of wanted blocks already in the device slots, same steps
    h2d_cold_bytes      bytes of the first decode step (empty slots)
    offload_max_diff    max |offloaded - resident| logit over the tail (first cell of each selector)
    tail_tokens         N
    anchors             reuse: its anchor layers; else None
    anchors_source      how the anchors were chosen ("spec", "chosen: ...", or the fallback and why)
    heads               where the Forecast heads came from (None: the model has none)
    prefill_s           seconds of the length's dense prefill (dense record; None when resumed)
    seconds             wall time of the cell
    skipped             why the cell was not measured (None: measured)
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..atomic import write_text_atomic
from ..errors import ConfigError
from ..modes import SELECTORS
from ..selectors import get_selector

DENSE = "dense"
# tasks whose example has one reference, the answer the sequence ends with
NEEDLE_TASKS = ("niah_single_essay", "niah_single_noise", "niah_multikey", "passkey")
ANSWER_GUESS = 8  # answer tokens asked of the task first; rebuilt once with the real count
OFFLOAD_TOLERANCE = 1e-3  # max |logit| difference between the offloaded and the resident decode
DEFAULT_HEADS = Path("runs/demo/heads")  # what `forecastkv demo` trains


# ----------------------------------------------------------------------------------------------
# the spec
# ----------------------------------------------------------------------------------------------


def _int_list(name: str, values, low: int) -> tuple:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise ConfigError(f"study {name} must be a list of integers, got {values!r}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"study {name} must hold integers >= {low}, got {value!r}")
    if len(set(values)) != len(values):
        raise ConfigError(f"study {name} must not repeat a value, got {list(values)!r}")
    return tuple(values)


@dataclass(frozen=True)
class StudySpec:
    """What `run_study` sweeps.  lengths: context tokens; budgets: fixed budgets in blocks (init and
    local included); top_p: masses in (0, 1], each capped at max(budgets); tail_tokens: decode steps
    scored per length; needle / needle_task: the needle sequence; heads_dir: where the Forecast heads
    came from (recorded; `load_study_model` loads them); reuse_anchors: the reuse selector's anchor
    layers (None: `eval.reuse_anchors.choose_anchors` with anchor_count anchors); offload: measure
    bytes and hits in the offloaded runtime; seed: the tasks' seed."""

    lengths: tuple = (2048, 4096, 8192)
    selectors: tuple = SELECTORS
    budgets: tuple = (8, 16, 32)
    top_p: tuple = (0.8, 0.9, 0.95)
    tail_tokens: int = 32
    needle: bool = True
    needle_task: str = "niah_single_essay"
    heads_dir: str | None = None
    reuse_anchors: tuple | None = None
    anchor_count: int = 2  # the knee of benchmarks/results/reuse_anchors.md (SmolLM2-135M, 2K, 16 blocks)
    offload: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen
        set_("lengths", _int_list("lengths", self.lengths, 2))
        set_("budgets", _int_list("budgets", self.budgets, 1))
        if not self.lengths:
            raise ConfigError("study lengths must name at least one length")
        self._check_selectors()
        self._check_top_p()
        for name in ("tail_tokens", "anchor_count", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "seed" else 1):
                raise ConfigError(f"study {name} must be an integer >= {0 if name == 'seed' else 1}, got {value!r}")
        for name in ("needle", "offload"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"study {name} must be true or false, got {getattr(self, name)!r}")
        if self.needle_task not in NEEDLE_TASKS:
            raise ConfigError(f"study needle_task {self.needle_task!r} is not one of {NEEDLE_TASKS}")
        if self.heads_dir is not None and not isinstance(self.heads_dir, (str, Path)):
            raise ConfigError(f"study heads_dir must be a directory path or None, got {self.heads_dir!r}")
        if self.reuse_anchors is not None:
            anchors = _int_list("reuse_anchors", self.reuse_anchors, 0)
            if 0 not in anchors:
                raise ConfigError(f"study reuse_anchors must hold layer 0, got {list(anchors)!r}")
            set_("reuse_anchors", tuple(sorted(anchors)))
        short = [n for n in self.lengths if n <= self.tail_tokens + 1]
        if short:
            raise ConfigError(f"study lengths {short} must exceed tail_tokens + 1 = {self.tail_tokens + 1}")

    def _check_selectors(self) -> None:
        if isinstance(self.selectors, str) or not isinstance(self.selectors, (list, tuple)) or not self.selectors:
            raise ConfigError(f"study selectors must be a non-empty list of {SELECTORS}, got {self.selectors!r}")
        unknown = [s for s in self.selectors if s not in SELECTORS]
        if unknown or len(set(self.selectors)) != len(self.selectors):
            raise ConfigError(f"study selectors must be distinct names from {SELECTORS}, got {list(self.selectors)!r}")
        object.__setattr__(self, "selectors", tuple(self.selectors))

    def _check_top_p(self) -> None:
        values = self.top_p
        if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
            raise ConfigError(f"study top_p must be a list of masses in (0, 1], got {values!r}")
        for p in values:
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
                raise ConfigError(f"study top_p values must lie in (0, 1], got {p!r}")
        if values and not self.budgets:
            raise ConfigError("study top_p needs at least one fixed budget: its cap is the largest of budgets")
        if not values and not self.budgets:
            raise ConfigError("study budgets and top_p are both empty: there is no cell to measure")
        object.__setattr__(self, "top_p", tuple(float(p) for p in values))

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Cell:
    """One measurement: `selector` at a fixed budget (`p` None) or a top-p budget capped at `blocks`."""

    selector: str
    blocks: int | None
    p: float | None = None

    @property
    def kind(self) -> str:
        return DENSE if self.selector == DENSE else ("top_p" if self.p is not None else "blocks")

    def key(self, length: int) -> str:
        return f"{length}/{self.selector}/{self.kind}/{self.blocks}/{self.p}"


def study_cells(spec: StudySpec) -> list[Cell]:
    """The cells of one length: dense first, then per selector its fixed budgets and its top-p values."""
    cap = max(spec.budgets) if spec.budgets else None
    cells = [Cell(DENSE, None)]
    for selector in spec.selectors:
        cells += [Cell(selector, blocks) for blocks in spec.budgets]
        cells += [Cell(selector, cap, p) for p in spec.top_p]
    return cells


def cell_sparse_config(base: dict, cell: Cell, anchors: tuple) -> dict:
    """The sparse_config of a cell: the model's geometry, the cell's selector and budget, every row sparse."""
    local = base["window_size"] // base["block_size"]
    return {
        **base,
        "selector": cell.selector,
        "topk": cell.blocks - local,
        "top_p": cell.p or 0.0,
        "reuse_anchors": list(anchors),
        "dense_len": 0,
    }


def check_geometry(spec: StudySpec, model, what: str = "study") -> dict:
    """The model's sparse geometry, after checking the spec against it (ConfigError naming the limit).
    what: the spec's name in the messages ("study"; the quality suite's `QualitySpec` is checked here too)."""
    config = model.config
    if config.sparse is None:
        raise ConfigError(f"the {what} needs a model with a sparse geometry (sparse_config); this one is dense")
    sparse = config.sparse
    forced = sparse.init_blocks + sparse.local_blocks + 1  # init, the local window and the current block
    small = [b for b in spec.budgets if b <= forced]
    if small:
        raise ConfigError(
            f"{what} budgets {small} leave no block to choose: each must exceed the {forced} forced blocks "
            f"(init {sparse.init_blocks} + local {sparse.local_blocks} + the current one) of block_size "
            f"{sparse.block_size}"
        )
    limit = config.max_position_embeddings
    long = [n for n in spec.lengths if n > limit]
    if long:
        raise ConfigError(f"{what} lengths {long} exceed the model's max_position_embeddings={limit}")
    layers = config.num_hidden_layers
    if spec.reuse_anchors is not None and max(spec.reuse_anchors) >= layers:
        raise ConfigError(f"{what} reuse_anchors {list(spec.reuse_anchors)} must be layer ids below {layers}")
    return sparse.to_dict()


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------


@dataclass
class ScoredSequence:
    """ids [1, M + 1]; the first M - tail tokens are prefilled, the tail is teacher-forced one token
    at a time (predicting ids[M - tail + 1 :]); the last `answer` targets are the needle's answer."""

    ids: torch.Tensor
    tail: int
    answer: int = 0

    @property
    def prefill(self) -> int:
        return self.ids.shape[1] - 1 - self.tail

    @property
    def targets(self) -> torch.Tensor:
        return self.ids[0, self.prefill + 1 :]

    @property
    def steps(self) -> range:
        return range(self.prefill, self.prefill + self.tail)


def text_sequence(codec, spec: StudySpec, length: int) -> ScoredSequence:
    """L + 1 held-out essay tokens from a seeded start (the eval's "perplexity" task)."""
    from .tasks import generate_example

    example = generate_example("perplexity", codec, length + 1, seed=spec.seed)
    return ScoredSequence(torch.tensor([example.input_ids]), spec.tail_tokens)


def needle_sequence(codec, spec: StudySpec, length: int) -> ScoredSequence:
    """A needle prompt with its answer appended, L + 1 tokens: the task builds the prompt for
    `answer` new tokens, and the answer (drawn before the haystack) fixes that count."""
    from .tasks import generate_example

    build = lambda new: generate_example(spec.needle_task, codec, length + 1, seed=spec.seed, max_new_tokens=new)  # noqa: E731
    example = build(ANSWER_GUESS)
    answer = codec.encode(" " + example.references[0])
    if len(answer) != ANSWER_GUESS:
        example = build(len(answer))
        answer = codec.encode(" " + example.references[0])
    ids = torch.tensor([example.input_ids + answer])
    return ScoredSequence(ids, max(spec.tail_tokens, len(answer)), len(answer))


# ----------------------------------------------------------------------------------------------
# decoding the tail
# ----------------------------------------------------------------------------------------------


def lm_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The causal LM's logits of the backbone's last hidden states (muP's output scale included)."""
    mup = model.config.mup_config
    if mup is not None:
        hidden = hidden / (model.config.hidden_size / mup.dim_model_base)
    return model.lm_head(hidden)


@torch.no_grad()
def dense_prefill(model, seq: ScoredSequence):
    """The dense cache holding seq's first `prefill` tokens (one forward call, chunked by the model), with the
    blocks its last rows attended most pinned in the model's geometry (`modeling/pins.py`), for the cells whose
    selector pins (the others ignore them)."""
    from ..modeling.cache import SparseCache
    from ..modeling.pins import PINNED
    from ..modeling.routing import attending_with

    device = next(model.parameters()).device
    geometry = model.config.sparse
    with attending_with(model, None):
        cache = SparseCache(model.config)
        cache.reserve(seq.ids.shape[1])
        cache.pins_always = None if geometry is None else (PINNED, geometry)
        model.model(seq.ids[:, : seq.prefill].to(device), cache=cache)
    return cache


@torch.no_grad()
def teacher_forced(model, cache, ids: torch.Tensor, steps: range, meter=None) -> torch.Tensor:
    """Feed ids[0, t] for t in `steps` one token per forward call (real decode steps).  Returns fp32
    logits [len(steps), vocab], row i predicting ids[0, steps[i] + 1].  meter: a `RecallMeter`, given
    every step's selections and its layer callback."""
    device = next(model.parameters()).device
    rows = []
    for t in steps:
        hidden, _, selections = model.model(
            ids[:, t : t + 1].to(device),
            cache=cache,
            collect_selections=meter is not None,
            layer_callback=None if meter is None else meter.on_layer,
        )
        if meter is not None:
            meter.add_step(selections)
        rows.append(lm_logits(model, hidden)[0, -1].float())
    return torch.stack(rows)


def tail_scores(logits: torch.Tensor, seq: ScoredSequence) -> dict:
    """Perplexity of the tail targets and, for a needle, the share of answer tokens the argmax predicts."""
    targets = seq.targets.to(logits.device)
    nll = float(F.cross_entropy(logits, targets))
    hits = (logits.argmax(-1) == targets)[len(targets) - seq.answer :] if seq.answer else None
    return {"nll": nll, "ppl": math.exp(nll), "accuracy": None if hits is None else float(hits.float().mean())}


class RecallMeter:
    """Recall against the oracle over the decode steps of one cell (see the module docstring).

    `on_layer` is the forward's layer_callback: it keeps each layer's oracle mass [1, H, 1, NB] from
    its true queries and stored keys; `add_step` compares it with the layer's selected ids."""

    def __init__(self, model, budget: int, top_p: bool) -> None:
        self.inner, self.budget, self.top_p = model.model, budget, top_p
        self.block_size = model.config.sparse.block_size
        self.masses: dict = {}
        self.sums = {"mass": 0.0, "overlap": 0.0, "rows": 0, "mass_all": 0.0, "overlap_all": 0.0, "rows_all": 0}
        self.layer_sums: dict = {}  # layer -> [recall_mass summed over its selective rows, those rows]
        self.selected, self.selected_rows = 0.0, 0

    def on_layer(self, idx, normed, positions, cos, sin, cache_layer) -> None:
        from ..selectors.oracle import oracle_block_mass

        if idx == 0:
            return
        q = self.inner.layers[idx].self_attn.queries(normed, cos, sin)
        keys, _, _, count = cache_layer.full()
        n_blocks = -(-count // self.block_size)
        self.masses[idx] = (oracle_block_mass(q, keys, positions, self.block_size, n_blocks), positions)

    def add_step(self, selections: list) -> None:
        for idx, record in enumerate(selections):
            ids = record["selected"]  # [1, H, 1, K]
            self.selected += float((ids >= 0).sum(-1).float().sum())
            self.selected_rows += ids.shape[1] * ids.shape[2]
            if idx in self.masses:
                mass, positions = self.masses.pop(idx)
                self._add_rows(ids, mass, positions, idx)

    def _add_rows(self, ids: torch.Tensor, mass: torch.Tensor, positions: torch.Tensor, layer=None) -> None:
        from ..modeling.selection import selection_recall
        from ..selectors.oracle import oracle_blocks

        if self.top_p:  # equal sizes: per row the oracle's top k, k = the blocks that row selected
            sizes = (ids >= 0).sum(-1)
            recall, overlap = torch.ones_like(mass[..., 0]), torch.ones_like(mass[..., 0])
            for k in sizes.unique().tolist():
                r, o = selection_recall(ids, mass, oracle_blocks(mass, positions, max(k, 1), self.block_size))
                recall, overlap = torch.where(sizes == k, r, recall), torch.where(sizes == k, o, overlap)
        else:
            recall, overlap = selection_recall(ids, mass, oracle_blocks(mass, positions, self.budget, self.block_size))
        visible = torch.div(positions, self.block_size, rounding_mode="floor") + 1  # [1, Tq]
        selective = (visible > self.budget).view(1, 1, -1).expand_as(recall)
        self.sums["mass_all"] += float(recall.sum())
        self.sums["overlap_all"] += float(overlap.sum())
        self.sums["rows_all"] += recall.numel()
        mass_sum, rows = float(recall[selective].sum()), int(selective.sum())
        self.sums["mass"] += mass_sum
        self.sums["overlap"] += float(overlap[selective].sum())
        self.sums["rows"] += rows
        if layer is not None:
            sums = self.layer_sums.setdefault(layer, [0.0, 0])
            sums[0], sums[1] = sums[0] + mass_sum, sums[1] + rows

    def layer_recall(self, layers: int) -> tuple[list, list]:
        """Per layer 0..layers-1: (mean recall_mass over its selective rows, None without any; those rows)."""
        sums = [self.layer_sums.get(layer, (0.0, 0)) for layer in range(layers)]
        return [total / rows if rows else None for total, rows in sums], [rows for _, rows in sums]

    def result(self) -> dict:
        s = self.sums
        mean = lambda total, rows: total / rows if rows else None  # noqa: E731
        return {
            "recall_mass": mean(s["mass"], s["rows"]),
            "overlap": mean(s["overlap"], s["rows"]),
            "recall_rows": s["rows"],
            "recall_mass_all": mean(s["mass_all"], s["rows_all"]),
            "overlap_all": mean(s["overlap_all"], s["rows_all"]),
            "recall_rows_all": s["rows_all"],
            "selected_blocks": mean(self.selected, self.selected_rows),
        }


# ----------------------------------------------------------------------------------------------
# one cell
# ----------------------------------------------------------------------------------------------


def offload_mode(selector: str) -> str | None:
    """The offloaded runtime's mode for `selector`: a layer ahead when it can, else at the consuming
    layer; "dense-offload" for dense; None for a selector that is not deployable (the oracle reads every
    key: the runtime refuses it)."""
    if selector == DENSE:
        return "dense-offload"
    rule = get_selector(selector)
    if not rule.deployable:
        return None
    return "forecast-offload" if rule.plans_ahead else "sparse-offload"


@torch.no_grad()
def offloaded_run(model, prefilled, seq: ScoredSequence, mode: str, selector: str | None) -> tuple[torch.Tensor, dict]:
    """Decode seq's tail in the offloaded runtime (the model already attends with the cell's
    config), its cache filled from `prefilled`.  Returns (logits [tail, vocab], bytes and hit rate)."""
    from ..inference import OffloadedSparseCache
    from ..inference.fill import copy_into
    from ..inference.report import stats_between

    options = {} if selector is None else {"selector": selector}
    cache = OffloadedSparseCache.for_model(model, mode=mode, **options)
    cache.reserve(seq.ids.shape[1])
    copy_into(prefilled, cache)
    offloaded = [layer.offloaded for layer in cache.layers]
    before = cache.stats()
    first = teacher_forced(model, cache, seq.ids, seq.steps[:1])
    cold = cache.stats()
    rest = teacher_forced(model, cache, seq.ids, seq.steps[1:]) if seq.tail > 1 else first[:0]
    steady = stats_between(cold, cache.stats(), offloaded)
    return torch.cat([first, rest]), {
        "h2d_bytes_per_step": steady["h2d_bytes_per_step"],
        "hit_rate": steady["hit_rate"],
        "h2d_cold_bytes": stats_between(before, cold, offloaded)["h2d_bytes_per_step"],
    }


def _measure_offload(model, prefilled, text: ScoredSequence, cell: Cell, resident: torch.Tensor | None) -> dict:
    """The offloaded run's fields; `resident` (the resident logits) is compared when given."""
    mode = offload_mode(cell.selector)
    if mode is None:
        note = f"{cell.selector} reads every key: the offloaded runtime refuses it"
        return {"offload_mode": None, "offload_note": note}
    logits, counts = offloaded_run(model, prefilled, text, mode, None if cell.selector == DENSE else cell.selector)
    fields = {"offload_mode": mode, "offload_note": None, **counts}
    if resident is not None:
        diff = float((logits - resident).abs().max())
        if not diff <= OFFLOAD_TOLERANCE:
            raise RuntimeError(
                f"{cell.selector} at {cell.blocks} blocks (p={cell.p}): the offloaded decode ({mode}) differs from "
                f"the resident one by {diff:.3g} in the logits (tolerance {OFFLOAD_TOLERANCE})"
            )
        fields["offload_max_diff"] = diff
    return fields


@torch.no_grad()
def measure_cell(model, cell: Cell, inputs: dict, anchors: tuple, check_offload: bool, offload: bool) -> dict:
    """One cell: resident decode of the text (recall, ppl) and the needle, then the offloaded text."""
    from ..inference.fill import copy_into
    from ..modeling.cache import SparseCache
    from ..modeling.routing import attending_with

    base = model.config.sparse.to_dict()
    sparse = cell_sparse_config(base, cell, anchors)
    meter = RecallMeter(model, cell.blocks, cell.p is not None)
    fields: dict = {}
    with attending_with(model, sparse):
        for name, meter_here in (("text", meter), ("needle", None)):
            if inputs.get(name) is None:
                continue
            seq, prefilled = inputs[name]
            cache = SparseCache(model.config)
            cache.reserve(seq.ids.shape[1])
            copy_into(prefilled, cache)
            logits = teacher_forced(model, cache, seq.ids, seq.steps, meter_here)
            fields[name] = (logits, tail_scores(logits, seq))
        record = {**meter.result(), **_quality(fields)}
        if offload:
            text, prefilled = inputs["text"]
            record.update(_measure_offload(model, prefilled, text, cell, fields["text"][0] if check_offload else None))
    return record


def _quality(fields: dict) -> dict:
    text = fields["text"][1]
    needle = fields["needle"][1] if "needle" in fields else None
    return {"ppl": text["ppl"], "nll": text["nll"], "needle_accuracy": None if needle is None else needle["accuracy"]}


@torch.no_grad()
def measure_dense(model, inputs: dict, offload: bool) -> dict:
    """The dense baseline: the tail decoded densely on forks of the dense prefill."""
    from ..modeling.routing import attending_with

    fields: dict = {}
    with attending_with(model, None):
        for name in ("text", "needle"):
            if inputs.get(name) is not None:
                seq, prefilled = inputs[name]
                logits = teacher_forced(model, prefilled.fork(), seq.ids, seq.steps)
                fields[name] = (logits, tail_scores(logits, seq))
        record = _quality(fields)
        if offload:
            text, prefilled = inputs["text"]
            record.update(_measure_offload(model, prefilled, text, Cell(DENSE, None), fields["text"][0]))
    return record


# ----------------------------------------------------------------------------------------------
# the study: cells per length, records, resume
# ----------------------------------------------------------------------------------------------


def study_fingerprint(model, spec: StudySpec) -> str:
    """What every record's numbers depend on besides its cell: the model (name, shape, geometry, the
    Forecast heads' weights) and the spec's protocol fields."""
    config = model.config
    heads = hashlib.sha1()
    for name, tensor in sorted(model.state_dict().items()):
        if "forecast_proj" in name or "current_proj" in name:
            heads.update(name.encode())
            heads.update(tensor.detach().float().cpu().numpy().tobytes())
    parts = {
        "model": [getattr(config, "_name_or_path", ""), config.num_hidden_layers, config.hidden_size],
        "sparse": config.sparse_config,
        "heads": heads.hexdigest(),
        **{k: v for k, v in spec.to_dict().items() if k not in ("lengths", "selectors", "budgets", "top_p")},
    }
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_records(path, fingerprint: str) -> dict:
    """{key: record} of the records in `path` (a JSON list) measured with `fingerprint`; {} without a file."""
    if path is None or not Path(path).is_file():
        return {}
    try:
        records = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"study output {path} is not valid JSON ({error}); move it away to start afresh") from None
    return {r["key"]: r for r in records if isinstance(r, dict) and r.get("fingerprint") == fingerprint}


def write_records(path, records: dict) -> None:
    """All records to `path` as one JSON list, atomically (a temporary file, then `os.replace`)."""
    write_text_atomic(path, json.dumps(list(records.values()), indent=1) + "\n")


@dataclass
class StudyRun:
    """What one `run_study` call shares between its lengths."""

    model: object
    tokenizer: object
    spec: StudySpec
    fingerprint: str
    done: dict
    out: Path | None
    progress: bool
    anchors: tuple | None = None
    anchors_source: str | None = None
    checked: set = field(default_factory=set)  # selectors whose offloaded logits were compared

    def save(self, record: dict) -> None:
        self.done[record["key"]] = record
        if self.out is not None:
            write_records(self.out, self.done)
        if self.progress:
            what = record["skipped"] or f"ppl {record['ppl']:.3f}, recall {record['recall_mass']}"
            print(f"study: {record['key']}: {what} ({record['seconds']:.1f} s)", file=sys.stderr, flush=True)


def run_study(model, tokenizer, spec: StudySpec | dict, out=None, progress: bool = False) -> list[dict]:
    """Measure every cell of `spec` on `model` (a ForecastKVForCausalLM with a sparse geometry) and
    return the records (schema: the module docstring), lengths in order, dense first in each.

    tokenizer: a Hugging Face tokenizer or a codec (`eval.codec`).  out: a JSON file the records go
    to after each cell (atomically); a cell already there with the same fingerprint is not measured
    again, and a length whose cells are all there is not even prefilled.  progress: a line per cell."""
    from ..modeling.configuration import strict_from_dict
    from .codec import as_codec

    spec = strict_from_dict(StudySpec, spec, "study spec")
    check_geometry(spec, model)
    fingerprint = study_fingerprint(model, spec)
    run = StudyRun(model, tokenizer, spec, fingerprint, read_records(out, fingerprint), out and Path(out), progress)
    records = []
    for length in spec.lengths:
        records += _run_length(run, as_codec(tokenizer), length)
    return records


def _run_length(run: StudyRun, codec, length: int) -> list[dict]:
    """The records of one length: what `run.done` holds, the rest measured on one dense prefill."""
    cells = study_cells(run.spec)
    if all(cell.key(length) in run.done for cell in cells):
        return [run.done[cell.key(length)] for cell in cells]
    began = time.perf_counter()
    inputs = {"text": text_sequence(codec, run.spec, length)}
    if run.spec.needle:
        inputs["needle"] = needle_sequence(codec, run.spec, length)
    inputs = {name: (seq, dense_prefill(run.model, seq)) for name, seq in inputs.items()}
    prefill_s = time.perf_counter() - began
    dense_key = cells[0].key(length)
    if dense_key not in run.done:
        began = time.perf_counter()
        fields = {**measure_dense(run.model, inputs, run.spec.offload), "prefill_s": round(prefill_s, 3)}
        run.save(_record(run, length, cells[0], fields, time.perf_counter() - began))
    dense_ppl = run.done[dense_key]["ppl"]
    for cell in cells[1:]:
        if cell.key(length) in run.done:
            continue
        began = time.perf_counter()
        reason = _skip_reason(run.model, cell)
        fields = {"skipped": reason} if reason else _measure(run, cell, inputs)
        if reason is None:
            fields["ppl_ratio"] = fields["ppl"] / dense_ppl
        run.save(_record(run, length, cell, fields, time.perf_counter() - began))
    return [run.done[cell.key(length)] for cell in cells]


def _measure(run: StudyRun, cell: Cell, inputs: dict) -> dict:
    """measure_cell with the cell's anchors, comparing offloaded and resident logits once per selector."""
    anchors = _anchors(run) if _anchored(cell) else (0,)
    check = cell.selector not in run.checked
    fields = measure_cell(run.model, cell, inputs, anchors, check, run.spec.offload)
    if check and fields.get("offload_mode") is not None:
        run.checked.add(cell.selector)
    return fields


def _skip_reason(model, cell: Cell) -> str | None:
    heads = cell.selector != DENSE and get_selector(cell.selector).needs_forecast_heads
    if heads and not model.config.forecast_config.enabled:
        return (
            f"the model has no Forecast heads: give the study a heads_dir (a train-forecast output, e.g. "
            f"{DEFAULT_HEADS}, which `forecastkv demo` writes)"
        )
    return None


def _anchored(cell: Cell) -> bool:
    """Whether the cell's selector takes its blocks from anchor layers (reuse)."""
    return cell.selector != DENSE and get_selector(cell.selector).anchored


def _anchors(run: StudyRun) -> tuple:
    """The reuse selector's anchors: the spec's, else chosen once by `reuse_anchors.choose_anchors`
    on the bundled essays at the shortest length and the middle fixed budget."""
    if run.anchors is None:
        spec = run.spec
        if spec.reuse_anchors is not None:
            run.anchors, run.anchors_source = spec.reuse_anchors, "spec"
        else:
            from .reuse_anchors import choose_anchors

            length, budget = min(spec.lengths), sorted(spec.budgets)[len(spec.budgets) // 2]
            run.anchors = tuple(choose_anchors(run.model, run.tokenizer, spec.anchor_count, length, budget))
            run.anchors_source = (
                f"chosen by eval.reuse_anchors.choose_anchors: {spec.anchor_count} anchors at length {length}, "
                f"budget {budget} blocks"
            )
    return run.anchors


def _record(run: StudyRun, length: int, cell: Cell, fields: dict, seconds: float) -> dict:
    """A full record (every schema key) of `fields` measured for `cell` at `length`."""
    sparse = run.model.config.sparse
    context_blocks = -(-length // sparse.block_size)
    blocks = context_blocks if cell.selector == DENSE else cell.blocks
    reuse = _anchored(cell) and not fields.get("skipped")
    heads = run.spec.heads_dir or ("the model's own" if run.model.config.forecast_config.enabled else None)
    record = dict.fromkeys(RECORD_FIELDS)
    record.update(
        key=cell.key(length),
        fingerprint=run.fingerprint,
        length=length,
        block_size=sparse.block_size,
        context_blocks=context_blocks,
        selector=cell.selector,
        budget_kind=cell.kind,
        budget_blocks=blocks,
        topk=None if cell.selector == DENSE else cell.blocks - sparse.local_blocks,
        p=cell.p,
        budget_tokens=blocks * sparse.block_size,
        budget_share=blocks / context_blocks,
        prefetch=None if cell.selector == DENSE else get_selector(cell.selector).plans_ahead,
        ppl_ratio=1.0 if cell.selector == DENSE else None,
        needle_tokens=None,
        tail_tokens=run.spec.tail_tokens,
        anchors=list(run.anchors) if reuse else None,
        anchors_source=run.anchors_source if reuse else None,
        heads=str(heads) if heads is not None else None,
        seconds=round(seconds, 3),
        skipped=None,
    )
    record.update(fields)
    return record


RECORD_FIELDS = (
    "key fingerprint length block_size context_blocks selector budget_kind budget_blocks topk p budget_tokens "
    "budget_share prefetch offload_mode offload_note recall_mass overlap recall_rows recall_mass_all overlap_all "
    "recall_rows_all selected_blocks ppl nll ppl_ratio needle_accuracy needle_tokens h2d_bytes_per_step hit_rate "
    "h2d_cold_bytes offload_max_diff tail_tokens anchors anchors_source heads prefill_s seconds skipped"
).split()


def load_study_model(spec: StudySpec, base: str = "bundled:smollm2-135m"):
    """(model, tokenizer, spec) for the study on `base` (float32, eval mode): with the Forecast heads of
    `spec.heads_dir` (a directory or `bundled:NAME`), else of the demo's `runs/demo/heads` when that
    exists, else the heads shipped for `base` (`bundled.shipped_heads_for`), else none (the forecast
    cells are then skipped, with the reason).  The geometry is the heads' (`training.recall.resolve_geometry`),
    else the smollm2-135m preset.  The returned spec names the heads used."""
    import dataclasses

    from transformers import AutoTokenizer

    from ..bundled import resolve_heads_path, resolve_model_path, shipped_heads_for
    from ..modeling.modeling import ForecastKVForCausalLM
    from ..training.recall import load_for_recall, resolve_geometry

    heads = spec.heads_dir
    if heads is None and (DEFAULT_HEADS / "forecast.safetensors").is_file():
        heads = str(DEFAULT_HEADS)
    if heads is None:
        heads = shipped_heads_for(base)
    if heads is not None and not Path(resolve_heads_path(str(heads))).exists():
        raise ConfigError(f"study heads_dir {heads} does not exist (a train-forecast output directory)")
    sparse = resolve_geometry(None, heads)
    if heads is not None:
        model, tokenizer, _ = load_for_recall(base, str(heads), sparse)
    else:
        path = resolve_model_path(base)
        model = ForecastKVForCausalLM.from_pretrained(path, sparse_config=sparse).float().eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer, dataclasses.replace(spec, heads_dir=None if heads is None else str(heads))
