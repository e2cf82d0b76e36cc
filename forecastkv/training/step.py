"""One training step of the Forecast heads, and their evaluation (what `trainer.py` runs each step and
each eval): the trainable heads (`forecast_heads`), the step's rows drawn from the cached ones
(`step_rows`), every layer's loss on them and one backward (`step_loss`, `backward_step`, gradients
summed over processes), the first round's norm calibration (`calibrate_from_features`), held-out
recall (`evaluate`) and the per-layer guard (`guard_layers`).
"""

from __future__ import annotations

import sys

import torch

from forecastkv.modeling import selection as sel
from forecastkv.modeling.forecast_init import calibrate_forecast_scale
from forecastkv.modeling.heads import scoring_head_name, trainable_head_names

from .features import Features, head_vectors
from .objective import ObjectiveConfig, rows_kl
from .recall import measure_recall_counts

# Salt of the per-step row draws, seeded (train.seed, ROW_DRAW_SALT, step, micro-batch): it keeps
# that stream apart from the per-round cached-row draws, seeded (train.seed, round, micro-batch).
# Changing it changes which rows every step trains on (and so every result).
ROW_DRAW_SALT = 7


def forecast_heads(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable tensors in state-dict order: the heads that score some layer
    (`modeling.heads.trainable_head_names`; the last layer's forecast_proj has no consumer and
    stays frozen)."""
    names = set(trainable_head_names(model.config.num_hidden_layers))
    return [(name, p) for name, p in model.named_parameters() if name in names]


def seeded(*parts: int) -> torch.Generator:
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part)) % (2**63 - 1)
    return torch.Generator().manual_seed(value)


def progress_bar(label: str | None, total: int, **kwargs):
    """A tqdm bar on stderr with `label` (None: a disabled one)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=label, disable=label is None, dynamic_ncols=True, file=sys.stderr, **kwargs)


