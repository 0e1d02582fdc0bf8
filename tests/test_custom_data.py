"""The user's own data: reading CSV / TSV / JSONL / JSON / Parquet tables, the label set, the held-out dev split and
the one-line errors for bad input (albert_core.finetune.tasks.tables, custom_splits). No training here."""

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from albert_core.finetune.tasks import DataFormatError
from albert_core.finetune.tasks.custom_splits import CustomDataConfig, held_out_rows, load_custom_splits
from albert_core.finetune.tasks.tables import read_table

ROWS = [
    {"text": "a goal, late", "label": "sports"},
    {"text": 'the "atom"\nsplit', "label": "science"},
    {"text": "market day", "label": "business"},
]


def write_csv(path: Path, rows: list[dict], delimiter: str = ",") -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter=delimiter)
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def topic_rows(n: int) -> list[dict]:
    topics = ["sports", "science", "business"]
    return [{"text": f"row {i} {topics[i % 3]}", "label": topics[i % 3]} for i in range(n)]


# --- tables ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".json", ".parquet"])
def test_every_format_reads_the_same_columns_and_rows(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    if suffix == ".csv":
        write_csv(path, ROWS)
    elif suffix == ".jsonl":
        write_jsonl(path, ROWS)
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS))
    else:
        write_parquet(path, ROWS)
    table = read_table(path)
    assert table.columns == ["text", "label"]
    assert table.rows == ROWS  # quoted commas, quotes and newlines survive


def test_tsv_is_read_as_glue_writes_it_one_record_per_line_and_quotes_as_ordinary_characters(tmp_path):
    (tmp_path / "d.tsv").write_text('text\tlabel\r\nHe said "hi"\tpos\r\n"a quoted start" and more\tneg\r\n')
    table = read_table(tmp_path / "d.tsv")
    assert table.rows == [
        {"text": 'He said "hi"', "label": "pos"},
        {"text": '"a quoted start" and more', "label": "neg"},
    ]


def test_csv_rows_are_named_by_index_and_the_line_they_start_on(tmp_path):
    table = read_table(write_csv(tmp_path / "d.csv", ROWS))
    # row 1 holds a quoted newline, so row 2 starts on line 5
    assert [table.where(i) for i in range(3)] == ["row 0 (line 2)", "row 1 (line 3)", "row 2 (line 5)"]


def test_an_unknown_format_is_refused_naming_the_formats_understood(tmp_path):
    (tmp_path / "d.xlsx").write_text("x")
    with pytest.raises(DataFormatError, match=r"d\.xlsx: unknown table format '\.xlsx'; expected one of \.csv"):
        read_table(tmp_path / "d.xlsx")


@pytest.mark.parametrize("content", ["", "\n\n", "text,label\n"])
def test_an_empty_file_or_a_header_without_rows_is_an_error(tmp_path, content):
    (tmp_path / "d.csv").write_text(content)
    with pytest.raises(DataFormatError, match=r"d\.csv: (the file is empty|no data rows)"):
        read_table(tmp_path / "d.csv")


def test_a_csv_row_with_the_wrong_number_of_fields_is_named(tmp_path):
    (tmp_path / "d.csv").write_text("text,label\nfine,a\ntoo,many,fields\n")
    with pytest.raises(DataFormatError, match=r"d\.csv: row 1 \(line 3\): expected 2 comma-separated fields"):
        read_table(tmp_path / "d.csv")


