"""Fine-tuning on downstream tasks: the paper's hyperparameters, one train loop, and a data pipeline per task family.

Task families (each a small class with the same five methods, see `_TaskData`):
- GLUE-format classification / regression: the nine GLUE tasks and "polarity" (Pang & Lee sentences in SST-2's
  form, with a fixed held-out split). Inputs are `[CLS] A [SEP] B [SEP]`; the longer side is cut one token at a
  time until the pair fits (BERT's _truncate_seq_pair); batches are padded to their longest row.
- SQuAD v1.1 / v2.0: `make_features` windows -> AlbertForQuestionAnswering -> `decode_predictions`. v2.0's null
  odds are the span null odds (null score − best span score) minus the model's answerability logit (the best
  window's); the threshold on them is tuned on dev with `best_null_threshold`, as the paper reports dev numbers.
- RACE: four `[CLS] article [SEP] question+option [SEP]` inputs per question -> AlbertForMultipleChoice.

The loop (`finetune`): AdamW (the optimizer of the original ALBERT fine-tuning scripts; LAMB selectable) over
the usual decay groups, linear warmup then linear decay to 0, global grad-norm clip 1.0, dev evaluation with the
task's official metric every `eval_every` steps, early stopping on it, the best-on-dev weights kept, prediction
files in the submission formats, and a results dict. torch's AdamW bias-corrects; the original's
AdamWeightDecayOptimizer does not (a difference of the first ~1/(1-β2) steps only).

GLUE dev numbers in the paper are the median of 5 runs (`median_of_seeds`); its ensembles average the outputs of
several fine-tuned models (`ensemble` over saved `TaskOutputs`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from albert_core.batch import padded_length
from albert_core.checkpoint import load_weights, read_checkpoint, save_model
from albert_core.config import AlbertConfig
from albert_core.downstream.glue import (
    GlueExample,
    glue_task,
    read_glue,
    read_polarity,
    write_glue_predictions,
)
from albert_core.downstream.race import ANSWER_LETTERS, RaceExample, race_inputs, read_race
from albert_core.downstream.squad import (
    SquadExample,
    SquadFeature,
    decode_predictions,
    make_features,
    read_squad,
    write_squad_predictions,
)
from albert_core.metrics import best_null_threshold, glue_metrics, race_accuracy, squad_scores, squad_v2_scores
from albert_core.model import (
    AlbertForMultipleChoice,
    AlbertForQuestionAnswering,
    AlbertForSequenceClassification,
)
from albert_core.optim import make_optimizer, make_scheduler
from albert_core.tokenization import MODEL_FILE, Tokenizer

# --- hyperparameters ---------------------------------------------------------------------------------------


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
POLARITY_FILE = "pang_lee_polarity.cor"
POLARITY_HELDOUT = 50  # sentences (25 per label) held out, the same ones for every run
_POLARITY_SPLIT_SEED = 20_191_026

GLUE_FINETUNE_TASKS = ("cola", "stsb", "sst2", "mnli", "qnli", "qqp", "rte", "mrpc", "wnli")
SQUAD_TASKS = {"squad1": "v1.1", "squad2": "v2.0"}
TASKS = (*GLUE_FINETUNE_TASKS, "mnli-m", "mnli-mm", "squad1", "squad2", "race", "polarity")
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
    """The paper's recipe for `task` (MNLI's for mnli-m / mnli-mm); POLARITY_HYPERPARAMS for polarity."""
    task = canonical_task(task)
    if task == "polarity":
        return POLARITY_HYPERPARAMS
    return PAPER_HYPERPARAMS["mnli" if task.startswith("mnli") else task]


# --- config ------------------------------------------------------------------------------------------------


@dataclass
class FinetuneConfig:
    task: str
    data_dir: str  # GLUE: the task folder (or its parent); SQuAD: holds train/dev-v1.1.json; RACE: train/dev/test
    checkpoint: str | None = None  # a model directory (ours or transformers'); None: random init of `model`
    model: AlbertConfig | None = None  # the architecture to initialize randomly when there is no checkpoint
    tokenizer: str | None = None  # spiece.model or its directory; None: the one in/above the checkpoint directory
    seed: int = 12345
    overrides: dict[str, Any] = field(default_factory=dict)  # TaskHyperparams fields replacing the recipe's
    max_steps: int | None = None  # a shorter run: train_steps := max_steps, warmup scaled by the same factor
    eval_every: int | None = None  # steps between dev evaluations; None: 10 per run; 0: only at the end
    patience: int | None = None  # stop after this many dev evaluations without a better dev metric
    micro_batch_size: int | None = None  # gradient accumulation: batch_size split into micro batches of this size
    eval_batch_size: int = 64
    dropout: float | None = None  # backbone hidden + attention dropout; None keeps the checkpoint's
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

    def __post_init__(self) -> None:
        self.task = canonical_task(self.task)
        known = {f.name for f in dataclasses.fields(TaskHyperparams)}
        unknown = sorted(set(self.overrides) - known)
        if unknown:
            raise ValueError(
                f"FinetuneConfig.overrides: unknown hyperparameter {unknown[0]!r} (known: {', '.join(sorted(known))})"
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
        if self.tokenizer is not None:
            return Path(self.tokenizer)
        tried = []
        if self.checkpoint is not None:
            directory = Path(self.checkpoint)
            for candidate in (directory, directory.parent, directory.parent.parent):
                tried.append(str(candidate / MODEL_FILE))
                if (candidate / MODEL_FILE).is_file():
                    return candidate / MODEL_FILE
        raise FileNotFoundError(
            f"FinetuneConfig.tokenizer: not set, and no {MODEL_FILE} beside the checkpoint (tried {tried}); "
            "pass the SentencePiece model the checkpoint was pretrained with"
        )


# --- outputs ----------------------------------------------------------------------------------------------


@dataclass
class TaskOutputs:
    """A model's raw outputs on one split: rows named by `ids` (example / window ids), float arrays by name.

    GLUE: "logits" (N, labels); SQuAD: "start_logits", "end_logits" (N windows, T), "answerable_logits" (N,);
    RACE: "logits" (N, 4). Saved as .npz so runs in other processes can be ensembled.
    """

    task: str
    split: str
    ids: list[str]
    arrays: dict[str, np.ndarray]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"__task__": np.array(self.task), "__split__": np.array(self.split), "__ids__": np.array(self.ids)}
        with open(path, "wb") as f:
            np.savez(f, **meta, **self.arrays)
        return path

    @classmethod
    def load(cls, path: str | Path) -> TaskOutputs:
        with np.load(path, allow_pickle=False) as data:
            missing = [k for k in ("__task__", "__split__", "__ids__") if k not in data.files]
            if missing:
                raise ValueError(f"{path}: not a TaskOutputs file (no {missing[0]})")
            arrays = {k: data[k] for k in data.files if not k.startswith("__")}
            return cls(str(data["__task__"]), str(data["__split__"]), [str(i) for i in data["__ids__"]], arrays)


def ensemble(outputs: Sequence[TaskOutputs]) -> TaskOutputs:
    """The element-wise mean of several models' outputs on the same rows (logits / scores averaged)."""
    if not outputs:
        raise ValueError("ensemble: no outputs to average")
    first = outputs[0]
    for i, other in enumerate(outputs[1:], start=1):
        if (other.task, other.split) != (first.task, first.split):
            raise ValueError(
                f"ensemble: outputs[{i}] is {other.task}/{other.split}, outputs[0] is {first.task}/{first.split}"
            )
        if other.ids != first.ids:
            raise ValueError(f"ensemble: outputs[{i}] has different rows (ids) than outputs[0]")
        if set(other.arrays) != set(first.arrays):
            raise ValueError(
                f"ensemble: outputs[{i}] has arrays {sorted(other.arrays)}, expected {sorted(first.arrays)}"
            )
        for name, array in other.arrays.items():
            if array.shape != first.arrays[name].shape:
                raise ValueError(
                    f"ensemble: outputs[{i}].{name} has shape {array.shape}, expected {first.arrays[name].shape}"
                )
    arrays = {
        name: np.mean([o.arrays[name].astype(np.float64) for o in outputs], axis=0).astype(np.float32)
        for name in first.arrays
    }
    return TaskOutputs(first.task, first.split, list(first.ids), arrays)


