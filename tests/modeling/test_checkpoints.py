"""Checkpoint formats: ours, MiniCPM4.1 (muP + LongRoPE), NOSA, SparDA heads, forecast weights alone."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import forecastkv.modeling  # noqa: F401  (registers the Auto classes)
from forecastkv import ForecastKVForCausalLM
from forecastkv.errors import CheckpointError
from forecastkv.modeling.modeling import RotaryEmbedding
from tests.helpers import TINY_MODEL, TINY_SPARSE, rel, tiny_config

HEAD_DIM = 16


def random_llama(seed=0, **overrides):
    """A random Llama of the tiny model's geometry (`TINY_MODEL` less our own query_chunk_size), 128 positions."""
    settings = {key: value for key, value in TINY_MODEL.items() if key != "query_chunk_size"}
    settings = {**settings, "max_position_embeddings": 128, **overrides}
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**settings)).eval()


def write_dir(path, config: dict, state: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


LONGROPE = {
    "rope_type": "longrope",
    "long_factor": [1.0 + 0.5 * i for i in range(HEAD_DIM // 2)],
    "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
    "original_max_position_embeddings": 32,
}
MUP = {"scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": 24}


def minicpm_dir(tmp_path, sparse_config, extra_state=None):
    """A tiny MiniCPM4.1-format directory (real config.json keys) and the Llama twin with muP folded in."""
    llama = random_llama(max_position_embeddings=128)
    config = {
        "architectures": ["MiniCPMForCausalLM"],
        "model_type": "minicpm",
        "vocab_size": 128,
        "hidden_size": 96,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": LONGROPE,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        **MUP,
        "sparse_config": sparse_config,
        "auto_map": {"AutoModelForCausalLM": "modeling_minicpm.MiniCPMForCausalLM"},
    }
    state = dict(llama.state_dict())
    state.update(extra_state or {})
    directory = write_dir(tmp_path / "minicpm", config, state)
    # the same function as a plain Llama: fold the muP scalars into the weights
    twin = random_llama(max_position_embeddings=128, rope_parameters={**LONGROPE, "rope_theta": 10000.0})
    folded = dict(llama.state_dict())
    residual = MUP["scale_depth"] / math.sqrt(3)
    folded["model.embed_tokens.weight"] = folded["model.embed_tokens.weight"] * MUP["scale_emb"]
    for i in range(3):
        for name in (f"model.layers.{i}.self_attn.o_proj.weight", f"model.layers.{i}.mlp.down_proj.weight"):
            folded[name] = folded[name] * residual
    folded["lm_head.weight"] = folded["lm_head.weight"] / (96 / MUP["dim_model_base"])
    twin.load_state_dict(folded)
    return directory, twin


# TINY_SPARSE's geometry in the keys of MiniCPM4.1's config.json (query_blocks is NOSA's, not MiniCPM's)
MINICPM_SPARSE = {
    key: TINY_SPARSE[key]
    for key in ("kernel_size", "kernel_stride", "init_blocks", "block_size", "window_size", "topk", "dense_len")
}
DENSE_MINICPM = {**MINICPM_SPARSE, "use_nope": False, "dense_len": 100000}


@pytest.mark.parametrize("length", [20, 60])  # below and above original_max_position_embeddings (LongRoPE switch)
def test_minicpm_format_matches_folded_llama(tmp_path, length):
    directory, twin = minicpm_dir(tmp_path, DENSE_MINICPM)
    model = ForecastKVForCausalLM.from_pretrained(directory)
    assert model.config.mup_config.scale_emb == 12.0 and model.config.sparse.lse == "coarse"
    ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        assert rel(model(ids).logits, twin(ids).logits) < 1e-4


def test_longrope_matches_direct_formula():
    config = tiny_config(max_position_embeddings=128, rope_parameters={**LONGROPE, "rope_theta": 10000.0})
    rope = RotaryEmbedding(config)
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    scale = math.sqrt(1 + math.log(128 / 32) / math.log(32))
    for length, factors in ((20, LONGROPE["short_factor"]), (60, LONGROPE["long_factor"])):
        positions = torch.arange(length).view(1, -1)
        cos, sin = rope(positions, torch.float32)
        freqs = positions.double().view(-1, 1) * (inv / torch.tensor(factors, dtype=torch.float64))
        emb = torch.cat([freqs, freqs], dim=-1)
        torch.testing.assert_close(cos[0].double(), emb.cos() * scale, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sin[0].double(), emb.sin() * scale, rtol=1e-5, atol=1e-5)


def test_minicpm_sparse_generates_and_sparda_heads_load(tmp_path):
    heads = {f"model.layers.{i}.self_attn.q_future_proj.weight": torch.randn(2 * HEAD_DIM, 96) for i in range(3)}
    heads["model.layers.0.self_attn.q_curr_proj.weight"] = torch.randn(2 * HEAD_DIM, 96)
    sparse = {**DENSE_MINICPM, "dense_len": 0}
    directory, _ = minicpm_dir(tmp_path, sparse, heads)
    model = ForecastKVForCausalLM.from_pretrained(directory, sparse_config={**TINY_SPARSE, "selector": "forecast"})
    assert model.config.forecast_config.enabled
    torch.testing.assert_close(
        model.model.layers[1].self_attn.forecast_proj.weight, heads["model.layers.1.self_attn.q_future_proj.weight"]
    )
    torch.testing.assert_close(
        model.model.layers[0].self_attn.current_proj.weight, heads["model.layers.0.self_attn.q_curr_proj.weight"]
    )
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 46)


def nosa_dir(tmp_path):
    """A tiny NOSA-format directory (Llama weights plus per-layer A and delta) -> (path, state dict)."""
    llama = random_llama()
    state = dict(llama.state_dict())
    for i in range(3):
        state[f"model.layers.{i}.self_attn.A"] = torch.randn(2)
        state[f"model.layers.{i}.self_attn.delta.weight"] = torch.randn(2, 2 * HEAD_DIM) * 0.1
    config = {**llama.config.to_dict(), "architectures": ["SparseLlamaForCausalLM"], "model_type": "llama"}
    return write_dir(tmp_path / "nosa", config, state), state


def test_nosa_format_loads_and_generates(tmp_path):
    directory, state = nosa_dir(tmp_path)
    default = ForecastKVForCausalLM.from_pretrained(directory)
    assert default.config.sparse.policy == "nosa" and default.config.sparse.budget_blocks == 64
    model = ForecastKVForCausalLM.from_pretrained(directory, sparse_config={**TINY_SPARSE, "policy": "nosa"})
    torch.testing.assert_close(model.model.layers[2].self_attn.A.data, state["model.layers.2.self_attn.A"])
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
        full = model(out.sequences).logits
    assert rel(torch.stack(out.logits, 1), full[:, 39:-1]) < 1e-4


def test_plain_llama_loads_dense_or_training_free_sparse(tmp_path):
    llama = random_llama()
    directory = tmp_path / "llama"
    llama.save_pretrained(directory)
    dense = ForecastKVForCausalLM.from_pretrained(directory)
    assert dense.config.sparse is None
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel(dense(ids).logits, llama(ids).logits) < 1e-5
    sparse = ForecastKVForCausalLM.from_pretrained(directory, sparse_config=TINY_SPARSE)
    assert sparse.config.sparse.topk == 3


def test_save_and_load_round_trip_and_auto_class(tmp_path):
    config = tiny_config(
        sparse_config={**TINY_SPARSE, "policy": "nosa", "selector": "forecast"},
        forecast={"enabled": True, "heads_per_group": 2},
    )
    torch.manual_seed(0)
    model = ForecastKVForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "ours")
    loaded = ForecastKVForCausalLM.from_pretrained(tmp_path / "ours")
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert isinstance(auto, ForecastKVForCausalLM)
    for other in (loaded, auto):
        assert other.config.sparse == model.config.sparse and other.config.forecast == model.config.forecast
        for key, value in model.state_dict().items():
            assert torch.equal(value, other.state_dict()[key]), key
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_forecast_weights_alone_reload_onto_base(tmp_path):
    llama = random_llama()
    llama.save_pretrained(tmp_path / "base")
    trained = ForecastKVForCausalLM.from_pretrained(
        tmp_path / "base", sparse_config=TINY_SPARSE, forecast={"heads_per_group": 1}
    )
    with torch.no_grad():
        for layer in trained.model.layers:
            layer.self_attn.forecast_proj.weight.normal_()
    trained.save_forecast_weights(tmp_path / "heads", base_model=str(tmp_path / "base"))
    files = sorted(p.name for p in (tmp_path / "heads").iterdir())
    assert files == ["forecast.safetensors", "forecast_config.json"]
    reloaded = ForecastKVForCausalLM.from_pretrained(tmp_path / "base", forecast_weights=tmp_path / "heads")
    assert reloaded.config.sparse == type(trained.config.sparse)(**{**TINY_SPARSE, "selector": "forecast"})
    for key, value in trained.state_dict().items():
        assert torch.equal(value, reloaded.state_dict()[key]), key


# -- bad input ---------------------------------------------------------------------------------


def test_forecast_selector_without_heads_names_missing_layers(tmp_path):
    random_llama().save_pretrained(tmp_path / "base")
    with pytest.raises(CheckpointError, match=r"missing forecast_proj on layers \[0, 1\] and current_proj on layer 0"):
        ForecastKVForCausalLM.from_pretrained(tmp_path / "base", sparse_config={**TINY_SPARSE, "selector": "forecast"})


def test_partially_missing_heads_are_named(tmp_path):
    config = tiny_config(forecast={"enabled": True})
    model = ForecastKVForCausalLM(config)
    state = {k: v for k, v in model.state_dict().items() if "layers.1.self_attn.forecast_proj" not in k}
    write_dir(tmp_path / "partial", {**config.to_dict(), "model_type": "forecastkv"}, state)
    with pytest.raises(CheckpointError, match=r"lacks forecast weights for layers \[1\]"):
        ForecastKVForCausalLM.from_pretrained(tmp_path / "partial")


def test_unknown_preset_is_rejected(tmp_path):
    random_llama().save_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match="unknown sparse_config preset 'nope'; known presets: .*smollm2-135m"):
        ForecastKVForCausalLM.from_pretrained(tmp_path / "base", sparse_config="nope")


