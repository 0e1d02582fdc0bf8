"""The run ledger: a run's record, as a plain, typed Python object persisted in the run directory.

It holds the checkpoint index (verified against each checkpoint's checksums), retention, the dropout state and the
run's events, and owns one file besides the metrics log it appends to (services.rundir.log):

- `coordinator.json`: its state, written atomically after every change, so a ledger opened again (a restarted
  coordinator or rank-0 worker) carries on where the last one stopped. Lines that reached metrics.jsonl after the
  last state write are reconciled when it opens: the last train step is read back, and a half-written last line is
  cut off.

Retention keeps the last `train.keep_last` checkpoints and those evaluation still needs (services.rundir.evaluations:
the best by the run's held-out MLM accuracy, and any an active evaluation schedule has still to evaluate); the rest
are deleted from disk if they lie inside the run's own checkpoints/ folder, and only dropped from the index
otherwise. Evaluations are not the ledger's: the run's recipe [eval] is its evaluation schedule, run by the
coordinator actor (services.train.coordinator), which wraps a ledger. A run without a coordinator uses a ledger
directly from its rank-0 worker (no evaluations).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from albert_core.files import CorruptCheckpoint, atomic_write_bytes, read_state_json
from services.rundir import evaluations, schedules
from services.rundir import log as run_log
from services.rundir.checkpoints import CHECKPOINTS_DIR, verify_checkpoint
from services.rundir.config import RunConfig, config_changes, config_hash

STATE_FILE = "coordinator.json"
# The coordinator touches this file every HEARTBEAT_EVERY_S while it lives; a status read from the run directory
# calls the run live when the touch is under LIVE_WITHIN_S old (no Ray connection needed).
HEARTBEAT_FILE = "coordinator.alive"
HEARTBEAT_EVERY_S = 5.0
LIVE_WITHIN_S = 30.0
STATE_VERSION = 1
_RESERVED_KEYS = ("kind", "time")


# --- typed state (its JSON form is coordinator.json) ------------------------------------------------------------


@dataclass
class CheckpointEntry:
    step: int
    path: str
    metrics: dict[str, Any] = field(default_factory=dict)
    time: float = 0.0


@dataclass
class RefusedCheckpoint:
    step: int
    path: str
    reason: str
    time: float = 0.0
    metrics: dict[str, Any] | None = None


@dataclass
class DropoutState:
    p: float | None
    removal_step: int = 0
    removed_at: int | None = None


@dataclass
class TrainLine:
    step: int
    metrics: dict[str, Any]


@dataclass
class StopRequest:
    """A graceful stop (the driver's first Ctrl-C, a SIGTERM to the driver or a worker): training checkpoints at its
    next step and ends. `session`: the coordinator that took it; one restarted by Ray is the same session and honours
    it, the next run's coordinator is another and does not. `signal`: the signal that asked (SIGINT, SIGTERM)."""

    step: int
    time: float
    session: str
    signal: str = "SIGINT"


@dataclass
class ConfigChange:
    """A start of the run under another config than its config of record, which it replaced: the step of the newest
    checkpoint (where the resume starts), the replaced config's hash (services.rundir.config.config_hash, as
    checkpoints record it) and the fields that changed: "section.field" -> [before, after]."""

    step: int
    time: float
    previous_hash: str
    changed: dict[str, list[Any]]


@dataclass
class LedgerState:
    run_name: str
    run_dir: str
    config: dict[str, Any]  # the run's config of record: the one its last start (a resume) used
    dropout: DropoutState
    version: int = STATE_VERSION
    started: float = field(default_factory=time.time)
    step: int = 0
    last_train: TrainLine | None = None
    checkpoints: list[CheckpointEntry] = field(default_factory=list)  # by step; only those on disk
    refused: list[RefusedCheckpoint] = field(default_factory=list)
    finished: bool = False  # the run's last checkpoint was saved
    config_history: list[ConfigChange] = field(default_factory=list)  # each config replaced, oldest first
    stop_request: StopRequest | None = None  # the last stop the driver asked for

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, source: Path) -> LedgerState:
        data = read_state_json(text, source, STATE_VERSION)
        legacy = {key: data.pop(key) for key in _LEGACY_EVAL_KEYS if key in data}
        last = data.pop("last_train")
        state = cls(
            **{k: v for k, v in data.items() if k not in _NESTED},
            last_train=TrainLine(**last) if last else None,
            config_history=[ConfigChange(**c) for c in data.get("config_history", [])],
            stop_request=StopRequest(**data["stop_request"]) if data.get("stop_request") else None,
            dropout=DropoutState(**data["dropout"]),
            checkpoints=[CheckpointEntry(**c) for c in data["checkpoints"]],
            refused=[RefusedCheckpoint(**r) for r in data["refused"]],
        )
        state.legacy_evals = legacy.get("evals", [])  # not a field: RunLedger moves them to the run's schedule
        return state


