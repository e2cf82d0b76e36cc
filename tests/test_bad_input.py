"""Bad input gets one line, `forecastkv: error: ...` naming the value and the limit, and exit status
2: no traceback, and nothing lost (issue 25, items 5-10 and 14).

Every bad input runs through `forecastkv.cli.main` in this process (the console script's own
function: same parsing, same error handling); the inputs that only a real process can give
(argv bytes that are not UTF-8, stdin) and one of each other kind run through the installed
`forecastkv` script as well.  The models are tiny random checkpoints with a 97-character
tokenizer, written into tmp_path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forecastkv.cli import main
from tests.helpers import TINY_SPARSE, tiny_model

SCRIPT = Path(sys.executable).with_name("forecastkv")
MAX_POSITIONS = 64
VOCAB = 97  # the tokenizer's: <unk>, <eos> and the 95 printable ASCII characters
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def save_char_tokenizer(path: Path, chat: bool = True) -> None:
    """A tokenizer of the 95 printable ASCII characters (ids 2-96; 0 unknown, 1 EOS)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{chr(c): c - 30 for c in range(32, 127)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", eos_token="<eos>")
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)


def save_tiny(path: Path, sparse: dict | None = TINY_SPARSE, chat: bool = True, **overrides) -> Path:
    model = tiny_model(
        mode=None if sparse is None else sparse, max_position_embeddings=MAX_POSITIONS, vocab_size=VOCAB, **overrides
    )
    model.save_pretrained(path)
    save_char_tokenizer(path, chat)
    return path


