"""Copy a train-forecast output into the package as the shipped heads of a bundled model
(`forecastkv/presets/heads/NAME/`, loaded as `forecast_weights="bundled:NAME"`).

    python benchmarks/ship_heads.py runs/smollm2-135m-forecast --name smollm2-135m

The heads are stored in float16 (half the bytes; the loader casts them to the model's dtype), beside
their forecast_config.json (base_model set to `bundled:NAME`, not this machine's cache path) and the
recipe.json that trained them (`forecastkv quality` reads the teacher from it).  The directory's
README.md, which says how they were trained and what they measured, is written by hand.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from forecastkv.atomic import write_atomic, write_text_atomic
from forecastkv.bundled import HEADS_DIR


def ship(source: Path, name: str, dtype: torch.dtype = torch.float16) -> Path:
    target = HEADS_DIR / name
    target.mkdir(parents=True, exist_ok=True)
    stored = load_file(str(source / "forecast.safetensors"))
    tensors = {key: value.to(dtype).contiguous() for key, value in stored.items()}
    write_atomic(target / "forecast.safetensors", lambda tmp: save_file(tensors, str(tmp)))
    side = json.loads((source / "forecast_config.json").read_text())
    side["base_model"] = f"bundled:{name}"
    write_text_atomic(target / "forecast_config.json", json.dumps(side, indent=2) + "\n")
    write_text_atomic(target / "recipe.json", (source / "recipe.json").read_text())
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a train-forecast output directory")
    parser.add_argument("--name", default="smollm2-135m", help="the bundled model the heads are for")
    args = parser.parse_args()
    target = ship(args.source, args.name)
    size = (target / "forecast.safetensors").stat().st_size
    print(f"shipped {args.source} as {target} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
