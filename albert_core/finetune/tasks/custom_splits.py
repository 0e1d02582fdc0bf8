"""The user's own data (task "custom"): which files and columns (`CustomDataConfig`), and the checked splits.

`load_custom_splits(config)` reads the train / dev / test tables (`albert_core.finetune.tasks.tables`) and returns
`CustomSplits`: the examples of each split and, for classification, the class names in label-id order. Every
check is made here, before anything trains, and a problem is one `DataFormatError` naming the file, the row and
what was expected:

- the text (and text pair) columns exist and hold text; the label column exists in train and dev;
- classification: the label set is that of train (strings or integers, named as written; integers sort
  numerically, other names alphabetically), at least 2 classes, and every dev (and labelled test) label is one
  of them;
- regression: every label is a finite number, and train's are not all equal.

Without a dev file, `dev_fraction` of train is held out, drawn with `split_seed` (stratified by class for
classification, at least one row of each class kept in train): the same rows every run, whatever the training
seed. `CustomSplits.record()` describes the split (written as split.json beside the runs). At most MAX_CLASSES
(10,000) classes: more is almost always a column of ids or texts given as the label. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from albert_core.finetune.tasks import DataFormatError
from albert_core.finetune.tasks.tables import TABLE_FORMATS, Table, read_table, table_format

SPLIT_SEED = 12345
MAX_CLASSES = 10_000


@dataclass(frozen=True)
class CustomDataConfig:
    """Files and columns of a classification (any number of classes) or regression task on the user's data."""

    train: str  # CSV / TSV / JSONL / JSON / Parquet, with a header (or named fields)
    dev: str | None = None  # None: dev_fraction of train held out
    test: str | None = None  # predicted (and scored when it has the label column)
    text_column: str = "text"
    text_pair_column: str | None = None  # the second text of a pair (entailment, paraphrase, ...)
    label_column: str = "label"
    id_column: str | None = None  # names the rows in the prediction files; None: the row's index in its file
    regression: bool = False  # labels are numbers to predict (Pearson / Spearman) rather than classes
    dev_fraction: float = 0.1
    split_seed: int = SPLIT_SEED
    raw_csv: bool = False  # prediction cells as given, not made spreadsheet-safe (downstream.custom.spreadsheet_safe)

    def __post_init__(self) -> None:
        for name in ("train", "text_column", "label_column"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"CustomDataConfig.{name}: expected a non-empty string, got {getattr(self, name)!r}")
        if not 0.0 < self.dev_fraction < 1.0:
            raise ValueError(f"CustomDataConfig.dev_fraction: expected a fraction in (0, 1), got {self.dev_fraction!r}")
        if self.text_pair_column is not None and self.text_pair_column == self.text_column:
            raise ValueError("CustomDataConfig: text_pair_column is the text_column; give two different columns")
        for name in ("train", "dev", "test"):
            if getattr(self, name) is not None:
                table_format(getattr(self, name))  # an unknown format is refused now, not after reading train


