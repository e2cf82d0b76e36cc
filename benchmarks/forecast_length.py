"""Forecast heads at length (issue #29): recall at 2K / 4K / 8K for heads trained at different lengths.

Per length T, the held-out essays are cut into sequences of T tokens and the frozen model runs once (dense
backbone); at every layer and for the query rows t >= start, in chunks of rows:

* the query selector's blocks (the layer's own queries, `selection.layer_selection` kind "query");
* each head set's forecast blocks (kind "forecast", the head that scores the layer: `heads.scoring_vectors`);
* the oracle: the true attention mass per block (`forecastkv/selectors/oracle.py:oracle_block_mass`) and its
  top `budget_blocks` (`oracle_blocks`).

Reported, as the mean over layers >= 1 of each layer's value (the recall protocol's convention):

* recall vs query: the share of the query selector's non-forced blocks the forecast selection holds
  (`selection.forecast_recall_counts`; the `forecastkv forecast-recall` number), chance beside;
* mass recall vs oracle: the selection's true attention mass / the oracle's (`modeling/selection.py:selection_recall`),
  and the block overlap with the oracle; for the query selector too.

Every number also per position bucket of the rows ([start, 2048), [2048, 4096), [4096, 8192)): a budget of 16
blocks is 50% of the blocks at t = 2048 and 12.5% at t = 8192, so a bucket separates "rows past the training
length" from "a smaller share of the context".

    python benchmarks/forecast_length.py --heads init=init:next_query:1 2k=runs/demo/heads \\
        8k=runs/forecast-8k --lengths 2048 4096 8192 --out benchmarks/results/forecast_length.md

A head set is [label=]spec, spec as in benchmarks/forecast_recall.py: a directory with forecast.safetensors,
or init:<next_query|kaiming>:<vectors per group>.  --check first compares this script's recall vs query with
`training.recall.measure_recall_counts` on one sequence (they must agree exactly).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

QUERY = "query"
BUCKET_EDGES = (2048, 4096)


@dataclass
class Tally:
    """Per-layer sums over rows, per position bucket (fp64).

    mass, overlap, rows: [S, L, NB] for the S selectors (query first, then each head set): the summed mass
    recall and overlap against the oracle over (batch, KV head, row), and the number of such rows.
    vs_query: [S-1, L, NB, 3] for the head sets: hits, wanted, chance against the query selector.
    """

    mass: torch.Tensor
    overlap: torch.Tensor
    rows: torch.Tensor
    vs_query: torch.Tensor

    @classmethod
    def zeros(cls, selectors: int, layers: int, buckets: int) -> "Tally":
        shape = (selectors, layers, buckets)
        zero = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        return cls(zero(shape), zero(shape), zero(shape), zero(selectors - 1, layers, buckets, 3))

    def add(self, other: "Tally") -> None:
        for name in ("mass", "overlap", "rows", "vs_query"):
            getattr(self, name).add_(getattr(other, name))


def bucket_edges(start: int, length: int) -> list[int]:
    """The first row of each position bucket: start, then each of BUCKET_EDGES inside (start, length)."""
    return [start] + [edge for edge in BUCKET_EDGES if start < edge < length]


def _bucket_sum(values: torch.Tensor, bucket: torch.Tensor, buckets: int) -> torch.Tensor:
    """values [B, H, Tq] summed over batch and heads, then per bucket of the rows: fp64 [buckets]."""
    per_row = values.double().sum(dim=(0, 1))
    return torch.zeros(buckets, dtype=torch.float64).index_add_(0, bucket, per_row.cpu())


def _score_chunk(layer, x, cos, sin, pos, keys, ckeys, cis, vectors, sparse, tally, idx, bucket, buckets):
    """One chunk of rows of one layer into `tally`: the query, forecast and oracle selections.

    x [B, Tq, hidden] post-norm input, cos / sin [B, Tq, d], pos [B, Tq]; keys [B, S, H, d] and ckeys
    [B, C, H, d] of the layer; vectors: per head set the forecast vectors [B, Tq, H*n, d] scoring it."""
    from forecastkv.modeling import selection as sel
    from forecastkv.selectors import oracle

    queries = layer.self_attn.queries(x, cos, sin)
    lse_keys = sel.compress_keys(keys, *sparse.coarse_kernel) if sparse.lse == "coarse" else None
    query_ids = sel.layer_selection(queries, ckeys, pos, sparse, "query", lse_keys, cis)
    n_blocks = sel.num_blocks(int(pos.max()) + 1, sparse.block_size)
    mass = oracle.oracle_block_mass(queries, keys, pos, sparse.block_size, n_blocks)
    oracle_ids = oracle.oracle_blocks(mass, pos, sparse.budget_blocks, sparse.block_size)
    chosen = [query_ids] + [sel.layer_selection(v, ckeys, pos, sparse, "forecast", cis=cis) for v in vectors]
    for s, ids in enumerate(chosen):
        recall, overlap = sel.selection_recall(ids, mass, oracle_ids)
        tally.mass[s, idx] += _bucket_sum(recall, bucket, buckets)
        tally.overlap[s, idx] += _bucket_sum(overlap, bucket, buckets)
        tally.rows[s, idx] += _bucket_sum(torch.ones_like(recall), bucket, buckets)
        if s > 0:
            counts = sel.forecast_recall_counts(query_ids, ids, pos, sparse)
            for c, value in enumerate(counts):
                tally.vs_query[s - 1, idx, :, c] += _bucket_sum(value, bucket, buckets)


@torch.no_grad()
def measure_sequence(models: list, input_ids: torch.Tensor, start: int, sparse, chunk: int) -> Tally:
    """The tally of one batch input_ids [B, T]: models[0] runs the frozen forward (dense attention), every
    model's heads score every layer.  Rows t >= start, `chunk` rows at a time (the oracle's softmax is
    [Hq, chunk, T] per sequence).  Memory: one layer's K/V at a time."""
    from forecastkv.modeling import selection as sel
    from forecastkv.modeling.heads import scoring_vectors
    from forecastkv.modeling.routing import attending_with

    inner = models[0].model
    layers, length = inner.config.num_hidden_layers, input_ids.shape[1]
    edges = bucket_edges(start, length)
    tally = Tally.zeros(1 + len(models), layers, len(edges))
    carried: dict = {}

    def on_layer(idx, normed, positions, cos, sin, cache_layer):
        keys, _, cis, _ = cache_layer.full()
        ckeys = sel.compress_keys(keys, sparse.kernel_size, sparse.kernel_stride)
        rows = slice(start, None)
        x, c, s, pos = normed[:, rows], cos[:, rows], sin[:, rows], positions[:, rows]
        owner_input = x if idx == 0 else carried.pop("normed")  # the input of the head's owning layer
        vectors = [scoring_vectors(m.model.layers, idx, owner_input, c, s) for m in models]
        bucket = torch.bucketize(pos[0].cpu(), torch.tensor(edges), right=True) - 1
        for first in range(0, pos.shape[1], chunk):
            part = slice(first, first + chunk)
            _score_chunk(
                inner.layers[idx], x[:, part], c[:, part], s[:, part], pos[:, part], keys, ckeys, cis,
                [v[:, part] for v in vectors], sparse, tally, idx, bucket[part], len(edges),
            )  # fmt: skip
        carried["normed"] = x
        cache_layer.reset()  # nothing reads this layer's K/V again: keep memory at one layer

    with attending_with(inner, None):
        inner(input_ids, layer_callback=on_layer)
    return tally


