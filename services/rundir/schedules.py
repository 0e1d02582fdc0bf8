"""An evaluation schedule's durable state: `<run_dir>/schedules/NAME.json`, its one owner.

A schedule evaluates, once each, the checkpoints of a run that are the first at or past each multiple of `every`
(every multiple, when checkpoints fall on them), and with `final` the run's last checkpoint too. The run's own
schedule, RECIPE, comes from its recipe's [eval] (services.rundir.evaluations); `albert eval schedule RUN --every N`
adds others. All are run by the one orchestrator, services.eval.schedule. A schedule's file holds what it was asked
to do (`ScheduleSpec`) and where it stands: the steps done (with their metrics; the result line is in the run's
metrics log: kind "eval" for RECIPE, "schedule_eval" with the schedule's name for the others), missing (the
checkpoint was gone before the schedule could evaluate it, with the reason), failed (the evaluation raised or the
checkpoint was damaged), pending (seen on disk, not yet settled), and whether it was cancelled or is complete (the
run finished and nothing is pending).

Exactly once: a step is recorded done only after its result line was appended to metrics.jsonl, and a scheduler
that starts reconciles the file from metrics.jsonl (a result line already there = done), so a crash between the
two neither repeats nor loses a step. Every change is a read-modify-write under an advisory lock (`update`),
written atomically, so a cancellation from the CLI is never overwritten by the scheduler. `RUN_LOCK` is held by the
one process that runs a schedule, for as long as it runs it.

Nothing here needs Ray or torch: the ledger reads the files for retention (checkpoints a live schedule still has to
evaluate are kept), `albert status` and `albert eval list` read them for progress.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from albert_core.files import atomic_write_bytes, file_lock, read_state_json
from services.rundir.checkpoints import checksum_file

SCHEDULES_DIR = "schedules"
RECIPE = "recipe"  # the run's own schedule, from its recipe's [eval] (services.rundir.evaluations)
RECIPE_RESULT_KIND = "eval"  # the kind of its result lines in metrics.jsonl: the run's held-out evaluations
RESULT_KIND = "schedule_eval"  # the kind of another schedule's result lines (with its name)
HEARTBEAT_SUFFIX = ".alive"  # touched by the scheduler while it runs
LIVE_WITHIN_S = 30.0
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
VERSION = 1
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule evaluates; fixed when it is created (attaching again with another spec is refused), but for
    the run's own, RECIPE, whose spec follows the recipe's [eval] (`adopt`)."""

    name: str
    every: int
    heldout: str  # the held-out documents file (absolute)
    tasks: tuple[str, ...] = ()
    task_data: tuple[str, ...] = ()  # one directory per task, in order
    task_seeds: int = 0  # 0: the task's protocol
    task_max_steps: int = 0
    cpus: float = 1.0  # per evaluator, only out of CPUs beyond training's (services.eval.schedule.schedule_cpus)
    final: bool = False  # also the run's last checkpoint, whatever its step (the run's own schedule)

    def matches(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    @property
    def result_kind(self) -> str:
        return RECIPE_RESULT_KIND if self.name == RECIPE else RESULT_KIND

    def owns(self, record: dict[str, Any]) -> bool:
        """Whether a metrics.jsonl line is one of this schedule's results (the run's "eval" lines are RECIPE's)."""
        if record.get("kind") != self.result_kind:
            return False
        return self.name == RECIPE or record.get("schedule") == self.name

    def same_job(self, other: ScheduleSpec) -> bool:
        """Same steps, same evaluation (the CPUs may differ between attachments)."""
        return dataclasses.replace(self, cpus=0) == dataclasses.replace(other, cpus=0)

    def describe(self) -> str:
        tasks = f", tasks {', '.join(self.tasks)}" if self.tasks else ""
        return f"{self.when()}, held-out {self.heldout}{tasks}"

    def when(self) -> str:
        every = f"every {self.every} steps" if self.every else ""
        end = "at the end" if self.final else ""
        return " and ".join(part for part in (every, end) if part) or "never"


@dataclass
class ScheduleState:
    spec: ScheduleSpec
    created: float = field(default_factory=time.time)
    done: dict[int, str] = field(default_factory=dict)  # step -> checkpoint evaluated
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)  # step done -> its result's metrics
    missing: dict[int, str] = field(default_factory=dict)  # step -> why it could not be evaluated
    failed: dict[int, str] = field(default_factory=dict)  # step -> the evaluation's error
    pending: list[int] = field(default_factory=list)  # covered checkpoints seen on disk, not settled yet
    # step -> the checkpoint (checkpoint_identity; "" when none was on disk) a missing or failed step was settled on:
    # one saved again at that step since (a resume) is due again
    settled_as: dict[int, str] = field(default_factory=dict)
    cancelled: bool = False
    complete: bool = False
    starts: int = 0  # scheduler (re)starts
    # Its scheduler did not renew its lease (the heartbeat) for eval.schedule_lease_s: it holds no checkpoint from
    # retention until a scheduler runs it again (which reports the steps it missed meanwhile).
    lease_lapsed: bool = False
    # Steps due besides the multiples of `every`, noted as they are seen: the first checkpoint past a multiple when
    # checkpoints fall off the multiples, the run's last checkpoints (spec.final), evaluations a run made before its
    # recipe's were a schedule had left pending.
    extra_steps: list[int] = field(default_factory=list)
    version: int = VERSION

    # --- decisions (pure) ---

    def settled(self, step: int) -> bool:
        return step in self.done or step in self.missing or step in self.failed

    def active(self) -> bool:
        return not (self.cancelled or self.complete)

    def covers(self, step: int) -> bool:
        """Whether the schedule evaluates the checkpoint of this step (as far as the steps seen so far tell)."""
        return self.spec.matches(step) or step in self.extra_steps

    def unsettled(self, steps: Iterable[int]) -> list[int]:
        """The covered steps among `steps` that are neither done, missing nor failed, in order."""
        return sorted({s for s in steps if self.covers(s) and not self.settled(s)})

    def observe(
        self,
        on_disk: Iterable[int],
        saved: dict[int, str],
        identities: dict[int, str] | None = None,
        finals: Iterable[int] = (),
    ) -> None:
        """What the run has now: checkpoints on disk, and every step the run's log says was saved (step -> why it
        is not on disk, for those gone). A covered step saved but no longer on disk and not settled is missing.
        `identities`: of checkpoints on disk (at least those of missing or failed steps); a missing or failed step
        whose checkpoint is another than the one it was settled on (saved again) is due again. `finals`: the steps
        the run saved as its last (due with spec.final)."""
        on_disk = set(on_disk)
        self.note_due(on_disk | set(saved), finals)
        for step, identity in (identities or {}).items():
            if step in on_disk and step in self.settled_as and self.settled_as[step] != identity:
                self.missing.pop(step, None)
                self.failed.pop(step, None)
                self.settled_as.pop(step)
        for step in self.unsettled(saved):
            if step not in on_disk:
                self.mark_missing(step, saved[step])
        self.pending = self.unsettled(on_disk)

    def note_due(self, saved: Iterable[int], finals: Iterable[int] = ()) -> None:
        """Note the steps due off the multiples of `every` among every step the run saved: a checkpoint whose step
        passes a multiple that the run's previous checkpoint had not, and the run's last ones (spec.final)."""
        extra = set(self.extra_steps) | (set(finals) if self.spec.final else set())
        previous = 0
        for step in sorted(saved):
            if self.spec.every and step // self.spec.every > previous // self.spec.every:
                extra.add(step)
            previous = step
        self.extra_steps = sorted(s for s in extra if not self.spec.matches(s))

    def retry_candidates(self, on_disk: Iterable[int]) -> list[int]:
        """The missing or failed steps on disk whose checkpoint identity `observe` compares."""
        return sorted(set(on_disk) & (set(self.missing) | set(self.failed)))

    def reconcile(self, results: Iterable[dict[str, Any]]) -> list[int]:
        """Take back result lines of this schedule that reached metrics.jsonl but not this file; returns their steps."""
        taken = []
        for record in results:
            step = int(record["step"])
            if self.spec.owns(record) and step not in self.done:
                self.done[step] = str(record.get("checkpoint", ""))
                self.metrics[step] = result_metrics(record)
                self.missing.pop(step, None)
                self.failed.pop(step, None)
                taken.append(step)
        self.pending = [s for s in self.pending if not self.settled(s)]
        return taken

    def mark_done(self, step: int, checkpoint: str, metrics: dict[str, Any] | None = None) -> None:
        self.done[step] = checkpoint
        self.metrics[step] = dict(metrics or {})
        self.pending = [s for s in self.pending if s != step]

    def mark_failed(self, step: int, error: str, identity: str = "") -> None:
        self.failed[step], self.settled_as[step] = error, identity
        self.pending = [s for s in self.pending if s != step]

    def mark_missing(self, step: int, reason: str, identity: str = "") -> None:
        self.missing[step], self.settled_as[step] = reason, identity
        self.pending = [s for s in self.pending if s != step]

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.spec.name,
            "every": self.spec.every,
            "final": self.spec.final,
            "tasks": list(self.spec.tasks),
            "heldout": self.spec.heldout,
            "done": len(self.done),
            "pending": len(self.pending),
            "missing": len(self.missing),
            "failed": len(self.failed),
            "last_step": max(self.done, default=None),
            "missing_steps": {str(s): why for s, why in sorted(self.missing.items())},
            "failed_steps": {str(s): why for s, why in sorted(self.failed.items())},
            "cancelled": self.cancelled,
            "complete": self.complete,
            "starts": self.starts,
        }

    # --- JSON ---

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        for key in _BY_STEP:
            data[key] = {str(step): value for step, value in sorted(data[key].items())}
        return json.dumps(data, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, source: Path) -> ScheduleState:
        data = read_state_json(text, source, VERSION, "schedule state")
        spec = data.pop("spec")
        spec = ScheduleSpec(**{**spec, "tasks": tuple(spec["tasks"]), "task_data": tuple(spec["task_data"])})
        steps = {key: {int(s): v for s, v in data.pop(key, {}).items()} for key in _BY_STEP}
        return cls(spec=spec, **steps, **data)


