"""A run's data stream over a shard set that grows: what each epoch trains on (`EpochData`: the shard set's version
and the data.mixture in force) as the run's checkpoints record it, the example order that follows from it
(examples.order.DataStream), and, for a run with `data.follow`, the newest version read at an epoch boundary.

The checkpoint records every epoch that holds a trained example (TrainerState.epoch_versions / epoch_mixtures), so
a resume replays them whatever the config says now: a data.mixture changed, or data.follow turned on, between two
resumes takes effect from the next epoch boundary. Epochs not recorded are decided when the run reaches them: the
newest version for a run that follows its shard set, else the version of its last recorded epoch; with the mixture
the run is configured with then.

Parts are only ever appended (`albert preprocess --append-to`), so a newer version's files begin with the older
one's and every global row keeps its number. The new parts' files are checked against the manifest's sha256
before a run trains on them; a shard set that cannot be read, or whose older parts changed, is not followed (the
run keeps its version and logs why), so a bad append never stops a run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from albert_core.examples.order import DataStream, ExampleOrder
from albert_core.files import file_sha256
from albert_core.model.config import ConfigError
from services.train.plan import ShardSet, read_shard_set
from services.train.state import TrainerState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpochData:
    """What one epoch trains on: a version of the shard set, weighted by a mixture ((part, weight) pairs, sorted;
    empty: every example of the version once)."""

    version: int
    mixture: tuple[tuple[str, float], ...] = ()

    @classmethod
    def of(cls, version: int, mixture: Mapping[str, float]) -> EpochData:
        return cls(int(version), tuple(sorted((str(k), float(v)) for k, v in mixture.items())))


def recorded_epochs(state: TrainerState) -> list[EpochData]:
    """The epochs the run's state has decided, in order."""
    return [EpochData.of(v, m) for v, m in zip(state.epoch_versions, state.epoch_mixtures, strict=True)]


def record_epoch(state: TrainerState, epoch: EpochData) -> None:
    """Decide the run's next epoch (it goes into every checkpoint from now on)."""
    state.epoch_versions.append(epoch.version)
    state.epoch_mixtures.append(dict(epoch.mixture))


def record_trained_epochs(state: TrainerState, stream: DataStream) -> None:
    """Record every epoch up to the one holding the last example trained (an open-ended stream's later epochs train
    its last key, the run's choice for an epoch it reaches without following its shard set)."""
    last = stream.epoch_of(state.examples_seen - 1) if state.examples_seen else 0
    while len(state.epoch_versions) <= last:
        record_epoch(state, stream.key(len(state.epoch_versions)))


def data_stream(shards: ShardSet, seed: int, epochs: list[EpochData], *, tail: EpochData | None) -> DataStream:
    """The stream of these epochs; with a `tail`, open-ended: every epoch after them trains it."""
    orders: dict[EpochData, ExampleOrder] = {}

    def order_of(epoch: EpochData) -> ExampleOrder:
        if epoch not in orders:
            orders[epoch] = shards.order(epoch.version, seed, dict(epoch.mixture))
        return orders[epoch]

    return DataStream(order_of, [*epochs, *([tail] if tail else [])], open_ended=tail is not None)


def newest_version(current: ShardSet, trained: int) -> ShardSet:
    """The shard set as its manifest lists it now, the files of the parts past version `trained` (the last one
    trained on) verified; `current` when it cannot be followed (unreadable, an older part changed, a new file
    whose sha256 differs), with the reason logged."""
    try:
        newest = read_shard_set(Path(current.directory))
        if newest.files[: len(current.files)] != current.files or newest.version < current.version:
            raise ConfigError(f"data.shards: {current.directory}: its parts changed (parts may only be appended)")
        _verify_files(newest, first=sum(newest.part_files[:trained]))
    except (ConfigError, OSError) as err:
        log.warning("not following the shard set, keeping version %d: %s", current.version, err)
        return current
    return newest


def _verify_files(shards: ShardSet, *, first: int) -> None:
    """Every file from index `first` on has the sha256 manifest.json records for it."""
    for path, digest in zip(shards.files[first:], shards.sha256[first:], strict=True):
        if digest and file_sha256(path) != digest:
            raise ConfigError(f"data.shards: {path}: sha256 differs from manifest.json")
