"""The main job on the bundled default: SmolLM2-135M continues a held-out essay in dense and in
InfLLM-v2 mode; prints how many tokens agree and the share of KV blocks each decode step read."""

from __future__ import annotations

import time

import torch


def generate_with_cache(model, ids: torch.Tensor, max_new_tokens: int):
    """Greedy continuation through an explicit SparseCache.  ids [1, T] -> (new ids [N], cache, seconds)."""
    from .modeling.cache import SparseCache
    from .modeling.modeling import CACHE_KWARG

    cache = SparseCache(model.config)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=model.config.eos_token_id, **{CACHE_KWARG: cache})
    return out[0, ids.shape[1] :], cache, time.perf_counter() - start


def run_demo(prompt_tokens: int = 1536, new_tokens: int = 32, preset: str = "smollm2-135m", essay: int = 0) -> dict:
    """Returns the numbers it prints: agreement, block shares, timings."""
    from transformers import AutoTokenizer

    from . import ForecastKVForCausalLM, bundled_model_path, bundled_texts
    from .modeling.configuration import SparseConfig, load_preset

    path = bundled_model_path("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = bundled_texts("heldout")[essay]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :prompt_tokens]
    sparse = SparseConfig.from_dict(load_preset(preset)["sparse_config"])
    stored_blocks = -(-ids.shape[1] // sparse.block_size)
    print(f"prompt: {ids.shape[1]} tokens of a held-out essay ({stored_blocks} blocks of {sparse.block_size}); "
          f"{preset} budget: {sparse.budget_blocks} blocks")

    results, half = {}, ids.shape[1] // 2
    for mode, sparse_config in (("dense", None), ("infllmv2", preset)):
        model = ForecastKVForCausalLM.from_pretrained(path, sparse_config=sparse_config)
        with torch.no_grad():  # teacher-forced next-token predictions over the prompt's second half
            logits = model(ids).logits[0, half:-1]
        new_ids, cache, seconds = generate_with_cache(model, ids, new_tokens)
        nll = torch.nn.functional.cross_entropy(logits.float(), ids[0, half + 1 :]).item()
        results[mode] = {"ids": new_ids.tolist(), "seconds": seconds, "stats": cache.stats(), "predicted": logits.argmax(-1), "nll": nll}
        print(f"\n[{mode}] {seconds:.1f}s, NLL over the prompt's second half {nll:.4f}: {tokenizer.decode(new_ids)!r}")
    dense, sparse_ids = results["dense"]["ids"], results["infllmv2"]["ids"]
    agree = sum(a == b for a, b in zip(dense, sparse_ids))
    prefix = next((i for i, (a, b) in enumerate(zip(dense, sparse_ids)) if a != b), len(dense))
    stats = results["infllmv2"]["stats"]
    per_layer = [s for s in stats["block_share_per_layer"] if s is not None]
    forced = (results["dense"]["predicted"] == results["infllmv2"]["predicted"]).float().mean().item()
    print(f"\ngenerated tokens that agree (dense vs infllmv2): {agree}/{len(dense)} (identical prefix: {prefix})")
    print(f"teacher-forced next-token agreement over the prompt's second half: {100 * forced:.1f}%")
    print(f"KV blocks read per decode step: {100 * stats['block_share']:.1f}% of the stored blocks on average "
          f"over {stats['decode_steps']} steps and {len(per_layer)} layers "
          f"(min layer {100 * min(per_layer):.1f}%, max layer {100 * max(per_layer):.1f}%)")
    return {"agree": agree, "prefix": prefix, "total": len(dense), "teacher_forced_agreement": forced, **results}