_BY_STEP = ("done", "metrics", "missing", "failed", "settled_as")  # keyed by step: JSON keys are strings


def result_metrics(result: dict[str, Any]) -> dict[str, Any]:
    """An evaluation's metrics, without what says which line or checkpoint it was."""
    return {k: v for k, v in result.items() if k not in ("step", "time", "kind", "schedule", "checkpoint")}


def checkpoint_identity(path: str | Path) -> str:
    """Which write of a checkpoint directory is there now: its checksum file's inode and change time ("" when there
    is none). A checkpoint saved again at the same step (every save writes a new directory) has another."""
    try:
        stat = checksum_file(path).stat()
    except OSError:
        return ""
    return f"{stat.st_ino}:{stat.st_ctime_ns}"


# --- the files ---------------------------------------------------------------------------------------------------


def schedules_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / SCHEDULES_DIR


def state_path(run_dir: str | Path, name: str) -> Path:
    return schedules_dir(run_dir) / f"{name}.json"


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise ValueError(f"--name {name!r}: use letters, digits, '.', '_' and '-' (up to 64, a letter or digit first)")
    return name


def load(run_dir: str | Path, name: str) -> ScheduleState:
    path = state_path(run_dir, name)
    if not path.is_file():
        known = ", ".join(names(run_dir)) or "none"
        raise FileNotFoundError(f"{path}: no schedule {name!r} on this run (schedules: {known})")
    return ScheduleState.from_json(path.read_text(), path)