# --- shared batch helpers ---------------------------------------------------------------------------------


def _pad(rows: Sequence[Sequence[int]], width: int, value: int) -> Tensor:
    out = np.full((len(rows), width), value, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out)


def _text_batch(rows: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, Tensor]:
    """input_ids / token_type_ids / attention_mask for (ids, types) rows, padded to the longest (rounded to 8)."""
    width = padded_length(max(len(ids) for ids, _ in rows))
    return {
        "input_ids": _pad([ids for ids, _ in rows], width, pad_id),
        "token_type_ids": _pad([types for _, types in rows], width, 0),
        "attention_mask": _pad([[1] * len(ids) for ids, _ in rows], width, 0),
    }


def _by_length(lengths: Sequence[int], batch_size: int) -> Iterator[np.ndarray]:
    """Index batches in decreasing length (little padding at prediction time)."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def truncate_pair(a: list[int], b: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
    """Cut the longer side (b on ties) by one token from its end until len(a) + len(b) <= max_tokens."""
    la, lb = len(a), len(b)
    while la + lb > max_tokens:
        if la > lb:
            la -= 1
        else:
            lb -= 1
    return a[:la], b[:lb]


def encode_pair(
    tokenizer: Tokenizer, text_a: str, text_b: str | None, max_seq_length: int
) -> tuple[list[int], list[int]]:
    """([CLS] A [SEP] (B [SEP]), token types 0 for [CLS] A [SEP] and 1 for B [SEP]), at most max_seq_length long."""
    a = tokenizer.encode(text_a)
    if text_b is None:
        a = a[: max_seq_length - 2]
        ids = [tokenizer.cls_id, *a, tokenizer.sep_id]
        return ids, [0] * len(ids)
    a, b = truncate_pair(a, tokenizer.encode(text_b), max_seq_length - 3)
    ids = [tokenizer.cls_id, *a, tokenizer.sep_id, *b, tokenizer.sep_id]
    return ids, [0] * (len(a) + 2) + [1] * (len(b) + 1)


def _to(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# --- GLUE-format classification / regression ---------------------------------------------------------------


def polarity_split(examples: Sequence[GlueExample], heldout: int = POLARITY_HELDOUT) -> tuple[list, list]:
    """(train, held-out): heldout/2 sentences of each label, drawn with a fixed seed, the rest for training."""
    rng = np.random.default_rng(_POLARITY_SPLIT_SEED)
    held: set[int] = set()
    for label in (0, 1):
        members = [i for i, e in enumerate(examples) if e.label == label]
        if len(members) <= heldout // 2:
            raise ValueError(f"polarity: {len(members)} sentences of label {label}, need more than {heldout // 2}")
        held.update(int(i) for i in rng.choice(members, size=heldout // 2, replace=False))
    train = [e for i, e in enumerate(examples) if i not in held]
    return train, [e for i, e in enumerate(examples) if i in held]


def _polarity_file(data_dir: Path) -> Path:
    path = data_dir / POLARITY_FILE if data_dir.is_dir() else data_dir
    if not path.is_file():
        raise FileNotFoundError(f"polarity: {path} not found (data_dir is {POLARITY_FILE} or the folder holding it)")
    return path


class GlueData:
    """GLUE tasks and polarity: sentence(-pair) inputs, one label (id or score) per example."""

    def __init__(self, task: str, data_dir: str | Path, tokenizer: Tokenizer, h: TaskHyperparams):
        self.task = task
        self.data_dir = Path(data_dir)
        self.tokenizer = tokenizer
        self.max_seq_length = h.max_seq_length
        self.spec = glue_task("sst2" if task == "polarity" else task)
        self.metric = self.spec.metric
        self._examples: dict[str, list[GlueExample]] = {}
        self._encoded: dict[str, list[tuple[list[int], list[int]]]] = {}
        if task == "polarity":
            train, dev = polarity_split(read_polarity(_polarity_file(self.data_dir)))
            self._examples = {"train": train, "dev": dev}
            self.dev_splits = ["dev"]
            self.test_splits: list[str] = []
        else:
            self.dev_splits = [s for s in self.spec.splits if s.startswith("dev")]
            self.test_splits = [s for s in self.spec.splits if s.startswith("test")]

    @functools.cached_property
    def train_rows(self) -> list[tuple[list[int], list[int]]]:
        return self._rows("train")

    @functools.cached_property
    def train_labels(self) -> list[int | float]:
        return [e.label for e in self.examples("train")]

    def row_ids(self, split: str) -> list[str]:
        return [e.guid for e in self.examples(split)]

    def examples(self, split: str) -> list[GlueExample]:
        if split not in self._examples:
            self._examples[split] = read_glue(self.task, self.data_dir, split)
        return self._examples[split]

    def _rows(self, split: str) -> list[tuple[list[int], list[int]]]:
        """Encoded once per split (dev is predicted at every evaluation)."""
        if split not in self._encoded:
            examples = self.examples(split)
            self._encoded[split] = [
                encode_pair(self.tokenizer, e.text_a, e.text_b, self.max_seq_length) for e in examples
            ]
        return self._encoded[split]

    def model(self, config: AlbertConfig) -> nn.Module:
        return AlbertForSequenceClassification(config, num_labels=self.spec.num_labels)

    @property
    def num_train(self) -> int:
        return len(self.train_rows)

    def train_batch(self, index: np.ndarray) -> dict[str, Tensor]:
        batch = _text_batch([self.train_rows[i] for i in index], self.tokenizer.pad_id)
        labels = [self.train_labels[i] for i in index]
        dtype = torch.float32 if self.spec.is_regression else torch.long
        batch["labels"] = torch.tensor(labels, dtype=dtype)
        return batch

    def predict(self, model: nn.Module, split: str, batch_size: int, device: torch.device) -> TaskOutputs:
        examples = self.examples(split)
        rows = self._rows(split)
        logits = np.zeros((len(rows), self.spec.num_labels), dtype=np.float32)
        for index in _by_length([len(ids) for ids, _ in rows], batch_size):
            batch = _to(_text_batch([rows[i] for i in index], self.tokenizer.pad_id), device)
            logits[index] = model(**batch).logits.float().cpu().numpy()
        return TaskOutputs(self.task, split, [e.guid for e in examples], {"logits": logits})

    def _predictions(self, outputs: TaskOutputs) -> np.ndarray:
        logits = outputs.arrays["logits"]
        return logits[:, 0] if self.spec.is_regression else logits.argmax(axis=1)

    def score(self, outputs: TaskOutputs) -> dict[str, float]:
        labels = [e.label for e in self.examples(outputs.split)]
        metrics = glue_metrics(self.spec.name, self._predictions(outputs), labels)
        prefix = "" if outputs.split == self.dev_splits[0] else f"{outputs.split}_"
        return {prefix + k: v for k, v in metrics.items()}

    def _submission_file(self, split: str) -> str:
        return "MNLI-mm.tsv" if split == "test_mismatched" else self.spec.submission_file

    def write_predictions(self, outputs: TaskOutputs, out_dir: Path) -> Path:
        """Dev: predictions_<split>.tsv; test: the GLUE server's file (e.g. SST-2.tsv). index<TAB>prediction."""
        name = self._submission_file(outputs.split) if outputs.split.startswith("test") else None
        path = out_dir / (name or f"predictions_{outputs.split}.tsv")
        return write_glue_predictions(self.spec.name, self._predictions(outputs), path, indices=outputs.ids)

    def available_test_splits(self) -> list[str]:
        present = []
        for split in self.test_splits:
            name = self.spec.splits[split]
            if (self.data_dir / name).is_file() or (self.data_dir / self.spec.folder / name).is_file():
                present.append(split)
        return present

    def test_metrics(self, outputs: TaskOutputs) -> dict[str, float]:
        return {}  # GLUE test labels are not public


