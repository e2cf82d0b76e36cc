"""lm-evaluation-harness: `--model forecastkv` scores what `forecastkv eval` scores, per mode.

The tasks are local JSONL files with lm-eval task YAMLs (tests/fixtures/lm_eval), read offline.
Like for like:
  * generate_until (a pass key in ~400 tokens): lm-eval's prompt, tokenised as lm-eval does, is
    one `eval.tasks.Example` scored by `eval.evaluate.evaluate_example` in the same mode (greedy,
    stop at EOS, same max new tokens, one prefill call as generate() makes): the prediction text,
    the string_match_all score and, offloaded, the decode steps and H2D bytes are equal;
  * multiple_choice: lm-eval's loglikelihood of each choice is minus the sum of the per-token NLL
    `evaluate_example` computes for its perplexity items (teacher forcing, one bucket per token)
    over the choice's tokens, in the same attention mode on the resident cache (lm-eval's
    loglikelihood runs one forward; the offload mode does not change it): equal to 1e-4, and so
    is the argmax (acc).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from forecastkv import ForecastKVForCausalLM  # noqa: E402
from forecastkv.eval.codec import TextCodec  # noqa: E402
from forecastkv.eval.evaluate import evaluate_example  # noqa: E402
from forecastkv.eval.modes import Mode, attending_with  # noqa: E402
from forecastkv.eval.tasks import Example  # noqa: E402
from forecastkv.lm_eval import CacheCounters, ForecastKVLM, forecast_request  # noqa: E402
from forecastkv.modeling.configuration import load_preset  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "lm_eval"
TASKS = ["forecastkv_passkey", "forecastkv_choice"]
MAX_NEW_TOKENS = 6  # the passkey YAML's max_gen_toks: a space and the five digits
# SmolLM2's preset scaled down so that ~400-token prompts are sparse: 6 of ~27 blocks per row
SMALL_SPARSE = {
    **load_preset("smollm2-135m")["sparse_config"],
    "kernel_size": 16,
    "kernel_stride": 8,
    "block_size": 16,
    "window_size": 32,
    "topk": 4,
    "query_blocks": 2,
}
# name -> (lm-eval model args besides pretrained, forecastkv eval mode of generation, of loglikelihood)
MODES = {
    "dense": ({}, Mode("dense"), Mode("dense")),
    "sparse": ({"sparse_config": SMALL_SPARSE}, Mode("infllmv2-query"), Mode("infllmv2-query")),
    "forecast-offload": (
        {"sparse_config": SMALL_SPARSE, "offload": "forecast-offload"},
        Mode("infllmv2-forecast", "forecast-offload"),
        Mode("infllmv2-forecast"),
    ),
    # a selector beyond the mode's own (`selector=`): the layer-ahead rule the quality suite recommends
    "forecast-carry-pin": (
        {"sparse_config": SMALL_SPARSE, "offload": "forecast-offload", "selector": "forecast-carry-pin"},
        Mode("infllmv2-forecast-carry-pin", "forecast-offload"),
        Mode("infllmv2-forecast-carry-pin"),
    ),
}


def _run_lm_eval(model_args: dict) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="forecastkv",
        model_args={"pretrained": "bundled:smollm2-135m", **model_args},
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(FIXTURES), include_defaults=False),
        limit=2,
        batch_size=1,
        log_samples=True,
        bootstrap_iters=0,
    )


@pytest.fixture(autouse=True)
def reference_kernels():
    """Both sides on the kernels' PyTorch references: the Triton kernels are checked against them
    in tests/kernels, and the interpreter would make every offloaded decode step take seconds."""
    from forecastkv import kernels

    with kernels.use_backend("reference"):
        yield


@pytest.fixture(scope="module")
def eval_side(bundled_path):
    """(model, tokenizer) of the forecastkv eval side: one model serves every mode (`attending_with`);
    its next_query heads are the ones lm-eval's forecast-offload run creates (a deterministic init)."""
    from transformers import AutoTokenizer

    model = ForecastKVForCausalLM.from_pretrained(
        bundled_path, sparse_config=SMALL_SPARSE, forecast={"init": "next_query"}
    )
    return model, AutoTokenizer.from_pretrained(bundled_path)


