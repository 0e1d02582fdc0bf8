"""Durable files without torch: atomic writes (bytes, CSV), advisory locks, sha256 of files, disk space up front;
and the names of the files a model directory and a training checkpoint hold (services.rundir.checkpoints owns a
run's checkpoints: it writes and verifies their checksums).

Disk space up front: a command compares the free bytes of the filesystem its output goes to with what it will write
there, before it starts (`albert pretrain`: services/train/space.py; `albert preprocess`:
services/preprocess/space.py). Below the least it needs to keep any work (one checkpoint, one shard) it is refused;
below what it will write in all, warned in one line with the numbers, and it runs on (it keeps what it finished when
the disk fills). `check_space` takes the free bytes as a number, so both outcomes can be tested on any disk.

Used by model checkpoints, training checkpoints and the coordinator (which runs without importing torch).
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A model directory (albert_core.model.checkpoint): its config and its weights.
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# What a training checkpoint holds beside its model (services.rundir.checkpoints): the trainer's state, and the sha256
# and size of every file, {"files": {name: {"sha256": hex, "size": bytes}}, ...}, written last. A checkpoint written
# before the checksums had their own name holds them in LEGACY_CHECKSUM_FILE.
TRAINER_FILE = "trainer.json"
CHECKSUM_FILE = "CHECKSUMS.json"
LEGACY_CHECKSUM_FILE = "MANIFEST.json"
# A run's metrics log, one JSON object per line: pretraining runs (services.rundir.log owns its records) and
# fine-tuning runs (albert_core.finetune.finetuning) name it alike.
METRICS_FILE = "metrics.jsonl"


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated or does not fit the model; the message names the file."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint directory does not match its checksums; the message names the file and the mismatch."""


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fsync_file(path: str | Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside `path` durable (best effort: some filesystems do not support it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_state_json(text: str, source: str | Path, version: int, what: str = "state") -> dict[str, Any]:
    """A state file's JSON object, checked for its format version; the file is written atomically, so text that does
    not parse was edited by hand."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{source}: not valid JSON ({err}); it is written atomically, so it was edited") from None
    if data.get("version") != version:
        raise ValueError(f"{source}: {what} version {data.get('version')!r}, expected {version}")
    return data


@contextlib.contextmanager
def file_lock(path: str | Path, *, blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive advisory lock (flock) on `path` (created if absent) for the block; yields whether it is
    held (blocking=False: False at once when another process holds it). A process that dies releases it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class HeldLock:
    """An exclusive advisory lock (flock) held until `release()` or the holder's death, across calls (file_lock
    holds one for a block)."""

    def __init__(self, handle):
        self._handle = handle

    @classmethod
    def try_acquire(cls, path: str | Path) -> HeldLock | None:
        """The lock on `path` (created if absent), or None at once when another holder has it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return None
        return cls(handle)

    def release(self) -> None:
        if not self._handle.closed:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write via a temporary file in the same directory, fsync, rename: readers see the old or the new file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_csv(path: str | Path, rows: Iterable[dict[str, Any]], columns: list[str]) -> None:
    """A CSV file with a header of `columns` and one line per row (missing fields empty), written atomically."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({c: row.get(c, "") for c in columns})
    atomic_write_bytes(path, buffer.getvalue().encode())


def leaves_directory(name: str) -> bool:
    """Whether a file name a manifest lists would resolve outside the directory it is listed for: an absolute
    path or one with a `..` part (the rule for the names a checkpoint's checksums and a shard set's manifest.json
    list)."""
    return Path(name).is_absolute() or ".." in Path(name).parts


# --- disk space up front -----------------------------------------------------------------------------------


class NotEnoughSpace(ValueError):
    """The output's filesystem holds less than the least the command needs (exit status 65, bad data or config)."""


@dataclass(frozen=True)
class SpaceNeed:
    """What a command will write under `path`: `total` bytes in all (`what`: how that was counted), and `least`, the
    bytes of the first `unit` it keeps (a checkpoint, a shard), without which it keeps no work at all."""

    option: str  # the field or flag that names the output (run.output_dir, --output)
    path: str
    total: int
    least: int
    unit: str  # "checkpoint", "shard"
    what: str  # the plural subject of "need", e.g. "the run's 4 checkpoints of 46.2 MB (train.keep_last 3, ...)"


def free_bytes(path: str | Path) -> int | None:
    """Free bytes (for this user) of the filesystem that holds `path`, or would hold it once made; None where the
    filesystem does not say (then nothing is checked)."""
    existing = Path(path).resolve()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        return shutil.disk_usage(existing).free
    except OSError:
        return None


def check_space(need: SpaceNeed, free: int | None) -> str | None:
    """None when `free` bytes hold everything (or are unknown: None); the warning line when they hold less than that
    but at least `need.least`; NotEnoughSpace (one line) below that."""
    if free is None or free >= need.total:
        return None
    where = f"{need.option}: {need.path} has {size(free)} free on its filesystem"
    if free < need.least:
        raise NotEnoughSpace(
            f"{where}, less than one {need.unit} ({size(need.least)}); {need.what} need {size(need.total)}; free "
            f"space there or choose another {need.option}"
        )
    return f"{where}, less than the {size(need.total)} that {need.what} need; it may fill up before the end"


def size(n: int) -> str:
    """Bytes as a reader says them: 812 B, 46.2 MB, 3.1 GB (powers of 1000)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
