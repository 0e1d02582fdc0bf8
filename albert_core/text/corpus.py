"""Streaming corpus readers: plain text, JSONL, Parquet and MediaWiki XML dumps, local or fsspec URLs.

Every reader yields one record per input document: a `Document` when it could be read, or a `Skip` naming
why not (so counts add up: documents read + documents skipped = documents in the input). Filter skips
(`redirect`, `namespace`, `markup_only`) are normal; the others are bad input, and with `on_error="fail"` they
raise `CorpusError` instead, naming the file, the line/record and what was expected.

Formats (`fmt="auto"` picks one from the extension, after a `.gz` / `.bz2` / `.xz` / `.zst` suffix):
- text (`.txt`, `.text`, `.md`, no extension): `split="file"` makes each file one document;
  `split="blank_line"` makes each run of non-blank lines one document.
- jsonl (`.jsonl`, `.ndjson`): one JSON object per line, the document in `text_field`; blank lines ignored.
- parquet (`.parquet`, `.pq`): one row per document, the document in column `text_field`.
- mediawiki (`.xml`): a MediaWiki export; one article (namespace 0, not a redirect) per document, its
  wikitext stripped to prose by `albert_core.text.wikitext.strip_wikitext`.

A big file is read in parts by `read_region` (albert_core.text.regions plans them): bytes [start, stop) of an
uncompressed text, JSONL or MediaWiki file cut on record boundaries, row groups of a Parquet file, bzip2 streams of
a MediaWiki multistream dump, or a chunk of whole records a single-stream compressed file was cut into as it was
read. Each document is read whole by exactly one region, as it is when the file is read whole; a line's location in
a byte range is "byte START + line N" (its line number in the file is not known without reading what precedes it).

Documents longer than `max_document_chars` are skipped (reason `too_long`), not chunked: reading stops
collecting as soon as the limit is passed, so a 50 MB line costs a few MB of memory, not 50. A MediaWiki page is
collected up to 4 x max_document_chars of wikitext (markup included) and skipped past that.

This module finds the files, opens them (decompressed, or a region's bytes) and applies on_error; the records are
albert_core.text.records', and each format's reader is in albert_core.text.readers.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import lzma
import os
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import fsspec

from albert_core.text.readers import CHUNK, read_records
from albert_core.text.records import WHOLE, CorpusError, Document, Place, Skip

FORMATS = ("auto", "text", "jsonl", "parquet", "mediawiki")
SPLITS = ("file", "blank_line")
ON_ERROR = ("skip", "fail")
MAX_DOCUMENT_CHARS = 1_000_000

EXTENSIONS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    "": "text",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".xml": "mediawiki",
}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")

# Skips that are expected filtering, not bad input: never raised, whatever on_error says.
FILTER_REASONS = frozenset({"redirect", "namespace", "markup_only"})

try:
    from zstandard import ZstdError
except ImportError:  # .zst corpora need zstandard (a dependency of albert); without it none can be read
    ZstdError = OSError

# What reading a file can raise that makes it unreadable (from here on): a skip, not a crash.
READ_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError, ZstdError)


@dataclass(frozen=True)
class Region:
    """The part of one file a reader reads on its own (albert_core.text.regions plans them).

    how: "bytes"       bytes [start, stop) of an uncompressed text, JSONL or MediaWiki file, cut on record bounds
         "bz2_streams" bytes [start, stop) of a bzip2 multistream MediaWiki dump, cut on stream bounds
         "row_groups"  row groups [start, stop) of a Parquet file
         "chunk"       whole records of a compressed file's decompressed stream, handed over in memory; start is
                       the number of its first line in the stream, stop its byte offset there (for messages)
    first / last: the region begins / ends the file (a MediaWiki region is given the export's root tags it lacks).
    """

    how: str
    start: int
    stop: int
    first: bool
    last: bool

    HOWS = ("bytes", "bz2_streams", "row_groups", "chunk")

    def __post_init__(self) -> None:
        if self.how not in self.HOWS:
            raise ValueError(f"Region.how must be one of {self.HOWS}, got {self.how!r}")


# ----------------------------------------------------------------------------------------------------------
# inputs


def _is_url(path: str) -> bool:
    return "://" in path


def detect_format(path: str) -> str | None:
    """The reader for `path` by its extension (compression suffix ignored); None if unknown."""
    name = path.rstrip("/").rsplit("/", 1)[-1].lower()
    for suffix in COMPRESSIONS:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    ext = os.path.splitext(name)[1]
    return EXTENSIONS.get(ext)


def _hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def list_inputs(paths: str | os.PathLike | Iterable[str | os.PathLike], *, fmt: str = "auto") -> list[str]:
    """Expand files, directories (recursively) and glob patterns, local or fsspec URLs, into a sorted list
    of files. In directories, hidden files (".x", "_x") are left out, and with fmt="auto" so are files whose
    extension names no known format (e.g. a SOURCES.json beside the corpus). A path that names nothing is
    kept as given, so that reading it reports it as missing."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    out: list[str] = []
    for path in map(str, paths):
        fs, root = fsspec.core.url_to_fs(path)

        url = _is_url(path)

        def full(p: str, fs=fs, url=url) -> str:
            return fs.unstrip_protocol(p) if url else p

        if any(c in root for c in "*?["):
            matches = [p for p in sorted(fs.glob(root)) if fs.isfile(p)]
            out.extend(full(p) for p in matches)
            if not matches:
                out.append(path)
        elif fs.isdir(root):
            found = []
            for p in fs.find(root):
                rel = p[len(root.rstrip("/")) + 1 :]
                if any(_hidden(part) for part in rel.split("/")):
                    continue
                if fmt == "auto" and detect_format(p) is None:
                    continue
                found.append(p)
            out.extend(full(p) for p in sorted(found))
        else:
            out.append(path if not fs.exists(root) else full(root))
    return out


def read_documents(
    path: str | os.PathLike | Iterable[str | os.PathLike],
    *,
    fmt: str = "auto",
    on_error: str = "skip",
    text_field: str = "text",
    split: str = "file",
    max_document_chars: int = MAX_DOCUMENT_CHARS,
) -> Iterator[Document | Skip]:
    """Stream Documents (and Skips) from a file, directory, glob or fsspec URL; see the module docstring."""
    if fmt not in FORMATS:
        raise ValueError(f"read_documents: fmt must be one of {FORMATS}, got {fmt!r}")
    if on_error not in ON_ERROR:
        raise ValueError(f"read_documents: on_error must be one of {ON_ERROR}, got {on_error!r}")
    if split not in SPLITS:
        raise ValueError(f"read_documents: split must be one of {SPLITS}, got {split!r}")
    if max_document_chars < 1:
        raise ValueError(f"read_documents: max_document_chars must be >= 1, got {max_document_chars}")
    for source in list_inputs(path, fmt=fmt):
        for record in _read_file(source, fmt, text_field, split, max_document_chars):
            if isinstance(record, Skip) and on_error == "fail" and record.reason not in FILTER_REASONS:
                raise CorpusError(record)
            yield record


def _read_file(source: str, fmt: str, text_field: str, split: str, max_chars: int) -> Iterator[Document | Skip]:
    kind = detect_format(source) if fmt == "auto" else fmt
    if kind is None:
        known = ", ".join(sorted(e for e in EXTENSIONS if e))
        yield Skip(source, "file", "unknown_format", f"cannot tell the format from the extension ({known}); pass fmt")
        return
    fs, root = fsspec.core.url_to_fs(source)
    try:
        if not fs.exists(root):
            yield Skip(source, "file", "missing", "no such file or directory")
            return
        if fs.isdir(root):
            yield Skip(source, "file", "unreadable", "expected a file, found a directory")
            return
        with fsspec.open(source, "rb") as raw, open_decompressed(raw, compression_of(source)) as f:
            yield from read_records(kind, source, f, text_field, split, max_chars, WHOLE)
    except READ_ERRORS as err:
        yield Skip(source, "file", "unreadable", f"{type(err).__name__}: {err}")


def compression_of(path: str) -> str | None:
    """The compression suffix of a file name (COMPRESSIONS), or None."""
    name = path.lower()
    return next((c for c in COMPRESSIONS if name.endswith(c)), None)


def open_decompressed(raw, compression: str | None):
    """A readable binary file of the decompressed bytes of `raw` (itself when `compression` is None). Every stream
    or frame of the file is read: concatenated gzip members, bzip2 streams and zstd frames, as the tools that
    wrote them do."""
    if compression is None:
        return contextlib.nullcontext(raw)
    if compression == ".gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == ".bz2":
        return bz2.BZ2File(raw, "rb")
    if compression == ".xz":
        return lzma.LZMAFile(raw, "rb")
    import zstandard

    reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=False)
    return io.BufferedReader(reader, buffer_size=CHUNK)  # readline, which the text readers use


