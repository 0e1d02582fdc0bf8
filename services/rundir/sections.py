"""The sections of a run recipe (one dataclass each: [run], [model], [data], [optim], [train], [eval], [finetune])
with their fields' defaults and meaning, and the checks of each section's own fields. services.rundir.config puts
them together into a RunConfig, loads recipes and checks what spans sections."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from albert_core.examples.shape import shape_field
from albert_core.model.config import ConfigError


@dataclass
class RunSection:
    name: str = "albert-tiny"
    output_dir: str = "runs"  # the run lives in output_dir/name
    seed: int = 12345


CHECKPOINT_PRESET = "checkpoint"  # model.preset of a run whose model is model.init_from's (services.rundir.init_from)


@dataclass
class ModelSection:
    # A preset of albert_core.model.config.PRESETS, or "checkpoint": the model of model.init_from, whose config
    # `albert pretrain --init-from DIR` writes into overrides whole (services.rundir.init_from).
    preset: str = "albert-base"
    # Any AlbertConfig field overrides the preset (vocab_size is taken from the tokenizer when 0).
    overrides: dict[str, Any] = field(default_factory=dict)
    # A model directory to start a new run from instead of random weights. With preset "checkpoint" (--init-from)
    # the model is the checkpoint's and every tensor it has is loaded (continued pretraining); with a preset of the
    # recipe's, its layers are stacked onto that model's depth (progressive stacking, albert_core.model.stacking).
    # Unused when the run resumes its own checkpoint.
    init_from: str = ""
    # The MLM decoder's bias at the start of a new run: "zeros" (the paper's) or "unigram" (the shard set's piece
    # log frequencies, evaluation.unigram): the model starts on the unigram floor instead of learning its way there.
    mlm_bias_init: str = "zeros"


@dataclass
class DataSection:
    shards: str = ""  # a preprocess output directory (train/ shards, heldout/, manifest.json)
    # The example shape a run trains on (albert_core.examples.shape; the pair task is the shard set's): tokens per
    # example (rows preprocessed longer are refused), and how MLM masks them.
    max_seq_length: int = shape_field("max_seq_length")
    mask_prob: float = shape_field("mask_prob")
    max_ngram: int = shape_field("max_ngram")
    # Pad every batch to max_seq_length (static shapes for XLA) instead of the longest row rounded up to 8.
    static_shapes: bool = False
    # With model.init_from: read on from where that checkpoint's run stopped (its epoch and data position; same
    # shards, workers and micro-batch size), so a stacked stage trains on new examples, not the first ones again.
    continue_from_init: bool = False
    # Follow the shard set as it grows (`albert preprocess --append-to`): each epoch trains on the newest version
    # there is when it starts. false: the run keeps the version it started with. Either way every checkpoint
    # records the version and mixture of each epoch trained, so a resume replays the same data; turned on (or off)
    # at a resume, it applies from the next epoch boundary.
    follow: bool = False
    # Relative sampling ratio of each part of the shard set, by part name ("*": every part not named; a part with
    # no weight is not trained on). Empty: every example once per epoch. Seeded by (run.seed, epoch, part); changed
    # at a resume, it applies from the next epoch boundary.
    mixture: dict[str, float] = field(default_factory=dict)
    # SOP's segment order. "stored": as the shards hold it (drawn once at preprocess, so a run of many epochs can
    # memorize which pairs are swapped). "epoch": drawn anew for every example in every epoch, seeded by (run.seed,
    # epoch, example id) like the masks; needs an SOP shard set.
    sop_order: str = "stored"  # stored | epoch


@dataclass
class OptimSection:
    name: str = "lamb"  # lamb | adamw
    lr: float = 0.00176
    warmup_steps: int = 3125
    total_steps: int = 125_000
    # 0: linear decay from the end of warmup to 0 at total_steps (the paper's). N > 0: hold the peak rate and decay
    # over the last N steps only (warmup-stable-decay), which trains faster on short budgets.
    decay_steps: int = 0
    # What the schedule counts. "steps": optimizer updates. "time": the share of train.max_seconds spent, scaled to
    # total_steps (cramming's budget schedules): warmup_steps and decay_steps become shares of the wall-clock budget,
    # so every model of a same-budget comparison (Table 6) warms up and decays fully whatever its step time.
    # total_steps still caps the number of updates.
    clock: str = "steps"  # steps | time
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    bias_correction: bool = False
    trust_clip: list[float] | None = None  # [lo, hi] or none
    grad_clip: float = 1.0


@dataclass
class TrainSection:
    global_batch_size: int = 4096  # = micro_batch_size x accumulation x workers
    micro_batch_size: int = 32
    num_workers: int = 1
    # 0: a fixed group of num_workers (a restart waits for all of them). 1..num_workers: an elastic group of
    # min_workers to num_workers (Ray Train's ScalingConfig(num_workers=(min, max))): a run that loses a node
    # restarts from its last checkpoint on the workers that remain (docs/operations.md, "Failures": Ray 2.60). The
    # global batch is split among however many there are, so it must be a multiple of micro_batch_size x w for
    # every w in range. Exact in data; in losses too only without dropout (its masks are drawn per rank).
    min_workers: int = 0
    backend: str = "cpu"  # cpu (gloo) | cuda (nccl) | xla
    precision: str = "fp32"  # fp32 | bf16 (autocast)
    # torch.compile the backbone (backends cpu/cuda): fuses GELU, LayerNorm, dropout and residual adds. The first
    # steps pay the compile. Meant for GPUs: on a 2-core CPU bench/bench_train.py measured it slower than eager.
    compile: bool = False
    cpus_per_worker: int = 1
    # Where a worker reads and masks its input, steps ahead of the loop (services/train/input.py): 0 in a thread of
    # the training process, N >= 1 in N input processes of its own (each takes every N-th step), off the loop's GIL.
    input_workers: int = 0
    # Further Ray resources each worker holds besides its CPUs, e.g. {TPU = 1} or {GPU = 1} (CPUs: cpus_per_worker).
    # With backend "xla" they also choose the PJRT runtime: TPU -> TPU, GPU -> CUDA, neither -> PJRT_DEVICE=CPU
    # must be set in the driver's environment (services/train.py, `pjrt_device_for`).
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    # A metrics.jsonl line (the live view's progress line, TensorBoard, `albert status`) every log_every steps. Rank 0
    # hands it to the run's coordinator without waiting: no step waits on it (bench/bench_reports.py, issue 38).
    log_every: int = 10
    checkpoint_every: int = 1000
    keep_last: int = 3
    # The paper removes dropout late (~1M steps); 0 keeps the configured dropout for the whole run.
    dropout_removal_step: int = 0
    # A wall-clock budget (Table 6: the same training time for every model): the run ends at the first step that
    # brings its training time (summed over resumes) to max_seconds, and saves that step as its final checkpoint.
    # The learning-rate schedule runs over optim.total_steps, or over the budget with optim.clock = "time". 0: no
    # budget, the run ends at total_steps.
    max_seconds: float = 0.0
    max_failures: int = 3
    # Training health (services/rundir/health.py). A logged step whose loss or gradient norm is not finite, or whose
    # loss is above divergence_factor x the median of the last logged losses (0: no spike check), has diverged.
    # on_divergence "stop" ends the run there with a divergence event; "rollback" reloads the last good checkpoint
    # and continues with the learning rate scaled by rollback_lr_scale (kept in checkpoints, so a resume honours
    # it), at most max_rollbacks times.
    on_divergence: str = "stop"  # stop | rollback
    divergence_factor: float = 2.0
    rollback_lr_scale: float = 0.5
    max_rollbacks: int = 3
    # The coordinator reports a `stalled` event when no step has been reported for this long (0: never).
    stall_seconds: float = 900.0
    # How long the driver waits for Ray to place all num_workers workers (each start and restart) before it fails
    # with a message naming the resources missing. Raise it on clusters that autoscale new nodes.
    startup_timeout_s: float = 180.0
    # A SIGTERM (to the driver: `albert jobs stop`, Kubernetes deleting the pod; or to a worker process) asks every
    # worker to save a checkpoint at its next step and stop. The driver waits this long for it, then stops without
    # one (SIGKILL follows SIGTERM: Kubernetes' terminationGracePeriodSeconds, 30 s by default; keep this below it).
    stop_grace_s: float = 25.0
    # Every this many steps all workers ask Ray Train whether a node of theirs is being drained or preempted
    # (ray.train.get_preemption_info, a barrier across workers); on a notice each saves a checkpoint at that step and
    # trains on. 0: never ask (a preempted node then loses the steps since the last checkpoint).
    preemption_check_every: int = 10
    # Restarts after a preempted node that Ray Train makes on top of max_failures (-1: no limit).
    max_preemption_failures: int = -1

    @property
    def accumulation(self) -> int:
        """Micro-batches per step at num_workers workers (an elastic group at w workers: global / (micro x w))."""
        return self.global_batch_size // (self.micro_batch_size * self.num_workers)

    @property
    def worker_counts(self) -> range:
        """The worker counts a run may train at: num_workers, or min_workers..num_workers when elastic."""
        return range(self.min_workers or self.num_workers, self.num_workers + 1)


@dataclass
class EvalSection:
    every_steps: int = 0  # 0: only at the end
    heldout_batches: int = 20
    batch_size: int = 32
    tasks: list[str] = field(default_factory=list)  # downstream tasks, e.g. ["sst2"]
    task_data: dict[str, str] = field(default_factory=dict)  # task -> data directory
    task_seeds: int = 0  # fine-tuning runs per task (0: the protocol's, 5 for GLUE); their median is logged
    task_max_steps: int = 0  # cap fine-tuning steps (0: the recipe's finetune.max_steps, else the task's)
    # A `plateau` event when held-out MLM accuracy is within plateau_margin of the unigram baseline on the same
    # positions for plateau_evals consecutive evaluations after warmup (0: never).
    plateau_margin: float = 0.01
    plateau_evals: int = 2
    # CPUs each evaluator actor holds. 1 keeps evaluations off the training workers' cores: on a machine whose CPUs
    # the workers hold, they wait for the end of training. 0 runs them beside training (sharing its cores, one
    # thread each), so held-out numbers and plateau events arrive while the run trains.
    cpus: float = 1.0
    # An evaluation schedule (`albert eval schedule`) keeps the checkpoints it has still to evaluate from retention
    # only while its scheduler renews its lease (every few seconds while it runs); one not renewed for this long
    # (the scheduler was stopped, its cluster went) releases them, with a schedule_lease_expired event.
    schedule_lease_s: float = 600.0


@dataclass
class FinetuneSection:
    """Fine-tuning defaults that suit this recipe's checkpoints (a small model wants a higher rate than the paper's
    albert-base recipes): `albert finetune`, `albert eval run` and evaluation schedules (the run's eval.tasks, `albert
    eval schedule --task`) use them for a checkpoint of a run of this recipe, unless given there (--lr, --max-steps,
    --pooling; --task-max-steps, eval.task_max_steps). 0 / "": the task's own recipe (the paper's)."""

    lr: float = 0.0  # the peak learning rate
    max_steps: int = 0  # train steps (warmup scaled alike)
    pooling: str = ""  # what the task head reads: cls | mean ("": the model's)


def check_train(t: TrainSection) -> None:
    if isinstance(t.min_workers, bool) or not 0 <= t.min_workers <= t.num_workers:
        raise ConfigError(
            f"train.min_workers: expected 0 (a fixed group of num_workers) or 1 to num_workers = {t.num_workers}, "
            f"got {t.min_workers!r}"
        )
    if t.global_batch_size % (t.micro_batch_size * t.num_workers):
        raise ConfigError(
            f"train.global_batch_size: {t.global_batch_size} is not a multiple of micro_batch_size x num_workers "
            f"({t.micro_batch_size} x {t.num_workers})"
        )
    split = next((w for w in t.worker_counts if t.global_batch_size % (t.micro_batch_size * w)), None)
    if split is not None:
        raise ConfigError(
            f"train.global_batch_size: {t.global_batch_size} is not a multiple of micro_batch_size x {split} workers "
            f"({t.micro_batch_size} x {split}), and train.min_workers = {t.min_workers} lets the run train at "
            f"{split}; choose a global batch that every count from {t.worker_counts.start} to {t.num_workers} splits"
        )
    if t.backend not in ("cpu", "cuda", "xla"):
        raise ConfigError(f"train.backend: expected cpu, cuda or xla, got {t.backend!r}")
    for resource, amount in t.resources_per_worker.items():
        if resource == "CPU":
            raise ConfigError("train.resources_per_worker: CPU is set by train.cpus_per_worker, not here")
        if not resource or isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
            raise ConfigError(
                f"train.resources_per_worker: expected a resource name and a positive amount, got {resource!r} = "
                f"{amount!r}"
            )
    if t.compile and t.backend == "xla":
        raise ConfigError("train.compile: backend 'xla' already compiles each step into an XLA graph; set it false")
    if t.precision not in ("fp32", "bf16"):
        raise ConfigError(f"train.precision: expected fp32 or bf16, got {t.precision!r}")
    if not 0 <= t.max_seconds < math.inf:
        raise ConfigError(f"train.max_seconds: expected seconds >= 0 (0: no budget), got {t.max_seconds}")
    if t.on_divergence not in ("stop", "rollback"):
        raise ConfigError(f"train.on_divergence: expected stop or rollback, got {t.on_divergence!r}")
    if not 0 < t.rollback_lr_scale < 1:
        raise ConfigError(f"train.rollback_lr_scale: expected a factor in (0, 1), got {t.rollback_lr_scale}")
    for name in ("divergence_factor", "stall_seconds", "max_rollbacks"):
        if not 0 <= getattr(t, name) < math.inf:
            raise ConfigError(f"train.{name}: expected a number >= 0 (0: off), got {getattr(t, name)}")
    if isinstance(t.input_workers, bool) or not isinstance(t.input_workers, int) or t.input_workers < 0:
        raise ConfigError(
            f"train.input_workers: expected 0 (a thread) or a number of processes, got {t.input_workers!r}"
        )
    if t.dropout_removal_step < 0:
        raise ConfigError(f"train.dropout_removal_step: expected >= 0, got {t.dropout_removal_step}")
    if not 0 < t.startup_timeout_s < math.inf:
        raise ConfigError(f"train.startup_timeout_s: expected seconds > 0, got {t.startup_timeout_s}")
    if not 0 < t.stop_grace_s < math.inf:
        raise ConfigError(f"train.stop_grace_s: expected seconds > 0, got {t.stop_grace_s}")
    if t.preemption_check_every < 0:
        raise ConfigError(
            f"train.preemption_check_every: expected steps >= 0 (0: never), got {t.preemption_check_every}"
        )
    if t.max_preemption_failures < -1:
        raise ConfigError(
            f"train.max_preemption_failures: expected -1 (no limit) or >= 0, got {t.max_preemption_failures}"
        )


def check_optim(o: OptimSection) -> None:
    if o.name not in ("lamb", "adamw"):
        raise ConfigError(f"optim.name: expected lamb or adamw, got {o.name!r}")
    if o.clock not in ("steps", "time"):
        raise ConfigError(f"optim.clock: expected steps or time, got {o.clock!r}")
    for positive in ("lr", "eps"):
        if not 0 < getattr(o, positive) < math.inf:
            raise ConfigError(f"optim.{positive}: expected a finite number > 0, got {getattr(o, positive)}")
    for beta in ("beta1", "beta2"):
        if not 0 <= getattr(o, beta) < 1:
            raise ConfigError(f"optim.{beta}: expected a number in [0, 1), got {getattr(o, beta)}")
    if not 0 <= o.weight_decay < math.inf:
        raise ConfigError(f"optim.weight_decay: expected a finite number >= 0, got {o.weight_decay}")
    if math.isnan(o.grad_clip):
        raise ConfigError("optim.grad_clip: expected a number (<= 0: no clipping), got nan")
    if not 0 <= o.warmup_steps < o.total_steps:
        raise ConfigError(
            f"optim.warmup_steps: expected 0..total_steps - 1 ({o.total_steps - 1}), got {o.warmup_steps}"
        )
    if not 0 <= o.decay_steps <= o.total_steps - o.warmup_steps:
        raise ConfigError(
            f"optim.decay_steps: expected 0..total_steps - warmup_steps ({o.total_steps - o.warmup_steps}), "
            f"got {o.decay_steps}"
        )
    if o.trust_clip is not None:
        clip = o.trust_clip
        numbers = isinstance(clip, list) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in clip)
        if not numbers or len(clip) != 2 or not 0 <= clip[0] <= clip[1]:
            raise ConfigError(f"optim.trust_clip: expected [lo, hi] with 0 <= lo <= hi, got {clip!r}")
        if o.name != "lamb":
            raise ConfigError(f"optim.trust_clip: a LAMB option, but optim.name is {o.name!r}")


def check_eval(e: EvalSection) -> None:
    if not e.cpus >= 0:  # NaN too
        raise ConfigError(f"eval.cpus: expected >= 0 CPUs per evaluator, got {e.cpus}")
    if not 0 < e.schedule_lease_s < math.inf:
        raise ConfigError(f"eval.schedule_lease_s: expected seconds > 0, got {e.schedule_lease_s}")
    if not 0 <= e.plateau_margin < 1:
        raise ConfigError(f"eval.plateau_margin: expected an accuracy margin in [0, 1), got {e.plateau_margin}")
    for name in ("every_steps", "task_seeds", "task_max_steps", "plateau_evals"):
        if getattr(e, name) < 0:
            raise ConfigError(f"eval.{name}: expected >= 0, got {getattr(e, name)}")
    if not all(isinstance(task, str) for task in e.tasks):
        raise ConfigError(f"eval.tasks: expected a list of task names, got {e.tasks!r}")
    for task, directory in e.task_data.items():
        if not isinstance(directory, str):
            raise ConfigError(f"eval.task_data: expected a directory path for task {task!r}, got {directory!r}")
    missing = [task for task in e.tasks if task not in e.task_data]
    if missing:
        raise ConfigError(f"eval.task_data: no data directory for task {missing[0]!r}")


def check_finetune(f: FinetuneSection) -> None:
    if not 0 <= f.lr < math.inf:
        raise ConfigError(f"finetune.lr: expected a learning rate > 0 (0: the task's), got {f.lr}")
    if f.max_steps < 0:
        raise ConfigError(f"finetune.max_steps: expected >= 0 (0: the task's), got {f.max_steps}")
    if f.pooling not in ("", "cls", "mean"):
        raise ConfigError(f'finetune.pooling: expected cls, mean or "" (the model\'s), got {f.pooling!r}')


SECTION_TYPES = {
    "run": RunSection,
    "model": ModelSection,
    "data": DataSection,
    "optim": OptimSection,
    "train": TrainSection,
    "eval": EvalSection,
    "finetune": FinetuneSection,
}