def split_files(folder: str | Path) -> dict[str, str | None]:
    """{"train", "dev", "test"}: the tables named train.<ext>, dev.<ext>, test.<ext> in `folder` (any format of
    `tables.TABLE_FORMATS`; dev and test may be absent: None). A missing train or two files of a split are errors."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: not a folder (expected one holding train.csv, dev.csv, ...)")
    found: dict[str, str | None] = {}
    for split in ("train", "dev", "test"):
        paths = [folder / f"{split}{ext}" for ext in TABLE_FORMATS if (folder / f"{split}{ext}").is_file()]
        if len(paths) > 1:
            raise DataFormatError(folder, "", f"holds {len(paths)} {split} tables ({', '.join(p.name for p in paths)})")
        found[split] = str(paths[0]) if paths else None
    if found["train"] is None:
        raise FileNotFoundError(
            f"{folder}: no train table (expected one of {', '.join('train' + ext for ext in TABLE_FORMATS)})"
        )
    return found


@dataclass(frozen=True)
class CustomExample:
    id: str  # the id column's value, or the row's index in its file
    text_a: str
    text_b: str | None
    label: int | float | None  # class id (index into CustomSplits.labels), regression target, None: unlabelled


@dataclass
class CustomSplits:
    config: CustomDataConfig
    labels: tuple[str, ...] | None  # class names in label-id order; None: regression
    train: list[CustomExample]
    dev: list[CustomExample]
    test: list[CustomExample] | None
    dev_rows: list[int] | None = None  # dev held out of train: those rows of the train file (else None)

    @property
    def test_labelled(self) -> bool:
        return bool(self.test) and all(e.label is not None for e in self.test)

    def record(self) -> dict[str, Any]:
        """The split, as split.json: files, row counts, how dev was chosen, the classes."""
        c = self.config
        dev: dict[str, Any] = {"rows": len(self.dev)}
        if self.dev_rows is None:
            dev["file"] = c.dev
        else:
            dev.update(held_out_of=c.train, fraction=c.dev_fraction, seed=c.split_seed, train_rows=self.dev_rows)
        return {
            "kind": "regression" if self.labels is None else "classification",
            "labels": None if self.labels is None else list(self.labels),
            "columns": {"text": c.text_column, "text_pair": c.text_pair_column, "label": c.label_column},
            "train": {"file": c.train, "rows": len(self.train)},
            "dev": dev,
            "test": None if self.test is None else {"file": c.test, "rows": len(self.test)},
        }

    def describe(self) -> str:
        """One line for the console: kind, classes, rows per split."""
        kind = "regression" if self.labels is None else f"{len(self.labels)} classes ({', '.join(self.labels[:8])}"
        kind += "" if self.labels is None else (", ...)" if len(self.labels) > 8 else ")")
        dev = f"{len(self.dev)} dev"
        if self.dev_rows is not None:
            dev += f" (held out of train: fraction {self.config.dev_fraction}, seed {self.config.split_seed})"
        test = "" if self.test is None else f" / {len(self.test)} test"
        return f"custom data: {kind}; {len(self.train)} train / {dev}{test} rows"


def load_custom_splits(config: CustomDataConfig) -> CustomSplits:
    """Read and check every split (module docstring); dev held out of train when config.dev is None."""
    train_table = _table(config, config.train, labelled=True)
    raw = [_raw_label(train_table, i, config) for i in range(len(train_table.rows))]
    labels = None if config.regression else _label_set(train_table, raw, config)
    train = _examples(train_table, config, labels, raw)
    if labels is None:
        _check_targets(train_table, train, config)
    dev_rows = None
    if config.dev is not None:
        dev_table = _table(config, config.dev, labelled=True)
        dev = _examples(dev_table, config, labels, _labels_of(dev_table, config))
    else:
        dev_rows = held_out_rows(train, config.dev_fraction, config.split_seed, stratify=labels is not None)
        held = set(dev_rows)
        dev = [e for i, e in enumerate(train) if i in held]
        train = [e for i, e in enumerate(train) if i not in held]
        _check_held_out(config, train_table, train, dev)
    test = None
    if config.test is not None:
        test_table = _table(config, config.test, labelled=False)
        test_raw = _labels_of(test_table, config) if config.label_column in test_table.columns else None
        test = _examples(test_table, config, labels, test_raw)
    return CustomSplits(config, labels, train, dev, test, dev_rows)


def held_out_rows(examples: list[CustomExample], fraction: float, seed: int, *, stratify: bool) -> list[int]:
    """The rows (sorted) held out as dev: round(fraction * n) drawn with `seed`; stratified: per class, each class
    keeping at least one row in train."""
    rng = np.random.default_rng(seed)
    if not stratify:
        k = min(round(fraction * len(examples)), len(examples) - 1)
        return sorted(int(i) for i in rng.permutation(len(examples))[:k])
    members: dict[Any, list[int]] = {}  # each class's rows, in file order: one pass, not one per class
    for i, e in enumerate(examples):
        members.setdefault(e.label, []).append(i)
    held: list[int] = []
    for label in sorted(members):
        k = min(round(fraction * len(members[label])), len(members[label]) - 1)
        held += [int(i) for i in rng.permutation(members[label])[:k]]
    return sorted(held)


def _check_held_out(config: CustomDataConfig, table: Table, train: list, dev: list) -> None:
    if not dev:
        raise DataFormatError(
            table.path,
            "",
            f"dev_fraction {config.dev_fraction} of its {len(train)} rows holds out no dev rows; "
            "give a dev file (--dev) or a larger fraction (--dev-fraction)",
        )


def _table(config: CustomDataConfig, path: str, *, labelled: bool) -> Table:
    table = read_table(path)
    table.require(config.text_column, "--text-column")
    if config.text_pair_column is not None:
        table.require(config.text_pair_column, "--text-pair-column")
    if labelled:
        table.require(config.label_column, "--label-column")
    if config.id_column is not None:
        table.require(config.id_column, "--id-column")
    return table


def _raw_label(table: Table, row: int, config: CustomDataConfig) -> Any:
    value = table.rows[row].get(config.label_column)
    if value is None or (isinstance(value, str) and not value.strip()) or _is_nan(value):
        raise DataFormatError(table.path, table.where(row), f"the label column {config.label_column!r} is empty")
    return value


def _labels_of(table: Table, config: CustomDataConfig) -> list[Any]:
    return [_raw_label(table, i, config) for i in range(len(table.rows))]


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def label_name(value: Any) -> str:
    """A class label as it is named in the output: integers (also integral floats, as Parquet may store them)
    as integers, strings stripped of surrounding whitespace."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return value.strip() if isinstance(value, str) else str(value)


