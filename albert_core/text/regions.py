"""Cutting a big corpus file into regions that readers take on their own (albert_core.text.corpus.read_region), so that
every CPU of a cluster can share one file.

- text (documents between blank lines) and JSONL, uncompressed: byte ranges starting on a record: for JSONL the
  byte after a newline, for text the first non-blank line after a blank line. A region ends where the next begins,
  so every record is read by exactly one region, whole.
- MediaWiki XML, uncompressed: byte ranges starting on a `<page>` tag (the reader supplies the root element).
- A bzip2 multistream MediaWiki dump with its index (`X-multistream-index.txt.bz2` beside `X-multistream.xml.bz2`):
  ranges of whole bzip2 streams (100 pages each), found in the index; each region decompresses only its streams.
- Parquet: ranges of row groups.
- A single-stream compressed file (.gz, .bz2 without an index, .xz, .zst) cannot be entered in the middle: it is
  read once, as a stream, and cut as it is read into chunks of whole records (`stream_chunks`) that are handed
  to the workers. Plain text read a document per file is never cut (a file is its one document).

Cut points are found by reading a little at each one (`cut_points`), never the whole file.
"""

from __future__ import annotations

import bz2
from collections.abc import Iterator
from dataclasses import dataclass, replace

import fsspec

from albert_core.text.corpus import READ_ERRORS, Region, compression_of, detect_format, open_decompressed

INDEX_SUFFIX = "-index.txt.bz2"  # X-multistream.xml.bz2's index is X-multistream-index.txt.bz2
_WINDOW = 1 << 16  # bytes read at a time while looking for a cut point
_MAX_RECORD = 1 << 28  # a cut point not found within this many bytes after its place is not looked for further
_STREAM_BLOCK = 1 << 18  # decompressed bytes read at a time (what is kept of a stream damaged in the next block)
# A compressed stream is cut into chunks of this many times the target (decompressed): about the target's worth of
# compressed input each, for text that compresses about 4:1 (JSONL and XML of prose: 3.5-5x with gzip, more with
# bzip2 and zstd).
STREAM_EXPANSION = 4


def index_of(path: str) -> str | None:
    """The multistream index beside a MediaWiki `...multistream.xml.bz2` dump, when there is one."""
    if not path.endswith(".xml.bz2") or "multistream" not in path.rsplit("/", 1)[-1]:
        return None
    index = path[: -len(".xml.bz2")] + INDEX_SUFFIX
    fs, root = fsspec.core.url_to_fs(index)
    return index if fs.isfile(root) else None


def is_index(path: str) -> bool:
    """A multistream dump's index file: it is read with its dump, never as a corpus of its own."""
    name = path.rsplit("/", 1)[-1]
    return "multistream" in name and name.endswith(INDEX_SUFFIX)


@dataclass(frozen=True)
class FileCut:
    """How a file is read: whole (regions empty), in regions, or as a compressed stream cut while it is read."""

    regions: tuple[Region, ...] = ()
    stream: bool = False  # a single-stream compressed file: read once, its records cut into chunks as they come


def plan_file(path: str, size: int, target: int, *, fmt: str = "auto", split: str = "file") -> FileCut:
    """The regions of about `target` bytes (on disk) a file of `size` bytes is read in; a file at most `target`
    bytes, or one that cannot be cut (plain text read as one document), is read whole."""
    kind = detect_format(path) if fmt == "auto" else fmt
    if size <= target or kind is None or (kind == "text" and split == "file"):
        return FileCut()
    compression = compression_of(path)
    if kind == "parquet" and compression is not None:
        return FileCut()  # a compressed Parquet file is read whole
    if compression is None:
        if kind == "parquet":
            return FileCut(_row_group_regions(path, target))
        points = cut_points(path, kind, size, target)
        return FileCut(_regions("bytes", points))
    index = index_of(path) if kind == "mediawiki" and compression == ".bz2" else None
    if index is not None:
        return FileCut(_regions("bz2_streams", stream_cut_points(index, size, target)))
    return FileCut(stream=True)


def _regions(how: str, points: list[int]) -> tuple[Region, ...]:
    last = len(points) - 2
    return tuple(
        Region(how, start, stop, first=i == 0, last=i == last)
        for i, (start, stop) in enumerate(zip(points[:-1], points[1:], strict=True))
    )


def _row_group_regions(path: str, target: int) -> tuple[Region, ...]:
    import pyarrow.parquet as pq

    with fsspec.open(path, "rb") as f:
        meta = pq.ParquetFile(f).metadata
    points, size = [0], 0
    for g in range(meta.num_row_groups):
        if size >= target and g > points[-1]:
            points.append(g)
            size = 0
        size += meta.row_group(g).total_byte_size
    points.append(meta.num_row_groups)
    if len(points) == 2:
        return ()
    return _regions("row_groups", points)


# --- record boundaries in uncompressed bytes --------------------------------------------------------------------


