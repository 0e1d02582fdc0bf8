"""A run's data stream over a shard set that grows: the example order of each epoch's version (albert_core.
data_order.DataStream), and, for a run with `data.follow`, the newest version read at an epoch boundary.

Parts are only ever appended (`albert preprocess --append-to`), so a newer version's files begin with the older
one's and every global row keeps its number. The new parts' files are checked against the manifest's sha256
before a run trains on them; a shard set that cannot be read, or whose older parts changed, is not followed (the
run keeps its version and logs why), so a bad append never stops a run.
"""

from __future__ import annotations

import logging
from pathlib import Path

from albert_core.config import ConfigError
from albert_core.data_order import DataStream, ExampleOrder
from albert_core.files import file_sha256
from services.run.config import RunConfig
from services.train.plan import ShardSet, read_shard_set

log = logging.getLogger(__name__)


def data_stream(shards: ShardSet, run: RunConfig, versions: list[int], *, open_ended: bool | None = None) -> DataStream:
    """The run's stream: epoch e in the order of version versions[e]; open-ended (later epochs keep the last
    version) unless the run follows its shard set."""
    orders: dict[int, ExampleOrder] = {}

    def order_of(version: int) -> ExampleOrder:
        if version not in orders:
            orders[version] = shards.order(version, run.run.seed, run.data.mixture)
        return orders[version]

    open_ended = not run.data.follow if open_ended is None else open_ended
    return DataStream(order_of, versions, open_ended=open_ended)


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
