"""The quality suite's engine: `run_suite(model, tokenizer, spec, out=dir)`, RULER-style task accuracy with
95% Wilson intervals per (task, length, selector, budget), held-out perplexity and H2D bytes per step.

Protocol (`QualitySpec`; the selector study's machinery, `eval/study.py`, does the measuring):

* Examples: per task (`eval/tasks.py:TASKS`) and length L, `spec.examples` (N) examples; example i asks for
  its needle at depth (i + 0.5) / N, so the N needles spread evenly over the context.  L is the whole
  budget (prompt + the task's max_new_tokens, RULER's convention).  Every example is built before any
  model work, so a length too short for a task fails at once, naming both.
* Per example: ONE dense prefill (`study.dense_prefill`) of all prompt tokens but the last.  Each cell
  (dense, then each selector x budget) decodes from it: the dense cell on a fork, a selector's cell on a
  cache of its own filled by `inference.fill.copy_into` (what its prefill would store: compressed keys,
  Quest's bounds) with the cell's sparse_config (`study.cell_sparse_config`: dense_len 0, so every decode
  row is sparse).  The first decode step feeds the last prompt token, so every generated token is
  predicted under the cell's selection; greedy, up to the task's max_new_tokens (or
  `spec.max_new_tokens`) or an EOS.  The prediction is scored by the task's metric (`score_prediction`).
  A selector cell also measures recall against the oracle (`study.RecallMeter`: the share of the oracle's
  attention mass the selected blocks hold, rows where the budget is selective), in all and per layer.
* Held-out perplexity and bytes: `study.run_study` per length with `ppl_tokens` tail tokens of the
  held-out essays, top-p off, no needle: dense prefill shared, the tail teacher-forced through each
  cell's sparse decode path (ppl, ratio to dense), then decoded again in the offloaded runtime
  (`OffloadedSparseCache`) for `h2d_bytes_per_step` (the oracle cannot run offloaded: no bytes).  Its
  records go to `ppl_cells.json` (the study's resumable file); a selector the study skips (Forecast
  heads missing) is skipped on the tasks too, with the same reason.
* Records (`TASK_FIELDS`): one JSON line per (example, cell) in `results.rank0.jsonl`
  (`eval/results.py:ShardWriter`: appended, flushed and fsynced as each cell completes; a kill loses at
  most the cell in flight, and its partial line is cut off on restart).  `key` is the example's
  ("task/length/index"), `mode` the cell's ("dense", "<selector>@<budget>"), and `fingerprint` hashes
  the model, its Forecast heads and every protocol field (`study.study_fingerprint`): a rerun with the
  same arguments skips what is done, a changed protocol measures afresh (old lines stay, unused).
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError
from ..modes import SELECTORS
from .metrics import score_prediction
from .study import (
    DENSE,
    Cell,
    RecallMeter,
    ScoredSequence,
    StudySpec,
    cell_sparse_config,
    check_geometry,
    dense_prefill,
    run_study,
    study_fingerprint,
    teacher_forced,
)

DEFAULT_TASKS = ("niah_single_essay", "niah_multikey", "niah_multivalue", "vt", "passkey")
DEFAULT_SELECTORS = ("query", "quest", "forecast", "quest-forecast", "oracle")
RECORDS = "results.rank0.jsonl"  # the task records (eval/results.py's shard name, rank 0)
PPL_RECORDS = "ppl_cells.json"  # the perplexity and bytes records (the study's file)
PROTOCOL = 1  # bumped when the measurement changes: older records are then not reused

TASK_FIELDS = (
    "key mode fingerprint run task length index depth needle_at prompt_tokens prompt_sha selector budget "
    "max_new_tokens prediction references metric score generated_tokens recall_mass recall_rows recall_layers "
    "recall_layer_rows seconds skipped"
).split()


# ----------------------------------------------------------------------------------------------
# the spec
# ----------------------------------------------------------------------------------------------


def _names(name: str, values, known) -> tuple:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or not values:
        raise ConfigError(f"quality {name} must be a non-empty list of names from {list(known)}, got {values!r}")
    unknown = [v for v in values if v not in known]
    if unknown:
        raise ConfigError(f"quality {name}: {', '.join(map(repr, unknown))} not one of {list(known)}")
    if len(set(values)) != len(values):
        raise ConfigError(f"quality {name} must not repeat a name, got {list(values)!r}")
    return tuple(values)


def _integers(name: str, values, low: int) -> tuple:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or not values:
        raise ConfigError(f"quality {name} must be a non-empty list of integers >= {low}, got {values!r}")
    for value in values:
        _integer(name, value, low)
    if len(set(values)) != len(values):
        raise ConfigError(f"quality {name} must not repeat a value, got {list(values)!r}")
    return tuple(values)


def _integer(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"quality {name} must be an integer >= {low}, got {value!r}")


def generative_tasks() -> tuple:
    """The task names the suite can score (every task of `eval/tasks.py` but perplexity)."""
    from .tasks import TASKS

    return tuple(name for name in TASKS if name != "perplexity")


@dataclass(frozen=True)
class QualitySpec:
    """What `run_suite` measures.  tasks / lengths / examples: the examples (N per task and length);
    selectors x budgets: the sparse cells (budgets in blocks, init and local included), dense always;
    ppl_tokens: held-out tokens scored per length; max_new_tokens: None for each task's own (a smaller
    value shortens decoding, for CI); heads_dir: where the Forecast heads came from (recorded);
    reuse_anchors / anchor_count: the reuse selector's anchors (the study's); offload: measure bytes."""

    tasks: tuple = DEFAULT_TASKS
    lengths: tuple = (4096, 8192)
    selectors: tuple = DEFAULT_SELECTORS
    budgets: tuple = (16,)
    examples: int = 50
    ppl_tokens: int = 256
    max_new_tokens: int | None = None
    seed: int = 0
    heads_dir: str | None = None
    reuse_anchors: tuple | None = None
    anchor_count: int = 2
    offload: bool = True

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen
        set_("tasks", _names("tasks", self.tasks, generative_tasks()))
        set_("selectors", _names("selectors", self.selectors, SELECTORS))
        set_("lengths", _integers("lengths", self.lengths, 2))
        set_("budgets", _integers("budgets", self.budgets, 1))
        for name, low in (("examples", 1), ("ppl_tokens", 1), ("seed", 0), ("anchor_count", 1)):
            _integer(name, getattr(self, name), low)
        if self.max_new_tokens is not None:
            _integer("max_new_tokens", self.max_new_tokens, 1)
        if not isinstance(self.offload, bool):
            raise ConfigError(f"quality offload must be true or false, got {self.offload!r}")
        if self.reuse_anchors is not None:
            set_("reuse_anchors", tuple(_integers("reuse_anchors", self.reuse_anchors, 0)))
        short = [n for n in self.lengths if n <= self.ppl_tokens + 1]
        if short:
            raise ConfigError(
                f"quality lengths {short} must exceed ppl_tokens + 1 = {self.ppl_tokens + 1} (held-out tokens scored)"
            )

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}

    def study_spec(self) -> StudySpec:
        """The selector study's spec of the perplexity and bytes part: fixed budgets, no top-p, no needle."""
        return StudySpec(
            lengths=self.lengths,
            selectors=self.selectors,
            budgets=self.budgets,
            top_p=(),
            tail_tokens=self.ppl_tokens,
            needle=False,
            heads_dir=self.heads_dir,
            reuse_anchors=self.reuse_anchors,
            anchor_count=self.anchor_count,
            offload=self.offload,
            seed=self.seed,
        )

    def cells(self) -> list[Cell]:
        """Dense first, then every selector at every budget."""
        return [Cell(DENSE, None)] + [Cell(s, b) for s in self.selectors for b in self.budgets]


