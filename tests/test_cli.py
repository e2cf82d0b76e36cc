"""The console script: sub-commands parse, convert writes our format, train-forecast owns --help."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from forecastkv import ForecastKVForCausalLM
from forecastkv.cli import build_parser, main


def test_parser_knows_every_command():
    parser = build_parser()
    for argv in (["demo"], ["generate", "--prompt", "x"], ["convert", "a", "b"]):
        assert callable(parser.parse_args(argv).run)


def test_train_forecast_help_reaches_the_trainer(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train-forecast", "--help"])
    assert exit_info.value.code == 0
    assert "--resume" in capsys.readouterr().out


def test_convert_writes_our_format(tmp_path):
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    llama.save_pretrained(tmp_path / "llama")
    assert main(["convert", str(tmp_path / "llama"), str(tmp_path / "ours"), "--sparse-config", "smollm2-135m"]) == 0
    model = ForecastKVForCausalLM.from_pretrained(tmp_path / "ours")
    assert model.config.model_type == "forecastkv" and model.config.sparse.window_size == 256
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, llama.model.layers[1].mlp.up_proj.weight)
