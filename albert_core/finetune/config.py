"""Fine-tuning configuration: the task names, each task's recipe (the paper's hyperparameters) and FinetuneConfig.

`hyperparams_for(task)` is the recipe of the paper's appendix (Table A.4); `FinetuneConfig` is one run: the task,
its data and checkpoint, the seed, overrides of the recipe, and how the loop
(`albert_core.finetune.finetuning.finetune`) evaluates and writes. Importable without torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from albert_core.finetune.tasks.custom_splits import CustomDataConfig
from albert_core.model.config import POOLINGS, AlbertConfig
from albert_core.text.tokenization import MODEL_FILE

MAX_BATCH_SIZE = 65_536  # examples in one fine-tuning batch (the paper's largest is 128)


@dataclass(frozen=True)
class TaskHyperparams:
    """One task's fine-tuning recipe (the paper's appendix, Table A.4)."""

    lr: float
    batch_size: int
    train_steps: int
    warmup_steps: int
    max_seq_length: int
    classifier_dropout: float = 0.1
    optimizer: str = "adamw"  # adamw | lamb
    weight_decay: float = 0.01
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        for name in ("batch_size", "train_steps", "max_seq_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TaskHyperparams.{name}: expected a positive integer, got {value!r}")
        if self.batch_size > MAX_BATCH_SIZE:
            raise ValueError(f"TaskHyperparams.batch_size: {self.batch_size} is above the limit of {MAX_BATCH_SIZE}")
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps < self.train_steps:
            raise ValueError(
                f"TaskHyperparams.warmup_steps: expected 0 <= warmup_steps < train_steps ({self.train_steps}), "
                f"got {self.warmup_steps!r}"
            )
        if not self.lr > 0:
            raise ValueError(f"TaskHyperparams.lr: expected > 0, got {self.lr!r}")
        if not 0.0 <= self.classifier_dropout < 1.0:
            raise ValueError(f"TaskHyperparams.classifier_dropout: expected [0, 1), got {self.classifier_dropout!r}")
        if self.optimizer not in ("adamw", "lamb"):
            raise ValueError(f"TaskHyperparams.optimizer: expected 'adamw' or 'lamb', got {self.optimizer!r}")
        if not self.grad_clip > 0:
            raise ValueError(f"TaskHyperparams.grad_clip: expected > 0, got {self.grad_clip!r}")


def _hp(lr: float, batch: int, steps: int, warmup: int, max_len: int) -> TaskHyperparams:
    return TaskHyperparams(lr=lr, batch_size=batch, train_steps=steps, warmup_steps=warmup, max_seq_length=max_len)


# LR / batch / steps / warmup / max length, classifier dropout 0.1 (the paper's appendix).
PAPER_HYPERPARAMS: dict[str, TaskHyperparams] = {
    "cola": _hp(1e-5, 16, 5336, 320, 512),
    "stsb": _hp(2e-5, 16, 3598, 214, 512),
    "sst2": _hp(1e-5, 32, 20935, 1256, 512),
    "mnli": _hp(3e-5, 128, 10000, 1000, 512),
    "qnli": _hp(1e-5, 32, 33112, 1986, 512),
    "qqp": _hp(5e-5, 128, 14000, 1000, 512),
    "rte": _hp(3e-5, 32, 800, 200, 512),
    "mrpc": _hp(2e-5, 32, 800, 200, 512),
    "wnli": _hp(2e-5, 16, 2000, 250, 512),
    "squad1": _hp(5e-5, 48, 3649, 365, 384),
    "squad2": _hp(3e-5, 48, 8144, 814, 512),
    "race": _hp(1e-5, 32, 12000, 1000, 512),
}

# Not in the paper: a recipe sized for the 200-sentence polarity task and CPU-sized models (bench/finetune_polarity).
POLARITY_HYPERPARAMS = _hp(1e-4, 16, 150, 15, 64)

# Not in the paper: the user's own data ("custom"). The paper's middle learning rate and warmup fraction at batch 32,
# 1,000 steps and 128 tokens; --max-steps / --lr / --max-seq-length fit it to the data.
CUSTOM_HYPERPARAMS = _hp(3e-5, 32, 1000, 100, 128)

GLUE_FINETUNE_TASKS = ("cola", "stsb", "sst2", "mnli", "qnli", "qqp", "rte", "mrpc", "wnli")
SQUAD_TASKS = {"squad1": "v1.1", "squad2": "v2.0"}
TASKS = (*GLUE_FINETUNE_TASKS, "mnli-m", "mnli-mm", "squad1", "squad2", "race", "polarity", "custom")
_ALIASES = {
    "sst-2": "sst2",
    "sts-b": "stsb",
    "squad": "squad1",
    "squad1.1": "squad1",
    "squad-v1.1": "squad1",
    "squad_v1.1": "squad1",
    "squad11": "squad1",
    "squad2.0": "squad2",
    "squad-v2.0": "squad2",
    "squad_v2.0": "squad2",
    "squad20": "squad2",
}


def canonical_task(name: str) -> str:
    """The canonical name of a fine-tuning task ("SST-2" -> "sst2", "squad-v2.0" -> "squad2")."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in TASKS:
        raise ValueError(f"unknown fine-tuning task {name!r}; expected one of {', '.join(TASKS)}")
    return key


