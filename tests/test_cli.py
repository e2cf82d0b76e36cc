"""The console script: sub-commands parse, convert writes our format (weights, tokenizer, auto_map),
train-forecast owns --help, and user errors print one line and exit with status 2."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from forecastkv import ForecastKVForCausalLM
from forecastkv.cli import BUG_HINT, PASSTHROUGH, build_parser, main


def test_parser_knows_every_command():
    parser = build_parser()
    for argv in (["demo"], ["generate", "--prompt", "x"], ["convert", "a", "b"]):
        assert callable(parser.parse_args(argv).run)
    assert set(PASSTHROUGH) == {"train-forecast", "forecast-recall", "lm-eval"}


def test_mode_names_import_nothing():
    """forecastkv/modes.py, which the console script reads for --offload, imports nothing but the selector
    registry's names, and the registry nothing at module level (so no torch)."""
    import ast

    import forecastkv.modes
    import forecastkv.selectors

    def module_imports(module):
        tree = ast.parse(open(module.__file__, encoding="utf-8").read())
        return [getattr(node, "module", None) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]

    assert module_imports(forecastkv.modes) == ["__future__", "selectors"]
    assert module_imports(forecastkv.selectors) == ["__future__"]


def test_train_forecast_help_reaches_the_trainer(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train-forecast", "--help"])
    assert exit_info.value.code == 0
    assert "--resume" in capsys.readouterr().out


def tiny_llama_dir(path):
    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )
    llama.save_pretrained(path)
    return llama


