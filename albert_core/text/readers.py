"""The format readers of albert_core.text.corpus: each turns an open binary file (decompressed, or a region of one)
into the records of its documents, a Document or a Skip each (albert_core.text.records), as the corpus module's
docstring describes: plain text, JSONL, Parquet and MediaWiki XML. `read_records` picks the reader of a format.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

from albert_core.text.records import WHOLE, Document, Place, Skip
from albert_core.text.wikitext import strip_wikitext

CHUNK = 1 << 20  # bytes read per line piece
HEAD = 8192  # bytes inspected for NUL to call a file binary


def read_records(
    kind: str, source: str, f, text_field: str, split: str, max_chars: int, place: Place, row_groups=None
) -> Iterator[Document | Skip]:
    """The records of `f` (an open binary file, decompressed) read as `kind` ("text", "jsonl", "parquet" or
    "mediawiki"); `row_groups`: a Parquet file's row groups [start, stop) only."""
    if kind == "text":
        yield from _read_text(source, f, split, max_chars, place)
    elif kind == "jsonl":
        yield from _read_jsonl(source, f, text_field, max_chars, place)
    elif kind == "parquet":
        yield from _read_parquet(source, f, text_field, max_chars, place, row_groups)
    else:
        yield from _read_mediawiki(source, f, max_chars, place)


# ----------------------------------------------------------------------------------------------------------
# plain text


class _HeadReader:
    """readline(limit) over a stream whose first bytes were already read (to look for NUL)."""

    def __init__(self, f, head: bytes):
        self.f, self.head = f, head

    def readline(self, limit: int) -> bytes:
        if not self.head:
            return self.f.readline(limit)
        end = self.head.find(b"\n", 0, limit)
        cut = end + 1 if end >= 0 else min(limit, len(self.head))
        line, self.head = self.head[:cut], self.head[cut:]
        if end < 0 and len(line) < limit and not self.head:
            line += self.f.readline(limit - len(line))
        return line

    def read(self, n: int = -1) -> bytes:
        if not self.head:
            return self.f.read(n)
        if n < 0:
            data, self.head = self.head + self.f.read(), b""
        else:
            data, self.head = self.head[:n], self.head[n:]
        return data


def _open_head(f) -> tuple[_HeadReader, bytes]:
    head = f.read(HEAD)
    return _HeadReader(f, head), head


@dataclass
class _Problem:
    reason: str
    detail: str


