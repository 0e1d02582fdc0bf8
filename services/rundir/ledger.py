"""The run ledger: a run's record, as a plain, typed Python object persisted in the run directory.

It holds the checkpoint index, retention, the dropout state and the run's events, and owns one file besides the
metrics log it appends to (services.rundir.log):

- `ledger.json`: its state, written atomically after every change, so a ledger opened again (a restarted
  coordinator or rank-0 worker) carries on where the last one stopped. Lines that reached metrics.jsonl after the
  last state write are reconciled when it opens: the last train step is read back, and a half-written last line is
  cut off. A run directory written before the file had its name holds `coordinator.json`: read as it is, renamed
  once by the next ledger that opens it (a `ledger_file_renamed` event says so).

The checkpoint index is a cache of the run's checkpoints/ folder (services.rundir.checkpoints owns it), rebuilt
from it whenever the record is read: a run directory copied or moved elsewhere names its own checkpoints, and the
newest good checkpoint is the one on disk that verifies, for a resume, `--dry-run` and `albert status` alike.
Retention keeps the last `train.keep_last` checkpoints and those evaluation still needs (services.rundir.evaluations:
the best by the run's held-out MLM accuracy, and any an active evaluation schedule has still to evaluate); the rest
are deleted (checkpoints.retain: only the run's own). Evaluations are not the ledger's: the run's recipe [eval] is
its evaluation schedule, run by the coordinator actor (services.train.coordinator), which wraps a ledger; a run
directory whose ledger file still holds evaluations (written before they were a schedule) has them moved into that
schedule when a ledger opens it. A run without a coordinator uses a ledger directly from its rank-0 worker (no
evaluations).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from albert_core.files import CorruptCheckpoint, atomic_write_bytes, read_state_json
from services.rundir import evaluations, schedules
from services.rundir import log as run_log
from services.rundir.checkpoints import (
    CHECKPOINTS_DIR,
    CheckpointEntry,
    RefusedCheckpoint,
    latest_good,
    own_step_dir,
    reindex,
    retain,
    verify,
)
from services.rundir.config import RunConfig, config_changes, config_hash

log = logging.getLogger(__name__)

LEDGER_FILE = "ledger.json"
OLD_LEDGER_FILE = "coordinator.json"  # its name before issue 35: read, and renamed by the next ledger that opens it
STATE_VERSION = 1
DELIVERY_SENDERS = 8  # train loop processes whose last applied call a ledger remembers (first_delivery)
_RESERVED_KEYS = ("kind", "time")


# --- typed state (its JSON form is ledger.json) -----------------------------------------------------------------


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
    checkpoints: list[CheckpointEntry] = field(default_factory=list)  # by step: a cache of checkpoints/
    refused: list[RefusedCheckpoint] = field(default_factory=list)
    finished: bool = False  # the run's last checkpoint was saved
    config_history: list[ConfigChange] = field(default_factory=list)  # each config replaced, oldest first
    stop_request: StopRequest | None = None  # the last stop the driver asked for
    delivered: dict[str, int] = field(default_factory=dict)  # sender -> the last call number applied: first_delivery

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
        self.run_dir = Path(run_dir).resolve()
        self.checkpoints_root = self.run_dir / CHECKPOINTS_DIR
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config = RunConfig.from_dict(config_dict, source="run config")
        renamed = _rename_old_ledger_file(self.run_dir)
        path = self.run_dir / LEDGER_FILE
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
        logged = self._reconcile_metrics_log()
        if renamed:
            self.event(self.state.step, "ledger_file_renamed", previous=OLD_LEDGER_FILE, now=LEDGER_FILE)
        if (previous := adopt_run_dir(self.state, self.run_dir)) is not None:
            self.event(self.state.step, "run_dir_moved", previous=str(previous))
        self._sync_index(logged)
        self._adopt_config(config_dict)
        self._move_legacy_evaluations()
        self.save()

    def _sync_index(self, logged: dict[int, bool]) -> None:
        """The checkpoint index rebuilt from disk (checkpoints.reindex). A checkpoint the cache missed (its
        coordinator was killed between the checkpoint_saved line and the state write, or before the train loop's
        call reached it) is indexed again; a final one means the run is finished. Its evaluation is the run's
        schedule's, which reads the disk and the log itself (services.eval.schedule). `logged`: step -> final, of
        the saves the metrics log holds (a call still to come is not a retry)."""
        found = reindex(self.checkpoints_root, self.state.checkpoints)
        self.state.checkpoints = found.index
        for entry in found.gone:
            self.event(entry.step, "checkpoint_missing", path=entry.path)
        for entry in found.added:
            final, entry.reported = logged.get(entry.step, False), entry.step in logged
            self.event(entry.step, "checkpoint_reindexed", path=entry.path)
            self.state.finished = self.state.finished or final or entry.step >= self.config.optim.total_steps

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

    def first_delivery(self, sender: str, number: int) -> bool:
        """Whether a train loop's call (its process's `sender`, its `number`) is new; it is then noted as applied, and
        saved with the state. Only the last DELIVERY_SENDERS senders are kept (one per worker group start)."""
        if number <= self.state.delivered.get(sender, 0):
            return False
        self.state.delivered.pop(sender, None)
        self.state.delivered[sender] = number
        while len(self.state.delivered) > DELIVERY_SENDERS:
            del self.state.delivered[next(iter(self.state.delivered))]
        return True

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
        """Verify and index a checkpoint of this run's checkpoints/, apply retention (its evaluation is the run's
        schedule's: the coordinator has its scheduler observe it)."""
        step = check_step(step)
        given, path = str(path), str(self.checkpoints_root / Path(path).name)  # the index names it as reindex does
        reason = own_step_dir(self.checkpoints_root, given, step)
        known = self.checkpoint(step)
        if reason is None and known is not None and known.path == path and known.reported:  # a retried call
            return SaveResult(True)
        if reason is None:
            try:
                verify(path)
            except CorruptCheckpoint as err:
                reason = str(err)
        if reason is not None:
            self.state.refused.append(RefusedCheckpoint(step, given, reason, time.time()))
            self.event(step, "checkpoint_refused", path=given, reason=reason)
            self.save()
            return SaveResult(False, reason=reason)
        if known is not None:  # indexed from disk before this call, or saved again under another name
            self.state.checkpoints.remove(known)
            if known.path != path:
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
        """The newest checkpoint on disk that verifies (checkpoints.latest_good, as `--dry-run` and `albert status`
        name it); a damaged one leaves the index."""
        newest = latest_good(self.checkpoints_root, on_damaged=self._damaged)
        return str(newest) if newest is not None else None

    def _damaged(self, step: int, path: Path, err: CorruptCheckpoint) -> None:
        entry = self.checkpoint(step)
        if entry is None or entry.path != str(path):  # not indexed: refused when it was saved
            return
        self.state.checkpoints.remove(entry)
        self.state.refused.append(RefusedCheckpoint(entry.step, entry.path, str(err), time.time(), entry.metrics))
        self.event(entry.step, "checkpoint_corrupt", path=entry.path, reason=str(err))
        self.save()

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
        """Delete checkpoints that are not among the last keep_last and that evaluation does not need
        (evaluations.kept_steps); checkpoints.retain deletes only this run's own."""
        checkpoints = self.state.checkpoints
        lease_s = self.config.eval.schedule_lease_s
        keep, lapsed = evaluations.kept_steps(self.run_dir, [(c.step, c.path) for c in checkpoints], lease_s)
        for lease in lapsed:  # its scheduler is gone: retention deletes old checkpoints again
            self.event(
                self.state.step, "schedule_lease_expired", **lease, lease_s=lease_s,
                message=f"schedule {lease['schedule']}: no scheduler for {lease['idle_s']:g} s (eval.schedule_lease_s "
                f"{lease_s:g}); it no longer holds checkpoints from retention. Run `albert eval schedule` again to "
                "resume it from the oldest checkpoint left",
            )  # fmt: skip
        result = retain(checkpoints, self.checkpoints_root, keep_last=self.config.train.keep_last, keep=keep)
        for entry, reason in result.failed:
            self.event(entry.step, "checkpoint_delete_failed", path=entry.path, reason=reason)
        for entry in result.deleted:
            self.event(entry.step, "checkpoint_deleted", path=entry.path)
        return [entry.path for entry in result.deleted]

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
        run_log.append_event(self.run_dir, step, event, **fields)

    def save(self) -> None:
        atomic_write_bytes(self.run_dir / LEDGER_FILE, self.state.to_json().encode())

    def _reconcile_metrics_log(self) -> dict[int, bool]:
        """Take back what reached metrics.jsonl after the last state write; cut a half-written last line. Returns
        step -> final of the saves the log holds (for a checkpoint the state file missed: _sync_index)."""
        dropped = run_log.repair(self.run_dir)
        if dropped:
            self.event(self.state.step, "metrics_log_repaired", dropped_bytes=dropped)
        logged: dict[int, bool] = {}
        for record in run_log.read_metrics(self.run_dir / run_log.METRICS_FILE):
            if record.get("kind") == "event" and record.get("event") == "checkpoint_saved":
                logged[record["step"]] = bool(record.get("final"))
            elif record.get("kind") == "train":
                metrics = {k: v for k, v in record.items() if k not in ("step", "time", "kind")}
                self.state.last_train = TrainLine(record["step"], metrics)
                self.state.step = record["step"]
        return logged