# --- SQuAD ------------------------------------------------------------------------------------------------


class SquadData:
    """SQuAD v1.1 / v2.0 from the official file names in data_dir: train-v1.1.json + dev-v1.1.json (or -v2.0)."""

    def __init__(self, task: str, data_dir: str | Path, tokenizer: Tokenizer, h: TaskHyperparams, cfg: FinetuneConfig):
        self.task = task
        self.version_2 = task == "squad2"
        self.data_dir = Path(data_dir)
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.max_seq_length = h.max_seq_length
        self.metric = "f1"
        self.dev_splits = ["dev"]
        self._examples: dict[str, list[SquadExample]] = {}
        self._features: dict[str, list[SquadFeature]] = {}

    @functools.cached_property
    def train(self) -> dict[str, Tensor]:
        features = self.features("train")
        if not features:
            raise ValueError(f"{self.path('train')}: no training features (every answer was off its answer_start)")
        train = {
            "input_ids": torch.tensor([f.input_ids for f in features]),
            "token_type_ids": torch.tensor([f.token_type_ids for f in features]),
            "attention_mask": torch.tensor([f.attention_mask for f in features]),
            "start_positions": torch.tensor([f.start_position for f in features]),
            "end_positions": torch.tensor([f.end_position for f in features]),
        }
        if self.version_2:  # a window that does not hold the answer is "impossible" for the answerability head
            train["is_impossible"] = (train["start_positions"] == 0).float()
        return train

    def row_ids(self, split: str) -> list[str]:
        return [f"{f.qid}#{f.window_index}" for f in self.features(split)]

    def path(self, split: str) -> Path:
        path = self.data_dir / f"{split}-{SQUAD_TASKS[self.task]}.json"
        if not path.is_file():
            raise FileNotFoundError(f"SQuAD {SQUAD_TASKS[self.task]} {split}: {path} not found (official file names)")
        return path

    def examples(self, split: str) -> list[SquadExample]:
        if split not in self._examples:
            self._examples[split] = read_squad(self.path(split))
        return self._examples[split]

    def features(self, split: str) -> list[SquadFeature]:
        if split not in self._features:
            self._features[split] = make_features(
                self.examples(split),
                self.tokenizer.encode,
                cls_id=self.tokenizer.cls_id,
                sep_id=self.tokenizer.sep_id,
                pad_id=self.tokenizer.pad_id,
                id_to_piece=self.tokenizer.id_to_piece,
                max_seq_length=self.max_seq_length,
                doc_stride=self.cfg.doc_stride,
                max_query_length=self.cfg.max_query_length,
                is_training=split == "train",
            )
        return self._features[split]

    def model(self, config: AlbertConfig) -> nn.Module:
        return AlbertForQuestionAnswering(config)

    @property
    def num_train(self) -> int:
        return len(self.train["input_ids"])

    def train_batch(self, index: np.ndarray) -> dict[str, Tensor]:
        index_t = torch.as_tensor(index)
        width = padded_length(int(self.train["attention_mask"][index_t].sum(1).max()))
        return {k: v[index_t, :width] if v.dim() == 2 else v[index_t] for k, v in self.train.items()}

    def predict(self, model: nn.Module, split: str, batch_size: int, device: torch.device) -> TaskOutputs:
        features = self.features(split)
        n, T = len(features), self.max_seq_length
        start = np.full((n, T), -1e4, dtype=np.float32)
        end = np.full((n, T), -1e4, dtype=np.float32)
        answerable = np.zeros(n, dtype=np.float32)
        lengths = [sum(f.attention_mask) for f in features]
        for index in _by_length(lengths, batch_size):
            width = padded_length(max(lengths[i] for i in index))
            batch = {
                "input_ids": torch.tensor([features[i].input_ids[:width] for i in index]),
                "token_type_ids": torch.tensor([features[i].token_type_ids[:width] for i in index]),
                "attention_mask": torch.tensor([features[i].attention_mask[:width] for i in index]),
            }
            out = model(**_to(batch, device))
            start[index, :width] = out.start_logits.float().cpu().numpy()
            end[index, :width] = out.end_logits.float().cpu().numpy()
            answerable[index] = out.answerable_logits.float().cpu().numpy()
        arrays = {"start_logits": start, "end_logits": end, "answerable_logits": answerable}
        return TaskOutputs(self.task, split, self.row_ids(split), arrays)

    def decode(self, outputs: TaskOutputs) -> tuple[dict[str, str], dict[str, float], dict[str, float]]:
        """(qid -> answer, qid -> null odds (v2.0; {} for v1.1), metrics)."""
        examples, features = self.examples(outputs.split), self.features(outputs.split)
        a = outputs.arrays
        options = dict(n_best=self.cfg.n_best, max_answer_length=self.cfg.max_answer_length)
        golds = [e.answers for e in examples]
        if not self.version_2:
            answers, _ = decode_predictions(
                examples, features, a["start_logits"], a["end_logits"], version_2=False, **options
            )
            return answers, {}, squad_scores(golds, [answers[e.qid] for e in examples])
        spans, span_odds = decode_predictions(
            examples, features, a["start_logits"], a["end_logits"], version_2=True, null_threshold=math.inf, **options
        )
        most_answerable: dict[str, float] = {}
        for feature, logit in zip(features, a["answerable_logits"].tolist(), strict=True):
            most_answerable[feature.qid] = max(most_answerable.get(feature.qid, -math.inf), logit)
        odds = {e.qid: span_odds[e.qid] - most_answerable[e.qid] for e in examples}
        texts = [spans[e.qid] for e in examples]
        threshold = best_null_threshold(golds, texts, [odds[e.qid] for e in examples])["best_f1_thresh"]
        answers = {e.qid: "" if odds[e.qid] > threshold else spans[e.qid] for e in examples}
        metrics = squad_v2_scores(golds, [answers[e.qid] for e in examples])
        metrics["null_threshold"] = threshold
        return answers, odds, metrics

    def score(self, outputs: TaskOutputs) -> dict[str, float]:
        return self.decode(outputs)[2]

    def write_predictions(self, outputs: TaskOutputs, out_dir: Path) -> Path:
        """predictions_<split>.json ({qid: answer}, the official format); v2.0 also null_odds_<split>.json."""
        answers, odds, _ = self.decode(outputs)
        if self.version_2:
            finite = {q: float(np.clip(v, -1e9, 1e9)) for q, v in odds.items()}
            write_squad_predictions(finite, out_dir / f"null_odds_{outputs.split}.json")
        return write_squad_predictions(answers, out_dir / f"predictions_{outputs.split}.json")

    def available_test_splits(self) -> list[str]:
        return []  # SQuAD's test set is not public: the dev predictions file is the submission format

    def test_metrics(self, outputs: TaskOutputs) -> dict[str, float]:
        return {}


