"""What vLLM users expect keeps working under a sparse mode (the Forecast selector): prefix caching
shares pages (and the window indexes filed with them) and gives the tokens of independent runs, and
n > 1 sampling (top_k=1) gives each copy the request's greedy tokens."""

from __future__ import annotations

import pytest

from tests.vllm.engines import engine, essay_prompts, hf_greedy, hf_model

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

    # vLLM refuses n > 1 with temperature 0; top_k=1 samples the argmax, so each copy is the greedy run
    sampled = SamplingParams(temperature=1.0, top_k=1, n=3, max_tokens=NEW_TOKENS, ignore_eos=True, seed=0)
    copies = llm.generate([TokensPrompt(prompt_token_ids=second)], sampled, use_tqdm=False)[0].outputs
    assert [list(copy.token_ids) for copy in copies] == [expected[1]] * 3
