"""The shipped recipes parse against the presets; the CLI entry runs, stops and resumes."""

import json
from pathlib import Path

import pytest
import yaml

from forecastkv.modeling.configuration import SparseConfig, list_presets, load_preset
from forecastkv.training import main
from forecastkv.training.checkpointing import list_checkpoints
from forecastkv.training.objective import ObjectiveConfig
from forecastkv.training.trainer import load_recipe

from .common import tiny_recipe

RECIPES = sorted((Path(__file__).resolve().parents[2] / "configs" / "train").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipes_are_valid(path):
    recipe = load_recipe(path)
    sparse = recipe["model"]["sparse_config"]
    if isinstance(sparse, str):
        assert sparse in list_presets(), sparse
        sparse = load_preset(sparse)["sparse_config"]
    ObjectiveConfig.from_dict(recipe["objective"]).check_against(SparseConfig.from_dict(sparse))
    assert recipe["train"]["global_batch"] % recipe["train"]["micro_batch"] == 0


def test_sparda_recipes_match_the_release():
    for name, length in (("sparda-minicpm4.1-8b", 65536), ("sparda-nosa-8b", 32768)):
        recipe = load_recipe(Path(RECIPES[0]).parent / f"{name}.yaml")
        train = recipe["train"]
        assert (train["steps"], train["global_batch"], recipe["data"]["seq_len"]) == (2000, 32, length)
        assert (train["lr"], train["betas"], train["eps"], train["weight_decay"], train["grad_clip"]) == (
            5e-4,
            [0.9, 0.95],
            1e-6,
            0.01,
            0.5,
        )
        assert recipe["model"]["sparse_config"] == name


def test_recipe_merging_defaults_and_checks(tmp_path):
    from forecastkv.training import recipe as rc

    assert load_recipe is rc.load_recipe  # trainer re-exports it
    recipe = rc.load_recipe({"model": {"config": {"a": 1, "b": 2}}}, model={"config": {"a": 3}}, max_steps=7)
    assert recipe["model"]["config"] == {"a": 3}  # a model config is one value, replaced whole
    assert recipe["train"]["max_steps"] == 7 and recipe["train"]["steps"] == rc.DEFAULTS["train"]["steps"]
    assert rc.last_step(recipe["train"]) == 7
    with pytest.raises(ValueError, match=r"unknown recipe key 'data.seq_lenn'; allowed: \["):
        rc.load_recipe({"data": {"seq_lenn": 3}})
    data = rc.load_recipe({"data": {"seq_len": 100, "eval_seq_len": 300}})["data"]
    assert rc.eval_window(data) == (300, 150) and rc.val_window(data) == (100, 50)
    with pytest.raises(ValueError, match=r"train.log_every must be a positive integer, got 0"):
        rc.check_recipe(rc.load_recipe({"train": {"log_every": 0}}), world=1)
    with pytest.raises(ValueError, match=r"train.eval_every must be an integer >= -1, got -2"):
        rc.check_recipe(rc.load_recipe({"train": {"eval_every": -2}}), world=1)
    with pytest.raises(
        ValueError, match=r"train.global_batch=32 must be a multiple of processes x micro_batch = 3 x 1"
    ):
        rc.check_recipe(rc.load_recipe({}), world=3)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match=r"list.yaml' must be a YAML mapping, got a list"):
        rc.load_recipe(listing)


def test_cli_stop_and_resume(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_recipe(tmp_path / "data", tmp_path / "unused", steps=3)))
    out = tmp_path / "run"
    assert main(["--config", str(config), "--output", str(out), "--max-steps", "1", "--no-progress"]) == 0
    assert [p.name for p in list_checkpoints(out)] == ["step-000001.safetensors"]
    assert main(["--resume", str(out), "--no-progress"]) == 0  # the recipe comes from the checkpoint
    assert [p.name for p in list_checkpoints(out)][-1] == "step-000003.safetensors"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert (out / "forecast.safetensors").is_file() and (out / "forecast_config.json").is_file()
    with pytest.raises(SystemExit):
        main([])


def test_recall_protocol_and_geometry(tmp_path):
    from forecastkv.training.recall import RecallProtocol, resolve_geometry
    from forecastkv.training.recall_cli import build_parser

    assert resolve_geometry(None, None, 12)["topk"] == 12  # smollm2-135m preset, topk overridden
    side = tmp_path / "heads"
    side.mkdir()
    (side / "forecast_config.json").write_text(
        json.dumps(
            {"forecast": {}, "sparse_config": {"kernel_size": 32, "kernel_stride": 16, "block_size": 64, "topk": 5}}
        )
    )
    assert resolve_geometry(None, side)["topk"] == 5  # the heads' own geometry
    assert resolve_geometry('{"kernel_size": 4, "kernel_stride": 2, "block_size": 8}')["block_size"] == 8
    with pytest.raises(ValueError, match=r"recall start=2048 must lie in \[0, length=2048\)"):
        RecallProtocol(length=2048, start=2048)
    with pytest.raises(ValueError, match=r"backbone 'sparse' is not one of"):
        RecallProtocol(backbone="sparse")
    with pytest.raises(ValueError, match=r"recall reference 'quest' is not one of \('query', 'oracle'\)"):
        RecallProtocol(reference="quest")
    args = build_parser().parse_args(["--forecast-weights", "x", "--length", "4096", "--start", "1024", "--topk", "12"])
    assert (args.length, args.start, args.topk, args.backbone, args.reference) == (4096, 1024, 12, "dense", "query")
    assert build_parser().parse_args(["--reference", "oracle"]).reference == "oracle"