def test_a_jsonl_line_that_is_not_an_object_is_named(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a", "label": 1}\n[1, 2]\n')
    with pytest.raises(DataFormatError, match=r"row 1 \(line 2\): expected a JSON object"):
        read_table(tmp_path / "d.jsonl")


# --- labels and columns -----------------------------------------------------------------------------------


def test_the_label_set_comes_from_train_strings_sorted_alphabetically(tmp_path):
    train = write_csv(tmp_path / "train.csv", topic_rows(9))
    splits = load_custom_splits(CustomDataConfig(str(train), dev=str(train)))
    assert splits.labels == ("business", "science", "sports")
    assert [e.label for e in splits.train[:3]] == [2, 1, 0]


def test_integer_labels_sort_numerically_and_keep_their_names(tmp_path):
    rows = [{"text": f"t{i}", "label": [2, 10, 1][i % 3]} for i in range(9)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    splits = load_custom_splits(CustomDataConfig(str(train), dev=str(train)))
    assert splits.labels == ("1", "2", "10")


def test_a_dev_label_not_in_train_names_the_file_row_and_value(tmp_path):
    train = write_csv(tmp_path / "train.csv", topic_rows(6))
    dev = write_csv(tmp_path / "dev.csv", [*topic_rows(2), {"text": "x", "label": "weather"}])
    with pytest.raises(DataFormatError) as err:
        load_custom_splits(CustomDataConfig(str(train), dev=str(dev)))
    assert str(err.value) == (
        f"{dev}: row 2 (line 4): label 'weather' is not one of the training data's labels "
        f"(business, science, sports; from {train})"
    )


def test_a_missing_column_names_the_file_the_flag_and_the_columns_found(tmp_path):
    train = write_csv(tmp_path / "train.csv", topic_rows(6))
    with pytest.raises(DataFormatError) as err:
        load_custom_splits(CustomDataConfig(str(train), label_column="topic"))
    assert str(err.value) == f"{train}: no column 'topic' (--label-column); the columns are 'text', 'label'"


def test_a_single_class_is_an_error_suggesting_regression(tmp_path):
    train = write_csv(tmp_path / "train.csv", [{"text": f"t{i}", "label": "spam"} for i in range(5)])
    with pytest.raises(DataFormatError, match=r"single value 'spam' in all 5 rows; .* at least 2 classes"):
        load_custom_splits(CustomDataConfig(str(train)))


def test_a_non_numeric_regression_label_names_the_row_and_value(tmp_path):
    rows = [{"text": "a", "score": "1.5"}, {"text": "b", "score": "high"}]
    train = write_csv(tmp_path / "train.tsv", rows, "\t")
    with pytest.raises(DataFormatError) as err:
        load_custom_splits(CustomDataConfig(str(train), label_column="score", regression=True))
    assert str(err.value) == f"{train}: row 1 (line 3): regression label 'score' must be a finite number, found 'high'"


def test_an_empty_label_is_named(tmp_path):
    train = write_parquet(tmp_path / "train.parquet", [{"text": "a", "label": "x"}, {"text": "b", "label": None}])
    with pytest.raises(DataFormatError, match=r"train\.parquet: row 1: the label column 'label' is empty"):
        load_custom_splits(CustomDataConfig(str(train)))


def test_a_test_file_without_labels_is_predicted_only(tmp_path):
    train = write_csv(tmp_path / "train.csv", topic_rows(6))
    test = write_csv(tmp_path / "test.csv", [{"text": "unlabelled"}])
    splits = load_custom_splits(CustomDataConfig(str(train), dev=str(train), test=str(test)))
    assert splits.test[0].label is None and not splits.test_labelled


# --- the held-out dev split ---------------------------------------------------------------------------------


def test_held_out_dev_is_the_same_rows_for_the_same_seed_and_other_rows_for_another(tmp_path):
    train = write_csv(tmp_path / "train.csv", topic_rows(60))
    first = load_custom_splits(CustomDataConfig(str(train), dev_fraction=0.2))
    again = load_custom_splits(CustomDataConfig(str(train), dev_fraction=0.2))
    other = load_custom_splits(CustomDataConfig(str(train), dev_fraction=0.2, split_seed=7))
    assert first.dev_rows == again.dev_rows and first.dev_rows != other.dev_rows
    assert len(first.dev) == 12 and len(first.train) == 48
    assert [e.id for e in first.dev] == [str(i) for i in first.dev_rows]  # dev rows keep their train row index


def test_held_out_dev_is_stratified_and_keeps_every_class_in_train(tmp_path):
    rows = topic_rows(30) + [{"text": "rare", "label": "weather"}]
    splits = load_custom_splits(CustomDataConfig(str(write_csv(tmp_path / "train.csv", rows)), dev_fraction=0.5))
    dev_labels = [splits.labels[e.label] for e in splits.dev]
    assert sorted(dev_labels) == ["business"] * 5 + ["science"] * 5 + ["sports"] * 5
    assert "weather" in {splits.labels[e.label] for e in splits.train}


def test_the_split_record_names_the_held_out_rows_and_seed(tmp_path):
    train = write_csv(tmp_path / "train.csv", topic_rows(30))
    record = load_custom_splits(CustomDataConfig(str(train))).record()
    assert record["dev"] == {"rows": 3, "held_out_of": str(train), "fraction": 0.1, "seed": 12345,
                             "train_rows": record["dev"]["train_rows"]}  # fmt: skip
    assert record["train"] == {"file": str(train), "rows": 27}
    assert len(record["dev"]["train_rows"]) == 3 and record["labels"] == ["business", "science", "sports"]


def test_a_fraction_that_holds_out_nothing_is_an_error(tmp_path):
    train = write_csv(tmp_path / "train.csv", topic_rows(6))
    with pytest.raises(DataFormatError, match=r"holds out no dev rows; give a dev file \(--dev\)"):
        load_custom_splits(CustomDataConfig(str(train), dev_fraction=0.1))


def test_regression_rows_are_held_out_without_strata():
    assert held_out_rows([None] * 10, 0.3, 1, stratify=False) == held_out_rows([None] * 10, 0.3, 1, stratify=False)
    assert len(held_out_rows([None] * 10, 0.3, 1, stratify=False)) == 3