def names(run_dir: str | Path) -> list[str]:
    directory = schedules_dir(run_dir)
    return sorted(p.stem for p in directory.glob("*.json")) if directory.is_dir() else []


def readable(run_dir: str | Path) -> Iterator[ScheduleState]:
    """The run's schedules; a file that cannot be read (edited by hand) is skipped with a warning, so that it never
    stops training (retention) or a status."""
    for name in names(run_dir):
        try:
            yield load(run_dir, name)
        except (ValueError, OSError) as err:
            log.warning("skipping schedule %s: %s", name, err)


def update(run_dir: str | Path, name: str, change: Callable[[ScheduleState], Any]) -> ScheduleState:
    """Read the file, apply `change`, write it back atomically, all under the schedule's lock; returns the state."""
    with file_lock(schedules_dir(run_dir) / f".{name}.lock"):
        state = load(run_dir, name)
        before = state.to_json()
        change(state)
        if state.to_json() != before:  # the scheduler looks every few seconds; most looks change nothing
            atomic_write_bytes(state_path(run_dir, name), state.to_json().encode())
        return state


def adopt(run_dir: str | Path, spec: ScheduleSpec) -> ScheduleState:
    """The schedule of `spec.name` with this spec: made when absent, else its spec replaced and what it settled kept
    (the run's own schedule, whose spec follows the recipe's [eval], which a resume may change)."""
    with file_lock(schedules_dir(run_dir) / f".{spec.name}.lock"):
        path = state_path(run_dir, spec.name)
        state = ScheduleState.from_json(path.read_text(), path) if path.is_file() else ScheduleState(spec)
        before = state.to_json() if path.is_file() else ""
        state.spec = spec
        if state.to_json() != before:
            atomic_write_bytes(path, state.to_json().encode())
        return state