def test_corrupt_and_partial_directories_are_rejected(tmp_path):
    llama = random_llama()
    llama.save_pretrained(tmp_path / "good")
    corrupt = tmp_path / "corrupt"
    llama.save_pretrained(corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt checkpoint file .*model.safetensors"):
        ForecastKVForCausalLM.from_pretrained(corrupt)
    partial = tmp_path / "partial"
    state = {k: v for k, v in llama.state_dict().items() if "layers.2.mlp" not in k}
    write_dir(partial, llama.config.to_dict(), state)
    with pytest.raises(CheckpointError, match="partial checkpoint .*3 tensors missing"):
        ForecastKVForCausalLM.from_pretrained(partial)
    (tmp_path / "noconfig").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        ForecastKVForCausalLM.from_pretrained(tmp_path / "noconfig")
    with pytest.raises(CheckpointError, match="neither a local directory nor a reachable hub id"):
        ForecastKVForCausalLM.from_pretrained(tmp_path / "does-not-exist")


# -- lean loading ------------------------------------------------------------------------------


def write_sharded(path, model, dtype=torch.bfloat16, shards=3):
    """Save `model` as `shards` safetensors files plus model.safetensors.index.json (the layout
    MiniCPM4.1-8B ships), in `dtype`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_dict()))
    state = {k: v.to(dtype).contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k] for k in part}, str(path / file))
        weight_map.update({k: file for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return state


class InitCalls(torch.overrides.TorchFunctionMode):
    """Records in-place initialiser calls (normal_, uniform_, fill_, zero_, ...) on real tensors."""

    NAMES = {"normal_", "uniform_", "fill_", "zero_", "copy_", "kaiming_uniform_", "trunc_normal_"}

    def __init__(self):
        super().__init__()
        self.real = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES and args and isinstance(args[0], torch.Tensor) and not args[0].is_meta:
            self.real.append((name, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


def test_sharded_checkpoint_loads_lean_in_target_dtype(tmp_path):
    """Shards + index, bf16 on disk and in memory: every tensor equals the file's, no initialiser
    touches a real tensor, no tensor is left on the meta device, and the model runs."""
    llama = random_llama(seed=5)
    state = write_sharded(tmp_path / "sharded", llama)
    with InitCalls() as calls:
        model = ForecastKVForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.bfloat16)
    assert calls.real == []
    loaded = model.state_dict()
    for name, tensor in state.items():
        assert loaded[name].dtype == torch.bfloat16 and torch.equal(loaded[name], tensor), name
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fp32 = ForecastKVForCausalLM.from_pretrained(tmp_path / "sharded")  # cast up on load
        assert fp32.model.embed_tokens.weight.dtype == torch.float32
        assert rel(model(ids).logits, fp32(ids).logits) < 6e-2  # bf16 arithmetic
        # the same bf16 weights in Llama, computed in fp32: our fp32 load is exact
        llama.load_state_dict({k: v.float() for k, v in state.items()})
        assert rel(fp32(ids).logits, llama(ids).logits) < 1e-5


def test_device_map_places_every_tensor(tmp_path):
    llama = random_llama(seed=6)
    write_sharded(tmp_path / "sharded", llama, dtype=torch.float32)
    plain = ForecastKVForCausalLM.from_pretrained(tmp_path / "sharded")
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    for device_map in ("auto", {"": "cpu"}, {"model": "cpu", "lm_head": "cpu"}):
        model = ForecastKVForCausalLM.from_pretrained(tmp_path / "sharded", device_map=device_map)
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        with torch.no_grad():
            assert torch.equal(model(ids).logits, plain(ids).logits), device_map
    with pytest.raises(ValueError, match="device_map='everywhere' is not a dict or one of 'auto'"):
        ForecastKVForCausalLM.from_pretrained(tmp_path / "sharded", device_map="everywhere")


def test_truncated_or_missing_shard_is_rejected(tmp_path):
    write_sharded(tmp_path / "sharded", random_llama(seed=7))
    shard = tmp_path / "sharded" / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="corrupt checkpoint file .*model-00002-of-00003.safetensors: tensor"):
        ForecastKVForCausalLM.from_pretrained(tmp_path / "sharded")
    shard.unlink()
    with pytest.raises(
        CheckpointError,
        match="partial checkpoint: shard model-00002-of-00003.safetensors listed in the index is missing",
    ):
        ForecastKVForCausalLM.from_pretrained(tmp_path / "sharded")


# -- what Hugging Face-style clients pass --------------------------------------------------------


def test_dtype_accepts_every_value_transformers_takes(tmp_path):
    """ "auto" is the checkpoint's own dtype (config.json's, else its first floating tensor's); a
    torch.dtype, its name and "torch.<name>" are the same dtype; anything else names the value."""
    llama = random_llama(seed=8).to(torch.bfloat16)
    llama.save_pretrained(tmp_path / "bf16")  # config.json says dtype bfloat16
    write_dir(
        tmp_path / "headerless",
        {**json.loads((tmp_path / "bf16" / "config.json").read_text()), "dtype": None},
        {k: v.to(torch.float16) for k, v in llama.state_dict().items()},
    )
    assert ForecastKVForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto").dtype == torch.bfloat16
    assert ForecastKVForCausalLM.from_pretrained(tmp_path / "headerless", dtype="auto").dtype == torch.float16
    for value in (torch.float16, "float16", "torch.float16"):
        assert ForecastKVForCausalLM.from_pretrained(tmp_path / "bf16", dtype=value).dtype == torch.float16, value
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")  # lm-eval's default: plain Llama here
    assert auto.dtype == torch.bfloat16
    for bad in ("int8", "fp77"):
        with pytest.raises(ValueError, match=f"dtype={bad!r} is not a floating torch dtype"):
            ForecastKVForCausalLM.from_pretrained(tmp_path / "bf16", dtype=bad)


def test_forecast_through_the_auto_class_creates_the_heads(tmp_path):
    """forecast= (and sparse_config= with the forecast selector) through AutoModelForCausalLM does
    what it does through ForecastKVForCausalLM, instead of being stored on the config unused."""
    torch.manual_seed(0)
    ForecastKVForCausalLM(tiny_config(sparse_config=TINY_SPARSE)).eval().save_pretrained(tmp_path / "ours")  # no heads
    asked = {
        "sparse_config": {**TINY_SPARSE, "selector": "forecast"},
        "forecast": {"init": "next_query", "heads_per_group": 2},
    }
    torch.manual_seed(5)  # the last layer's head (it scores no layer) starts random
    direct = ForecastKVForCausalLM.from_pretrained(tmp_path / "ours", **asked)
    torch.manual_seed(5)
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", **asked)
    assert auto.config.forecast_config.enabled and auto.config.forecast_config.heads_per_group == 2
    assert auto.config.sparse.selector == "forecast"
    assert (
        auto.model.layers[0].self_attn.forecast_proj.weight.shape
        == direct.model.layers[0].self_attn.forecast_proj.weight.shape
    )
    for key, value in direct.state_dict().items():
        assert torch.equal(value, auto.state_dict()[key]), key
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert not plain.config.forecast_config.enabled and plain.config.sparse.selector == "query"


REMOTE_LOAD = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
ids = torch.tensor([json.loads(sys.argv[2])])
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
print(json.dumps({"class": type(model).__module__ + "." + type(model).__name__, "tokens": out[0].tolist()}))
"""


@pytest.mark.slow  # a fresh interpreter importing torch and transformers
def test_saved_directory_loads_with_trust_remote_code_in_a_fresh_process(tmp_path):
    """save_pretrained writes auto_map and modules importing the installed package: a process that
    never imported forecastkv loads the model with plain transformers and generates its tokens."""
    import subprocess
    import sys

    torch.manual_seed(1)
    model = ForecastKVForCausalLM(tiny_config(sparse_config=TINY_SPARSE, forecast={"enabled": True})).eval()
    model.save_pretrained(tmp_path / "ours")
    raw = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert raw["auto_map"] == {
        "AutoConfig": "configuration_forecastkv.ForecastKVConfig",
        "AutoModelForCausalLM": "modeling_forecastkv.ForecastKVForCausalLM",
    }
    prompt = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    env = {**__import__("os").environ, "HF_HOME": str(tmp_path / "hf")}  # a fresh modules cache
    done = subprocess.run(
        [sys.executable, "-c", REMOTE_LOAD, str(tmp_path / "ours"), json.dumps(prompt)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded["class"] == "forecastkv.modeling.modeling.ForecastKVForCausalLM"
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0].tolist()
    assert loaded["tokens"] == expected
    # saving a model loaded that way writes the same small modules, never the package's sources
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", trust_remote_code=True)
    reloaded.save_pretrained(tmp_path / "again")
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == sorted(
        p.name for p in (tmp_path / "ours").iterdir()
    )


def test_heads_must_fit_the_base_and_its_block_geometry(tmp_path):
    """Heads from another base name the heads file; heads of another block geometry are an error
    unless allow_geometry_mismatch=True (then a warning naming both); another topk only warns;
    a corrupt forecast.safetensors is a CheckpointError naming it."""
    import shutil
    import warnings

    from forecastkv.errors import ForecastKVWarning
    from tests.helpers import tiny_model

    tiny_model(mode={}).save_pretrained(tmp_path / "base")
    tiny_model(mode={}, num_hidden_layers=2).save_forecast_weights(tmp_path / "two_layers")
    tiny_model(mode={"block_size": 16, "window_size": 16}).save_forecast_weights(tmp_path / "block16")
    tiny_model(mode={"topk": 5}).save_forecast_weights(tmp_path / "topk5")
    load = lambda heads, **kw: ForecastKVForCausalLM.from_pretrained(
        tmp_path / "base", forecast_weights=tmp_path / heads, **kw
    )  # noqa: E731
    with pytest.raises(
        CheckpointError,
        match=rf"the forecast heads {tmp_path / 'two_layers'} hold 3 tensors for layers 0-1, but the base "
        rf"{tmp_path / 'base'} has 3 layers .*train heads for this base",
    ):
        load("two_layers")
    with pytest.raises(
        CheckpointError,
        match="were trained for block_size 16; the sparse_config selects with block_size 8: "
        ".*allow_geometry_mismatch=True",
    ):
        load("block16")
    geometry = "trained for block_size 16; the sparse_config selects with block_size 8 \\(allowed by allow_geometry"
    with pytest.warns(ForecastKVWarning, match=geometry) as geometry_warnings:
        assert load("block16", allow_geometry_mismatch=True).config.sparse.block_size == 8
    with pytest.warns(
        ForecastKVWarning, match="were trained with topk 5; selecting with topk 3 \\(same block geometry"
    ) as budget_warnings:
        load("topk5")
    # each warning points at the line that called from_pretrained (here), not into the package
    assert {w.filename for w in [*geometry_warnings, *budget_warnings]} == {__file__}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            load("topk5", sparse_config={**TINY_SPARSE, "topk": 5}).config.sparse.topk == 5
        )  # the heads' own budget: silent
    shutil.copytree(tmp_path / "topk5", tmp_path / "cut")
    data = (tmp_path / "cut" / "forecast.safetensors").read_bytes()
    (tmp_path / "cut" / "forecast.safetensors").write_bytes(data[:100])
    with pytest.raises(CheckpointError, match=f"corrupt checkpoint file {tmp_path / 'cut' / 'forecast.safetensors'}"):
        load("cut")


# issue 39 item 4: one rule for every source of a sparse_config; value -> the message it gets
BAD_SPARSE = {
    "block_size 0": ({"block_size": 0}, r"sparse_config\.block_size must be a positive integer, got 0"),
    "window -64": ({"window_size": -64}, r"sparse_config\.window_size must be a non-negative integer, got -64"),
    "kernel_size 1e9": ({"kernel_size": 10**9}, r"sparse_config\.kernel_size=1000000000 exceeds max_position_emb"),
}
CONFIG_SOURCES = ("forecastkv config.json", "llama config.json", "minicpm config.json", "from_pretrained", "preset")


@pytest.mark.parametrize("source", CONFIG_SOURCES)
@pytest.mark.parametrize("bad", list(BAD_SPARSE))
def test_a_bad_sparse_config_is_refused_from_every_source(tmp_path, source, bad):
    """The same ConfigError text whichever source holds the value; a config.json names its file.
    None loads (a bad value once ran dense without a word)."""
    from forecastkv.errors import ConfigError
    from forecastkv.modeling.configuration import resolve_sparse_config

    change, message = BAD_SPARSE[bad]
    sparse = {**resolve_sparse_config(TINY_SPARSE), **change}
    folder = tmp_path / "model"
    if source == "forecastkv config.json":
        ForecastKVForCausalLM.from_pretrained(_llama_dir(tmp_path), sparse_config=TINY_SPARSE).save_pretrained(folder)
        raw = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**raw, "sparse_config": sparse}))
    elif source == "llama config.json":
        folder = _llama_dir(tmp_path)
        raw = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**raw, "sparse_config": sparse}))
    elif source == "minicpm config.json":
        folder = minicpm_dir(tmp_path, sparse)[0]
    with pytest.raises(ConfigError, match=message) as raised:
        if source == "from_pretrained":
            ForecastKVForCausalLM.from_pretrained(_llama_dir(tmp_path), sparse_config=sparse)
        elif source == "preset":  # what a YAML recipe and --sparse-config resolve through
            tiny_config(sparse_config=resolve_sparse_config(sparse))
        else:
            ForecastKVForCausalLM.from_pretrained(folder)
    if source.endswith("config.json"):
        assert str(raised.value).startswith(f"{folder / 'config.json'}: "), str(raised.value)


