"""The offloading runtime on CUDA: every mode of `forecastkv.inference.MODES` gives the greedy tokens
of the resident `SparseCache` with the same selector, on a tiny random model, for a left-padded
batch of 3, 80 new tokens (compression windows and whole blocks complete while decoding), both
policies; and no decode step synchronises the host with the device: everything after the prefill
call runs under `torch.cuda.set_sync_debug_mode("error")`, so a `.item()`, `.cpu()`, a pageable
copy or a `nonzero` in the decode path fails here with the stack of the call that synchronised.

CUDA only (benchmarks/gpu_check.py's "runtime parity" section runs this file).  The decode loop is
`greedy_decode`, a plain loop instead of `model.generate`, whose own stopping checks read device
values every step; on CPU a short test checks that the loop gives `generate`'s tokens.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from forecastkv import SparseCache
from forecastkv.inference import MODES, OffloadedSparseCache
from forecastkv.inference.offloaded import MODE_SELECTOR
from forecastkv.modeling.modeling import CACHE_KWARG
from tests.helpers import left_padded, rel, tiny_model

POLICIES = ("infllmv2", "nosa")
LENGTHS = [45, 26, 37]  # left-padded batch of 3
NEW_TOKENS = 80  # with kernel_stride 2 and block_size 8: 40 compressed keys and 10 blocks complete while decoding
MODEL_SELECTOR = "forecast"  # the model's own selector; sparse-offload selects with queries


class HostSync(AssertionError):
    """A decode step synchronised the host with the device (under sync-debug mode "error")."""


@contextlib.contextmanager
def no_host_syncs(enabled: bool):
    """`torch.cuda.set_sync_debug_mode("error")` while the block runs (when `enabled`), "default" after."""
    if not enabled:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@torch.no_grad()
def greedy_decode(model, ids, mask, cache, new_tokens: int, strict_syncs: bool = False):
    """Greedy tokens [B, new_tokens] and their logits [B, new_tokens, V] (fp32), both on the CPU:
    one prefill call over the (left-padded) prompt, then `new_tokens - 1` one-token steps, each
    with the attention mask grown by a column of ones, as `model.generate` does.  With
    `strict_syncs` (CUDA) the steps after the prefill run under sync-debug mode "error"; a host
    sync raises `HostSync` naming the step (chained to the error raised where it synchronised)."""
    out = model(input_ids=ids, attention_mask=mask, logits_to_keep=1, **{CACHE_KWARG: cache})
    logits = [out.logits[:, -1].float()]
    tokens = [logits[-1].argmax(-1, keepdim=True)]
    ones = mask.new_ones((mask.shape[0], 1))
    if strict_syncs:
        torch.cuda.synchronize()
    step = 0
    try:
        with no_host_syncs(strict_syncs):
            for step in range(1, new_tokens):
                mask = torch.cat([mask, ones], dim=1)
                out = model(input_ids=tokens[-1], attention_mask=mask, logits_to_keep=1, **{CACHE_KWARG: cache})
                logits.append(out.logits[:, -1].float())
                tokens.append(logits[-1].argmax(-1, keepdim=True))
    except RuntimeError as error:
        if strict_syncs and "synchroniz" in str(error).lower():
            raise HostSync(f"host-device sync in decode step {step} (of {new_tokens - 1}): {error}") from error
        raise
    return torch.cat(tokens, 1).cpu(), torch.stack(logits, 1).cpu()


def reference_selector(mode: str) -> str:
    """The selector of `SparseCache` that `mode` must match: its own, else the model's."""
    return MODE_SELECTOR.get(mode, MODEL_SELECTOR)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    rows, cols = torch.nonzero(a != b, as_tuple=True)
    if len(cols) == 0:
        return "none"
    step = int(cols.min())
    return f"first at new token {step} (rows {sorted(set(rows[cols == step].tolist()))})"


