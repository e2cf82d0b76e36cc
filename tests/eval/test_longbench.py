"""LongBench v1 on the tiny fixture in the official JSONL format: loading, prompts, middle
truncation, per-task metrics, and clear errors for a bad directory."""

import json
import sys

import pytest

from forecastkv.errors import UserInputError
from forecastkv.eval import longbench
from forecastkv.eval.codec import ByteCodec

from .common import FIXTURES

DIR = FIXTURES / "longbench"


def test_rows_load_from_the_official_files():
    rows = longbench.load_rows("hotpotqa", DIR)
    assert [r["_id"] for r in rows] == ["hp0", "hp1"] and rows[1]["answers"] == ["Ada Lovelace", "Lovelace"]


def test_prompt_is_the_official_template():
    codec = ByteCodec(256)
    row = longbench.load_rows("hotpotqa", DIR)[0]
    ex = longbench.build_example("hotpotqa", row, 0, codec, 4096)
    text = codec.decode(ex.input_ids)
    assert text.startswith(
        "Answer the question based on the given passages. Only give me the answer and do not output any other words."
        "\n\nThe following are given passages.\nPassage 1:\nThe comet"
    )
    assert text.endswith("Question: Which city hosts the observatory where the comet was found?\nAnswer:")
    assert ex.max_new_tokens == 32 and ex.metric == "qa_f1" and ex.references == ["Graz"] and not ex.meta["truncated"]
    lcc = longbench.build_example("lcc", longbench.load_rows("lcc", DIR)[0], 0, codec, 1024)
    assert (
        codec.decode(lcc.input_ids)
        == "Please complete the code given below. \ndef add(a, b):\n    total = a + b\nNext line of code:\n"
    )


def test_middle_truncation_keeps_both_ends():
    assert longbench.middle_truncate(list(range(10)), 4) == [0, 1, 8, 9]
    assert longbench.middle_truncate(list(range(3)), 4) == [0, 1, 2]
    codec = ByteCodec(256)
    row = longbench.load_rows("hotpotqa", DIR)[1]
    ex = longbench.build_example("hotpotqa", row, 1, codec, 300, max_new_tokens=20)
    full = codec.encode(longbench.PROMPTS["hotpotqa"].format(**row))
    assert len(ex.input_ids) == 280 and ex.meta["truncated"]
    assert ex.input_ids == full[:140] + full[-140:]


def test_scoring_follows_the_task():
    codec = ByteCodec(256)
    trec = longbench.build_example("trec", longbench.load_rows("trec", DIR)[0], 0, codec, 1024)
    assert trec.metric == "classification" and "Country" in trec.all_classes
    # trec scores only the first line of the prediction
    assert longbench.prepare_prediction("trec", "\nCity\nIndividual") == "City"
    assert longbench.prepare_prediction("hotpotqa", "Graz\nAustria") == "Graz\nAustria"
    assert longbench.METRIC["passage_retrieval_en"] == "retrieval" and longbench.METRIC["lcc"] == "code_sim"
    assert longbench.METRIC["gov_report"] == "rouge_l"


def test_bad_directory_errors(tmp_path):
    with pytest.raises(UserInputError, match="does not exist"):
        longbench.check_directory(tmp_path / "nowhere", ["hotpotqa"])
    with pytest.raises(UserInputError, match=r"lacks \['qasper.jsonl'\]; it holds \['hotpotqa.jsonl'"):
        (tmp_path / "hotpotqa.jsonl").write_text((DIR / "hotpotqa.jsonl").read_text())
        longbench.check_directory(tmp_path, ["hotpotqa", "qasper"])
    with pytest.raises(UserInputError, match="unknown LongBench task 'hotpot'"):
        longbench.load_rows("hotpot", DIR)
    (tmp_path / "musique.jsonl").write_text(json.dumps({"context": "c", "input": "q"}) + "\n")
    with pytest.raises(UserInputError, match=r"row 1 lacks the field\(s\) \['answers'\]"):
        longbench.load_rows("musique", tmp_path)
    (tmp_path / "trec.jsonl").write_text("{not json\n")
    with pytest.raises(UserInputError, match="trec.jsonl line 1 is not JSON"):
        longbench.load_rows("trec", tmp_path)


def test_without_a_directory_datasets_is_needed(monkeypatch):
    # as on a machine without `datasets` (the GPU test machine; lm-eval installs it here), whether
    # or not it is installed: the hub path itself would need the network
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(UserInputError, match=r"official JSONL files \(longbench.dir\) or the `datasets` package"):
        longbench.load_rows("hotpotqa", None)
