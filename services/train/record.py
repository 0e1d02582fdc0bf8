"""Where rank 0 keeps the run's record: the run's coordinator actor when it has one, else a ledger of its own.

Both answer the same calls, so the worker loop does not care which it has.
"""

from __future__ import annotations

import uuid
from typing import Any, Protocol

from albert_core.files import DiskFull
from services.rundir.ledger import RunLedger
from services.train.plan import WorkerPlan

Call = tuple[int, str, tuple[Any, ...], dict[str, Any]]  # (number, method, args, kwargs): Coordinator.deliver


class RunRecord(Protocol):
    def latest_good_checkpoint(self) -> str | None: ...

    def report(self, step: int, metrics: dict[str, Any]) -> None: ...

    def checkpoint_saved(self, step: int, path: str, metrics: dict[str, Any], *, final: bool) -> None: ...

    def event(self, step: int, event: str, **fields: Any) -> None:
        """Append a run event; it is in the metrics log when this returns."""
        ...

    def flush(self) -> None:
        """Return when every call so far is in the record (the worker group's last step)."""
        ...

    def stop_requested(self) -> str | None:
        """The signal that asked training to stop (the driver's first Ctrl-C, a SIGTERM), or None; called after every
        step, never blocks."""
        ...


class LedgerRecord:
    """A run without a coordinator: rank 0 holds the ledger (index, retention, metrics log); no evaluations."""

    def __init__(self, plan: WorkerPlan):
        self.ledger = RunLedger(plan.run_dir, plan.config.run.name, plan.config.to_dict())

    def latest_good_checkpoint(self) -> str | None:
        return self.ledger.latest_good_checkpoint()

    def report(self, step: int, metrics: dict[str, Any]) -> None:
        self.ledger.report(step, metrics)

    def checkpoint_saved(self, step: int, path: str, metrics: dict[str, Any], *, final: bool) -> None:
        self.ledger.checkpoint_saved(step, path, metrics, final=final)

    def event(self, step: int, event: str, **fields: Any) -> None:
        self.ledger.event(step, event, **fields)

    def flush(self) -> None:
        pass  # written as called

    def stop_requested(self) -> str | None:
        return None  # no driver-side coordinator to ask


class CoordinatorRecord:
    """The run's coordinator actor. Reports, checkpoint notices and events go to it in order, at most one call in
    flight, so that a step never waits for an answer (a checkpoint notice leaves at once; an event returns when it is
    in the log). Ray runs the call in flight again on a restarted coordinator (max_task_retries), possibly twice and
    out of order with calls sent after it: hence one call at a time, each entry numbered, and the coordinator applies
    each number once (Coordinator.deliver)."""

    def __init__(self, name: str):
        import ray

        from services import RAY_NAMESPACE

        self.actor = ray.get_actor(name, namespace=RAY_NAMESPACE)
        self.sender = uuid.uuid4().hex  # this process's numbering
        self._numbered = 0
        self._queue: list[Call] = []  # numbered, not sent yet
        self._in_flight = None  # the deliver call on its way, if any
        self._stop_poll = None  # the answer of the last stop_requested call, while it is on its way
        self._stopped: str | None = None

    def latest_good_checkpoint(self) -> str | None:
        import ray

        self.flush()  # the checkpoint notices sent so far count
        return ray.get(self.actor.latest_good_checkpoint.remote())

    def report(self, step: int, metrics: dict[str, Any]) -> None:
        self._add("report", step, metrics)
        self._pump(wait=False)

    def checkpoint_saved(self, step: int, path: str, metrics: dict[str, Any], *, final: bool) -> None:
        self._add("checkpoint_saved", step, path, metrics, final=final)
        self._pump(wait=True)  # leaves now, behind the call in flight

    def event(self, step: int, event: str, **fields: Any) -> None:
        self._add("event", step, event, fields)
        self.flush()

    def flush(self) -> None:
        """Return when every call so far is applied (raises if the coordinator is gone for good)."""
        while self._queue or self._in_flight is not None:
            self._pump(wait=True)

    def _add(self, name: str, *args: Any, **kwargs: Any) -> None:
        self._numbered += 1
        self._queue.append((self._numbered, name, args, kwargs))

    def _pump(self, wait: bool) -> None:
        """Collect the answer of the call in flight (waiting for it if `wait`), then send what is queued."""
        import ray

        if self._in_flight is not None:
            ready, _ = ray.wait([self._in_flight], timeout=None if wait else 0)
            if not ready:
                return
            try:
                ray.get(self._in_flight)
            except ray.exceptions.RayTaskError as err:  # a full disk fails the worker group with its own line
                raise err.cause if isinstance(err.cause, DiskFull) else err from None
            self._in_flight = None
        if self._queue:
            self._in_flight, self._queue = self.actor.deliver.remote(self.sender, self._queue), []

    def stop_requested(self) -> str | None:
        """One call in flight at a time; a step reads its answer only when it has arrived."""
        import ray

        if self._stopped:
            return self._stopped
        if self._stop_poll is not None:
            ready, _ = ray.wait([self._stop_poll], timeout=0)
            if not ready:
                return None
            self._stopped = ray.get(self._stop_poll) or None
        self._stop_poll = None if self._stopped else self.actor.stop_requested.remote()
        return self._stopped


def open_record(plan: WorkerPlan) -> RunRecord:
    return CoordinatorRecord(plan.coordinator) if plan.coordinator else LedgerRecord(plan)