def mode_name(cell: Cell) -> str:
    """A cell's name in the records: "dense" or "<selector>@<budget blocks>"."""
    return DENSE if cell.selector == DENSE else f"{cell.selector}@{cell.blocks}"


def study_mode(record: dict) -> str:
    """The cell name of one of the study's records (a fixed budget's or dense)."""
    return DENSE if record["selector"] == DENSE else f"{record['selector']}@{record['budget_blocks']}"


def check_against_model(spec: QualitySpec, model) -> None:
    """The spec's lengths, budgets and anchors against the model (`study.check_geometry`'s checks: a
    ConfigError naming the value and the limit)."""
    check_geometry(spec, model, "quality")


# ----------------------------------------------------------------------------------------------
# examples
# ----------------------------------------------------------------------------------------------


def example_depth(index: int, count: int) -> float:
    """Example `index` of `count` asks for its needle at (index + 0.5) / count of the context."""
    return (index + 0.5) / count


def suite_examples(codec, spec: QualitySpec) -> dict:
    """{(task, length): [Example] * spec.examples}, every one built now (a too-short length fails here)."""
    from .tasks import generate_example

    return {
        (task, length): [
            generate_example(
                task,
                codec,
                length,
                index=i,
                seed=spec.seed,
                depth=example_depth(i, spec.examples),
                max_new_tokens=spec.max_new_tokens,
            )
            for i in range(spec.examples)
        ]
        for length in spec.lengths
        for task in spec.tasks
    }


