"""A worker's training input: its slice of each global batch, read from the shards in the run's example order
(albert_core.examples.order), masked, and prefetched by a background thread ahead of the step.

Rows are read with pyarrow by (file, row group), the unit Parquet decompresses, and kept in a small cache: the
order serves one window of blocks at a time, so each row group is read about once per window.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from albert_core.examples.order import DataStream, ExampleOrder, worker_positions
from albert_core.examples.shards import EXAMPLE_SCHEMA

COLUMNS = [f.name for f in EXAMPLE_SCHEMA]
Rows = dict[str, np.ndarray]


class ShardRows:
    """Rows of a shard set by global row index (ExampleOrder numbering), through a cache of row groups."""

    def __init__(self, files: Sequence[str], order: ExampleOrder, *, cache_rows: int | None = None):
        self.files = list(files)
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
            meta = pq.ParquetFile(self.files[f]).metadata
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
        table = pq.ParquetFile(self.files[f]).read_row_group(g, columns=COLUMNS)
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