def _line_pieces(reader: _HeadReader) -> Iterator[tuple[int, str | _Problem, bool]]:
    """(line number, decoded piece of at most CHUNK bytes or a _Problem, whether the piece ends the line).
    After a problem the rest of its line is skipped and decoding restarts on the next line."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    lineno, offset = 1, 0
    while True:
        raw = reader.readline(CHUNK)
        if not raw:  # end of file: close an unterminated last line
            try:
                tail = decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                yield lineno, _Problem("invalid_utf8", f"line {lineno} ends inside a UTF-8 sequence"), True
                return
            if offset:
                yield lineno, tail, True
            return
        ends = raw.endswith(b"\n")
        problem = None
        if b"\0" in raw:
            problem = _Problem("binary", f"NUL byte on line {lineno}: expected text")
        else:
            try:
                piece = decoder.decode(raw, final=ends)
            except UnicodeDecodeError as err:
                bad = raw[err.start : err.start + 1].hex()
                problem = _Problem(
                    "invalid_utf8", f"byte 0x{bad} at line {lineno}, column {offset + err.start + 1}: expected UTF-8"
                )
        if problem is not None:
            while not ends:  # drop the rest of the line
                raw = reader.readline(CHUNK)
                ends = not raw or raw.endswith(b"\n")
            decoder.reset()
            yield lineno, problem, True
        else:
            yield lineno, piece, ends
        offset = 0 if ends or problem else offset + len(raw)
        if ends or problem:
            lineno += 1


def _read_text(source: str, f, split: str, max_chars: int, place: Place = WHOLE) -> Iterator[Document | Skip]:
    reader, head = _open_head(f)
    if place.first and not head:
        yield Skip(source, "file", "empty", "the file is empty: expected text")
        return
    if place.first and b"\0" in head:
        yield Skip(source, "file", "binary", f"NUL byte in the first {len(head)} bytes: expected a text file")
        return
    by_file = split == "file"
    parts: list[str] = []  # finished lines of the current document
    line: list[str] = []  # pieces of the current line
    line_blank = True
    chars, start, documents, first = 0, 1, 0, True
    problem: _Problem | None = None
    started = False  # the current document has a line

    def finish(location: str) -> Document | Skip:
        if problem is not None:
            return Skip(source, location, problem.reason, problem.detail)
        text = "".join(parts)
        if not text.strip():
            return Skip(source, location, "empty", "the document is blank: expected text")
        return Document(source, location, text)

    for lineno, piece, ends in _line_pieces(reader):
        if isinstance(piece, _Problem):  # the problem line is dropped whole
            problem = problem or piece
            if by_file:
                break
            if not started:
                start, started = lineno, True
            line, line_blank = [], True
            continue
        if first:
            piece, first = piece.removeprefix("\ufeff"), False
        if piece.strip():
            line_blank = False
        if problem is None:
            line.append(piece)
            chars += len(piece)
            if chars > max_chars:
                problem = _Problem("too_long", f"more than max_document_chars={max_chars} characters")
                if by_file:
                    break
                parts, line = [], []
        if not ends:
            continue
        if by_file or not line_blank:
            if not started:
                start, started = lineno, True
            if problem is None:
                parts.append("".join(line).replace("\r\n", "\n"))
        elif started:  # a blank line ends the current document
            yield finish(place.line(start))
            documents += 1
            parts, chars, problem, started = [], 0, None, False
        line, line_blank = [], True
    if by_file:
        yield finish("file")
    elif started:
        yield finish(place.line(start))
    elif documents == 0 and place.whole:
        yield Skip(source, "file", "empty", "the file has only blank lines: expected text")


# ----------------------------------------------------------------------------------------------------------
# JSONL


def _read_jsonl(source: str, f, text_field: str, max_chars: int, place: Place = WHOLE) -> Iterator[Document | Skip]:
    reader, head = _open_head(f)
    if place.first and not head:
        yield Skip(source, "file", "empty", "the file is empty: expected JSON lines")
        return
    if place.first and b"\0" in head:
        yield Skip(source, "file", "binary", f"NUL byte in the first {len(head)} bytes: expected JSON lines")
        return
    # a record may escape every character (\uXXXX, 6 bytes), so its line may be up to 6x the text limit
    max_bytes = 6 * max_chars + 4096
    buf: list[str] = []
    size, too_long, records = 0, False, 0
    for lineno, piece, ends in _line_pieces(reader):
        if isinstance(piece, _Problem):
            records += 1
            yield Skip(source, place.line(lineno), piece.reason, piece.detail)
            buf, size, too_long = [], 0, False
            continue
        if not too_long:
            buf.append(piece)
            size += len(piece)
            if size > max_bytes:
                too_long, buf = True, []
        if not ends:
            continue
        line = "".join(buf)
        location = place.line(lineno)
        buf, size, was_too_long, too_long = [], 0, too_long, False
        if was_too_long:
            records += 1
            yield Skip(source, location, "too_long", f"line longer than max_document_chars={max_chars} allows")
            continue
        if not line.strip():
            continue
        records += 1
        yield _jsonl_record(source, location, line, text_field, max_chars)
    if records == 0 and place.whole:
        yield Skip(source, "file", "empty", "the file has no JSON records")


def _jsonl_record(source: str, location: str, line: str, text_field: str, max_chars: int) -> Document | Skip:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        return Skip(source, location, "malformed_record", f"expected a JSON object: {err}")
    except RecursionError:
        return Skip(source, location, "malformed_record", "expected a JSON object: nested too deeply")
    if not isinstance(record, dict):
        return Skip(source, location, "malformed_record", f"expected a JSON object, got {type(record).__name__}")
    if text_field not in record:
        keys = ", ".join(sorted(record)[:10])
        return Skip(source, location, "missing_field", f"no {text_field!r} field (fields: {keys})")
    text = record[text_field]
    if not isinstance(text, str):
        return Skip(
            source, location, "malformed_record", f"field {text_field!r} must be a string, got {type(text).__name__}"
        )
    return _checked(source, location, text, max_chars)


def _checked(source: str, location: str, text: str, max_chars: int) -> Document | Skip:
    if not text.strip():
        return Skip(source, location, "empty", "the document is blank: expected text")
    if len(text) > max_chars:
        return Skip(source, location, "too_long", f"{len(text)} characters > max_document_chars={max_chars}")
    return Document(source, location, text)


# ----------------------------------------------------------------------------------------------------------
# Parquet


def _read_parquet(
    source: str, f, text_field: str, max_chars: int, place: Place = WHOLE, row_groups: tuple[int, int] | None = None
) -> Iterator[Document | Skip]:
    """The rows of the file, or of row groups [start, stop) (`row_groups`), numbered as in the whole file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as err:
        yield Skip(source, "file", "malformed_parquet", f"expected a Parquet file: {err}")
        return
    names = pf.schema_arrow.names
    if text_field not in names:
        yield Skip(source, "file", "missing_field", f"no column {text_field!r} (columns: {', '.join(names[:10])})")
        return
    if pf.metadata.num_rows == 0:
        if place.whole:
            yield Skip(source, "file", "empty", "the Parquet file has no rows")
        return
    groups = range(*(row_groups or (0, pf.metadata.num_row_groups)))
    row = sum(pf.metadata.row_group(g).num_rows for g in range(groups.start))
    pf = pq.ParquetFile(f, metadata=pf.metadata, read_dictionary=[text_field])  # a repeated value is held once
    try:
        for batch in pf.iter_batches(columns=[text_field], batch_size=256, row_groups=list(groups)):
            for value in _parquet_values(batch.column(0), max_chars):
                row += 1
                location = f"row {row}"
                if value is None:
                    yield Skip(source, location, "empty", f"column {text_field!r} is null: expected text")
                elif isinstance(value, _TooLong):
                    yield Skip(source, location, "too_long", f"{value} characters > max_document_chars={max_chars}")
                elif not isinstance(value, str):
                    detail = f"column {text_field!r} must hold strings, got {type(value).__name__}"
                    yield Skip(source, location, "malformed_record", detail)
                else:
                    yield _checked(source, location, value, max_chars)
    except pa.ArrowException as err:
        yield Skip(source, f"row {row + 1}", "malformed_parquet", f"unreadable from here on: {err}")


