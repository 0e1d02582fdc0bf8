"""Fine-tuning: the train loop (`finetune`) over a task adapter, and scoring of saved outputs, seeds and ensembles.

The recipes and the run's config are in `albert_core.finetune.config`; each task family's adapter (GlueData,
SquadData, RaceData, CustomData) sits next to its reader in `albert_core.finetune.tasks`. docs/finetuning.md describes
the loop, the adapters' methods and the paper's protocol (median of 5 seeds, ensembles).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from albert_core.files import METRICS_FILE, append_line, atomic_write_bytes, atomic_write_json
from albert_core.finetune.config import SQUAD_TASKS, FinetuneConfig, TaskHyperparams
from albert_core.finetune.tasks.batching import to_device
from albert_core.finetune.tasks.custom import CustomData
from albert_core.finetune.tasks.glue import GlueData
from albert_core.finetune.tasks.outputs import TaskOutputs, ensemble
from albert_core.finetune.tasks.race import RaceData
from albert_core.finetune.tasks.squad import SquadData
from albert_core.model.checkpoint import load_weights, read_checkpoint, save_model
from albert_core.optim import make_optimizer, make_scheduler
from albert_core.text.tokenization import AnyTokenizer, load_tokenizer

TaskData = GlueData | SquadData | RaceData | CustomData


class FinetuneInterrupted(KeyboardInterrupt):
    """Ctrl-C during the training steps. `result` is what the run had: its dev evaluations so far (history), the
    best of them (dev, best_step), the steps run, interrupted=True; no predictions were written."""

    def __init__(self, result: dict[str, Any]):
        super().__init__(f"fine-tuning {result['task']} interrupted at step {result['steps']}")
        self.result = result


def load_task_data(config: FinetuneConfig, tokenizer: AnyTokenizer, h: TaskHyperparams | None = None) -> TaskData:
    """Read and encode the training data of config.task (dev and test are read when first needed)."""
    h = h or config.hyperparams()
    if config.task in SQUAD_TASKS:
        return SquadData(config.task, config.data_dir, tokenizer, h, config)
    if config.task == "race":
        return RaceData(config.task, config.data_dir, tokenizer, h, config)
    if config.task == "custom":
        return CustomData(config, tokenizer, h)
    return GlueData(config.task, config.data_dir, tokenizer, h)


# --- the train loop ---------------------------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_model(config: FinetuneConfig, data: TaskData, h: TaskHyperparams, vocab_size: int) -> nn.Module:
    """The task model: the checkpoint's backbone under a freshly initialized head, or all random (no checkpoint).

    Initialization draws from torch's global generator: seed it first.
    """
    if config.checkpoint is not None:
        model_config, state = read_checkpoint(config.checkpoint)
        where = f"checkpoint {config.checkpoint}"
    else:
        model_config, state, where = config.model, None, "FinetuneConfig.model"
    changes: dict[str, Any] = {"classifier_dropout_prob": h.classifier_dropout}
    if config.dropout is not None:
        changes.update(hidden_dropout_prob=config.dropout, attention_probs_dropout_prob=config.dropout)
    if config.pooling is not None:
        changes["pooling"] = config.pooling
    model_config = model_config.replace(**changes)
    if model_config.vocab_size < vocab_size:
        raise ValueError(
            f"{where}: vocab_size {model_config.vocab_size} is smaller than the tokenizer's {vocab_size} pieces"
        )
    if h.max_seq_length > model_config.max_position_embeddings:
        raise ValueError(
            f"max_seq_length {h.max_seq_length} exceeds the {where} max_position_embeddings "
            f"{model_config.max_position_embeddings}; override max_seq_length"
        )
    model = data.model(model_config)
    if state is not None:
        load_weights(model, state)
    return model


class _Batches:
    """Endless batches of example indices: a fresh seeded permutation each epoch, batches crossing epochs."""

    def __init__(self, n: int, batch_size: int, rng: np.random.Generator):
        if n == 0:
            raise ValueError("fine-tuning: the training split has no examples")
        self.n, self.batch_size, self.rng = n, batch_size, rng
        self.pending = np.empty(0, dtype=np.int64)

    def next(self) -> np.ndarray:
        if len(self.pending) < self.batch_size:  # the epochs this batch reaches into, drawn in one go
            epochs = -(-(self.batch_size - len(self.pending)) // self.n)
            self.pending = np.concatenate([self.pending, *(self.rng.permutation(self.n) for _ in range(epochs))])
        batch, self.pending = self.pending[: self.batch_size], self.pending[self.batch_size :]
        return batch


def json_safe(value: Any) -> Any:
    """value with NaN / ±inf floats replaced by None (strict JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _better(value: float, best: float | None) -> bool:
    value = value if math.isfinite(value) else -math.inf
    return best is None or value > best


def eval_steps(total: int, eval_every: int | None) -> set[int]:
    """Steps after which the dev set is evaluated; always includes the last step."""
    every = max(1, total // 10) if eval_every is None else eval_every
    steps = set(range(every, total + 1, every)) if every else set()
    return steps | {total}


@dataclass
class _Run:
    """What one fine-tuning run works with, built in `_start`."""

    config: FinetuneConfig
    h: TaskHyperparams
    tokenizer: AnyTokenizer
    data: TaskData
    model: nn.Module
    device: torch.device
    optimizer: torch.optim.Optimizer
    scheduler: Any
    batches: _Batches
    autocast: torch.autocast
    out_dir: Path | None

    def predict(self, split: str) -> TaskOutputs:
        self.model.eval()
        with torch.inference_mode(), self.autocast:
            return self.data.predict(self.model, split, self.config.eval_batch_size, self.device)

    def train_step(self, index: np.ndarray) -> float:
        """Forward and backward over `index` in micro batches, then one optimizer step; returns the loss."""
        self.model.train()
        micro = self.config.micro_batch_size or self.h.batch_size
        loss_value = 0.0
        for start in range(0, len(index), micro):
            chunk = index[start : start + micro]
            with self.autocast:
                loss = self.model(**to_device(self.data.train_batch(chunk), self.device)).loss * (
                    len(chunk) / len(index)
                )
            loss.backward()
            loss_value += float(loss.detach())
        return loss_value

    def update(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.h.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def evaluate(self) -> tuple[dict[str, TaskOutputs], dict[str, float]]:
        """The dev splits' outputs and all their metrics."""
        outputs = {split: self.predict(split) for split in self.data.dev_splits}
        metrics: dict[str, float] = {}
        for split_outputs in outputs.values():
            metrics.update(self.data.score(split_outputs))
        return outputs, metrics

    def log(self, record: dict[str, Any]) -> None:
        if self.out_dir is not None:
            append_line(self.out_dir / METRICS_FILE, json.dumps(json_safe(record)))


def _start(config: FinetuneConfig) -> _Run:
    """Recipe, device, tokenizer, task data, seeded model, optimizer and schedule; the output directory emptied."""
    h = config.hyperparams()
    device = resolve_device(config.device)
    tokenizer = load_tokenizer(config.tokenizer_path())
    data = load_task_data(config, tokenizer, h)
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    model = build_model(config, data, h, tokenizer.vocab_size).to(device)
    optimizer = make_optimizer(model, name=h.optimizer, lr=h.lr, weight_decay=h.weight_decay)
    scheduler = make_scheduler(optimizer, warmup_steps=h.warmup_steps, total_steps=h.train_steps)
    batches = _Batches(data.num_train, h.batch_size, rng)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16")
    out_dir = Path(config.output_dir) if config.output_dir is not None else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out_dir / METRICS_FILE, b"")
    return _Run(config, h, tokenizer, data, model, device, optimizer, scheduler, batches, autocast, out_dir)


@dataclass
class _BestOnDev:
    """The best dev evaluation so far (its weights copied to the CPU), and early stopping on it."""

    patience: int | None
    value: float | None = None
    step: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    outputs: dict[str, TaskOutputs] = field(default_factory=dict)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    evals_since: int = 0

    def update(self, step: int, metrics: dict[str, float], outputs: dict[str, TaskOutputs], run: _Run) -> bool:
        """Take this evaluation if it is better; True when `patience` evaluations in a row were not."""
        value = metrics[run.data.metric]
        if _better(value, self.value):
            self.value = value if math.isfinite(value) else -math.inf
            self.state = {k: v.detach().to("cpu", copy=True) for k, v in run.model.state_dict().items()}
            self.step, self.metrics, self.outputs = step, metrics, outputs
            self.evals_since = 0
            return False
        self.evals_since += 1
        return self.patience is not None and self.evals_since >= self.patience


@dataclass
class _Trained:
    best: _BestOnDev
    history: list[dict[str, Any]]
    steps: int  # optimizer steps taken
    stopped_early: bool = False
    interrupted: KeyboardInterrupt | None = None  # what ended the steps (Ctrl-C, or a command's SIGTERM as one)


def _train(run: _Run, on_evaluation: Callable[[int, float], None] | None = None) -> _Trained:
    """The steps, with dev evaluations on the schedule (each one a line on the progress bar's console, and
    on_evaluation(step, the primary dev metric) called after it)."""
    config, h = run.config, run.h
    trained = _Trained(_BestOnDev(config.patience), [], 0)
    losses: list[float] = []
    schedule = eval_steps(h.train_steps, config.eval_every)
    progress = _progress(h.train_steps, config.progress, config.task)
    try:
        for step in range(1, h.train_steps + 1):
            loss_value = run.train_step(run.batches.next())
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"fine-tuning {config.task}: loss is {loss_value} at step {step}")
            run.update()
            trained.steps = step
            losses.append(loss_value)
            progress.update(1)
            progress.set_postfix(loss=f"{loss_value:.4f}")
            if step not in schedule:
                continue
            outputs, metrics = run.evaluate()
            record = {"step": step, "time": time.time(), "train_loss": float(np.mean(losses))}
            record.update(lr=run.scheduler.get_last_lr()[0], **metrics)
            losses = []
            trained.history.append(record)
            run.log(record)
            stop = trained.best.update(step, metrics, outputs, run)
            progress.write(evaluation_line(record, metrics, h.train_steps, best=trained.best.step == step))
            if on_evaluation is not None:
                on_evaluation(step, float(metrics[run.data.metric]))
            if stop:
                trained.stopped_early = True
                break
    except KeyboardInterrupt as interrupt:
        trained.interrupted = interrupt
    progress.close()
    return trained


def evaluation_line(record: dict[str, Any], metrics: dict[str, float], total: int, *, best: bool) -> str:
    """One dev evaluation for the console: "step 40/200  dev acc 0.8125  macro_f1 0.8012  train_loss 0.41  (best)"."""
    shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
    return f"step {record['step']}/{total}  dev {shown}  train_loss {record['train_loss']:.4f}" + (
        "  (best)" if best else ""
    )


def finetune(config: FinetuneConfig, on_evaluation: Callable[[int, float], None] | None = None) -> dict[str, Any]:
    """Fine-tune, evaluate on dev as configured, keep the best-on-dev weights, write predictions; return the results.

    Result: task, seed, metric (the task's primary dev metric), dev (all dev metrics at the best evaluation),
    best_step, steps (steps run), stopped_early, history (one record per evaluation), test (metrics where test
    labels are public: RACE, custom data with labels), files (what was written), hyperparams, checkpoint, seconds.
    Ctrl-C during the steps raises FinetuneInterrupted carrying this result so far (interrupted=True, no files).
    `on_evaluation(step, primary dev metric)` is called after each dev evaluation (a Tune trial reports it there).
    """
    started = time.time()
    run = _start(config)
    trained = _train(run, on_evaluation)
    result = {
        "task": config.task,
        "seed": config.seed,
        "metric": run.data.metric,
        "dev": trained.best.metrics,
        "best_step": trained.best.step,
        "steps": trained.steps,
        "stopped_early": trained.stopped_early,
        "history": trained.history,
        "test": {},
        "files": {},
        "hyperparams": dataclasses.asdict(run.h),
        "pooling": getattr(getattr(run.model, "config", None), "pooling", None),  # what the task head read
        "checkpoint": config.checkpoint,
        "started": started,
    }
    if trained.interrupted:
        result.update(interrupted=True, seconds=time.time() - started)
        _write_result(run, result)
        raise FinetuneInterrupted(result) from trained.interrupted
    run.model.load_state_dict(trained.best.state)
    test_outputs = {split: run.predict(split) for split in run.data.available_test_splits()}
    for split_outputs in test_outputs.values():
        result["test"].update(run.data.test_metrics(split_outputs))
    result["files"] = _write_outputs(run, {**trained.best.outputs, **test_outputs})
    result["seconds"] = time.time() - started
    _write_result(run, result)
    return result


def _write_result(run: _Run, result: dict[str, Any]) -> None:
    if run.out_dir is not None:
        atomic_write_json(run.out_dir / "result.json", json_safe(result))


def _write_outputs(run: _Run, outputs: dict[str, TaskOutputs]) -> dict[str, str]:
    """Each split's prediction file and saved outputs (and the model with save_model) in out_dir; what was written."""
    files: dict[str, str] = {}
    if run.out_dir is None:
        return files
    for split, split_outputs in outputs.items():
        files[f"predictions_{split}"] = str(run.data.write_predictions(split_outputs, run.out_dir))
        files[f"outputs_{split}"] = str(split_outputs.save(run.out_dir / f"outputs_{split}.npz"))
    if run.config.save_model:
        files["model"] = str(save_model(run.out_dir / "model", run.model))
        run.tokenizer.save(run.out_dir / "model")
    return files


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def write(self, line: str) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool, task: str):
    if not enabled:
        return _NoProgress()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"finetune {task}", unit="step")