def first_cut(kind: str, data: bytes | bytearray, pos: int) -> int | None:
    """The first offset at or after `pos` in `data` where a record of `kind` begins, reading `data[pos - 1:]` as
    the middle of a line; None when `data` ends first (more bytes are needed to tell)."""
    if kind == "jsonl":
        end = data.find(b"\n", max(pos - 1, 0))
        return None if end < 0 else end + 1
    if kind == "mediawiki":
        at = data.find(b"<page>", pos)
        return None if at < 0 else at
    if kind != "text":
        raise ValueError(f"cannot cut a {kind} file by bytes")
    end = data.find(b"\n", max(pos - 1, 0))  # the line under pos ends here; the lines after it begin a record
    blank = False
    while end >= 0:
        start = end + 1
        end = data.find(b"\n", start)
        if end < 0:
            return None
        if data[start:end].strip():
            if blank:
                return start  # a non-blank line after a blank one: a document begins
        else:
            blank = True
    return None


def cut_points(path: str, kind: str, size: int, target: int) -> list[int]:
    """0, the offsets where regions of about `target` bytes begin (each on a record boundary), and `size`."""
    points = [0]
    with fsspec.open(path, "rb") as f:
        place = target
        while place < size:
            cut = _cut_near(f, kind, place, size)
            if cut is None:
                break
            if cut > points[-1] and cut < size:
                points.append(cut)
            place = max(cut, place) + target
    return [*points, size]


def _cut_near(f, kind: str, place: int, size: int) -> int | None:
    """The first record boundary at or after `place`, read from the file in windows (None: none before its end
    or within _MAX_RECORD bytes)."""
    start = place - 1
    f.seek(start)
    data = bytearray()
    while len(data) < _MAX_RECORD:
        block = f.read(_WINDOW)
        if not block:
            return None
        data += block
        cut = first_cut(kind, data, 1)
        if cut is not None:
            return start + cut
        if start + len(data) >= size:
            return None
    return None


# --- bzip2 multistream dumps --------------------------------------------------------------------------------


def stream_offsets(index: str) -> list[int]:
    """The byte offsets where the dump's page streams begin, from its index (lines `offset:page_id:title`)."""
    offsets: list[int] = []
    with fsspec.open(index, "rb") as raw, bz2.open(raw, "rb") as lines:
        for line in lines:
            head, sep, _ = line.partition(b":")
            if not sep:
                continue
            offset = int(head)
            if not offsets or offset != offsets[-1]:
                offsets.append(offset)
    if offsets != sorted(set(offsets)):
        raise ValueError(f"{index}: stream offsets are not increasing; not a multistream index")
    return offsets


def stream_cut_points(index: str, size: int, target: int) -> list[int]:
    """0, the stream offsets where regions of about `target` compressed bytes begin, and `size`. The first region
    also holds the header stream (the export's <siteinfo>), the last the closing one."""
    offsets = [o for o in stream_offsets(index) if 0 < o < size]
    points = [0]
    for offset in offsets:
        if offset - points[-1] >= target:
            points.append(offset)
    return [*points, size]


# --- single-stream compressed files ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """Whole records of a compressed stream: `data` decompressed, its first line's number there, where it began in
    the decompressed stream, how far into the compressed file the reader was when it was cut (for progress), and
    whether it ends the stream."""

    index: int
    data: bytes
    first_line: int
    offset: int  # decompressed bytes before it
    compressed_end: int  # compressed bytes read when it was cut
    last: bool
    error: str = ""  # the stream could not be read past this chunk: why (its reader reports it as a skip)

    def region(self) -> Region:
        return Region("chunk", self.first_line, self.offset, first=self.index == 0, last=self.last)


def stream_chunks(path: str, target: int, *, fmt: str = "auto", skip: int = 0) -> Iterator[Chunk]:
    """The decompressed stream of a compressed file cut into chunks of whole records of about `target` bytes, in
    order; the first `skip` chunks are cut but not returned (a resumed run has them). A chunk is returned once the
    next is cut, so that the last one is known to be last. The cuts depend on the decompressed bytes alone, so a
    rerun (a resume) cuts the same chunks."""
    pending: Chunk | None = None
    for chunk in _cut_stream(path, target, fmt):
        if pending is not None and pending.index >= skip:
            yield pending
        pending = chunk
    if pending is not None and pending.index >= skip:
        yield replace(pending, last=True)


def _cut_stream(path: str, target: int, fmt: str) -> Iterator[Chunk]:
    kind = detect_format(path) if fmt == "auto" else fmt
    compression = compression_of(path)
    if compression is None:
        raise ValueError(f"{path}: not a compressed file")
    index, lines, offset = 0, 1, 0
    buf = bytearray()
    with fsspec.open(path, "rb") as raw, open_decompressed(raw, compression) as f:
        done, error = False, ""
        while not done:
            try:
                block = f.read(_STREAM_BLOCK)
            except READ_ERRORS as err:  # damaged or cut short: what was read is kept, the rest is one skip
                block, error = b"", f"{type(err).__name__}: {err}"
            done = not block
            buf += block
            while buf and (len(buf) >= target or done):
                cut = len(buf) if done else first_cut(kind, buf, target)
                if cut is None:
                    break
                data = bytes(buf[:cut])
                del buf[:cut]
                yield Chunk(index, data, lines, offset, raw.tell(), last=False, error=error if done else "")
                index, lines, offset = index + 1, lines + data.count(b"\n"), offset + len(data)
                error = "" if done else error
        if error:  # the damage came right after a cut: an empty chunk reports it
            yield Chunk(index, b"", lines, offset, raw.tell(), last=False, error=error)