# --- RACE -------------------------------------------------------------------------------------------------


class RaceData:
    """RACE: four choices per question, accuracy on middle / high / all."""

    def __init__(self, task: str, data_dir: str | Path, tokenizer: Tokenizer, h: TaskHyperparams, cfg: FinetuneConfig):
        self.task = task
        self.data_dir = Path(data_dir)
        self.tokenizer = tokenizer
        self.max_seq_length = h.max_seq_length
        self.max_qa_length = cfg.max_qa_length
        if not 0 < cfg.max_qa_length <= h.max_seq_length - 3:
            raise ValueError(
                f"FinetuneConfig.max_qa_length: {cfg.max_qa_length} leaves no room for the article in "
                f"max_seq_length {h.max_seq_length}; expected 1..{h.max_seq_length - 3}"
            )
        self.metric = "acc"
        self.dev_splits = ["dev"]
        self._examples: dict[str, list[RaceExample]] = {}
        self._encoded: dict[str, list[list[tuple[list[int], list[int]]]]] = {}

    @functools.cached_property
    def train_rows(self) -> list[list[tuple[list[int], list[int]]]]:
        return self._rows("train")

    @functools.cached_property
    def train_labels(self) -> list[int]:
        return [e.label for e in self.examples("train")]

    def row_ids(self, split: str) -> list[str]:
        return [e.example_id for e in self.examples(split)]

    def examples(self, split: str) -> list[RaceExample]:
        if split not in self._examples:
            self._examples[split] = read_race(self.data_dir, split)
        return self._examples[split]

    def _rows(self, split: str) -> list[list[tuple[list[int], list[int]]]]:
        """Encoded once per split (dev is predicted at every evaluation)."""
        if split in self._encoded:
            return self._encoded[split]
        t = self.tokenizer
        self._encoded[split] = [
            race_inputs(
                e,
                t.encode,
                cls_id=t.cls_id,
                sep_id=t.sep_id,
                max_seq_length=self.max_seq_length,
                max_qa_length=self.max_qa_length,
            )
            for e in self.examples(split)
        ]
        return self._encoded[split]

    def model(self, config: AlbertConfig) -> nn.Module:
        return AlbertForMultipleChoice(config)

    @property
    def num_train(self) -> int:
        return len(self.train_rows)

    def _batch(self, rows: Sequence[list[tuple[list[int], list[int]]]]) -> dict[str, Tensor]:
        flat = _text_batch([choice for row in rows for choice in row], self.tokenizer.pad_id)
        return {k: v.view(len(rows), len(ANSWER_LETTERS), -1) for k, v in flat.items()}

    def train_batch(self, index: np.ndarray) -> dict[str, Tensor]:
        batch = self._batch([self.train_rows[i] for i in index])
        batch["labels"] = torch.tensor([self.train_labels[i] for i in index])
        return batch

    def predict(self, model: nn.Module, split: str, batch_size: int, device: torch.device) -> TaskOutputs:
        rows = self._rows(split)
        logits = np.zeros((len(rows), len(ANSWER_LETTERS)), dtype=np.float32)
        # batch_size counts sequences: a question is four of them
        for index in _by_length([max(len(ids) for ids, _ in row) for row in rows], max(1, batch_size // 4)):
            batch = _to(self._batch([rows[i] for i in index]), device)
            logits[index] = model(**batch).logits.float().cpu().numpy()
        return TaskOutputs(self.task, split, [e.example_id for e in self.examples(split)], {"logits": logits})

    def score(self, outputs: TaskOutputs) -> dict[str, float]:
        examples = self.examples(outputs.split)
        by_level = race_accuracy(
            outputs.arrays["logits"].argmax(axis=1), [e.label for e in examples], [e.level for e in examples]
        )
        return {"acc": by_level["all"], "acc_middle": by_level["middle"], "acc_high": by_level["high"]}

    def write_predictions(self, outputs: TaskOutputs, out_dir: Path) -> Path:
        """predictions_<split>.json: {example id: answer letter}."""
        letters = [ANSWER_LETTERS[i] for i in outputs.arrays["logits"].argmax(axis=1).tolist()]
        path = out_dir / f"predictions_{outputs.split}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dict(zip(outputs.ids, letters, strict=True)), indent=2) + "\n")
        return path

    def available_test_splits(self) -> list[str]:
        root = self.data_dir if (self.data_dir / "test").is_dir() else self.data_dir / "RACE"
        return ["test"] if (root / "test").is_dir() else []

    def test_metrics(self, outputs: TaskOutputs) -> dict[str, float]:
        return self.score(outputs)  # RACE's test answers are public


TaskData = GlueData | SquadData | RaceData


def load_task_data(config: FinetuneConfig, tokenizer: Tokenizer, h: TaskHyperparams | None = None) -> TaskData:
    """Read and encode the training data of config.task (dev and test are read when first needed)."""
    h = h or config.hyperparams()
    if config.task in SQUAD_TASKS:
        return SquadData(config.task, config.data_dir, tokenizer, h, config)
    if config.task == "race":
        return RaceData(config.task, config.data_dir, tokenizer, h, config)
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
        while len(self.pending) < self.batch_size:
            self.pending = np.concatenate([self.pending, self.rng.permutation(self.n)])
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


def finetune(config: FinetuneConfig) -> dict[str, Any]:
    """Fine-tune, evaluate on dev as configured, keep the best-on-dev weights, write predictions; return the results.

    Result: task, seed, metric (the task's primary dev metric), dev (all dev metrics at the best evaluation),
    best_step, steps (steps run), stopped_early, history (one record per evaluation), test (metrics where test
    labels are public: RACE), files (what was written), hyperparams, checkpoint, seconds.
    """
    started = time.time()
    h = config.hyperparams()
    device = resolve_device(config.device)
    tokenizer = Tokenizer.load(config.tokenizer_path())
    data = load_task_data(config, tokenizer, h)
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    model = build_model(config, data, h, tokenizer.vocab_size).to(device)
    optimizer = make_optimizer(model, name=h.optimizer, lr=h.lr, weight_decay=h.weight_decay)
    scheduler = make_scheduler(optimizer, warmup_steps=h.warmup_steps, total_steps=h.train_steps)
    batches = _Batches(data.num_train, h.batch_size, rng)
    micro = config.micro_batch_size or h.batch_size
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16")
    out_dir = Path(config.output_dir) if config.output_dir is not None else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "metrics.jsonl").write_text("")

    def predict(split: str) -> TaskOutputs:
        model.eval()
        with torch.inference_mode(), autocast:
            return data.predict(model, split, config.eval_batch_size, device)

    history: list[dict[str, Any]] = []
    best_value: float | None = None
    best: dict[str, Any] = {}
    evals_since_best = 0
    stopped_early = False
    losses: list[float] = []
    schedule = eval_steps(h.train_steps, config.eval_every)
    progress = _progress(h.train_steps, config.progress, config.task)
    step = 0
    for step in range(1, h.train_steps + 1):
        model.train()
        index = batches.next()
        loss_value = 0.0
        for start in range(0, len(index), micro):
            chunk = index[start : start + micro]
            with autocast:
                loss = model(**_to(data.train_batch(chunk), device)).loss * (len(chunk) / len(index))
            loss.backward()
            loss_value += float(loss.detach())
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"fine-tuning {config.task}: loss is {loss_value} at step {step}")
        torch.nn.utils.clip_grad_norm_(model.parameters(), h.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_value)
        progress.update(1)
        progress.set_postfix(loss=f"{loss_value:.4f}")
        if step not in schedule:
            continue
        outputs = {split: predict(split) for split in data.dev_splits}
        metrics: dict[str, float] = {}
        for split_outputs in outputs.values():
            metrics.update(data.score(split_outputs))
        record = {
            "step": step,
            "time": time.time(),
            "train_loss": float(np.mean(losses)),
            "lr": scheduler.get_last_lr()[0],
            **metrics,
        }
        losses = []
        history.append(record)
        if out_dir is not None:
            with open(out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(json_safe(record)) + "\n")
        value = metrics[data.metric]
        if _better(value, best_value):
            best_value = value if math.isfinite(value) else -math.inf
            state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            best = {"step": step, "metrics": metrics, "outputs": outputs, "state": state}
            evals_since_best = 0
        else:
            evals_since_best += 1
            if config.patience is not None and evals_since_best >= config.patience:
                stopped_early = True
                break
    progress.close()

    model.load_state_dict(best["state"])
    files: dict[str, str] = {}
    test: dict[str, float] = {}
    test_outputs = {split: predict(split) for split in data.available_test_splits()}
    for split_outputs in test_outputs.values():
        test.update(data.test_metrics(split_outputs))
    if out_dir is not None:
        for split, split_outputs in {**best["outputs"], **test_outputs}.items():
            files[f"predictions_{split}"] = str(data.write_predictions(split_outputs, out_dir))
            files[f"outputs_{split}"] = str(split_outputs.save(out_dir / f"outputs_{split}.npz"))
        if config.save_model:
            files["model"] = str(save_model(out_dir / "model", model))
            tokenizer.save(out_dir / "model")
    result = {
        "task": config.task,
        "seed": config.seed,
        "metric": data.metric,
        "dev": best["metrics"],
        "best_step": best["step"],
        "steps": step,
        "stopped_early": stopped_early,
        "history": history,
        "test": test,
        "files": files,
        "hyperparams": dataclasses.asdict(h),
        "checkpoint": config.checkpoint,
        "started": started,
        "seconds": time.time() - started,
    }
    if out_dir is not None:
        (out_dir / "result.json").write_text(json.dumps(json_safe(result), indent=2) + "\n")
    return result


