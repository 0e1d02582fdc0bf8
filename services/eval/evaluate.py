"""Evaluation of checkpoints: the intrinsic evaluator actor, a plain function for `albert evaluate`, and the
registry downstream tasks plug into.

Intrinsic metrics (MLM / SOP / NSP accuracy on held-out documents) come from `albert_core.evaluation.intrinsic`; this
module only loads the checkpoint and the held-out file and, in Ray, runs that on its own CPU.

Downstream tasks are the fine-tuning tasks of services.finetune (GLUE, SQuAD, RACE, polarity, custom), each a
(checkpoint_dir, data_dir) -> metrics function in DOWNSTREAM_TASKS; `evaluate_checkpoint(..., tasks=[...])` runs
them and refuses a name that has none.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from albert_core.examples.shape import shape_field
from albert_core.files import TRAINER_FILE
from services.rundir.config import RunConfig

# torch is imported where evaluation runs (inside the functions below), not here: the scheduler (services.eval.schedule,
# in the run's coordinator or a schedule's runner) imports this module for the actor class and its options and stays
# a light process that (re)starts in a second.
if TYPE_CHECKING:
    from torch import nn

    from albert_core.evaluation.intrinsic import HeldoutDocument, TokenIds
    from albert_core.evaluation.unigram import UnigramBaseline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IntrinsicOptions:
    """How held-out examples are built and batched; the same options give the same examples every time. Their shape
    is the example shape's (albert_core.examples.shape; SOP and NSP pairs are both built, whatever the run's task)."""

    max_seq_length: int = shape_field("max_seq_length")
    seed: int = 12345
    batch_size: int = 32
    max_examples: int = 640
    mask_prob: float = shape_field("mask_prob")
    max_ngram: int = shape_field("max_ngram")
    short_seq_prob: float = shape_field("short_seq_prob")

    @classmethod
    def from_run_config(cls, config: RunConfig) -> IntrinsicOptions:
        return cls(
            max_seq_length=config.data.max_seq_length,
            seed=config.run.seed,
            batch_size=config.eval.batch_size,
            max_examples=config.eval.heldout_batches * config.eval.batch_size,
            mask_prob=config.data.mask_prob,
            max_ngram=config.data.max_ngram,
        )


# --- downstream task registry ----------------------------------------------------------------------------------

# (checkpoint directory, task data directory) -> metrics for that task (e.g. {"acc": ..., "f1": ...}).
DownstreamTask = Callable[[str, str], dict[str, Any]]
DOWNSTREAM_TASKS: dict[str, DownstreamTask] = {}


class UnknownTask(ValueError):
    """A downstream task was requested that no evaluator is registered for."""


def register_finetune_tasks() -> None:
    """The fine-tuning tasks of services.finetune.seeds (GLUE, SQuAD, RACE, polarity): median dev metrics over seeds."""
    from services.finetune.seeds import TASKS, downstream_evaluator

    for task in TASKS:
        DOWNSTREAM_TASKS.setdefault(task, downstream_evaluator(task))


def check_tasks(tasks: Sequence[str], task_data: dict[str, str]) -> None:
    """Raise UnknownTask / ValueError naming the first task that cannot run."""
    if tasks:
        register_finetune_tasks()
    for task in tasks:
        if task not in DOWNSTREAM_TASKS:
            known = ", ".join(sorted(DOWNSTREAM_TASKS)) or "none yet"
            raise UnknownTask(
                f"eval.tasks: no evaluator is registered for downstream task {task!r} (registered: {known})"
            )
        if task not in task_data:
            raise ValueError(f"eval.task_data: no data directory for downstream task {task!r}")


def downstream_metrics(
    task: str, checkpoint: str | Path, data_dir: str, *, seeds: int = 0, max_steps: int = 0
) -> dict[str, Any]:
    """One downstream task's metrics for a checkpoint; seeds / max_steps (0: the task's protocol) shape the
    built-in fine-tuning tasks, which also take the fine-tuning defaults of the checkpoint's recipe ([finetune] of
    its run: lr, max_steps, pooling; max_steps given here wins)."""
    from services.finetune.seeds import TASKS, downstream_evaluator, recipe_defaults

    if task not in TASKS:
        return DOWNSTREAM_TASKS[task](str(checkpoint), data_dir)
    defaults = recipe_defaults(checkpoint)
    overrides = dict(defaults.overrides) if defaults is not None else {}
    if max_steps:
        overrides["max_steps"] = max_steps
    if seeds or overrides:
        evaluate = downstream_evaluator(task, seeds=seeds or None, overrides=overrides or None)
        return evaluate(str(checkpoint), data_dir)
    return DOWNSTREAM_TASKS[task](str(checkpoint), data_dir)


def flat_task_metrics(tasks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """{"sst2": {"acc": 0.9}} -> {"task/sst2/acc": 0.9}: one flat metrics line, as the report reads it."""
    return {
        f"task/{task}/{name}": value
        for task, metrics in tasks.items()
        for name, value in metrics.items()
        if isinstance(value, (int, float))
    }


# --- evaluation ------------------------------------------------------------------------------------------------


def _trainer_record(path: str | Path) -> dict[str, Any]:
    """The trainer.json beside a checkpoint's weights ({} when there is none)."""
    trainer = Path(path) / TRAINER_FILE
    if not trainer.is_file():
        return {}
    try:
        record = json.loads(trainer.read_text())
    except json.JSONDecodeError:
        record = None
    if not isinstance(record, dict):
        raise ValueError(f"{trainer}: expected a JSON object with an integer 'step'")
    return record


