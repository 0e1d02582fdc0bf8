"""The loop each Ray Train worker runs. It reads like its table of contents; the backend (services.train.backends)
is applied from outside, so the loop has no backend branches.

Exact resume. A run stopped at any point and resumed from its newest good checkpoint reproduces the uninterrupted
run's per-step losses bit for bit on CPU: the example order is a function of the seed and the shard set only
(albert_core.examples.order) and the checkpoint holds the data position; masks are seeded per (run seed, epoch,
example id) and dropout per (run seed, rank, step), so no RNG state has to survive a crash.

Reporting. Every `train.log_every` steps, every `train.checkpoint_every` steps and at the end, rank 0 hands the
step's metrics to the run's record (services.train.record: the coordinator, without waiting but in order and once
each, a restart of it included; or its own ledger), which writes metrics.jsonl; the driver's live view (progress
line, TensorBoard) and `albert status` read that. On checkpoint steps rank 0 first writes a training checkpoint to
`<run_dir>/checkpoints/step_XXXXXXXX` (services.train.state), the one copy on disk, and tells the record. Ray Train
hears of the run once, at the last step of the worker group (the end, the budget, a stop): all workers call
`ray.train.report` with its metrics, a barrier that waits for rank 0's final checkpoint (rank 0 first waits until
its record holds every line). No step waits on Ray: its worker holds one unread result at a time and its controller
reads them every 2 s, so a report per log step stalled training up to 2 s each (bench/bench_reports.py).

Budget. `train.max_seconds` > 0 ends the run at the first step that brings its training time (summed over resumes)
to the budget: rank 0's clock decides and one tiny broadcast per step tells every worker, so all stop at the same
step, which is saved as the final checkpoint. With `optim.clock = "time"` the same broadcast carries rank 0's
training time, and after each step the learning-rate schedule moves to the share of the budget spent.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from albert_core.evaluation.unigram import UnigramBaseline, stored_file
from albert_core.examples.order import DataStream
from albert_core.files import DiskFull, disk_full_line, free_bytes
from albert_core.optim import set_schedule_position, time_position
from services.rundir.checkpoints import checkpoint_dir, kept_checkpoints
from services.rundir.health import Finding, divergence
from services.train.backends import StepBackend, all_reduce_sum, backend_for
from services.train.data import DAMAGE_EVENT, DamagedShard, damage_left
from services.train.follow import (
    EpochData,
    data_stream,
    newest_version,
    record_epoch,
    record_trained_epochs,
    recorded_epochs,
)
from services.train.input import InputPlan, open_input
from services.train.interrupt import stop_gracefully_on_sigterm
from services.train.plan import ShardSet, WorkerPlan, config_hash
from services.train.record import CoordinatorRecord, RunRecord, open_record
from services.train.state import TrainerState
from services.train.step import StepStats, initial_model, optimizer_for, step_seed

log = logging.getLogger(__name__)
RECENT_LOSSES = 20
REPORT_COST_SHARE = 0.05  # of training time spent handing metrics to the run's record: warned about, once
REPORT_COST_MIN = 20  # reports before the share is judged


@dataclass
class Worker:
    plan: WorkerPlan
    rank: int
    world: int
    distributed: bool
    backend: StepBackend
    record: RunRecord | None  # rank 0 only
    started_at: int = 0  # the step this process started from
    shards: ShardSet | None = None  # the newest version of the shard set this worker knows (the plan's at first)
    stream: DataStream | None = None  # the example order of the epochs decided so far (input_steps makes it)
    recent_losses: list[float] = field(default_factory=list)  # the last logged losses (divergence check)
    window: list[Any] = field(default_factory=list)  # tokens of the steps since the last log line
    window_start: float = field(default_factory=time.perf_counter)
    noticed: set[str] = field(default_factory=set)  # nodes whose preemption notice this worker group has saved for
    report_seconds: float = 0.0  # rank 0: time spent handing metrics lines to the run's record (note_report_cost)
    reports: int = 0
    report_cost_warned: bool = False


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Ray Train entry point; `loop_config["plan"]` is the WorkerPlan prepare_run made (services.train.driver).

    A damaged shard (services.train.data.DamagedShard) fails the worker group once: the run's log names it first,
    and a worker group Ray Train restarts while that shard is still damaged ends at once instead of training up to
    it again; the driver then stops the run with the shard's line.

    A full disk (albert_core.files.DiskFull: rank 0's checkpoint, or the run's record) fails the worker group with
    its line; a worker group Ray Train restarts while the run directory still lacks room for one checkpoint fails at
    once with it, instead of training up to the next save again; the driver then stops the run with that line."""
    worker = start_worker(loop_config["plan"])
    if _from_rank0([worker.rank == 0 and damage_left(worker.plan.run_dir) is not None], worker)[0]:
        return
    if worker.rank == 0:
        check_room_for_a_checkpoint(worker.plan)
    coordinator = worker.plan.coordinator
    # While this worker trains, a SIGTERM to its process asks the run for a graceful stop, as one to the driver does.
    with stop_gracefully_on_sigterm(coordinator, worker.rank) if coordinator else contextlib.nullcontext():
        model, optimizer, scheduler = build(worker)
        state = resume(worker, model, optimizer, scheduler)
        clock = Clock(worker, state)
        try:
            while True:
                diverged = train_steps(worker, model, optimizer, scheduler, state, clock)
                if diverged is None:
                    return
                state = roll_back(worker, model, optimizer, scheduler, state, diverged)
                if state is None:
                    return
        except DamagedShard as damage:
            record_damage(worker, state.step, damage)
            raise