_NESTED = ("dropout", "checkpoints", "refused", "config_history", "stop_request")  # built by from_json
# A run made before its evaluations were a schedule (services.rundir.evaluations) kept them here.
_LEGACY_EVAL_KEYS = ("evals", "last_eval_scheduled", "plateau")


@dataclass
class SaveResult:
    accepted: bool
    deleted: list[str] = field(default_factory=list)
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"accepted": self.accepted, "deleted": self.deleted}
        if self.reason is not None:
            out["reason"] = self.reason
        return out


# --- the ledger ------------------------------------------------------------------------------------------------


class RunLedger:
    def __init__(self, run_dir: str | Path, run_name: str, config_dict: dict[str, Any]):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config = RunConfig.from_dict(config_dict, source="run config")
        path = self.run_dir / STATE_FILE
        if path.is_file():
            self.state = LedgerState.from_json(path.read_text(), path)
        else:
            self.state = LedgerState(
                run_name=run_name,
                run_dir=str(self.run_dir),
                config=config_dict,
                dropout=DropoutState(
                    p=self.config.model_config(vocab_size=30000).hidden_dropout_prob,
                    removal_step=self.config.train.dropout_removal_step,
                ),
            )
        self._reconcile_metrics_log()
        self._adopt_config(config_dict)
        self._move_legacy_evaluations()
        self.save()

    def _move_legacy_evaluations(self) -> None:
        """A run made before its evaluations were a schedule: they move to its schedule's file, said once."""
        legacy = getattr(self.state, "legacy_evals", [])
        if moved := evaluations.migrate_ledger_evaluations(self.run_dir, self.config, legacy):
            where = schedules.state_path(self.run_dir, schedules.RECIPE)
            self.event(self.state.step, "evaluations_moved", count=moved, to=str(where))

    def _adopt_config(self, config_dict: dict[str, Any]) -> None:
        """The run's config of record becomes the one this start uses (schedules and retention read it: a resume
        with a larger optim.total_steps makes a finished run unfinished, and reopens the schedules that completed
        with it); the one it replaces goes into the history."""
        previous = self.state.config
        changed = config_changes(previous, config_dict)
        if not changed:
            return
        newest = self.state.checkpoints[-1].step if self.state.checkpoints else 0  # where the resume starts
        change = ConfigChange(newest, time.time(), config_hash(previous), changed)
        self.state.config_history.append(change)
        self.state.config = config_dict
        self.state.finished = self.state.finished and newest >= self.config.optim.total_steps
        reopened = schedules.reopen_complete(self.run_dir) if not self.state.finished else []
        self.event(newest, "config_changed", previous_hash=change.previous_hash, changed=changed, reopened=reopened)

    # --- the train loop's calls ---

    def report(self, step: int, metrics: dict[str, Any]) -> None:
        """Append a train line; note resumes and dropout changes. Idempotent for a retried call."""
        metrics = _train_metrics(step, metrics)
        last = self.state.last_train
        if last is not None and last.step == step and last.metrics == metrics:
            return
        if last is not None and step <= last.step:  # training resumed from an earlier checkpoint
            dropped = run_log.drop_train_lines_from(self.run_dir, step)
            self.event(step, "train_lines_replaced", previous_step=last.step, train_lines_dropped=dropped)
        run_log.append(self.run_dir, {"step": step, "time": time.time(), "kind": "train", **metrics})
        self.state.last_train = TrainLine(step, metrics)
        self.state.step = step
        self._note_dropout(step, metrics)
        self.save()

    def checkpoint_saved(
        self, step: int, path: str, metrics: dict[str, Any] | None = None, *, final: bool = False
    ) -> SaveResult:
        """Verify and index a checkpoint, schedule its evaluation when one is due, apply retention."""
        step = check_step(step)
        path = str(Path(path).resolve())
        known = self.checkpoint(step)
        if known is not None and known.path == path:  # a retried call
            return SaveResult(True)
        try:
            verify_checkpoint(path)
        except CorruptCheckpoint as err:
            self.state.refused.append(RefusedCheckpoint(step, path, str(err), time.time()))
            self.event(step, "checkpoint_refused", path=path, reason=str(err))
            self.save()
            return SaveResult(False, reason=str(err))
        if known is not None:  # the same step saved again elsewhere (a resumed run): the new one replaces it
            self.state.checkpoints.remove(known)
            self.event(step, "checkpoint_replaced", path=path, previous_path=known.path)
        self.state.checkpoints.append(CheckpointEntry(step, path, run_log.plain(metrics or {}), time.time()))
        self.state.checkpoints.sort(key=lambda c: c.step)
        final_mark = {"final": True} if final else {}  # the run's last: a reopened ledger reads it back
        self.event(step, "checkpoint_saved", path=path, **final_mark)
        self.state.finished = self.state.finished or final or step >= self.config.optim.total_steps
        deleted = self.apply_retention()
        self.save()
        return SaveResult(True, deleted=deleted)

    def latest_good_checkpoint(self) -> str | None:
        """The newest indexed checkpoint that still matches its checksums; corrupt ones leave the index."""
        for entry in sorted(self.state.checkpoints, key=lambda c: c.step, reverse=True):
            try:
                verify_checkpoint(entry.path)
                return entry.path
            except CorruptCheckpoint as err:
                self.state.checkpoints.remove(entry)
                self.state.refused.append(
                    RefusedCheckpoint(entry.step, entry.path, str(err), time.time(), entry.metrics)
                )
                self.event(entry.step, "checkpoint_corrupt", path=entry.path, reason=str(err))
                self.save()
        return None

    def request_stop(self, session: str, reason: str, signal: str = "SIGINT") -> None:
        """Record a stop request (a `stop_requested` event naming the signal), so that a restarted coordinator of the
        same session still hands it to training."""
        if not self.stop_requested(session):
            self.state.stop_request = StopRequest(self.state.step, time.time(), session, signal)
            self.event(self.state.step, "stop_requested", reason=reason, signal=signal)
            self.save()

    def stop_requested(self, session: str) -> str | None:
        """The signal of this session's stop request (an earlier session's request ended its own run), or None."""
        request = self.state.stop_request
        return request.signal if request is not None and request.session == session else None

    # --- checkpoints ---

    def checkpoint(self, step: int) -> CheckpointEntry | None:
        return next((c for c in self.state.checkpoints if c.step == step), None)

    def apply_retention(self) -> list[str]:
        """Delete checkpoints that are not among the last keep_last and that evaluation does not need.

        Only what resolves (symlinks followed) inside this run's own checkpoints/ folder is deleted: an index that
        names anything else (a run directory copied with `cp -r`, a hand-edited coordinator.json) loses the entry
        with a checkpoint_not_deleted event, and the files stay."""
        checkpoints = self.state.checkpoints
        keep = {c.step for c in checkpoints[-self.config.train.keep_last :]}
        lease_s = self.config.eval.schedule_lease_s
        held, lapsed = evaluations.kept_steps(self.run_dir, [(c.step, c.path) for c in checkpoints], lease_s)
        keep |= held
        for lease in lapsed:  # its scheduler is gone: retention deletes old checkpoints again
            self.event(
                self.state.step, "schedule_lease_expired", **lease, lease_s=lease_s,
                message=f"schedule {lease['schedule']}: no scheduler for {lease['idle_s']:g} s (eval.schedule_lease_s "
                f"{lease_s:g}); it no longer holds checkpoints from retention. Run `albert eval schedule` again to "
                "resume it from the oldest checkpoint left",
            )  # fmt: skip
        deleted = []
        own = (self.run_dir / CHECKPOINTS_DIR).resolve()
        for entry in [c for c in checkpoints if c.step not in keep]:
            path = Path(entry.path)
            resolved = path.resolve()
            if resolved == own or not resolved.is_relative_to(own):  # a copied run's index names another run's
                checkpoints.remove(entry)
                reason = f"outside this run's {own}: dropped from the index, not deleted"
                self.event(entry.step, "checkpoint_not_deleted", path=str(path), reason=reason)
                continue
            try:
                shutil.rmtree(path)
            except FileNotFoundError:
                pass
            except OSError as err:
                self.event(entry.step, "checkpoint_delete_failed", path=str(path), reason=str(err))
                continue
            checkpoints.remove(entry)
            deleted.append(str(path))
            self.event(entry.step, "checkpoint_deleted", path=str(path))
        return deleted

    # --- dropout ---

    def _note_dropout(self, step: int, metrics: dict[str, Any]) -> None:
        dropout = self.state.dropout
        if "dropout" in metrics:  # the train loop says what it runs with
            p = float(metrics["dropout"])
            if dropout.p is not None and p != dropout.p:
                self.event(step, "dropout_removed" if p == 0 else "dropout_changed", previous=dropout.p, dropout=p)
                if p == 0:
                    dropout.removed_at = step
            dropout.p = p
        elif dropout.removal_step and dropout.removed_at is None and step >= dropout.removal_step:
            dropout.removed_at = dropout.removal_step
            self.event(dropout.removal_step, "dropout_removed", previous=dropout.p, dropout=0.0)
            dropout.p = 0.0

    # --- files ---

    def event(self, step: int, event: str, **fields: Any) -> None:
        run_log.append(self.run_dir, {"step": step, "time": time.time(), "kind": "event", "event": event, **fields})

    def save(self) -> None:
        atomic_write_bytes(self.run_dir / STATE_FILE, self.state.to_json().encode())

    def _reconcile_metrics_log(self) -> None:
        """Take back what reached metrics.jsonl after the last state write; cut a half-written last line."""
        dropped = run_log.repair(self.run_dir)
        if dropped:
            self.event(self.state.step, "metrics_log_repaired", dropped_bytes=dropped)
        saved: dict[int, tuple[str, bool]] = {}  # checkpoints the log says were saved (path, final), not deleted since
        for record in run_log.read_metrics(self.run_dir / run_log.METRICS_FILE):
            if record.get("kind") == "event" and record.get("event") in ("checkpoint_saved", "checkpoint_deleted"):
                saved.pop(record["step"], None)
                if record["event"] == "checkpoint_saved":
                    saved[record["step"]] = (record["path"], bool(record.get("final")))
            elif record.get("kind") == "train":
                metrics = {k: v for k, v in record.items() if k not in ("step", "time", "kind")}
                self.state.last_train = TrainLine(record["step"], metrics)
                self.state.step = record["step"]
        self._reindex_saved_checkpoints(saved)

    def _reindex_saved_checkpoints(self, saved: dict[int, tuple[str, bool]]) -> None:
        """Index the checkpoints the log names as saved that the state file missed (a coordinator killed between
        the checkpoint_saved line and its next state write), if they are still intact on disk (a final one: the run is
        then finished); without this a resume would start from an older checkpoint. Their evaluations are the run's
        schedule's, which reads the log itself."""
        for step, (path, final) in sorted(saved.items()):
            if self.checkpoint(step) is not None:  # indexed (this path or a replacement)
                continue
            try:
                verify_checkpoint(path)
            except CorruptCheckpoint:
                continue  # a checkpoint cut short by the same crash: the previous one stays the newest
            self.state.checkpoints.append(CheckpointEntry(step, path, {}, time.time()))
            self.state.checkpoints.sort(key=lambda c: c.step)
            self.event(step, "checkpoint_reindexed", path=path)
            self.state.finished = self.state.finished or final or step >= self.config.optim.total_steps

    def status(self, *, live: bool) -> dict[str, Any]:
        return status_from_state(self.state, live=live)


