"""Evaluation schedules on Ray: the scheduler loop and the detached actor that runs it.

A schedule (its state: services.rundir.schedules) is run by one `Scheduler` at a time (the schedule's run lock). The
loop looks at the run directory every `poll_s`: the checkpoints on disk (`<run_dir>/checkpoints/step_*`), the
checkpoints the run's log says were saved (so that one deleted before the schedule saw it is named missing, never
skipped silently), and whether the run is finished. It evaluates the oldest due checkpoint on an
`IntrinsicEvaluator` (services.eval.evaluate), appends the result to metrics.jsonl (kind "schedule_eval", with the
schedule's name), then records the step done; it ends when the run is finished and nothing is pending, or when the
schedule is cancelled.

`ScheduleRunner` is that loop in a named actor (0 CPUs, restarted by Ray when its process dies: the new one
reconciles the schedule from metrics.jsonl and goes on). Its evaluator gets `spec.cpus` only out of the CPUs the
cluster has beyond the training workers' and the run's own evaluators' (`schedule_cpus`), else 0 CPUs, beside
training: a restarted or resumed worker group always finds its CPUs.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError

from albert_core.files import CorruptCheckpoint
from services import RAY_NAMESPACE
from services.eval.evaluate import IntrinsicEvaluator, IntrinsicOptions, evaluator_slots, options_dict
from services.rundir import log as run_log
from services.rundir import schedules
from services.rundir.checkpoints import CHECKPOINTS_DIR, MODEL_FILES, list_checkpoints, verify
from services.rundir.config import RunConfig
from services.rundir.ledger import LedgerState, ledger_path
from services.rundir.schedules import RESULT_KIND, ScheduleSpec, ScheduleState, checkpoint_identity

log = logging.getLogger(__name__)
MAX_EVALUATOR_DEATHS = 2  # relaunches of an evaluator that died on the same checkpoint


class ScheduleBusy(ValueError):
    """Another process runs this schedule (it holds the schedule's run lock)."""


def runner_name(run_dir: str | Path, name: str) -> str:
    """`albert-schedule:RUN:NAME:HASH` (HASH: of the run directory's path, so two runs of one name never share it)."""
    path = Path(run_dir).resolve()
    return f"albert-schedule:{path.name}:{name}:{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"


def run_config_of(run_dir: str | Path) -> RunConfig:
    """The run's config of record (its ledger's): the one its last start or resume used."""
    path = ledger_path(run_dir)
    if not path.is_file():
        raise FileNotFoundError(f"RUN: {run_dir} has no {path.name}; is it a run directory (runs/NAME)?")
    return RunConfig.from_dict(LedgerState.from_json(path.read_text(), path).config, source=str(path))


def schedule_cpus(wanted: float, config: RunConfig, cluster_cpus: float) -> float:
    """CPUs for a schedule's evaluator: `wanted` only when the cluster has them beyond the training workers' and the
    most the run's own evaluators may take (services.eval.evaluate.evaluator_slots), else 0 (beside training)."""
    t = config.train
    training = t.num_workers * t.cpus_per_worker
    run_cpus, run_slots = evaluator_slots(config.eval.cpus, training_cpus=training, cluster_cpus=cluster_cpus)
    cpus, _ = evaluator_slots(wanted, training_cpus=training + run_cpus * run_slots, cluster_cpus=cluster_cpus)
    return cpus


def result_record(name: str, step: int, result: dict[str, Any]) -> dict[str, Any]:
    """The schedule's line in metrics.jsonl for one evaluated checkpoint."""
    metrics = {k: v for k, v in result.items() if k not in ("step", "time", "kind", "schedule")}
    return {"step": step, "time": time.time(), "kind": RESULT_KIND, "schedule": name, **metrics}


# --- what the run has ------------------------------------------------------------------------------------------


def checkpoints_on_disk(run_dir: Path) -> dict[int, str]:
    return {step: str(path) for step, path in list_checkpoints(run_dir / CHECKPOINTS_DIR)}


def saved_steps(run_dir: Path) -> dict[int, str]:
    """Every checkpoint step the run's log says was saved -> why it would not be on disk now."""
    saved: dict[int, str] = {}
    for record in run_log.read_metrics(run_dir):
        event, step = record.get("event"), record.get("step")
        if record.get("kind") != "event" or step is None:
            continue
        if event in ("checkpoint_saved", "checkpoint_replaced"):
            saved[int(step)] = "not on disk"
        elif event == "checkpoint_deleted" and int(step) in saved:
            saved[int(step)] = "deleted by retention (train.keep_last) before the schedule evaluated it"
        elif event == "checkpoint_corrupt" and int(step) in saved:
            saved[int(step)] = f"corrupt: {record.get('reason')}"
    return saved


def run_finished(newest: str | None, config: RunConfig) -> bool:
    """The run's newest checkpoint is its last: optim.total_steps reached or train.max_seconds spent."""
    if newest is None:
        return False
    from services.rundir.checkpoints import read_trainer_json

    try:
        state = read_trainer_json(newest)["state"]
    except (ValueError, KeyError, OSError):
        return False
    t = config.train
    return state["step"] >= config.optim.total_steps or bool(
        t.max_seconds and state.get("train_seconds", 0.0) >= t.max_seconds
    )


# --- the loop ----------------------------------------------------------------------------------------------------


class Scheduler:
    """Evaluates one schedule's due checkpoints, one at a time, until the run is finished or it is cancelled."""

    def __init__(self, run_dir: str | Path, name: str, *, poll_s: float = 2.0):
        self.run_dir, self.name, self.poll_s = Path(run_dir).resolve(), name, poll_s
        self.spec: ScheduleSpec = schedules.load(self.run_dir, name).spec
        self.config = run_config_of(self.run_dir)
        self.evaluator = None
        self.deaths: dict[int, int] = {}
        self._seen: tuple[dict[int, str], dict[int, str], bool] | None = None
        self._back_after_lapse: set[int] | None = None  # its lease had lapsed: the steps missing before this start

    def run(self, stop: threading.Event, *, once: bool = False) -> ScheduleState:
        """The loop; `once`: evaluate what is due now and return. Raises ScheduleBusy when another process runs it."""
        with schedules.running(self.run_dir, self.name) as held:
            if not held:
                raise ScheduleBusy(f"schedule {self.name} of {self.run_dir} is already running in another process")
            try:
                return self._loop(stop, once)
            finally:
                self._release_evaluator()

    def _loop(self, stop: threading.Event, once: bool) -> ScheduleState:
        state = self.reconcile()
        while not stop.is_set() and state.active():
            schedules.touch_heartbeat(self.run_dir, self.name)
            state, due = self.observe()
            if self._back_after_lapse is not None:
                self.report_missed(state)
            if due is not None:
                self.evaluate(due, stop)
            elif once:
                break
            else:  # the evaluator stays up between checkpoints: a new one would import torch and read the held-out set
                stop.wait(self.poll_s)
        return schedules.load(self.run_dir, self.name)

    def reconcile(self) -> ScheduleState:
        """A start: result lines that reached metrics.jsonl after the last record are taken back as done."""
        results = [r for r in run_log.read_metrics(self.run_dir) if r.get("kind") == RESULT_KIND]

        def start(state: ScheduleState) -> None:
            if state.lease_lapsed:  # its checkpoints were not held meanwhile: report_missed says what went
                self._back_after_lapse = set(state.missing)
                state.lease_lapsed = False
            state.starts += 1
            state.complete = False  # found again below, once nothing is pending (the run may have trained on)
            taken = state.reconcile(results)
            if taken:
                log.info("schedule %s: steps %s were in the metrics log already", self.name, taken)

        return schedules.update(self.run_dir, self.name, start)

    def report_missed(self, state: ScheduleState) -> None:
        """Back after its lease lapsed: a schedule_resumed event naming the steps retention deleted meanwhile
        (now missing) and the oldest checkpoint still present, where it resumes."""
        missed = sorted(set(state.missing) - (self._back_after_lapse or set()))
        self._back_after_lapse = None
        resumes_at = state.pending[0] if state.pending else None
        step = max([*missed, *state.pending, *state.done], default=0)
        record = {"step": step, "time": time.time(), "kind": "event", "event": "schedule_resumed",
                  "schedule": self.name, "missed": missed, "resumes_at": resumes_at}  # fmt: skip
        run_log.append(self.run_dir, record)
        log.warning("schedule %s: back after its lease lapsed; missed steps %s, resumes at %s", self.name, missed,
                    resumes_at)  # fmt: skip

    def observe(self) -> tuple[ScheduleState, int | None]:
        """Record what the run has now (pending, missing, complete); returns the state and the oldest due step."""
        on_disk = checkpoints_on_disk(self.run_dir)  # listed before the log is read would name a new one missing
        if self._seen is None or set(self._seen[0]) != set(on_disk):
            saved = saved_steps(self.run_dir)
            on_disk = checkpoints_on_disk(self.run_dir)
            self.config = run_config_of(self.run_dir)  # a resume may have raised optim.total_steps since
            self._seen = (on_disk, saved, run_finished(on_disk[max(on_disk)] if on_disk else None, self.config))
        on_disk, saved, finished = self._seen
        gone = {step: why for step, why in saved.items() if step not in on_disk}

        def note(state: ScheduleState) -> None:
            identities = {step: checkpoint_identity(on_disk[step]) for step in state.retry_candidates(on_disk)}
            state.observe(on_disk, gone, identities)
            state.complete = state.complete or (finished and not state.pending and not state.cancelled)

        state = schedules.update(self.run_dir, self.name, note)
        return state, (state.pending[0] if state.pending and state.active() else None)

    def evaluate(self, step: int, stop: threading.Event) -> None:
        """Evaluate one checkpoint; its result line is appended before the step is recorded done."""
        path = self._seen[0][step]
        # The write evaluated: a step settled missing or failed on it is retried once the run saves the step again.
        seen_as = checkpoint_identity(path)
        try:
            verify(path, MODEL_FILES)
        except (CorruptCheckpoint, FileNotFoundError) as err:
            self._settle(step, "missing" if not Path(path).exists() else "failed", str(err), seen_as)
            return
        ref = self._evaluator().evaluate.remote(path, step)
        while not ray.wait([ref], timeout=self.poll_s)[0]:
            if stop.is_set() or schedules.load(self.run_dir, self.name).cancelled:
                self._release_evaluator()
                return
            schedules.touch_heartbeat(self.run_dir, self.name)
        try:
            result = ray.get(ref)
        except RayTaskError as err:
            gone = not Path(path).exists()
            why = "deleted while it was evaluated" if gone else _last(err)
            self._settle(step, "missing" if gone else "failed", why, seen_as)
            return
        except RayError as err:  # the evaluator died: a new one tries again, up to MAX_EVALUATOR_DEATHS times
            self.evaluator = None
            self.deaths[step] = self.deaths.get(step, 0) + 1
            if self.deaths[step] > MAX_EVALUATOR_DEATHS:
                self._settle(step, "failed", f"evaluator died {self.deaths[step]} times: {_last(err)}", seen_as)
            return
        if schedules.load(self.run_dir, self.name).cancelled:
            return
        run_log.append(self.run_dir, result_record(self.name, step, result))
        schedules.update(self.run_dir, self.name, lambda s: s.mark_done(step, path))

    def _settle(self, step: int, how: str, why: str, seen_as: str) -> None:
        mark = {"missing": ScheduleState.mark_missing, "failed": ScheduleState.mark_failed}[how]
        schedules.update(self.run_dir, self.name, lambda s: mark(s, step, why, seen_as))

    def _evaluator(self):
        if self.evaluator is None:
            cpus = schedule_cpus(self.spec.cpus, self.config, ray.cluster_resources().get("CPU", 0.0))
            downstream = {
                "tasks": list(self.spec.tasks),
                "task_data": dict(zip(self.spec.tasks, self.spec.task_data, strict=True)),
                "seeds": self.spec.task_seeds,
                "max_steps": self.spec.task_max_steps,
            }
            options = options_dict(IntrinsicOptions.from_run_config(self.config))
            self.evaluator = IntrinsicEvaluator.options(num_cpus=cpus, max_restarts=0).remote(
                self.spec.heldout, options, None, downstream
            )
        return self.evaluator

    def _release_evaluator(self) -> None:
        if self.evaluator is not None:
            ray.kill(self.evaluator, no_restart=True)
            self.evaluator = None


def _last(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[-1] if lines else type(err).__name__


# --- the actor ---------------------------------------------------------------------------------------------------


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class ScheduleRunner:
    """One schedule's scheduler as a named actor. Its loop runs in a thread; when another process holds the schedule
    (a previous incarnation still shutting down, an `--once` run) it waits for it. It ends itself when the schedule
    is complete or cancelled; a process that dies is restarted by Ray and carries on from the files."""

    def __init__(self, run_dir: str, name: str, poll_s: float = 2.0):
        self.scheduler = Scheduler(run_dir, name, poll_s=poll_s)
        self.stop_event = threading.Event()
        self.error: str | None = None
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.scheduler.run(self.stop_event)
                break
            except ScheduleBusy:
                self.stop_event.wait(self.scheduler.poll_s)
            except Exception as err:  # reported by progress(); the actor ends
                log.exception("schedule %s failed", self.scheduler.name)
                self.error = f"{type(err).__name__}: {err}"
                break
        if self.error is None:
            ray.get_runtime_context().current_actor.__ray_terminate__.remote()

    def progress(self) -> dict[str, Any]:
        state = schedules.load(self.scheduler.run_dir, self.scheduler.name)
        return {**state.summary(), "error": self.error}

    def pid(self) -> int:
        import os

        return os.getpid()


def start_runner(run_dir: str | Path, name: str, *, detached: bool, poll_s: float = 2.0):
    """The schedule's runner actor: the live one of that name, else a new one (namespace "albert")."""
    return ScheduleRunner.options(
        name=runner_name(run_dir, name),
        namespace=RAY_NAMESPACE,
        get_if_exists=True,
        lifetime="detached" if detached else None,
    ).remote(str(Path(run_dir).resolve()), name, poll_s)


def stop_runner(run_dir: str | Path, name: str) -> bool:
    """Kill the schedule's runner actor on the connected cluster; False when there is none."""
    try:
        actor = ray.get_actor(runner_name(run_dir, name), namespace=RAY_NAMESPACE)
    except ValueError:
        return False
    ray.kill(actor, no_restart=True)
    return True
