"""Where rank 0 keeps the run's record: the run's coordinator actor when it has one, else a ledger of its own.

Both answer the same calls, so the worker loop does not care which it has.
"""

from __future__ import annotations

from typing import Any, Protocol

from services.rundir.ledger import RunLedger
from services.train.plan import WorkerPlan


class RunRecord(Protocol):
    def latest_good_checkpoint(self) -> str | None: ...

    def report(self, step: int, metrics: dict[str, Any]) -> None: ...

    def checkpoint_saved(self, step: int, path: str, metrics: dict[str, Any], *, final: bool) -> None: ...

    def event(self, step: int, event: str, **fields: Any) -> None:
        """Append a run event; it is in the metrics log when this returns."""
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

    def stop_requested(self) -> str | None:
        return None  # no driver-side coordinator to ask


class CoordinatorRecord:
    """The run's coordinator actor; reports and checkpoint notices are sent without waiting for an answer."""

    def __init__(self, name: str):
        import ray

        from services import RAY_NAMESPACE

        self.actor = ray.get_actor(name, namespace=RAY_NAMESPACE)
        self._stop_poll = None  # the answer of the last stop_requested call, while it is on its way
        self._stopped: str | None = None

    def latest_good_checkpoint(self) -> str | None:
        import ray

        return ray.get(self.actor.latest_good_checkpoint.remote())

    def report(self, step: int, metrics: dict[str, Any]) -> None:
        self.actor.report.remote(step, metrics)

    def checkpoint_saved(self, step: int, path: str, metrics: dict[str, Any], *, final: bool) -> None:
        self.actor.checkpoint_saved.remote(step, path, metrics, final=final)

    def event(self, step: int, event: str, **fields: Any) -> None:
        import ray

        ray.get(self.actor.event.remote(step, event, fields))

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