def step_rows(features: Features, first_chunk: int, step: int, recipe: dict) -> torch.Tensor | None:
    """Row indices [B, r] into the cached rows for this step (None: all rows).  Sequence b belongs
    to micro-batch first_chunk + b // micro_batch, whose draw is seeded with (seed, salt, step,
    chunk), so the draw does not depend on how the sequences are split over processes."""
    train = recipe["train"]
    batch, count = features.positions.shape
    take = train["rows_per_step"]
    if take is None or take >= count:
        return None
    micro = train["micro_batch"]
    draws = {}
    for b in range(batch):
        chunk = first_chunk + b // micro
        if chunk not in draws:
            draws[chunk] = (
                torch.randperm(count, generator=seeded(train["seed"], ROW_DRAW_SALT, step, chunk))[:take].sort().values
            )
    return torch.stack([draws[first_chunk + b // micro] for b in range(batch)]).to(features.positions.device)


def step_loss(
    model, features: Features, first_chunk: int, step: int, recipe: dict, objective: ObjectiveConfig, denominator: float
) -> list[float]:
    """Back-propagate one step's loss over this process's cached rows; returns the per-layer
    losses (this process's share of the global mean)."""
    sparse = model.config.sparse
    index = step_rows(features, first_chunk, step, recipe)
    feats = features if index is None else features.take(index)
    per_layer, total = [], 0.0
    for layer in range(model.config.num_hidden_layers):
        targets = None if feats.targets is None else feats.targets[layer]
        vectors = head_vectors(model, feats, layer)
        loss = rows_kl(
            vectors, feats.ckeys[layer], feats.positions, feats.teachers[layer], sparse, objective.loss, targets
        )
        loss = loss / denominator
        per_layer.append(float(loss.detach()))
        total = total + loss
    total.backward()
    return per_layer


def sum_over_processes(params: list[torch.nn.Parameter], accelerator) -> None:
    """All-reduce (sum) the gradients of `params` in one flat buffer.  Each micro-batch loss was
    scaled by its share of the global batch, so the sum is the global-batch mean gradient."""
    grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
    grads = accelerator.reduce(grads, reduction="sum")
    offset = 0
    for p in params:
        p.grad = grads[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def backward_step(
    model,
    params,
    features: Features,
    first_chunk: int,
    step: int,
    recipe: dict,
    objective,
    denominator: float,
    accelerator,
) -> float:
    """Gradients of the global-batch loss in `params` (this process's share, summed over
    processes); returns that loss (summed over layers)."""
    layer_losses = step_loss(model, features, first_chunk, step, recipe, objective, denominator)
    loss = torch.tensor([sum(layer_losses)], dtype=torch.float64)
    if accelerator.num_processes > 1:
        sum_over_processes(params, accelerator)
        loss = accelerator.reduce(loss.to(accelerator.device), reduction="sum").cpu()
    return float(loss)


@torch.no_grad()
def _calibration_sums(model, part: Features) -> torch.Tensor:
    """One micro-batch's calibration sums, float64 [L*H*n + L*Hq + 1]: squared head-output norms
    summed over its rows, squared real-query norms summed over its rows, the row count."""
    layers = model.config.num_hidden_layers
    head_sq = torch.stack(
        [head_vectors(model, part, m).double().pow(2).sum(-1).sum(dim=(0, 1)).cpu() for m in range(layers)]
    )
    rows = part.positions.numel()
    query_sq = part.query_sq.double().cpu() * rows
    return torch.cat([head_sq.flatten(), query_sq.flatten(), torch.tensor([float(rows)], dtype=torch.float64)])


@torch.no_grad()
def calibrate_from_features(model, parts: list[Features], accelerator) -> None:
    """Scale every head so its mean squared output norm equals the real queries' it imitates,
    measured on the cached rows of all processes (`forecast_init.calibrate_forecast_scale`).

    parts: this process's micro-batches (`build_round`).  Each micro-batch's sums are gathered
    from every process and added in global micro-batch order, so the factors are bitwise the same
    however the batch is split over processes (a sum over processes would round differently).
    """
    sums = torch.stack([_calibration_sums(model, part) for part in parts])  # [micro-batches, S]
    if accelerator.num_processes > 1:
        sums = accelerator.gather(sums.to(accelerator.device)).cpu()  # rank order = global order
    total = sums.sum(dim=0)
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    head_sq, query_sq = total[:-1].split([total.numel() - 1 - layers * heads, layers * heads])
    count = total[-1]
    calibrate_forecast_scale(
        model, (head_sq / count).view(layers, -1).float(), (query_sq / count).view(layers, heads).float()
    )


def evaluate(
    model,
    sequences: torch.Tensor,
    start: int,
    backbone: str,
    accelerator,
    progress: str | None = None,
    check=None,
    reference: str = "query",
) -> dict:
    """Held-out forecast recall (`recall.measure_recall_counts`) of `reference`'s blocks (the
    selection the heads' teacher stands for), sequences split over processes, counts summed;
    returns `RecallReport.to_dict()`.  progress: a bar with this label (this process's sequences);
    check: called before each sequence (it may raise to stop)."""
    rank, world = accelerator.process_index, accelerator.num_processes
    counts = torch.zeros(model.config.num_hidden_layers, 3, dtype=torch.float64)
    mine = range(rank, sequences.shape[0], world)
    bar = progress_bar(progress, len(mine))
    with accelerator.autocast():
        for row in mine:
            if check is not None:
                check()
            ids = sequences[row : row + 1].to(accelerator.device)
            counts += measure_recall_counts(model, ids, start, backbone, reference=reference)
            bar.update(1)
    bar.close()
    if world > 1:
        counts = accelerator.reduce(counts.to(accelerator.device), reduction="sum").cpu()
    length = sequences.shape[1]
    return sel.summarise_recall(counts, start, length, sequences.shape[0] * (length - start), backbone).to_dict()


@torch.no_grad()
def guard_layers(
    model,
    start_heads: dict,
    sequences: torch.Tensor,
    start: int,
    backbone: str,
    accelerator,
    progress: bool = False,
    check=None,
    reference: str = "query",
) -> dict:
    """Give each layer whose validation recall (of `reference`'s blocks) fell below its starting
    head's the starting head back.

    start_heads: {name: tensor} as `forecast_heads` before training; sequences [N, T] validation
    windows; progress: bars; check: see `evaluate` (the trained heads are back in place if it
    raises).  Returns {"start": recall per layer, "trained": recall per layer, "restored": [layers]}.
    """
    heads = dict(forecast_heads(model))
    trained = {name: p.detach().clone() for name, p in heads.items()}
    label = f"guard ({sequences.shape[0]} unseen windows), %s heads"
    try:
        for name, p in heads.items():
            p.copy_(start_heads[name].to(p.device))
        before = evaluate(
            model, sequences, start, backbone, accelerator, label % "starting" if progress else None, check, reference
        )
    finally:
        for name, p in heads.items():
            p.copy_(trained[name])
    after = evaluate(
        model, sequences, start, backbone, accelerator, label % "trained" if progress else None, check, reference
    )
    restored = []
    for layer, (old, new) in enumerate(zip(before["recall"], after["recall"])):
        name = scoring_head_name(layer)
        if new < old and name in heads:
            heads[name].copy_(start_heads[name].to(heads[name].device))
            restored.append(layer)
    return {
        "start": before["recall"],
        "trained": after["recall"],
        "restored": restored,
        "length": sequences.shape[1],
        "rows_from": start,
        "sequences": sequences.shape[0],
    }
