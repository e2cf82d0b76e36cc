"""Greedy tokens from vLLM equal forecastkv's generate() with its SparseCache, in every attention mode:
one 4K-token prompt alone, then four prompts of 1K-4K tokens sent together (continuous batching,
chunked prefill mixing prefill and decode rows).  The largest |logprob difference| is recorded in
benchmarks/results/vllm/parity.json."""

from __future__ import annotations

import gc

import pytest

from tests.vllm.engines import MODE_CHECKPOINT, engine, essay_prompts, hf_greedy, hf_model, record, vllm_greedy

NEW_TOKENS = 32
LENGTHS = [4096, 1024, 2048, 3072]  # the first alone, then all four together
FINDINGS: dict = {}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODE_CHECKPOINT))
def test_vllm_tokens_equal_generate(checkpoints, mode):
    path = checkpoints[MODE_CHECKPOINT[mode]]
    prompts = essay_prompts(LENGTHS)
    model = hf_model(path)
    expected = [hf_greedy(model, mode, p, NEW_TOKENS) for p in prompts]
    del model
    # a small token budget per step: prompts prefill in chunks, beside other requests' decode rows
    llm = engine(path, mode, max_num_batched_tokens=1024, enable_chunked_prefill=True)
    alone = vllm_greedy(llm, prompts[:1], NEW_TOKENS)
    together = vllm_greedy(llm, prompts, NEW_TOKENS)
    del llm
    gc.collect()
    worst = 0.0
    for label, got, want in (("alone", alone, expected[:1]), ("together", together, expected)):
        for index, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(zip(got, want)):
            assert tokens == ref_tokens, f"{mode} {label}, prompt {index} ({len(prompts[index])} tokens)"
            worst = max(worst, max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)))
    assert worst < 1e-3, f"{mode}: max |logprob difference| {worst}"
    FINDINGS[mode] = {"max_abs_logprob_diff": worst, "prompts": LENGTHS, "new_tokens": NEW_TOKENS}
    record("parity", {"what": "vLLM-CPU greedy vs forecastkv generate() (SparseCache), fp32, bundled SmolLM2",
                      "modes": FINDINGS})
