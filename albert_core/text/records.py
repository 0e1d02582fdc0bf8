"""What reading a corpus yields (albert_core.text.corpus): one record per input document, a `Document` when it
could be read or a `Skip` naming why not; `CorpusError`, bad input under on_error="fail"; and `Place`, where a
reader's data lies in its file (the whole file, or a region of it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Document:
    source: str  # the file (path or URL)
    location: str  # "file", "line 12", "record 3", "row 7", "page 12 (Title)"
    text: str


@dataclass(frozen=True)
class Skip:
    source: str
    location: str
    reason: str  # missing, unreadable, binary, invalid_utf8, empty, too_long, malformed_record, missing_field,
    # malformed_parquet, malformed_xml, unknown_format; filters: redirect, namespace, markup_only
    detail: str


class CorpusError(ValueError):
    """Bad corpus input under on_error="fail"; the message names file, location and what was expected."""

    def __init__(self, skip: Skip):
        super().__init__(f"{skip.source}: {skip.location}: {skip.reason}: {skip.detail}")
        self.skip = skip


@dataclass(frozen=True)
class Place:
    """Where a reader's data lies in its file: file-level checks apply to the whole file only (and the head checks
    to the region that begins it), and line locations are labelled in file terms."""

    first: bool = True  # the data begins the file
    whole: bool = True  # the data is the whole file
    first_line: int | None = 1  # the number of the data's first line in the file, when known
    byte: int = 0  # the data's first byte in the file (labels lines when first_line is unknown)

    def line(self, n: int) -> str:
        if self.first_line is not None:
            return f"line {self.first_line + n - 1}"
        return f"byte {self.byte} + line {n}"


WHOLE = Place()
