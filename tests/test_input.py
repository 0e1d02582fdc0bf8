"""A worker's input ahead of its loop (services.train.input): in a thread or in input processes, the same steps in the
same order as reading and masking each micro-batch in the loop would give, and masking a step at once equals
masking its micro-batches one by one."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from albert_core.examples.batch import mlm_batch, mlm_batches
from albert_core.model.config import ConfigError
from albert_core.text.tokenization import TokenIds
from services.rundir.config import RunConfig
from services.train.data import ShardRows, host_steps
from services.train.follow import EpochData, data_stream
from services.train.input import InputPlan, open_input
from services.train.plan import ShardSet
from services.train.step import make_micro_batch
from tests.synthetic import write_random_shards

FILE_ROWS = (300, 200, 90)
VOCAB = 60


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory) -> ShardSet:
    train = tmp_path_factory.mktemp("shards") / "train"
    write_random_shards(train, FILE_ROWS, vocab_size=VOCAB, rng=np.random.default_rng(0))
    files = tuple(sorted(str(p) for p in train.glob("*.parquet")))
    rows = tuple(pq.ParquetFile(f).metadata.num_rows for f in files)
    return ShardSet(str(train.parent), files, rows, (len(files),), ("part-0",), ("",) * len(files))


def run_config(**data) -> RunConfig:
    run = RunConfig()
    run.run.seed = 7
    run.train.global_batch_size, run.train.micro_batch_size, run.train.num_workers = 48, 8, 2
    run.optim.total_steps = 40
    for name, value in data.items():
        setattr(run.data, name, value)
    return run


def plan_for(shards: ShardSet, run: RunConfig, *, position: int, steps: int, rank: int = 1) -> InputPlan:
    first = EpochData.of(1, run.data.mixture)
    tail = None if run.data.follow else first  # a run that does not follow its set: every epoch on version 1
    return InputPlan(shards, run, TokenIds(vocab_size=VOCAB), (first,), tail, position, steps, rank=rank, world=2)


def per_micro_batch(plan: InputPlan) -> list[tuple[list[list[int]], list[dict[str, torch.Tensor]]]]:
    """The steps as the loop read them before: host_steps masking each micro-batch with make_micro_batch."""
    config, t = plan.config, plan.config.train
    stream = data_stream(plan.shards, config.run.seed, list(plan.epochs), tail=plan.tail)
    source = host_steps(
        ShardRows(plan.shards.files, plan.shards.order(plan.shards.version, config.run.seed)),
        position=plan.position,
        steps=plan.steps,
        global_batch=t.global_batch_size,
        micro_batch=t.micro_batch_size,
        rank=plan.rank,
        world=plan.world,
        mask=lambda rows, epochs: make_micro_batch(
            rows, seed=config.run.seed, epoch=epochs, ids=plan.token_ids, data=config.data
        ),  # fmt: skip
        stream=stream,
    )
    return [([r["example_id"].tolist() for r in rows], micro) for rows, micro in source]


def assert_same_steps(got, expected) -> None:
    assert len(got) == len(expected)
    for (rows, micro), (ids, micro_expected) in zip(got, expected, strict=True):
        assert [list(np.asarray(r["example_id"]).tolist()) for r in rows] == ids
        assert len(micro) == len(micro_expected)
        for batch, batch_expected in zip(micro, micro_expected, strict=True):
            assert batch.keys() == batch_expected.keys()
            for key in batch:
                assert torch.equal(batch[key], batch_expected[key]), key


@pytest.mark.parametrize("sop_order", ["stored", "epoch"])
def test_the_thread_gives_the_steps_masking_each_micro_batch_gave(shard_set, sop_order):
    plan = plan_for(shard_set, run_config(sop_order=sop_order), position=48 * 9, steps=6)  # crosses epoch 0's end
    with open_input(plan, workers=0, pin=False) as steps:
        got = list(steps)
    assert_same_steps(got, per_micro_batch(plan))


def test_input_processes_give_the_threads_steps_in_order(shard_set):
    plan = plan_for(shard_set, run_config(static_shapes=True), position=48 * 3, steps=9)
    with open_input(plan, workers=0, pin=False) as steps:
        expected = [([r["example_id"].tolist() for r in rows], micro) for rows, micro in steps]
    with open_input(plan, workers=2, pin=False) as steps:
        assert_same_steps(list(steps), expected)


def test_input_ends_before_a_step_past_the_decided_epochs(shard_set):
    run = run_config()
    run.data.follow = True  # the stream ends with its recorded epochs
    plan = plan_for(shard_set, run, position=0, steps=100)
    with open_input(plan, workers=0, pin=False) as steps:
        assert len(list(steps)) == sum(FILE_ROWS) // 48


def test_input_workers_must_be_a_count_of_processes():
    run = RunConfig()
    run.train.input_workers = -1
    with pytest.raises(ConfigError, match="train.input_workers"):
        run.validate()


def test_masking_a_steps_rows_at_once_equals_masking_each_micro_batch():
    rng = np.random.default_rng(3)
    n, vocab = 40, 500
    lengths = rng.integers(5, 120, n)
    ids = [np.r_[2, rng.integers(5, vocab, k - 2), 3] for k in lengths]
    columns = (ids, [np.zeros(k, dtype=np.int64) for k in lengths], rng.integers(0, 2, n).tolist(),
               [rng.random(k) < 0.8 for k in lengths], rng.integers(0, 2**40, n).tolist())  # fmt: skip
    for seq_len in (None, 128):
        options = {"seed": 1, "epoch": rng.integers(0, 3, n), "seq_len": seq_len, "vocab_size": vocab,
                   "special_ids": {0, 1, 2, 3, 4}, "mask_id": 4}  # fmt: skip
        together = mlm_batches(*columns, micro_batch=16, **options)
        assert [len(b["pair_labels"]) for b in together] == [16, 16, 8]
        for m, batch in enumerate(together):
            part = slice(16 * m, 16 * (m + 1))
            alone = mlm_batch(*(c[part] for c in columns), **{**options, "epoch": options["epoch"][part]})
            assert batch.keys() == alone.keys()
            for key in alone:
                np.testing.assert_array_equal(batch[key], alone[key], err_msg=key)
                assert batch[key].flags.c_contiguous


def test_a_run_with_its_input_in_processes_trains_the_threads_losses(ray_local, tmp_path):
    from tests.runs import run_training
    from tests.test_train import losses, run_config, train_lines
    from tests.test_train import write_shards as write_run_shards

    shards = write_run_shards(tmp_path / "shards")
    runs = {n: run_config(tmp_path / f"w{n}", shards, f"input{n}", input_workers=n) for n in (0, 1)}
    results = {n: run_training(config, resume=False) for n, config in runs.items()}
    assert all(result.finished and result.step == 8 for result in results.values())
    thread, processes = (losses(train_lines(results[n].metrics_file)) for n in (0, 1))
    assert len(thread) == 8 and processes == thread  # bit for bit: the same batches, the same steps