class _TooLong(int):
    """The length of a Parquet value too long to be a document, in place of the value (never made a str)."""


def _parquet_values(column, max_chars: int) -> Iterator[object]:
    """A column's values, each string's (or bytes') length checked in Arrow before it becomes a Python object: a
    longer one than max_chars comes as its _TooLong length. A dictionary's values are measured and converted once
    each, so a long value repeated on every row of a dictionary-encoded file is never expanded."""
    import pyarrow as pa
    import pyarrow.compute as pc

    encoded = pa.types.is_dictionary(column.type)
    values = column.dictionary if encoded else column
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        lengths = pc.utf8_length(values)
    elif pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type):
        lengths = pc.binary_length(values)  # not text (a skip), but not expanded either
    else:
        yield from column.to_pylist()
        return
    if not encoded and (pc.max(lengths).as_py() or 0) <= max_chars:  # the usual case: every value fits
        yield from values.to_pylist()
        return
    kept = [
        _TooLong(n) if n is not None and n > max_chars else values[i].as_py() for i, n in enumerate(lengths.to_pylist())
    ]
    yield from (kept if not encoded else (None if i is None else kept[i] for i in column.indices.to_pylist()))


# ----------------------------------------------------------------------------------------------------------
# MediaWiki XML


_MAX_FIELD_CHARS = 4096  # a page's title, id or ns beyond this is cut (they are a few characters)


