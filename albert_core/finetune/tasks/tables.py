"""Readers for the user's own labelled tables: CSV, TSV, JSONL (or a JSON array) and Parquet, with named columns.

`read_table(path)` returns a `Table`: the column names and one dict per data row, each row remembering the line it
starts on (text formats) so that messages can name it. The format comes from the file name's ending:

    .csv                    comma-separated, a header line, RFC 4180 quoting (what pandas' to_csv writes)
    .tsv .tab               tab-separated, a header line, one record per line and no quoting (a `"` is an
                            ordinary character: GLUE's files, the IANA text/tab-separated-values)
    .jsonl .ndjson          one JSON object per line (blank lines skipped)
    .json                   a JSON array of objects, or JSON Lines
    .parquet .pq            Parquet (pyarrow), any column types

Rows are numbered from 0 in file order, as in the prediction files; a problem is reported as a `DataFormatError`
naming the file, the row (and its line) and what was expected.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from albert_core.finetune.tasks import DataFormatError

TABLE_FORMATS = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".tab": "tsv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
}


# What one table may hold, checked before its values become Python objects: rows (by the file's metadata), characters
# in one cell (a text is cut to max_seq_length tokens anyway) and bytes once decoded. Real fine-tuning sets are far
# below each (MNLI: 393K rows, 100 MB).
MAX_ROWS = 10_000_000
MAX_CELL_CHARS = 1_000_000
MAX_TABLE_BYTES = 4 << 30


@dataclass
class Table:
    """One file's data rows: `rows[i]` maps column name -> value; `lines[i]` is the line row i starts on (0: none)."""

    path: Path
    format: str
    columns: list[str]
    rows: list[dict[str, Any]]
    lines: list[int]

    def where(self, row: int) -> str:
        """How messages name data row `row`: "row 4 (line 6)" in text formats, "row 4" in Parquet."""
        line = self.lines[row] if row < len(self.lines) else 0
        return f"row {row} (line {line})" if line else f"row {row}"

    def require(self, column: str, flag: str) -> None:
        """Raise, naming the columns found, when `column` (given with `flag`) is not a column of this table."""
        if column not in self.columns:
            found = ", ".join(repr(c) for c in self.columns[:20]) or "none"
            raise DataFormatError(self.path, "", f"no column {column!r} ({flag}); the columns are {found}")


def table_format(path: str | Path) -> str:
    """The format of `path` by its ending; an unknown ending is an error naming the ones understood."""
    suffix = Path(path).suffix.lower()
    if suffix not in TABLE_FORMATS:
        known = ", ".join(TABLE_FORMATS)
        raise DataFormatError(path, "", f"unknown table format {suffix or '(no extension)'!r}; expected one of {known}")
    return TABLE_FORMATS[suffix]


def read_table(path: str | Path) -> Table:
    """All data rows of a CSV / TSV / JSONL / JSON / Parquet file; an empty file or one without rows is an error."""
    path = Path(path)
    kind = table_format(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise _empty(path, kind)
    if kind == "parquet":
        table = _read_parquet(path)
    else:
        text = _text(path)
        if not text.strip():
            raise _empty(path, kind)
        if kind in ("csv", "tsv"):
            table = _read_delimited(path, kind, text)
        elif kind == "json" and text.lstrip().startswith("["):
            table = _read_json_array(path, text)
        else:
            table = _read_json_lines(path, kind, text)
    if not table.rows:
        raise DataFormatError(path, "", f"no data rows (columns: {', '.join(table.columns) or 'none'})")
    return table


def _empty(path: Path, kind: str) -> DataFormatError:
    expected = "a header line and data rows" if kind in ("csv", "tsv") else "data rows"
    return DataFormatError(path, "", f"the file is empty: expected {expected}")


def _text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise DataFormatError(path, f"byte {err.start}", f"not valid UTF-8 ({err.reason})") from None


def _read_delimited(path: Path, kind: str, text: str) -> Table:
    if kind == "csv":
        reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    else:
        reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE, strict=True)
    records = _records(path, reader)
    _, header = next(records)
    if len(set(header)) != len(header):
        duplicated = sorted({c for c in header if header.count(c) > 1})
        raise DataFormatError(path, "line 1", f"the header names column {duplicated[0]!r} more than once")
    rows, lines = [], []
    for line, fields in records:
        if fields == [] or fields == [""]:
            continue  # a blank line
        if len(fields) != len(header):
            raise DataFormatError(
                path,
                f"row {len(rows)} (line {line})",
                f"expected {len(header)} {'comma' if kind == 'csv' else 'tab'}-separated fields "
                f"({', '.join(header)}), found {len(fields)}",
            )
        rows.append(dict(zip(header, fields, strict=True)))
        lines.append(line)
    return Table(path, kind, header, rows, lines)