def needle_at(example) -> float | None:
    """The depth the example's first needle landed at: the share of the haystack's tokens (the context
    without its needles) before it, what a task's `depth` asks for (None without needles)."""
    needles, context = example.meta.get("needles"), example.meta.get("context")
    if not needles or not context:
        return None
    start = needles[0][0]
    before = sum(end - begin for begin, end, _ in needles if end <= start)
    haystack = context[1] - context[0] - sum(end - begin for begin, end, _ in needles)
    return (start - context[0] - before) / max(haystack, 1)


def ids_digest(ids) -> str:
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:16]


def suite_fingerprint(model, spec: QualitySpec) -> str:
    """`study.study_fingerprint` over the model, its heads and the fields that change a task record
    (the tasks, lengths, selectors and budgets are in each record's key and mode instead)."""
    sweep = ("tasks", "lengths", "selectors", "budgets", "ppl_tokens", "offload")
    protocol = {k: v for k, v in spec.to_dict().items() if k not in sweep}
    protocol["protocol"] = PROTOCOL
    return study_fingerprint(model, _Fields(protocol))


@dataclass(frozen=True)
class _Fields:
    fields: dict

    def to_dict(self) -> dict:
        return dict(self.fields)


# ----------------------------------------------------------------------------------------------
# one cell
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_decode(model, cache, prompt: list[int], max_new: int, meter=None, stops=()) -> list[int]:
    """Greedy tokens after `prompt`, whose last token `cache` does not hold yet: each step feeds one
    token (`study.teacher_forced`, a real decode step), up to `max_new` tokens or a token in `stops`."""
    ids = torch.zeros(1, len(prompt) + max_new, dtype=torch.long)
    ids[0, : len(prompt)] = torch.tensor(prompt)
    generated: list[int] = []
    for t in range(len(prompt) - 1, len(prompt) - 1 + max_new):
        token = int(teacher_forced(model, cache, ids, range(t, t + 1), meter)[0].argmax())
        if token in stops:
            break
        generated.append(token)
        ids[0, t + 1] = token
    return generated


class LayerRecallMeter(RecallMeter):
    """The study's recall meter at a fixed budget, read per layer too."""

    def __init__(self, model, budget: int) -> None:
        super().__init__(model, budget, top_p=False)
        self.layers = model.config.num_hidden_layers

    def fields(self) -> dict:
        result = self.result()
        means, rows = self.layer_recall(self.layers)
        return {
            "recall_mass": result["recall_mass"],
            "recall_rows": result["recall_rows"],
            "recall_layers": means,
            "recall_layer_rows": rows,
        }


def stop_tokens(model) -> set:
    eos = model.config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


@torch.no_grad()
def decode_cell(model, prefilled, prompt: list[int], max_new: int, cell: Cell, anchors: tuple) -> tuple[list, dict]:
    """Greedy decode of one cell from the shared dense prefill: (tokens, recall fields; {} for dense)."""
    from ..inference.fill import copy_into
    from ..modeling.cache import SparseCache
    from ..modeling.routing import attending_with

    stops = stop_tokens(model)
    if cell.selector == DENSE:
        with attending_with(model, None):
            return greedy_decode(model, prefilled.fork(), prompt, max_new, None, stops), {}
    sparse = cell_sparse_config(model.config.sparse.to_dict(), cell, anchors)
    meter = LayerRecallMeter(model, cell.blocks)
    with attending_with(model, sparse):
        cache = SparseCache(model.config)
        cache.reserve(len(prompt) + max_new)
        copy_into(prefilled, cache)
        tokens = greedy_decode(model, cache, prompt, max_new, meter, stops)
    return tokens, meter.fields()


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------


@dataclass
class SuiteRun:
    """What one `run_suite` call shares between its examples."""

    model: object
    codec: object
    spec: QualitySpec
    fingerprint: str
    done: dict  # (key, mode) -> record
    writer: object | None  # results.ShardWriter, None: records kept in memory only
    progress: bool
    ppl: dict  # (length, mode) -> the study's record
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def save(self, record: dict) -> None:
        self.done[(record["key"], record["mode"])] = record
        if self.writer is not None:
            self.writer.append(record)