# --- reading a run's record --------------------------------------------------------------------------------------


def status_from_state(state: LedgerState, *, live: bool) -> dict[str, Any]:
    evals = evaluations.status_fields(state.run_dir, [(c.step, c.path) for c in state.checkpoints])
    return {
        "run_name": state.run_name,
        "run_dir": state.run_dir,
        "live": live,
        "step": state.step,
        "last_metrics": state.last_train.metrics if state.last_train else {},
        "dropout": dataclasses.asdict(state.dropout),
        "checkpoints": [
            {"step": c.step, "path": c.path, "eval": evals["metrics"].get(c.step)} for c in state.checkpoints
        ],
        "best_checkpoint": evals["best_checkpoint"],
        "evals": evals["evals"],  # the run's own (its schedule "recipe"); the others follow
        "refused": [{"step": r.step, "path": r.path, "reason": r.reason} for r in state.refused],
        "schedules": [s for s in schedules.summaries(state.run_dir) if s["name"] != schedules.RECIPE],
    }


def read_status(run_dir: str | Path) -> dict[str, Any]:
    """A run's status from `<run_dir>/coordinator.json`; "live" while its coordinator's heartbeat is fresh."""
    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no coordinator state; is {run_dir} a run directory?")
    age = heartbeat_age(run_dir)
    status = status_from_state(
        LedgerState.from_json(path.read_text(), path), live=age is not None and age < LIVE_WITHIN_S
    )
    status["heartbeat_age_s"] = None if age is None else round(age, 1)
    return status