def check_room_for_a_checkpoint(plan: WorkerPlan) -> None:
    """DiskFull when the run directory's filesystem holds less than one checkpoint (plan.disk.least) now."""
    free = free_bytes(plan.checkpoints)
    if plan.disk is not None and free is not None and free < plan.disk.least:
        line = disk_full_line(plan.checkpoints, plan.disk.least, kept_checkpoints(plan.checkpoints))
        raise DiskFull(line, str(plan.checkpoints))


def record_damage(worker: Worker, step: int, damage: DamagedShard) -> None:
    """The damaged shard in the run's log (through the coordinator from any rank; rank 0's own ledger otherwise)."""
    record = worker.record
    if record is None and worker.plan.coordinator:
        record = CoordinatorRecord(worker.plan.coordinator)
    if record is not None:
        record.event(step, DAMAGE_EVENT, **damage.fields(), rank=worker.rank)


def train_steps(worker: Worker, model, optimizer, scheduler, state: TrainerState, clock: Clock) -> Finding | None:
    """Train from the state's data position to the end of the run (or its budget); a divergence stops early. A run
    that follows its shard set decides each epoch's version when its input reaches it, then reads on."""
    while True:
        with input_steps(worker, state) as steps:
            for rows, micro in steps:
                step = state.step + 1
                before_step(worker, model, state, step, rows)
                seed = step_seed(worker.plan.config.run.seed, worker.rank, step)
                grad_clip = worker.plan.config.optim.grad_clip
                stats = worker.backend.train_step(model, optimizer, scheduler, micro, grad_clip=grad_clip, seed=seed)
                advance(worker, state, stats)
                stop = after_step(worker, model, optimizer, scheduler, state, stats, clock)
                if stop is not None:
                    return stop if isinstance(stop, Finding) else None
        if not worker.plan.config.data.follow or state.step >= worker.plan.config.optim.total_steps:
            return None
        if Clock.spent(worker.plan.config.train, state):
            return None
        follow_shard_set(worker, state)


# --- set-up --------------------------------------------------------------------------------------------------


def start_worker(plan: WorkerPlan) -> Worker:
    import ray.train
    import torch.distributed as dist

    t = plan.config.train
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    if world not in t.worker_counts:
        counts = f"{t.min_workers} to {t.num_workers}" if t.min_workers else f"{t.num_workers}"
        raise RuntimeError(f"train.num_workers/min_workers allow {counts} workers but Ray started {world}")
    distributed = dist.is_available() and dist.is_initialized() and world > 1
    backend = backend_for(plan, world=world, reduce_sum=all_reduce_sum if distributed else None)
    record = open_record(plan) if rank == 0 else None
    return Worker(plan, rank, world, distributed, backend, record, shards=plan.shards)


def build(worker: Worker):
    config = worker.plan.config
    vocab = worker.plan.token_ids.vocab_size
    unigram = None
    if worker.plan.unigram_dir:  # the driver stored the shard set's counts (train.plan.unigram_for)
        unigram = UnigramBaseline.load_file(stored_file(worker.plan.unigram_dir), vocab)
    model = initial_model(config.model_config(vocab), config.run.seed, unigram)  # the same on every worker
    worker.backend.place(model)  # before the optimizer (XLA needs it)
    optimizer, scheduler = optimizer_for(model, config.optim)
    return model, optimizer, scheduler


