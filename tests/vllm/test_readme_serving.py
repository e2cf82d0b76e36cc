"""The README's "Serving with vLLM" block, run as a user types it (issue 40).

The commands are read from the README's fenced block itself, so the two cannot drift: its
`forecastkv convert` line writes the checkpoint (DIR: a tmp directory), each of its server lines
starts vLLM's OpenAI server, and its curl request (sent through httpx, parsed from the block) must
come back with the tokens forecastkv's own generate() gives.  The test adds only `--host` and
`--port` to the lines.  The server's environment is this suite's (conftest.py) less its
VLLM_CPU_KVCACHE_SPACE, which would stand in for the line's own --kv-cache-memory-bytes; it keeps
VLLM_ENABLE_V1_MULTIPROCESSING=0 (the worker inside the engine-core process: ready in 23 s, not 37, per
server; the memory check the line's flag passes is the worker's either way).

The first server line runs as written (a sparse mode) and with `dense` in its --hf-overrides (the
README's other kind of mode); as written, 8 concurrent completions also get the tokens they get one
at a time (dense is vLLM's own Llama, whose batching `test_parity.py` checks).  On the connector
server, `/metrics` carries the connector's H2D bytes, decode calls and block hits, equal
to the HF runtime's forecast-offload counts for the same prompt.  Serving a checkpoint without
Forecast heads in a Forecast mode prints one `forecastkv: error:` line before vLLM's traceback.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.helpers import free_port
from tests.vllm.engines import essay_prompts, hf_greedy, hf_model, hf_runtime_counts, record

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = ("### Serving with vLLM", "## Several processes and GPUs")
BIN = Path(sys.executable).parent  # the venv's `python` and `forecastkv`, as an activated venv has them
METRICS_PROMPT, METRICS_NEW = 1200, 12  # 18 complete blocks for a budget of 12: the slot maps hit and miss


def readme_commands() -> dict:
    """The serving block's commands as argv lists: {"install": [...], "convert": argv, "servers":
    [argv, ...], "curl": argv}; any other command fails here (the test runs every line it keeps)."""
    text = README.read_text()
    start = text.index(SECTION[0])
    block = re.search(r"```bash\n(.*?)```", text[start : text.index(SECTION[1], start)], re.S)
    assert block, "no ```bash block in the README's serving section"
    commands: dict = {"install": [], "convert": None, "servers": [], "curl": None}
    for line in block.group(1).replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        kind = {"pip": "install", "forecastkv": "convert", "python": "servers", "curl": "curl"}.get(argv[0])
        assert kind is not None, f"the README's serving block has a command this test does not run: {line}"
        if isinstance(commands[kind], list):
            commands[kind].append(argv)
        else:
            assert commands[kind] is None, f"two {kind} lines in the README's serving block"
            commands[kind] = argv
    assert commands["convert"] and commands["curl"] and len(commands["servers"]) == 2, commands
    return commands


def with_dir(argv: list[str], path: str) -> list[str]:
    """argv with the README's placeholder DIR replaced by `path` (in JSON arguments too)."""
    return [re.sub(r"\bDIR\b", path, arg) for arg in argv]


def curl_request(argv: list[str]) -> tuple[str, dict, dict]:
    """(url, headers, JSON body) of the README's curl line; a flag other than -H / -d fails."""
    url, headers, body = None, {}, None
    args = iter(argv[1:])
    for arg in args:
        if arg == "-H":
            name, value = next(args).split(":", 1)
            headers[name.strip()] = value.strip()
        elif arg == "-d":
            body = json.loads(next(args))
        else:
            assert not arg.startswith("-") and url is None, f"curl argument this test does not send: {arg}"
            url = arg
    assert url and body is not None, argv
    return url, headers, body


def server_mode(argv: list[str]) -> str:
    """The forecastkv_mode a server line's --hf-overrides asks for."""
    return json.loads(argv[argv.index("--hf-overrides") + 1])["forecastkv_mode"]


