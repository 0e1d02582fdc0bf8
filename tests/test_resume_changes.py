"""A run resumed under a changed data config: `--set data.follow=true` on a run that did not follow, another
`data.mixture`. The checkpoint records the version and mixture of every epoch trained so far, so the saved data
position keeps meaning the same rows; the change takes effect from the next epoch boundary (deploy.md, "Training on
a shard set that grows").

The worker loop's data path (services.train.worker: start_versions, advance, follow_shard_set) on shard sets
described in memory: the example order needs only row counts, so no file is read and no model trained."""

from __future__ import annotations

import copy
import dataclasses
import json
from types import SimpleNamespace

import numpy as np

from albert_core.text.tokenization import TokenIds
from services.rundir.config import RunConfig
from services.train import worker as loop
from services.train.plan import ShardSet, WorkerPlan
from services.train.state import TrainerState

BATCH = 100
FILES = ("/shards/train/shard-00000.parquet", "/shards/train/shard-00001.parquet")
ONE_PART = ShardSet("/shards", FILES[:1], (1000,), (1,), ("part-0",), ("",))
TWO_PARTS = ShardSet("/shards", FILES, (1000, 1000), (1, 1), ("part-0", "news"), ("", ""))


def make_worker(shards: ShardSet, **data) -> loop.Worker:
    config = RunConfig.from_dict(
        {
            "run": {"seed": 5},
            "data": {"shards": shards.directory, **data},
            "train": {"global_batch_size": BATCH, "micro_batch_size": BATCH},
        }
    )
    plan = WorkerPlan(config=config, run_dir="/runs/r", token_ids=TokenIds(vocab_size=64), shards=shards)
    return loop.Worker(plan, rank=0, world=1, distributed=False, backend=None, record=None, shards=shards)


def start(worker: loop.Worker, state: TrainerState | None = None) -> TrainerState:
    state = state or TrainerState()
    loop.start_versions(worker, state)
    return state


def train(worker: loop.Worker, state: TrainerState, steps: int, monkeypatch, newest: ShardSet) -> list[tuple]:
    """What train_steps does to the data position, step by step: each step's (rows, epochs); where the input ends
    (an epoch not decided yet, for a run that follows its shard set) the loop decides it and reads on."""
    monkeypatch.setattr(loop, "newest_version", lambda current, trained: newest)
    trained = []
    for _ in range(steps):
        if state.examples_seen + BATCH > worker.stream.end:
            loop.follow_shard_set(worker, state)
            worker.stream = loop.decided_stream(worker, state)
        rows, epochs = worker.stream.rows_at(np.arange(state.examples_seen, state.examples_seen + BATCH))
        loop.advance(worker, state, SimpleNamespace(tokens=0))
        trained.append((rows.tolist(), epochs.tolist()))
    return trained


def checkpoint(state: TrainerState) -> TrainerState:
    """The state as a resume reads it back from trainer.json."""
    return TrainerState.from_dict(json.loads(json.dumps(dataclasses.asdict(state))), source="trainer.json")


def test_follow_turned_on_at_a_resume_trains_the_current_epoch_on_as_before_and_the_new_part_from_the_next(
    monkeypatch,
):
    before = make_worker(ONE_PART)
    state = start(before)
    train(before, state, 25, monkeypatch, ONE_PART)  # position 2,500: epoch 2 of 1,000 examples
    assert state.epoch == 2 and state.epoch_versions == [1, 1, 1]
    saved = checkpoint(state)
    straight = train(before, copy.deepcopy(state), 5, monkeypatch, ONE_PART)  # the rest of epoch 2, not following

    after = make_worker(TWO_PARTS, follow=True)  # a part appended, resumed with --set data.follow=true
    resumed = start(after, saved)
    assert resumed.epoch == 2 and resumed.epoch_versions == [1, 1, 1]
    assert train(after, resumed, 5, monkeypatch, TWO_PARTS) == straight
    next_epoch = train(after, resumed, 20, monkeypatch, TWO_PARTS)  # epoch 3: version 2's 2,000 examples
    assert resumed.epoch_versions == [1, 1, 1, 2]
    rows = np.concatenate([r for r, _ in next_epoch])
    expected = TWO_PARTS.order(2, 5).rows_in_epoch(3, np.arange(2000))
    assert rows.tolist() == expected.tolist() and {e for _, es in next_epoch for e in es} == {3}


def test_a_checkpoint_that_recorded_only_its_first_epoch_is_read_as_the_run_that_did_not_follow_trained_it(
    monkeypatch,
):
    written_before = TrainerState(step=25, examples_seen=2500, epoch=2, epoch_versions=[1])
    resumed = start(make_worker(TWO_PARTS, follow=True), checkpoint(written_before))
    assert resumed.epoch == 2 and resumed.epoch_versions == [1, 1, 1]


def test_another_mixture_at_a_resume_keeps_the_current_epochs_rows_and_weighs_the_next_epoch(monkeypatch):
    even, news_x3 = {"part-0": 1.0, "news": 1.0}, {"part-0": 1.0, "news": 3.0}
    before = make_worker(TWO_PARTS, mixture=even)
    state = start(before)
    train(before, state, 25, monkeypatch, TWO_PARTS)  # position 2,500: in epoch 1 (about 2,000 per epoch)
    assert state.epoch == 1 and state.epoch_mixtures == [even, even]
    saved = checkpoint(state)
    straight = train(before, copy.deepcopy(state), 20, monkeypatch, TWO_PARTS)

    after = make_worker(TWO_PARTS, mixture=news_x3)
    resumed = start(after, saved)
    steps = train(after, resumed, 20, monkeypatch, TWO_PARTS)
    assert resumed.epoch_mixtures == [even, even, news_x3]
    old, new = TWO_PARTS.order(2, 5, even), TWO_PARTS.order(2, 5, news_x3)
    boundary = old.epoch_size(0) + old.epoch_size(1)  # epoch 2 starts where the epochs drawn with `even` end
    positions = np.arange(2500, 2500 + 20 * BATCH)
    rows, was = np.concatenate([r for r, _ in steps]), np.concatenate([r for r, _ in straight])
    in_epoch_1 = positions < boundary
    assert 0 < in_epoch_1.sum() < len(positions)
    assert rows[in_epoch_1].tolist() == was[in_epoch_1].tolist()  # epoch 1 as it was drawn
    expected = new.rows_in_epoch(2, positions[~in_epoch_1] - boundary)
    assert rows[~in_epoch_1].tolist() == expected.tolist()  # epoch 2 weighted by the new mixture