def hyperparams_for(task: str) -> TaskHyperparams:
    """The paper's recipe for `task` (MNLI's for mnli-m / mnli-mm); POLARITY_ / CUSTOM_HYPERPARAMS for those."""
    task = canonical_task(task)
    if task == "polarity":
        return POLARITY_HYPERPARAMS
    if task == "custom":
        return CUSTOM_HYPERPARAMS
    return PAPER_HYPERPARAMS["mnli" if task.startswith("mnli") else task]


@dataclass
class FinetuneConfig:
    task: str
    data_dir: str  # GLUE: the task folder (or its parent); SQuAD: holds train/dev-v1.1.json; RACE: train/dev/test;
    # custom: informational (the files are in `custom`)
    checkpoint: str | None = None  # a model directory (ours or transformers'); None: random init of `model`
    model: AlbertConfig | None = None  # the architecture to initialize randomly when there is no checkpoint
    tokenizer: str | None = None  # spiece.model or a tokenizer directory; None: the one in/above the checkpoint dir
    seed: int = 12345
    overrides: dict[str, Any] = field(default_factory=dict)  # TaskHyperparams fields replacing the recipe's
    max_steps: int | None = None  # a shorter run: train_steps := max_steps, warmup scaled by the same factor
    eval_every: int | None = None  # steps between dev evaluations; None: 10 per run; 0: only at the end
    patience: int | None = None  # stop after this many dev evaluations without a better dev metric
    micro_batch_size: int | None = None  # gradient accumulation: batch_size split into micro batches of this size
    eval_batch_size: int = 64
    dropout: float | None = None  # backbone hidden + attention dropout; None keeps the checkpoint's
    pooling: str | None = None  # what the task head reads: "cls" | "mean" (AlbertConfig.pooling); None: the model's
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "fp32"  # fp32 | bf16 (autocast)
    output_dir: str | None = None  # metrics.jsonl, result.json, predictions, dev outputs (None: write nothing)
    save_model: bool = False  # also write the best-on-dev model (+ tokenizer) to output_dir/model
    progress: bool = False  # a tqdm bar over the training steps
    # SQuAD
    doc_stride: int = 128
    max_query_length: int = 64
    max_answer_length: int = 30
    n_best: int = 20
    # RACE
    max_qa_length: int = 128
    # custom: the user's files and columns
    custom: CustomDataConfig | None = None

    def __post_init__(self) -> None:
        self.task = canonical_task(self.task)
        known = {f.name for f in dataclasses.fields(TaskHyperparams)}
        unknown = sorted(set(self.overrides) - known)
        if unknown:
            raise ValueError(
                f"FinetuneConfig.overrides: unknown hyperparameter {unknown[0]!r} (known: {', '.join(sorted(known))})"
            )
        if (self.task == "custom") != (self.custom is not None):
            raise ValueError(
                "FinetuneConfig: task 'custom' needs custom (a CustomDataConfig: files and columns), "
                f"and only it takes one (task {self.task!r}, custom {'set' if self.custom else 'not set'})"
            )
        if self.checkpoint is None and self.model is None:
            raise ValueError("FinetuneConfig: set checkpoint (a pretrained model directory) or model (random init)")
        for name in ("max_steps", "eval_every", "patience", "micro_batch_size"):
            value = getattr(self, name)
            low = 0 if name == "eval_every" else 1
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ValueError(f"FinetuneConfig.{name}: expected None or an integer >= {low}, got {value!r}")
        if not isinstance(self.eval_batch_size, int) or self.eval_batch_size < 1:
            raise ValueError(
                f"FinetuneConfig.eval_batch_size: expected a positive integer, got {self.eval_batch_size!r}"
            )
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"FinetuneConfig.dropout: expected None or a probability in [0, 1), got {self.dropout!r}")
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise ValueError(
                f"FinetuneConfig.pooling: expected None or one of {', '.join(POOLINGS)}, got {self.pooling!r}"
            )
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"FinetuneConfig.precision: expected 'fp32' or 'bf16', got {self.precision!r}")
        self.hyperparams()  # validate the combination now, not after the data is read

    def hyperparams(self) -> TaskHyperparams:
        """The task's recipe with `overrides` applied, then shortened to `max_steps` (warmup scaled alike)."""
        h = dataclasses.replace(hyperparams_for(self.task), **self.overrides)
        if self.max_steps is not None:
            warmup = min(round(h.warmup_steps * self.max_steps / h.train_steps), self.max_steps - 1)
            h = dataclasses.replace(h, train_steps=self.max_steps, warmup_steps=warmup)
        return h

    def tokenizer_path(self) -> Path:
        """`tokenizer`, else the spiece.model (or WordPiece vocabulary) in or above the checkpoint directory (the
        search `albert convert` shares); refused in one line naming both when its vocabulary is not the
        checkpoint's."""
        from albert_core.text.vocabulary import check_tokenizer_fits, find_tokenizer, tokenizer_candidates

        candidates = tokenizer_candidates(self.checkpoint) if self.checkpoint is not None else []
        found = find_tokenizer(self.checkpoint) if self.checkpoint is not None else None
        found = Path(self.tokenizer) if self.tokenizer is not None else found
        if found is not None:
            if self.checkpoint is not None:
                check_tokenizer_fits(self.checkpoint, found)  # milliseconds: config.json and the tokenizer files
            return found
        tried = [str(path) for path in candidates]
        raise FileNotFoundError(
            f"FinetuneConfig.tokenizer: not set, and no {MODEL_FILE} or WordPiece vocab.txt / tokenizer.json beside "
            f"the checkpoint (tried {tried}); pass the tokenizer the checkpoint was pretrained with"
        )
