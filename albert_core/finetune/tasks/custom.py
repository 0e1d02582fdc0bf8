"""CustomData: the fine-tuning loop's adapter for the user's own data (task "custom"; docs/finetuning.md).

Classification with any number of classes, or regression, on single texts or text pairs, over the splits of
`albert_core.finetune.tasks.custom_splits`. Inputs are `[CLS] A [SEP] (B [SEP])` as for GLUE (`encode_pair`).
Regression trains on the targets standardized with train's mean and standard deviation (so any scale trains
alike) and predicts in the targets' own units. Prediction files are CSV, one row per example of the split:
the id column (or "index", the row's index in its file), the label column with the predicted class name or value,
the gold label where the split has one (gold_<label column>), and each class's probability (p_<class>).
"""

from __future__ import annotations

import csv
import functools
import io
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from albert_core.evaluation.metrics import classification_metrics, regression_metrics
from albert_core.files import atomic_write_text
from albert_core.finetune.config import FinetuneConfig, TaskHyperparams
from albert_core.finetune.tasks.batching import by_length, text_batch, to_device
from albert_core.finetune.tasks.custom_splits import CustomExample, CustomSplits, load_custom_splits
from albert_core.finetune.tasks.glue import encode_pair
from albert_core.finetune.tasks.outputs import TaskOutputs
from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import AlbertForSequenceClassification
from albert_core.text.tokenization import Tokenizer

CLASSIFICATION_METRIC = "acc"  # the primary dev metric: best-on-dev weights and early stopping follow it
REGRESSION_METRIC = "pearson"


