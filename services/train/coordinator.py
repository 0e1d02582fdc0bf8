"""The run coordinator: one named Ray actor per run, the run's record while it trains.

It keeps the run's ledger (services.rundir.ledger: the metrics log, the checkpoint index and retention, events,
dropout changes, ledger.json), the driver's stop requests (a restarted coordinator of the same session still
hands them to training) and the heartbeat with the stall check. A restarted coordinator (`max_restarts=-1`) reopens
the ledger and carries on.

Evaluation is not its own: the run's recipe [eval] is the run's evaluation schedule "recipe", which the coordinator
adopts when it starts and runs with the one orchestrator, services.eval.schedule.Scheduler, in a thread beside its
calls (the design: that module's docstring). A checkpoint saved wakes the scheduler, which observes it at once;
the scheduler's gate opens when training reports, so that the evaluations a previous coordinator left pending never
take the CPUs of a resumed run's workers first; `wait_for_evals` waits for it at the run's end.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from albert_core.examples.shards import HELDOUT_FILE
from albert_core.files import DiskFull
from services import RAY_NAMESPACE
from services.cluster import coordinator_name
from services.eval.evaluate import check_tasks
from services.eval.schedule import ScheduleBusy, Scheduler
from services.rundir import evaluations, schedules
from services.rundir.config import RunConfig
from services.rundir.health import stalled
from services.rundir.ledger import RunLedger
from services.rundir.status import HEARTBEAT_EVERY_S, status_of, touch_heartbeat

if TYPE_CHECKING:
    from services.train.record import Call

DELIVERED = ("report", "checkpoint_saved", "event")  # what the train loop's record sends through deliver
EVAL_POLL_S = 2.0  # how often the run's scheduler looks at the run between checkpoints
log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Coordinator:
    def __init__(self, run_dir: str, run_name: str, config_dict: dict[str, Any], heldout_path: str, session: str = ""):
        """`session`: this run's start (get_or_create_coordinator draws one); Ray restarts the actor with the same
        arguments, so a restarted coordinator reads back the stop its session's driver asked for."""
        self.ledger = RunLedger(run_dir, run_name, config_dict)
        self.session = session
        config = self.ledger.config
        schedules.adopt(self.ledger.run_dir, evaluations.recipe_spec(config, heldout_path))
        self.training = threading.Event()  # set when training reports: the scheduler may launch evaluators then
        self.scheduler = Scheduler(self.ledger.run_dir, schedules.RECIPE, poll_s=EVAL_POLL_S, gate=self.training)
        threading.Thread(target=self._evaluate, name="albert-recipe-schedule", daemon=True).start()
        self._stop_requested = self.ledger.stop_requested(session)
        self._last_seen, self._stall_reported = time.monotonic(), False
        threading.Thread(target=self._watch, args=(config.train.stall_seconds,), daemon=True).start()

    # --- the train loop's calls ---

    def deliver(self, sender: str, calls: list[Call]) -> None:
        """The train loop's calls (services.train.record.CoordinatorRecord), in order, each number applied once: Ray
        runs this call again on a restarted coordinator, possibly after it had already run here."""
        for number, name, args, kwargs in calls:
            if name not in DELIVERED:
                raise ValueError(f"deliver: {name!r} is not one of {DELIVERED}")
            if self.ledger.first_delivery(sender, number):
                getattr(self, name)(*args, **kwargs)  # report and checkpoint_saved save the ledger, numbers included
                if name == "event":
                    self.ledger.save()  # an event's number: it is not appended twice

    def report(self, step: int, metrics: dict[str, Any]) -> None:
        """Append a train line; note resumes and dropout changes. Idempotent for a retried call."""
        self.training.set()
        self._last_seen, self._stall_reported = time.monotonic(), False
        self.ledger.report(step, metrics)

    def checkpoint_saved(
        self, step: int, path: str, metrics: dict[str, Any] | None = None, *, final: bool = False
    ) -> dict[str, Any]:
        """Verify, index and apply retention (the ledger), then have the run's schedule observe the checkpoint.

        Returns {"accepted", "reason" (when refused), "eval_scheduled", "deleted": [paths]}. The run's last
        checkpoint (step >= optim.total_steps, or `final=True` for a run whose budget ended it) is evaluated even off
        the every_steps schedule.
        """
        self.training.set()
        result = self.ledger.checkpoint_saved(step, path, metrics, final=final).to_dict()
        scheduled = False
        if result["accepted"]:
            state, _ = self.scheduler.observe()  # now: status and retention see the step due
            scheduled = state.covers(step)
            self.scheduler.wake.set()
        return {**result, "eval_scheduled": scheduled}

    def latest_good_checkpoint(self) -> str | None:
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

    # --- the run's evaluations ---

    def wait_for_evals(self, timeout: float | None = None) -> dict[str, int]:
        """Block until none of the run's own evaluations is pending (or `timeout` seconds pass); returns how many are
        pending, done, failed and missing. Retention then frees the checkpoints only an evaluation held."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.training.set()  # training is over: nothing left to wait for
        self.scheduler.wake.set()
        while True:
            state, _ = self.scheduler.observe()
            remaining = None if deadline is None else deadline - time.monotonic()
            if not state.pending or state.cancelled or (remaining is not None and remaining <= 0):
                break
            time.sleep(0.2 if remaining is None else min(0.2, remaining))
        self.ledger.apply_retention()
        self.ledger.save()
        return evaluations.counts(state)

    def _evaluate(self) -> None:
        """The run's schedule, for as long as the actor lives: its loop ends when the schedule is complete (the
        run's last checkpoint evaluated) and starts again at the next checkpoint saved (a resumed run trains on)."""
        forever = threading.Event()
        while True:
            try:
                self.scheduler.run(forever)
            except ScheduleBusy:  # the process of this actor's previous incarnation is still going
                time.sleep(EVAL_POLL_S)
                continue
            except DiskFull as err:  # one line; training meets the full disk too, at its next save at the latest
                log.error(
                    "the evaluations of %s stopped: %s; they go on at its next checkpoint", self.ledger.run_dir, err
                )
            except Exception:
                log.exception("the evaluations of %s failed; they go on at its next checkpoint", self.ledger.run_dir)
            self.scheduler.wake.wait()
            self.scheduler.wake.clear()

    # --- reading and health ---

    def status(self) -> dict[str, Any]:
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


def get_or_create_coordinator(run_dir: str | Path, run_name: str, config_dict: dict[str, Any]):
    """The run's coordinator actor: the live one if it exists, else a new one (which resumes ledger.json) of a
    new session (a stop request of an earlier one is not its own).

    Checks on the driver what would make the actor fail later: the config, the held-out file evaluation reads
    (`<data.shards>/heldout/documents.parquet`) and the downstream tasks.
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
    return Coordinator.options(name=coordinator_name(run_name), namespace=RAY_NAMESPACE, get_if_exists=True).remote(
        str(Path(run_dir).resolve()), run_name, config_dict, str(heldout), uuid.uuid4().hex
    )
