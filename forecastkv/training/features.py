"""The feature cache: what the Forecast heads read, computed once per sequence and reused.

The base is frozen, so everything a head's loss depends on except the head itself is a constant of
the sequence: for every layer m, the post-norm input of the head that scores m (layer m-1's input,
or layer 0's own for `current_proj`), layer m's deployed compressed keys and the teacher rows.
`build_features` runs the frozen model once (through `ForecastKVModel.forward(layer_callback=)`,
the model's own decoder loop) and keeps those for a subset of query rows -- with the "topk" loss
also each row's top-k + rest target (`objective.topk_targets`: the teacher's routed blocks, a
constant of the row too); a training step then costs one projection and one [rows x C] softmax
per layer, a small fraction of a forward.

Memory: the model holds one layer's K/V at a time (each layer's cache is dropped once read); the
cache keeps, per sequence, L x rows x (hidden + H x C) numbers, plus for "topk" about 3 x H x M
per row (M supervised slots: int64 index, bool mask, fp32 target; M is fixed by the budget, not
by T), independent of T^2.

On disk (`save_part` / `load_part`): a run keeps each micro-batch's features beside its
checkpoints (`<output_dir>/features/`), one safetensors file per micro-batch, named by a key over
everything they depend on (the trainer's `feature_key`: base model, geometry, objective, backbone,
rows, the tokens themselves), written atomically with a checksum.  A resume -- or a rerun after a
kill during the build -- loads them instead of running the frozen model again.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from forecastkv.errors import ConfigError
from forecastkv.modeling import selection as sel
from forecastkv.modeling.heads import scoring_head
from forecastkv.modeling.routing import attending_with, backbone_sparse_config

from .objective import ObjectiveConfig, TopkTargets, teacher_keys, teacher_rows, topk_targets


@dataclass
class Features:
    """Cached inputs of one micro-batch, for R cached query rows per sequence.

    positions [B, R] int64, cos / sin [B, R, d] (RoPE at those rows), inputs: L-1 tensors
    [B, R, hidden] (post-norm input of layer l, l = 0..L-2), ckeys: L tensors [B, C, H, d] (layer
    m's deployed compressed keys, fp32), teachers: L tensors [B, H, R, C] (fp32, rows sum to 1),
    query_sq: fp32 [L, Hq] (mean squared norm of layer m's real queries per query head, for calibration),
    targets: L `TopkTargets` of the teacher rows (loss "topk"; None for "full").
    """

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    inputs: list
    ckeys: list
    teachers: list
    query_sq: torch.Tensor
    targets: list | None = None

    def head_input(self, layer: int) -> tuple[torch.Tensor, str, int]:
        """(input rows [B, R, hidden], projection name, owning layer) of the head scoring `layer`
        (`modeling.heads.scoring_head`): the post-norm input of the owning layer."""
        owner, projection = scoring_head(layer)
        return self.inputs[owner], projection, owner

    def take(self, index: torch.Tensor) -> "Features":
        """The cached rows `index` [B, r] (int64, per sequence, into the R cached rows)."""

        def rows(t: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = index.shape[1]
            view = [index.shape[0]] + [1] * (t.dim() - 1)
            view[dim] = index.shape[1]
            return torch.gather(t, dim, index.view(view).expand(shape))

        return Features(
            rows(self.positions, 1),
            rows(self.cos, 1),
            rows(self.sin, 1),
            [rows(x, 1) for x in self.inputs],
            self.ckeys,
            [rows(t, 2) for t in self.teachers],
            self.query_sq,
            None if self.targets is None else [t.take(index) for t in self.targets],
        )

    @staticmethod
    def merge(parts: list) -> "Features":
        """Concatenate micro-batches with equal T and R along the batch (one op per layer per step)."""
        cat = lambda get: torch.cat([get(p) for p in parts])  # noqa: E731
        layers = range(len(parts[0].ckeys))
        return Features(
            cat(lambda p: p.positions),
            cat(lambda p: p.cos),
            cat(lambda p: p.sin),
            [cat(lambda p, i=i: p.inputs[i]) for i in range(len(parts[0].inputs))],
            [cat(lambda p, i=i: p.ckeys[i]) for i in layers],
            [cat(lambda p, i=i: p.teachers[i]) for i in layers],
            torch.stack([p.query_sq for p in parts]).mean(0),
            None
            if parts[0].targets is None
            else [TopkTargets.cat([p.targets[i] for p in parts], dim=0) for i in layers],
        )

    def to_tensors(self) -> dict:
        """{name: tensor} of every cached tensor (`from_tensors` inverts it)."""
        tensors = {"positions": self.positions, "cos": self.cos, "sin": self.sin, "query_sq": self.query_sq}
        for group in ("inputs", "ckeys", "teachers"):
            tensors.update({f"{group}/{i}": t for i, t in enumerate(getattr(self, group))})
        for i, targets in enumerate(self.targets or []):
            tensors.update({f"targets/{i}/{f}": getattr(targets, f) for f in TopkTargets._fields})
        return tensors

    @staticmethod
    def from_tensors(tensors: dict, device=None) -> "Features":
        def group(name: str) -> list:
            count = sum(1 for key in tensors if key.startswith(f"{name}/") and key.count("/") == 1)
            return [tensors[f"{name}/{i}"].to(device) for i in range(count)]

        layers = len(group("ckeys"))
        targets = None
        if any(key.startswith("targets/") for key in tensors):
            targets = [
                TopkTargets(*(tensors[f"targets/{i}/{f}"].to(device) for f in TopkTargets._fields))
                for i in range(layers)
            ]
        return Features(
            tensors["positions"].to(device),
            tensors["cos"].to(device),
            tensors["sin"].to(device),
            group("inputs"),
            group("ckeys"),
            group("teachers"),
            tensors["query_sq"],
            targets,
        )

    def nbytes(self) -> int:
        """Bytes held by the cached tensors."""
        tensors = [self.positions, self.cos, self.sin, *self.inputs, *self.ckeys, *self.teachers]
        tensors += [t for targets in self.targets or [] for t in targets]
        return sum(t.numel() * t.element_size() for t in tensors)


def cached_rows(length: int, row_start: int, count: int | None, generator: torch.Generator | None) -> torch.Tensor:
    """Sorted row indices int64 [R] in [row_start, length): all of them, or `count` drawn without
    replacement by `generator`."""
    if not 0 <= row_start < length:
        raise ConfigError(f"row_start={row_start} must lie in [0, sequence length {length})")
    rows = torch.arange(row_start, length)
    if count is not None and count < rows.numel():
        rows = rows[torch.randperm(rows.numel(), generator=generator)[:count]].sort().values
    return rows


@torch.no_grad()
def build_features(
    model,
    ids: torch.Tensor,
    rows: torch.Tensor,
    sparse,
    objective: ObjectiveConfig,
    backbone: str = "query",
    on_layer_done=None,
) -> Features:
    """Run the frozen `model` once over ids [B, T] and cache the rows `rows` [R] (int64, sorted).

    sparse: the geometry the heads are trained for; backbone: what the frozen model attends with
    ("dense", "query" = its sparse attention routed by real queries, "forecast"); on_layer_done:
    called with each layer's index once its features are cached (a progress bar; it may raise to
    abandon the build).
    """
    inner = getattr(model, "model", model)
    config = inner.config
    last = config.num_hidden_layers - 1
    rows = rows.to(ids.device)
    topk = objective.loss == "topk"
    store: dict = {"inputs": [], "ckeys": [], "teachers": [], "norms": [], "targets": []}

    def on_layer(idx, normed, positions, cos, sin, cache_layer):
        attn = inner.layers[idx].self_attn
        if idx == 0:
            store["positions"], store["cos"], store["sin"] = (
                positions[:, rows],
                cos[:, rows].float(),
                sin[:, rows].float(),
            )
        x = normed[:, rows]
        if idx < last:
            store["inputs"].append(x.float())
        keys = cache_layer.full()[0]
        ckeys = sel.compress_keys(keys, sparse.kernel_size, sparse.kernel_stride).float()
        read = teacher_keys(keys, objective)
        pos = store["positions"]
        queries = attn.queries(x, cos[:, rows], sin[:, rows])
        chunks, targets = [], []
        for start in range(0, rows.numel(), objective.chunk_size):
            part = slice(start, start + objective.chunk_size)
            chunks.append(teacher_rows(queries[:, part], read, pos[:, part], sparse, objective, ckeys.shape[1]))
            if topk:  # a row's target depends on its teacher row and position only: chunking is exact
                targets.append(topk_targets(chunks[-1], pos[:, part], sparse, objective.teacher))
        store["ckeys"].append(ckeys)
        store["teachers"].append(torch.cat(chunks, dim=2))
        if topk:
            store["targets"].append(TopkTargets.cat(targets, dim=2))
        store["norms"].append(queries.float().pow(2).sum(-1).mean(dim=(0, 1)).cpu())  # [Hq]
        cache_layer.reset()  # nothing reads this layer's K/V again
        if on_layer_done is not None:
            on_layer_done(idx)

    with attending_with(inner, backbone_sparse_config(backbone, sparse)):
        inner(ids, layer_callback=on_layer)
    return Features(
        store["positions"],
        store["cos"],
        store["sin"],
        store["inputs"],
        store["ckeys"],
        store["teachers"],
        torch.stack(store["norms"]),
        store["targets"] if topk else None,
    )


def head_vectors(model, features: Features, layer: int) -> torch.Tensor:
    """Forecast vectors [B, R, H*n, d] (post-RoPE) scoring `layer` at the cached rows,
    differentiable in the head's weight: the owning layer's `SparseAttention.project_forecast` on
    the cached input rows (cast to the head's dtype, fp32 in training)."""
    inner = getattr(model, "model", model)
    x, projection, owner = features.head_input(layer)
    attn = inner.layers[owner].self_attn
    dtype = getattr(attn, projection).weight.dtype
    return attn.project_forecast(x.to(dtype), features.cos.to(dtype), features.sin.to(dtype), projection)


# ----------------------------------------------------------------------------------------------
# the on-disk cache
# ----------------------------------------------------------------------------------------------

CACHE_KEY = "forecastkv.features"  # metadata: {"key": ..., "build_s": ...}


def save_part(path: Path, part: Features, key: str, build_seconds: float) -> Path:
    """Write one micro-batch's features to `path` atomically, with its key, the seconds its build
    took and a checksum (`checkpointing.state_checksum`)."""
    from safetensors.torch import save_file

    from forecastkv.atomic import write_atomic

    from .checkpointing import CHECKSUM_KEY, state_checksum

    tensors = {name: t.detach().cpu().contiguous() for name, t in part.to_tensors().items()}
    meta = json.dumps({"key": key, "build_s": build_seconds})
    metadata = {CACHE_KEY: meta, CHECKSUM_KEY: state_checksum(meta, tensors)}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())  # refused early without room
    return write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata), nbytes)


def load_part(path: Path, key: str, device=None) -> tuple[Features, float, float] | None:
    """(features, seconds their build took, seconds this load took) from `path`, or None when the
    file is missing, written under another key, or damaged (a warning says so: it is rebuilt)."""
    import warnings

    from safetensors import safe_open

    from .checkpointing import CHECKSUM_KEY, state_checksum

    if not path.is_file():
        return None
    started = time.perf_counter()
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        meta = json.loads(metadata[CACHE_KEY])
        intact = metadata.get(CHECKSUM_KEY) == state_checksum(metadata[CACHE_KEY], tensors)
    except Exception as error:  # any unreadable file is a miss: the features are rebuilt
        warnings.warn(f"feature cache {path} is unreadable ({error}); rebuilding it", stacklevel=2)
        return None
    if not intact:
        warnings.warn(f"feature cache {path} does not match its checksum; rebuilding it", stacklevel=2)
        return None
    if meta.get("key") != key:
        return None
    return Features.from_tensors(tensors, device), float(meta["build_s"]), time.perf_counter() - started