def touch_heartbeat(run_dir: str | Path) -> None:
    (Path(run_dir) / HEARTBEAT_FILE).touch()


def heartbeat_age(run_dir: str | Path) -> float | None:
    """Seconds since the run's coordinator last touched its heartbeat file; None when it never did."""
    try:
        return max(0.0, time.time() - (Path(run_dir) / HEARTBEAT_FILE).stat().st_mtime)
    except FileNotFoundError:
        return None


# --- helpers -----------------------------------------------------------------------------------------------------


def check_step(step: Any) -> int:
    import operator

    if isinstance(step, bool):
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    try:
        step = operator.index(step)  # int and numpy integers; not floats
    except TypeError:
        raise ValueError(f"step must be a non-negative integer, got {step!r}") from None
    if step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step}")
    return step


def _train_metrics(step: Any, metrics: Any) -> dict[str, Any]:
    step = check_step(step)
    if not isinstance(metrics, dict):
        raise ValueError(f"report(step={step}): metrics must be a dict, got {type(metrics).__name__}")
    metrics = run_log.plain(metrics)
    reserved = [key for key in _RESERVED_KEYS if key in metrics]
    if reserved:
        raise ValueError(f"report(step={step}): metrics key {reserved[0]!r} is reserved for the metrics log")
    if metrics.get("step", step) != step:
        raise ValueError(f"report(step={step}): metrics carry a different step ({metrics['step']})")
    metrics.pop("step", None)
    return metrics