def resume(worker: Worker, model, optimizer, scheduler) -> TrainerState:
    """Rank 0 picks the checkpoint to resume from; everyone loads the same one. Otherwise a new run starts from
    random weights, or from model.init_from's layers (and, with data.continue_from_init, its data position)."""
    plan, t = worker.plan, worker.plan.config.train
    found = worker.record.latest_good_checkpoint() if worker.record is not None else None
    choice = _from_rank0([found], worker)[0]
    state = TrainerState(
        dropout=model.config.hidden_dropout_prob,
        config_hash=config_hash(plan.config),
        world_size=worker.world,
        micro_batch_size=t.micro_batch_size,
    )
    if choice:
        state = worker.backend.load(choice, model, optimizer, scheduler)
        trains_on = state.step < plan.config.optim.total_steps and not Clock.spent(t, state)
        if worker.record is not None and trains_on:
            worker.record.event(
                state.step, "resumed", checkpoint=choice, workers=worker.world, written_by_workers=state.world_size
            )
        if (state.world_size, state.micro_batch_size) != (worker.world, t.micro_batch_size):
            warn(worker, state.step, f"{choice}: written by {state.world_size} workers x micro-batch "
                 f"{state.micro_batch_size}, resumed by {worker.world} x {t.micro_batch_size}; the data position "
                 "carries over")  # fmt: skip
            state.world_size, state.micro_batch_size = worker.world, t.micro_batch_size
        if state.config_hash != config_hash(plan.config):
            warn(worker, state.step, f"{choice}: written under a different run config; continuing with the new one "
                 "(the changed fields: the run's config_changed event)")  # fmt: skip
        log.info("rank %d resumes from %s at step %d (epoch %d)", worker.rank, choice, state.step, state.epoch)
    elif plan.init_from:
        from albert_core.model.stacking import load_stacked

        load_stacked(model, plan.init_from)
        if worker.record is not None and plan.init is not None:
            worker.record.event(0, "initialized_from", message=plan.init.line(), source=plan.init_from,
                                checkpoint_kind=plan.init.kind, initialized=plan.init.initialized)  # fmt: skip
        if plan.init_data_position is not None:
            state.examples_seen = plan.init_data_position
    start_versions(worker, state)
    worker.started_at = state.step
    if worker.rank == 0:
        plan.checkpoints.mkdir(parents=True, exist_ok=True)
        for stale in plan.checkpoints.glob(".step_*"):  # temporaries of a save that crashed
            shutil.rmtree(stale, ignore_errors=True)
    return state


def warn(worker: Worker, step: int, message: str) -> None:
    """A warning for the user: logged, and (rank 0) a `warning` event in the run's metrics log, which the driver's
    console prints (services.rundir.report.LiveView): a local run's worker logs do not reach the console."""
    log.warning("%s", message)
    if worker.record is not None:
        worker.record.event(step, "warning", message=message)


def _from_rank0(values: list[Any], worker: Worker) -> list[Any]:
    if worker.distributed:
        import torch.distributed as dist

        dist.broadcast_object_list(values, src=0)
    return values


def start_versions(worker: Worker, state: TrainerState) -> None:
    """What each epoch so far trains on: the checkpoint's record, or, for a new run, the newest version (and the
    configured mixture) for epoch 0; epochs up to the data position that a checkpoint did not record (one written
    before every epoch was, by a run that did not follow) trained its last recorded version."""
    shards, config = worker.shards, worker.plan.config
    if not state.epoch_versions:
        state.epoch_versions = [1 if state.step > 0 else shards.version]  # a checkpoint from before parts: one part
    unrecorded = len(state.epoch_versions) - len(state.epoch_mixtures)
    state.epoch_mixtures += [dict(config.data.mixture)] * unrecorded  # a checkpoint from before mixtures were recorded
    if max(state.epoch_versions) > shards.version:
        raise RuntimeError(
            f"data.shards: {shards.directory} has {shards.version} parts, but the checkpoint trained on version "
            f"{max(state.epoch_versions)}; its appended parts are gone"
        )
    epochs = recorded_epochs(state)
    record_trained_epochs(state, data_stream(shards, config.run.seed, epochs, tail=epochs[-1]))
    worker.stream = decided_stream(worker, state)
    state.epoch = worker.stream.epoch_of(state.examples_seen)


