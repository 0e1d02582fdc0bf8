"""The example order of pretraining: every example once per epoch, well mixed, the same for any worker count and
after a resume (albert_core.examples.order, services.train.data on real Parquet shards)."""

from __future__ import annotations

import functools
import tracemalloc

import numpy as np
import pyarrow.parquet as pq
import pytest

from albert_core.examples.order import WINDOW_ROWS, DataStream, ExampleOrder, worker_positions
from services.train.data import Prefetch, ShardRows, host_steps
from tests.synthetic import write_random_shards

FILE_ROWS = (500, 300, 700, 12)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    train = tmp_path_factory.mktemp("shards") / "train"
    write_random_shards(train, FILE_ROWS, vocab_size=50, rng=np.random.default_rng(0))
    files = sorted(str(p) for p in train.glob("*.parquet"))
    return files, tuple(pq.ParquetFile(f).metadata.num_rows for f in files)


def epoch_ids(reader: ShardRows, epoch: int) -> list[int]:
    n = reader.order.num_examples
    rows, epochs = reader.order.rows_at(np.arange(epoch * n, (epoch + 1) * n))
    assert (epochs == epoch).all()
    return reader.read(rows)["example_id"].tolist()


@pytest.mark.parametrize("window_rows", [128, 1 << 16])
def test_every_epoch_visits_every_example_id_once_and_epochs_differ(shards, window_rows):
    files, rows = shards
    reader = ShardRows(files, ExampleOrder(rows, seed=5, block_rows=32, window_rows=window_rows))
    every = sorted(int(i) for f in files for i in pq.read_table(f, columns=["example_id"])["example_id"].to_pylist())
    first, second = epoch_ids(reader, 0), epoch_ids(reader, 1)
    assert sorted(first) == every and sorted(second) == every
    assert first != second