def read_region(
    source: str,
    region: Region,
    *,
    payload: bytes | None = None,
    fmt: str = "auto",
    on_error: str = "skip",
    text_field: str = "text",
    split: str = "file",
    max_document_chars: int = MAX_DOCUMENT_CHARS,
) -> Iterator[Document | Skip]:
    """Stream the Documents (and Skips) of one region of `source`; a "chunk" region's bytes are `payload`. Every
    document whose record begins in the region is read whole, as reading the whole file reads it."""
    kind = detect_format(source) if fmt == "auto" else fmt
    place = Place(
        first=region.first,
        whole=region.first and region.last,
        first_line=region.start if region.how == "chunk" else (1 if region.start == 0 else None),
        byte=region.stop if region.how == "chunk" else region.start,
    )
    try:
        with _open_region(source, region, payload) as f:
            if kind == "mediawiki":
                f = _WithRoot(f, opened=not region.first, closed=not region.last)
            rows = (region.start, region.stop) if region.how == "row_groups" else None
            for record in read_records(kind, source, f, text_field, split, max_document_chars, place, rows):
                if isinstance(record, Skip) and on_error == "fail" and record.reason not in FILTER_REASONS:
                    raise CorpusError(record)
                yield record
    except READ_ERRORS as err:
        where = f"bytes {region.start}-{region.stop}" if region.how == "bytes" else f"{region.how} {region.start}"
        skip = Skip(source, where, "unreadable", f"{type(err).__name__}: {err}")
        if on_error == "fail":
            raise CorpusError(skip) from None
        yield skip