# --- scoring saved outputs, seeds, ensembles --------------------------------------------------------------


def score_ensemble(
    config: FinetuneConfig, run_dirs: Sequence[str | Path], out_dir: str | Path | None = None
) -> dict[str, Any]:
    """Average the saved outputs (outputs_<split>.npz) of several fine-tuning runs of config.task and score them.

    Runs may differ in seed or pretrained checkpoint; every split saved by all runs is averaged. Returns
    {"runs", "dev": metrics, "test": metrics (RACE), "files"}; with out_dir, the ensemble's prediction files too.
    """
    if not run_dirs:
        raise ValueError("score_ensemble: no run directories")
    dirs = [Path(d) for d in run_dirs]
    saved = [{p.stem.removeprefix("outputs_") for p in d.glob("outputs_*.npz")} for d in dirs]
    for d, splits in zip(dirs, saved, strict=True):
        if not splits:
            raise FileNotFoundError(f"score_ensemble: {d} holds no outputs_<split>.npz (was output_dir set?)")
    data = load_task_data(config, load_tokenizer(config.tokenizer_path()))
    result: dict[str, Any] = {"runs": len(dirs), "dev": {}, "test": {}, "files": {}}
    for split in sorted(set.intersection(*saved)):
        merged = ensemble([TaskOutputs.load(d / f"outputs_{split}.npz") for d in dirs])
        if merged.task != config.task or merged.ids != data.row_ids(split):
            raise ValueError(f"score_ensemble: the saved {split} outputs are not the rows of {config.data_dir}")
        if split in data.dev_splits:
            result["dev"].update(data.score(merged))
        else:
            result["test"].update(data.test_metrics(merged))
        if out_dir is not None:
            result["files"][f"predictions_{split}"] = str(data.write_predictions(merged, Path(out_dir)))
    return result


