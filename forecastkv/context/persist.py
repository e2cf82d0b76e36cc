"""The context store's disk tier: loading a namespace into the index and pools, reading blocks
when a lookup needs them, saving (merged with what other processes saved).

The file format, the namespace directory, its lock and the index file are `context/disk.py`'s;
this module keeps a store's `BlockIndex` (context/index.py) in step with them: the index's
generation and stamp tell when another process changed it (a lookup then revalidates), a bad
or missing block is a miss for its chain (with a warning), never an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Callable

from . import disk
from .blocks import BlockRows, identity_differences
from .disk import ContextStoreError
from .index import BlockIndex, Entry
from .transfer import copy_in


def _parents_first(records: list[dict]) -> list[dict]:
    return sorted(records, key=lambda record: record["position"])


class DiskTier:
    """One store's namespace on disk.

    root: the store's directory (None: a store in memory only); namespace: its private part;
    identity: the store's `blocks.model_identity`; index: the store's `BlockIndex` (its pools are
    the store's); shapes: tensor name -> (shape, torch dtype name) of a block file."""

    def __init__(
        self, root: Path | None, namespace: str, identity: dict, index: BlockIndex, shapes: dict[str, tuple]
    ) -> None:
        self.root, self.namespace, self.identity, self.index, self.shapes = root, namespace, identity, index, shapes
        self.seen: tuple[int, str | None] | None = None  # (generation, stamp) of the index last read or written

    # -- the index file -------------------------------------------------------------------------
    def _check_identity(self, space: disk.Namespace, index: dict) -> None:
        differences = identity_differences(self.identity, index.get("identity") or {})
        if differences and index["entries"]:
            named = {line.split(":")[0] for line in differences}
            parts = [part for part in ("model", "geometry", "dtype") if part in named]
            parts += sorted(named - {"model", "geometry", "dtype"})
            raise ContextStoreError(
                f"{space.path} holds blocks of another {' / '.join(parts)}: " + "; ".join(differences)
            )

    def _good_records(self, space: disk.Namespace, index: dict | None) -> list[dict]:
        """The index's well-formed entries of this store's identity (problems warned about)."""
        if index is None or not index["entries"]:
            return []
        self._check_identity(space, index)
        good, problems = disk.check_entries(index, self.index.root)
        if problems:
            shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
            disk.warn(
                f"{space.path / disk.INDEX}: {len(problems)} entries skipped "
                f"(misses; the next save drops them): {shown}"
            )
        return good

    def _drop_unlisted(self, names: set[str]) -> None:
        """Drop the blocks on disk that the index file no longer names (another process removed them)."""
        for entry in list(self.index.entries.values()):
            if self.index.current(entry) and entry.disk is not None and entry.name not in names:
                self.index.drop(entry, forget_on_disk=False)

    def _revalidate(self, space: disk.Namespace) -> None:
        """Under the shared lock, after another process changed the index: drop what it removed."""
        try:
            index = disk.read_index(space)
        except disk.BrokenIndex:
            index = None
        self._drop_unlisted({record["hash"] for record in self._good_records(space, index)})
        self.seen = None if index is None else (index.get("generation", 0), index.get("stamp"))

    # -- load -----------------------------------------------------------------------------------
    def load(self) -> None:
        """Read the namespace's index under the shared lock; its blocks stay in their own files
        until a lookup needs them (`load_blocks`: read, verified, copied into the pools, which are
        RAM).  Opening a store writes nothing and takes no disk: N processes that open it cost
        its blocks once.  Bad or missing blocks are misses for their chains (with a warning), an
        unreadable index an empty store."""
        try:
            space = disk.Namespace(self.root, self.namespace, create=False)
        except FileNotFoundError:
            return
        with space, space.lock(exclusive=False):
            try:
                index = disk.read_index(space)
            except disk.BrokenIndex as error:
                disk.warn(
                    f"{error}: the store starts empty; the next save rebuilds the index "
                    "(or run `forecastkv context-cache repair`)"
                )
                return
            if index is None:
                return
            self.seen = (index.get("generation", 0), index.get("stamp"))
            for record in _parents_first(self._good_records(space, index)):
                if record["parent"] is None or record["parent"] in self.index.entries:
                    self.index.add_record(record, used=float(record.get("used") or 0.0))
            self.index.order()
            self._drop_missing(space)
        self.index.make_room(0)

    def _drop_missing(self, space: disk.Namespace) -> None:
        """Drop the blocks whose file is missing or has another size than the index records, with
        a warning (their checksums are checked when a lookup reads them)."""
        for entry in list(self.index.entries.values()):
            if not self.index.current(entry) or entry.blocks is not None:
                continue
            if space.size(entry.disk["file"]) != entry.disk["bytes"]:
                disk.warn(
                    f"block {entry.name[:16]} of {space.path} is missing or has another size than its index records: "
                    "a miss for its chain"
                )
                self.index.drop(entry, forget_on_disk=True)

    def _read_block(self, space: disk.Namespace, entry: Entry) -> disk.DiskBlock | None:
        """A block's verified file, or None (the block and its descendants dropped, with a warning)."""
        try:
            data = disk.verified_block(space, entry.disk, self.shapes)
            return disk.DiskBlock(data, str(space.path / entry.disk["file"]))
        except (OSError, ContextStoreError) as error:
            disk.warn(
                f"block {entry.name[:16]} of {space.path} skipped ({error}): "
                "a miss for its chain; the next save drops it"
            )
            self.index.drop(entry, forget_on_disk=True)
            return None

    def load_blocks(self, chain: list[Entry]) -> list[Entry]:
        """Read the blocks of `chain` (root first) that are on disk only into the pools, under the
        namespace's shared lock, after revalidating against the index if another process changed
        it.  Returns the leading part of `chain` that is now in the pools: a block that is gone
        (removed by another process) or bad (with a warning) ends it, and leaves the store."""
        if all(entry.blocks is not None for entry in chain):
            return chain
        loaded = []
        try:
            with disk.Namespace(self.root, self.namespace, create=False) as space, space.lock(exclusive=False):
                if disk.index_head(space) != self.seen:
                    self._revalidate(space)
                missing = [entry for entry in chain if entry.blocks is None]
                for pool in self.index.pools:
                    pool.allocator.reserve(len(missing))
                for entry in chain:
                    if not self.index.current(entry):
                        break
                    if entry.blocks is None:
                        block = self._read_block(space, entry)
                        if block is None:
                            break
                        entry.blocks = copy_in(self.index.pools, block)
                    loaded.append(entry)
        except (OSError, ContextStoreError) as error:
            # the namespace is gone or refused: what is not in memory is a miss
            disk.warn(
                f"context store {self.root}/{self.namespace} could not be read ({error}); "
                "blocks not in memory are misses"
            )
        return loaded

    # -- save -----------------------------------------------------------------------------------
    def save(self, rows_of: Callable[[str], BlockRows]) -> Path:
        """Merge the store into the namespace on disk under its exclusive lock: read the index,
        keep what other processes saved there (their blocks join the store, on disk only), drop
        what they removed, drop what the store evicted, evict under max_bytes, write the new
        blocks (`rows_of(name)`: their rows), replace the index atomically (next generation), then
        delete the files it does not name.  Returns the namespace directory.  A save that fails
        (a full disk: `DiskFullError`) leaves the previous index and its files as they were and
        removes the block files it wrote; the store in memory keeps every block."""
        with disk.Namespace(self.root, self.namespace, create=True) as space, space.lock(exclusive=True):
            try:
                index = disk.read_index(space)
            except disk.BrokenIndex as error:
                disk.warn(f"{error}: this save rebuilds it from this store's blocks")
                index = None
            self._merge(space, index)
            new = [entry for entry in self.index.entries.values() if entry.disk is None]
            try:
                records = [self._record(space, entry, rows_of) for entry in self.index.entries.values()]
                generation = (index or {}).get("generation", 0) + 1
                written = disk.new_index(self.namespace, self.identity, self.index.block_size, records, generation)
                disk.write_index(space, written)
            except BaseException:  # a full disk, say: the old index stands; the blocks this save wrote go
                for entry in new:
                    if entry.disk is not None:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.disk["file"].partition("/")[2], dir_fd=space.blocks_fd)
                        entry.disk = None
                raise
            self.seen, self.index.forgotten = (generation, written["stamp"]), set()
            disk.remove_unlisted(space, {record["file"] for record in records})
            return space.path

    @staticmethod
    def _record(space: disk.Namespace, entry: Entry, rows_of: Callable[[str], BlockRows]) -> dict:
        """`entry`'s record in the index file; its block file is written first if it has none."""
        if entry.disk is None:
            rows = rows_of(entry.name)
            tensors = {"keys": rows.keys.contiguous(), "values": rows.values.contiguous()}
            if rows.cis is not None:
                tensors["cis"] = rows.cis.contiguous()
            data = disk.block_bytes(tensors, entry.name)
            space.write(disk.block_file(entry.name), data)
            entry.disk = {
                "file": disk.block_file(entry.name),
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        return {
            "hash": entry.name, "parent": entry.parent, "position": entry.position, "tokens": entry.tokens,
            "nbytes": entry.nbytes, **entry.disk, "used": entry.used,
        }  # fmt: skip

    def _merge(self, space: disk.Namespace, index: dict | None) -> None:
        """Under the exclusive lock: the store becomes the index's blocks (other processes' join,
        on disk only) minus what the store evicted, plus its own new blocks; then the cap."""
        records = self._good_records(space, index)
        self._drop_unlisted({record["hash"] for record in records})  # removed by another process (rm, eviction)
        for record in _parents_first(records):
            entry = self.index.entries.get(record["hash"])
            used = float(record.get("used") or 0.0)
            if entry is not None:
                entry.used = max(entry.used, used)
                if entry.disk is None:  # the same block, saved by another process: its file serves
                    entry.disk = {key: record[key] for key in ("file", "bytes", "sha256")}
            elif self._joins(space, record):
                self.index.add_record(record, used)
        self.index.order()
        self.index.make_room(0)

    def _joins(self, space: disk.Namespace, record: dict) -> bool:
        """Whether another process's block `record` joins the store: not evicted by this store,
        its parent stored, its file of the recorded size."""
        if record["hash"] in self.index.forgotten:
            return False
        parent = record["parent"]
        return (parent is None or parent in self.index.entries) and space.size(record["file"]) == record["bytes"]
