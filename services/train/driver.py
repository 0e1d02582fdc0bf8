"""The driver of a pretraining run: check everything that can be checked, plan, launch one TorchTrainer with
`train.num_workers` copies of the worker loop (services.train.worker), and read back where the run ended."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from albert_core.model.config import ConfigError
from services.rundir.checkpoints import CHECKPOINTS_DIR, latest_good, list_checkpoints, read_trainer_json
from services.rundir.config import RunConfig
from services.rundir.log import METRICS_FILE, read_metrics
from services.train.callbacks import installed_callbacks
from services.train.interrupt import run_interruptibly
from services.train.plan import (
    WorkerPlan,
    init_data_position,
    pjrt_device_for,
    plan_data,
    resolve_token_ids,
    unigram_for,
)
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


def run_pretraining(
    config: RunConfig,
    *,
    shards_dir: Path | None = None,
    resume: bool = True,
    coordinator_name: str | None = None,
    callbacks: list | None = None,
    plan: WorkerPlan | None = None,
) -> TrainResult:
    """Validate, plan the data, run the TorchTrainer to optim.total_steps; resumes from the newest good checkpoint.

    Everything that can be checked is checked before a worker starts: the config, the shards directory
    (`data.shards`), the vocabulary, model.init_from. resume=False refuses a run directory that already holds
    checkpoints rather than mixing two runs in it. `plan`: one make_plan made already (before Ray started).
    """
    if plan is None:
        plan = make_plan(config, shards_dir=shards_dir, resume=resume, coordinator_name=coordinator_name)
    fit(plan, callbacks)
    return result_of(config)


def make_plan(
    config: RunConfig, *, shards_dir: Path | None, resume: bool, coordinator_name: str | None, dry_run: bool = False
) -> WorkerPlan:
    """Every check before Ray, and the plan the workers get. dry_run: the checks and the plan only, nothing written
    (no run directory made, no unigram counts stored: `albert pretrain --dry-run`)."""
    config.validate()
    t = config.train
    pjrt_device = None
    if t.backend == "xla":
        if importlib.util.find_spec("torch_xla") is None:
            raise ConfigError(
                "train.backend: 'xla' needs torch_xla (torch-xla 2.9 with torch 2.9.0) on the driver and every worker; "
                "scripts/xla_venv.sh builds that virtualenv, the TPU cluster recipes install it on every node"
            )
        pjrt_device = pjrt_device_for(t)
    if shards_dir is None:
        if not config.data.shards:
            raise ConfigError("data.shards: empty; point it at a preprocess output directory")
        shards_dir = Path(config.data.shards)
    shards_dir = Path(shards_dir).resolve()
    shards = plan_data(shards_dir, config)
    ids = resolve_token_ids(shards_dir, config)
    if config.model.mlm_bias_init == "unigram" and not dry_run:
        unigram_for(shards_dir, config)  # counted once per shard set, then read by every worker
    run_dir = config.run_dir.resolve()
    init_from = Path(config.model.init_from).resolve() if config.model.init_from else None
    if init_from is not None:  # the workers read it by absolute path
        from albert_core.model.stacking import check_init_source

        check_init_source(init_from, config.model_config(ids.vocab_size))
    if not resume and list_checkpoints(run_dir / CHECKPOINTS_DIR):
        raise ConfigError(
            f"run.name: {run_dir} already holds checkpoints; resume it, or choose another run.name / run.output_dir"
        )
    if not resume and not dry_run:
        shutil.rmtree(run_dir / "ray" / config.run.name, ignore_errors=True)  # Ray would restore its old run state
    if not dry_run:
        run_dir.mkdir(parents=True, exist_ok=True)
    return WorkerPlan(
        run=config,
        run_dir=str(run_dir),
        token_ids=ids,
        shards=shards,
        coordinator=coordinator_name,
        pjrt_device=pjrt_device,
        init_from=str(init_from) if init_from else None,
        init_data_position=init_data_position(init_from) if config.data.continue_from_init else None,
        unigram_dir=str(shards_dir) if config.model.mlm_bias_init == "unigram" else None,
        callbacks=installed_callbacks(),
    )


def fit(plan: WorkerPlan, callbacks: list | None = None) -> None:
    """One TorchTrainer over the plan's workers (restarted by Ray up to train.max_failures times).

    The first Ctrl-C or SIGTERM asks the workers, through the run's coordinator, to checkpoint at their next step
    and end (after a SIGTERM, within train.stop_grace_s); a second one stops at once (services.train.interrupt).
    Workers Ray cannot place within train.startup_timeout_s fail the run with a message naming the resources missing,
    instead of a silent retry loop. Restarts after a preempted node count against train.max_preemption_failures."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    t = plan.run.train
    resources = {"CPU": t.cpus_per_worker, **t.resources_per_worker}
    use_gpu = t.backend == "cuda" or resources.get("GPU", 0) > 0
    tpu = {"use_tpu": True} if resources.get("TPU", 0) > 0 else {}  # Ray refuses a TPU resource without it
    try:
        scaling = ray.train.ScalingConfig(
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
        run_config=ray.train.RunConfig(
            name=plan.run.run.name,
            storage_path=str(Path(plan.run_dir) / "ray"),
            # A worker group that cannot be placed in time fails the run (below); an elastic one first retries:
            # Ray 2.60 sizes it from a view of the nodes up to 20 s old, so its first try after a node loss can ask
            # for the lost node's workers too.
            failure_config=ray.train.FailureConfig(
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
        run_interruptibly(trainer.fit, graceful_stop=stop, what=f"run {plan.run.run.name}", grace_s=t.stop_grace_s)
    except ray.train.ControllerError as err:
        if "WorkerGroupStartupTimeoutError" not in type(err.controller_failure).__name__:
            raise
        raise ConfigError(workers_missing(t, resources, t.startup_timeout_s)) from None


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