def decided_epochs(worker: Worker, state: TrainerState) -> tuple[list[EpochData], EpochData | None]:
    """The run's decided epochs: the recorded ones, then (the tail), for a run that does not follow its shard set,
    its last recorded version under the mixture it is configured with now (a run that follows decides each epoch at
    its boundary)."""
    config = worker.plan.config
    epochs = recorded_epochs(state)
    tail = None if config.data.follow else EpochData.of(epochs[-1].version, config.data.mixture)
    return epochs, tail


def decided_stream(worker: Worker, state: TrainerState) -> DataStream:
    """The example order of the run's decided epochs (decided_epochs)."""
    epochs, tail = decided_epochs(worker, state)
    return data_stream(worker.shards, worker.plan.config.run.seed, epochs, tail=tail)


def follow_shard_set(worker: Worker, state: TrainerState) -> None:
    """At an epoch boundary of a run with data.follow: rank 0 reads the shard set's newest version (new parts
    verified), every worker takes it, and the next epoch trains on it under the configured mixture (recorded in the
    state, so in checkpoints)."""
    epoch, before = len(state.epoch_versions), state.epoch_versions[-1]
    newest = _from_rank0([newest_version(worker.shards, before) if worker.rank == 0 else None], worker)[0]
    if newest.version > before and worker.record is not None:
        new_parts = list(newest.part_names[before:])
        worker.record.event(state.step, "shards_version", epoch=epoch, version=newest.version, new_parts=new_parts)
        log.info("epoch %d trains on version %d of the shard set (new parts: %s)", epoch, newest.version, new_parts)
    worker.shards = newest
    record_epoch(state, EpochData.of(newest.version, worker.plan.config.data.mixture))


@contextlib.contextmanager
def input_steps(worker: Worker, state: TrainerState) -> Iterator[Iterator]:
    """This worker's (rows, micro-batches) for every step left in the decided epochs, read and masked ahead of the
    loop: by a thread, or by train.input_workers processes (services.train.input)."""
    config = worker.plan.config
    epochs, tail = decided_epochs(worker, state)
    worker.stream = decided_stream(worker, state)
    plan = InputPlan(
        worker.shards,
        config,
        worker.plan.token_ids,
        tuple(epochs),
        tail,
        position=state.examples_seen,
        steps=max(0, config.optim.total_steps - state.step),
        rank=worker.rank,
        world=worker.world,
    )
    with open_input(plan, workers=config.train.input_workers, pin=config.train.backend == "cuda") as ahead:
        with worker.backend.step_batches(ahead) as steps:
            yield steps if not Clock.spent(config.train, state) else iter(())


# --- each step -----------------------------------------------------------------------------------------------


def before_step(worker: Worker, model, state: TrainerState, step: int, rows) -> None:
    for callback in worker.plan.callbacks:  # services.train.callbacks
        callback.before_step(step=step, epoch=state.epoch, rank=worker.rank, rows=rows)
    removal = worker.plan.config.train.dropout_removal_step
    if removal and step >= removal and state.dropout != 0.0:
        model.set_dropout(0.0)
        state.dropout = 0.0


def advance(worker: Worker, state: TrainerState, stats: StepStats) -> None:
    state.step += 1
    state.examples_seen += worker.plan.config.train.global_batch_size
    record_trained_epochs(state, worker.stream)
    state.epoch = worker.stream.epoch_of(state.examples_seen)
    worker.window.append(stats.tokens)


class Clock:
    """The run's training time (summed over resumes) against train.max_seconds, and the driver's stop request.

    Rank 0 decides both, so that every worker ends at the same step: one tiny broadcast per step, made only when
    there is something to decide (a budget, or a coordinator the driver can ask to stop through). It carries rank 0's
    training time too, so that a schedule driven by the budget (optim.clock = "time") sets the same rate everywhere.
    """

    def __init__(self, worker: Worker, state: TrainerState):
        self.worker = worker
        self.started, self.before = time.perf_counter(), state.train_seconds
        self.decides = bool(worker.plan.config.train.max_seconds) or worker.plan.coordinator is not None

    @staticmethod
    def spent(train, state: TrainerState) -> bool:
        return bool(train.max_seconds) and state.train_seconds >= train.max_seconds

    def tick(self, state: TrainerState) -> str | None:
        """Update state.train_seconds (rank 0's, on every worker); on every worker, when the run ends at this step,
        "budget" or the name of the signal that asked for the stop ("SIGINT", "SIGTERM")."""
        state.train_seconds = self.before + time.perf_counter() - self.started
        if not self.decides:
            return None
        reason = 0  # 1: the budget is spent; else the number of the signal that asked for a stop
        if self.worker.record is not None:  # rank 0
            if self.spent(self.worker.plan.config.train, state):
                reason = 1
            elif asked := self.worker.record.stop_requested():
                reason = int(getattr(signal.Signals, asked, signal.SIGINT))
        reason, state.train_seconds = _from_rank0_numbers([reason, state.train_seconds], self.worker.distributed)
        if int(reason) == 0:
            return None
        return "budget" if int(reason) == 1 else signal.Signals(int(reason)).name