@contextmanager
def running_server(argv: list[str], log: Path, **env_vars: str):
    """The README's server line (python: this venv's) with --host/--port added, `env_vars` set;
    yields (client, base URL)."""
    import httpx

    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], argv
    assert "--port" not in argv and "--host" not in argv, "the harness picks the port"
    port = free_port()
    command = [str(BIN / "python"), *argv[1:], "--host", "127.0.0.1", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env.update(env_vars, PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    with open(log, "w") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client() as client:
            wait_ready(client, base, server, log)
            yield client, base
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def wait_ready(client, base: str, server: subprocess.Popen, log: Path, limit: float = 600.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if client.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        time.sleep(1)
    raise AssertionError(f"the server was not ready in {limit:.0f} s:\n{log.read_text()[-4000:]}")


def send_readme_curl(client, base: str, curl: list[str]) -> dict:
    """The README's curl request, sent to `base` instead of its 127.0.0.1:8000; the reply's JSON."""
    url, headers, body = curl_request(curl)
    parts = urlsplit(url)
    assert parts.netloc == "127.0.0.1:8000", f"the README's curl goes to {parts.netloc}, not vLLM's default"
    reply = client.post(
        urlunsplit(parts._replace(netloc=urlsplit(base).netloc)), headers=headers, json=body, timeout=600
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.fixture(scope="module")
def readme(tmp_path_factory):
    """{"commands": the README's, "dir": the checkpoint its convert line wrote, "tokenizer" and
    "model": that checkpoint's, "prompt" and "max_tokens": its curl request's, "expected": {mode:
    generate()'s greedy tokens for that request}, filled by `expected_tokens`}."""
    commands = readme_commands()
    path = str(tmp_path_factory.mktemp("readme") / "checkpoint")
    convert = with_dir(commands["convert"], path)
    done = subprocess.run([str(BIN / "forecastkv"), *convert[1:]], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    _, _, body = curl_request(with_dir(commands["curl"], path))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return {
        "commands": commands,
        "dir": path,
        "tokenizer": tokenizer,
        "model": hf_model(path),
        "prompt": tokenizer(body["prompt"])["input_ids"],
        "max_tokens": body["max_tokens"],
        "expected": {},
    }


def expected_tokens(readme, mode: str) -> list[int]:
    """generate()'s greedy tokens for the README's curl request in `mode` (computed once per mode)."""
    if mode not in readme["expected"]:
        readme["expected"][mode], _ = hf_greedy(readme["model"], mode, readme["prompt"], readme["max_tokens"])
    return readme["expected"][mode]


def check_readme_completion(readme, client, base: str, mode: str) -> int:
    """The README's curl gets generate()'s greedy tokens in `mode` (as text; up to an EOS, where vLLM
    stops); returns how many."""
    reply = send_readme_curl(client, base, with_dir(readme["commands"]["curl"], readme["dir"]))
    (choice,) = reply["choices"]
    count = reply["usage"]["completion_tokens"]
    assert count > 0 and choice["text"].strip(), reply
    expected = readme["tokenizer"].decode(expected_tokens(readme, mode)[:count], skip_special_tokens=True)
    assert choice["text"] == expected, (choice["text"], expected)
    return count


def with_mode(argv: list[str], mode: str | None) -> list[str]:
    """A server line with its --hf-overrides forecastkv_mode set to `mode` (None: as written)."""
    if mode is None:
        return argv
    at = argv.index("--hf-overrides") + 1
    return [*argv[:at], json.dumps({**json.loads(argv[at]), "forecastkv_mode": mode}), *argv[at + 1 :]]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [None, "dense"], ids=["as-written", "dense"])
def test_readme_first_server_line(readme, tmp_path, mode):
    """The first server line, as written (a sparse mode) and with the README's other attention mode,
    `dense`, in its --hf-overrides: the README's curl gets generate()'s tokens.  As written, 8
    concurrent completions then equal the same 8 sent one at a time (fp32; bf16 agreed on 3 of 4 in an
    earlier run).  The dense line skips that part: dense is vLLM's own Llama, whose batching
    `test_parity.py` checks against generate() (4 prompts together, chunked prefill)."""
    argv = with_mode(with_dir(readme["commands"]["servers"][0], readme["dir"]), mode)
    assert "--kv-transfer-config" not in argv
    with running_server(argv, tmp_path / "serve.log") as (client, base):
        check_readme_completion(readme, client, base, server_mode(argv))
        if mode == "dense":
            return
        prompts = essay_prompts([300 + 100 * i for i in range(8)])  # unequal: they finish prefill apart

        def complete(prompt):
            body = {"model": readme["dir"], "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            reply = client.post(f"{base}/v1/completions", json=body, timeout=600)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"]

        with ThreadPoolExecutor(max_workers=8) as pool:
            together = list(pool.map(complete, prompts))
        alone = [complete(p) for p in prompts]
    assert all(text for text in alone), alone
    assert together == alone


def connector_metrics(client, base: str) -> dict[str, float]:
    """The connector's series in `/metrics`, summed over labels (engines)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = (
        "vllm:forecastkv_h2d_bytes_per_step_sum",
        "vllm:forecastkv_h2d_bytes_per_step_count",
        "vllm:forecastkv_blocks_wanted_total",
        "vllm:forecastkv_block_hits_total",
    )
    values = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(client.get(f"{base}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return values


@pytest.mark.slow
def test_readme_connector_server_and_its_metrics(readme, tmp_path):
    """The second server line (forecast-offload through the KV connector): the README's curl, then one
    prompt whose `/metrics` deltas (H2D bytes, decode calls, blocks wanted and hit) equal the HF
    runtime's forecast-offload counts for the same prompt and tokens, and the periodic log line."""
    (prompt,) = essay_prompts([METRICS_PROMPT])
    mode = server_mode(readme["commands"]["servers"][1])
    model = readme["model"]
    tokens, _ = hf_greedy(model, mode, prompt, METRICS_NEW)
    counts, _ = hf_runtime_counts(model, mode, prompt, tokens)
    want = {
        "vllm:forecastkv_h2d_bytes_per_step_sum": sum(counts["per_step"]),
        "vllm:forecastkv_h2d_bytes_per_step_count": len(counts["per_step"]),
        "vllm:forecastkv_blocks_wanted_total": counts["wanted"],
        "vllm:forecastkv_block_hits_total": counts["hits"],
    }
    assert want["vllm:forecastkv_h2d_bytes_per_step_sum"] > 0
    assert 0 < want["vllm:forecastkv_block_hits_total"] < want["vllm:forecastkv_blocks_wanted_total"]

    argv = with_dir(readme["commands"]["servers"][1], readme["dir"])
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector"] == "ForecastLookaheadConnector"
    log = tmp_path / "serve.log"
    steps = "vllm:forecastkv_h2d_bytes_per_step_count"
    # the stats log line every second, not every 10 s (a harness setting)
    with running_server(argv, log, VLLM_LOG_STATS_INTERVAL="1") as (client, base):
        curl_tokens = check_readme_completion(readme, client, base, mode)
        before = connector_metrics(client, base)
        body = {
            "model": readme["dir"],
            "prompt": prompt,
            "max_tokens": METRICS_NEW,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        reply = client.post(f"{base}/v1/completions", json=body, timeout=600)
        assert reply.status_code == 200, reply.text
        # the stats of the last decode call may reach the API server just after the reply
        deadline = time.monotonic() + 30
        while True:
            after = connector_metrics(client, base)
            if after[steps] - before[steps] >= want[steps] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        time.sleep(3)  # the periodic "KV Transfer metrics" line of that last interval
    got = {name: after[name] - before[name] for name in want}
    record(
        "connector_metrics",
        {
            "what": "README connector server: /metrics deltas for one prompt vs the HF runtime's forecast-offload",
            "prompt_tokens": len(prompt),
            "new_tokens": METRICS_NEW,
            "dtype": "float32",
            "page": 64,
            "metrics": got,
            "hf_runtime": want,
            "hit_rate": got["vllm:forecastkv_block_hits_total"] / max(got["vllm:forecastkv_blocks_wanted_total"], 1),
        },
    )
    assert reply.json()["choices"][0]["token_ids"] == tokens
    assert got == want
    lines = re.findall(r"KV Transfer metrics: (forecastkv_decode_steps=\d+, h2d_bytes=\d+.*)", log.read_text())
    assert lines and "block_hit_rate=" in lines[-1], lines
    logged = [int(re.search(r"forecastkv_decode_steps=(\d+)", line).group(1)) for line in lines]
    # every decode call in the log: the README curl's (one per token after the first) and the prompt's
    assert sum(logged) == curl_tokens - 1 + want[steps], lines


@pytest.mark.slow
def test_a_checkpoint_without_heads_is_one_line_before_the_traceback(readme, tmp_path):
    """The README's convert line without --forecast-init (no Forecast heads), served by its Forecast-mode
    server line: the server exits, and its output carries `forecastkv: error: ...; fix: forecastkv
    convert ...` once, before any traceback."""
    convert = with_dir(readme["commands"]["convert"], str(tmp_path / "no-heads"))
    at = convert.index("--forecast-init")
    convert = convert[:at] + convert[at + 2 :]
    done = subprocess.run([str(BIN / "forecastkv"), *convert[1:]], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    argv = with_dir(readme["commands"]["servers"][0], str(tmp_path / "no-heads"))
    assert "forecast" in server_mode(argv)
    log = tmp_path / "serve.log"
    with pytest.raises(AssertionError, match="the server exited"):
        with running_server(argv, log):
            pass
    output = log.read_text()
    errors = [line for line in output.splitlines() if line.startswith("forecastkv: error: ")]
    assert len(errors) == 1, output[-6000:]
    assert "needs Forecast heads, but the checkpoint has none; fix: forecastkv convert " in errors[0], errors
    assert "--forecast-init next_query" in errors[0], errors
    assert "Traceback" in output and output.index(errors[0]) < output.index("Traceback"), output[-6000:]
