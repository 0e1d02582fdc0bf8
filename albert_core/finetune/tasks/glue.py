"""GLUE: the task table, readers for the official distribution folders, the submission writer, and GlueData (the
fine-tuning loop's adapter for the GLUE tasks and for polarity, Pang & Lee sentences in SST-2's form).

Files are read as the official GLUE download lays them out (download_glue_data.py): tab-separated, UTF-8, no
quoting (a `"` is an ordinary character), one record per "\\n"-terminated line. Text and label columns are found by
their header names; CoLA's train/dev files have no header and the fixed columns source / label /
original-label / sentence. Every row must have as many columns as the header. Test files carry no labels.

Label ids follow the order of each task's `labels` (the original BERT/ALBERT processors' order);
STS-B is a regression task with float labels.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from albert_core.evaluation.metrics import GLUE_TASK_METRICS, canonical_glue_task, glue_metrics
from albert_core.files import atomic_write_text
from albert_core.finetune.config import TaskHyperparams
from albert_core.finetune.tasks import DataFormatError
from albert_core.finetune.tasks.batching import by_length, text_batch, to_device
from albert_core.finetune.tasks.outputs import TaskOutputs
from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import AlbertForSequenceClassification
from albert_core.text.tokenization import Tokenizer


@dataclass(frozen=True)
class GlueExample:
    guid: str  # "<split>-<row>" for labelled files; the file's own index/id for test files
    text_a: str
    text_b: str | None
    label: int | float | None  # label id, STS-B score, or None in test files


@dataclass(frozen=True)
class GlueTask:
    name: str  # canonical name, as metrics.glue_metrics takes it
    folder: str  # folder of the official download
    submission_file: str  # file name the GLUE server expects in the submission zip
    labels: tuple[str, ...] | None  # None: regression
    text_a: str  # header name of the first text column
    text_b: str | None  # header name of the second text column
    label_column: str | None  # header name of the label column (None: test-only task)
    test_index_column: str  # header name of the test file's row id
    splits: dict[str, str] = field(default_factory=lambda: {"train": "train.tsv", "dev": "dev.tsv", "test": "test.tsv"})
    headerless_columns: tuple[str, ...] | None = None  # labelled files without a header (CoLA)

    @property
    def metric(self) -> str:
        return GLUE_TASK_METRICS[self.name]

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)


_BINARY = ("0", "1")
_NLI3 = ("contradiction", "entailment", "neutral")
_NLI2 = ("entailment", "not_entailment")
_COLA = ("source", "label", "original_label", "sentence")  # CoLA train/dev: no header
_MNLI_M = {"train": "train.tsv", "dev": "dev_matched.tsv", "test": "test_matched.tsv"}
_MNLI_MM = {"train": "train.tsv", "dev": "dev_mismatched.tsv", "test": "test_mismatched.tsv"}
_MNLI_ALL = {
    "train": "train.tsv",
    "dev_matched": "dev_matched.tsv",
    "dev_mismatched": "dev_mismatched.tsv",
    "test_matched": "test_matched.tsv",
    "test_mismatched": "test_mismatched.tsv",
}


def _mnli(name: str, submission: str, splits: dict[str, str]) -> GlueTask:
    return GlueTask(name, "MNLI", submission, _NLI3, "sentence1", "sentence2", "gold_label", "index", splits)


GLUE_TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in (
        # name, folder, submission file, labels, text_a, text_b, label column, test index column
        GlueTask("cola", "CoLA", "CoLA.tsv", _BINARY, "sentence", None, "label", "index", headerless_columns=_COLA),
        GlueTask("sst2", "SST-2", "SST-2.tsv", _BINARY, "sentence", None, "label", "index"),
        GlueTask("mrpc", "MRPC", "MRPC.tsv", _BINARY, "#1 String", "#2 String", "Quality", "index"),
        GlueTask("stsb", "STS-B", "STS-B.tsv", None, "sentence1", "sentence2", "score", "index"),
        GlueTask("qqp", "QQP", "QQP.tsv", _BINARY, "question1", "question2", "is_duplicate", "id"),
        _mnli("mnli", "MNLI-m.tsv", _MNLI_ALL),
        _mnli("mnli-m", "MNLI-m.tsv", _MNLI_M),
        _mnli("mnli-mm", "MNLI-mm.tsv", _MNLI_MM),
        GlueTask("qnli", "QNLI", "QNLI.tsv", _NLI2, "question", "sentence", "label", "index"),
        GlueTask("rte", "RTE", "RTE.tsv", _NLI2, "sentence1", "sentence2", "label", "index"),
        GlueTask("wnli", "WNLI", "WNLI.tsv", _BINARY, "sentence1", "sentence2", "label", "index"),
        # The diagnostic set: MNLI labels, test only, scored with MCC.
        GlueTask(
            "ax", "diagnostic", "AX.tsv", _NLI3, "sentence1", "sentence2", None, "index", {"test": "diagnostic.tsv"}
        ),
    )
}


def glue_task(name: str) -> GlueTask:
    return GLUE_TASKS[canonical_glue_task(name)]


def _tsv_rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(1-based line number, tab-separated fields) for each line; splits on "\\n" only, drops a trailing "\\r"."""
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            raw = raw.rstrip(b"\n").rstrip(b"\r")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataFormatError(path, f"line {line_number}", f"not valid UTF-8 ({e.reason})") from None
            if line_number == 1:
                line = line.removeprefix("\ufeff")
            yield line_number, line.split("\t")


