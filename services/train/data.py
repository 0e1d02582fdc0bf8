"""A worker's training input: its slice of each global batch, read from the shards in the run's example order
(albert_core.examples.order), masked, and prefetched by a background thread ahead of the step.

Rows are read with pyarrow by (file, row group), the unit Parquet decompresses, and kept in a small cache: the
order serves one window of blocks at a time, so each row group is read about once per window.

Damaged shards. Every page is read with its CRC checked (albert preprocess writes Parquet page checksums; a shard
without them is read unchecked), so bytes changed on disk fail the read of their row group instead of training on
garbage. A row group that cannot be read raises DamagedShard, one line naming the file, the row group, and whether
the file's bytes still have the sha256 manifest.json records (the file is hashed then, once). A full sha256 pass
over the set before training is opt-in (`verify_shards`, `albert pretrain --verify-shards`): it reads every byte of
every shard on the driver before Ray starts (1.1 GB/s of CPU measured, plus the disk's time), where the page checks
cost 1-2% of the reads the workers make anyway (bench/shard_checks.py).
"""

from __future__ import annotations

import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from albert_core.examples.order import DataStream, ExampleOrder, worker_positions
from albert_core.examples.shards import EXAMPLE_SCHEMA, MANIFEST_FILE
from albert_core.files import file_sha256
from services.rundir.log import read_metrics

COLUMNS = [f.name for f in EXAMPLE_SCHEMA]
Rows = dict[str, np.ndarray]
READ_ERRORS = (OSError, pa.ArrowException)  # what pyarrow raises for a file it cannot read (a CRC failure: OSError)


DAMAGE_EVENT = "damaged_shard"  # the run's log names the shard, so that a restarted worker group ends at once


class DamagedShard(ValueError):
    """A shard whose row group cannot be read, or whose bytes differ from manifest.json's sha256: one line (the
    file, and its row group where one failed: `path`, `row_group`)."""

    def __init__(self, line: str, path: str = "", row_group: int | None = None):
        super().__init__(line)
        self.path, self.row_group = path, row_group

    def __reduce__(self):
        return (DamagedShard, (str(self), self.path, self.row_group))

    def fields(self) -> dict[str, Any]:
        return {"message": str(self), "file": self.path, "row_group": self.row_group}


def still_damaged(path: str, row_group: int | None) -> bool:
    """Whether the row group (None: the file's footer) still fails to read, CRCs checked: a restored file reads."""
    try:
        shard = pq.ParquetFile(path, page_checksum_verification=True)
        if row_group is not None and row_group < shard.num_row_groups:  # (fewer: another file now)
            shard.read_row_group(row_group, columns=COLUMNS)
    except READ_ERRORS:
        return True
    return False


def damage_left(run_dir: str | Path) -> DamagedShard | None:
    """The first shard the run's log names damaged (a DAMAGE_EVENT) that still is, or None."""
    for record in read_metrics(run_dir):
        if record.get("event") == DAMAGE_EVENT and still_damaged(record["file"], record.get("row_group")):
            return DamagedShard(record["message"], record["file"], record.get("row_group"))
    return None


def shard_damage(path: str, digest: str, row_group: int | None, error: BaseException | None) -> str:
    """The line naming a damaged shard: the file, its row group (None: the file as a whole), what failed (None: the
    opt-in sha256 pass found it), and what its sha256 says (`digest`: manifest.json's, "" where it records none)."""
    where, then = f"data.shards: {path}", ": "
    if error is not None:
        group = f"row group {row_group} " if row_group is not None else ""
        where, then = f"{where}: {group}cannot be read ({str(error).strip() or type(error).__name__})", "; "
    if not digest:
        return f"{where}{then}{MANIFEST_FILE} records no sha256 to compare it with; restore or preprocess it again"
    try:
        same = file_sha256(path) == digest
    except OSError as err:
        return f"{where}{then}the file cannot be hashed ({err}); restore it or preprocess again"
    if same:
        return (
            f"{where}, although its sha256 is the one {MANIFEST_FILE} records: it was written damaged; preprocess again"
        )
    return (
        f"{where}{then}its sha256 differs from the one {MANIFEST_FILE} records: the file changed after "
        "preprocessing; restore it from a copy or preprocess again"
    )


def verify_shards(files: Sequence[str], digests: Sequence[str]) -> int:
    """The opt-in full check: every file's sha256 against manifest.json's (DamagedShard for the first that
    differs; a file it records none for is not checked). Returns the bytes hashed."""
    hashed = 0
    for path, digest in zip(files, digests, strict=True):
        if digest:
            try:
                found = file_sha256(path)
            except OSError as err:
                raise DamagedShard(f"data.shards: {path}: cannot be read ({err})", path) from None
            if found != digest:
                raise DamagedShard(shard_damage(path, digest, None, None), path)
            hashed += os.path.getsize(path)
    return hashed