def run_suite(model, tokenizer, spec: QualitySpec | dict, out=None, progress: bool = False) -> tuple[list, list]:
    """Measure `spec` on `model` (a ForecastKVForCausalLM with a sparse geometry): returns (task records,
    one per example and cell; the study's perplexity records, one per length and cell).

    tokenizer: a Hugging Face tokenizer or a codec (`eval.codec`).  out: a directory for the records
    (`RECORDS`, `PPL_RECORDS`); what it already holds with the same fingerprint is not measured again.
    progress: a line per example on stderr."""
    from ..modeling.configuration import strict_from_dict
    from .codec import as_codec
    from .results import ShardWriter, read_records

    spec = strict_from_dict(QualitySpec, spec, "quality spec")
    check_against_model(spec, model)
    codec = as_codec(tokenizer)
    examples = suite_examples(codec, spec)  # before any model work: a bad length fails now
    fingerprint = suite_fingerprint(model, spec)
    done, writer = {}, None
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        writer = ShardWriter(out, 0)  # cuts off a partial last line
        done = {(r["key"], r["mode"]): r for r in read_records(out) if r.get("fingerprint") == fingerprint}
    ppl_out = None if out is None else Path(out) / PPL_RECORDS
    ppl_records = run_study(model, tokenizer, spec.study_spec(), out=ppl_out, progress=progress)
    ppl = {(r["length"], study_mode(r)): r for r in ppl_records}
    run = SuiteRun(model, codec, spec, fingerprint, done, writer, progress, ppl)
    records = []
    for group in examples.values():
        tally: dict = {}
        for example in group:
            records += run_example(run, example, tally)
    return records, ppl_records


def run_example(run: SuiteRun, example, tally: dict) -> list[dict]:
    """Every cell of one example: what `run.done` holds, the rest decoded from one dense prefill."""
    cells = run.spec.cells()
    began = time.perf_counter()
    missing = [c for c in cells if (example.key, mode_name(c)) not in run.done]
    prefilled = None
    for cell in missing:
        reason = run.ppl[(example.length, mode_name(cell))]["skipped"]
        if reason is None and prefilled is None:
            prefilled = dense_prefill(run.model, ScoredSequence(torch.tensor([example.input_ids]), 0))
        run.save(measure_example_cell(run, example, cell, prefilled, reason))
    records = [run.done[(example.key, mode_name(c))] for c in cells]
    for record in records:
        if record["score"] is not None:
            hits = tally.setdefault(record["mode"], [0, 0])
            hits[0], hits[1] = hits[0] + (record["score"] == 1.0), hits[1] + 1
    if run.progress:
        accuracy = ", ".join(f"{mode} {hits}/{count}" for mode, (hits, count) in tally.items())
        print(
            f"quality: {example.task} L={example.length} #{example.index + 1}/{run.spec.examples}: "
            f"{time.perf_counter() - began:.1f} s ({len(missing)} cells measured); all-correct so far: {accuracy}",
            file=sys.stderr,
            flush=True,
        )
    return records


def measure_example_cell(run: SuiteRun, example, cell: Cell, prefilled, skipped: str | None) -> dict:
    """The record of one (example, cell): decoded and scored, or skipped with `skipped`."""
    began = time.perf_counter()
    record = dict.fromkeys(TASK_FIELDS)
    record.update(
        key=example.key,
        mode=mode_name(cell),
        fingerprint=run.fingerprint,
        run=run.run,
        task=example.task,
        length=example.length,
        index=example.index,
        depth=example.meta.get("depth"),
        needle_at=needle_at(example),
        prompt_tokens=len(example.input_ids),
        prompt_sha=ids_digest(example.input_ids),
        selector=cell.selector,
        budget=cell.blocks,
        max_new_tokens=example.max_new_tokens,
        references=list(example.references),
        metric=example.metric,
        skipped=skipped,
    )
    if skipped is None:
        anchors = tuple(run.ppl[(example.length, mode_name(cell))].get("anchors") or (0,))
        tokens, recall = decode_cell(run.model, prefilled, example.input_ids, example.max_new_tokens, cell, anchors)
        prediction = run.codec.decode(tokens)
        score = score_prediction(example.metric, prediction, example.references, example.all_classes)
        record.update(prediction=prediction, score=float(score), generated_tokens=len(tokens), **recall)
    record["seconds"] = round(time.perf_counter() - began, 4)
    return record
