"""Host bytes of one document with many questions on the paged host tier: a batch of N questions over
one prefilled document (`cache.fork_batch(N)`: every full block shared) against one sequence.

In one run, on the bundled SmolLM2 (sparse preset) with an ~8K-token document (8192 positions with
the questions and answers, SmolLM2's limit):

1. the document is prefilled once into an `OffloadedSparseCache`;
2. one sequence: a fresh cache holding a copy of the document (`fill.copy_into`, no second
   prefill, no sharing) answers question 0; its `host_nbytes()` is the unit;
3. the batch: `fork_batch(N)` of the prefilled cache answers the N questions as one batch (each
   question right-aligned after padding); its `host_nbytes()` counts every block of the pools it
   lives in once (the document, the batch's tails and answers);
4. check: each question answered alone from a `fork()` gives the batch's tokens.

Reported: both byte counts, the ratio (goal: <= 1.3 at N = 8), what N unshared sequences would
pin (N x one sequence), and whether the tokens agree.

    PYTHONPATH=. python benchmarks/context_share.py [--length 8192] [--questions 8] [--new-tokens 4]
        [--mode sparse-offload] [--output benchmarks/results/context_share_cpu.md]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prefill import prompt_ids  # noqa: E402

QUESTIONS = [
    "What is the main argument of the essay above?",
    "Which example does the author use first?",
    "Summarise the second paragraph in one sentence.",
    "Who is the intended reader?",
    "What does the author recommend doing next?",
    "Name one claim the author doubts.",
    "Which word best describes the tone?",
    "What would the author say to a beginner?",
    "How does the essay end?",
    "What question does the essay leave open?",
    "Give the essay a short title.",
    "What is one thing the author admits not knowing?",
]


def generate(model, ids, mask, cache, new_tokens):
    import torch

    from forecastkv.modeling.modeling import CACHE_KWARG

    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **{CACHE_KWARG: cache},
        )  # no early end of sequence: equal lengths to compare
    return out[:, ids.shape[1] :]


def padded_batch(doc, questions):
    """[N, D + Q] ids and mask: the document, then each question right-aligned after padding."""
    import torch

    width = max(q.shape[1] for q in questions)
    ids = torch.zeros(len(questions), doc.shape[1] + width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[:, : doc.shape[1]], mask[:, : doc.shape[1]] = doc, 1
    for row, q in enumerate(questions):
        ids[row, ids.shape[1] - q.shape[1] :], mask[row, ids.shape[1] - q.shape[1] :] = q, 1
    return ids, mask


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--length", type=int, default=8192, help="positions in all: document + the longest question + the answer"
    )
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--mode", default="sparse-offload")
    parser.add_argument("--output", default=None, help="a Markdown report (and the JSON beside it)")
    args = parser.parse_args(argv)
    if not 1 <= args.questions <= len(QUESTIONS):
        raise ValueError(f"--questions must be in [1, {len(QUESTIONS)}], got {args.questions}")

    import torch
    from transformers import AutoTokenizer

    from forecastkv import ForecastKVForCausalLM, bundled_model_path
    from forecastkv.inference import OffloadedSparseCache
    from forecastkv.inference.fill import copy_into
    from forecastkv.modeling.modeling import CACHE_KWARG

    path = bundled_model_path("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(path)
    forecast = {"init": "next_query", "heads_per_group": 1} if "forecast" in args.mode else None
    model = ForecastKVForCausalLM.from_pretrained(path, sparse_config="smollm2-135m", forecast=forecast).eval()
    questions = [tokenizer("\n\n" + q, return_tensors="pt").input_ids for q in QUESTIONS[: args.questions]]
    doc = prompt_ids(tokenizer, args.length - max(q.shape[1] for q in questions) - args.new_tokens)

    start = time.perf_counter()
    source = OffloadedSparseCache.for_model(model, mode=args.mode)
    with torch.no_grad():
        model(input_ids=doc, **{CACHE_KWARG: source})
    prefill_s = time.perf_counter() - start

    one = OffloadedSparseCache.for_model(model, mode=args.mode)
    copy_into(source, one)  # the document's rows, stored unshared, without a second prefill
    single_ids = torch.cat([doc, questions[0]], 1)
    single_tokens = generate(model, single_ids, torch.ones_like(single_ids), one, args.new_tokens)
    one_bytes = one.host_nbytes()

    batch = source.fork_batch(args.questions)
    ids, mask = padded_batch(doc, questions)
    batch_tokens = generate(model, ids, mask, batch, args.new_tokens)
    batch_bytes = batch.host_nbytes()
    blocks = batch.host_blocks()

    alone = []
    for q in questions:
        alone_ids = torch.cat([doc, q], 1)
        alone.append(generate(model, alone_ids, torch.ones_like(alone_ids), source.fork(), args.new_tokens))
    tokens_equal = bool(torch.equal(torch.cat(alone), batch_tokens) and torch.equal(single_tokens, alone[0]))

    result = {
        "model": "smollm2-135m",
        "mode": args.mode,
        "document_tokens": doc.shape[1],
        "questions": args.questions,
        "question_tokens": [q.shape[1] for q in questions],
        "new_tokens": args.new_tokens,
        "prefill_s": round(prefill_s, 2),
        "one_sequence_host_bytes": one_bytes,
        "batch_host_bytes": batch_bytes,
        "ratio": batch_bytes / one_bytes,
        "unshared_batch_host_bytes": args.questions * one_bytes,
        "batch_blocks": blocks,
        "tokens_equal": tokens_equal,
    }
    report = render(result)
    print(report)
    if args.output:
        from forecastkv.atomic import write_text_atomic

        write_text_atomic(args.output, report)
        write_text_atomic(os.path.splitext(args.output)[0] + ".json", json.dumps(result, indent=2) + "\n")
    return result


def render(r: dict) -> str:
    gib = 2**30
    return "\n".join(
        [
            f"# One document, {r['questions']} questions: host bytes on the paged host tier",
            "",
            f"SmolLM2-135M ({r['mode']}, CPU), document of {r['document_tokens']} tokens "
            f"prefilled once ({r['prefill_s']} s), "
            f"questions of {min(r['question_tokens'])}-{max(r['question_tokens'])} tokens, "
            f"{r['new_tokens']} new tokens each.",
            "",
            "| cache | host bytes | GiB | x one sequence |",
            "|---|---:|---:|---:|",
            f"| one sequence (document + one question, unshared) | {r['one_sequence_host_bytes']} | "
            f"{r['one_sequence_host_bytes'] / gib:.3f} | 1.00 |",
            f"| batch of {r['questions']} over the shared document (`fork_batch`) | {r['batch_host_bytes']} | "
            f"{r['batch_host_bytes'] / gib:.3f} | {r['ratio']:.3f} |",
            f"| {r['questions']} unshared sequences ({r['questions']} x one, computed) | "
            f"{r['unshared_batch_host_bytes']} | "
            f"{r['unshared_batch_host_bytes'] / gib:.3f} | {r['questions']:.2f} |",
            "",
            f"Batch blocks (all layers): {r['batch_blocks']}.  Tokens of the batch equal each question answered alone "
            f"from a fork, and the unshared sequence's: {r['tokens_equal']}.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