def test_a_micro_batch_mixes_rows_from_many_places_of_the_corpus(shards):
    files, rows = shards
    reader = ShardRows(files, ExampleOrder(rows, seed=5))  # default blocks of 128 rows
    batch, _ = reader.order.rows_at(np.arange(0, 32))
    ids = reader.read(batch)["example_id"]
    places = {(int(i) >> 32, (int(i) & 0xFFFFFFFF) // 128) for i in ids}  # (file, 128-row block)
    assert len(places) >= 10  # read in file order, all 32 rows would be from one block


def test_a_window_holds_only_rows_of_its_own_blocks(shards):
    _, rows = shards
    order = ExampleOrder(rows, seed=2, block_rows=50, window_rows=200)
    window = order.window(0, 1)
    files, local = order.file_row(window)
    assert 200 <= len(window) < 250
    assert len({(int(f), int(r) // 50) for f, r in zip(files, local, strict=True)}) <= 5


def test_the_global_batch_is_the_same_for_one_two_or_four_workers():
    for position in (0, 48, 1500):
        split = {
            world: [p for r in range(world) for p in worker_positions(position, 48, r, world)] for world in (1, 2, 4)
        }
        assert split[1] == split[2] == split[4] == list(range(position, position + 48))


def test_a_global_batch_that_crosses_the_epoch_end_continues_into_the_next_epoch(shards):
    _, rows = shards
    order = ExampleOrder(rows, seed=1)
    n = order.num_examples
    got, epochs = order.rows_at(np.arange(n - 3, n + 3))
    assert epochs.tolist() == [0, 0, 0, 1, 1, 1]
    assert got[:3].tolist() == order.rows_at(np.arange(n - 3, n))[0].tolist()
    assert got[3:].tolist() == order.rows_at(np.arange(n, n + 3))[0].tolist()


def steps_from(files, rows, position, steps, rank=0, world=2):
    reader = ShardRows(files, ExampleOrder(rows, seed=9))
    source = host_steps(
        reader,
        position=position,
        steps=steps,
        global_batch=16,
        micro_batch=4,
        rank=rank,
        world=world,
        mask=lambda part, epochs: epochs.tolist(),
    )
    return [([part["example_id"].tolist() for part in rows_], micro) for rows_, micro in source]


def test_a_resumed_stream_replays_the_uninterrupted_one_from_its_data_position(shards):
    files, rows = shards
    straight = steps_from(files, rows, 0, 200)  # crosses the epoch end (1,512 rows) at step 95
    assert steps_from(files, rows, 16 * 120, 80) == straight[120:]
    assert {tuple(e) for _, micro in straight for e in micro} >= {(0, 0, 0, 0), (1, 1, 1, 1)}


def test_prefetch_delivers_every_item_in_order_and_raises_the_source_error_after_them():
    def source():
        yield from range(5)
        raise ValueError("shard 3 is damaged")

    items = Prefetch(source(), depth=2)
    assert [next(items) for _ in range(5)] == list(range(5))
    with pytest.raises(ValueError, match="shard 3 is damaged"):
        next(items)


def test_prefetch_closed_early_stops_reading_its_source():
    read = []

    def source():
        for i in range(1000):
            read.append(i)
            yield i

    items = Prefetch(source(), depth=2)
    next(items)
    items.close()
    assert len(read) <= 5


# ----------------------------------------------------------------------------------------------------------
# a shard set that grows by parts, and mixture weights (albert_core.examples.order.DataStream)

PARTS = (3, 1)  # files of part 0 (the first three of FILE_ROWS) and of part 1 (the last)


def versioned(rows, seed=4, weights=None):
    def order_of(version):
        parts = PARTS[:version]
        return ExampleOrder(rows[: sum(parts)], seed, block_rows=32, part_files=parts, weights=weights)

    return order_of


def test_a_stream_trains_each_epoch_on_its_version_and_continues_across_them(shards):
    _, rows = shards
    order_of = versioned(rows)
    stream = DataStream(order_of, [1, 1, 2], open_ended=False)
    n1, n2 = sum(rows[:3]), sum(rows)
    assert stream.end == 2 * n1 + n2
    got, epochs = stream.rows_at(np.arange(0, 2 * n1 + n2))
    assert np.bincount(epochs).tolist() == [n1, n1, n2]
    for epoch, expected in ((0, range(n1)), (1, range(n1)), (2, range(n2))):
        assert sorted(got[epochs == epoch].tolist()) == list(expected)  # every example of the version once
    # epochs 0 and 1 are version 1's own orders: the second part changes nothing before it is taken
    alone, _ = ExampleOrder(rows[:3], 4, block_rows=32, part_files=(3,)).rows_at(np.arange(0, 2 * n1))
    assert got[: 2 * n1].tolist() == alone.tolist()
    with pytest.raises(ValueError, match="past the decided epochs"):
        stream.rows_at([2 * n1 + n2])
    assert stream.epoch_of(2 * n1 + n2) == 3  # the next, undecided epoch
    open_ended = DataStream(order_of, [1, 2], open_ended=True)
    assert open_ended.end == float("inf") and open_ended.epoch_of(n1 + 5 * n2) == 6


def test_the_input_stops_before_a_step_that_reaches_an_undecided_epoch(shards):
    files, rows = shards
    stream = DataStream(versioned(rows), [1], open_ended=False)
    source = host_steps(
        ShardRows(files, versioned(rows)(2)), position=0, steps=1000, global_batch=64, micro_batch=32,
        rank=0, world=1, mask=lambda part, epochs: epochs.tolist(), stream=stream,
    )  # fmt: skip
    assert len(list(source)) == sum(rows[:3]) // 64  # 23 whole steps fit in epoch 0 (1,500 rows)


def whole_epoch(order: ExampleOrder, epoch: int) -> np.ndarray:
    return order.rows_in_epoch(epoch, np.arange(order.epoch_size(epoch)))


def test_mixture_weights_set_each_parts_share_of_an_epoch_reproducibly(shards):
    _, rows = shards
    weighted = functools.partial(ExampleOrder, rows, 4, block_rows=32, part_files=PARTS)
    order = weighted(weights=(1.0, 1.0))
    epochs = [whole_epoch(order, e) for e in range(3)]
    assert [e.tolist() for e in epochs] == [whole_epoch(weighted(weights=(1.0, 1.0)), e).tolist() for e in range(3)]
    assert len({tuple(e[:50]) for e in epochs}) == 3
    # half of the 49 blocks are part 1's one block of 12 rows, drawn again and again: about 0.28 of the examples
    assert all(0.2 < np.mean(e >= sum(rows[:3])) < 0.36 for e in epochs)
    assert whole_epoch(weighted(weights=(1.0, 0.0)), 0).max() < sum(rows[:3])  # weight 0: never drawn


def test_a_part_is_subsampled_without_replacement_below_its_size(shards):
    _, rows = shards
    order = ExampleOrder(rows, 4, block_rows=32, part_files=(1, 3), weights=(1.0, 3.0))
    got = whole_epoch(order, 0)
    first = got[got < rows[0]]
    assert len(first) == len(set(first.tolist())) and 0 < len(first) < rows[0]  # a quarter of the blocks, once each


# mixture weights over many epochs: the rounding of each part's share is carried from one epoch to the next

BLOCK = 128


def part_blocks_per_epoch(order: ExampleOrder, rows: range, epochs: int) -> list[float]:
    """Blocks of the part of these global rows drawn in each of the first `epochs` epochs."""
    return [np.sum(np.isin(whole_epoch(order, e), rows)) / BLOCK for e in range(epochs)]


def test_a_part_worth_under_half_a_block_per_epoch_is_still_trained_within_a_few_epochs():
    # 99 + 1 blocks, weights (1.0, 0.004): part 1's share is 0.4 of a block per epoch
    order = ExampleOrder((99 * BLOCK, BLOCK), 3, part_files=(1, 1), weights=(1.0, 0.004))
    drawn = part_blocks_per_epoch(order, range(99 * BLOCK, 100 * BLOCK), 5)
    assert sum(drawn[:3]) >= 1  # rounded the same way every epoch, it was never drawn
    share = 100 * 0.004 / 1.004
    assert all(abs(sum(drawn[: e + 1]) - (e + 1) * share) <= 1 for e in range(5))


def test_a_share_of_1_41_blocks_per_epoch_is_drawn_1_or_2_times_and_14_times_in_10_epochs():
    # part 1 is one block; weights put 1.41 blocks of 100 per epoch on it (whole extra copies)
    order = ExampleOrder((99 * BLOCK, BLOCK), 3, part_files=(1, 1), weights=(98.59, 1.41))
    drawn = part_blocks_per_epoch(order, range(99 * BLOCK, 100 * BLOCK), 10)
    assert set(drawn) == {1, 2} and sum(drawn) == 14  # rounded each epoch alone: 1 every time, 10
    first = part_blocks_per_epoch(order, range(99 * BLOCK), 10)
    assert all(abs(sum(first[: e + 1]) - (e + 1) * 98.59) <= 1 for e in range(10))


def test_the_carried_draw_is_reproducible_for_any_epoch_alone():
    order = ExampleOrder((99 * BLOCK, BLOCK), 3, part_files=(1, 1), weights=(1.0, 0.004))
    again = ExampleOrder((99 * BLOCK, BLOCK), 3, part_files=(1, 1), weights=(1.0, 0.004))
    assert whole_epoch(again, 4).tolist() == whole_epoch(order, 4).tolist()  # no epoch before it was computed


# ----------------------------------------------------------------------------------------------------------
# shard sets of real size: the order holds arrays of blocks, never one of examples


def test_the_order_of_ten_million_examples_holds_arrays_of_blocks_not_of_examples():
    order = ExampleOrder((100_000,) * 100, seed=3)  # 10M examples in 78,200 blocks of 128
    n = order.num_examples
    tracemalloc.start()
    try:
        for first in (0, n // 2, n - 256):  # a step at the start, the middle and across the end of epoch 0
            rows, _ = order.rows_at(np.arange(first, first + 512))
            assert len(set(rows.tolist())) == 512
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < n  # under a byte per example: one int64 per example would be 80 MB
    for epoch in (0, 1):
        blocks, bounds, first_blocks = order._epoch_windows(epoch)
        assert blocks.nbytes == 4 * order.num_blocks  # int32 block numbers, the one array as long as the order
        assert len(bounds) == len(first_blocks) <= n // WINDOW_ROWS + 2  # windows of at least 2**16 rows each


def reference_epoch(order: ExampleOrder, epoch: int) -> np.ndarray:
    """An epoch's rows by the order's definition, block by block (the code before the order kept block numbers)."""
    blocks = []
    for f, n in enumerate(order.rows_per_file):
        starts = np.arange(0, n, order.block_rows) + order.offsets[f]
        blocks += [(a, min(a + order.block_rows, order.offsets[f + 1])) for a in starts]
    blocks = np.asarray(blocks, dtype=np.int64).reshape(-1, 2)
    if order.weights is not None:
        part_of_file = np.repeat(np.arange(len(order.part_files)), order.part_files)
        part_of_block = part_of_file[np.searchsorted(order.offsets, blocks[:, 0], side="right") - 1]
        shares, drawn = len(blocks) * np.asarray(order.weights) / sum(order.weights), []
        for part, share in enumerate(shares):
            mine = np.flatnonzero(part_of_block == part)
            wanted = int(np.floor(share * (epoch + 1) + 0.5) - np.floor(share * epoch + 0.5))  # the carried rounding
            copies, rest = divmod(wanted, len(mine))
            drawn += [mine] * copies + [np.random.default_rng([order.seed, epoch, 2, part]).choice(mine, rest, False)]
        blocks = blocks[np.concatenate(drawn).astype(np.int64)]
    blocks = blocks[np.random.default_rng([order.seed, epoch, 0]).permutation(len(blocks))]
    windows, size = [[]], 0
    for i, (a, b) in enumerate(blocks):
        windows[-1].append(np.arange(a, b))
        size += b - a
        if size >= order.window_rows and i < len(blocks) - 1:
            windows.append([])
            size = 0
    return np.concatenate([
        np.concatenate(w)[np.random.default_rng([order.seed, epoch, 1, k]).permutation(sum(map(len, w)))]
        for k, w in enumerate(windows)
    ])  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [
        {"block_rows": 32, "window_rows": 100},
        {"block_rows": 7, "window_rows": 7},
        {"block_rows": 128},
        {"block_rows": 32, "window_rows": 200, "part_files": (3, 1), "weights": (1.0, 2.0)},
        {"block_rows": 16, "window_rows": 64, "part_files": (1, 3), "weights": (0.0, 1.0)},
    ],
)
def test_the_order_is_the_one_its_definition_gives_block_by_block(shards, options):
    _, rows = shards
    order = ExampleOrder((*rows[:2], 0, *rows[2:]), 11, **options) if "part_files" not in options else (
        ExampleOrder(rows, 11, **options))  # fmt: skip
    for epoch in range(3):
        got = order.rows_in_epoch(epoch, np.arange(order.epoch_size(epoch)))
        np.testing.assert_array_equal(got, reference_epoch(order, epoch))
