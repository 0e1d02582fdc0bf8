"""Durable files without torch: atomic writes (bytes, CSV), advisory locks, sha256 of files, disk space up front;
and the names of the files a model directory and a training checkpoint hold (services.rundir.checkpoints owns a
run's checkpoints: it writes and verifies their checksums).

Disk space up front: a command compares the free bytes of the filesystem its output goes to with what it will write
there, before it starts (`albert pretrain`: services/train/space.py; `albert preprocess`:
services/preprocess/space.py). Below the least it needs to keep any work (one checkpoint, one shard) it is refused;
below what it will write in all, warned in one line with the numbers, and it runs on (it keeps what it finished when
the disk fills). `check_space` takes the free bytes as a number, so both outcomes can be tested on any disk.

A full disk while writing (issue 39 item 1): every writer of a run and of preprocessing writes through
`atomic_write_bytes` (a temporary file in the same directory, fsync, rename: readers see the old file or the new
one), `append_line` (one whole line or none: a line the disk cannot take is cut back off), `replacing` (a writer of
its own writes a partial file that then replaces the target: model weights, Parquet, numpy) or `disk_full_as` (around
a writer of its own that leaves only a temporary file behind, removed on error: a checkpoint directory, a shard).
On ENOSPC or EDQUOT each raises DiskFull, one line: the path, the bytes it needed, the bytes free there and what
was kept. The commands print it and exit EXIT_DISK_FULL (services.terminal); after space is freed the same command
resumes from what was kept.

Used by model checkpoints, training checkpoints and the coordinator (which runs without importing torch).
"""

from __future__ import annotations

import contextlib
import csv
import errno
import fcntl
import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
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


def atomic_write_bytes(path: str | Path, data: bytes, kept: str | None = None) -> None:
    """Write via a temporary file in the same directory, fsync, rename: readers see the old or the new file. A full
    disk removes the temporary file and raises DiskFull (`kept`: what stays, said in its line; by default the file
    as it was, or none)."""
    path = Path(path)
    if kept is None:
        kept = "the previous file, unchanged" if path.exists() else "nothing (the file was not created)"
    with disk_full_as(path, len(data), kept):
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


def atomic_write_text(path: str | Path, text: str, kept: str | None = None) -> None:
    """`atomic_write_bytes` of UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"), kept)


def atomic_write_json(path: str | Path, data: Any, kept: str | None = None, **dumps: Any) -> None:
    """A JSON document (indent 2 unless `dumps` says otherwise) with a final newline, written atomically."""
    atomic_write_text(path, json.dumps(data, **{"indent": 2, **dumps}) + "\n", kept)


def append_line(path: str | Path, line: str) -> None:
    """Append one line to `path` with a single write: the line is whole or absent. A full disk cuts back what part
    of it was written and raises DiskFull, so that the file keeps only whole lines (the caller holds any lock that
    other appenders take)."""
    data = line.encode("utf-8") if line.endswith("\n") else (line + "\n").encode("utf-8")
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        with disk_full_as(path, len(data), "its earlier lines, whole (this line was not written)"):
            try:
                written = os.write(fd, data)
                if written != len(data):  # a short write: the disk took part of the line
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            except BaseException:
                os.ftruncate(fd, start)
                raise
    finally:
        os.close(fd)


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


# --- a full disk while writing -----------------------------------------------------------------------------


class DiskFull(Exception):
    """A write met a full disk (ENOSPC, EDQUOT): one line naming the path, the bytes it needed, the bytes free and
    what was kept (exit status EXIT_DISK_FULL, services.terminal). Not an OSError, so that no `except OSError` of a
    reader takes it for a missing file."""

    def __init__(self, line: str, path: str = ""):
        super().__init__(line)
        self.path = path

    def __reduce__(self):  # whole across Ray (a worker's or a task's error reaches the driver as this line)
        return (DiskFull, (str(self), self.path))


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How libraries that do not set errno say it: pyarrow ("[errno 28] No space left on device"), safetensors (Rust's
# "Os { code: 28, kind: StorageFull, ... }"), numpy and the standard library (strerror).
_FULL_WORDS = ("No space left on device", "Disk quota exceeded", "StorageFull", "QuotaExceeded")


def is_disk_full(err: BaseException) -> bool:
    """Whether `err` (or what it was raised from) says the disk or the user's quota is full."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL_ERRNOS:
            return True
        if any(word in str(seen) for word in _FULL_WORDS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def disk_full_line(path: str | Path, needed: int, kept: str) -> str:
    """The one line of a DiskFull: the path, the bytes it needed and the bytes free there, what was kept."""
    free = free_bytes(path)
    there = "" if free is None else f", {size(free)} free"
    return f"{path}: disk full ({size(needed)} to write{there}); kept {kept}; free space and run the same command again"


@contextlib.contextmanager
def replacing(
    path: str | Path, partial: str | Path, needed: int | Callable[[], int], kept: str | Callable[[], str]
) -> Iterator[Path]:
    """For a writer of its own (Parquet, numpy): the block writes `partial`, which then replaces `path`. On any error
    `partial` is removed and `path` stays as it was; a full disk is DiskFull naming `path` (disk_full_as)."""
    partial = Path(partial)
    with disk_full_as(path, needed, kept):
        try:
            yield partial
            os.replace(partial, path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise


@contextlib.contextmanager
def disk_full_as(path: str | Path, needed: int | Callable[[], int], kept: str | Callable[[], str]) -> Iterator[None]:
    """Turn a full disk met in the block into DiskFull naming `path`, `needed` bytes and what was `kept` (each may be
    a function, called only then); other errors pass through. The block removes what it half wrote itself. A
    DiskFull of a writer inside (a checkpoint's model file) is said as this one, the owner of what was kept."""
    try:
        yield
    except Exception as err:
        if not (isinstance(err, DiskFull) or is_disk_full(err)):
            raise
        needed, kept = needed() if callable(needed) else needed, kept() if callable(kept) else kept
        raise DiskFull(disk_full_line(path, needed, kept), str(path)) from None
