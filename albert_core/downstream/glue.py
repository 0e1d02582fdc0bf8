"""GLUE: the task table, readers for the official distribution folders, and the submission writer.

Files are read as the official GLUE download lays them out (download_glue_data.py): tab-separated, UTF-8, no
quoting (a `"` is an ordinary character), one record per "\\n"-terminated line. Text and label columns are found by
their header names; CoLA's train/dev files have no header and the fixed columns source / label /
original-label / sentence. Every row must have as many columns as the header. Test files carry no labels.

Label ids follow the order of each task's `labels` (the original BERT/ALBERT processors' order);
STS-B is a regression task with float labels.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from albert_core.downstream import DataFormatError
from albert_core.metrics import GLUE_TASK_METRICS, canonical_glue_task


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
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