def create_or_attach(run_dir: str | Path, spec: ScheduleSpec) -> tuple[ScheduleState, bool]:
    """(the schedule's state, whether it was created). Attaching to an existing schedule of the same name needs the
    same job; a cancelled one stays cancelled (choose another name)."""
    with file_lock(schedules_dir(run_dir) / f".{spec.name}.lock"):
        path = state_path(run_dir, spec.name)
        if not path.is_file():
            state = ScheduleState(spec)
            atomic_write_bytes(path, state.to_json().encode())
            return state, True
        state = ScheduleState.from_json(path.read_text(), path)
    if state.cancelled:
        raise ValueError(f"--name {spec.name}: that schedule was cancelled; choose another --name")
    if not state.spec.same_job(spec):
        raise ValueError(
            f"--name {spec.name}: a schedule of that name exists with another job ({state.spec.describe()}); "
            "choose another --name, or cancel it first"
        )
    return state, False


@contextlib.contextmanager
def running(run_dir: str | Path, name: str) -> Iterator[bool]:
    """Hold the schedule's run lock while it runs: yields False (and holds nothing) when another process runs it.
    The lock goes with its process, so a killed scheduler never blocks its restart."""
    with file_lock(schedules_dir(run_dir) / f".{name}.running", blocking=False) as held:
        yield held


def touch_heartbeat(run_dir: str | Path, name: str) -> None:
    (schedules_dir(run_dir) / f"{name}{HEARTBEAT_SUFFIX}").touch()


def live(run_dir: str | Path, name: str) -> bool:
    try:
        age = time.time() - (schedules_dir(run_dir) / f"{name}{HEARTBEAT_SUFFIX}").stat().st_mtime
    except FileNotFoundError:
        return False
    return age < LIVE_WITHIN_S


def summaries(run_dir: str | Path) -> list[dict[str, Any]]:
    """Each schedule's progress (for `albert status` and `albert eval list`); "live" while its scheduler beats."""
    return [{**state.summary(), "live": live(run_dir, state.spec.name)} for state in readable(run_dir)]


def reopen_complete(run_dir: str | Path) -> list[str]:
    """A run that finished trains on (a resume raised optim.total_steps): the schedules that completed with it are
    active again, so retention keeps their new matching checkpoints; returns their names. Their scheduler ended:
    running `albert eval schedule` again evaluates the checkpoints they hold."""
    reopened = []
    for state in readable(run_dir):
        if state.complete and not state.cancelled:
            update(run_dir, state.spec.name, lambda s: setattr(s, "complete", False))
            reopened.append(state.spec.name)
    return reopened


def lease_age(run_dir: str | Path, state: ScheduleState, now: float | None = None) -> float:
    """Seconds since the schedule's scheduler last renewed its lease (touched its heartbeat), or since the schedule
    was created when no scheduler has run it yet."""
    try:
        renewed = max((schedules_dir(run_dir) / f"{state.spec.name}{HEARTBEAT_SUFFIX}").stat().st_mtime, state.created)
    except FileNotFoundError:
        renewed = state.created
    return (time.time() if now is None else now) - renewed


def held_and_lapsed(run_dir: str | Path, steps: Iterable[int], lease_s: float) -> tuple[set[int], list[dict]]:
    """The checkpoint steps retention must keep for the schedules: those an active schedule of the run still has to
    evaluate, while its scheduler holds its lease (renewed within `lease_s` seconds); and the active schedules whose
    lease lapsed since they last held (each marked `lease_lapsed` once, returned as {"schedule", "idle_s",
    "released": the steps it no longer holds})."""
    steps = list(steps)
    held: set[int] = set()
    lapsed: list[dict] = []
    for state in readable(run_dir):
        if not state.active():
            continue
        idle = lease_age(run_dir, state)
        if idle < lease_s:
            held |= set(state.unsettled(steps))
        elif not state.lease_lapsed:
            update(run_dir, state.spec.name, lambda s: setattr(s, "lease_lapsed", True))
            lapsed.append({"schedule": state.spec.name, "idle_s": round(idle, 1), "released": state.unsettled(steps)})
    return held, lapsed
