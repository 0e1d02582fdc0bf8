"""The one path from a command to the workers. `prepare_run` takes a checked config (RunConfig.load / from_dict
checked it, once) through everything that can be decided before Ray starts: whether the run has already finished,
what a resume changes in its recipe (services.rundir.resume), and the plan every worker gets
(services.train.plan.make_plan). `launch(plan)` runs one TorchTrainer with `train.num_workers` copies of the worker
loop (services.train.worker) and reads back where the run ended. `albert pretrain` (services.train.pretrain), its
--dry-run (services.train.dry_run), experiments' cells and the tests all take this path."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from albert_core.files import DiskFull
from albert_core.model.config import ConfigError
from services.rundir.checkpoints import CHECKPOINTS_DIR, latest_good, read_trainer_json
from services.rundir.config import RunConfig
from services.rundir.log import METRICS_FILE, read_metrics
from services.rundir.resume import check_resume_changes
from services.train.data import DamagedShard, damage_left
from services.train.interrupt import run_interruptibly
from services.train.plan import WorkerPlan, make_plan
from services.train.worker import train_loop_per_worker

START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # Ray Train's wait for a worker group to be placed
ELASTIC_PLACEMENT_RETRIES = 3  # train.min_workers > 0: placements retried, each up to train.startup_timeout_s


@dataclass
class TrainResult:
    run_dir: Path
    step: int  # the last step of the newest good checkpoint
    checkpoint: Path | None
    metrics: dict[str, float]  # reported at that step
    metrics_file: Path
    finished: bool = False  # the run reached optim.total_steps or spent train.max_seconds
    stopped: str | None = None  # why the run ended early (a divergence under on_divergence = "stop", a Ctrl-C)
    interrupted: bool = False  # it ended early because it was asked to (the first Ctrl-C, a SIGTERM)
    signal: str | None = None  # the signal that asked it to (SIGINT, SIGTERM)


@dataclass(frozen=True)
class PreparedRun:
    """What prepare_run decided: the plan to launch, or, for a resume of a run that has already finished, its result
    (nothing to train: no plan is made)."""

    config: RunConfig
    plan: WorkerPlan | None
    finished: TrainResult | None = None
    changes: dict[str, list[Any]] = field(default_factory=dict)  # a resume's recipe changes (each safe or allowed)

    def finished_line(self) -> str:
        done = self.finished
        assert done is not None, "the run has not finished"
        return (
            f"run {self.config.run.name} already finished at step {done.step} ({done.checkpoint}); nothing to train. "
            "To train on, raise optim.total_steps; for a new run, choose another run.name"
        )


def prepare_run(
    config: RunConfig,
    *,
    resume: bool = True,
    allow_config_change: Sequence[str] = (),
    coordinator: str | None = None,
    dry_run: bool = False,
) -> PreparedRun:
    """Every check before Ray starts, then the plan; ConfigError naming the field or file otherwise.

    resume=True continues the run directory from its newest good checkpoint: a run that has finished is not planned
    again, and a recipe that changes fields other than those safe to change (services.rundir.resume) is refused
    unless `allow_config_change` names them. resume=False refuses a run directory that already holds checkpoints.
    `coordinator`: the run's coordinator actor the workers report to (None: rank 0 keeps the ledger itself).
    dry_run: the checks and the plan only, nothing written (`albert pretrain --dry-run`)."""
    done = result_of(config) if resume else None  # where a resume starts: the newest good checkpoint, verified once
    if done is not None and done.finished:
        return PreparedRun(config, None, finished=done)
    changes = check_resume_changes(config.run_dir, config, allow_config_change) if resume else {}
    newest = (done.checkpoint, done.step) if done is not None and done.checkpoint is not None else None
    plan = make_plan(config, resume=resume, coordinator=coordinator, dry_run=dry_run, newest=newest)
    return PreparedRun(config, plan, changes=changes)


def launch(plan: WorkerPlan, callbacks: list | None = None) -> TrainResult:
    """Train the plan to optim.total_steps (resuming from the newest good checkpoint), on a Ray already started;
    returns where the run ended."""
    fit(plan, callbacks)
    return result_of(plan.config)


def fit(plan: WorkerPlan, callbacks: list | None = None) -> None:
    """One TorchTrainer over the plan's workers (restarted by Ray up to train.max_failures times).

    The first Ctrl-C or SIGTERM asks the workers, through the run's coordinator, to checkpoint at their next step
    and end (after a SIGTERM, within train.stop_grace_s); a second one stops at once (services.train.interrupt).
    Workers Ray cannot place within train.startup_timeout_s fail the run with a message naming the resources missing,
    instead of a silent retry loop. Restarts after a preempted node count against train.max_preemption_failures."""
    from ray.train import ControllerError, FailureConfig, ScalingConfig, WorkerGroupError
    from ray.train import RunConfig as RayRunConfig  # Ray Train's run options, not the recipe's RunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    t = plan.config.train
    resources = {"CPU": t.cpus_per_worker, **t.resources_per_worker}
    use_gpu = t.backend == "cuda" or resources.get("GPU", 0) > 0
    tpu = {"use_tpu": True} if resources.get("TPU", 0) > 0 else {}  # Ray refuses a TPU resource without it
    try:
        scaling = ScalingConfig(
            num_workers=worker_group_size(t), use_gpu=use_gpu, resources_per_worker=resources, **tpu
        )
    except (TypeError, ValueError) as err:
        raise ConfigError(f"train.resources_per_worker: Ray does not accept {resources} per worker ({err})") from None
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"plan": plan},
        # xla: gloo carries the loop's control messages (resume choice) and, when each worker is one PJRT replica,
        # the host all-reduce of the gradients (services.train.xla.host_sum_gradients).
        torch_config=TorchConfig(backend="nccl" if t.backend == "cuda" else "gloo"),
        scaling_config=scaling,
        run_config=RayRunConfig(
            name=plan.config.run.name,
            storage_path=str(Path(plan.run_dir) / "ray"),
            # A worker group that cannot be placed in time fails the run (below); an elastic one first retries:
            # Ray 2.60 sizes it from a view of the nodes up to 20 s old, so its first try after a node loss can ask
            # for the lost node's workers too.
            failure_config=FailureConfig(
                max_failures=t.max_failures,
                max_preemption_failures=t.max_preemption_failures,  # a preempted node does not use up max_failures
                controller_failure_limit=ELASTIC_PLACEMENT_RETRIES if t.min_workers else 0,
            ),
            callbacks=callbacks,
        ),
    )
    os.environ[START_TIMEOUT_ENV] = str(t.startup_timeout_s)  # passed on to the trainer's controller actor
    stop = functools.partial(request_stop, plan.coordinator) if plan.coordinator else None
    try:
        run_interruptibly(trainer.fit, graceful_stop=stop, what=f"run {plan.config.run.name}", grace_s=t.stop_grace_s)
    except ControllerError as err:
        if "WorkerGroupStartupTimeoutError" not in type(err.controller_failure).__name__:
            raise
        raise ConfigError(workers_missing(t, resources, t.startup_timeout_s)) from None
    except WorkerGroupError as err:
        damage = next((e for e in err.worker_failures.values() if isinstance(e, DamagedShard)), None)
        full = next((e for e in err.worker_failures.values() if isinstance(e, DiskFull)), None)
        if full is not None:
            raise DiskFull(f"{full}; the run stopped: {resumes_from(plan)}", full.path) from None
        if damage is None:
            raise
        raise stopped_on_damage(plan, damage) from None
    if (damage := damage_left(plan.run_dir)) is not None:  # a restarted worker group ended at once on it
        raise stopped_on_damage(plan, damage)


def stopped_on_damage(plan: WorkerPlan, damage: DamagedShard) -> DamagedShard:
    """The damaged shard's line, with where the run stands (exit status 65 through the command's ValueError)."""
    return DamagedShard(f"{damage}; the run stopped, {resumes_from(plan)}", damage.path, damage.row_group)


def resumes_from(plan: WorkerPlan) -> str:
    """Where the run stands, for the line of a run stopped on a damaged shard or a full disk."""
    newest = latest_good(plan.checkpoints)
    return f"a resume starts from {newest}" if newest else "no checkpoint yet: a resume starts from step 0"


def worker_group_size(t) -> int | tuple[int, int]:
    """Ray Train's num_workers: train.num_workers, or (min_workers, num_workers), an elastic group, when
    train.min_workers is set: a restart after a lost node then starts on the workers the cluster still has."""
    return (t.min_workers, t.num_workers) if t.min_workers else t.num_workers


def request_stop(coordinator: str, signal_name: str = "SIGINT") -> None:
    import ray

    from services import RAY_NAMESPACE

    ray.get_actor(coordinator, namespace=RAY_NAMESPACE).request_stop.remote(signal_name, "the driver")


def workers_missing(t, resources: dict[str, float], timeout: float) -> str:
    """The startup failure, with what the workers need against what the cluster has."""
    import ray

    count = t.min_workers or t.num_workers  # an elastic group starts with as few as min_workers
    need = {k: v * count for k, v in resources.items()}
    total, free = ray.cluster_resources(), ray.available_resources()
    have = ", ".join(f"{k} {total.get(k, 0):g} ({free.get(k, 0):g} free)" for k in need)
    return (
        f"train.num_workers: Ray could not place {count} workers of {resources} (in all {need}) within "
        f"{timeout:g} s; the cluster has {have}. Free or add those resources, lower train.num_workers, or raise "
        "train.startup_timeout_s if the cluster is still scaling up"
    )


def result_of(config: RunConfig) -> TrainResult:
    run_dir = config.run_dir.resolve()
    final = latest_good(run_dir / CHECKPOINTS_DIR)
    step, metrics, seconds = 0, {}, 0.0
    if final is not None:
        state = read_trainer_json(final)["state"]
        step, metrics, seconds = state["step"], state["metrics"], state.get("train_seconds", 0.0)
    t = config.train
    finished = step >= config.optim.total_steps or bool(t.max_seconds and seconds >= t.max_seconds)
    stopped, signal_name = stop_reason(run_dir, after_step=step) if not finished else (None, None)
    return TrainResult(
        run_dir, step, final, metrics, run_dir / METRICS_FILE, finished, stopped, signal_name is not None, signal_name
    )


def stop_reason(run_dir: Path, *, after_step: int) -> tuple[str | None, str | None]:
    """Why a run stopped short, and the signal that asked it to (None when it stopped on its own): its latest
    divergence event that ended training past its last checkpoint, or the stop asked for at that checkpoint."""
    for record in reversed(read_metrics(run_dir)):
        if record.get("event") == "stopped" and record["step"] == after_step:
            return f"{record['reason']}; resume with the same command", record.get("signal", "SIGINT")
        if record.get("event") == "divergence" and str(record.get("action", "")).startswith("stopped"):
            if record["step"] > after_step:
                return f"{record['message']}; {record['action']}. Remedy: {record['remedy']}", None
    return None, None