class _PageCollector:
    """A target for xml.etree's XMLParser that keeps, of each <page>, only what its record needs.

    That is the text (before any child element, as Element.text) of the page's <title>, <id> and <ns> children,
    whether it has a <redirect>, and the text of the first <text> child of its last <revision>, cut at `cap`
    characters (`too_long` set). Memory is one page's capped fields whatever the file holds; a tree builder kept
    every character of a page, 17x its size once stripped (a 16 MB page took 271 MB).
    """

    def __init__(self, cap: int):
        self.cap = cap
        self.root: str | None = None  # the document element's tag
        self.stack: list[str] = []  # local names of the open elements
        self.open: list[dict] = []  # pages being read (a page inside a page is a page of its own)
        self.done: list[dict] = []  # pages read, in document order, until the reader takes them
        self.field: tuple[dict, str, int] | None = None  # where character data goes: (holder, key, limit)

    def start(self, tag: str, attrib: dict) -> None:
        name = tag.rsplit("}", 1)[-1]
        if self.root is None:
            self.root = tag
        self.stack.append(name)
        self.field = None  # text after a child element is that child's tail, not the parent's text
        depth = len(self.stack)
        if name == "page":
            self.open.append({"depth": depth})
            return
        if not self.open:
            return
        page = self.open[-1]
        if depth == page["depth"] + 1:  # a child of the page
            if name in ("title", "id", "ns"):
                page[name] = {"parts": [], "size": 0}
                self.field = (page[name], name, _MAX_FIELD_CHARS)
            elif name == "redirect":
                page["redirect"] = True
            elif name == "revision":
                page["revision_depth"], page["text"] = depth, None  # the last revision's text counts
        elif (
            name == "text"
            and depth == page.get("revision_depth", -2) + 1
            and self.stack[-2] == "revision"
            and page.get("text") is None
        ):
            page["text"] = {"parts": [], "size": 0}
            self.field = (page["text"], "text", self.cap)

    def data(self, chunk: str) -> None:
        if self.field is None:
            return
        holder, _, limit = self.field
        room = limit - holder["size"]
        if len(chunk) > room:
            holder["too_long"] = True
            chunk = chunk[: max(room, 0)]
        holder["parts"].append(chunk)
        holder["size"] += len(chunk)

    def end(self, tag: str) -> None:
        self.field = None
        depth = len(self.stack)
        self.stack.pop()
        if self.open and self.open[-1]["depth"] == depth:
            self.done.append(self.open.pop())

    def close(self) -> None:
        return None

    def take(self) -> list[dict]:
        done, self.done = self.done, []
        return done


def _page_record(source: str, page: dict, max_chars: int, cap: int) -> Document | Skip:
    def text(key: str, missing: str) -> str:
        return "".join(page[key]["parts"]) if page.get(key) is not None else missing

    title, page_id = text("title", ""), text("id", "?") or "?"
    location = f"page {page_id} ({title})"
    ns = text("ns", "0").strip() if "ns" in page else "0"
    wikitext = text("text", "")
    if ns != "0":
        return Skip(source, location, "namespace", f"namespace {ns} is not an article")
    if page.get("redirect") or re.match(r"\s*#redirect", wikitext, re.IGNORECASE):
        return Skip(source, location, "redirect", "redirect page")
    if (page.get("text") or {}).get("too_long"):
        return Skip(source, location, "too_long", f"wikitext longer than {cap} characters (4 x max_document_chars)")
    if not wikitext.strip():
        return Skip(source, location, "empty", "the page has no text")
    prose = strip_wikitext(wikitext)
    if not prose:
        return Skip(source, location, "markup_only", "no prose left after removing markup")
    return _checked(source, location, prose, max_chars)


def _read_mediawiki(source: str, f, max_chars: int, place: Place = WHOLE) -> Iterator[Document | Skip]:
    import xml.etree.ElementTree as ET

    reader, head = _open_head(f)
    if place.first and not head:
        yield Skip(source, "file", "empty", "the file is empty: expected a MediaWiki XML export")
        return
    if place.first and b"\0" in head:
        yield Skip(source, "file", "binary", f"NUL byte in the first {len(head)} bytes: expected XML")
        return
    cap = 4 * max_chars + 65536  # wikitext is longer than its prose; a page past this cannot be a document
    collector = _PageCollector(cap)
    parser = ET.XMLParser(target=collector)
    pages = 0
    try:
        while True:
            chunk = reader.read(CHUNK)
            if chunk:
                parser.feed(chunk)
            else:
                parser.close()
            if collector.root is not None and collector.root.rsplit("}", 1)[-1] != "mediawiki":
                yield Skip(source, "file", "malformed_xml", f"expected a <mediawiki> export, found <{collector.root}>")
                return
            for page in collector.take():
                pages += 1
                yield _page_record(source, page, max_chars, cap)
            if not chunk:
                break
    except ET.ParseError as err:
        if collector.root is not None and collector.root.rsplit("}", 1)[-1] != "mediawiki":
            yield Skip(source, "file", "malformed_xml", f"expected a <mediawiki> export, found <{collector.root}>")
            return
        for page in collector.take():  # pages finished before the error, in the same chunk
            pages += 1
            yield _page_record(source, page, max_chars, cap)
        line, column = err.position
        yield Skip(
            source,
            f"line {line}, column {column}",
            "malformed_xml",
            f"expected well-formed XML ({err}); the rest of the file is unread after {pages} pages",
        )
        return
    if pages == 0 and place.whole:
        yield Skip(source, "file", "empty", "the export has no <page>")
