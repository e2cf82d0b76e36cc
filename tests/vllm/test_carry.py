"""infllmv2-forecast-carry in vLLM: what each request carries from one decode step to the next
(`forecastkv/modeling/carry.py`) is kept beside its pages between vLLM's calls (`serving/paged.py`,
`LayerPages.carried`), and under infllmv2-forecast-carry-pin so are the blocks its prompt pinned
(`modeling/pins.py`; `LayerPages.pinned`) and, between its prefill chunks, the query rows they are read
from (`LayerPages.pin_rows`); infllmv2-quest-forecast-carry-pin scores Quest's block key bounds, kept in the
pages' window slots.  On a tiny checkpoint, greedy tokens equal generate()'s for one prompt alone
and for four sent together under a small token budget, so prompts prefill in chunks beside other
requests' decode rows (mixed calls, rows in the scheduler's order; a prompt's last 32 rows cut across
chunks; without the rows kept between chunks the pinning mode's tokens differ) and the first prompt comes
again from the prefix cache.  The logic is tested on the toy engine (`tests/serving/test_paged.py`); this is
vLLM's scheduler around it.  Two ranks (carrying only): `test_tensor_parallel.py`.  Under the forecast-offload connector
(`serving/vllm_connector.py`, pool rows it did not load poisoned with NaN), the carried blocks must be among
the blocks it loads a layer ahead."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.vllm.engines import engine, hf_greedy, vllm_greedy
from tests.vllm.test_connector import CONNECTOR
from tests.vllm.test_tensor_parallel import CHANGES, tiny_checkpoint

MODE = "infllmv2-forecast-carry"
NEW_TOKENS = 12


PIN_MODE = "infllmv2-forecast-carry-pin"
QUEST_PIN_MODE = "infllmv2-quest-forecast-carry-pin"  # Quest's block key bounds kept in the pages' slots too
# room for 4 carried and 2 pinned blocks per head beside the forced ones
SPARSE_CHANGES = {MODE: CHANGES[MODE], PIN_MODE: {"topk": 10}, QUEST_PIN_MODE: {"topk": 10}}


@pytest.mark.slow
@pytest.mark.parametrize("mode", [MODE, PIN_MODE, QUEST_PIN_MODE])
def test_carrying_mode_gives_generate_tokens_beside_other_requests(tmp_path, mode):
    model = tiny_checkpoint(tmp_path / "tiny", "infllmv2", **SPARSE_CHANGES[mode])
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (700, 300, 520, 900)]
    expected = [hf_greedy(model, mode, p, NEW_TOKENS) for p in prompts]
    del model
    llm = engine(str(tmp_path / "tiny"), mode, skip_tokenizer_init=True, max_model_len=1024,
                 max_num_batched_tokens=256, enable_chunked_prefill=True, enable_prefix_caching=True)
    alone = vllm_greedy(llm, prompts[:1], NEW_TOKENS)
    together = vllm_greedy(llm, prompts, NEW_TOKENS)
    del llm
    gc.collect()
    for label, got, want in (("alone", alone, expected[:1]), ("together", together, expected)):
        for n, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(zip(got, want)):
            assert tokens == ref_tokens, f"{label}, prompt {n} ({len(prompts[n])} tokens)"
            assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-3, f"{label}, prompt {n}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", [MODE, QUEST_PIN_MODE])
def test_carried_blocks_are_loaded_by_the_lookahead_connector(tmp_path, mode):
    """The blocks a step carries (and those the prompt pinned) are in each layer's planned selection, which the
    connector fetches a layer ahead: with every row it did not load poisoned (`evict`), the tokens still equal
    generate()'s."""
    model = tiny_checkpoint(tmp_path / "tiny", "infllmv2", **SPARSE_CHANGES[mode])
    prompt = torch.randint(3, 256, (700,), generator=torch.Generator().manual_seed(5)).tolist()
    expected = hf_greedy(model, mode, prompt, NEW_TOKENS)
    del model
    llm = engine(str(tmp_path / "tiny"), mode, skip_tokenizer_init=True, max_model_len=1024,
                 enable_prefix_caching=False, kv_transfer_config=CONNECTOR)
    ((tokens, logprobs),) = vllm_greedy(llm, [prompt], NEW_TOKENS)
    del llm
    gc.collect()
    assert tokens == expected[0]
    assert max(abs(a - b) for a, b in zip(logprobs, expected[1])) < 1e-3