def _label_set(table: Table, raw: list[Any], config: CustomDataConfig) -> tuple[str, ...]:
    names = {label_name(v) for v in raw}
    if len(names) < 2:
        raise DataFormatError(
            table.path,
            "",
            f"the label column {config.label_column!r} has the single value {next(iter(names))!r} in all "
            f"{len(raw)} rows; classification needs at least 2 classes (for numeric targets pass --regression)",
        )
    if len(names) > MAX_CLASSES:
        raise DataFormatError(
            table.path,
            "",
            f"the label column {config.label_column!r} has {len(names)} distinct values, more than the "
            f"{MAX_CLASSES} classes a classifier may have (a label column of ids or texts? for numeric targets pass "
            "--regression)",
        )
    if all(_is_integer(n) for n in names):
        return tuple(sorted(names, key=int))
    return tuple(sorted(names))


def _is_integer(name: str) -> bool:
    try:
        int(name)
    except ValueError:
        return False
    return True


def _label(table: Table, row: int, value: Any, labels: dict[str, int] | None, config: CustomDataConfig):
    if labels is None:
        return _target(table, row, value, config)
    name = label_name(value)
    if name not in labels:
        shown = ", ".join(list(labels)[:20]) + (", ..." if len(labels) > 20 else "")
        raise DataFormatError(
            table.path,
            table.where(row),
            f"label {name!r} is not one of the training data's labels ({shown}; from {config.train})",
        )
    return labels[name]


def _target(table: Table, row: int, value: Any, config: CustomDataConfig) -> float:
    number = math.nan
    if not isinstance(value, bool):
        try:
            number = float(value)
        except (TypeError, ValueError):
            pass
    if not math.isfinite(number):
        raise DataFormatError(
            table.path,
            table.where(row),
            f"regression label {config.label_column!r} must be a finite number, found {value!r}",
        )
    return number


def _text(table: Table, row: int, column: str) -> str:
    value = table.rows[row].get(column)
    if value is None or _is_nan(value):
        raise DataFormatError(table.path, table.where(row), f"the text column {column!r} is empty")
    return value if isinstance(value, str) else str(value)


def _ident(table: Table, row: int, column: str) -> str:
    value = table.rows[row].get(column)
    if value is None or _is_nan(value) or (isinstance(value, str) and not value.strip()):
        raise DataFormatError(table.path, table.where(row), f"the id column {column!r} is empty")
    return label_name(value)


def _examples(
    table: Table, config: CustomDataConfig, labels: tuple[str, ...] | None, raw: list[Any] | None
) -> list[CustomExample]:
    examples = []
    ids = None if labels is None else {name: i for i, name in enumerate(labels)}  # a dict: no list.index per row
    for row in range(len(table.rows)):
        label = None if raw is None else _label(table, row, raw[row], ids, config)
        pair = None if config.text_pair_column is None else _text(table, row, config.text_pair_column)
        ident = str(row) if config.id_column is None else _ident(table, row, config.id_column)
        examples.append(CustomExample(ident, _text(table, row, config.text_column), pair, label))
    return examples


def _check_targets(table: Table, train: list[CustomExample], config: CustomDataConfig) -> None:
    if len({e.label for e in train}) < 2:
        raise DataFormatError(
            table.path,
            "",
            f"the regression label {config.label_column!r} is {train[0].label!r} in all {len(train)} rows; "
            "there is nothing to learn",
        )