def checkpoint_step(path: str | Path) -> int | None:
    """The training step recorded beside a checkpoint's weights (trainer.json), or None when there is none."""
    step = _trainer_record(path).get("step")
    return int(step) if step is not None else None


def checkpoint_version(path: str | Path) -> int | None:
    """The shard-set version a training checkpoint's last epoch trained on (trainer.json's epoch_versions), or
    None (a model directory, or a checkpoint made before shard sets had versions)."""
    versions = _trainer_record(path).get("epoch_versions") or []
    return int(versions[-1]) if versions else None


def evaluate_model(
    model: nn.Module,
    documents: Sequence[HeldoutDocument],
    options: IntrinsicOptions,
    token_ids: TokenIds | None = None,
    unigram: UnigramBaseline | None = None,
) -> dict[str, float | int]:
    """Intrinsic metrics of a loaded model (token ids default to the ALBERT layout at the model's vocab size);
    with `unigram`, also the floor on the same masked positions and the margin over it."""
    from albert_core.evaluation.intrinsic import TokenIds, intrinsic_metrics

    token_ids = token_ids or TokenIds(vocab_size=model.config.vocab_size)
    return intrinsic_metrics(
        model,
        documents,
        token_ids=token_ids,
        max_seq_length=options.max_seq_length,
        seed=options.seed,
        batch_size=options.batch_size,
        max_examples=options.max_examples,
        mask_prob=options.mask_prob,
        max_ngram=options.max_ngram,
        short_seq_prob=options.short_seq_prob,
        unigram=unigram,
    )