# --- reading a run's record --------------------------------------------------------------------------------------


def ledger_path(run_dir: str | Path) -> Path:
    """The run's ledger file: ledger.json, or coordinator.json in a run directory written before the rename."""
    run_dir = Path(run_dir)
    old = run_dir / OLD_LEDGER_FILE
    return old if old.is_file() and not (run_dir / LEDGER_FILE).is_file() else run_dir / LEDGER_FILE


def _rename_old_ledger_file(run_dir: Path) -> bool:
    """Rename a run's coordinator.json (its ledger file before issue 35) to ledger.json, saying so; whether it was."""
    old = ledger_path(run_dir)
    if old.name != OLD_LEDGER_FILE:
        return False
    os.replace(old, run_dir / LEDGER_FILE)
    log.warning("%s: the run ledger's file, renamed to %s", old, LEDGER_FILE)
    return True


def adopt_run_dir(state: LedgerState, run_dir: Path) -> Path | None:
    """A run directory copied or moved (`cp -a runs/s1 runs/s5`) holds its source's record: make it this
    directory's (its name the run's; its checkpoint index is rebuilt from its own checkpoints/, and its evaluations
    are matched to them by step and directory name: evaluations.best_checkpoint). Returns the source, if moved."""
    previous = Path(state.run_dir)
    if previous == run_dir:
        return None
    state.run_name = run_dir.name  # a run's directory is <run.output_dir>/<run.name>
    state.run_dir = str(run_dir)
    return previous


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
