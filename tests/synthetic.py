"""Synthetic data for tests and benchmarks (bench/ imports it too): corpora of any size made from real text, and
random shards (nothing downloaded at run time).

`distinct_documents` draws documents from the paragraphs of a source corpus (the sample corpus: State of the
Union addresses, Moby-Dick, Wikipedia articles): each is a seeded random run of paragraphs, its sentences
shuffled, so every document is distinct and reads like the source. The same seed gives the same documents. They
are written in the shapes users bring:

- `write_jsonl`: one JSONL file, a {"text": ...} record per line (optionally .gz / .zst compressed);
- `write_text_folder`: a folder of plain text files, documents separated by blank lines;
- `write_multistream_dump`: a MediaWiki XML export compressed as a bzip2 multistream dump with its index, the
  shape of Wikipedia's `*-pages-articles-multistream.xml.bz2` (a stream per 100 pages, plus a header and a closing
  stream; the index lists `offset:page_id:title` per page).

`write_random_shards` writes training shards of random token ids in the shard format (albert_core.examples.shards),
for tests and benchmarks that need shards but not real text.
"""

from __future__ import annotations

import bz2
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from xml.sax.saxutils import escape

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from albert_core.examples.shards import EXAMPLE_SCHEMA, example_id
from albert_core.text.corpus import list_inputs, read_documents
from albert_core.text.records import Document

PAGES_PER_STREAM = 100  # as Wikipedia's multistream dumps
MAX_PARAGRAPH_CHARS = 8000  # longer source paragraphs (a speech without blank lines) are cut at sentence ends
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffe\uffff]")  # not text (and not allowed in XML)


def source_paragraphs(inputs: Sequence[str], *, min_chars: int = 80) -> list[str]:
    """The paragraphs (blank-line separated, whitespace collapsed, control characters dropped, at most
    MAX_PARAGRAPH_CHARS: a longer one is cut between sentences) of the documents in `inputs`."""
    paragraphs = []
    for source in list_inputs(list(inputs)):
        for record in read_documents(source):
            if isinstance(record, Document):
                for block in re.split(r"\n\s*\n", _CONTROL.sub(" ", record.text)):
                    paragraphs += [p for p in _cut(" ".join(block.split())) if len(p) >= min_chars]
    if not paragraphs:
        raise ValueError(f"{', '.join(inputs)}: no paragraph of at least {min_chars} characters to draw from")
    return paragraphs


def _cut(paragraph: str) -> list[str]:
    pieces, current = [], ""
    for sentence in _SENTENCE_END.split(paragraph):
        if current and len(current) + len(sentence) > MAX_PARAGRAPH_CHARS:
            pieces.append(current)
            current = ""
        current = f"{current} {sentence}" if current else sentence
    return [*pieces, current[:MAX_PARAGRAPH_CHARS]] if current else pieces


def distinct_documents(
    paragraphs: Sequence[str], *, total_bytes: int, seed: int = 0, mean_paragraphs: int = 12
) -> Iterator[str]:
    """Documents of about `total_bytes` UTF-8 bytes in all: each a run of consecutive paragraphs from a random
    place, with its sentences shuffled within each paragraph, and a document number in its first line so no two
    are equal."""
    rng = np.random.default_rng(seed)
    written, number = 0, 0
    while written < total_bytes:
        count = int(rng.integers(1, 2 * mean_paragraphs))
        start = int(rng.integers(len(paragraphs)))
        body = []
        for paragraph in (paragraphs[(start + i) % len(paragraphs)] for i in range(count)):
            sentences = _SENTENCE_END.split(paragraph)
            rng.shuffle(sentences)
            body.append(" ".join(sentences))
        text = f"Document {number}.\n\n" + "\n\n".join(body)
        written += len(text.encode()) + 1
        number += 1
        yield text


def _open_out(path: Path, mode: str = "wt"):
    if path.suffix in (".gz", ".bz2", ".xz"):
        import gzip
        import lzma

        return {".gz": gzip, ".bz2": bz2, ".xz": lzma}[path.suffix].open(path, mode, encoding="utf-8")
    if path.suffix == ".zst":
        import io

        import zstandard

        return io.TextIOWrapper(zstandard.ZstdCompressor(level=3).stream_writer(open(path, "wb")), encoding="utf-8")
    return open(path, "w", encoding="utf-8")