@pytest.mark.slow
@pytest.mark.bundled
@pytest.mark.parametrize("name", list(MODES))
def test_simple_evaluate_scores_equal_forecastkv_eval(name, eval_side, monkeypatch):
    monkeypatch.chdir(REPO)  # the YAMLs' data_files are relative to the repository root
    model_args, generate_mode, loglikelihood_mode = MODES[name]
    results = _run_lm_eval(model_args)
    info = results["config"]["forecastkv"]
    model, tokenizer = eval_side
    codec = TextCodec(tokenizer)
    assert info["attention"] == ("dense" if not generate_mode.sparse else f"infllmv2-{generate_mode.selector}")

    passkey = results["samples"]["forecastkv_passkey"]
    assert len(passkey) == 2
    steps = step_bytes = 0
    for i, sample in enumerate(passkey):
        ((prompt, gen_kwargs),) = sample["arguments"]
        ids = tokenizer(prompt)["input_ids"]  # what lm-eval's tok_batch_encode gives (batch of one)
        example = Example(
            "passkey",
            len(ids) + MAX_NEW_TOKENS,
            i,
            ids,
            sample["doc"]["references"],
            "string_match_all",
            MAX_NEW_TOKENS,
        )
        with attending_with(model, generate_mode):
            ours = evaluate_example(model, example, generate_mode, codec, prefill_chunk=4096, recall="none")
        assert sample["filtered_resps"][0] == ours["prediction"], (name, i)
        assert sample["string_match_all"] == ours["score"], (name, i)
        if ours["h2d_bytes_per_step"] is not None:
            steps += ours["decode_steps"]
            step_bytes += ours["h2d_bytes_per_step"] * ours["decode_steps"]

    choice = results["samples"]["forecastkv_choice"]
    assert len(choice) == 2
    for i, sample in enumerate(choice):
        ours_ll = []
        for context, continuation in sample["arguments"]:
            whole = tokenizer(context + continuation)["input_ids"]
            start = len(tokenizer(context)["input_ids"])  # lm-eval's _encode_pair (no trailing spaces here)
            example = Example("choice", len(whole), i, whole, [], "perplexity", 0)
            with attending_with(model, loglikelihood_mode):
                buckets = evaluate_example(
                    model, example, loglikelihood_mode, codec, prefill_chunk=4096, bucket_tokens=1, recall="none"
                )["buckets"]
            ours_ll.append(-sum(b["nll_sum"] for b in buckets[start - 1 :]))  # bucket k: NLL of token k + 1
        theirs_ll = [ll for ll, _ in sample["filtered_resps"]]
        assert theirs_ll == pytest.approx(ours_ll, abs=1e-4), (name, i)
        assert sample["acc"] == float(max(range(len(ours_ll)), key=ours_ll.__getitem__) == sample["target"]), (name, i)

    cache = info["cache"]
    assert cache["generate_calls"] == 2
    if generate_mode.cache == "forecast-offload":
        assert info["selector"] == generate_mode.selector
        # the offload counters are in the results, and they are what forecastkv eval measured
        assert (
            info["offload"] == "forecast-offload"
            and info["forecast"]["init"] == "next_query"
            and "forecast_heads" in info
        )
        assert cache["decode_steps"] == steps == 2 * (MAX_NEW_TOKENS - 1)
        assert cache["h2d_step_bytes"] == pytest.approx(step_bytes)
        assert cache["h2d_bytes_per_step"] > 0 and 0 <= cache["hit_rate"] <= 1
        assert cache["device_nbytes_max"] > 0 and cache["host_nbytes_max"] > 0
    else:
        assert cache["cache"] == "resident"
        if generate_mode.sparse:
            assert cache["decode_steps"] == 2 * (MAX_NEW_TOKENS - 1) and 0 < cache["block_share"] < 1
        else:  # SparseCache.stats() counts sparse decode steps only
            assert cache["decode_steps"] == 0 and cache["block_share"] is None