def test_convert_writes_our_format(tmp_path):
    llama = tiny_llama_dir(tmp_path / "llama")
    tokenizer_files = {"tokenizer_config.json": '{"tokenizer_class": "X"}\n', "merges.txt": "#version: 0.2\n"}
    for name, text in tokenizer_files.items():
        (tmp_path / "llama" / name).write_text(text)
    assert main(["convert", str(tmp_path / "llama"), str(tmp_path / "ours"), "--sparse-config", "smollm2-135m"]) == 0
    model = ForecastKVForCausalLM.from_pretrained(tmp_path / "ours")
    assert model.config.model_type == "forecastkv" and model.config.sparse.window_size == 256
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, llama.model.layers[1].mlp.up_proj.weight)
    for name, text in tokenizer_files.items():  # copied byte for byte
        assert (tmp_path / "ours" / name).read_text() == text
    assert (
        json.loads((tmp_path / "ours" / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
        == "modeling_forecastkv.ForecastKVForCausalLM"
    )
    for module in ("modeling_forecastkv.py", "configuration_forecastkv.py"):
        assert (tmp_path / "ours" / module).is_file()


# -- user errors: one line on stderr, status 2, no traceback ---------------------------------------


def _user_error(argv, capsys) -> str:
    """Run main(argv); assert it ends as a user error; return its one stderr line."""
    try:
        status = main(argv)
    except SystemExit as stop:  # argparse's own errors
        status = stop.code
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("forecastkv: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_each_user_error_is_one_line_and_status_2(tmp_path, capsys):
    tiny_llama_dir(tmp_path / "llama")
    capsys.readouterr()  # the save's progress bar
    llama = str(tmp_path / "llama")
    line = _user_error(["generate", "--model", llama, "--sparse-config", "nope", "--prompt", "x"], capsys)
    assert "--sparse-config 'nope' is not a preset; known presets: " in line and "smollm2-135m" in line
    line = _user_error(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"], capsys)
    assert line == f"forecastkv: error: --model {tmp_path / 'missing'}: no such checkpoint directory"
    line = _user_error(
        [
            "generate",
            "--model",
            llama,
            "--sparse-config",
            "smollm2-135m",
            "--offload",
            "forecast-offload",
            "--prompt",
            "x",
        ],
        capsys,
    )
    assert "--offload forecast-offload selects blocks with Forecast heads" in line
    assert "--forecast-init next_query" in line and "--forecast-weights DIR" in line and "forecast={" not in line
    line = _user_error(
        ["generate", "--model", llama, "--sparse-config", "smollm2-135m", "--selector", "forecast-carry-pin"]
        + ["--prompt", "x"],
        capsys,
    )
    assert f"--selector forecast-carry-pin selects blocks with Forecast heads, and --model {llama} has none" in line
    line = _user_error(["generate", "--max-new-tokens", "-3", "--prompt", "x"], capsys)
    assert line == "forecastkv: error: generate: argument --max-new-tokens: must be at least 1, got -3"
    line = _user_error(["convert", str(tmp_path / "missing"), str(tmp_path / "out")], capsys)
    assert line == f"forecastkv: error: source {tmp_path / 'missing'}: no such checkpoint directory"


def test_a_bug_keeps_its_traceback_and_a_hint_to_file_it(monkeypatch, capsys):
    """An exception that is no user error (here a plain ValueError) is not turned into a one-line
    usage error: it goes on, and its traceback ends with BUG_HINT."""
    import traceback

    import forecastkv.cli as cli

    def broken(args):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(cli, "_convert", broken)
    with pytest.raises(ValueError, match="an internal invariant broke") as raised:
        main(["convert", "a", "b"])
    printed = "".join(traceback.format_exception(raised.value)).rstrip().splitlines()
    if hasattr(raised.value, "add_note"):  # Python 3.11+: the hint is a note, printed below the traceback
        assert capsys.readouterr().err == ""  # no `forecastkv: error:` line
        assert printed[-2:] == ["ValueError: an internal invariant broke", BUG_HINT]
    else:  # 3.10: the hint goes to stderr before the traceback
        assert capsys.readouterr().err == BUG_HINT + "\n"
        assert printed[-1] == "ValueError: an internal invariant broke"


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(ValueError, match="no such checkpoint directory"):
        main(["--debug", "generate", "--model", str(tmp_path / "missing"), "--prompt", "x"])
    with pytest.raises(ValueError, match="no such checkpoint directory"):  # after the command, too
        main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x", "--debug"])


@pytest.mark.slow  # a fresh interpreter importing torch and transformers
def test_console_script_prints_no_traceback(tmp_path):
    """The installed entry point, in its own process: one line, status 2."""
    done = subprocess.run(
        [sys.executable, "-m", "forecastkv.cli", "generate", "--model", str(tmp_path / "missing"), "--prompt", "x"],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"forecastkv: error: --model {tmp_path / 'missing'}: no such checkpoint directory"
    ]


FRESH_LOAD = """
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
path, prompt, out = sys.argv[1:]
# stdin is closed: transformers' "run the custom code?" question goes unanswered, and the tokenizer loads without it
plain = AutoTokenizer.from_pretrained(path)
declined = AutoTokenizer.from_pretrained(path, trust_remote_code=False)  # what lm-eval's HFLM passes by default
assert "forecastkv" not in sys.modules
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
trusted = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
ids = plain(prompt, return_tensors="pt").input_ids
assert declined(prompt).input_ids == trusted(prompt).input_ids == ids[0].tolist()
tokens = model.generate(ids, max_new_tokens=8, do_sample=False)[0].tolist()
with open(out, "w") as f:
    model_class = type(model).__module__ + "." + type(model).__name__
    json.dump({"class": model_class, "prompt": ids[0].tolist(), "tokens": tokens}, f)
"""


@pytest.mark.slow
@pytest.mark.bundled
def test_converted_bundled_model_loads_with_plain_transformers(bundled_path, tmp_path):
    """`forecastkv convert` output: AutoTokenizer and AutoModelForCausalLM(trust_remote_code=True)
    load it in a process that never imported forecastkv, and it generates ForecastKVForCausalLM's tokens."""
    from transformers import AutoTokenizer

    out = tmp_path / "converted"
    assert main(["convert", bundled_path, str(out), "--sparse-config", "smollm2-135m"]) == 0
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    done = subprocess.run(
        [sys.executable, "-c", FRESH_LOAD, str(out), prompt, str(tmp_path / "fresh.json")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    fresh = json.loads((tmp_path / "fresh.json").read_text())
    assert fresh["class"] == "forecastkv.modeling.modeling.ForecastKVForCausalLM"
    assert fresh["prompt"] == AutoTokenizer.from_pretrained(bundled_path)(prompt).input_ids
    model = ForecastKVForCausalLM.from_pretrained(out)
    assert model.config.sparse.block_size == 64
    with torch.no_grad():
        expected = model.generate(torch.tensor([fresh["prompt"]]), max_new_tokens=8, do_sample=False)[0].tolist()
    assert fresh["tokens"] == expected


def test_convert_writes_heads_dtype_and_modes_a_server_needs(tmp_path):
    """One `convert` line makes a checkpoint every mode serves: Forecast heads (--forecast-init),
    the asked dtype, the tokenizer, and the weights under the same file mode as the other files."""
    from forecastkv.modeling.head_files import has_forecast_heads

    tiny_llama_dir(tmp_path / "llama")
    (tmp_path / "llama" / "tokenizer_config.json").write_text('{"tokenizer_class": "X"}\n')
    out = tmp_path / "ours"
    argv = ["convert", str(tmp_path / "llama"), str(out), "--sparse-config", "smollm2-135m"]
    assert main([*argv, "--forecast-init", "next_query", "--dtype", "bfloat16"]) == 0
    assert has_forecast_heads(out)
    model = ForecastKVForCausalLM.from_pretrained(out, dtype="auto")
    assert model.dtype == torch.bfloat16
    direct = ForecastKVForCausalLM.from_pretrained(
        tmp_path / "llama", sparse_config="smollm2-135m", forecast={"init": "next_query"}, dtype=torch.bfloat16
    )
    for ours, made in zip(model.model.layers, direct.model.layers):  # the heads written are the init's
        assert torch.equal(ours.self_attn.forecast_proj.weight, made.self_attn.forecast_proj.weight)
    modes = {path.name: path.stat().st_mode & 0o777 for path in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == modes["tokenizer_config.json"], modes


def test_convert_refuses_two_sources_of_heads(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["convert", "a", "b", "--forecast-init", "next_query", "--forecast-weights", "w"])
    assert stop.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
