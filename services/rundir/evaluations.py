"""A run's evaluations in its directory: what an evaluation's outcome writes, and the run's own schedule.

Every evaluation of a run's checkpoints belongs to a schedule (services.rundir.schedules: its state) and is run by the
one orchestrator, services.eval.schedule.Scheduler (its design is in that module's docstring). This module is what
the orchestrator writes and what the run's record reads back, without Ray or torch:

- an outcome: `record_result` appends the result line to metrics.jsonl, then marks the step done in the schedule's
  file (a crash between the two is reconciled from the log: neither repeated nor lost); `record_failure` marks it
  failed (an `eval_failed` event) or missing;
- the run's own schedule, RECIPE: the recipe's [eval] as a schedule (`recipe_spec`: every eval.every_steps and the
  run's last checkpoint). Its results are the run's "eval" lines; it also keeps `eval.md` (its table) and the
  plateau check (services.rundir.health.plateau) after each result, and its best checkpoint by held-out MLM accuracy
  is kept by retention (`kept_steps`) and named by the run's status (`status_fields`). A run directory made before
  its evaluations were a schedule held them in its ledger file's `evals` (coordinator.json): the ledger hands them to
  `migrate_ledger_evaluations` when it opens such a directory, and `albert status` reads them as that schedule
  (`legacy_state`) until then.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from albert_core.files import atomic_write_bytes
from services.rundir import log as run_log
from services.rundir import schedules
from services.rundir.checkpoints import checkpoint_dir
from services.rundir.config import RunConfig
from services.rundir.health import plateau
from services.rundir.schedules import RECIPE, ScheduleSpec, ScheduleState, checkpoint_identity, result_metrics

EVAL_TABLE_FILE = "eval.md"
EVAL_COLUMNS = ("mlm_acc", "mlm_loss", "sop_acc", "nsp_acc", "unigram_acc", "mlm_margin")
STATUSES = ("pending", "done", "failed", "missing")
log = logging.getLogger(__name__)


# --- outcomes ------------------------------------------------------------------------------------------------------


def record_result(
    run_dir: str | Path, spec: ScheduleSpec, config: RunConfig, step: int, checkpoint: str, result: dict[str, Any]
) -> ScheduleState:
    """A finished evaluation: its line in metrics.jsonl first, then the step done in the schedule's file."""
    metrics = result_metrics(run_log.plain(result))
    named = {} if spec.name == RECIPE else {"schedule": spec.name}
    line = {"step": step, "time": time.time(), "kind": spec.result_kind, **named, "checkpoint": checkpoint, **metrics}
    run_log.append(run_dir, line)
    state = schedules.update(run_dir, spec.name, lambda s: s.mark_done(step, checkpoint, metrics))
    if spec.name == RECIPE:
        check_plateau(run_dir, state, config, step)
        write_table(run_dir, state)
    return state


def record_failure(
    run_dir: str | Path, spec: ScheduleSpec, step: int, *, missing: bool, why: str, identity: str, checkpoint: str
) -> ScheduleState:
    """A step that cannot be evaluated on this checkpoint: failed (it raised, or the checkpoint is damaged: an
    `eval_failed` event) or missing (the checkpoint is gone). Either is due again once the run saves the step again
    (another `identity`)."""
    mark = ScheduleState.mark_missing if missing else ScheduleState.mark_failed
    state = schedules.update(run_dir, spec.name, lambda s: mark(s, step, why, identity))
    if not missing:
        run_log.append_event(run_dir, step, "eval_failed", schedule=spec.name, path=checkpoint, reason=why)
    if spec.name == RECIPE:
        write_table(run_dir, state)
    return state


# --- the run's own schedule ----------------------------------------------------------------------------------------


def recipe_spec(config: RunConfig, heldout: str | Path) -> ScheduleSpec:
    """The recipe's [eval] as the run's schedule: every eval.every_steps and the run's last checkpoint."""
    e = config.eval
    return ScheduleSpec(
        name=RECIPE,
        every=e.every_steps,
        heldout=str(Path(heldout).resolve()),
        tasks=tuple(e.tasks),
        task_data=tuple(e.task_data[task] for task in e.tasks),
        task_seeds=e.task_seeds,
        task_max_steps=e.task_max_steps,
        cpus=e.cpus,
        final=True,
    )


def recipe_state(run_dir: str | Path) -> ScheduleState | None:
    """The run's own schedule, or None when it has none (no coordinator ran it) or its file cannot be read."""
    if not schedules.state_path(run_dir, RECIPE).is_file():
        return None
    try:
        return schedules.load(run_dir, RECIPE)
    except (ValueError, OSError) as err:
        log.warning("skipping the run's evaluations: %s", err)
        return None


def migrate_ledger_evaluations(run_dir: str | Path, config: RunConfig, evals: list[dict[str, Any]]) -> int:
    """The evaluations a run's ledger held before they were its RECIPE schedule's (coordinator.json's `evals`, whose
    entries are {step, path, status, metrics, error, ...}) become that schedule's: done with their metrics, failed
    (settled on the checkpoint on disk now), pending ones still due. Returns how many moved (0 when the schedule
    exists already)."""
    if not evals or schedules.state_path(run_dir, RECIPE).is_file():
        return 0
    schedules.adopt(run_dir, _legacy_spec(config))
    schedules.update(run_dir, RECIPE, lambda state: _take_legacy(state, evals))
    return len(evals)


def legacy_state(config: RunConfig, evals: list[dict[str, Any]]) -> ScheduleState | None:
    """The run's own schedule as its ledger file's `evals` (a run directory made before they were a schedule, which
    no ledger has opened since) will become it, read without writing anything; None without any."""
    if not evals:
        return None
    state = ScheduleState(_legacy_spec(config))
    _take_legacy(state, evals)
    return state