class ShardRows:
    """Rows of a shard set by global row index (ExampleOrder numbering), through a cache of row groups; each row
    group's pages are checked against their CRCs where the shard has them (DamagedShard otherwise)."""

    def __init__(
        self,
        files: Sequence[str],
        order: ExampleOrder,
        *,
        cache_rows: int | None = None,
        sha256: Sequence[str] = (),
    ):
        self.files = list(files)
        self.sha256 = list(sha256) or [""] * len(self.files)  # manifest.json's, named when a file is damaged
        self.order = order
        self.cache_rows = cache_rows if cache_rows is not None else 2 * order.window_rows
        self._groups: dict[int, np.ndarray] = {}  # file -> first row of each row group (and the total)
        self._cache: OrderedDict[tuple[int, int], pa.Table] = OrderedDict()
        self._cached_rows = 0

    def read(self, rows: np.ndarray) -> Rows:
        """The columns of these global rows, in this order."""
        files, local = self.order.file_row(np.asarray(rows, dtype=np.int64))
        groups = np.empty_like(local)
        for f in np.unique(files):
            here = files == f
            groups[here] = np.searchsorted(self._row_groups(int(f)), local[here], side="right") - 1
        parts, where = [], []
        for f, g in sorted(set(zip(files.tolist(), groups.tolist(), strict=True))):
            here = np.flatnonzero((files == f) & (groups == g))
            parts.append(self._group(f, g).take(local[here] - self._row_groups(f)[g]))
            where.append(here)
        table = pa.concat_tables(parts).take(np.argsort(np.concatenate(where)))
        return {name: table.column(name).to_numpy() for name in COLUMNS}

    def _row_groups(self, f: int) -> np.ndarray:
        if f not in self._groups:
            try:
                meta = pq.ParquetFile(self.files[f]).metadata
            except READ_ERRORS as err:
                line = shard_damage(self.files[f], self.sha256[f], None, err)
                raise DamagedShard(line, self.files[f]) from None
            sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            self._groups[f] = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            if self._groups[f][-1] != self.order.rows_per_file[f]:
                raise RuntimeError(
                    f"{self.files[f]}: has {self._groups[f][-1]} rows, {self.order.rows_per_file[f]} when the run "
                    "was planned; the shard files changed under the run"
                )
        return self._groups[f]

    def _group(self, f: int, g: int) -> pa.Table:
        key = (f, g)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        try:
            table = pq.ParquetFile(self.files[f], page_checksum_verification=True).read_row_group(g, columns=COLUMNS)
        except READ_ERRORS as err:
            raise DamagedShard(shard_damage(self.files[f], self.sha256[f], g, err), self.files[f], g) from None
        self._cache[key] = table
        self._cached_rows += table.num_rows
        while self._cached_rows > self.cache_rows and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_rows -= old.num_rows
        return table


def host_steps(
    reader: ShardRows,
    *,
    position: int,
    steps: int,
    global_batch: int,
    micro_batch: int,
    rank: int,
    world: int,
    mask: Callable[[Rows, np.ndarray], dict] | None = None,
    mask_step: Callable[[Rows, np.ndarray], list[dict]] | None = None,
    stream: DataStream | ExampleOrder | None = None,
) -> Iterator[tuple[list[Rows], list[dict]]]:
    """(rows, masked micro-batches) of this worker for `steps` steps from data position `position`, in the order of
    `stream` (default: the reader's). It ends early before a step that reaches past the stream's decided epochs.

    `mask(rows, epochs)` masks one micro-batch (each row under its own epoch's seed); or `mask_step(rows, epochs)`
    masks the worker's rows of a step into its micro-batches in one call.
    """
    if (mask is None) == (mask_step is None):
        raise ValueError("host_steps: give one of mask (per micro-batch) and mask_step (per step)")
    stream = stream or reader.order
    for step in range(steps):
        first = position + step * global_batch
        if first + global_batch > stream.end:
            return
        mine = worker_positions(first, global_batch, rank, world)
        rows, epochs = stream.rows_at(np.arange(mine.start, mine.stop))
        part = reader.read(rows)
        groups = [slice(a, a + micro_batch) for a in range(0, len(rows), micro_batch)]
        rows_list = [{name: column[group] for name, column in part.items()} for group in groups]
        if mask_step is not None:
            yield rows_list, mask_step(part, epochs)
        else:
            yield rows_list, [mask(rows_, epochs[group]) for rows_, group in zip(rows_list, groups, strict=True)]


class Prefetch:
    """Runs an iterator in a background thread, `depth` items ahead; errors are raised where items are read.
    `close()` stops the thread (the source is read no further)."""

    _END = object()

    def __init__(self, source: Iterator, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(source,), name="albert-input", daemon=True)
        self._thread.start()

    def _run(self, source: Iterator) -> None:
        try:
            for item in source:
                if not self._put(item):
                    return
            self._put(self._END)
        except BaseException as err:  # noqa: BLE001 - handed to the reading thread
            self._put(err)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetch:
        return self

    def __next__(self):
        item = self._queue.get()
        if item is self._END:
            self._queue.put(self._END)
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