def median_of_seeds(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-metric median of the dev metrics of several runs (GLUE dev results are the median of 5 runs)."""
    if not results:
        raise ValueError("median_of_seeds: no results")
    tasks = {r["task"] for r in results}
    if len(tasks) != 1:
        raise ValueError(f"median_of_seeds: results of several tasks {sorted(tasks)}")
    names = [k for k in results[0]["dev"] if all(k in r["dev"] for r in results)]
    median = {k: float(np.median([float(r["dev"][k]) for r in results])) for k in names}
    return {
        "task": results[0]["task"],
        "metric": results[0]["metric"],
        "runs": len(results),
        "seeds": [r["seed"] for r in results],
        "median": median,
        "per_seed": [{"seed": r["seed"], **{k: r["dev"][k] for k in names}} for r in results],
    }


def markdown_table(summary: dict[str, Any]) -> str:
    """A markdown table of a median_of_seeds summary: one row per seed, then the median."""
    names = list(summary["median"])
    lines = ["| seed | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]

    scale = 1.0 if summary["task"] in SQUAD_TASKS else 100.0  # GLUE / RACE metrics are fractions, SQuAD's percent

    def cell(value: float) -> str:
        return f"{scale * value:.2f}"

    for row in summary["per_seed"]:
        lines.append(f"| {row['seed']} | " + " | ".join(cell(row[k]) for k in names) + " |")
    lines.append("| **median** | " + " | ".join(f"**{cell(summary['median'][k])}**" for k in names) + " |")
    return "\n".join(lines)


__all__ = [
    "FinetuneInterrupted",
    "TaskData",
    "build_model",
    "eval_steps",
    "evaluation_line",
    "finetune",
    "json_safe",
    "load_task_data",
    "markdown_table",
    "median_of_seeds",
    "resolve_device",
    "score_ensemble",
]