def save_heads(path: Path, **overrides) -> Path:
    mode = overrides.pop("mode", {})
    tiny_model(mode=mode, **overrides).save_forecast_weights(path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Every file the bad inputs name, written once."""
    root = tmp_path_factory.mktemp("bad_input")
    paths = {"model": save_tiny(root / "model"), "dense": save_tiny(root / "dense", sparse=None, chat=False)}
    heads = paths["heads"] = save_heads(root / "heads")
    for name, cut in (
        ("truncated", lambda data: data[: len(data) // 2]),
        ("garbage", lambda data: b"\x0b" + bytes(7) + b"{not json!}"),
    ):
        shutil.copytree(heads, root / name)
        target = root / name / "forecast.safetensors"
        target.write_bytes(cut(target.read_bytes()))
        paths[name] = root / name
    paths["other_heads"] = save_heads(root / "other_heads", num_hidden_layers=2)  # another model's heads
    paths["block16_heads"] = save_heads(root / "block16_heads", mode={"block_size": 16, "window_size": 16})
    paths["topk5_heads"] = save_heads(root / "topk5_heads", mode={"topk": 5})
    pickled = root / "pickled"
    shutil.copytree(paths["dense"], pickled)
    (pickled / "model.safetensors").unlink()
    torch.save(
        {"model.embed_tokens.weight": torch.zeros(2), "args": __import__("argparse").Namespace(lr=1)},
        pickled / "pytorch_model.bin",
    )
    paths["pickled"] = pickled
    (root / "rows.jsonl").write_text('{"text": "a"}\n\n{"text": "b", oops}\n')
    (root / "latin.txt").write_bytes("one\ncafé".encode("latin-1"))
    (root / "empty").mkdir()
    paths.update(jsonl=root / "rows.jsonl", latin=root / "latin.txt", empty=root / "empty")
    for name, text in (("long_prompt", "x" * MAX_POSITIONS),):
        (root / f"{name}.txt").write_text(text)
        paths[name] = root / f"{name}.txt"
    for name, change in {
        "suite_tokens": {"max_new_tokens": -8},
        "suite_examples": {"examples": -3},
        "suite_zero": {"examples": 0},
        "suite_corrupt": {},
    }.items():
        model = {"path": str(paths["model"])}
        if name == "suite_corrupt":
            model["forecast_weights"] = str(paths["truncated"])
        suite = {
            "model": model,
            "tokenizer": "bytes",
            "modes": ["dense"],
            "tasks": [{"name": "passkey", "lengths": [48], **change}],
            "output_dir": str(root / "eval" / name),
        }
        (root / f"{name}.yaml").write_text(json.dumps(suite))  # JSON is YAML
        paths[name] = root / f"{name}.yaml"
    for name, data in {
        "recipe_corrupt": {"model": {"forecast_weights": str(paths["truncated"])}},
        "recipe_latin": {"data": {"source": str(paths["latin"])}},
        "recipe_jsonl": {"data": {"source": str(paths["jsonl"])}},
        "recipe_empty": {"data": {"source": str(paths["empty"])}},
    }.items():
        recipe = {
            "model": {"path": str(paths["model"]), "sparse_config": dict(TINY_SPARSE), **data.get("model", {})},
            "data": {"tokenizer": "bytes", "seq_len": 32, "eval_seq_len": 32, **data.get("data", {})},
            "train": {"steps": 1, "global_batch": 1, "progress": False},
            "output_dir": str(root / "runs" / name),
        }
        (root / f"{name}.yaml").write_text(json.dumps(recipe))
        paths[name] = root / f"{name}.yaml"
    return {name: str(path) for name, path in paths.items()}


# name -> (argv with {file} placeholders, what the one error line must contain)
BAD_INPUTS = {
    # 5. corrupt or truncated forecast.safetensors, in every command that loads heads
    "generate-truncated-heads": (
        "generate --model {model} --prompt ab --forecast-weights {truncated}",
        "corrupt checkpoint file {truncated}/forecast.safetensors: tensor ",
    ),
    "generate-garbage-heads": (
        "generate --model {model} --prompt ab --forecast-weights {garbage}",
        "corrupt checkpoint file {garbage}/forecast.safetensors: unreadable header",
    ),
    "convert-truncated-heads": (
        "convert {model} {model}-out --forecast-weights {truncated}",
        "corrupt checkpoint file {truncated}/forecast.safetensors",
    ),
    "forecast-recall-truncated-heads": (
        "forecast-recall --model {model} --forecast-weights {truncated} --source {jsonl}",
        "corrupt checkpoint file {truncated}/forecast.safetensors",
    ),
    "train-forecast-truncated-heads": (
        "train-forecast --config {recipe_corrupt}",
        "corrupt checkpoint file {truncated}/forecast.safetensors",
    ),
    "eval-truncated-heads": (
        "eval --config {suite_corrupt} --no-progress",
        "corrupt checkpoint file {truncated}/forecast.safetensors",
    ),
    # 6. generate's prompt and length
    "empty-prompt": ("generate --model {model} --prompt=", "--prompt '' is empty: give a prompt of at least one token"),
    "prompt-not-utf8": (
        ["generate", "--model", "{model}", "--prompt", "ab\udcffc"],
        "--prompt is not valid UTF-8: byte 0xff at offset 2",
    ),
    "prompt-file-not-utf8": (
        "generate --model {model} --prompt-file {latin}",
        "--prompt-file {latin} is not valid UTF-8: byte 0xe9 at offset 7",
    ),
    "prompt-file-missing": (
        "generate --model {model} --prompt-file {model}/nope.txt",
        "--prompt-file {model}/nope.txt: no such file",
    ),
    "prompt-fills-context": (
        "generate --model {model} --prompt-file {long_prompt}",
        f"the prompt has {MAX_POSITIONS} tokens and the model's max_position_embeddings is {MAX_POSITIONS}: "
        "no position is left",
    ),
    # 14. generate's sampling options
    "temperature-zero": (
        "generate --model {model} --prompt ab --temperature 0",
        "argument --temperature: must be a finite number > 0, got 0",
    ),
    "temperature-nan": (
        "generate --model {model} --prompt ab --temperature nan",
        "argument --temperature: must be a finite number > 0, got nan",
    ),
    "top-p-zero": ("generate --model {model} --prompt ab --top-p 0", "argument --top-p: must lie in (0, 1], got 0"),
    "top-p-above-one": (
        "generate --model {model} --prompt ab --top-p 1.5",
        "argument --top-p: must lie in (0, 1], got 1.5",
    ),
    "seed-negative": (
        "generate --model {model} --prompt ab --seed -1",
        "argument --seed: must lie in [0, 2**63), got -1",
    ),
    "prompt-and-file": (
        "generate --model {model} --prompt ab --prompt-file {latin}",
        "argument --prompt-file: not allowed with argument --prompt",
    ),
    "chat-without-template": (
        "generate --model {dense} --prompt ab --chat",
        "--chat: the tokenizer of {dense} has no chat template",
    ),
    # generate's --selector against the mode, the store and the checkpoint
    "selector-not-ahead": (
        "generate --model {model} --prompt ab --offload forecast-offload --selector quest",
        "--selector quest with --offload forecast-offload: mode 'forecast-offload' fetches blocks a layer ahead, "
        "but the 'quest' selector only knows them at the consuming layer",
    ),
    "selector-oracle-offloaded": (
        "generate --model {model} --prompt ab --offload sparse-offload --selector oracle",
        "--selector oracle with --offload sparse-offload: the oracle selector reads every key of every layer",
    ),
    "selector-with-context-cache": (
        "generate --model {model} --prompt ab --selector forecast-carry-pin --context-cache {empty}",
        "--selector forecast-carry-pin with --context-cache: a context store keeps the prefills of the query and "
        "forecast selectors only",
    ),
    "selector-on-a-dense-model": (
        "generate --model {dense} --prompt ab --selector query",
        "--selector query needs a sparse model, and this checkpoint is dense",
    ),
    "selector-unknown": (
        "generate --model {model} --prompt ab --selector best",
        "argument --selector: invalid choice: 'best'",
    ),
    # 7. a config that is not YAML; a pickle refused
    "train-config-jsonl": (
        "train-forecast --config {jsonl}",
        "recipe '{jsonl}' is not valid YAML (line 3, column 1): expected '<document start>'",
    ),
    "eval-config-jsonl": ("eval --config {jsonl}", "eval config '{jsonl}' is not valid YAML (line 3, column 1)"),
    "eval-config-missing": ("eval --config {model}/nope.yaml", "eval config '{model}/nope.yaml': no such file"),
    "pickle-refused": (
        "generate --model {pickled} --prompt ab",
        "{pickled}/pytorch_model.bin is a pickle that torch.load(weights_only=True) refuses "
        "(it stores argparse.Namespace)",
    ),
    # 8. eval suites
    "suite-max-new-tokens": (
        "eval --config {suite_tokens}",
        "tasks[0].max_new_tokens must be a positive integer or null, got -8",
    ),
    "suite-examples-negative": (
        "eval --config {suite_examples}",
        "tasks[0].examples must be a positive integer or null, got -3",
    ),
    "suite-examples-zero": (
        "eval --config {suite_zero}",
        "tasks[0].examples must be a positive integer or null, got 0",
    ),
    # 9. heads of another model or geometry
    "heads-of-another-model": (
        "generate --model {model} --prompt ab --forecast-weights {other_heads}",
        "the forecast heads {other_heads} hold 3 tensors for layers 0-1, but the base {model} has 3 layers",
    ),
    "heads-of-another-geometry": (
        "generate --model {model} --prompt ab --forecast-weights {block16_heads}",
        "the forecast heads {block16_heads} were trained for block_size 16; "
        "the sparse_config selects with block_size 8",
    ),
    # 10. data errors say where
    "data-bad-jsonl-line": (
        "train-forecast --config {recipe_jsonl}",
        "{jsonl}:3: not a JSON object (Expecting property name",
    ),
    "data-not-utf8": (
        "train-forecast --config {recipe_latin}",
        "data file {latin} is not UTF-8 text: byte 0xe9 at offset 7 (line 2)",
    ),
    "data-empty-directory": (
        "train-forecast --config {recipe_empty}",
        "data source directory {empty} holds no .txt or .jsonl files",
    ),
}
# the ones run through the installed console script as well (a fresh process each, 13-25 s): argv
# bytes only a real process passes, and one error raised past main()'s parsing.  Every other name
# runs through the same main() in this process above.
CONSOLE = ("prompt-not-utf8", "generate-truncated-heads")


def _argv(spec, files) -> list[str]:
    parts = spec.split() if isinstance(spec, str) else spec
    return [part.format(**files) for part in parts]


def _one_line(status, err: str, expected: str) -> str:
    assert status == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if not line.startswith("forecastkv: warning:")]
    assert len(lines) == 1 and lines[0].startswith("forecastkv: error: "), err
    assert expected in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_is_one_line_and_status_2(name, files, capsys):
    spec, expected = BAD_INPUTS[name]
    capsys.readouterr()
    try:
        status = main(_argv(spec, files))
    except SystemExit as stop:  # argparse's own errors
        status = stop.code
    _one_line(status, capsys.readouterr().err, expected.format(**files))


@pytest.mark.slow  # a fresh process importing torch each: 13-25 s apiece on a busy 2-core CPU
@pytest.mark.parametrize("name", CONSOLE)
def test_console_script_bad_input(name, files):
    """The installed `forecastkv` script: argv bytes as the shell passes them, one line, status 2."""
    spec, expected = BAD_INPUTS[name]
    argv = [os.fsencode(part) for part in _argv(spec, files)]  # "\udcff" -> the byte 0xff, as a shell would pass it
    done = subprocess.run(
        [os.fsencode(SCRIPT), *argv], capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300
    )
    _one_line(done.returncode, done.stderr.decode("utf-8", "replace"), expected.format(**files))


@pytest.mark.slow
def test_stdin_that_is_not_utf8(files):
    done = subprocess.run(
        [SCRIPT, "generate", "--model", files["model"]],
        input=b"caf\xe9",
        capture_output=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    _one_line(done.returncode, done.stderr.decode(), "the prompt on stdin is not valid UTF-8: byte 0xe9 at offset 3")


# -- what is accepted, and said ---------------------------------------------------------------------


def test_max_new_tokens_is_capped_by_the_positions_left(files, capsys):
    """--max-new-tokens 1000000000 is capped at max_position_embeddings - prompt length, with a note;
    the run reaches the last position and prints what it generated."""
    argv = ["generate", "--model", files["model"], "--prompt", "abcd", "--max-new-tokens", "1000000000", "--stats"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    left = MAX_POSITIONS - 4
    note = f"forecastkv: note: --max-new-tokens 1000000000 capped at {left}, the positions a 4-token prompt leaves"
    assert note in err
    # no EOS in this vocabulary's random model: it runs to the last position
    assert f"[4 prompt tokens, {left} new," in err
    # --stats shows a progress bar (issue 39): tokens done of those asked, with a rate
    assert "generate: 100%" in err and f"{left}/{left}" in err and "tok/s" in err, err[-500:]
    assert len(out.strip()) > 0


def test_selector_option_decodes_as_the_python_api_with_that_selector(files, capsys):
    """`--selector forecast-carry-pin` (a selector beyond the modes' own) gives the tokens of generate() into
    a cache of that selector, resident and offloaded a layer ahead, and --stats names it."""
    from transformers import AutoTokenizer

    from forecastkv import ForecastKVForCausalLM, SparseCache
    from forecastkv.modeling.modeling import CACHE_KWARG

    prompt = "the quick brown fox jumps over a lazy dog ok"  # 44 tokens: 5 full blocks of 8, a budget of 3
    model = ForecastKVForCausalLM.from_pretrained(files["model"], forecast_weights=files["heads"])
    tokenizer = AutoTokenizer.from_pretrained(files["model"])
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    cache = SparseCache(model.config, selector="forecast-carry-pin")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=1, **{CACHE_KWARG: cache})
    expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    base = ["generate", "--model", files["model"], "--forecast-weights", files["heads"], "--prompt", prompt]
    base += ["--max-new-tokens", "12", "--selector", "forecast-carry-pin"]
    for extra in ([], ["--offload", "forecast-offload", "--stats"]):
        assert main(base + extra) == 0
        out_text, err = capsys.readouterr()
        assert out_text.rstrip("\n") == expected, extra
    assert "mode forecast-offload (selector forecast-carry-pin): 11 decode steps" in err


def test_geometry_mismatch_is_allowed_when_asked_and_topk_is_a_warning(files, capsys):
    base = ["generate", "--model", files["model"], "--prompt", "ab", "--max-new-tokens", "2", "--forecast-weights"]
    assert main([*base, files["block16_heads"], "--allow-geometry-mismatch"]) == 0
    err = capsys.readouterr().err
    warning = (
        f"forecastkv: warning: the forecast heads {files['block16_heads']} were trained for block_size 16; "
        "the sparse_config selects with block_size 8 (allowed by allow_geometry_mismatch)"
    )
    assert warning in err
    assert main([*base, files["topk5_heads"]]) == 0
    err = capsys.readouterr().err
    heads = files["topk5_heads"]
    assert f"forecastkv: warning: the forecast heads {heads} were trained with topk 5; selecting with topk 3" in err
    assert "Traceback" not in err and "warnings.warn" not in err


def test_sampling_chat_stream_and_prompt_file(files, tmp_path, capsys):
    """--temperature/--top-p/--seed sample reproducibly; --stream prints the same text; --chat
    applies the template; --prompt-file reads the prompt."""
    base = ["generate", "--model", files["model"], "--max-new-tokens", "6"]
    sample = ["--prompt", "abc", "--temperature", "1.5", "--top-p", "0.9", "--seed", "7"]
    texts = []
    for extra in ([], [], ["--stream"], ["--seed", "8"]):
        assert main(base + sample + extra) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] == texts[2] and texts[0].strip()
    assert texts[3] != texts[0]
    (tmp_path / "prompt.txt").write_text("abc")
    assert main(base + ["--prompt-file", str(tmp_path / "prompt.txt"), "--chat", "--stats"]) == 0
    assert "[20 prompt tokens," in capsys.readouterr().err  # "<user>abc<assistant>"


def test_a_prompt_file_too_long_for_the_positions_is_refused_before_tokenizing(files, tmp_path, capsys, monkeypatch):
    """Issue 39: a prompt file that is surely longer than max_position_embeddings is refused from
    its size alone (the tokenizer never runs on it), naming the bytes, the bound and the limit."""
    from transformers import PreTrainedTokenizerBase

    big = tmp_path / "big.txt"
    big.write_text("a" * (MAX_POSITIONS * 64))  # far beyond the positions, whatever the tokenizer
    calls = []
    original = PreTrainedTokenizerBase.__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", counted)
    assert main(["generate", "--model", files["model"], "--prompt-file", str(big)]) == 2
    err = capsys.readouterr().err
    assert f"--prompt-file {big} is {MAX_POSITIONS * 64:,} bytes: at least" in err, err
    assert f"more than the model's max_position_embeddings={MAX_POSITIONS}" in err and not calls
