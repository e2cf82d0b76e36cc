"""Fine-tuning of the Forecast heads: the objective, the trainer, data packing.

    from forecastkv.training import train_forecast
    result = train_forecast("configs/train/smollm2-135m.yaml", max_steps=10)

`main(argv)` is the `forecastkv train-forecast` command (see `cli.py`).  The names below import
on first use, so the command's parser imports no torch.
"""

from ..lazy import lazy_attributes


def main(argv: list[str] | None = None) -> int:
    """`forecastkv train-forecast [--config X] [--resume DIR] [--output DIR] [--max-steps N]`."""
    from .cli import main as cli_main

    return cli_main(argv)


_PUBLIC = {
    "ObjectiveConfig": ".objective",
    "PackedSequences": ".data",
    "TrainResult": ".trainer",
    "build_sequences": ".data",
    "evaluate": ".trainer",
    "layer_loss": ".objective",
    "load_documents": ".data",
    "load_recipe": ".recipe",
    "train_forecast": ".trainer",
}
__all__ = sorted([*_PUBLIC, "main"])
__getattr__, __dir__ = lazy_attributes(__name__, _PUBLIC)
