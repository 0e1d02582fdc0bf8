"""A run's status: `albert status RUN` reads it from the run directory alone (no Ray, no torch), a live coordinator
from its ledger, in the same form: the ledger's record, its checkpoint index rebuilt from disk, the checkpoint a
resume starts from (the one `--dry-run` names), the run's own evaluations (its schedule "recipe":
services.rundir.evaluations) with the best evaluated checkpoint that still verifies, the other evaluation schedules,
and whether the run's coordinator process is alive.

The coordinator writes its host and process id into `coordinator.alive` every HEARTBEAT_EVERY_S while it lives. On
that host the run is live while that process runs (not a moment after it exits); read from another host, while the
heartbeat is under LIVE_WITHIN_S old.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from albert_core.files import CorruptCheckpoint, is_disk_full
from albert_core.model.config import ConfigError
from services.rundir import evaluations, schedules
from services.rundir.checkpoints import CHECKPOINTS_DIR, latest_good, reindex, verify
from services.rundir.config import RunConfig
from services.rundir.ledger import LEDGER_FILE, LedgerState, adopt_run_dir, ledger_path
from services.rundir.schedules import ScheduleState
from services.rundir.sections import CHECKPOINT_PRESET

log = logging.getLogger(__name__)
HEARTBEAT_FILE = "coordinator.alive"
HEARTBEAT_EVERY_S = 5.0
LIVE_WITHIN_S = 30.0


def status_of(state: LedgerState, *, live: bool) -> dict[str, Any]:
    """The status of a run from its record; the checkpoints it names as good (`resume_from`, `best_checkpoint`) are
    verified now, and a damaged one is listed under `refused` instead of `checkpoints`."""
    damaged: dict[str, dict[str, Any]] = {}

    def note(step: int, path: Path, err: CorruptCheckpoint) -> None:
        damaged[str(path)] = {"step": step, "path": str(path), "reason": str(err)}

    resume_from = latest_good(Path(state.run_dir) / CHECKPOINTS_DIR, on_damaged=note)

    def good(step: int, path: str) -> bool:
        """Whether the checkpoint verifies (the one a resume starts from was verified already)."""
        if path in damaged:
            return False
        if path == str(resume_from):
            return True
        try:
            verify(path)
            return True
        except CorruptCheckpoint as err:
            note(step, Path(path), err)
            return False

    indexed = [(c.step, c.path) for c in state.checkpoints]
    evals = evaluations.status_fields(run_evaluations(state), indexed, usable=good)
    return {
        "run_name": state.run_name,
        "run_dir": state.run_dir,
        "live": live,
        "initialized_from": initialized_from(state.config),
        "step": state.step,
        "last_metrics": state.last_train.metrics if state.last_train else {},
        "dropout": dataclasses.asdict(state.dropout),
        "checkpoints": [
            {"step": c.step, "path": c.path, "eval": evals["metrics"].get(c.step)}
            for c in state.checkpoints
            if c.path not in damaged
        ],
        "resume_from": str(resume_from) if resume_from is not None else None,
        "best_checkpoint": evals["best_checkpoint"],
        "evals": evals["evals"],  # the run's own (its schedule "recipe"); the others follow
        "refused": [{"step": r.step, "path": r.path, "reason": r.reason} for r in state.refused]
        + sorted(damaged.values(), key=lambda d: d["step"]),
        "schedules": [s for s in schedules.summaries(state.run_dir) if s["name"] != schedules.RECIPE],
    }


def initialized_from(config: dict[str, Any]) -> str | None:
    """What a run's weights started from: model.init_from with how it was used (None: random weights)."""
    model = config.get("model") if isinstance(config, dict) else None
    source = model.get("init_from") if isinstance(model, dict) else None
    if not source:
        return None
    how = "continued pretraining" if model.get("preset") == CHECKPOINT_PRESET else "progressive stacking"
    return f"{source} ({how})"


def run_evaluations(state: LedgerState) -> ScheduleState | None:
    """The run's own evaluations: its schedule "recipe", or, in a run directory whose ledger file still holds them
    (written before they were a schedule, not opened by a ledger since), those (evaluations.legacy_state)."""
    recipe = evaluations.recipe_state(state.run_dir)
    legacy = getattr(state, "legacy_evals", [])
    if recipe is not None or not legacy:
        return recipe
    try:
        return evaluations.legacy_state(RunConfig.from_dict(state.config, source="run config"), legacy)
    except ConfigError as err:
        log.warning("skipping the run's evaluations: %s", err)
        return None


def read_status(run_dir: str | Path) -> dict[str, Any]:
    """A run's status from its directory (read_state): "live" while its coordinator runs."""
    status = status_of(read_state(run_dir), live=coordinator_live(run_dir))
    age = heartbeat_age(run_dir)
    status["heartbeat_age_s"] = None if age is None else round(age, 1)
    return status


def read_state(run_dir: str | Path) -> LedgerState:
    """The run's record as its ledger would open it, nothing written: the directory read is its run_dir (a copied
    one's record names its source) and its checkpoint index is rebuilt from disk."""
    run_dir = Path(run_dir).resolve()
    path = ledger_path(run_dir)
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir / LEDGER_FILE}: no run ledger; is {run_dir} a run directory?")
    state = LedgerState.from_json(path.read_text(), path)
    adopt_run_dir(state, run_dir)
    state.checkpoints = reindex(run_dir / CHECKPOINTS_DIR, state.checkpoints).index
    return state


# --- the coordinator's heartbeat ---------------------------------------------------------------------------------


def touch_heartbeat(run_dir: str | Path) -> None:
    """Say that the run's coordinator, this process, is alive. On a full disk the beat is the file's time alone (its
    text may be lost: coordinator_live then trusts its age)."""
    path = Path(run_dir) / HEARTBEAT_FILE
    try:
        path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    except OSError as err:
        if not is_disk_full(err):
            raise
        path.touch()


def heartbeat_age(run_dir: str | Path) -> float | None:
    """Seconds since the run's coordinator last touched its heartbeat file; None when it never did."""
    try:
        return max(0.0, time.time() - (Path(run_dir) / HEARTBEAT_FILE).stat().st_mtime)
    except FileNotFoundError:
        return None


def coordinator_live(run_dir: str | Path) -> bool:
    """Whether the run's coordinator runs: its heartbeat is under LIVE_WITHIN_S old and, when it names a process of
    this host, that process is alive (a heartbeat written before it named its process: its age alone)."""
    age = heartbeat_age(run_dir)
    if age is None or age >= LIVE_WITHIN_S:
        return False
    try:
        owner = json.loads((Path(run_dir) / HEARTBEAT_FILE).read_text())
        host, pid = owner["host"], int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return True
    return host != socket.gethostname() or process_alive(pid)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
