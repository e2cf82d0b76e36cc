"""Results on disk: one JSON object per (example, mode), streamed to a per-process shard file and
merged into `results.jsonl` in the suite's canonical order.  A record carries a fingerprint of the
settings that produced it (model, tokenizer, seed, its task entry, prefill and recall options), so a
changed suite re-runs what changed instead of reusing stale records.

    <output_dir>/results.rank<r>.jsonl   what process r finished, appended and flushed per record
    <output_dir>/results.jsonl           the merge (written atomically by process 0 at the end)

A record is finished once its line is complete.  A run killed mid-write leaves a partial last line;
`read_records` ignores it and `ShardWriter` cuts it off before appending, so a restarted run
re-evaluates exactly the unfinished records and never repeats a finished one.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..atomic import append_line, write_text_atomic

MERGED = "results.jsonl"


def record_id(record: dict) -> tuple[str, str, str | None]:
    """(example key, mode, fingerprint of the settings that produced it)."""
    return record["key"], record["mode"], record.get("fingerprint")


def _complete_lines(path: Path) -> tuple[list[dict], int]:
    """Parsed complete lines of `path` and the byte length they span (a partial tail is left out)."""
    records, good = [], 0
    if not path.is_file():
        return records, 0
    data = path.read_bytes()
    offset = 0
    for line in data.splitlines(keepends=True):
        offset += len(line)
        if not line.endswith(b"\n"):
            break  # an interrupted write
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
        good = offset
    return records, good


def shard_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"results.rank{rank}.jsonl"


def read_records(directory: str | Path) -> list[dict]:
    """Every finished record under `directory` (the merge first, then the shards), duplicates dropped."""
    directory = Path(directory)
    seen, out = set(), []
    for path in [directory / MERGED, *sorted(directory.glob("results.rank*.jsonl"))]:
        for record in _complete_lines(path)[0]:
            if record_id(record) not in seen:
                seen.add(record_id(record))
                out.append(record)
    return out


class ShardWriter:
    """Appends records to one process's shard file, one flushed + fsynced line each."""

    def __init__(self, directory: str | Path, rank: int) -> None:
        self.path = shard_path(Path(directory), rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _, good = _complete_lines(self.path)
        if self.path.is_file() and self.path.stat().st_size != good:
            with open(self.path, "r+b") as f:  # drop the partial line of an interrupted run
                f.truncate(good)

    def append(self, record: dict) -> None:
        append_line(self.path, json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")


def merge(directory: str | Path, order: dict[tuple, int]) -> Path:
    """Write `results.jsonl`: the finished records of this suite (ids in `order`), in that order.
    Records from other settings (another suite or changed options) stay in the shards only."""
    directory = Path(directory)
    records = [r for r in read_records(directory) if record_id(r) in order]
    ranked = sorted(records, key=lambda r: order[record_id(r)])
    text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in ranked)
    write_text_atomic(directory / MERGED, text)
    return directory / MERGED
