"""The selector study's engine (`forecastkv.eval.study`) on a tiny random model: byte tokens, 3 layers,
blocks of 16 (one init block, a one-block window: 3 forced blocks), a 4-token tail."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from forecastkv.errors import ConfigError
from forecastkv.eval import study
from forecastkv.eval.codec import ByteCodec
from forecastkv.kernels import use_backend
from forecastkv.modes import SELECTORS
from tests.helpers import tiny_config, tiny_model

GEOMETRY = dict(kernel_size=8, kernel_stride=4, block_size=16, window_size=16, topk=4)
SMALL = dict(
    lengths=[320, 512],
    selectors=list(SELECTORS),
    budgets=[4, 8],
    top_p=[0.3, 0.9],
    tail_tokens=4,
    needle_task="passkey",
    reuse_anchors=[0, 2],
)


def small_model():
    return tiny_model(mode=GEOMETRY)


@pytest.fixture(scope="module", autouse=True)
def one_thread_reference_kernels():
    """The study as a CPU run makes it: the PyTorch reference kernels (the suite's TRITON_INTERPRET
    would run Triton's interpreter), one thread (tiny ops on a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with use_backend("reference"):
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """The small study, once: (records, output path, seconds)."""
    out = tmp_path_factory.mktemp("study") / "records.json"
    began = time.perf_counter()
    records = study.run_study(small_model(), ByteCodec(128), SMALL, out=out)
    return records, out, time.perf_counter() - began


def by(records, **match):
    return [r for r in records if all(r[k] == v for k, v in match.items())]


def test_small_study_records_every_cell_with_every_field(small_run):
    records, out, seconds = small_run
    assert seconds < 60, f"the small study took {seconds:.1f} s"
    per_length = 1 + len(SELECTORS) * (len(SMALL["budgets"]) + len(SMALL["top_p"]))
    assert len(records) == 2 * per_length
    assert [r["length"] for r in records] == [320] * per_length + [512] * per_length
    assert json.loads(out.read_text()) == records  # the file holds exactly what was returned
    for r in records:
        assert set(r) == set(study.RECORD_FIELDS), r["key"]
        assert r["skipped"] is None and r["tail_tokens"] == 4 and r["seconds"] > 0
        assert r["context_blocks"] == math.ceil(r["length"] / 16)
        assert r["budget_tokens"] == r["budget_blocks"] * 16
        assert r["budget_share"] == pytest.approx(r["budget_blocks"] / r["context_blocks"])
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1
        assert 0.0 <= r["needle_accuracy"] <= 1.0
    for r in by(records, budget_kind="top_p"):
        assert r["budget_blocks"] == max(SMALL["budgets"]) and r["p"] in SMALL["top_p"]
    for r in by(records, budget_kind="blocks"):
        assert r["topk"] == r["budget_blocks"] - 1 and r["p"] is None  # one local block
    reuse = by(records, selector="reuse")
    assert all(r["anchors"] == [0, 2] and r["anchors_source"] == "spec" for r in reuse)
    assert all(r["anchors"] is None for r in records if r["selector"] != "reuse")


def test_dense_is_the_reference(small_run):
    records, _, _ = small_run
    for length in SMALL["lengths"]:
        (dense,) = by(records, length=length, selector="dense")
        assert dense["ppl_ratio"] == 1.0 and dense["budget_share"] == 1.0 and dense["prefill_s"] > 0
        assert dense["recall_mass"] is None and dense["prefetch"] is None
        for r in by(records, length=length):
            assert r["ppl_ratio"] == pytest.approx(r["ppl"] / dense["ppl"], rel=1e-12)


def test_oracle_recall_is_one_at_every_budget(small_run):
    records, _, _ = small_run
    oracle = by(records, selector="oracle")
    assert len(oracle) == 8  # 2 lengths x (2 fixed budgets + 2 top-p values)
    for r in oracle:
        # 4 steps x 2 layers >= 1 x 2 KV heads, every row selective (20 or 32 blocks seen, cap 8)
        assert r["recall_rows"] == r["recall_rows_all"] == 16
        assert r["recall_mass"] == pytest.approx(1.0, abs=1e-5) and r["overlap"] == pytest.approx(1.0)
    query = by(records, selector="query", budget_kind="blocks", budget_blocks=4)
    assert any(r["recall_mass"] < 0.999 for r in query)  # a real selector misses some of the oracle's mass


def test_top_p_rows_are_compared_with_the_oracle_of_their_own_size():
    """RecallMeter's rule against a plain loop: a row that selected k blocks is scored against the
    k blocks of most mass; only rows that see more blocks than the cap count as selective."""
    meter = study.RecallMeter(small_model(), budget=3, top_p=True)
    torch.manual_seed(3)
    mass = torch.rand(1, 2, 1, 6).softmax(-1)  # 2 KV heads, one row at position 80: blocks 0..5 visible
    ids = torch.tensor([[[[0, 2, -1]], [[1, 3, 5]]]])  # head 0 took 2 blocks, head 1 took 3
    meter._add_rows(ids, mass, torch.tensor([[80]]))
    expected = []
    for h in range(2):
        chosen = [j for j in ids[0, h, 0].tolist() if j >= 0]
        best = sorted(mass[0, h, 0].tolist(), reverse=True)[: len(chosen)]
        expected.append(sum(mass[0, h, 0, j].item() for j in chosen) / sum(best))
    result = meter.result()
    assert result["recall_rows"] == 2
    assert result["recall_mass"] == pytest.approx(sum(expected) / 2, rel=1e-6)


def test_top_p_selects_fewer_blocks_than_its_cap_and_more_with_p(small_run):
    records, _, _ = small_run
    for selector in ("query", "quest", "speculate", "oracle"):
        for length in SMALL["lengths"]:
            low, high = (by(records, selector=selector, length=length, p=p)[0] for p in SMALL["top_p"])
            assert low["selected_blocks"] <= high["selected_blocks"] <= 8
            fixed = by(records, selector=selector, length=length, budget_blocks=8, budget_kind="blocks")[0]
            assert fixed["selected_blocks"] == pytest.approx(8.0)  # every row sees >= 8 blocks
            assert low["selected_blocks"] < 8, (selector, length, low["selected_blocks"])


def test_offloaded_bytes_and_hits(small_run):
    records, _, _ = small_run
    for r in records:
        if r["selector"] == "oracle":
            assert r["offload_mode"] is None and "refuses" in r["offload_note"] and r["h2d_bytes_per_step"] is None
            continue
        assert r["h2d_bytes_per_step"] > 0 and r["h2d_cold_bytes"] > 0, r["key"]
        if r["selector"] == "dense":
            assert r["offload_mode"] == "dense-offload" and r["hit_rate"] is None
        else:
            assert 0.0 <= r["hit_rate"] <= 1.0
            ahead = r["selector"] in (
                "forecast", "reuse", "speculate", "quest-forecast", "maxkey-forecast", "forecast-carry",
                "quest-forecast-carry", "forecast-carry-pin", "quest-forecast-carry-pin",
            )
            assert r["prefetch"] is ahead and r["offload_mode"] == ("forecast-offload" if ahead else "sparse-offload")
    for selector in ("dense", *(s for s in SELECTORS if s != "oracle")):
        checked = [r for r in by(records, selector=selector) if r["offload_max_diff"] is not None]
        assert checked and all(r["offload_max_diff"] <= study.OFFLOAD_TOLERANCE for r in checked), selector


def test_every_selector_recalls_everything_when_the_budget_covers_every_block():
    model = small_model()
    spec = dict(SMALL, lengths=[256], budgets=[16], top_p=[], needle=False, offload=False)
    records = study.run_study(model, ByteCodec(128), spec)
    assert [r["selector"] for r in records] == ["dense", *SELECTORS]
    for r in records[1:]:
        assert r["recall_rows"] == 0 and r["recall_mass"] is None  # no row sees more than 16 blocks
        assert r["recall_rows_all"] == 16
        assert r["recall_mass_all"] == pytest.approx(1.0, abs=1e-5) and r["overlap_all"] == pytest.approx(1.0)
        assert r["needle_accuracy"] is None and r["offload_mode"] is None


def test_a_rerun_resumes_from_the_output_file(small_run, monkeypatch, tmp_path):
    records, out, _ = small_run
    copy = tmp_path / "records.json"
    copy.write_text(out.read_text())

    def refuse(*args, **kwargs):
        raise AssertionError("a finished cell was measured again")

    monkeypatch.setattr(study, "dense_prefill", refuse)
    monkeypatch.setattr(study, "measure_cell", refuse)
    assert study.run_study(small_model(), ByteCodec(128), SMALL, out=copy) == records
    # another tail is another protocol: its cells are measured, not read back
    with pytest.raises(AssertionError, match="measured again"):
        study.run_study(small_model(), ByteCodec(128), dict(SMALL, tail_tokens=5), out=copy)


def test_forecast_is_skipped_with_its_reason_without_heads():
    from forecastkv import ForecastKVForCausalLM

    torch.manual_seed(0)
    model = ForecastKVForCausalLM(tiny_config(sparse_config={**tiny_model_sparse(), **GEOMETRY})).eval()
    spec = dict(SMALL, lengths=[256], selectors=["forecast", "query"], budgets=[4], top_p=[], needle=False)
    dense, forecast, query = study.run_study(model, ByteCodec(128), spec)
    assert forecast["skipped"].startswith("the model has no Forecast heads") and forecast["ppl"] is None
    assert query["skipped"] is None and query["ppl"] > 1 and query["heads"] is None


def tiny_model_sparse() -> dict:
    from tests.helpers import TINY_SPARSE

    return dict(TINY_SPARSE)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"lengths": []}, "at least one length"),
        ({"lengths": [512, "1024"]}, "integers >= 2"),
        ({"lengths": [4]}, "exceed tail_tokens"),
        ({"selectors": ["query", "nope"]}, "distinct names"),
        ({"selectors": ["query", "query"]}, "distinct names"),
        ({"budgets": [0]}, "integers >= 1"),
        ({"budgets": [8, 8]}, "must not repeat"),
        ({"top_p": [0.0]}, r"\(0, 1\]"),
        ({"top_p": [1.5]}, r"\(0, 1\]"),
        ({"budgets": [], "top_p": [0.9]}, "cap is the largest"),
        ({"budgets": [], "top_p": []}, "no cell"),
        ({"tail_tokens": 0}, "tail_tokens must be an integer >= 1"),
        ({"needle": "yes"}, "needle must be true or false"),
        ({"needle_task": "cwe"}, "needle_task 'cwe'"),
        ({"reuse_anchors": [1, 2]}, "must hold layer 0"),
        ({"anchor_count": 0}, "anchor_count"),
        ({"seed": -1}, "seed"),
        ({"colour": "red"}, "unknown study spec key"),
    ],
)
def test_bad_spec_values_are_config_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        study.run_study(small_model(), ByteCodec(128), dict(SMALL, **change))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"budgets": [3]}, "3 forced blocks"),
        ({"lengths": [1024]}, "max_position_embeddings=512"),
        ({"reuse_anchors": [0, 3]}, "below 3"),
    ],
)
def test_spec_checked_against_the_model(change, message):
    with pytest.raises(ConfigError, match=message):
        study.run_study(small_model(), ByteCodec(128), dict(SMALL, **change))


def test_reuse_anchors_are_chosen_on_the_essays_when_the_spec_names_none():
    spec = dict(SMALL, lengths=[320], selectors=["reuse"], budgets=[4], top_p=[], reuse_anchors=None, anchor_count=2)
    dense, reuse = study.run_study(small_model(), ByteCodec(128), spec)
    assert reuse["anchors"][0] == 0 and len(reuse["anchors"]) == 2 and reuse["anchors"] == sorted(reuse["anchors"])
    assert reuse["anchors_source"] == (
        "chosen by eval.reuse_anchors.choose_anchors: 2 anchors at length 320, budget 4 blocks"
    )
    assert dense["anchors"] is None