def evaluate_checkpoint(
    path: str | Path,
    heldout_path: str | Path,
    *,
    options: IntrinsicOptions | None = None,
    token_ids: TokenIds | None = None,
    step: int | None = None,
    tasks: Sequence[str] = (),
    task_data: dict[str, str] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Evaluate one model directory (ours or transformers'): intrinsic metrics plus any registered downstream tasks.

    Returns {"step", "checkpoint", "time", "seconds", mlm_acc, mlm_loss, sop_acc, nsp_acc, counts...} and, when
    tasks are given, "tasks": {task: metrics}.
    """
    from albert_core.evaluation.intrinsic import read_heldout
    from albert_core.text.vocabulary import check_heldout_fits

    task_data = task_data or {}
    check_tasks(tasks, task_data)
    check_heldout_fits(path, heldout_path)  # a vocabulary mismatch is refused before the model loads
    started = time.time()
    model = _load(path).to(device)
    unigram = unigram_beside(heldout_path, model.config.vocab_size, checkpoint_version(path))
    metrics = evaluate_model(model, read_heldout(str(heldout_path)), options or IntrinsicOptions(), token_ids, unigram)
    result: dict[str, Any] = {
        "step": step if step is not None else checkpoint_step(path),
        "checkpoint": str(path),
        **metrics,
    }
    if tasks:
        result["tasks"] = {task: downstream_metrics(task, path, task_data[task]) for task in tasks}
    result["time"] = time.time()
    result["seconds"] = result["time"] - started
    return result


@ray.remote(num_cpus=1)
class IntrinsicEvaluator:
    """One evaluation worker: reads the held-out documents once, then evaluates checkpoint directories."""

    def __init__(
        self,
        heldout_path: str,
        options: dict[str, Any] | None = None,
        token_ids: TokenIds | None = None,
        downstream: dict[str, Any] | None = None,
    ):
        """downstream: {"tasks": [...], "task_data": {task: dir}, "seeds": n, "max_steps": n} (eval.* of the run)."""
        import torch

        from albert_core.evaluation.intrinsic import read_heldout

        torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 0))))
        self.heldout_path = heldout_path
        self.documents = read_heldout(heldout_path)
        self.options = IntrinsicOptions(**(options or {}))
        self.token_ids = token_ids
        self.downstream = downstream or {"tasks": []}
        check_tasks(self.downstream["tasks"], self.downstream.get("task_data", {}))

    def evaluate(self, checkpoint_path: str, step: int | None = None) -> dict[str, Any]:
        started = time.time()
        model = _load(checkpoint_path)
        if ray.get_gpu_ids():  # launched with num_gpus: evaluate on the GPU Ray assigned
            model = model.to("cuda")
        unigram = unigram_beside(self.heldout_path, model.config.vocab_size, checkpoint_version(checkpoint_path))
        metrics = evaluate_model(model, self.documents, self.options, self.token_ids, unigram=unigram)
        d = self.downstream
        tasks = {
            task: downstream_metrics(
                task, checkpoint_path, d["task_data"][task], seeds=d.get("seeds", 0), max_steps=d.get("max_steps", 0)
            )
            for task in d["tasks"]
        }
        metrics.update(flat_task_metrics(tasks))
        finished = time.time()
        step = step if step is not None else checkpoint_step(checkpoint_path)
        return {"step": step, "checkpoint": checkpoint_path, **metrics, "time": finished, "seconds": finished - started}


def unigram_beside(heldout_path: str | Path, vocab_size: int, version: int | None = None) -> UnigramBaseline | None:
    """The unigram baseline of the shard set a held-out file belongs to (<shards>/heldout/documents.parquet), of
    the version the checkpoint trained on (None, or a set that kept no counts of that version: the newest), when it
    has been counted and fits the model's vocabulary."""
    from albert_core.evaluation.unigram import UnigramBaseline, stored_file

    shards = Path(heldout_path).resolve().parent.parent
    stored = (version is not None and stored_file(shards, version)) or stored_file(shards)
    if stored is None:
        return None
    try:
        return UnigramBaseline.load_file(stored, vocab_size)
    except ValueError as err:
        log.warning("no unigram baseline for this evaluation: %s", err)
        return None


def _load(path: str | Path) -> nn.Module:
    from albert_core.model.checkpoint import load_model
    from albert_core.model.modeling import AlbertForPreTraining

    return load_model(path, AlbertForPreTraining)


def options_dict(options: IntrinsicOptions) -> dict[str, Any]:
    """Plain form for passing IntrinsicOptions to an actor (and for logs)."""
    return asdict(options)
