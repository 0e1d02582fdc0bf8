"""The one evaluation orchestrator: the scheduler that evaluates a run's checkpoints for a schedule, on Ray.

Design (issue 35, item 2: one orchestrator for evaluation on a run).
- Every evaluation of a run belongs to a schedule: its state is its file, schedules/NAME.json
  (services.rundir.schedules); what an outcome writes (the result line, then the file; the run's eval.md and plateau
  check) is services.rundir.evaluations. Neither needs Ray.
- The recipe's [eval] is the run's own schedule, RECIPE ("recipe"): every eval.every_steps and the run's last
  checkpoint. The run's coordinator actor (services.train.coordinator) adopts it when it starts and runs its
  `Scheduler` in a thread; `albert eval schedule` makes other schedules and runs each one's `Scheduler` in a
  `ScheduleRunner` actor (or in the command itself, --once). Same loop, same decisions, same files.
- The coordinator keeps the run's ledger (checkpoint index, retention, events), stop requests, dropout and the
  heartbeat. It tells its scheduler when a checkpoint was saved (which observes it at once, so that status and
  retention see the step due), opens its `gate` when training reports (evaluations left pending by a previous
  coordinator never take a resumed run's CPUs before its workers do), and waits for it at the run's end. Retention
  asks services.rundir.evaluations for the steps evaluation still needs.

The loop, every poll_s or when woken: look at the run directory (the checkpoints on disk; the run's log for the
checkpoints it saved, so that one deleted before it was evaluated is named missing, never skipped silently, and for
the run's last ones), record the schedule's due steps, collect finished evaluations, launch due ones while there is
room. A step is due when its checkpoint is the first at or past a multiple of `every` (every multiple, when the
checkpoints fall on them) or, for a schedule with `final`, the run's last; it is evaluated once per checkpoint
written (a step missing or failed on one checkpoint is due again once the run saves that step again). A step is
recorded done only after its result line is in metrics.jsonl, and a starting scheduler reconciles the file from the
log: a crash neither repeats nor loses one. One process runs a schedule at a time (its run lock); the scheduler
renews the schedule's lease (its heartbeat) on every pass, which holds its checkpoints from retention.

Evaluators: one `IntrinsicEvaluator` actor per evaluation, killed when it ends, so nothing is held between
checkpoints; named albert-eval:RUN:STEP:SCHEDULE-HASH-TOKEN. Their size never starves training on a small machine:
the recipe's evaluators get eval.cpus each only out of the CPUs beyond the training workers' (all of them, so that a
restarted or resumed worker group always finds its CPUs), as many at once as fit there, else one at a time on 0 CPUs
beside training (`evaluator_slots`, an `eval_cpus_shared` event once); another schedule's evaluator gets its CPUs
only beyond those and the recipe's most (`schedule_cpus`), one at a time. An evaluator that dies is relaunched up to
MAX_EVALUATOR_DEATHS times (an `eval_retried` event each), then the step is failed; an evaluation that raises, or a
checkpoint that does not verify, is failed at once (an `eval_failed` event). Neither touches training.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError

from albert_core.files import CorruptCheckpoint, DiskFull
from services import RAY_NAMESPACE
from services.eval.evaluate import IntrinsicEvaluator, IntrinsicOptions, options_dict
from services.rundir import evaluations, schedules
from services.rundir import log as run_log
from services.rundir.checkpoints import CHECKPOINTS_DIR, MODEL_FILES, checkpoint_dir, list_checkpoints, verify
from services.rundir.config import RunConfig
from services.rundir.ledger import LedgerState, ledger_path
from services.rundir.schedules import RECIPE, ScheduleSpec, ScheduleState, checkpoint_identity

log = logging.getLogger(__name__)
MAX_EVALUATOR_DEATHS = 2  # relaunches of an evaluator that died on the same checkpoint


class ScheduleBusy(ValueError):
    """Another process runs this schedule (it holds the schedule's run lock)."""


def runner_name(run_dir: str | Path, name: str) -> str:
    """`albert-schedule:RUN:NAME:HASH` (HASH: of the run directory's path, so two runs of one name never share it)."""
    path = Path(run_dir).resolve()
    return f"albert-schedule:{path.name}:{name}:{_path_hash(path)}"


def evaluator_prefix(run_dir: str | Path, name: str, step: int) -> str:
    """The start of the names of the evaluators of one step of a schedule (each launch adds a token)."""
    path = Path(run_dir).resolve()
    return f"albert-eval:{path.name}:{step}:{name}-{_path_hash(path)}-"


def _path_hash(path: Path) -> str:
    return hashlib.sha1(str(path).encode()).hexdigest()[:8]


def run_config_of(run_dir: str | Path) -> RunConfig:
    """The run's config of record (its ledger's): the one its last start or resume used."""
    path = ledger_path(run_dir)
    if not path.is_file():
        raise FileNotFoundError(f"RUN: {run_dir} has no {path.name}; is it a run directory (runs/NAME)?")
    return RunConfig.from_dict(LedgerState.from_json(path.read_text(), path).config, source=str(path))


# --- sizing --------------------------------------------------------------------------------------------------------


def evaluator_slots(eval_cpus: float, *, training_cpus: float, cluster_cpus: float) -> tuple[float, int]:
    """(CPUs per evaluator, evaluators at once) such that evaluators never hold a CPU the training workers need.

    Evaluators get eval.cpus each only from the CPUs the cluster has beyond the training workers' (all of them, so
    that a restarted or resumed worker group always finds its CPUs), as many at once as fit there. With no such CPU
    (or eval.cpus = 0) one evaluator at a time runs on 0 CPUs, beside training: slower, never blocking.
    """
    spare = cluster_cpus - training_cpus
    if eval_cpus <= 0 or spare < eval_cpus:
        return 0.0, 1
    return eval_cpus, int(spare // eval_cpus)


def schedule_cpus(wanted: float, config: RunConfig, cluster_cpus: float) -> float:
    """CPUs for another schedule's evaluator: `wanted` only when the cluster has them beyond the training workers'
    and the most the run's own evaluators may take (`evaluator_slots`), else 0 (beside training)."""
    t = config.train
    training = t.num_workers * t.cpus_per_worker
    run_cpus, run_slots = evaluator_slots(config.eval.cpus, training_cpus=training, cluster_cpus=cluster_cpus)
    cpus, _ = evaluator_slots(wanted, training_cpus=training + run_cpus * run_slots, cluster_cpus=cluster_cpus)
    return cpus


# --- what the run has ----------------------------------------------------------------------------------------------


def checkpoints_on_disk(run_dir: Path) -> dict[int, str]:
    return {step: str(path.resolve()) for step, path in list_checkpoints(run_dir / CHECKPOINTS_DIR)}


@dataclass
class SavedSteps:
    """What the run's log says of its checkpoints."""

    gone_why: dict[int, str]  # every step saved -> why it would not be on disk now
    finals: set[int]  # the steps saved as the run's last
    named: set[int]  # every step a checkpoint event names


def saved_steps(run_dir: Path) -> SavedSteps:
    saved, finals, named = {}, set(), set()
    for record in run_log.read_metrics(run_dir):
        event, step = str(record.get("event")), record.get("step")
        if record.get("kind") != "event" or step is None or not event.startswith("checkpoint_"):
            continue
        step = int(step)
        named.add(step)
        if event in ("checkpoint_saved", "checkpoint_replaced"):
            saved[step] = "not on disk"
            if record.get("final"):
                finals.add(step)
        elif event == "checkpoint_deleted" and step in saved:
            saved[step] = "deleted by retention (train.keep_last) before the schedule evaluated it"
        elif event == "checkpoint_corrupt" and step in saved:
            saved[step] = f"corrupt: {record.get('reason')}"
    return SavedSteps(saved, finals, named)


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


@dataclass
class RunView:
    """The run at the scheduler's last look."""

    on_disk: dict[int, str]
    saved: SavedSteps
    finals: set[int]  # the run's last checkpoints: saved as final, or at optim.total_steps or past it
    finished: bool


@dataclass
class Launch:
    """One evaluation under way."""

    ref: Any
    evaluator: Any
    path: str
    identity: str  # checkpoint_identity of the checkpoint evaluated


# --- the loop ----------------------------------------------------------------------------------------------------


class Scheduler:
    """Evaluates one schedule's due checkpoints until the run is finished and nothing is pending, or it is cancelled.

    `gate`: evaluators are launched only while it is set (the run's coordinator sets it when training reports).
    `wake`: set it to have the loop look at the run at once (a checkpoint was saved)."""

    def __init__(self, run_dir: str | Path, name: str, *, poll_s: float = 2.0, gate: threading.Event | None = None):
        self.run_dir, self.name, self.poll_s = Path(run_dir).resolve(), name, poll_s
        self.spec: ScheduleSpec = schedules.load(self.run_dir, name).spec
        self.config = run_config_of(self.run_dir)
        self.gate = gate
        self.wake = threading.Event()
        self.running: dict[int, Launch] = {}
        self.deaths: dict[int, int] = {}
        self._view: RunView | None = None
        self._back_after_lapse: set[int] | None = None  # its lease had lapsed: the steps missing before this start
        self._shared_noted = False
        self._lock = threading.RLock()  # the loop's thread and its owner's (observe) share the scheduler

    def run(self, stop: threading.Event, *, once: bool = False) -> ScheduleState:
        """The loop; `once`: evaluate what is due now and return. Raises ScheduleBusy when another process runs it."""
        with schedules.running(self.run_dir, self.name) as held:
            if not held:
                raise ScheduleBusy(f"schedule {self.name} of {self.run_dir} is already running in another process")
            try:
                return self._loop(stop, once)
            finally:
                self.release()

    def _loop(self, stop: threading.Event, once: bool) -> ScheduleState:
        self.wake.clear()
        state = self.reconcile()
        while not stop.is_set():
            schedules.touch_heartbeat(self.run_dir, self.name)
            state = self.step()
            if self._back_after_lapse is not None:
                self.report_missed(state)
            if not state.active() or (once and not self.running and not self.due(state)):
                break
            refs = [launch.ref for launch in self.running.values()]
            if refs:
                ray.wait(refs, num_returns=1, timeout=self.poll_s)
            else:
                self.wake.wait(self.poll_s)
            self.wake.clear()
        return schedules.load(self.run_dir, self.name)

    def step(self) -> ScheduleState:
        """One pass: collect finished evaluations, record what the run has now, launch what is due and fits."""
        with self._lock:
            self.collect()
            state, _ = self.observe()
            if state.cancelled:
                self.release()
            elif self.gate is None or self.gate.is_set():
                due = self.due(state)
                if due:
                    cpus, slots = self._sizing(due[0])
                    for step in due[: max(0, slots - len(self.running))]:
                        self.launch(step, cpus)
            return state

    def reconcile(self) -> ScheduleState:
        """A start: result lines that reached metrics.jsonl after the last record are taken back as done."""
        results = [r for r in run_log.read_metrics(self.run_dir) if self.spec.owns(r)]

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
        run_log.append_event(
            self.run_dir, step, "schedule_resumed", schedule=self.name, missed=missed, resumes_at=resumes_at
        )
        log.warning("schedule %s: back after its lease lapsed; missed steps %s, resumes at %s", self.name, missed,
                    resumes_at)  # fmt: skip

    def observe(self) -> tuple[ScheduleState, int | None]:
        """Record what the run has now (pending, missing, complete); returns the state and the oldest step due and
        not under way."""
        with self._lock:
            view = self._look()
            gone = {step: why for step, why in view.saved.gone_why.items() if step not in view.on_disk}

            def note(state: ScheduleState) -> None:
                identities = {s: checkpoint_identity(view.on_disk[s]) for s in state.retry_candidates(view.on_disk)}
                state.observe(view.on_disk, gone, identities, view.finals)
                state.complete = state.complete or (view.finished and not state.pending and not state.cancelled)

            state = schedules.update(self.run_dir, self.name, note)
            self.spec = state.spec
            due = self.due(state)
            return state, (due[0] if due else None)

    def due(self, state: ScheduleState) -> list[int]:
        """The pending steps not under way, oldest first."""
        return [step for step in state.pending if step not in self.running] if state.active() else []

    def _look(self) -> RunView:
        """The checkpoints on disk; the log is read again when they changed or one is not in it yet."""
        on_disk = checkpoints_on_disk(self.run_dir)  # listed before the log is read would name a new one missing
        view = self._view
        if view is None or set(view.on_disk) != set(on_disk) or not set(on_disk) <= view.saved.named:
            saved = saved_steps(self.run_dir)
            on_disk = checkpoints_on_disk(self.run_dir)
            self.config = run_config_of(self.run_dir)  # a resume may have raised optim.total_steps since
            total = self.config.optim.total_steps
            finals = saved.finals | {s for s in (*saved.gone_why, *on_disk) if s >= total}
            newest = max(on_disk, default=None)
            finished = newest is not None and (newest in finals or run_finished(on_disk[newest], self.config))
            view = self._view = RunView(on_disk, saved, finals, finished)
        return view

    def launch(self, step: int, cpus: float | None = None) -> None:
        """Start evaluating a due step. Its checkpoint is verified first: a damaged one is failed and a gone one
        missing, with no evaluator started."""
        path = self._look().on_disk.get(step) or str(checkpoint_dir(self.run_dir / CHECKPOINTS_DIR, step))
        seen_as = checkpoint_identity(path)  # the write evaluated (a step settled on it is due again once re-saved)
        try:
            verify(path, MODEL_FILES)
        except (CorruptCheckpoint, FileNotFoundError) as err:
            self._settle(step, missing=not Path(path).exists(), why=str(err), identity=seen_as, path=path)
            return
        if cpus is None:
            cpus, _ = self._sizing(step)
        options = options_dict(IntrinsicOptions.from_run_config(self.config))
        try:
            evaluator = IntrinsicEvaluator.options(
                name=evaluator_prefix(self.run_dir, self.name, step) + uuid.uuid4().hex[:8],
                namespace=RAY_NAMESPACE,
                num_cpus=cpus,
                max_restarts=0,
            ).remote(self.spec.heldout, options, None, self._tasks())
            self.running[step] = Launch(evaluator.evaluate.remote(path, step), evaluator, path, seen_as)
        except (RayError, ValueError) as err:
            self._settle(step, missing=False, why=f"could not launch an evaluator: {err}", identity=seen_as, path=path)

    def collect(self) -> None:
        """Record every finished evaluation; an evaluator that died leaves its step due (relaunched by the next pass)
        up to MAX_EVALUATOR_DEATHS times."""
        if not self.running:
            return
        refs = {launch.ref: step for step, launch in self.running.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        if ready and schedules.load(self.run_dir, self.name).cancelled:
            self.release()  # a cancelled schedule records nothing more
            return
        for ref in ready:
            step = refs[ref]
            launch = self.running.pop(step)
            self._record(step, launch)
            ray.kill(launch.evaluator, no_restart=True)

    def _record(self, step: int, launch: Launch) -> None:
        try:
            result = ray.get(launch.ref, timeout=0)
        except RayTaskError as err:  # the evaluation raised: retrying would raise again
            gone = not Path(launch.path).exists()
            why = "deleted while it was evaluated" if gone else _last(err)
            self._settle(step, missing=gone, why=why, identity=launch.identity, path=launch.path)
        except RayError as err:  # the evaluator died
            deaths = self.deaths[step] = self.deaths.get(step, 0) + 1
            if deaths > MAX_EVALUATOR_DEATHS:
                why = f"evaluator died {deaths} times: {_last(err)}"
                self._settle(step, missing=False, why=why, identity=launch.identity, path=launch.path)
            else:
                run_log.append_event(self.run_dir, step, "eval_retried", schedule=self.name, deaths=deaths,
                                     reason=_last(err))  # fmt: skip
        else:
            evaluations.record_result(self.run_dir, self.spec, self.config, step, launch.path, result)

    def _settle(self, step: int, *, missing: bool, why: str, identity: str, path: str) -> None:
        evaluations.record_failure(
            self.run_dir, self.spec, step, missing=missing, why=why, identity=identity, checkpoint=path
        )

    def _sizing(self, step: int) -> tuple[float, int]:
        """(CPUs per evaluator, evaluators at once) for this schedule now (see the module's docstring)."""
        t, cluster_cpus = self.config.train, ray.cluster_resources().get("CPU", 0.0)
        training_cpus = t.num_workers * t.cpus_per_worker
        if self.name == RECIPE:
            cpus, slots = evaluator_slots(self.spec.cpus, training_cpus=training_cpus, cluster_cpus=cluster_cpus)
        else:
            cpus, slots = schedule_cpus(self.spec.cpus, self.config, cluster_cpus), 1
        if cpus < self.spec.cpus and not self._shared_noted:
            self._shared_noted = True
            run_log.append_event(
                self.run_dir, step, "eval_cpus_shared", schedule=self.name, eval_cpus=self.spec.cpus,
                cluster_cpus=cluster_cpus, training_cpus=training_cpus,
                message="the cluster has no CPU beyond the training workers' own: evaluators run one at a time on 0 "
                "CPUs, beside training",
            )  # fmt: skip
        return cpus, slots

    def _tasks(self) -> dict[str, Any]:
        """The downstream tasks each evaluation runs, as IntrinsicEvaluator takes them."""
        return {
            "tasks": list(self.spec.tasks),
            "task_data": dict(zip(self.spec.tasks, self.spec.task_data, strict=True)),
            "seeds": self.spec.task_seeds,
            "max_steps": self.spec.task_max_steps,
        }

    def release(self) -> None:
        """Stop the evaluations under way (their steps stay pending)."""
        for launch in self.running.values():
            ray.kill(launch.evaluator, no_restart=True)
        self.running.clear()


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
        self.disk_full = False  # the error is a full disk's line (albert_core.files.DiskFull)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.scheduler.run(self.stop_event)
                break
            except ScheduleBusy:
                self.stop_event.wait(self.scheduler.poll_s)
            except DiskFull as err:  # its one line, reported by progress(); the actor ends
                log.error("schedule %s stopped: %s", self.scheduler.name, err)
                self.error, self.disk_full = str(err), True
                break
            except Exception as err:  # reported by progress(); the actor ends
                log.exception("schedule %s failed", self.scheduler.name)
                self.error = f"{type(err).__name__}: {err}"
                break
        if self.error is None:
            ray.get_runtime_context().current_actor.__ray_terminate__.remote()

    def progress(self) -> dict[str, Any]:
        state = schedules.load(self.scheduler.run_dir, self.scheduler.name)
        return {**state.summary(), "error": self.error, "disk_full": self.disk_full}

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