def follow_clock(worker: Worker, scheduler, state: TrainerState) -> None:
    """optim.clock = "time": move the schedule to the share of the budget spent, for the next step."""
    o = worker.plan.config.optim
    if o.clock == "time":
        set_schedule_position(
            scheduler, time_position(o.total_steps, state.train_seconds, worker.plan.config.train.max_seconds)
        )


def after_step(worker: Worker, model, optimizer, scheduler, state: TrainerState, stats: StepStats, clock):
    """Log, check health, checkpoint, report. Returns True when the run ends here (budget spent), the Finding when
    the step diverged (nothing of it is saved), else None."""
    import ray.train

    t, step = worker.plan.config.train, state.step
    ends = clock.tick(state)
    follow_clock(worker, scheduler, state)
    notice = preemption_notice(worker, step)
    is_last = step == worker.plan.config.optim.total_steps or ends == "budget"
    save = step % t.checkpoint_every == 0 or is_last or ends is not None or notice is not None
    if step % t.log_every == 0 or save:
        metrics = _metrics(worker, stats, state)
        diverged = divergence(step, metrics["loss"], metrics["grad_norm"], worker.recent_losses, t.divergence_factor)
        if diverged is not None:
            return diverged
        worker.recent_losses = [*worker.recent_losses, metrics["loss"]][-RECENT_LOSSES:]
        if worker.record is not None:
            started = time.perf_counter()
            worker.record.report(step, metrics)
            note_report_cost(worker, step, time.perf_counter() - started, time.perf_counter() - clock.started)
            if save:
                directory = checkpoint_dir(worker.plan.checkpoints, step)
                path = worker.backend.save(directory, model, optimizer, scheduler, state, worker.plan.tokenizer_files)
                worker.record.checkpoint_saved(step, str(path), metrics, final=is_last)
        if ends is not None or is_last:
            if worker.record is not None:
                worker.record.flush()
            ray.train.report(metrics)  # the result, at the last step of this worker group (module docstring)
    if notice is not None and notice["new"] and worker.record is not None:
        fields = {k: v for k, v in notice.items() if k != "new"}
        worker.record.event(step, "preemption_notice", **fields, checkpoint_step=step)
        log.warning("nodes %s are being preempted; saved a checkpoint at step %d", notice["nodes"], step)
    for callback in worker.plan.callbacks:  # services.train.callbacks
        callback.after_step(step=step, rank=worker.rank, started_at=worker.started_at)
    if ends == "budget":
        log.info("train.max_seconds=%s spent at step %d: the run ends here", t.max_seconds, step)
    elif ends is not None and worker.record is not None:
        asked = "Ctrl-C (SIGINT)" if ends == "SIGINT" else ends
        worker.record.event(step, "stopped", reason=f"stop requested ({asked})", signal=ends, checkpoint_step=step)
    return True if ends is not None else None


def note_report_cost(worker: Worker, step: int, seconds: float, trained: float) -> None:
    """Rank 0: a warning, once, when handing metrics lines to the run's record has taken more than
    REPORT_COST_SHARE of this process's training time (`trained` seconds) over at least REPORT_COST_MIN reports."""
    worker.report_seconds += seconds
    worker.reports += 1
    if worker.report_cost_warned or worker.reports < REPORT_COST_MIN:
        return
    if worker.report_seconds > REPORT_COST_SHARE * trained:
        worker.report_cost_warned = True
        share, every = worker.report_seconds / max(trained, 1e-9), worker.plan.config.train.log_every
        warn(worker, step, f"writing metrics took {share:.0%} of training time ({worker.reports} reports, "
             f"{1000 * worker.report_seconds / worker.reports:.2f} ms each, train.log_every = {every}); raise "
             "train.log_every to train faster")  # fmt: skip


