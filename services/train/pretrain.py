"""`albert pretrain` as a job: Ray (embedded or a cluster) → the run's coordinator actor → Ray Train workers, with
a live progress bar and TensorBoard events, then scheduled evaluations are awaited and the report is written."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import ray

from albert_core.files import atomic_write_bytes
from services.cluster import connect, coordinator_name
from services.rundir.config import RunConfig
from services.rundir.report import LiveView, write_report
from services.rundir.resume import describe_changes
from services.train.coordinator import get_or_create_coordinator
from services.train.driver import TrainResult, launch, prepare_run

log = logging.getLogger(__name__)


def pretrain(
    config: RunConfig,
    *,
    address: str | None = None,
    resume: bool = True,
    progress: bool = True,
    allow_config_change: Sequence[str] = (),
) -> TrainResult:
    """One pretraining run to optim.total_steps (resuming from its newest good checkpoint), then its report.

    Everything services.train.driver.prepare_run checks is checked before Ray starts: a resume under a recipe that
    changes fields other than those safe to change (services.rundir.resume) is refused unless `allow_config_change`
    names them; the changes it makes are printed."""
    prepared = prepare_run(
        config, resume=resume, allow_config_change=allow_config_change, coordinator=coordinator_name(config.run.name)
    )
    if prepared.finished is not None:  # nothing to train: Ray is not started
        print(prepared.finished_line())
        return prepared.finished
    for line in describe_changes(prepared.changes):
        print(f"albert: resuming {config.run.name} with a changed config: {line}", file=sys.stderr)
    if prepared.plan.disk_warning:
        print(f"albert: warning: {prepared.plan.disk_warning}", file=sys.stderr)
    connect(address, worker_logs=False)  # every check above ran before Ray started; a SIGTERM stops gracefully
    run_dir = config.run_dir.resolve()
    keep_tokenizer_with_run(prepared.plan.tokenizer_files, Path(config.data.shards), run_dir)
    coordinator = get_or_create_coordinator(run_dir, config.run.name, config.to_dict())
    with LiveView(run_dir, config.optim.total_steps, progress=progress):
        result = launch(prepared.plan)
        if result.interrupted:  # Ctrl-C: its evaluations stay pending, the resumed run's coordinator runs them
            return result
        counts = ray.get(coordinator.wait_for_evals.remote(timeout=1800))
    log.info("evaluations: %s", counts)
    report = write_report(run_dir, title=f"albert pretraining run {config.run.name}")
    print(f"report: {report}")
    return result


def keep_tokenizer_with_run(files: Sequence[str], shards: Path, run_dir: Path) -> None:
    """Copy the tokenizer the shards were made with (its `files`, the plan's) into the run directory (each of its
    checkpoints carries a copy too), so the run directory says what its checkpoints speak."""
    import shutil

    if not files:
        log.warning("%s: names no readable tokenizer; fine-tuning will need --tokenizer", shards)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    for path in map(Path, files):
        atomic_write_bytes(run_dir / path.name, path.read_bytes())  # a few MB at most; whole or the previous copy
        shutil.copystat(path, run_dir / path.name)
