"""The order pretraining examples are trained in: a seeded shuffle per epoch that depends only on the seed, the
epoch and the shard set's row counts, never on the number of workers or on where a run was resumed.

The examples of a shard set form one stream: epoch 0's order, then epoch 1's, and so on. Position p of the stream
is example `order(p // N)[p % N]` of the N examples. Each epoch's order is a two-level shuffle:

1. the shard files are cut into blocks of `block_rows` consecutive rows, and the blocks are permuted;
2. consecutive permuted blocks form windows of `window_rows` rows, and the rows of each window are permuted.

A window holds rows from many places of the corpus (its blocks come from anywhere), so a micro-batch mixes many
documents; a shard set no larger than one window (the demo's) gets a full uniform shuffle. A reader only ever needs
the rows of one window at a time. Every epoch visits every example exactly once; a global batch that crosses an
epoch boundary simply continues into the next epoch's order, so there is no partial step and no example is left
out.

Step s of a run with global batch G trains the stream positions [p_s, p_s + G), where p_s is the data position
(examples consumed so far), and worker r of W takes the slice [p_s + r·G/W, p_s + (r+1)·G/W) of it. A resumed run
continues at its saved data position, whatever its worker count.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BLOCK_ROWS = 128
WINDOW_ROWS = 1 << 16


@dataclass(frozen=True)
class ExampleOrder:
    """The epoch orders of a shard set. Global row g is row g - offsets[f] of file f."""

    rows_per_file: tuple[int, ...]
    seed: int
    block_rows: int = BLOCK_ROWS
    window_rows: int = WINDOW_ROWS

    def __post_init__(self) -> None:
        if not self.rows_per_file or min(self.rows_per_file) < 0 or sum(self.rows_per_file) == 0:
            raise ValueError(f"ExampleOrder: expected row counts with at least one row, got {self.rows_per_file}")
        if self.block_rows < 1 or self.window_rows < self.block_rows:
            raise ValueError(
                f"ExampleOrder: need 1 <= block_rows <= window_rows, got {self.block_rows}, {self.window_rows}"
            )

    @functools.cached_property
    def num_examples(self) -> int:
        return int(sum(self.rows_per_file))

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """Global row index of each file's first row (and the total at the end)."""
        return np.concatenate([[0], np.cumsum(self.rows_per_file)]).astype(np.int64)

    @functools.cached_property
    def _blocks(self) -> np.ndarray:
        """(start, stop) global row ranges of the blocks, file by file; a block never spans two files."""
        blocks = []
        for f, rows in enumerate(self.rows_per_file):
            starts = np.arange(0, rows, self.block_rows, dtype=np.int64) + self.offsets[f]
            blocks.append(np.stack([starts, np.minimum(starts + self.block_rows, self.offsets[f + 1])], axis=1))
        return np.concatenate(blocks)

    @functools.lru_cache(maxsize=4)  # noqa: B019 - a handful of epochs per order, freed with it
    def _epoch_windows(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's permuted blocks and the epoch index at which each window starts."""
        blocks = self._blocks[np.random.default_rng([self.seed, epoch, 0]).permutation(len(self._blocks))]
        sizes = blocks[:, 1] - blocks[:, 0]
        ends = np.cumsum(sizes)
        starts = [0]
        for end in ends[:-1]:  # close a window at the first block boundary past window_rows
            if end - starts[-1] >= self.window_rows:
                starts.append(int(end))
        return blocks, np.asarray(starts, dtype=np.int64)

    def window_of(self, epoch: int, index: int) -> tuple[int, int]:
        """(window number, its first epoch index) holding epoch index `index`."""
        _, starts = self._epoch_windows(epoch)
        w = int(np.searchsorted(starts, index, side="right")) - 1
        return w, int(starts[w])

    @functools.lru_cache(maxsize=8)  # noqa: B019
    def window(self, epoch: int, w: int) -> np.ndarray:
        """The global rows of window w of an epoch, in training order."""
        blocks, starts = self._epoch_windows(epoch)
        ends = np.cumsum(blocks[:, 1] - blocks[:, 0])
        first = int(np.searchsorted(ends, starts[w], side="right"))
        stop = self.num_examples if w + 1 == len(starts) else int(starts[w + 1])
        last = int(np.searchsorted(ends, stop, side="left"))
        rows = np.concatenate([np.arange(a, b) for a, b in blocks[first : last + 1]])
        return rows[np.random.default_rng([self.seed, epoch, 1, w]).permutation(len(rows))]

    def rows_at(self, positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(global row, epoch) of each stream position."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs, indices = np.divmod(positions, self.num_examples)
        rows = np.empty_like(positions)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            rows[here] = self._rows_in_epoch(int(epoch), indices[here])
        return rows, epochs

    def _rows_in_epoch(self, epoch: int, indices: np.ndarray) -> np.ndarray:
        out = np.empty_like(indices)
        _, starts = self._epoch_windows(epoch)
        windows = np.searchsorted(starts, indices, side="right") - 1
        for w in np.unique(windows):
            here = windows == w
            out[here] = self.window(epoch, int(w))[indices[here] - starts[w]]
        return out

    def file_row(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file index, row in file) of global rows."""
        files = np.searchsorted(self.offsets, rows, side="right") - 1
        return files, rows - self.offsets[files]


def worker_positions(position: int, global_batch: int, rank: int, world: int) -> range:
    """The stream positions worker `rank` of `world` trains in the step that starts at data position `position`."""
    if global_batch % world:
        raise ValueError(f"global batch {global_batch} does not split over {world} workers")
    share = global_batch // world
    return range(position + rank * share, position + (rank + 1) * share)
