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

A shard set grows by parts (`albert preprocess --append-to`); its version is its number of parts, and the files of
version v are the first files of version v + 1, so a global row keeps its number as the set grows. A run records
what each of its epochs trains on (`DataStream`'s keys: the version, and the mixture below): one that follows its
shard set takes the newest version at each epoch boundary, and a resume replays the recorded epochs.

Mixture weights (relative sampling ratios per part) make an epoch draw about `total blocks x ratio` blocks from each
part, without replacement up to the part's size and in whole extra copies beyond it, seeded by (seed, epoch, part);
the drawn blocks are then shuffled as above. The rounding to whole blocks is carried from epoch to epoch (through
epoch e a part has drawn its share of e + 1 epochs, rounded once), so a part owed a fraction of a block is still
drawn, in some epochs. Without weights an epoch is every example once, exactly as a set of one part.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

BLOCK_ROWS = 128
WINDOW_ROWS = 1 << 16
_PIECE = 1 << 20  # blocks handled together when an epoch's windows are found


@dataclass(frozen=True)
class ExampleOrder:
    """The epoch orders of one version of a shard set. Global row g is row g - offsets[f] of file f.

    `part_files`: the number of files of each part, in order (empty: one part of every file). `weights`: a relative
    sampling ratio per part (None: every example once per epoch).
    """

    rows_per_file: tuple[int, ...]
    seed: int
    block_rows: int = BLOCK_ROWS
    window_rows: int = WINDOW_ROWS
    part_files: tuple[int, ...] = ()
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.rows_per_file or min(self.rows_per_file) < 0 or sum(self.rows_per_file) == 0:
            raise ValueError(f"ExampleOrder: expected row counts with at least one row, got {self.rows_per_file}")
        if self.block_rows < 1 or self.window_rows < self.block_rows:
            raise ValueError(
                f"ExampleOrder: need 1 <= block_rows <= window_rows, got {self.block_rows}, {self.window_rows}"
            )
        if self.part_files and (sum(self.part_files) != len(self.rows_per_file) or min(self.part_files) < 1):
            raise ValueError(f"ExampleOrder: part_files {self.part_files} do not cover {len(self.rows_per_file)} files")
        if self.weights is not None:
            parts = len(self.part_files) or 1
            if len(self.weights) != parts or min(self.weights) < 0 or sum(self.weights) <= 0:
                raise ValueError(f"ExampleOrder: expected {parts} weights >= 0, not all 0, got {self.weights}")

    @functools.cached_property
    def num_examples(self) -> int:
        return int(sum(self.rows_per_file))

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """Global row index of each file's first row (and the total at the end)."""
        return np.concatenate([[0], np.cumsum(self.rows_per_file)]).astype(np.int64)

    @functools.cached_property
    def _file_blocks(self) -> np.ndarray:
        """Index of each file's first block (and the total at the end): blocks are numbered file by file."""
        per_file = -(-np.asarray(self.rows_per_file, dtype=np.int64) // self.block_rows)
        return np.concatenate([[0], np.cumsum(per_file)]).astype(np.int64)

    @property
    def num_blocks(self) -> int:
        return int(self._file_blocks[-1])

    def block_rows_of(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, stop) global row ranges of these blocks (by number); a block never spans two files."""
        files = np.searchsorted(self._file_blocks, blocks, side="right") - 1
        start = self.offsets[files] + (blocks - self._file_blocks[files]) * self.block_rows
        return start, np.minimum(start + self.block_rows, self.offsets[files + 1])

    def _epoch_blocks(self, epoch: int) -> np.ndarray:
        """The numbers of the blocks an epoch trains on, in order: all of them once, or a weighted draw per part."""
        n = self.num_blocks if self.weights is None else None
        blocks = None if self.weights is None else self._weighted_draw(epoch)
        order = np.random.default_rng([self.seed, epoch, 0]).permutation(n if blocks is None else len(blocks))
        return _compact(order if blocks is None else blocks[order])  # every block once: the order is the blocks

    def _part_blocks(self) -> np.ndarray:
        """Index of each part's first block (and the total at the end): a part is a run of whole files."""
        part_files = np.concatenate([[0], np.cumsum(self.part_files or [len(self.rows_per_file)])])
        return self._file_blocks[part_files]

    @functools.cached_property
    def shares(self) -> np.ndarray:
        """Blocks each part is owed per epoch: all blocks x its ratio (weight / sum of the weights)."""
        if self.weights is None:
            raise ValueError("ExampleOrder: shares are those of a weighted order")
        return self.num_blocks * np.asarray(self.weights, dtype=np.float64) / sum(self.weights)

    def blocks_through(self, epochs: int) -> np.ndarray:
        """Blocks drawn from each part in the first `epochs` epochs of a weighted order: its share over those
        epochs rounded once, so the rounding of one epoch is carried into the next and over any number of epochs
        every part gets its share within half a block (a part owed 0.4 blocks an epoch is drawn in 2 of 5)."""
        return np.floor(self.shares * epochs + 0.5).astype(np.int64)

    def rows_drawn(self, examples: int) -> int:
        """At most how many distinct rows the stream's first `examples` positions train: every row without weights;
        with weights, each part's rows up to those of the blocks it draws in the epochs the positions span, so a part
        whose share rounds to no block in them counts none."""
        if self.weights is None:
            return self.num_examples
        parts = len(self.part_files) or 1
        blocks = np.diff(self._part_blocks())
        part_files = np.concatenate([[0], np.cumsum(self.part_files or [len(self.rows_per_file)])])
        rows = np.diff(self.offsets[part_files]).astype(np.float64)
        per_block = np.divide(rows, blocks, out=np.zeros(parts), where=blocks > 0)
        epochs = math.ceil(examples / max(float(self.shares @ per_block), 1.0))
        return int(np.minimum(rows, self.blocks_through(epochs) * per_block).sum())

    def _weighted_draw(self, epoch: int) -> np.ndarray:
        wanted_per_part = self.blocks_through(epoch + 1) - self.blocks_through(epoch)
        bounds = self._part_blocks()
        drawn = []
        for part, wanted in enumerate(wanted_per_part.tolist()):
            mine = np.arange(bounds[part], bounds[part + 1])
            copies, rest = divmod(wanted, len(mine)) if len(mine) else (0, 0)
            rng = np.random.default_rng([self.seed, epoch, 2, part])
            drawn += [mine] * copies + [rng.choice(mine, size=rest, replace=False)]
        return np.concatenate(drawn).astype(np.int64)

    @functools.lru_cache(maxsize=4)  # noqa: B019 - a handful of epochs per order, freed with it
    def _epoch_windows(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The epoch's block numbers in order, the epoch index at which each window starts (and its size at the
        end), and the position in the block order of each window's first block (and the number of blocks).

        A window closes at the first block boundary at least window_rows past its start (the last window takes what
        is left). The boundaries are found by binary search, window by window, in pieces of the block order, so
        that no array as long as the order is made besides the order itself."""
        blocks = self._epoch_blocks(epoch)
        starts, first_blocks, before = [0], [0], 0
        for piece in range(0, len(blocks), _PIECE):
            start, stop = self.block_rows_of(blocks[piece : piece + _PIECE].astype(np.int64))
            ends = before + np.cumsum(stop - start)
            while True:
                j = int(np.searchsorted(ends, starts[-1] + self.window_rows, side="left"))
                if j >= len(ends) or piece + j >= len(blocks) - 1:  # past this piece; the last block starts none
                    break
                starts.append(int(ends[j]))
                first_blocks.append(piece + j + 1)
            before = int(ends[-1])
        bounds = np.asarray([*starts, before], dtype=np.int64)
        return blocks, bounds, np.asarray([*first_blocks, len(blocks)], dtype=np.int64)

    def epoch_size(self, epoch: int) -> int:
        """Examples in the epoch: every example once, or the sizes of a weighted epoch's drawn blocks."""
        return self.num_examples if self.weights is None else int(self._epoch_windows(epoch)[1][-1])

    @functools.lru_cache(maxsize=8)  # noqa: B019
    def window(self, epoch: int, w: int) -> np.ndarray:
        """The global rows of window w of an epoch, in training order."""
        blocks, _, first_blocks = self._epoch_windows(epoch)
        start, stop = self.block_rows_of(blocks[first_blocks[w] : first_blocks[w + 1]].astype(np.int64))
        sizes = stop - start
        rows = np.repeat(start - (np.cumsum(sizes) - sizes), sizes) + np.arange(int(sizes.sum()))
        return rows[np.random.default_rng([self.seed, epoch, 1, w]).permutation(len(rows))]

    @property
    def end(self) -> float:
        """The first stream position whose order is not decided: none, every epoch follows from the seed."""
        return math.inf

    def rows_at(self, positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(global row, epoch) of each stream position."""
        return DataStream(lambda version: self, [1], open_ended=True).rows_at(positions)

    def rows_in_epoch(self, epoch: int, indices: np.ndarray) -> np.ndarray:
        """The global rows at these indices of the epoch's order."""
        out = np.empty_like(indices)
        _, bounds, _ = self._epoch_windows(epoch)
        windows = np.searchsorted(bounds[:-1], indices, side="right") - 1
        for w in np.unique(windows):
            here = windows == w
            out[here] = self.window(epoch, int(w))[indices[here] - bounds[w]]
        return out

    def file_row(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file index, row in file) of global rows."""
        files = np.searchsorted(self.offsets, rows, side="right") - 1
        return files, rows - self.offsets[files]


class DataStream:
    """A run's stream of examples over a shard set that may grow: epoch e trains in the order `order_of(keys[e])`,
    and positions continue from one epoch into the next. A key names what an epoch trains on: a version of the
    shard set (services.train.follow adds the mixture in force). `open_ended`: epochs past the given ones train the
    last key (a run that does not follow its shard set); otherwise the stream ends with the given epochs, and the
    run decides the next epoch's key when it gets there."""

    def __init__(self, order_of: Callable[[Any], ExampleOrder], keys: Sequence[Hashable], *, open_ended: bool):
        if not keys:
            raise ValueError("DataStream: expected the key of at least one epoch")
        self.order_of, self.keys, self.open_ended = order_of, list(keys), open_ended
        self._starts = [0]  # the first position of each epoch whose size is known so far

    def key(self, epoch: int) -> Hashable:
        return self.keys[min(epoch, len(self.keys) - 1)]

    def _start(self, epoch: int) -> int:
        while len(self._starts) <= epoch:
            e = len(self._starts) - 1
            self._starts.append(self._starts[-1] + self.order_of(self.key(e)).epoch_size(e))
        return self._starts[epoch]

    @property
    def end(self) -> float:
        """The first position whose epoch is not decided yet (inf for an open-ended stream)."""
        return math.inf if self.open_ended else self._start(len(self.keys))

    def epoch_of(self, position: int) -> int:
        """The epoch holding stream position `position` (an undecided epoch past the end counts as the next one)."""
        last = math.inf if self.open_ended else len(self.keys)  # the latest epoch a position can be in
        while self._starts[-1] <= position and len(self._starts) - 1 < last:
            self._start(len(self._starts))  # the start of one more epoch
        return min(bisect.bisect_right(self._starts, position) - 1, last)

    def rows_at(self, positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(global row, epoch) of each stream position (all before `end`)."""
        positions = np.asarray(positions, dtype=np.int64)
        if len(positions) and positions.max() >= self.end:
            raise ValueError(f"DataStream: position {int(positions.max())} is past the decided epochs ({self.end})")
        rows = np.empty_like(positions)
        last = self.epoch_of(int(positions.max())) if len(positions) else 0
        epochs = np.searchsorted(self._starts[: last + 1], positions, side="right") - 1
        for epoch in np.unique(epochs):
            here = epochs == epoch
            order = self.order_of(self.key(int(epoch)))
            rows[here] = order.rows_in_epoch(int(epoch), positions[here] - self._start(int(epoch)))
        return rows, epochs


def _compact(values: np.ndarray) -> np.ndarray:
    """Non-negative int64 values as int32 when they fit: an epoch's block order is the one array as long as the
    blocks that an order keeps (4 bytes a block)."""
    return values.astype(np.int32) if len(values) and int(values.max()) < 2**31 else values


def worker_positions(position: int, global_batch: int, rank: int, world: int) -> range:
    """The stream positions worker `rank` of `world` trains in the step that starts at data position `position`."""
    if global_batch % world:
        raise ValueError(f"global batch {global_batch} does not split over {world} workers")
    share = global_batch // world
    return range(position + rank * share, position + (rank + 1) * share)