def _legacy_spec(config: RunConfig) -> ScheduleSpec:
    from albert_core.examples.shards import HELDOUT_FILE

    return recipe_spec(config, Path(config.data.shards) / HELDOUT_FILE)


def _take_legacy(state: ScheduleState, evals: list[dict[str, Any]]) -> None:
    for entry in evals:
        step, path = int(entry["step"]), str(entry["path"])
        if entry["status"] == "done":
            state.mark_done(step, path, entry.get("metrics"))
        elif entry["status"] == "failed":
            state.mark_failed(step, str(entry.get("error") or ""), checkpoint_identity(path))
        else:
            state.pending = sorted({*state.pending, step})
            if not state.covers(step):
                state.extra_steps = sorted({*state.extra_steps, step})


def counts(state: ScheduleState | None) -> dict[str, int]:
    """How many of the run's own evaluations are pending, done, failed and missing."""
    return {status: len(steps) for status, steps in steps_by_status(state).items()}


def steps_by_status(state: ScheduleState | None) -> dict[str, list[int]]:
    if state is None:
        return {status: [] for status in STATUSES}
    return {
        "pending": sorted(state.pending),
        "done": sorted(state.done),
        "failed": sorted(state.failed),
        "missing": sorted(state.missing),
    }


def best_checkpoint(
    state: ScheduleState | None,
    checkpoints: Iterable[tuple[int, str]],
    usable: Callable[[int, str], bool] | None = None,
) -> tuple[int, str] | None:
    """The (step, path) among `checkpoints` (the run's index) whose evaluation by the run's own schedule has the
    highest held-out MLM accuracy (the later step on ties) and that `usable` accepts (the status: it verifies), or
    None. An evaluation is of the index's checkpoint of its step and directory name (the index names only the run's
    own checkpoints; a copied run directory's schedule names its source's)."""
    if state is None:
        return None
    scored = sorted(
        (
            (state.metrics[step]["mlm_acc"], step, path)
            for step, path in checkpoints
            if step in state.done
            and Path(state.done[step]).name == Path(path).name
            and _finite(state.metrics.get(step, {}).get("mlm_acc"))
        ),
        reverse=True,
    )
    return next(((step, path) for _, step, path in scored if usable is None or usable(step, path)), None)


def kept_steps(
    run_dir: str | Path, checkpoints: list[tuple[int, str]], lease_s: float
) -> tuple[set[int], list[dict[str, Any]]]:
    """The checkpoint steps retention must keep for evaluation: those an active schedule still has to evaluate
    while its scheduler holds its lease, and the best one by the run's own evaluations; and the schedules whose lease
    lapsed (schedules.held_and_lapsed)."""
    held, lapsed = schedules.held_and_lapsed(run_dir, [step for step, _ in checkpoints], lease_s)
    best = best_checkpoint(recipe_state(run_dir), checkpoints)
    if best is not None:
        held.add(best[0])
    return held, lapsed


def status_fields(
    state: ScheduleState | None,
    checkpoints: list[tuple[int, str]],
    usable: Callable[[int, str], bool] | None = None,
) -> dict[str, Any]:
    """What a run's status says of its own evaluations (`state`: recipe_state, or legacy_state): "evals" (steps by
    status), "best_checkpoint" (a path or None; best_checkpoint with `usable`) and "metrics" (step -> the metrics of
    its evaluation)."""
    best = best_checkpoint(state, checkpoints, usable)
    return {
        "evals": steps_by_status(state),
        "best_checkpoint": best[1] if best else None,
        "metrics": {step: state.metrics.get(step, {}) for step in state.done} if state else {},
    }


def check_plateau(run_dir: str | Path, state: ScheduleState, config: RunConfig, step: int) -> None:
    """A plateau event when the last evaluations sit on the unigram baseline: once, when the result of `step` brings
    the run onto it (again, after an evaluation that left it)."""
    evals = [
        (s, metrics["mlm_acc"], metrics["unigram_acc"])
        for s, metrics in sorted(state.metrics.items())
        if s in state.done and "unigram_acc" in metrics and "mlm_acc" in metrics
    ]
    o, e = config.optim, config.eval

    def finding(points):
        return plateau(points, warmup_steps=o.warmup_steps, margin=e.plateau_margin, count=e.plateau_evals)

    now = finding(evals)
    if now is not None and finding([point for point in evals if point[0] != step]) is None:
        run_log.append_event(run_dir, evals[-1][0], now.event, **now.fields())


# --- eval.md ---------------------------------------------------------------------------------------------------------


def write_table(run_dir: str | Path, state: ScheduleState) -> None:
    atomic_write_bytes(Path(run_dir) / EVAL_TABLE_FILE, eval_table(state).encode())


def eval_table(state: ScheduleState) -> str:
    """The run's own evaluations as a markdown table: a row per step done or failed."""
    lines = [
        "| step | " + " | ".join(EVAL_COLUMNS) + " | checkpoint |",
        "|---:|" + "---:|" * len(EVAL_COLUMNS) + "---|",
    ]
    for step in sorted({*state.done, *state.failed}):
        if step in state.done:
            cells = [markdown_cell(state.metrics.get(step, {}).get(name)) for name in EVAL_COLUMNS]
            name = Path(state.done[step]).name
        else:
            cells = ["failed"] + [""] * (len(EVAL_COLUMNS) - 1)
            name = checkpoint_dir("", step).name
        lines.append(f"| {step} | " + " | ".join(cells) + f" | {name} |")
    return "\n".join(lines) + "\n"


def markdown_cell(value: Any) -> str:
    """A metric as a markdown table cell: floats to 4 places, None empty."""
    return f"{value:.4f}" if isinstance(value, float) else str(value if value is not None else "")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
