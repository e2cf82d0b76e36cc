"""What vLLM users expect keeps working under a sparse mode (the Forecast selector): prefix caching
shares pages (and the window indexes filed with them) and gives the tokens of independent runs, and
n > 1 sampling gives each copy the request's tokens."""

from __future__ import annotations

import pytest

from tests.vllm.engines import engine, essay_prompts, hf_greedy, hf_model, vllm_greedy

MODE = "infllmv2-forecast"
NEW_TOKENS = 16


@pytest.mark.slow
def test_prefix_caching_and_n_copies(checkpoints):
    path = checkpoints["demo"]
    prefix, tail_a, tail_b = essay_prompts([2048, 300, 200])
    first, second = prefix + tail_a, prefix + tail_b
    model = hf_model(path)
    expected = [hf_greedy(model, MODE, p, NEW_TOKENS)[0] for p in (first, second)]
    del model

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine(path, MODE, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    runs = [llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0] for p in (first, second)]
    assert runs[1].num_cached_tokens >= 2048 - 64, "the second request should reuse the shared prefix's pages"
    assert [list(run.outputs[0].token_ids) for run in runs] == expected

    copies = vllm_greedy(llm, [second], NEW_TOKENS, n=3)
    assert [tokens for tokens, _ in copies] == [expected[1]] * 3
