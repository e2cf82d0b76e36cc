"""Forecast recall of saved heads on held-out text: the protocol's runner (its sums and report are `selection.py`'s).

    forecastkv forecast-recall --forecast-weights runs/smollm2-135m-forecast --length 2048 --start 1024
    forecastkv forecast-recall --init next_query --heads-per-group 1      # an untrained init

The protocol (`forecast_recall` below): a held-out split cut into sequences of T tokens, query
rows t in [start, T) only, both selectors scored at every layer against that layer's keys, recall
per layer and as the mean over layers >= 1, chance alongside.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from forecastkv.atomic import write_text_atomic
from forecastkv.bundled import resolve_heads_path, resolve_model_path
from forecastkv.errors import ConfigError
from forecastkv.modeling import selection as sel
from forecastkv.modeling.heads import scoring_vectors
from forecastkv.modeling.routing import BACKBONES, attending_with, backbone_sparse_config
from forecastkv.selectors.oracle import oracle_block_mass
from forecastkv.training.recall_cli import DEFAULT_START, REFERENCES, build_parser

# ----------------------------------------------------------------------------------------------
# the runner: both selectors at every layer of a frozen forward
# ----------------------------------------------------------------------------------------------


def oracle_selection(queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, sparse) -> torch.Tensor:
    """The `budget_blocks` blocks the layer's true attention puts the most mass on, the init and local
    blocks forced as deployed, future blocks excluded (`oracle_block_mass`): int64 [B, H, Tq, K]."""
    n_blocks = sel.num_blocks(int(positions.max()) + 1, sparse.block_size)
    mass = oracle_block_mass(queries, keys, positions, sparse.block_size, n_blocks)
    blocks = torch.arange(n_blocks, device=mass.device).view(1, 1, -1)
    future = (blocks > torch.div(positions, sparse.block_size, rounding_mode="floor").unsqueeze(-1))[:, None]
    scores = sel.force_blocks(mass.masked_fill(future, sel.NEG_INF), positions, sparse.block_size,
                              sparse.init_blocks, sparse.local_blocks)  # fmt: skip
    return sel.topk_blocks(scores, positions, sparse.budget_blocks, sparse.block_size)


@torch.no_grad()
def measure_recall_counts(
    model,
    input_ids: torch.Tensor,
    start: int,
    backbone: str = "dense",
    sparse=None,
    on_layer_done=None,
    reference: str = "query",
) -> torch.Tensor:
    """Per-layer recall sums fp64 [L, 3] (hits, wanted, chance) of `model` on input_ids [B, T].

    model: a ForecastKVForCausalLM (or ForecastKVModel) with forecast heads; sparse: the geometry
    both selectors use (default: the model's sparse_config).  At every layer l both selections are
    made for the rows t >= start against layer l's keys: the reference's, and the forecast selector's
    from the head that scores l (`heads.scoring_head`) by `selection.layer_selection`.  reference:
    "query" (the query selector from l's real queries: what heads trained on the selector teacher
    imitate) or "oracle" (the top blocks of l's true attention, `oracle_selection`: what the
    attention teacher's heads imitate).  Memory: one layer's K/V at a time.  on_layer_done(idx):
    called as each layer is scored (a progress bar).
    """
    if reference not in REFERENCES:
        raise ConfigError(f"recall reference {reference!r} is not one of {REFERENCES}")
    inner = getattr(model, "model", model)
    config = inner.config
    sparse = sparse if sparse is not None else config.sparse
    if sparse is None:
        raise ConfigError("forecast recall needs a sparse geometry: the model has no sparse_config, pass sparse=")
    if not config.forecast_config.enabled:
        raise ConfigError("forecast recall needs a model with forecast heads")
    length = input_ids.shape[1]
    if not 0 <= start < length:
        raise ConfigError(f"recall start={start} must lie in [0, sequence length {length})")
    last = config.num_hidden_layers - 1
    counts = torch.zeros(config.num_hidden_layers, 3, dtype=torch.float64)
    carried: dict = {}

    def on_layer(idx, normed, positions, cos, sin, cache_layer):
        attn = inner.layers[idx].self_attn
        rows = slice(start, None)
        x, c, s, pos = normed[:, rows], cos[:, rows], sin[:, rows], positions[:, rows]
        keys, _, cis, _ = cache_layer.full()
        ckeys = sel.compress_keys(keys, sparse.kernel_size, sparse.kernel_stride)
        lse_keys = sel.compress_keys(keys, *sparse.coarse_kernel) if sparse.lse == "coarse" else None
        forecast = scoring_vectors(inner.layers, 0, x, c, s) if idx == 0 else carried.pop("forecast")
        queries = attn.queries(x, c, s)
        if reference == "oracle":
            query_ids = oracle_selection(queries, keys, pos, sparse)
        else:
            query_ids = sel.layer_selection(queries, ckeys, pos, sparse, "query", lse_keys, cis)
        forecast_ids = sel.layer_selection(forecast, ckeys, pos, sparse, "forecast", cis=cis)
        counts[idx] = sel.recall_row_sums(query_ids, forecast_ids, pos, sparse, start)
        if idx < last:
            carried["forecast"] = scoring_vectors(inner.layers, idx + 1, x, c, s)
        cache_layer.reset()  # nothing reads this layer's K/V again: keep memory at one layer
        if on_layer_done is not None:
            on_layer_done(idx)

    with attending_with(inner, backbone_sparse_config(backbone, sparse)):
        inner(input_ids, layer_callback=on_layer)
    return counts


def forecast_recall(
    model,
    sequences: torch.Tensor,
    start: int,
    backbone: str = "dense",
    sparse=None,
    batch_size: int = 1,
    progress: bool = False,
    reference: str = "query",
) -> sel.RecallReport:
    """The recall protocol on held-out sequences [N, T] (int64 token ids): per layer and mean over
    layers >= 1, chance alongside, counting query rows t in [start, T) only.  See
    `measure_recall_counts` for model / backbone / sparse / reference.  progress: a bar on stderr that
    moves layer by layer (a 2K sequence of a 30-layer model takes seconds per layer on a CPU)."""
    sequences = torch.as_tensor(sequences)
    if sequences.dim() != 2 or sequences.shape[0] == 0:
        raise ConfigError(
            f"sequences must be a non-empty [N, T] tensor of token ids, got shape {tuple(sequences.shape)}"
        )
    device = next(model.parameters()).device
    config = getattr(model, "model", model).config
    counts = torch.zeros(config.num_hidden_layers, 3, dtype=torch.float64)
    from tqdm.auto import tqdm

    layers = config.num_hidden_layers
    bar = tqdm(
        total=sequences.shape[0] * layers,
        desc=f"recall ({sequences.shape[0]} sequences x {layers} layers)",
        unit="layer",
        disable=not progress,
        dynamic_ncols=True,
        file=sys.stderr,
    )
    for first in range(0, sequences.shape[0], batch_size):
        rows = sequences[first : first + batch_size]
        counts += measure_recall_counts(
            model, rows.to(device), start, backbone, sparse, lambda idx, n=rows.shape[0]: bar.update(n), reference
        )
    bar.close()
    length = sequences.shape[1]
    return sel.summarise_recall(counts, start, length, sequences.shape[0] * (length - start), backbone)


@dataclass(frozen=True)
class RecallProtocol:
    """What a recall number means: held-out `split` of `source`, `sequences` sequences of `length`
    tokens (all there are when None), rows t >= `start`, attention of the frozen model `backbone`,
    recall of `reference`'s blocks ("query" or "oracle": `measure_recall_counts`)."""

    source: str = "bundled"
    split: str = "heldout"
    length: int = 2048
    start: int = DEFAULT_START
    sequences: int | None = None
    backbone: str = "dense"
    reference: str = "query"

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.length:
            raise ConfigError(f"recall start={self.start} must lie in [0, length={self.length})")
        if self.backbone not in BACKBONES:
            raise ConfigError(f"backbone {self.backbone!r} is not one of {BACKBONES}")
        if self.reference not in REFERENCES:
            raise ConfigError(f"recall reference {self.reference!r} is not one of {REFERENCES}")


def heldout_sequences(protocol: RecallProtocol, tokenizer) -> torch.Tensor:
    """[N, length] int64: the held-out documents packed in storage order (no shuffle)."""
    from .data import build_sequences

    packed = build_sequences(
        protocol.source, tokenizer, protocol.length, split=protocol.split, shuffle=False, name="recall data"
    )
    count = len(packed) if protocol.sequences is None else min(protocol.sequences, len(packed))
    return packed.first(count)


def evaluate_recall(
    model, tokenizer, protocol: RecallProtocol = RecallProtocol(), sparse=None, progress: bool = False
) -> sel.RecallReport:
    """Run the protocol on `model` (forecast heads required).  Returns a `selection.RecallReport`."""
    sequences = heldout_sequences(protocol, tokenizer)
    return forecast_recall(
        model, sequences, protocol.start, protocol.backbone, sparse=sparse, progress=progress,
        reference=protocol.reference,
    )  # fmt: skip


def load_for_recall(
    base: str,
    forecast_weights: str | None = None,
    sparse_config=None,
    init: str = "next_query",
    heads_per_group: int = 1,
):
    """(model, tokenizer, base path): the base with saved heads (`forecast_weights`) or freshly
    initialised ones (`init`, `heads_per_group`), float32."""
    from transformers import AutoTokenizer

    from forecastkv import ForecastKVForCausalLM

    path = resolve_model_path(base)
    if forecast_weights is not None:
        model = ForecastKVForCausalLM.from_pretrained(
            path, sparse_config=sparse_config, forecast_weights=forecast_weights
        )
    else:
        model = ForecastKVForCausalLM.from_pretrained(
            path, sparse_config=sparse_config, forecast={"init": init, "heads_per_group": heads_per_group}
        )
    return model.float().eval(), AutoTokenizer.from_pretrained(path), path


def _json_mapping(text: str, where: str) -> dict:
    """The JSON object in `text`; anything else is a ConfigError naming `where`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{where} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must hold a JSON object, got a {type(value).__name__}")
    return value


def resolve_geometry(sparse_config=None, forecast_weights=None, topk: int | None = None) -> dict:
    """The sparse_config dict both selectors use: `sparse_config` (preset name, JSON text or dict),
    else the one saved beside `forecast_weights`, else the smollm2-135m preset; `topk` overrides."""
    from forecastkv.modeling.configuration import resolve_sparse_config

    if isinstance(sparse_config, str) and sparse_config.lstrip().startswith("{"):
        sparse_config = _json_mapping(sparse_config, "--sparse-config")
    if sparse_config is None and forecast_weights is not None:
        side = Path(resolve_heads_path(forecast_weights)) / "forecast_config.json"
        if side.is_file():
            sparse_config = _json_mapping(side.read_text(errors="replace"), str(side)).get("sparse_config")
    geometry = dict(resolve_sparse_config(sparse_config if sparse_config is not None else "smollm2-135m"))
    if topk is not None:
        geometry["topk"] = topk
    return resolve_sparse_config(geometry)


def run(args) -> int:
    """`forecastkv forecast-recall` with its parsed arguments (`recall_cli.build_parser`)."""
    protocol = RecallProtocol(
        args.source, args.split, args.length, args.start, args.sequences, args.backbone, args.reference
    )
    sparse = resolve_geometry(args.sparse_config, args.forecast_weights, args.topk)
    model, tokenizer, _ = load_for_recall(args.model, args.forecast_weights, sparse, args.init, args.heads_per_group)
    report = evaluate_recall(model, tokenizer, protocol, progress=not args.no_progress)
    what = args.forecast_weights or f"init {args.init}, {args.heads_per_group} vector(s) per group"
    print(
        f"forecast recall of {what}: T={args.length}, rows t >= {args.start}, {report.rows} rows, "
        f"backbone {args.backbone}, recall of the {args.reference} selection's blocks"
    )
    print(report.table())
    if args.json:
        record = {"protocol": protocol.__dict__, "heads": what, **report.to_dict()}
        write_text_atomic(args.json, json.dumps(record, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m forecastkv.training.recall ...`, the same as `forecastkv forecast-recall ...`."""
    return run(build_parser().parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())