@contextlib.contextmanager
def _open_region(source: str, region: Region, payload: bytes | None):
    if region.how == "chunk":
        if payload is None:
            raise ValueError(f"{source}: a chunk region is read from its payload, and none was given")
        yield io.BytesIO(payload)
        return
    with fsspec.open(source, "rb") as raw:  # no decompression: the region is a part of the file's own bytes
        if region.how == "row_groups":
            yield raw
            return
        raw.seek(region.start)
        window = _Window(raw, region.stop - region.start)
        yield bz2_streams(window) if region.how == "bz2_streams" else window


def bz2_streams(f, *, fast: bool = True):
    """A reader of the decompressed bytes of the consecutive bzip2 streams `f` holds (a multistream dump's region):
    indexed_bzip2's decoder on one thread where it is installed (the `bz2` extra: 0.85 of the standard library's
    CPU time, bench/bench_scale.py), else the standard library's (`fast=False` asks for it)."""
    if fast:
        try:
            import indexed_bzip2
        except ImportError:
            pass
        else:
            return _IndexedBz2Streams(indexed_bzip2.open(io.BytesIO(f.read()), parallelization=1))
    return _Bz2Streams(f)


class _Window:
    """read(n) over the next `size` bytes of a file (end of file after them)."""

    def __init__(self, f, size: int):
        self.f, self.left = f, size

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self.f.read(n) if n else b""
        self.left -= len(data)
        return data

    def readline(self, limit: int = -1) -> bytes:
        limit = self.left if limit < 0 else min(limit, self.left)
        line = self.f.readline(limit) if limit else b""
        self.left -= len(line)
        return line


class _Bz2Streams:
    """read(n) of the decompressed bytes of consecutive bzip2 streams (a multistream dump's region)."""

    def __init__(self, f):
        self.f, self.out = f, b""
        self.decompressor = bz2.BZ2Decompressor()

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self.out) < n:
            data = self.f.read(CHUNK)
            if not data:
                break
            while data:
                if self.decompressor.eof:  # the next stream begins in the bytes the last one left over
                    self.decompressor = bz2.BZ2Decompressor()
                self.out += self.decompressor.decompress(data)
                data = self.decompressor.unused_data if self.decompressor.eof else b""
        if n < 0:
            n = len(self.out)
        chunk, self.out = self.out[:n], self.out[n:]
        return chunk


class _IndexedBz2Streams:
    """read(n) of indexed_bzip2's file; its decoding errors (RuntimeError, ValueError) raised as OSError, one of
    READ_ERRORS, so a damaged stream is an `unreadable` skip as with the standard library's decoder. (Data cut off in
    the middle of a stream is one too, where the standard library's decoder returns the bytes before the cut.)"""

    def __init__(self, f):
        self.f = f

    def read(self, n: int = -1) -> bytes:
        try:
            return self.f.read(n)
        except (RuntimeError, ValueError) as err:
            raise OSError(f"bzip2: {err}") from None


class _WithRoot:
    """read(n) of a MediaWiki region with the export's root element around it where the region lacks it."""

    def __init__(self, f, *, opened: bool, closed: bool):
        self.f = f
        self.head = b"<mediawiki>" if opened else b""
        self.tail = b"</mediawiki>" if closed else b""

    def read(self, n: int = -1) -> bytes:
        if self.head:
            out, self.head = self.head, b""
            return out
        data = self.f.read(n)
        if data:
            return data
        out, self.tail = self.tail, b""
        return out