def preemption_notice(worker: Worker, step: int) -> dict[str, Any] | None:
    """Every train.preemption_check_every steps: whether Ray Train knows of a node of this worker group being drained
    or preempted (ray.train.get_preemption_info: a barrier, called by every worker at the same steps, answered with
    rank 0's view). While a notice stands: {"nodes", "ranks", "deadline" (UNIX seconds or None), "new" (names a
    node not noticed before)}, the same on every worker, and the step is saved, so that the restart after the node
    goes redoes at most preemption_check_every steps; else None."""
    every = worker.plan.config.train.preemption_check_every
    if not every or step % every:
        return None
    import ray.train

    info = ray.train.get_preemption_info()
    if info is None:
        return None
    new = not set(info.preempted_node_ids) <= worker.noticed
    worker.noticed |= set(info.preempted_node_ids)
    deadline = info.deadline_ms / 1000 if info.deadline_ms else None
    return {"nodes": info.preempted_node_ids, "ranks": info.preempted_ranks, "deadline": deadline, "new": new}


def roll_back(worker: Worker, model, optimizer, scheduler, state: TrainerState, diverged: Finding):
    """train.on_divergence: "rollback" reloads the last good checkpoint and scales the learning rate down; "stop"
    (or no checkpoint, or rollbacks used up) ends the run. Either way the run's record gets a divergence event.
    Returns the state to continue from, or None."""
    t = worker.plan.config.train
    path = worker.record.latest_good_checkpoint() if worker.record is not None else None
    path = _from_rank0([path], worker)[0]
    if t.on_divergence != "rollback" or path is None or state.rollbacks >= t.max_rollbacks:
        why = "train.on_divergence is stop" if t.on_divergence != "rollback" else (
            "no checkpoint to roll back to" if path is None else f"train.max_rollbacks ({t.max_rollbacks}) used up"
        )  # fmt: skip
        if worker.record is not None:  # the driver reads why the run stopped from this event
            worker.record.event(state.step, "divergence", **diverged.fields(), action=f"stopped ({why})")
        return None
    scale, rollbacks, diverged_at = state.lr_scale * t.rollback_lr_scale, state.rollbacks + 1, state.step
    state = worker.backend.load(path, model, optimizer, scheduler)
    state.lr_scale, state.rollbacks = scale, rollbacks
    start_versions(worker, state)
    apply_lr_scale(optimizer, scheduler, scale)
    worker.recent_losses, worker.window, worker.window_start = [], [], time.perf_counter()
    if worker.record is not None:
        worker.record.event(
            diverged_at, "divergence", **diverged.fields(), action=f"rolled back to step {state.step}", lr_scale=scale
        )
    log.warning("%s; rolled back to step %d with the learning rate scaled by %g", diverged.message, state.step, scale)
    return state


def apply_lr_scale(optimizer, scheduler, scale: float) -> None:
    """Scale the schedule's base learning rates (and the current rate) by `scale` of the configured ones."""
    scheduler.base_lrs = [group["initial_lr"] * scale for group in optimizer.param_groups]
    set_schedule_position(scheduler, scheduler.last_epoch)


def _metrics(worker: Worker, stats: StepStats, state: TrainerState) -> dict[str, Any]:
    values = {
        "loss": stats.loss,
        "mlm_loss": stats.mlm_loss,
        "pair_loss": stats.pair_loss,
        "mlm_acc": stats.mlm_acc,
        "pair_acc": stats.pair_acc,
        "grad_norm": stats.grad_norm,
    }
    first_example = state.examples_seen - worker.plan.config.train.global_batch_size
    metrics: dict[str, Any] = {"step": state.step, "epoch": worker.stream.epoch_of(first_example)}
    metrics.update({k: float(v) for k, v in values.items()})
    now = time.perf_counter()
    tokens = sum(int(n) for n in worker.window)  # XLA: device scalars, read only here
    metrics.update(lr=float(stats.lr), tokens_per_s=tokens / max(now - worker.window_start, 1e-9))
    metrics.update(dropout=float(state.dropout), train_seconds=round(state.train_seconds, 3), lr_scale=state.lr_scale)
    metrics.update(worker.backend.metrics())
    worker.window, worker.window_start = [], now
    state.metrics = metrics
    return metrics


def _from_rank0_numbers(values: list[float], distributed: bool) -> list[float]:
    """Rank 0's numbers on every worker (one tiny broadcast), so that all of them stop at the same step."""
    if not distributed:
        return values
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    numbers = torch.tensor(values, dtype=torch.float64, device=device)
    dist.broadcast(numbers, src=0)
    return numbers.tolist()
