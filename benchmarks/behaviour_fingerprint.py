"""A fingerprint of what the model computes in every cache x selector x policy, to hold a refactor to
"behaviour unchanged" byte for byte:

    python benchmarks/behaviour_fingerprint.py --json before.json      # on the old commit
    python benchmarks/behaviour_fingerprint.py --json after.json       # on the new one
    python benchmarks/behaviour_fingerprint.py --compare before.json after.json

Each cell is a tiny random 3-layer model (Forecast heads, kernel 4/2, blocks of 8) prefilling a 150-token
batch of two left-padded prompts, then decoding 10 tokens greedily by hand (what generate() does) in
one cache: `SparseCache` (resident) or `OffloadedSparseCache` in each mode that can run the selector.
A cell records the sha256 of the bytes of every step's logits, the greedy tokens, and for an
offloaded cache the H2D bytes of each decode step.  A cell the build refuses records its error's type.
Selectors and modes are read from `forecastkv.modes`, so a new selector adds cells, not changes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch

POLICIES = ("infllmv2", "nosa")
NEW_TOKENS = 10


def build(policy: str, selector: str, heads_per_group: int = 1, top_p: float | None = None):
    """The tiny model of the cell (seed 0), NOSA's A drawn from N(0, 1) so its bias matters."""
    from forecastkv import ForecastKVConfig, ForecastKVForCausalLM

    sparse = dict(kernel_size=4, kernel_stride=2, block_size=8, init_blocks=1, window_size=8, topk=4,
                  dense_len=0, query_blocks=2, selector=selector, policy=policy, reuse_anchors=[0])
    if top_p is not None:
        sparse["top_p"] = top_p
    config = ForecastKVConfig(
        vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, query_chunk_size=16,
        bos_token_id=None, eos_token_id=None, sparse_config=sparse,
        forecast={"enabled": True, "heads_per_group": heads_per_group},
    )
    torch.manual_seed(0)
    model = ForecastKVForCausalLM(config).eval()
    if policy == "nosa":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.A.normal_()
    return model


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 150 and 113 tokens, left-padded: ids [2, 150], mask [2, 150]."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (2, 150), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    return ids.masked_fill(mask == 0, 0), mask


@torch.no_grad()
def run_cell(model, cache) -> dict:
    """Prefill and NEW_TOKENS greedy steps in `cache`: the digest of all logits, the tokens, H2D bytes."""
    ids, mask = prompts()
    digest = hashlib.sha256()
    out = model(ids, attention_mask=mask, cache=cache)
    tokens = []
    for _ in range(NEW_TOKENS):
        logits = out.logits[:, -1].float()
        digest.update(logits.numpy().tobytes())
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token[:, 0].tolist())
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        out = model(token, attention_mask=mask, cache=cache)
    cell = {"logits_sha256": digest.hexdigest(), "tokens": tokens}
    if hasattr(cache, "mode"):  # an OffloadedSparseCache
        cell["h2d_bytes_per_step"] = cache.stats()["h2d_bytes_per_step"]
    return cell


def cells():
    """(name, make_model, make_cache) of every cell."""
    from forecastkv.inference import OffloadedSparseCache
    from forecastkv.modeling.cache import SparseCache
    from forecastkv.modes import MODES, SELECTORS

    for policy in POLICIES:
        for selector in SELECTORS:
            variants = [("", {})]
            if selector in ("forecast", "query"):
                variants.append(("/n3", {"heads_per_group": 3}))
            if policy == "infllmv2":  # NOSA fills a fixed budget
                variants.append(("/top_p", {"top_p": 0.3}))
            for suffix, options in variants:
                make = lambda p=policy, s=selector, o=options: build(p, s, **o)  # noqa: E731
                yield f"{policy}/{selector}{suffix}/resident", make, lambda m: SparseCache(m.config)
                for mode in MODES:
                    yield (f"{policy}/{selector}{suffix}/{mode}", make,
                           lambda m, mode=mode, s=selector: OffloadedSparseCache.for_model(m, mode=mode, selector=s))


def fingerprint() -> dict:
    result = {}
    for name, make_model, make_cache in cells():
        model = make_model()
        try:
            cache = make_cache(model)
        except (ValueError, TypeError) as error:
            result[name] = {"refused": type(error).__name__}
            continue
        result[name] = run_cell(model, cache)
        print(name, result[name]["logits_sha256"][:12], file=sys.stderr)
    return result


def compare(before: dict, after: dict) -> int:
    """Print the cells that differ, are gone or are new; 0 when every old cell is unchanged."""
    changed = [name for name in before if name in after and before[name] != after[name]]
    gone = [name for name in before if name not in after]
    new = [name for name in after if name not in before]
    print(f"{len(before)} cells before, {len(after)} after: {len(before) - len(changed) - len(gone)} equal, "
          f"{len(changed)} changed, {len(gone)} gone, {len(new)} new")
    for name in changed:
        print("changed", name, before[name], after[name])
    for name in gone:
        print("gone", name)
    for name in new:
        print("new", name, "refused" if "refused" in after[name] else "runs")
    return 1 if changed or gone else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the fingerprint here")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two fingerprints")
    args = parser.parse_args(argv)
    if args.compare:
        with open(args.compare[0]) as f, open(args.compare[1]) as g:
            return compare(json.load(f), json.load(g))
    torch.set_num_threads(1)  # one thread: the same reduction order on every run
    result = fingerprint()
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.json:
        from forecastkv.atomic import write_text_atomic

        write_text_atomic(args.json, text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
