"""Step callbacks: code that every Ray Train worker of a pretraining run calls around each of its steps, for a tool
or a test that watches the run or disturbs it from outside. albert installs none itself; the tests' example tracing
and crash injection (tests/worker_callbacks.py) are callbacks.

A callback is a `StepCallback` (its methods do nothing unless overridden). The driver's process installs callbacks
(`installed`, around the call that starts training); the run plan made meanwhile carries them to the workers
(WorkerPlan.callbacks), pickled: a callback's class must be importable on the workers, and each worker process
calls its own copy. `before_step` runs as a step starts, before anything of it is computed; `after_step` runs after
the step's log line, checkpoint and report, so an exception raised there fails the run with that step saved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any


class StepCallback:
    def before_step(self, *, step: int, epoch: int, rank: int, rows: Sequence[dict[str, Any]]) -> None:
        """Step `step` (of epoch `epoch`) starts on worker `rank`; `rows` are its rows, each a batch of examples
        with their "example_id"s."""

    def after_step(self, *, step: int, rank: int, started_at: int) -> None:
        """Step `step` is done on worker `rank`, whose process started the run at step `started_at` (its checkpoint's
        step; 0 for a new run)."""


_installed: list[StepCallback] = []


@contextlib.contextmanager
def installed(*callbacks: StepCallback) -> Iterator[None]:
    """Within the block, every run plan this process makes carries `callbacks` (after those installed already)."""
    _installed.extend(callbacks)
    try:
        yield
    finally:
        del _installed[len(_installed) - len(callbacks) :]


def installed_callbacks() -> tuple[StepCallback, ...]:
    """The callbacks installed in this process now, in order (what a new run plan carries)."""
    return tuple(_installed)
