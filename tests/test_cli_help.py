"""Every command's `--help` answers, describes every argument, and builds without torch (so it
answers at once: `benchmarks/cli_startup.py` times it)."""

import argparse
import json
import subprocess
import sys

import pytest

from forecastkv.cli import PASSTHROUGH, SUBCOMMANDS, build_parser, main


def passthrough_parser(name: str) -> argparse.ArgumentParser | None:
    """The parser a pass-through command hands its arguments to (None: another program's, lm_eval's)."""
    if name == "train-forecast":
        from forecastkv.training.cli import build_parser as train_parser

        return train_parser()
    if name == "forecast-recall":
        from forecastkv.training.recall_cli import build_parser as recall_parser

        return recall_parser()
    return None


def command_parser(name: str) -> argparse.ArgumentParser:
    if name in PASSTHROUGH:
        return passthrough_parser(name)
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


OWN_PARSERS = [*SUBCOMMANDS, *(name for name in PASSTHROUGH if passthrough_parser(name) is not None)]


def undescribed(parser: argparse.ArgumentParser, prog: str) -> list[str]:
    """The arguments of `parser` and of its nested sub-commands that have no help text, and the
    parsers with no description."""
    missing = [] if parser.description else [f"{prog} (no description)"]
    for action in parser._actions:
        if not (action.help and action.help.strip()) or action.help == argparse.SUPPRESS:
            missing.append(f"{prog} {action.option_strings[0] if action.option_strings else action.dest}")
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += undescribed(sub, f"{prog} {name}")
    return missing


@pytest.mark.parametrize("command", OWN_PARSERS)
def test_every_argument_is_described(command):
    assert undescribed(command_parser(command), command) == []


@pytest.mark.parametrize("command", OWN_PARSERS)
def test_help_exits_zero_and_names_the_command(command, capsys):
    with pytest.raises(SystemExit) as stop:
        main([command, "--help"])
    assert stop.value.code == 0
    assert f"forecastkv {command}" in capsys.readouterr().out


def test_top_level_help_lists_commands_only(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for command in [*SUBCOMMANDS, *PASSTHROUGH]:
        assert f"\n    {command}" in out
    for internal in ("SUBCOMMANDS", "PASSTHROUGH", "is_user_error", "BUG_HINT", "_<name>"):
        assert internal not in out  # developer notes stay in the module's docstring


def test_version(capsys):
    import forecastkv

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"forecastkv {forecastkv.__version__}"


def test_version_matches_the_distribution():
    from importlib.metadata import version

    import forecastkv

    assert version("forecastkv") == forecastkv.__version__


PARSERS_WITHOUT_TORCH = """
import json, sys
import forecastkv.cli
forecastkv.cli.build_parser()
from forecastkv.training.cli import build_parser as train; train()
from forecastkv.training.recall_cli import build_parser as recall; recall()
print(json.dumps(sorted(m for m in ("torch", "transformers", "numpy", "triton") if m in sys.modules)))
"""


def test_the_parsers_import_no_torch():
    """What makes `--help` fast: building every parser imports neither torch nor transformers."""
    done = subprocess.run([sys.executable, "-c", PARSERS_WITHOUT_TORCH], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_public_names_still_import_and_register():
    """The lazy package: a public name is the model class, and its import registered the Auto classes."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import forecastkv; from transformers import AutoConfig; cls = forecastkv.ForecastKVForCausalLM; "
            "print(type(AutoConfig.for_model('forecastkv')).__name__, cls.__name__, "
            "'forecastkv.inference' in __import__('sys').modules)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ForecastKVConfig", "ForecastKVForCausalLM", "True"]