def _column(path: Path, header: Sequence[str], name: str) -> int:
    try:
        return list(header).index(name)
    except ValueError:
        raise DataFormatError(
            path, "line 1", f"expected a header with a {name!r} column, found {list(header)!r}"
        ) from None


def _resolve_file(task: GlueTask, data_dir: Path, split: str) -> Path:
    if split not in task.splits:
        raise ValueError(f"GLUE task {task.name!r} has no split {split!r}; expected one of {sorted(task.splits)}")
    file_name = task.splits[split]
    candidates = [data_dir / file_name, data_dir / task.folder / file_name]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"GLUE {task.name} {split}: none of {[str(c) for c in candidates]} exists "
        f"(data_dir is the task folder of the official download, or the folder holding {task.folder}/)"
    )


def _parse_label(task: GlueTask, path: Path, line_number: int, value: str) -> int | float:
    if task.labels is None:
        try:
            score = float(value)
        except ValueError:
            score = math.nan
        if not math.isfinite(score):
            raise DataFormatError(
                path, f"line {line_number}", f"expected a numeric {task.label_column}, found {value!r}"
            )
        return score
    if value not in task.labels:
        raise DataFormatError(
            path, f"line {line_number}", f"expected a {task.label_column} in {list(task.labels)}, found {value!r}"
        )
    return task.labels.index(value)


def read_glue(task: str, data_dir: str | Path, split: str) -> list[GlueExample]:
    """Examples of `split` ("train", "dev", "test"; MNLI also "dev_matched", ... ) of a GLUE task.

    `data_dir` is the task folder of the official download (e.g. glue_data/RTE) or the folder holding it.
    """
    spec = glue_task(task)
    path = _resolve_file(spec, Path(data_dir), split)
    labelled = not split.startswith("test")
    rows = _tsv_rows(path)
    if labelled and spec.headerless_columns is not None:
        header = list(spec.headerless_columns)
    else:
        first = next(rows, None)
        if first is None:
            raise DataFormatError(path, "line 1", "expected a header line, found an empty file")
        header = first[1]
    a = _column(path, header, spec.text_a)
    b = None if spec.text_b is None else _column(path, header, spec.text_b)
    y = _column(path, header, spec.label_column) if labelled else None
    guid_column = None if labelled else _column(path, header, spec.test_index_column)

    examples = []
    for line_number, fields in rows:
        if len(fields) != len(header):
            raise DataFormatError(
                path,
                f"line {line_number}",
                f"expected {len(header)} tab-separated columns ({', '.join(header)}), found {len(fields)}",
            )
        examples.append(
            GlueExample(
                guid=f"{split}-{len(examples)}" if guid_column is None else fields[guid_column],
                text_a=fields[a],
                text_b=None if b is None else fields[b],
                label=None if y is None else _parse_label(spec, path, line_number, fields[y]),
            )
        )
    return examples