def summarise(tally: Tally, names: list[str], edges: list[int], length: int) -> dict:
    """{selector: {bucket label: {mass, overlap[, vs_query, chance]}}}, each the mean over layers >= 1 of the
    per-layer value; bucket "all" pools every row t >= start (the protocol's number)."""
    from forecastkv.modeling.selection import RECALL_FIRST_LAYER

    first = RECALL_FIRST_LAYER
    labels = [f"[{a}, {b})" for a, b in zip(edges, edges[1:] + [length])]
    out = {}
    for s, name in enumerate([QUERY] + names):
        out[name] = {}
        for label, pick in [("all", slice(None))] + [(lab, slice(b, b + 1)) for b, lab in enumerate(labels)]:
            rows = tally.rows[s, first:, pick].sum(-1).clamp(min=1)
            cell = {
                "mass": float((tally.mass[s, first:, pick].sum(-1) / rows).mean()),
                "overlap": float((tally.overlap[s, first:, pick].sum(-1) / rows).mean()),
            }
            if s > 0:
                hits, wanted, chance = tally.vs_query[s - 1, first:, pick].sum(-2).unbind(-1)
                cell["vs_query"] = float((hits / wanted.clamp(min=1)).mean())
                cell["chance"] = float((chance / wanted.clamp(min=1)).mean())
            out[name][label] = cell
    return out


def check_against_protocol(models: list, sequence: torch.Tensor, start: int, sparse, chunk: int) -> None:
    """Raise unless this script's per-layer recall vs query of models[0] equals the recall protocol's
    (`training.recall.measure_recall_counts`) on sequence [1, T]: the same hits and wanted blocks per layer."""
    from forecastkv.training.recall import measure_recall_counts

    ours = measure_sequence(models[:1], sequence, start, sparse, chunk).vs_query[0].sum(1)
    theirs = measure_recall_counts(models[0], sequence, start, "dense", sparse)
    # hits and wanted are counts (exact); chance is fp32 per row, summed in another order here
    if not (torch.equal(ours[:, :2], theirs[:, :2]) and torch.allclose(ours[:, 2], theirs[:, 2], rtol=1e-6)):
        raise AssertionError(f"recall vs query differs from the protocol's:\n{ours}\n{theirs}")
    print(f"check: recall vs query equals measure_recall_counts at T = {sequence.shape[1]}", file=sys.stderr)


def parse_heads(specs: list[str]) -> list[tuple[str, str]]:
    """[label=]spec -> (label, spec); the label defaults to the spec."""
    return [tuple(s.split("=", 1)) if "=" in s else (s, s) for s in specs]


