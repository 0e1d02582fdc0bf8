"""A pretraining run in a test, by the path `albert pretrain` takes (services.train.driver): prepare_run, then
launch, on a Ray the test started (the `ray_local` fixture or its own cluster). What `albert pretrain` adds around it
(starting Ray, the run's coordinator, the live view, the report) is the test's to start where it needs it."""

from __future__ import annotations

from services.rundir.config import RunConfig
from services.train.driver import TrainResult, launch, prepare_run


def run_training(config: RunConfig, *, resume: bool = True, coordinator: str | None = None) -> TrainResult:
    """The run to optim.total_steps (resume: from its newest good checkpoint); a finished run's result as it is.
    `coordinator`: the name of the run's coordinator actor, which the test started (None: rank 0 keeps the ledger)."""
    prepared = prepare_run(config, resume=resume, coordinator=coordinator)
    return prepared.finished if prepared.finished is not None else launch(prepared.plan)