POLARITY_LABELS = ("neg", "pos")  # ids 0/1, as SST-2's
POLARITY_FILE = "pang_lee_polarity.cor"
POLARITY_HELDOUT = 50  # sentences (25 per label) held out, the same ones for every run
_POLARITY_SPLIT_SEED = 20_191_026


def read_polarity(path: str | Path, encoding: str | None = None) -> list[GlueExample]:
    """Sentences in fastText format, one `__label__neg|__label__pos <text>` per line (gensim's
    pang_lee_polarity.cor, a sample of Pang & Lee's sentence polarity data); labels 0 = neg, 1 = pos.

    `encoding=None` reads UTF-8 when the file decodes as UTF-8, else cp1252 (the encoding of the original
    rt-polarity release, and of gensim's copy). Blank lines are skipped.
    """
    path = Path(path)
    data = path.read_bytes()
    if encoding is None:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = data.decode("cp1252", errors="strict")
    else:
        text = data.decode(encoding)
    examples = []
    for line_number, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        tag, _, sentence = line.partition(" ")
        label = tag.removeprefix("__label__")
        if not tag.startswith("__label__") or label not in POLARITY_LABELS:
            raise DataFormatError(
                path,
                f"line {line_number}",
                f"expected the line to start with __label__neg or __label__pos, found {tag!r}",
            )
        examples.append(GlueExample(f"polarity-{len(examples)}", sentence.strip(), None, POLARITY_LABELS.index(label)))
    return examples


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


def write_glue_predictions(
    task: str, predictions: Sequence[int | float], path: str | Path, *, indices: Sequence[str | int] | None = None
) -> Path:
    """Write a GLUE submission file: header `index\\tprediction`, then one row per test example.

    Classification predictions are label ids, written as label names; STS-B predictions are scores, written with
    three decimals. `indices` default to 0..n-1 (the test files' own index column, in file order).
    """
    spec = glue_task(task)
    if indices is None:
        indices = range(len(predictions))
    if len(indices) != len(predictions):
        raise ValueError(f"indices ({len(indices)}) and predictions ({len(predictions)}) differ in length")
    lines = ["index\tprediction"]
    for i, (index, prediction) in enumerate(zip(indices, predictions, strict=True)):
        if spec.labels is None:
            lines.append(f"{index}\t{float(prediction):.3f}")
            continue
        if isinstance(prediction, bool) or int(prediction) != prediction or not 0 <= prediction < len(spec.labels):
            raise ValueError(
                f"predictions[{i}] = {prediction!r} is not a label id of {spec.name} (0..{len(spec.labels) - 1})"
            )
        lines.append(f"{index}\t{spec.labels[int(prediction)]}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


# --- fine-tuning: sentence-pair inputs and the task adapter --------------------------------------------------


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
        batch = text_batch([self.train_rows[i] for i in index], self.tokenizer.pad_id)
        labels = [self.train_labels[i] for i in index]
        dtype = torch.float32 if self.spec.is_regression else torch.long
        batch["labels"] = torch.tensor(labels, dtype=dtype)
        return batch

    def predict(self, model: nn.Module, split: str, batch_size: int, device: torch.device) -> TaskOutputs:
        examples = self.examples(split)
        rows = self._rows(split)
        logits = np.zeros((len(rows), self.spec.num_labels), dtype=np.float32)
        for index in by_length([len(ids) for ids, _ in rows], batch_size):
            batch = to_device(text_batch([rows[i] for i in index], self.tokenizer.pad_id), device)
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