def write_jsonl(documents: Iterator[str], path: str | Path) -> Path:
    """One {"text": ...} record per line (compressed by a .gz / .bz2 / .xz / .zst suffix)."""
    path = Path(path)
    with _open_out(path) as f:
        for text in documents:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return path


def write_text_folder(documents: Iterator[str], folder: str | Path, *, file_bytes: int = 64 << 20) -> Path:
    """Text files of about `file_bytes` each (part-00000.txt, ...), documents separated by blank lines; each
    document's own blank lines become single newlines, so a document is one blank-line block."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    index, size, f = 0, 0, None
    for text in documents:
        if f is None or size >= file_bytes:
            if f is not None:
                f.close()
            f = open(folder / f"part-{index:05d}.txt", "w", encoding="utf-8")
            index, size = index + 1, 0
        block = re.sub(r"\n\s*\n", "\n", text) + "\n\n"
        f.write(block)
        size += len(block.encode())
    if f is not None:
        f.close()
    return folder


def write_multistream_dump(documents: Iterator[str], path: str | Path) -> tuple[Path, Path]:
    """A MediaWiki export `...-multistream.xml.bz2` of one article per document (paragraphs as wikitext) and its
    index `...-multistream-index.txt.bz2`; returns both paths."""
    path = Path(path)
    if not path.name.endswith("-multistream.xml.bz2"):
        raise ValueError(f"{path}: a multistream dump's name ends with -multistream.xml.bz2")
    index_path = path.with_name(path.name[: -len(".xml.bz2")] + "-index.txt.bz2")
    header = (
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" xml:lang="en">\n'
        "  <siteinfo>\n    <sitename>Synthetic</sitename>\n  </siteinfo>\n"
    )
    index_lines: list[str] = []
    with open(path, "wb") as out:
        out.write(bz2.compress(header.encode()))
        pages: list[str] = []
        page_id = 0
        for text in documents:
            page_id += 1
            title = f"Article {page_id}"
            index_lines.append(f"{out.tell()}:{page_id}:{title}")  # where this page's stream will begin
            pages.append(_page(page_id, title, text))
            if len(pages) == PAGES_PER_STREAM:
                out.write(bz2.compress("".join(pages).encode()))
                pages = []
        if pages:
            out.write(bz2.compress("".join(pages).encode()))
        out.write(bz2.compress(b"</mediawiki>\n"))
    index_path.write_bytes(bz2.compress(("\n".join(index_lines) + "\n").encode()))
    return path, index_path


def _page(page_id: int, title: str, text: str) -> str:
    return (
        f"  <page>\n    <title>{escape(title)}</title>\n    <ns>0</ns>\n    <id>{page_id}</id>\n"
        f'    <revision>\n      <id>{page_id}</id>\n      <text xml:space="preserve">{escape(text)}</text>\n'
        "    </revision>\n  </page>\n"
    )


def write_random_shards(
    train_dir: Path, rows_per_file: tuple[int, ...], *, vocab_size: int, rng: np.random.Generator
) -> None:
    """Random [CLS] A [SEP] B [SEP] rows in the EXAMPLE_SCHEMA, `rows_per_file[i]` in shard i."""
    train_dir.mkdir(parents=True)
    for shard, n_rows in enumerate(rows_per_file):
        rows: dict[str, list] = {name: [] for name in EXAMPLE_SCHEMA.names}
        for row in range(n_rows):
            n_a, n_b = rng.integers(4, 13, size=2)
            ids = [2, *rng.integers(5, vocab_size, n_a), 3, *rng.integers(5, vocab_size, n_b), 3]
            starts = rng.random(len(ids)) < 0.7
            starts[[0, 1, n_a + 1, n_a + 2, len(ids) - 1]] = True
            rows["example_id"].append(example_id(shard, row))
            rows["input_ids"].append(ids)
            rows["token_type_ids"].append([0] * (n_a + 2) + [1] * (n_b + 1))
            rows["word_starts"].append(starts.tolist())
            rows["pair_label"].append(int(rng.integers(0, 2)))
        pq.write_table(pa.table(rows, schema=EXAMPLE_SCHEMA), train_dir / f"shard-{shard:05d}.parquet")
