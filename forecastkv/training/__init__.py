"""Fine-tuning of the Forecast heads: the objective, the trainer, data packing.

    from forecastkv.training import train_forecast
    result = train_forecast("configs/train/smollm2-135m.yaml", max_steps=10)

`main(argv)` is the `forecastkv train-forecast` command (see `cli.py`).
"""

from .data import PackedSequences, build_sequences, load_documents
from .objective import ObjectiveConfig, layer_loss
from .recipe import load_recipe
from .trainer import TrainResult, evaluate, train_forecast


def main(argv: list[str] | None = None) -> int:
    """`forecastkv train-forecast [--config X] [--resume DIR] [--output DIR] [--max-steps N]`."""
    from .cli import main as cli_main

    return cli_main(argv)


__all__ = [
    "ObjectiveConfig",
    "PackedSequences",
    "TrainResult",
    "build_sequences",
    "evaluate",
    "layer_loss",
    "load_documents",
    "load_recipe",
    "main",
    "train_forecast",
]
