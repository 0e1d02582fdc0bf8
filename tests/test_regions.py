"""albert_core.text.regions and corpus.read_region: a big file read in regions (or as a stream cut into chunks) yields
exactly the documents of reading it whole, in order, whatever the region size."""

from __future__ import annotations

import bz2
import gzip
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from albert_core.text.corpus import Region, bz2_streams, read_documents, read_region
from albert_core.text.records import Document, Skip
from albert_core.text.regions import cut_points, first_cut, index_of, is_index, plan_file, stream_chunks
from tests.synthetic import distinct_documents, write_jsonl, write_multistream_dump

PARAGRAPHS = [
    f"Paragraph {i} says something about topic {i % 7}. It has a second sentence! And a third one? Yes, {i}."
    for i in range(60)
]


def documents(n_bytes: int = 200_000, seed: int = 3) -> list[str]:
    return list(distinct_documents(PARAGRAPHS, total_bytes=n_bytes, seed=seed))


def texts(records) -> list[str]:
    return [r.text for r in records if isinstance(r, Document)]


def read_in_regions(path: str, target: int, **options) -> tuple[list, int]:
    cut = plan_file(path, len(open(path, "rb").read()), target, **options)
    assert not cut.stream
    return [r for region in cut.regions for r in read_region(path, region, **options)], len(cut.regions)


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return documents()


@pytest.mark.parametrize("target", [997, 4096, 65536])
def test_a_jsonl_file_read_in_regions_gives_the_documents_of_reading_it_whole(tmp_path, docs, target):
    path = str(write_jsonl(iter(docs), tmp_path / "c.jsonl"))
    parts, n = read_in_regions(path, target)
    assert n > 1 and texts(parts) == texts(read_documents(path)) == docs


@pytest.mark.parametrize("target", [1500, 20000])
def test_a_blank_line_text_file_read_in_regions_gives_the_same_documents(tmp_path, docs, target):
    path = tmp_path / "c.txt"
    # documents of several lines, separated by one or more blank (or whitespace-only) lines
    path.write_text("".join(d.replace("\n\n", "\n") + ("\n\n" if i % 3 else "\n \n\n") for i, d in enumerate(docs)))
    parts, n = read_in_regions(str(path), target, split="blank_line")
    assert n > 1 and texts(parts) == texts(read_documents(str(path), split="blank_line"))
    assert len(texts(parts)) == len(docs)


def test_a_mediawiki_export_read_in_regions_gives_the_same_articles(tmp_path, docs):
    dump, _ = write_multistream_dump(iter(docs), tmp_path / "w-multistream.xml.bz2")
    plain = tmp_path / "w.xml"
    plain.write_bytes(bz2.decompress(dump.read_bytes()))
    parts, n = read_in_regions(str(plain), 8000)
    assert n > 1 and texts(parts) == texts(read_documents(str(plain))) and len(texts(parts)) == len(docs)


def test_a_multistream_dump_is_cut_on_its_streams_and_each_region_reads_only_its_own(tmp_path):
    docs = documents(1_000_000)  # several streams of 100 pages
    dump, index = write_multistream_dump(iter(docs), tmp_path / "w-multistream.xml.bz2")
    assert index_of(str(dump)) == str(index) and is_index(str(index)) and not is_index(str(dump))
    cut = plan_file(str(dump), dump.stat().st_size, 4000)
    assert {r.how for r in cut.regions} == {"bz2_streams"} and len(cut.regions) > 2
    whole = texts(read_documents(str(dump)))
    assert len(whole) == len(docs)
    assert texts(r for region in cut.regions for r in read_region(str(dump), region)) == whole
    # a middle region decompresses only its bytes: it holds whole pages, none of the first region's
    middle = texts(read_region(str(dump), cut.regions[1]))
    assert middle and set(middle).isdisjoint(texts(read_region(str(dump), cut.regions[0])))


def test_indexed_bzip2_decompresses_a_multistream_region_as_the_standard_library_does(tmp_path):
    pytest.importorskip("indexed_bzip2")  # the `bz2` extra
    dump, _ = write_multistream_dump(iter(documents(400_000)), tmp_path / "w-multistream.xml.bz2")
    data = dump.read_bytes()
    fast, standard = bz2_streams(io.BytesIO(data)), bz2_streams(io.BytesIO(data), fast=False)
    assert type(fast) is not type(standard)
    assert b"".join(iter(lambda: fast.read(5000), b"")) == standard.read() == bz2.decompress(data)