def _llama_dir(tmp_path):
    directory = tmp_path / "llama"
    if not directory.exists():
        random_llama().save_pretrained(directory)
    return directory


def test_save_pretrained_writes_the_source_tokenizer_and_umask_modes(tmp_path):
    """A `save_pretrained` directory serves as it is: the tokenizer files of the directory the model
    was loaded from come along (a tokenizer saved there first is kept), and the weights get the
    umask's mode like every other file (safetensors alone writes them 0600)."""
    import os

    random_llama().save_pretrained(tmp_path / "llama")
    (tmp_path / "llama" / "tokenizer.json").write_text('{"version": "1.0"}\n')
    (tmp_path / "llama" / "tokenizer_config.json").write_text('{"tokenizer_class": "X"}\n')
    model = ForecastKVForCausalLM.from_pretrained(tmp_path / "llama")
    out = tmp_path / "saved"
    out.mkdir()
    (out / "tokenizer_config.json").write_text('{"tokenizer_class": "Mine"}\n')  # the caller's own
    mask = os.umask(0o027)
    try:
        model.save_pretrained(out)
    finally:
        os.umask(mask)
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}\n'
    assert (out / "tokenizer_config.json").read_text() == '{"tokenizer_class": "Mine"}\n'
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o640
    assert (out / "config.json").stat().st_mode & 0o777 == 0o640


def test_longrope_factors_are_chosen_per_sequence():
    """A batch of a sequence below `original_max_position_embeddings` and one past it: each row gets the
    cos/sin it gets alone (short factors for the first, long for the second), so a serving engine's
    batch does not change a sequence's rotary tables.  Deciding once per batch fails this."""
    config = tiny_config(max_position_embeddings=128, rope_parameters={**LONGROPE, "rope_theta": 10000.0})
    rotary = RotaryEmbedding(config)
    short, long = torch.tensor([[20]]), torch.tensor([[60]])  # one decode row each, 32 the switch
    batch = rotary(torch.cat([short, long]), torch.float32)
    for row, alone in enumerate((rotary(short, torch.float32), rotary(long, torch.float32))):
        for table, expected in zip(batch, alone):
            torch.testing.assert_close(table[row : row + 1], expected, rtol=0, atol=0)
    # the long factors at position 20 (what a per-batch decision gives the short row) are another table
    freqs = 20 * rotary.long_inv_freq
    long_cos = torch.cat([freqs, freqs]).cos() * rotary.attention_scaling
    assert not torch.allclose(long_cos, batch[0][0, 0], atol=1e-3)