@pytest.mark.slow
@pytest.mark.bundled
def test_cli_runs_the_readme_command(bundled_path, tmp_path):
    """`forecastkv lm-eval ...` as the README writes it (from the repository root), results on disk."""
    command = [
        sys.executable,
        "-m",
        "forecastkv.cli",
        "lm-eval",
        "--model",
        "forecastkv",
        "--model_args",
        "pretrained=bundled:smollm2-135m,sparse_config=smollm2-135m,offload=forecast-offload",
        "--tasks",
        "forecastkv_passkey",
        "--include_path",
        "tests/fixtures/lm_eval",
        "--limit",
        "2",
        "--output_path",
        str(tmp_path / "out"),
    ]
    # as a user runs it on a CPU: the kernels' PyTorch references, not the Triton interpreter the tests set
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FORECASTKV_BACKEND")},
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "forecastkv_passkey" in done.stdout and "string_match_all" in done.stdout
    written = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    cache = written["config"]["forecastkv"]["cache"]
    assert cache["cache"] == "forecast-offload" and cache["decode_steps"] > 0 and cache["h2d_bytes_per_step"] > 0
    assert "forecastkv: cache counters (forecast-offload: " in done.stderr


# -- fast: arguments and counters ------------------------------------------------------------------


def test_bad_model_arguments_are_named_before_loading():
    with pytest.raises(ValueError, match=r"offload='everywhere' is not an offload mode; choose one of \('no-offload'"):
        ForecastKVLM(pretrained="/nonexistent", offload="everywhere")
    with pytest.raises(ValueError, match=r"unknown model_args \['sparse_confg'\] for --model forecastkv"):
        ForecastKVLM(pretrained="/nonexistent", sparse_confg="smollm2-135m")
    with pytest.raises(ValueError, match=r"selector='bogus', offload=None: selector='bogus' is not None or one of"):
        ForecastKVLM(pretrained="/nonexistent", selector="bogus")
    with pytest.raises(ValueError, match=r"mode 'forecast-offload' fetches blocks a layer ahead, but the 'quest'"):
        ForecastKVLM(pretrained="/nonexistent", selector="quest", offload="forecast-offload")
    with pytest.raises(ValueError, match=r"the oracle selector reads every key of every layer"):
        ForecastKVLM(pretrained="/nonexistent", selector="oracle", offload="sparse-offload")
    assert forecast_request('{"heads_per_group": 2}', "kaiming") == {"heads_per_group": 2, "init": "kaiming"}
    assert forecast_request(None, None) is None
    with pytest.raises(ValueError, match="forecast='heads' is not a JSON object"):
        forecast_request("heads", None)


def test_cache_counters_sum_every_generate_call():
    """Two offloaded generate() calls: the summary is the sum of the two caches' stats()."""
    from forecastkv.inference import OffloadedSparseCache
    from forecastkv.modeling.modeling import CACHE_KWARG
    from tests.helpers import tiny_model

    model = tiny_model({"selector": "forecast"})
    counters, stats = CacheCounters("forecast-offload"), []
    for seed, length in ((0, 40), (1, 57)):
        ids = torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))
        cache = OffloadedSparseCache.for_model(model, mode="forecast-offload")
        with torch.no_grad():
            model.generate(ids, max_new_tokens=5, do_sample=False, **{CACHE_KWARG: cache})
        counters.add(cache)
        stats.append(cache.stats())
    summary = counters.summary()
    steps = sum(s["decode_steps"] for s in stats)
    assert summary["generate_calls"] == 2 and summary["decode_steps"] == steps == 8
    assert summary["h2d_step_bytes"] == sum(sum(s["h2d_bytes_per_step"]) for s in stats) > 0
    assert summary["h2d_bytes_per_step"] == summary["h2d_step_bytes"] / steps
    wanted = sum(sum(s["blocks_wanted_per_layer"][1:]) for s in stats)  # layer 0 stays resident
    hits = sum(sum(s["hits_per_layer"][1:]) for s in stats)
    assert wanted > 0 and summary["hit_rate"] == hits / wanted
    assert summary["host_nbytes_max"] == max(s["host_nbytes"] for s in stats)
    json.dumps(summary)  # plain numbers: lm-eval writes them into its results file