def test_a_damaged_multistream_region_is_an_oserror_with_indexed_bzip2_too(tmp_path):
    pytest.importorskip("indexed_bzip2")
    data = bytearray(bz2.compress(b"<page>text</page>\n" * 2000))
    data[len(data) // 2] ^= 0xFF
    with pytest.raises(OSError, match="bzip2: "):
        bz2_streams(io.BytesIO(bytes(data))).read()


def test_parquet_is_cut_by_row_groups_and_rows_keep_their_numbers(tmp_path, docs):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": docs}), path, row_group_size=10)
    parts, n = read_in_regions(str(path), 5000)
    assert n > 1 and texts(parts) == docs
    assert [r.location for r in parts] == [f"row {i + 1}" for i in range(len(docs))]


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz", ".zst"])
def test_a_compressed_stream_cut_into_chunks_gives_the_same_documents_and_line_numbers(tmp_path, docs, suffix):
    path = str(write_jsonl(iter(docs), tmp_path / f"c.jsonl{suffix}"))
    assert plan_file(path, 10**9, 1000).stream
    chunks = list(stream_chunks(path, 3000))
    assert len(chunks) > 5 and chunks[-1].last and not any(c.last for c in chunks[:-1])
    records = [r for c in chunks for r in read_region(path, c.region(), payload=c.data)]
    assert texts(records) == texts(read_documents(path)) == docs
    assert [r.location for r in records] == [f"line {i + 1}" for i in range(len(docs))]
    assert [c.index for c in stream_chunks(path, 3000, skip=3)] == [c.index for c in chunks[3:]]


def test_a_bad_record_in_a_region_is_located_by_the_region_and_its_line(tmp_path):
    lines = [json.dumps({"text": f"document {i} " * 20}) for i in range(200)]
    lines[150] = "{not json"
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines) + "\n")
    parts, _ = read_in_regions(str(path), 2000)
    (skip,) = [r for r in parts if isinstance(r, Skip)]
    assert skip.reason == "malformed_record" and skip.location.startswith("byte ")
    start, line = skip.location.removeprefix("byte ").split(" + line ")
    with open(path, "rb") as f:
        f.seek(int(start))
        assert f.read().split(b"\n")[int(line) - 1] == b"{not json"


def test_first_cut_finds_record_starts_only():
    assert first_cut("jsonl", b'{"a": 1}\n{"b": 2}\n', 3) == 9
    assert first_cut("jsonl", b'{"a": 1}\n{"b"', 9) == 9  # pos right after a newline is a record start
    assert first_cut("jsonl", b'{"a": 1', 3) is None
    assert first_cut("text", b"one\ntwo\n\nthree\nfour\n", 2) == 9  # the first line after a blank one
    assert first_cut("text", b"one\n  \t\nthree\n", 1) == 8  # a whitespace-only line is blank
    assert first_cut("text", b"one\ntwo\nthree\n", 1) is None
    assert first_cut("mediawiki", b"</page>\n  <page>\n", 1) == 10


def test_a_file_at_most_the_target_or_one_document_per_file_is_read_whole(tmp_path, docs):
    path = str(write_jsonl(iter(docs), tmp_path / "c.jsonl"))
    size = len(open(path, "rb").read())
    assert plan_file(path, size, size).regions == () and not plan_file(path, size, size).stream
    text = tmp_path / "one.txt"
    text.write_text("\n".join(docs))
    assert plan_file(str(text), text.stat().st_size, 100, split="file").regions == ()


def test_cut_points_split_a_file_into_regions_of_about_the_target(tmp_path, docs):
    path = str(write_jsonl(iter(docs), tmp_path / "c.jsonl"))
    size = len(open(path, "rb").read())
    points = cut_points(path, "jsonl", size, 10_000)
    assert points[0] == 0 and points[-1] == size and points == sorted(set(points))
    gaps = [b - a for a, b in zip(points[:-1], points[1:], strict=True)]
    assert all(g >= 10_000 - 1 for g in gaps[:-1]) and max(gaps) < 10_000 + 2 * max(len(d) for d in docs) + 100


def test_a_stream_cut_short_keeps_the_chunks_before_the_damage_and_reports_it_once(tmp_path):
    docs = documents(2_000_000)  # several blocks of decompressed stream before the damage
    path = tmp_path / "c.jsonl.gz"
    data = gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in docs).encode())
    path.write_bytes(data[: len(data) // 2])  # cut short
    chunks = list(stream_chunks(str(path), 30_000))
    assert [bool(c.error) for c in chunks] == [False] * (len(chunks) - 1) + [True] and chunks[-1].last
    read = texts(r for c in chunks for r in read_region(str(path), c.region(), payload=c.data))
    assert 0 < len(read) < len(docs) and read == docs[: len(read)]
    assert "EOFError" in chunks[-1].error or "Error" in chunks[-1].error


def test_a_region_of_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="Region.how"):
        Region("lines", 0, 1, first=True, last=True)