class _NoProgress:
    def update(self, n: int) -> None:
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


def score_outputs(config: FinetuneConfig, outputs: TaskOutputs) -> dict[str, float]:
    """The official metrics of saved outputs (e.g. an `ensemble`) on config.task's data (no model involved)."""
    tokenizer = Tokenizer.load(config.tokenizer_path())
    data = load_task_data(config, tokenizer)
    if outputs.task != config.task:
        raise ValueError(f"score_outputs: outputs are of task {outputs.task!r}, the config's task is {config.task!r}")
    if outputs.ids != data.row_ids(outputs.split):
        raise ValueError(
            f"score_outputs: the outputs' {len(outputs.ids)} rows are not the {outputs.split} rows of {config.data_dir}"
        )
    if outputs.split.startswith("test"):
        return data.test_metrics(outputs)
    return data.score(outputs)


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
    data = load_task_data(config, Tokenizer.load(config.tokenizer_path()))
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
    "GLUE_FINETUNE_TASKS",
    "PAPER_HYPERPARAMS",
    "POLARITY_HYPERPARAMS",
    "TASKS",
    "FinetuneConfig",
    "GlueData",
    "RaceData",
    "SquadData",
    "TaskHyperparams",
    "TaskOutputs",
    "build_model",
    "canonical_task",
    "encode_pair",
    "ensemble",
    "eval_steps",
    "finetune",
    "hyperparams_for",
    "json_safe",
    "load_task_data",
    "markdown_table",
    "median_of_seeds",
    "polarity_split",
    "score_ensemble",
    "score_outputs",
    "truncate_pair",
]
