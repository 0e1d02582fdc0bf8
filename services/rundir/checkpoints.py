"""A run's checkpoints: the one owner of `<run_dir>/checkpoints/` (torchtitan's CheckpointManager is the model).

    <run_dir>/checkpoints/step_00001000/   config.json, model.safetensors (the model: albert_core.model.checkpoint),
                                           optimizer.safetensors, trainer.json, CHECKSUMS.json (written last)

- names: `checkpoint_dir` and the files a training checkpoint holds (TRAINING_FILES; MODEL_FILES: what evaluation
  loads);
- writing: `writing` hands the writer (services.train.state, which fills the files with torch) a hidden temporary
  directory, records the checksums of its files last and renames it into place whole, so a reader sees a complete
  checkpoint or none;
- verification: `verify` checks every file against the checksums, what a caller needs listed being a parameter
  (a checkpoint written before the checksums had their own name holds them in MANIFEST.json: read still);
- listing and the newest good one: `list_checkpoints`, `latest_good`: the checkpoint a resume, `--dry-run` and
  `albert status` all name;
- the ledger's index (`CheckpointEntry`): a cache of the directory that `reindex` rebuilds from it;
- retention: `retain` deletes the run's own checkpoints that are not kept.

Torch-free and Ray-free, so that `albert status`, schedules and the ledger read checkpoints without loading a
trainer.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from albert_core.files import (
    CHECKSUM_FILE,
    CONFIG_FILE,
    LEGACY_CHECKSUM_FILE,
    TRAINER_FILE,
    WEIGHTS_FILE,
    CorruptCheckpoint,
    atomic_write_bytes,
    disk_full_as,
    file_sha256,
    fsync_dir,
    fsync_file,
    leaves_directory,
)

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"  # under the run directory
OPTIMIZER_FILE = "optimizer.safetensors"
FORMAT = "albert-train-state"
VERSION = 1
MODEL_FILES = (CONFIG_FILE, WEIGHTS_FILE)  # what evaluation loads
TRAINING_FILES = (*MODEL_FILES, OPTIMIZER_FILE, TRAINER_FILE)  # what a resume loads
STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """`root/step_XXXXXXXX`: zero-padded so names sort by step."""
    return Path(root) / f"step_{step:08d}"


# --- writing ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def writing(
    final: str | Path, extra: Iterable[str] = (), needed: Callable[[], int] = lambda: 0, **fields: Any
) -> Iterator[Path]:
    """Write a training checkpoint at `final` whole or not at all: the caller writes TRAINING_FILES (and the `extra`
    files it names: the run's tokenizer) into the temporary directory yielded (beside `final`, hidden); then their
    checksums (with `fields`) are recorded and it is renamed to `final`, replacing one there. On any error the
    temporary directory is removed and `final`, as the other checkpoints, stays as it was; a full disk is DiskFull
    (`needed`: counts the checkpoint's bytes for its line), and nothing of the checkpoint is left to index."""
    final = Path(final)
    with disk_full_as(final, needed, functools.partial(kept_checkpoints, final.parent, final)):
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            yield tmp
            write_checksums(tmp, (*TRAINING_FILES, *extra), format=FORMAT, version=VERSION, **fields)
            _replace_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def kept_checkpoints(root: Path, but: Path | None = None) -> str:
    """What a run that met a full disk keeps: the checkpoints under `root` (but `but`, the one not written), named."""
    others = [path.name for _, path in list_checkpoints(root) if path != but]
    kept = f"the run's {len(others)} checkpoint(s), the newest {others[0]}" if others else "no checkpoint yet"
    return kept if but is None else f"{kept} (nothing of {but.name} was written)"


def write_checksums(directory: str | Path, names: Iterable[str], **fields: Any) -> dict[str, Any]:
    """fsync the named files of `directory` and record their sha256 and size in its CHECKSUMS.json (atomically)."""
    directory = Path(directory)
    files = {}
    for name in names:
        path = directory / name
        fsync_file(path)
        files[name] = {"sha256": file_sha256(path), "size": path.stat().st_size}
    checksums = {**fields, "files": files}
    atomic_write_bytes(directory / CHECKSUM_FILE, (json.dumps(checksums, indent=2) + "\n").encode())
    return checksums


def _replace_dir(tmp: Path, final: Path) -> None:
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --- verification ----------------------------------------------------------------------------------------------


def checksum_file(directory: str | Path) -> Path:
    """The file that holds a checkpoint's checksums: CHECKSUMS.json, or MANIFEST.json in one written before."""
    directory = Path(directory)
    legacy = directory / LEGACY_CHECKSUM_FILE
    return legacy if legacy.is_file() and not (directory / CHECKSUM_FILE).is_file() else directory / CHECKSUM_FILE


def verify(directory: str | Path, files: Iterable[str] = TRAINING_FILES) -> dict[str, Any]:
    """Check every file the checkpoint's checksums list; returns them. `files`: the names they must list (a resume
    needs TRAINING_FILES, an evaluation MODEL_FILES).

    Raises CorruptCheckpoint naming the file for: missing or unreadable checksums, checksums lacking one of `files`
    or naming a path outside the directory, a missing file, a size mismatch (truncated / too long) or a sha256
    mismatch.
    """
    directory = Path(directory)
    listing = checksum_file(directory)
    if not directory.is_dir():
        raise CorruptCheckpoint(f"{directory}: not a directory")
    if not listing.is_file():
        raise CorruptCheckpoint(f"{listing}: missing (a partial or foreign checkpoint)")
    try:
        checksums = json.loads(listing.read_text())
        listed = checksums["files"]
        if not isinstance(listed, dict):
            raise TypeError("'files' is not an object")
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CorruptCheckpoint(f"{listing}: unreadable checksums ({err})") from None
    for name in files:
        if name not in listed:
            raise CorruptCheckpoint(f"{listing}: lists no {name}")
    for name, expected in listed.items():
        _check_file(directory, listing, name, expected)
    return checksums


def _check_file(directory: Path, listing: Path, name: str, expected: Any) -> None:
    if leaves_directory(name):
        raise CorruptCheckpoint(f"{listing}: file name {name!r} leaves the checkpoint directory")
    if not isinstance(expected, dict) or not isinstance(expected.get("sha256"), str) or "size" not in expected:
        raise CorruptCheckpoint(f"{listing}: entry for {name} lacks sha256 or size")
    path = directory / name
    if not path.is_file():
        raise CorruptCheckpoint(f"{path}: missing")
    size = path.stat().st_size
    if size != expected["size"]:
        kind = "truncated" if size < expected["size"] else "too long"
        raise CorruptCheckpoint(f"{path}: {kind}: {size} bytes, {listing.name} says {expected['size']}")
    digest = file_sha256(path)
    if digest != expected["sha256"]:
        raise CorruptCheckpoint(
            f"{path}: checksum mismatch (sha256 {digest[:12]}…, {listing.name} says {expected['sha256'][:12]}…)"
        )


def read_trainer_json(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / TRAINER_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptCheckpoint(f"{path}: not valid JSON ({err})") from None
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise CorruptCheckpoint(
            f"{path}: format {data.get('format')!r} version {data.get('version')!r}, expected {FORMAT!r} {VERSION}"
        )
    return data


# --- listing and the newest good one ---------------------------------------------------------------------------


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step_*` directory under root, newest first. Hidden temporaries are not listed, nor a
    `step_*` that is a link (it is not this run's own directory)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and not child.is_symlink():
            found.append((int(match.group(1)), child))
    return sorted(found, reverse=True)


Damaged = Callable[[int, Path, CorruptCheckpoint], None]


def latest_good(root: str | Path, on_damaged: Damaged | None = None) -> Path | None:
    """The newest checkpoint under root that verifies (every training file): what a resume loads. Damaged or partial
    ones are skipped with a warning, and handed to `on_damaged(step, path, error)`."""
    for step, path in list_checkpoints(root):
        try:
            verify(path)
        except CorruptCheckpoint as err:
            log.warning("skipping damaged checkpoint %s: %s", path, err)
            if on_damaged is not None:
                on_damaged(step, path, err)
            continue
        return path
    return None


# --- the ledger's index: a cache of the directory --------------------------------------------------------------


@dataclass
class CheckpointEntry:
    step: int
    path: str
    metrics: dict[str, Any] = field(default_factory=dict)  # the train loop's last metrics when it saved
    time: float = 0.0
    reported: bool = True  # the train loop's checkpoint_saved reached the ledger (False: found on disk before it)


@dataclass
class RefusedCheckpoint:
    step: int
    path: str
    reason: str
    time: float = 0.0
    metrics: dict[str, Any] | None = None


@dataclass
class Reindexed:
    index: list[CheckpointEntry]  # by step
    added: list[CheckpointEntry]  # on disk, not in the cache, verified
    gone: list[CheckpointEntry]  # in the cache, not on disk


def reindex(root: str | Path, cached: list[CheckpointEntry]) -> Reindexed:
    """The index of the checkpoints under root, rebuilt from the directory: for each step on disk, the cached entry
    of that step (its metrics kept, its path the one on disk: the cache of a copied run directory names its
    source's) or, when the cache lacks it, a new entry if it verifies (one cut short by a crash does not)."""
    by_step = {entry.step: entry for entry in cached}
    index, added = [], []
    for step, path in reversed(list_checkpoints(root)):
        entry = by_step.pop(step, None)
        if entry is None:
            try:
                verify(path)
            except CorruptCheckpoint:
                continue
            entry = CheckpointEntry(step, str(path), {}, time.time(), reported=False)
            added.append(entry)
        entry.path = str(path)
        index.append(entry)
    return Reindexed(index, added, sorted(by_step.values(), key=lambda c: c.step))


def own_step_dir(root: str | Path, path: str | Path, step: int) -> str | None:
    """Why `path` is not the directory of `step` in this run's `root` (None when it is): the index holds only those."""
    path, root = Path(path), Path(root)
    match = STEP_DIR.match(path.name)
    if match is None or int(match.group(1)) != step:
        return f"{path}: not the directory of step {step} (step_{step:08d})"
    if path.is_symlink() or path.resolve().parent != root.resolve():
        return f"{path}: outside this run's {root}"
    return None


# --- retention -------------------------------------------------------------------------------------------------


@dataclass
class Retention:
    deleted: list[CheckpointEntry] = field(default_factory=list)
    failed: list[tuple[CheckpointEntry, str]] = field(default_factory=list)  # still on disk and indexed: why


def retain(index: list[CheckpointEntry], root: str | Path, *, keep_last: int, keep: set[int]) -> Retention:
    """Delete from disk and from `index` every checkpoint that is neither among the last `keep_last` nor in `keep`
    (the ledger's: the best evaluated, those an evaluation or a schedule still needs). Only a directory of this
    run's `root` is deleted, which is all the index holds (reindex, the ledger's checkpoint_saved)."""
    kept = {c.step for c in index[-keep_last:]} | keep
    result = Retention()
    for entry in [c for c in index if c.step not in kept]:
        why = own_step_dir(root, entry.path, entry.step)
        if why is None:
            try:
                shutil.rmtree(entry.path)
            except FileNotFoundError:
                pass
            except OSError as err:
                why = str(err)
        if why is not None:
            result.failed.append((entry, why))
            continue
        index.remove(entry)
        result.deleted.append(entry)
    return result
