"""Session fixtures of the training tests: what many of them build once."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from .common import tiny_recipe


@dataclasses.dataclass(frozen=True)
class Uninterrupted:
    """An uninterrupted tiny run: its Forecast heads ({name: tensor}) and losses [(step, loss)]."""

    heads: dict[str, torch.Tensor]
    losses: list[tuple[int, float]]


def head_tensors(model) -> dict[str, torch.Tensor]:
    """The trained tensors of `model`: every Forecast head (forecast_proj / current_proj)."""
    return {
        name: tensor.detach().clone()
        for name, tensor in model.state_dict().items()
        if "forecast_proj" in name or "current_proj" in name
    }


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """`uninterrupted(steps, save_every)`: the tiny recipe's run trained through without a stop,
    built on first use and shared by every resume test that must end bit-identical to it."""
    from forecastkv.training import train_forecast

    runs: dict[tuple[int, int], Uninterrupted] = {}

    def run(steps: int, save_every: int) -> Uninterrupted:
        if (steps, save_every) not in runs:
            root = tmp_path_factory.mktemp(f"uninterrupted-{steps}-{save_every}")
            result = train_forecast(tiny_recipe(root / "data", root / "run", steps=steps, save_every=save_every))
            runs[steps, save_every] = Uninterrupted(head_tensors(result.model), list(result.losses))
        return runs[steps, save_every]

    return run