def compare_modes(model, ids, mask, modes, new_tokens: int, strict_syncs: bool, reference_cache: dict | None = None):
    """Run every mode and check its tokens (exact) and logits (1e-4 relative, fp32) against
    `SparseCache` with the same selector; the references are computed once per selector (kept in
    `reference_cache` when given).  Returns {mode: OffloadedSparseCache}."""
    refs = {} if reference_cache is None else reference_cache
    caches = {}
    for mode in modes:
        selector = reference_selector(mode)
        if selector not in refs:
            refs[selector] = greedy_decode(model, ids, mask, SparseCache(model.config, selector=selector), new_tokens)
        ref_tokens, ref_logits = refs[selector]
        cache = OffloadedSparseCache.for_model(model, mode=mode)
        tokens, logits = greedy_decode(model, ids, mask, cache, new_tokens, strict_syncs=strict_syncs)
        assert torch.equal(tokens, ref_tokens), (
            f"{mode}: tokens differ from SparseCache(selector={selector!r}), {first_difference(tokens, ref_tokens)}"
        )
        err = rel(logits, ref_logits)
        assert err < 1e-4, f"{mode}: logits relative error {err:.3g} against SparseCache(selector={selector!r})"
        caches[mode] = cache
    return caches


# -- CUDA ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_models():
    """{policy: tiny forecast-selector model on CUDA}, fp32, TF32 off (exact comparisons)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield {policy: tiny_model({"policy": policy, "selector": MODEL_SELECTOR}, seed=3).cuda() for policy in POLICIES}
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@pytest.fixture(scope="module")
def cuda_references():
    """{policy: {selector: (tokens, logits)}}, filled by the first test of each policy."""
    return {policy: {} for policy in POLICIES}


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_cuda_mode_matches_sparse_cache_without_host_syncs(policy, mode, cuda_models, cuda_references):
    """Tokens equal; no step syncs.  On a sync the mode is run again without the check, so the
    failure also says whether its tokens are right."""
    model = cuda_models[policy]
    ids, mask = (t.cuda() for t in left_padded(LENGTHS))
    refs = cuda_references[policy]
    try:
        caches = compare_modes(model, ids, mask, [mode], NEW_TOKENS, strict_syncs=True, reference_cache=refs)
    except HostSync as sync:
        try:
            compare_modes(model, ids, mask, [mode], NEW_TOKENS, strict_syncs=False, reference_cache=refs)
            parity = "without the sync check its tokens and logits equal SparseCache's"
        except AssertionError as error:
            parity = f"without the sync check it fails too: {error}"
        raise AssertionError(f"{mode}: {sync}\n{parity}") from sync
    stats = caches[mode].stats()
    assert stats["decode_steps"] == NEW_TOKENS - 1
    if mode != "no-offload":
        assert stats["h2d_bytes_per_step_mean"] > 0  # blocks (or whole layers) really moved


# -- CPU: the loop itself --------------------------------------------------------------------------


def test_greedy_decode_gives_generate_tokens_on_cpu():
    """`greedy_decode` (the loop the CUDA test runs) gives `model.generate`'s tokens and logits on a
    left-padded batch, and `compare_modes` passes an offloaded mode against that reference."""
    model = tiny_model({"policy": "nosa", "selector": MODEL_SELECTOR}, seed=3)
    ids, mask = left_padded(LENGTHS)
    new_tokens = 8
    with torch.no_grad():
        ref = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
            **{CACHE_KWARG: SparseCache(model.config)},
        )
    tokens, logits = greedy_decode(model, ids, mask, SparseCache(model.config), new_tokens)
    assert torch.equal(tokens, ref.sequences[:, ids.shape[1] :])
    assert rel(logits, torch.stack(ref.logits, 1)) < 1e-5
    caches = compare_modes(
        model,
        ids,
        mask,
        ["forecast-offload"],
        new_tokens,
        strict_syncs=False,
        reference_cache={MODEL_SELECTOR: (tokens, logits)},
    )
    assert caches["forecast-offload"].stats()["decode_steps"] == new_tokens - 1