def run(args) -> dict:
    """Every length of args.lengths: {"lengths": {T: {...summary, sequences, rows, seconds}}, ...}."""
    from forecast_recall import load_heads

    from forecastkv.training.recall import RecallProtocol, heldout_sequences, resolve_geometry

    sparse_dict = resolve_geometry(args.sparse_config, None, args.topk)
    heads = parse_heads(args.heads)
    loaded = [load_heads(spec, args.model, sparse_dict) for _, spec in heads]
    models, tokenizer = [m for m, _, _ in loaded], loaded[0][1]
    sparse = models[0].model.config.sparse
    names = [label for label, _ in heads]
    results = {"heads": dict(heads), "sparse_config": sparse_dict, "start": args.start, "lengths": {}}
    counts = args.sequences or [None]
    if len(counts) not in (1, len(args.lengths)):
        raise ValueError(f"--sequences takes 1 count or one per length ({len(args.lengths)}), got {len(counts)}")
    for length, count in zip(args.lengths, counts * len(args.lengths) if len(counts) == 1 else counts):
        protocol = RecallProtocol(length=length, start=args.start, sequences=count)
        sequences = heldout_sequences(protocol, tokenizer)
        if args.check and length == args.lengths[0]:
            check_against_protocol(models, sequences[:1], args.start, sparse, args.chunk)
        started = time.time()
        edges = bucket_edges(args.start, length)
        tally = Tally.zeros(1 + len(models), models[0].config.num_hidden_layers, len(edges))
        for number, row in enumerate(sequences, 1):
            tally.add(measure_sequence(models, row.view(1, -1), args.start, sparse, args.chunk))
            print(f"T = {length}: sequence {number}/{len(sequences)}, {time.time() - started:.0f} s", file=sys.stderr)
        results["lengths"][length] = {
            "sequences": sequences.shape[0],
            "rows": sequences.shape[0] * (length - args.start),
            "seconds": time.time() - started,
            "selectors": summarise(tally, names, edges, length),
            "per_layer": per_layer(tally, names),
        }
        print(f"T = {length}: {time.time() - started:.0f} s", file=sys.stderr)
    return results


def per_layer(tally: Tally, names: list[str]) -> dict:
    """{selector: {"mass": [L], "vs_query": [L]}} over every row t >= start."""
    mass = tally.mass.sum(-1) / tally.rows.sum(-1).clamp(min=1)
    out = {QUERY: {"mass": mass[0].tolist()}}
    for s, name in enumerate(names):
        hits, wanted, _ = tally.vs_query[s].sum(1).unbind(-1)
        out[name] = {"mass": mass[s + 1].tolist(), "vs_query": (hits / wanted.clamp(min=1)).tolist()}
    return out


def tables(results: dict) -> str:
    """The Markdown tables: per length (all rows t >= start), then per position bucket at each length."""
    lengths = list(results["lengths"])
    first = results["lengths"][lengths[0]]["selectors"]
    lines = [
        "| selector | " + " | ".join(f"vs query @ {t}" for t in lengths) + " | "
        + " | ".join(f"mass vs oracle @ {t}" for t in lengths) + " |",
        "|---" * (1 + 2 * len(lengths)) + "|",
    ]  # fmt: skip
    for name in first:
        at = [results["lengths"][t]["selectors"][name]["all"] for t in lengths]
        query = " | ".join(f"{a['vs_query']:.3f}" if "vs_query" in a else "(1)" for a in at)
        lines.append(f"| {name} | {query} | " + " | ".join(f"{a['mass']:.3f}" for a in at) + " |")
    chance = [results["lengths"][t]["selectors"][name]["all"].get("chance") for t in lengths]
    lines.append("| chance | " + " | ".join(f"{c:.3f}" for c in chance) + " |" + " |" * len(lengths))
    for length in lengths:
        selectors = results["lengths"][length]["selectors"]
        buckets = list(next(iter(selectors.values())))
        lines += ["", f"T = {length}, by row position (vs query / mass vs oracle / overlap with oracle):", ""]
        lines += ["| selector | " + " | ".join(buckets) + " |", "|---" * (1 + len(buckets)) + "|"]
        for name, cells in selectors.items():
            row = [
                (f"{c['vs_query']:.3f}" if "vs_query" in c else "-") + f" / {c['mass']:.3f} / {c['overlap']:.3f}"
                for c in cells.values()
            ]
            lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", nargs="+", required=True, help="[label=]spec, spec a heads dir or init:...")
    parser.add_argument("--model", default="bundled:smollm2-135m")
    parser.add_argument("--sparse-config", default="smollm2-135m")
    parser.add_argument("--topk", type=int, default=12)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--start", type=int, default=1024)
    parser.add_argument(
        "--sequences",
        type=int,
        nargs="+",
        default=None,
        help="one count for every length, or one per length (default: all)",
    )
    parser.add_argument("--chunk", type=int, default=512, help="query rows per oracle softmax")
    parser.add_argument("--check", action="store_true", help="first check recall vs query against the protocol")
    parser.add_argument("--out", default=None, help="write the Markdown tables (and a .json beside them)")
    args = parser.parse_args(argv)
    started = time.time()
    results = run(args)
    results["seconds"] = time.time() - started
    table = tables(results)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(results, indent=2))
        out.write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
