"""`albert pretrain --dry-run`: the whole plan of a run, made by the run's own path with every check it makes before
Ray starts (services.train.driver.prepare_run: a finished run, a resume's config changes, the shard set, the
vocabulary, model.init_from, the run directory), then printed. Nothing is written and Ray is not started."""

from __future__ import annotations

from collections.abc import Sequence

from albert_core.files import free_bytes, size
from albert_core.model.config import count_parameters
from services.rundir.config import RunConfig
from services.rundir.resume import describe_changes
from services.train.driver import prepare_run
from services.train.plan import WorkerPlan
from services.train.space import checkpoint_count


def dry_run(config: RunConfig, *, resume: bool, allow_config_change: Sequence[str] = ()) -> list[str]:
    """The plan's lines; ConfigError / ValueError as the real run would refuse it."""
    prepared = prepare_run(config, resume=resume, allow_config_change=allow_config_change, dry_run=True)
    if prepared.finished is not None:
        return [prepared.finished_line(), "dry run: nothing was started or written"]
    plan, changes = prepared.plan, prepared.changes
    lines = plan_lines(plan)
    need = plan.disk
    free = free_bytes(need.path)
    free_text = "unknown space" if free is None else f"{size(free)}"
    lines.append(f"disk: {need.what} need {size(need.total)}; {free_text} free in {need.path}")
    if changes:
        lines.append("changed since the run's last start (allowed):")
        lines += [f"  {line}" for line in describe_changes(changes)]
    lines.append("dry run: every check passed; nothing was started or written")
    return lines


def plan_lines(plan: WorkerPlan) -> list[str]:
    """What the run will do: the run directory, the model, the shard set, the workers, steps, epochs, checkpoints."""
    config = plan.config
    o, t, e = config.optim, config.train, config.eval
    model = config.model_config(plan.token_ids.vocab_size)
    start_step = plan.start_step
    where = f"resumes from step {start_step}" if start_step else "a new run"
    lines = [
        f"run {config.run.name}: {plan.run_dir} ({where})",
        f"model: {config.model.preset}, {model.num_hidden_layers} layers, H {model.hidden_size}, E "
        f"{model.embedding_size}, {model.num_attention_heads} heads, sharing {model.sharing}, vocab "
        f"{model.vocab_size}: {count_parameters(model) / 1e6:.2f}M parameters",
        *shard_lines(plan),
        *worker_lines(config),
        f"steps: {o.total_steps} ({o.total_steps - start_step} to go), {o.name} lr {o.lr:g}, warmup {o.warmup_steps}"
        + (f", decay over the last {o.decay_steps}" if o.decay_steps else ", linear decay to 0")
        + (f", clock {o.clock}" if o.clock != "steps" else "")
        + (f"; budget {t.max_seconds:g} s of training" if t.max_seconds else ""),
        *epoch_lines(plan),
        f"checkpoints: every {t.checkpoint_every} steps and at the end ({checkpoint_count(config)} in all), "
        f"keep the last {t.keep_last}, in {plan.checkpoints}",
        "held-out evaluation: "
        + (f"every {e.every_steps} steps and at the end" if e.every_steps else "at the end")
        + (f"; tasks {', '.join(e.tasks)}" if e.tasks else ""),
    ]
    if plan.disk_warning:
        lines.append(f"warning: {plan.disk_warning}")
    if t.dropout_removal_step:
        lines.append(f"dropout {model.hidden_dropout_prob:g} removed at step {t.dropout_removal_step}")
    if plan.init is not None:
        lines.append(plan.init.line())
    f = config.finetune
    tuned = ", ".join(f"{k} {v}" for k, v in (("lr", f.lr), ("max_steps", f.max_steps), ("pooling", f.pooling)) if v)
    if tuned:
        lines.append(f"fine-tuning its checkpoints: {tuned} ([finetune]; the task's recipe for the rest)")
    return lines


def shard_lines(plan: WorkerPlan) -> list[str]:
    shards, d = plan.shards, plan.config.data
    lines = [f"shards: {shards.directory}, version {shards.version}, {sum(shards.rows_per_file)} examples"]
    first = 0
    for name, files in zip(shards.part_names, shards.part_files, strict=True):
        rows = sum(shards.rows_per_file[first : first + files])
        lines.append(f"  part {name}: {files} file{'s' if files != 1 else ''}, {rows} examples")
        first += files
    if d.mixture:
        lines.append(f"  mixture: {d.mixture}")
    if d.follow:
        lines.append("  follows the shard set: each epoch trains on its newest version")
    return lines


def worker_lines(config: RunConfig) -> list[str]:
    t = config.train
    count = f"{t.min_workers} to {t.num_workers} (elastic)" if t.min_workers else str(t.num_workers)
    resources = "".join(f" + {amount:g} {name}" for name, amount in t.resources_per_worker.items())
    return [
        f"workers: {count}, each {t.cpus_per_worker} CPU{resources}; backend {t.backend}, {t.precision}"
        + (", compiled" if t.compile else ""),
        f"batch: {t.global_batch_size} examples a step = micro-batch {t.micro_batch_size} x {t.accumulation} "
        f"accumulated x {t.num_workers} workers, {config.data.max_seq_length} tokens",
    ]


def epoch_lines(plan: WorkerPlan) -> list[str]:
    config = plan.config
    order = plan.shards.order(plan.shards.version, config.run.seed, config.data.mixture)
    per_epoch = order.epoch_size(0)
    batch = config.train.global_batch_size
    epochs = config.optim.total_steps * batch / per_epoch
    return [f"epochs: {per_epoch} examples each ({per_epoch / batch:.1f} steps); {epochs:.2f} epochs in all"]