def _records(path: Path, reader) -> Iterator[tuple[int, list[str]]]:
    """(line each record starts on, its fields); csv's own errors become DataFormatErrors naming the line."""
    start = 1
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as err:
            raise DataFormatError(path, f"line {start}", f"malformed record ({err})") from None
        yield start, fields
        start = reader.line_num + 1


def _object(path: Path, where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DataFormatError(path, where, f"expected a JSON object with named fields, found {type(value).__name__}")
    return value


def _table_of_objects(path: Path, kind: str, rows: list[dict[str, Any]], lines: list[int]) -> Table:
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    return Table(path, kind, list(columns), rows, lines)


def _read_json_lines(path: Path, kind: str, text: str) -> Table:
    rows, lines = [], []
    for line, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        where = f"row {len(rows)} (line {line})"
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as err:
            raise DataFormatError(
                path, where, f"not valid JSON ({err.msg}); expected one JSON object per line"
            ) from None
        except RecursionError:
            raise DataFormatError(path, where, "not valid JSON: nested too deeply") from None
        rows.append(_object(path, where, value))
        lines.append(line)
    return _table_of_objects(path, "jsonl", rows, lines)


def _read_json_array(path: Path, text: str) -> Table:
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataFormatError(path, f"line {err.lineno}", f"not valid JSON ({err.msg})") from None
    except RecursionError:
        raise DataFormatError(path, "", "not valid JSON: nested too deeply") from None
    rows = [_object(path, f"row {i}", value) for i, value in enumerate(values)]
    return _table_of_objects(path, "json", rows, [])


def _read_parquet(path: Path) -> Table:
    """The rows, read in batches whose decoded size is checked in Arrow before any becomes Python objects (a
    dictionary-encoded file can expand a few KB into GBs), within MAX_ROWS, MAX_CELL_CHARS and MAX_TABLE_BYTES."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        columns = pq.ParquetFile(path).schema_arrow
        texts = [f.name for f in columns if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
        parquet = pq.ParquetFile(path, read_dictionary=texts)  # a value repeated on many rows is held once
        if parquet.metadata.num_rows > MAX_ROWS:
            raise DataFormatError(
                path, "", f"{parquet.metadata.num_rows} rows, more than the {MAX_ROWS} a table may hold"
            )
        rows: list[dict[str, Any]] = []
        size = 0
        for batch in parquet.iter_batches(batch_size=1024):
            size += _decoded_size(path, batch, len(rows))
            if size > MAX_TABLE_BYTES:
                where = f"row {len(rows) + batch.num_rows - 1}"
                raise DataFormatError(path, where, f"the table decodes to more than {MAX_TABLE_BYTES >> 30} GiB")
            rows += batch.to_pylist()
    except (pa.ArrowException, OSError) as err:
        raise DataFormatError(path, "", f"not a readable Parquet file ({err})") from None
    return Table(path, "parquet", list(columns.names), rows, [])


def _decoded_size(path: Path, batch, first_row: int) -> int:
    """The bytes a batch's values take once decoded, counted in Arrow; a cell over MAX_CELL_CHARS is an error."""
    import pyarrow as pa
    import pyarrow.compute as pc

    total = 0
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        encoded = pa.types.is_dictionary(column.type)
        values = column.dictionary if encoded else column
        if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
            total += column.nbytes
            continue
        chars, size = pc.utf8_length(values), pc.binary_length(values)
        if encoded:  # each row's own length, without decoding a value
            chars, size = pc.take(chars, column.indices), pc.take(size, column.indices)
        longest = pc.max(chars).as_py() or 0
        if longest > MAX_CELL_CHARS:
            row = first_row + pc.index(chars, longest).as_py()
            raise DataFormatError(
                path,
                f"row {row}",
                f"column {name!r} holds {longest} characters, more than the {MAX_CELL_CHARS} a table cell may hold",
            )
        total += (pc.sum(size).as_py() or 0) + 8 * len(column)
    return total
