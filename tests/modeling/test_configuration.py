"""`ForecastKVConfig`: a misspelt key is an error that names the right one; transformers' own keys
and the extras of real checkpoints (MiniCPM4.1, NOSA/Llama) stay accepted; the sections
(sparse_config, forecast, mup) read strictly; MiniCPM's dense rule."""

import dataclasses
import re

import pytest

from forecastkv.errors import ConfigError
from forecastkv.modeling.checkpoints import config_from_raw, detect_format
from forecastkv.modeling.configuration import ForecastConfig, ForecastKVConfig, MupConfig, SparseConfig
from forecastkv.modeling.selection import dense_at

# MiniCPM4.1-8B's config.json fields (the openbmb/MiniCPM4.1-8B model card; LongRoPE lists shortened)
MINICPM41_CONFIG = {
    "architectures": ["MiniCPMForCausalLM"],
    "model_type": "minicpm",
    "auto_map": {
        "AutoConfig": "configuration_minicpm.MiniCPMConfig",
        "AutoModelForCausalLM": "modeling_minicpm.MiniCPMForCausalLM",
    },
    "hidden_size": 4096,
    "intermediate_size": 16384,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "vocab_size": 73448,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": [2, 73440],
    "pad_token_id": 2,
    "max_position_embeddings": 65536,
    "rope_scaling": {
        "rope_type": "longrope",
        "long_factor": [1.0] * 64,
        "short_factor": [1.0] * 64,
        "original_max_position_embeddings": 65536,
    },
    "rope_theta": 10000.0,
    "scale_emb": 12,
    "scale_depth": 1.4,
    "dim_model_base": 256,
    "mup_denominator": 32,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.56.0",
    "use_cache": True,
    "sparse_config": {
        "kernel_size": 32,
        "kernel_stride": 16,
        "init_blocks": 1,
        "block_size": 64,
        "window_size": 2048,
        "topk": 64,
        "use_nope": False,
        "dense_len": 8192,
    },
}
# a Llama-format checkpoint (NOSA's): Llama's own extras
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "pretraining_tp": 1,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
    "head_dim": 128,
}


@pytest.mark.parametrize(
    "wrong, right",
    [
        ("prefill_chunk_size", "'prefill_chunk' or 'query_chunk_size'"),
        ("num_hiden_layers", "'num_hidden_layers'"),
        ("sparse_confg", "'sparse_config'"),
    ],
)
def test_misspelt_key_names_the_right_one(wrong, right):
    with pytest.raises(ValueError, match=rf"unknown ForecastKVConfig key '{wrong}'; did you mean {right}\?"):
        ForecastKVConfig(**{wrong: 16})


def test_prefill_chunk_is_validated():
    assert ForecastKVConfig(prefill_chunk=4096).prefill_chunk == 4096 and ForecastKVConfig().prefill_chunk == 0
    with pytest.raises(ValueError, match=r"prefill_chunk must be a non-negative integer .* got -1"):
        ForecastKVConfig(prefill_chunk=-1)


def test_transformers_and_foreign_keys_stay_accepted():
    # transformers' own keys, and config keys of other architectures that look like ours
    config = ForecastKVConfig(
        output_attentions=True, torch_dtype="bfloat16", layer_norm_eps=1e-5, num_kv_heads=2, pretraining_tp=1
    )
    assert config.output_attentions is True
    assert config.layer_norm_eps == 1e-5  # kept, as transformers keeps unknown keys


@pytest.mark.parametrize("raw, fmt", [(MINICPM41_CONFIG, "minicpm"), (LLAMA_CONFIG, "llama")])
def test_real_config_json_still_loads(raw, fmt):
    assert detect_format(raw, {}) == fmt
    config = ForecastKVConfig(**config_from_raw(raw, fmt))
    assert config.num_key_value_heads == raw["num_key_value_heads"]
    if fmt == "minicpm":
        assert config.sparse.budget_blocks == 96 and config.sparse.lse == "coarse"
        assert config.mup_config.scale_emb == 12


def test_our_own_format_round_trips_through_to_dict():
    config = ForecastKVConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, sparse_config="smollm2-135m")
    again = ForecastKVConfig(
        **{k: v for k, v in config.to_dict().items() if k not in ("model_type", "transformers_version")}
    )
    assert again.sparse == config.sparse and again.query_chunk_size == config.query_chunk_size


@pytest.mark.parametrize(
    "cls, section", [(SparseConfig, "sparse_config"), (ForecastConfig, "forecast"), (MupConfig, "mup")]
)
def test_each_config_section_reads_strictly(cls, section):
    """One strict `from_dict`: an unknown key or a value that is no mapping is a ConfigError naming
    the section (and the allowed keys); a parsed section passes through as it is."""
    allowed = sorted(field.name for field in dataclasses.fields(cls))
    with pytest.raises(ConfigError, match=re.escape(f"unknown {section} key(s) ['bogus']; allowed keys are {allowed}")):
        cls.from_dict({"bogus": 1})
    with pytest.raises(ConfigError, match=re.escape(f"{section} must be a mapping of {section} keys, got [1, 2]")):
        cls.from_dict([1, 2])
    parsed = cls()
    assert cls.from_dict(parsed) is parsed and cls.from_dict({}) == parsed
    with pytest.raises(ConfigError, match=re.escape(f"unknown {section} key(s) ['bogus']")):  # as the config reads it
        ForecastKVConfig(hidden_size=64, num_attention_heads=4, **{section: {"bogus": 1}})


@pytest.mark.parametrize(
    "mup, message",
    [
        ({"scale_emb": "12"}, "mup.scale_emb must be a finite number, got '12'"),
        ({"scale_depth": float("nan")}, "mup.scale_depth must be a finite number, got nan"),
        ({"dim_model_base": 0}, "mup.dim_model_base must be a positive integer, got 0"),
    ],
)
def test_mup_values_are_checked(mup, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ForecastKVConfig(hidden_size=64, num_attention_heads=4, mup=mup)


def test_dense_rule():
    """MiniCPM's dense rule: fewer keys than dense_len attend densely; dense_len 0 or -1 never does."""
    assert dense_at(8191, SparseConfig(dense_len=8192)) and not dense_at(8192, SparseConfig(dense_len=8192))
    assert not dense_at(1, SparseConfig(dense_len=0)) and not dense_at(1, SparseConfig(dense_len=-1))
