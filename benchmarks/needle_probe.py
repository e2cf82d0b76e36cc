"""Where a selector loses the needle: per decode step and layer, the share of the true attention on the
needle's block(s) (the oracle's mass, per KV head), its rank among the row's blocks, and whether the
selector selected it.  The answer is teacher-forced (the rows dense would see), so a miss shows as a layer
whose heads put much of their attention on the needle's block while the selector left it out.

    python benchmarks/needle_probe.py --selector query --index 1 --out benchmarks/results/quality/needle_probe
    python benchmarks/needle_probe.py --selector query-carry --index 1 --out benchmarks/results/quality/needle_probe

The bundled SmolLM2-135M with its shipped Forecast heads; the quality suite's `niah_single_essay` example
`--index` of 50 at `--length` tokens (the suite's depths), a `--budget`-block budget.  Writes
OUT/<selector>_<length>_<index>.md (the rows with a head above `--threshold`) and .json (every row).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def probe(selector: str, length: int, index: int, budget: int, examples: int = 50) -> dict:
    from forecastkv.eval import suite
    from forecastkv.eval.codec import as_codec
    from forecastkv.eval.study import (
        Cell,
        ScoredSequence,
        StudySpec,
        cell_sparse_config,
        dense_prefill,
        load_study_model,
    )
    from forecastkv.eval.tasks import generate_example
    from forecastkv.inference.fill import copy_into
    from forecastkv.modeling.cache import SparseCache
    from forecastkv.modeling.routing import attending_with
    from forecastkv.selectors.oracle import oracle_block_mass

    model, tokenizer, _ = load_study_model(StudySpec(lengths=(length,), selectors=(selector,), budgets=(budget,)))
    codec = as_codec(tokenizer)
    example = generate_example(
        "niah_single_essay", codec, length, index=index, seed=0, depth=suite.example_depth(index, examples),
        max_new_tokens=32,
    )
    block = model.config.sparse.block_size
    start, end, _ = example.meta["needles"][0]
    needle = list(range(start // block, (end - 1) // block + 1))
    answer = codec.encode(" " + example.references[0])
    ids = torch.tensor([example.input_ids + answer])
    prefilled = dense_prefill(model, ScoredSequence(torch.tensor([example.input_ids]), 0))
    masses: dict = {}

    def on_layer(idx, normed, positions, cos, sin, cache_layer):  # the oracle's mass per block [H, NB]
        q = model.model.layers[idx].self_attn.queries(normed, cos, sin)
        keys, _, _, count = cache_layer.full()
        masses[idx] = oracle_block_mass(q, keys, positions, block, -(-count // block))[0, :, 0]

    rows, steps = [], []
    sparse = cell_sparse_config(model.config.sparse.to_dict(), Cell(selector, budget), (0,))
    with attending_with(model, sparse), torch.no_grad():
        cache = SparseCache(model.config)
        cache.reserve(ids.shape[1] + 1)
        copy_into(prefilled, cache)
        first = len(example.input_ids) - 1
        for step, t in enumerate(range(first, first + len(answer))):
            masses.clear()
            hidden, _, selections = model.model(ids[:, t : t + 1], cache=cache, collect_selections=True,
                                                layer_callback=on_layer)
            got = int(model.lm_head(hidden)[0, -1].argmax())
            steps.append({"step": step, "input": codec.decode([int(ids[0, t])]),
                          "wanted": codec.decode([int(ids[0, t + 1])]), "predicted": codec.decode([got])})
            for layer, mass in sorted(masses.items()):
                selected = selections[layer]["selected"][0, :, 0]  # [H, K]
                for j in needle:
                    share = mass[:, j]
                    rows.append({
                        "step": step, "layer": layer, "block": j, "mass": [round(float(m), 4) for m in share],
                        "oracle_rank": (mass > share.unsqueeze(-1)).sum(-1).tolist(),
                        "selected": (selected == j).any(-1).tolist(),
                    })
    return {"selector": selector, "length": length, "index": index, "budget": budget, "needle_blocks": needle,
            "needle": codec.decode(example.input_ids[start:end]), "steps": steps, "rows": rows}


def markdown(result: dict, threshold: float) -> str:
    lines = [
        f"# Needle probe: {result['selector']} at {result['budget']} blocks, {result['length']} tokens, "
        f"example {result['index']}",
        "",
        f"Needle {result['needle']!r} in block(s) {result['needle_blocks']}. Rows where a KV head puts more "
        f"than {threshold} of its attention on a needle block (oracle rank 0 = the row's heaviest block).",
        "",
    ]
    for step in result["steps"]:
        lines += [f"## step {step['step']}: input {step['input']!r}, wanted {step['wanted']!r}, "
                  f"predicted {step['predicted']!r}", "",
                  "| layer | block | mass per KV head | oracle rank | selected |", "|---|---|---|---|---|"]
        for row in result["rows"]:
            if row["step"] == step["step"] and max(row["mass"]) > threshold:
                lines.append(f"| {row['layer']} | {row['block']} | {row['mass']} | {row['oracle_rank']} | "
                             f"{['yes' if s else '**no**' for s in row['selected']]} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--selector", default="query")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--index", type=int, default=1)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--threshold", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/quality/needle_probe")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = probe(args.selector, args.length, args.index, args.budget)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{args.selector}_{args.length}_{args.index}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(markdown(result, args.threshold))
    print(f"wrote {stem}.md and .json")


if __name__ == "__main__":
    main()