class CustomData:
    """The user's classification or regression task: one label (class id or number) per text or text pair."""

    def __init__(self, config: FinetuneConfig, tokenizer: Tokenizer, h: TaskHyperparams):
        if config.custom is None:
            raise ValueError("CustomData: FinetuneConfig.custom is not set")
        self.task = config.task
        self.tokenizer = tokenizer
        self.max_seq_length = h.max_seq_length
        self.splits: CustomSplits = load_custom_splits(config.custom)
        self.labels = self.splits.labels
        self.is_regression = self.labels is None
        self.metric = REGRESSION_METRIC if self.is_regression else CLASSIFICATION_METRIC
        self.dev_splits = ["dev"]
        self.test_splits = [] if self.splits.test is None else ["test"]
        self._encoded: dict[str, list[tuple[list[int], list[int]]]] = {}
        targets = np.array([e.label for e in self.splits.train], dtype=np.float64) if self.is_regression else None
        self.target_mean = 0.0 if targets is None else float(targets.mean())
        self.target_scale = 1.0 if targets is None else float(targets.std()) or 1.0

    def examples(self, split: str) -> list[CustomExample]:
        examples = {"train": self.splits.train, "dev": self.splits.dev, "test": self.splits.test}.get(split)
        if examples is None:
            raise ValueError(f"custom data has no split {split!r}; it has {['train', 'dev', *self.test_splits]}")
        return examples

    def row_ids(self, split: str) -> list[str]:
        return [e.id for e in self.examples(split)]

    def _rows(self, split: str) -> list[tuple[list[int], list[int]]]:
        if split not in self._encoded:
            self._encoded[split] = [
                encode_pair(self.tokenizer, e.text_a, e.text_b, self.max_seq_length) for e in self.examples(split)
            ]
        return self._encoded[split]

    @functools.cached_property
    def _train_targets(self) -> Tensor:
        labels = [e.label for e in self.splits.train]
        if self.is_regression:
            scaled = (np.asarray(labels, dtype=np.float64) - self.target_mean) / self.target_scale
            return torch.tensor(scaled, dtype=torch.float32)
        return torch.tensor(labels, dtype=torch.long)

    def model(self, config: AlbertConfig) -> nn.Module:
        return AlbertForSequenceClassification(config, num_labels=1 if self.labels is None else len(self.labels))

    @property
    def num_train(self) -> int:
        return len(self.splits.train)

    def train_batch(self, index: np.ndarray) -> dict[str, Tensor]:
        rows = self._rows("train")
        batch = text_batch([rows[i] for i in index], self.tokenizer.pad_id)
        batch["labels"] = self._train_targets[torch.from_numpy(np.asarray(index, dtype=np.int64))]
        return batch

    def predict(self, model: nn.Module, split: str, batch_size: int, device: torch.device) -> TaskOutputs:
        rows = self._rows(split)
        logits = np.zeros((len(rows), 1 if self.labels is None else len(self.labels)), dtype=np.float32)
        for index in by_length([len(ids) for ids, _ in rows], batch_size):
            batch = to_device(text_batch([rows[i] for i in index], self.tokenizer.pad_id), device)
            logits[index] = model(**batch).logits.float().cpu().numpy()
        return TaskOutputs(self.task, split, self.row_ids(split), {"logits": logits})

    def predictions(self, outputs: TaskOutputs) -> np.ndarray:
        """Class ids (argmax) or values in the targets' units."""
        logits = outputs.arrays["logits"]
        if self.is_regression:
            return logits[:, 0].astype(np.float64) * self.target_scale + self.target_mean
        return logits.argmax(axis=1)

    def _metrics(self, outputs: TaskOutputs) -> dict[str, float]:
        labels = [e.label for e in self.examples(outputs.split)]
        if self.is_regression:
            return regression_metrics(self.predictions(outputs), labels)
        return classification_metrics(self.predictions(outputs), labels)

    def score(self, outputs: TaskOutputs) -> dict[str, float]:
        return self._metrics(outputs)

    def available_test_splits(self) -> list[str]:
        return list(self.test_splits)

    def test_metrics(self, outputs: TaskOutputs) -> dict[str, float]:
        """The test split's metrics when the test file has the label column, else none."""
        return self._metrics(outputs) if self.splits.test_labelled else {}

    def write_predictions(self, outputs: TaskOutputs, out_dir: Path) -> Path:
        """predictions_<split>.csv: <id column or "index">, <label column> (the predicted class name, or value),
        gold_<label column> (the split's own label, where its table has the label column), then for classification
        p_<class> for each class (the model's probability, softmax of its logits). Every cell is spreadsheet-safe
        (`spreadsheet_safe`) unless the config says raw_csv (`--raw-csv`)."""
        config = self.splits.config
        path = Path(out_dir) / f"predictions_{outputs.split}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        values = self.predictions(outputs)
        cell = str if config.raw_csv else spreadsheet_safe
        examples = self.examples(outputs.split)
        gold = all(e.label is not None for e in examples)
        probabilities = None if self.labels is None else _softmax(outputs.arrays["logits"])
        header = [config.id_column or "index", config.label_column]
        if gold:
            header.append(f"gold_{config.label_column}")
        if self.labels is not None:
            header += [f"p_{name}" for name in self.labels]
        text = io.StringIO(newline="")
        writer = csv.writer(text)
        writer.writerow([cell(name) for name in header])
        for i, (ident, value) in enumerate(zip(outputs.ids, values, strict=True)):
            row = [ident, self._label_text(value)]
            if gold:
                row.append(self._label_text(examples[i].label))
            if probabilities is not None:
                row += [f"{p:.6f}" for p in probabilities[i]]
            writer.writerow([cell(c) for c in row])
        atomic_write_text(path, text.getvalue())
        return path

    def _label_text(self, value) -> str:
        return f"{value:.6g}" if self.is_regression else self.labels[int(value)]


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_safe(cell: str) -> str:
    """The cell as a spreadsheet opens it as text: one that begins like a formula (= + - @, tab, carriage return)
    and is not a number gets a leading ' (OWASP's advice against CSV injection); a number such as -1 stays one."""
    if not cell.startswith(FORMULA_STARTS):
        return cell
    try:
        float(cell)
    except ValueError:
        return "'" + cell
    return cell
