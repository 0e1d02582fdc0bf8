"""The run's metrics log, `<run_dir>/metrics.jsonl`: its one name, its one writer and its readers.

One JSON object per line with "step", "time" and "kind": "train" (what the train loop reported), "eval"
(held-out and downstream metrics of a checkpoint, the run's own evaluations), "schedule_eval" (those of another
evaluation schedule, with its name) or "event" (run events: resumes, dropout changes, checkpoints saved / refused /
deleted, training health, evaluation failures). Lines are appended whole with one write (albert_core.files.append_line:
a line a full disk cannot take is cut back off and DiskFull raised, so the log holds whole lines only); a line torn
by a crash is cut off when the log is next opened for writing (`repair`) and skipped by readers; a rewrite
(`drop_train_lines_from`) replaces the file atomically. Writers in other processes and
threads (the evaluation schedulers, services.eval.schedule, beside the run's ledger) take the log's advisory lock
(`.metrics.jsonl.lock`) for every append and rewrite, so an append never lands in a copy that a rewrite is about to
replace.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from albert_core.files import METRICS_FILE, append_line, atomic_write_bytes, file_lock

__all__ = [
    "METRICS_FILE",
    "append",
    "append_event",
    "drop_train_lines_from",
    "follow",
    "plain",
    "read_metrics",
    "repair",
]
log = logging.getLogger(__name__)
LOCK_FILE = f".{METRICS_FILE}.lock"


def metrics_path(run_dir_or_file: str | Path) -> Path:
    path = Path(run_dir_or_file)
    return path / METRICS_FILE if path.is_dir() or path.suffix != ".jsonl" else path


def read_metrics(run_dir_or_file: str | Path) -> list[dict[str, Any]]:
    """The JSON lines of a metrics log (a run directory or the file); a torn last line (crash mid-write) is skipped."""
    path = metrics_path(run_dir_or_file)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s: skipping an unreadable line (%.60s)", path, line)
    return records


def last_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step (the last written wins: a resumed run may log a step twice), in step order."""
    by_step = {int(r["step"]): r for r in records if "step" in r}
    return [by_step[s] for s in sorted(by_step)]


def append(run_dir: str | Path, record: dict[str, Any]) -> None:
    """Append one line (a single write, so a line is whole or absent; DiskFull on a full disk)."""
    line = json.dumps(record, allow_nan=True) + "\n"
    with file_lock(Path(run_dir) / LOCK_FILE):
        append_line(Path(run_dir) / METRICS_FILE, line)


def append_event(run_dir: str | Path, step: int, event: str, **fields: Any) -> None:
    """Append a run event line."""
    append(run_dir, {"step": step, "time": time.time(), "kind": "event", "event": event, **fields})


def plain(value: Any) -> Any:
    """JSON-ready copy of a line's values: numpy / torch scalars become Python numbers, keys become strings."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    if hasattr(value, "item"):
        return value.item()
    raise ValueError(f"metrics value {value!r} ({type(value).__name__}) is not a number, string, list or dict")


def repair(run_dir: str | Path) -> int:
    """Cut a half-written last line (a crash mid-append); returns the bytes dropped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    with file_lock(Path(run_dir) / LOCK_FILE):
        data = path.read_bytes()
        if not data or data.endswith(b"\n"):
            return 0
        keep = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(keep)
    return len(data) - keep


def drop_train_lines_from(run_dir: str | Path, step: int) -> int:
    """Rewrite the log without the train lines at or past `step` (a resumed run reports them again)."""
    path = Path(run_dir) / METRICS_FILE
    with file_lock(Path(run_dir) / LOCK_FILE):
        lines = path.read_text().splitlines(keepends=True) if path.is_file() else []
        kept = [line for line in lines if not _is_train_line_from(line, step)]
        atomic_write_bytes(path, "".join(kept).encode())
    return len(lines) - len(kept)


def _is_train_line_from(line: str, step: int) -> bool:
    record = json.loads(line)
    return record.get("kind") == "train" and int(record.get("step", 0)) >= step


def follow(run_dir: str | Path, stop: threading.Event, poll_s: float = 0.5) -> Iterator[dict[str, Any]]:
    """Yield complete lines as they are appended; after `stop` is set, drain what is there once more and end."""
    path = Path(run_dir) / METRICS_FILE
    offset = 0
    while True:
        stopping = stop.is_set()
        if path.exists():
            with path.open("rb") as f:
                f.seek(offset)
                while line := f.readline():
                    if not line.endswith(b"\n"):
                        break  # partial line: read it again next time
                    offset += len(line)
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError:
                        continue
        if stopping:
            return
        stop.wait(poll_s)
