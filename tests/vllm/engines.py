"""What the vLLM tests share: the converted checkpoints, prompts from the bundled essays, an engine
per mode, and forecastkv's own generate() as the reference."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from tests.helpers import TINY_MODEL

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "vllm"
# the checkpoint each attention mode is served from (NOSA needs A/delta, which the demo's lacks)
MODE_CHECKPOINT = {"dense": "demo", "infllmv2-query": "demo", "infllmv2-forecast": "demo", "nosa": "nosa"}
PAGE = 64  # vLLM block_size: one page per selection block
# the tests' tiny model with heads of 32 (vLLM-CPU's smallest): 4 query heads over TINY_MODEL's KV heads
TINY_VLLM_SHAPE = dict(
    TINY_MODEL,
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def build_checkpoints(root: Path) -> dict[str, str]:
    """Save the bundled SmolLM2 (fp32) with the demo's sparse_config and next-query-initialised
    Forecast heads ("demo"), and again with policy nosa and A ~ N(0, 0.5^2), delta random ("nosa":
    A = 0 would make NOSA's bias a no-op).  Tokenizer files copied: both serve as they are."""
    from forecastkv import ForecastKVForCausalLM, bundled_model_path
    from forecastkv.modeling.remote_code import copy_tokenizer_files

    source = bundled_model_path()
    model = ForecastKVForCausalLM.from_pretrained(
        source, sparse_config="smollm2-135m", forecast={"enabled": True, "init": "next_query"}, dtype=torch.float32
    )
    paths = {"demo": str(root / "demo"), "nosa": str(root / "nosa")}
    model.save_pretrained(paths["demo"])
    copy_tokenizer_files(source, paths["demo"])
    generator = torch.Generator().manual_seed(0)
    config = model.config
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.A = nn.Parameter(torch.randn(config.num_key_value_heads, generator=generator) * 0.5)
        attn.delta = nn.Linear(config.num_key_value_heads * config.head_dim, config.num_key_value_heads, bias=False)
    config.sparse_config = {**config.sparse_config, "policy": "nosa"}
    model.save_pretrained(paths["nosa"])
    copy_tokenizer_files(source, paths["nosa"])
    return paths


def essay_prompts(lengths: list[int]) -> list[list[int]]:
    """Token ids of the bundled essays' text, one prompt of each length (different text each)."""
    from transformers import AutoTokenizer

    from forecastkv import bundled_model_path, bundled_texts

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    ids = tokenizer("\n\n".join(bundled_texts("train")))["input_ids"]
    prompts, start = [], 0
    for n in lengths:
        if start + n > len(ids):
            raise ValueError(f"the bundled essays hold {len(ids)} tokens, not {start + n}")
        prompts.append(ids[start : start + n])
        start += n
    return prompts


def engine(path: str, mode: str | None, **options):
    """vLLM's offline engine on `path` in attention mode `mode` (None: the checkpoint's own), fp32, eager,
    pages of PAGE tokens."""
    from vllm import LLM

    settings = dict(dtype="float32", block_size=PAGE, enforce_eager=True, max_model_len=8192, max_num_seqs=8, seed=0)
    if mode is not None:
        settings["hf_overrides"] = {"forecastkv_mode": mode}
    return LLM(model=path, **{**settings, **options})


def vllm_greedy(llm, prompts: list[list[int]], new_tokens: int, **sampling):
    """[(tokens, logprob of each)] per prompt, all prompts sent together."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=new_tokens, logprobs=0, ignore_eos=True, **sampling)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    results = []
    for output in outputs:
        for completion in output.outputs:
            tokens = list(completion.token_ids)
            logprobs = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
            results.append((tokens, logprobs))
    return results


def hf_model(path: str):
    from forecastkv import ForecastKVForCausalLM

    return ForecastKVForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, mode: str, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """forecastkv's generate() with its SparseCache in `mode`: greedy tokens and their logprobs."""
    from forecastkv.eval.modes import attending_with, parse_mode

    model.generation_config.eos_token_id = None  # vLLM runs with ignore_eos: neither stops early
    with attending_with(model, parse_mode(mode)):
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def hf_runtime_counts(model, mode: str, prompt: list[int], tokens: list[int]) -> tuple[dict, object]:
    """`tests/helpers.py:offloaded_counts` of forecast-offload with `model` attending in vLLM's `mode`:
    an independent count of what the connector moves."""
    from forecastkv.eval.modes import attending_with, parse_mode
    from tests.helpers import offloaded_counts

    with attending_with(model, parse_mode(mode)):
        return offloaded_counts(model, "forecast-offload", prompt, tokens)


def record(name: str, payload: dict) -> None:
    """Write a measurement to benchmarks/results/vllm/<name>.json (atomically)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    target = RESULTS / f"{name}.json"
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(target)
