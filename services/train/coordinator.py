"""The run coordinator: one named Ray actor per run that wraps the run's ledger and runs its evaluations.

The ledger (services.rundir.ledger) keeps the run's record: metrics log, checkpoint index and retention, evaluation
bookkeeping, dropout state, ledger.json. The actor adds only what needs Ray: it launches an
`IntrinsicEvaluator` actor for each evaluation the ledger finds due, without blocking, and collects results on
every later call, in `poll()` and in `wait_for_evals()`. An evaluator that dies is relaunched up to
MAX_EVAL_RETRIES times; one that raises is recorded as failed. Neither touches training. A restarted coordinator
(`max_restarts=-1`) reopens the ledger and relaunches the evaluations that were pending.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from albert_core.examples.shards import HELDOUT_FILE
from services import RAY_NAMESPACE
from services.cluster import coordinator_name
from services.eval.evaluate import IntrinsicEvaluator, IntrinsicOptions, check_tasks, evaluator_slots, options_dict
from services.rundir.config import RunConfig
from services.rundir.health import stalled
from services.rundir.ledger import EvalEntry, RunLedger
from services.rundir.status import HEARTBEAT_EVERY_S, status_of, touch_heartbeat

MAX_EVAL_RETRIES = 2  # relaunches of an evaluator that died


def evaluator_name(run_name: str, step: int, launch: int) -> str:
    """Name of the evaluator actor for one launch of one step's evaluation (namespace "albert")."""
    return f"albert-eval:{run_name}:{step}:{launch}"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Coordinator:
    def __init__(
        self,
        run_dir: str,
        run_name: str,
        config_dict: dict[str, Any],
        heldout_path: str,
        evaluator_options: dict[str, Any] | None = None,
        session: str = "",
    ):
        """`session`: this run's start (get_or_create_coordinator draws one); Ray restarts the actor with the same
        arguments, so a restarted coordinator reads back the stop its session's driver asked for."""
        self.ledger = RunLedger(run_dir, run_name, config_dict)
        self.run_name = run_name
        self.session = session
        self.heldout_path = heldout_path
        config = self.ledger.config
        self.intrinsic = IntrinsicOptions.from_run_config(config)
        e = config.eval
        self.downstream = {
            "tasks": list(e.tasks),
            "task_data": dict(e.task_data),
            "seeds": e.task_seeds,
            "max_steps": e.task_max_steps,
        }
        self.evaluator_options = dict(evaluator_options or {})
        self._running: dict[int, tuple[ray.ObjectRef, Any]] = {}  # step -> (result ref, evaluator actor)
        # Due evaluations wait here for a slot (see `evaluator_slots`). Those left pending by a previous coordinator
        # (their evaluators died with it) wait until training reports its first step: a resumed run's workers get
        # their CPUs before any evaluator asks for one.
        self._queue: list[EvalEntry] = list(self.ledger.pending_evals())
        self._training_started = False
        self._shared_cpus_noted = False
        self._stop_requested = self.ledger.stop_requested(session)
        self._last_seen, self._stall_reported = time.monotonic(), False
        threading.Thread(target=self._watch, args=(config.train.stall_seconds,), daemon=True).start()

    # --- the train loop's calls ---

    def report(self, step: int, metrics: dict[str, Any]) -> None:
        """Append a train line; note resumes and dropout changes. Idempotent for a retried call."""
        self._training_started = True
        self._collect()
        self._last_seen, self._stall_reported = time.monotonic(), False
        self.ledger.report(step, metrics)

    def checkpoint_saved(
        self, step: int, path: str, metrics: dict[str, Any] | None = None, *, final: bool = False
    ) -> dict[str, Any]:
        """Verify, index, launch an evaluation when one is due, apply retention.

        Returns {"accepted", "reason" (when refused), "eval_scheduled", "deleted": [paths]}. The run's last
        checkpoint (step >= optim.total_steps, or `final=True` for a run stopped early) is evaluated even off the
        every_steps schedule.
        """
        self._training_started = True
        self._collect()
        result = self.ledger.checkpoint_saved(step, path, metrics, final=final)
        if result.eval_due is not None:
            self._queue.append(result.eval_due)
            self._pump()
            self.ledger.save()
        return result.to_dict()

    def latest_good_checkpoint(self) -> str | None:
        self._collect()
        return self.ledger.latest_good_checkpoint()

    def event(self, step: int, event: str, fields: dict[str, Any]) -> None:
        """A run event (training health, a stop on request) appended to the metrics log."""
        self.ledger.event(step, event, **fields)

    def request_stop(self, signal: str = "SIGINT", where: str = "the driver") -> None:
        """A graceful stop (the driver's first Ctrl-C, a SIGTERM to the driver or to a worker process): training saves
        a checkpoint at its next step and ends there. The first request counts; later ones change nothing."""
        if self._stop_requested is None:
            self._stop_requested = signal
            name = "Ctrl-C (SIGINT)" if signal == "SIGINT" else signal
            self.ledger.request_stop(self.session, reason=f"{name} on {where}", signal=signal)

    def stop_requested(self) -> str | None:
        """Polled by rank 0 after every step: the signal that asked for a stop, or None."""
        return self._stop_requested

    # --- evaluations ---

    def poll(self) -> dict[str, int]:
        """Collect finished evaluations; returns the counts of pending / done / failed ones."""
        self._collect()
        return self.ledger.eval_counts()

    def wait_for_evals(self, timeout: float | None = None) -> dict[str, int]:
        """Block until no evaluation is pending (or `timeout` seconds pass); returns the counts."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._training_started = True  # training is over: nothing left to wait for
        self._collect()
        while self._running:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            ray.wait([ref for ref, _ in self._running.values()], num_returns=1, timeout=remaining)
            self._collect()
        return self.ledger.eval_counts()

    def status(self) -> dict[str, Any]:
        self._collect()
        return status_of(self.ledger.state, live=True)

    def check_stall(self) -> None:
        """A `stalled` event when no step was reported for train.stall_seconds (once per stall) while the run is
        not finished. Called by the watch thread through the actor's own queue, so it never races another call."""
        t = self.ledger.config.train
        idle = time.monotonic() - self._last_seen
        if self.ledger.state.finished or self._stall_reported or idle < t.stall_seconds:
            return
        resources = {"CPU": t.cpus_per_worker, **t.resources_per_worker}
        finding = stalled(
            idle, self.ledger.state.step, limit=t.stall_seconds, workers=t.num_workers, resources=resources
        )
        self.ledger.event(self.ledger.state.step, finding.event, **finding.fields())
        self._stall_reported = True

    def _watch(self, limit: float) -> None:
        """The heartbeat file, touched from this thread (so it beats while a call such as wait_for_evals blocks the
        actor), and the stall check, sent through the actor's queue."""
        me = ray.get_runtime_context().current_actor
        every = min(max(limit / 10, 0.2), HEARTBEAT_EVERY_S) if limit else HEARTBEAT_EVERY_S
        while True:
            touch_heartbeat(self.ledger.run_dir)
            if limit:
                me.check_stall.remote()
            time.sleep(every)

    # --- internals ---

    def _pump(self) -> None:
        """Launch queued evaluations while there are free evaluator slots (the cluster is asked only when some wait:
        this runs on every call of the train loop)."""
        if not self._training_started or not self._queue:
            return
        t, wanted = self.ledger.config.train, self.ledger.config.eval.cpus
        training_cpus, cluster_cpus = t.num_workers * t.cpus_per_worker, ray.cluster_resources().get("CPU", 0.0)
        cpus, slots = evaluator_slots(wanted, training_cpus=training_cpus, cluster_cpus=cluster_cpus)
        if cpus < wanted and not self._shared_cpus_noted:
            self._shared_cpus_noted = True
            self.ledger.event(
                self.ledger.state.step, "eval_cpus_shared", eval_cpus=wanted, cluster_cpus=cluster_cpus,
                training_cpus=training_cpus,
                message="the cluster has no CPU beyond the training workers' own: evaluators run one at a time on 0 "
                "CPUs, beside training",
            )  # fmt: skip
        while self._queue and len(self._running) < slots:
            self._launch(self._queue.pop(0), cpus)

    def _launch(self, entry: EvalEntry, cpus: float) -> None:
        entry.launches += 1
        try:
            evaluator = IntrinsicEvaluator.options(
                name=evaluator_name(self.run_name, entry.step, entry.launches),
                namespace=RAY_NAMESPACE,
                max_restarts=0,
                **{"num_cpus": cpus, **self.evaluator_options},
            ).remote(self.heldout_path, options_dict(self.intrinsic), None, self.downstream)
            self._running[entry.step] = (evaluator.evaluate.remote(entry.path, entry.step), evaluator)
        except (RayError, ValueError) as err:  # e.g. a name still held by a dead evaluator
            self.ledger.eval_failed(entry, f"could not launch an evaluator: {err}")

    def _collect(self) -> None:
        """Record every finished evaluation; relaunch evaluators that died, up to MAX_EVAL_RETRIES times."""
        self._pump()
        if not self._running:
            return
        refs = {ref: step for step, (ref, _) in self._running.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in ready:
            step = refs[ref]
            _, evaluator = self._running.pop(step)
            self._record(self.ledger.evaluation(step), ref)
            ray.kill(evaluator, no_restart=True)
        if ready:
            self.ledger.evals_finished()
            self._pump()

    def _record(self, entry: EvalEntry, ref: ray.ObjectRef) -> None:
        try:
            result = ray.get(ref, timeout=0)
        except RayTaskError as err:  # the evaluation raised: retrying would raise again
            self.ledger.eval_failed(entry, _error_summary(err))
        except (RayActorError, RayError, GetTimeoutError) as err:  # the evaluator died
            entry.deaths += 1
            if entry.deaths <= MAX_EVAL_RETRIES:
                self.ledger.event(entry.step, "eval_retried", deaths=entry.deaths, reason=_error_summary(err))
                self._queue.insert(0, entry)
            else:
                self.ledger.eval_failed(entry, f"evaluator died {entry.deaths} times: {_error_summary(err)}")
        else:
            self.ledger.eval_done(entry, result)


def get_or_create_coordinator(
    run_dir: str | Path,
    run_name: str,
    config_dict: dict[str, Any],
    *,
    lifetime: str | None = None,
    evaluator_options: dict[str, Any] | None = None,
):
    """The run's coordinator actor: the live one if it exists, else a new one (which resumes ledger.json) of a
    new session (a stop request of an earlier one is not its own).

    Checks on the driver what would make the actor fail later: the config, the held-out file evaluation reads
    (`<data.shards>/heldout/documents.parquet`) and the downstream tasks. `lifetime="detached"` outlives the driver.
    """
    config = RunConfig.from_dict(config_dict, source="run config")
    check_tasks(config.eval.tasks, config.eval.task_data)
    heldout = (Path(config.data.shards) / HELDOUT_FILE).resolve()
    if not heldout.is_file():
        raise FileNotFoundError(
            f"data.shards: {heldout} not found; evaluation reads held-out documents from <shards>/{HELDOUT_FILE}"
        )
    from services.train.plan import unigram_for

    unigram_for(Path(config.data.shards), config)  # stored beside the manifest, where evaluators find it
    return Coordinator.options(
        name=coordinator_name(run_name), namespace=RAY_NAMESPACE, get_if_exists=True, lifetime=lifetime
    ).remote(str(Path(run_dir).resolve()), run_name, config_dict, str(heldout), evaluator_options, uuid.uuid4().hex)


def _error_summary(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[-1] if text else type(err).__name__
