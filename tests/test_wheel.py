"""The presets ship inside the wheel: build it, install it into another directory, load every preset.

The source tree is copied first, so the build leaves no `build/` or `*.egg-info` in the checkout,
and the installed copy is imported from a directory outside the repository, so the repository's
own `forecastkv/` cannot be picked up by accident.
"""

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from forecastkv.modeling.configuration import SparseConfig

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # pip builds and installs the wheel, and a fresh Python imports it

CHECK = """
import json, sys
import forecastkv
from forecastkv import ForecastKVConfig
from forecastkv.modeling.configuration import list_presets, load_preset

report = {"file": forecastkv.__file__, "presets": {}}
for name in list_presets():
    preset = load_preset(name)
    config = ForecastKVConfig(sparse_config=name, forecast=preset.get("forecast"))
    report["presets"][name] = {"budget": config.sparse.budget_blocks, "sparse_config": config.sparse_config}
from forecastkv.bundled import resolve_heads_path
from forecastkv.modeling.head_files import read_forecast_side
heads, side = read_forecast_side(resolve_heads_path("bundled:smollm2-135m"))
report["heads"] = {"dir": resolve_heads_path("bundled:smollm2-135m"), "tensors": len(heads), "side": side}
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site directory holding the installed wheel, the wheel file)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "forecastkv", source / "forecastkv", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = work / "dist"
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-q",
        "-w",
        str(dist),
        str(source),
    ]
    subprocess.run(build, check=True, cwd=work, timeout=300)
    (wheel,) = dist.glob("forecastkv-*.whl")
    site = work / "site"
    install = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "-q",
        "--target",
        str(site),
        str(wheel),
    ]
    subprocess.run(install, check=True, cwd=work, timeout=300)
    return site, wheel


def test_wheel_contains_every_preset(installed):
    """Every file under forecastkv/presets (model presets, the demo's recipe and suites) ships."""
    _, wheel = installed
    presets = ROOT / "forecastkv" / "presets"
    shipped = sorted(
        str(p.relative_to(ROOT)) for p in presets.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )
    assert any(name.endswith(".json") for name in shipped), "no presets in forecastkv/presets"
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = sorted(n for n in archive.namelist() if n.startswith("forecastkv/presets/"))
    assert in_wheel == shipped


def test_installed_wheel_loads_every_preset(installed):
    site, _ = installed
    run = subprocess.run(
        [sys.executable, "-c", CHECK],
        cwd=site.parent,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(report["file"]).resolve().is_relative_to(site.resolve())  # the installed copy, not the checkout
    expected = sorted(p.stem for p in (ROOT / "forecastkv" / "presets").glob("*.json"))
    assert sorted(report["presets"]) == expected
    defaults = SparseConfig().to_dict()  # the defaults as a config.json holds them (lists, not tuples)
    for name, got in report["presets"].items():
        preset = json.loads((ROOT / "forecastkv" / "presets" / f"{name}.json").read_text())["sparse_config"]
        loaded = got["sparse_config"]
        assert {key: loaded[key] for key in preset} == preset, name  # every key the file sets
        assert {key: loaded[key] for key in loaded.keys() - preset.keys()} == {
            key: defaults[key] for key in loaded.keys() - preset.keys()
        }, name  # the rest: defaults
    # the shipped Forecast heads load from the installed copy by their bundled name
    heads = report["heads"]
    assert Path(heads["dir"]).resolve().is_relative_to(site.resolve()) and heads["tensors"] == 31, heads
    assert heads["side"]["base_model"] == "bundled:smollm2-135m"
    # MiniCPM4.1-8B: 64 top-k + 2048 / 64 local = 96 blocks; NOSA-8B: 48 + 16 = 64
    assert report["presets"]["minicpm4.1-8b"]["budget"] == 96
    assert report["presets"]["nosa-8b"]["budget"] == 64
