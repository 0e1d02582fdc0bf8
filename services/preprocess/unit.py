"""The per-unit work of `albert preprocess`: one unit's documents → example tables (one per document group),
held-out rows, piece counts and file counts (UnitTransform), written and committed (`write_unit`: the shard, the
held-out part and the piece counts renamed into place, then the done marker). Runs in the Ray Data workers; pure
Python + pyarrow, no Ray.

Memory is bounded by one document group (`docs_per_group` documents or GROUP_CHARS characters), whatever the
unit's size: example tables are written to the shard as row groups when their group closes, held-out documents
in batches of HELDOUT_BATCH, and piece counts are summed as tables are made.

A document is known by the sha256 of its text (albert_core.examples.shards.document_hash): it is held out when its hash
is below heldout_fraction x 2**64, and its pair draws (target lengths, split points, SOP order) come from a generator
seeded by (seed, hash). So the held-out documents and, for SOP (and `none`), the examples are the same however
the corpus is cut into files, units and groups; only NSP's random B depends on the unit, being drawn from another
document of the same group.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from albert_core.evaluation.unigram import UnigramBaseline
from albert_core.examples.pairs import create_pairs
from albert_core.examples.shards import EXAMPLE_SCHEMA, HELDOUT_SCHEMA, PARQUET_WRITE_OPTIONS, document_hash, example_id
from albert_core.files import DiskFull, atomic_write_json, disk_full_as, file_sha256
from albert_core.text.corpus import read_documents, read_region
from albert_core.text.records import CorpusError, Document, Skip
from albert_core.text.sentences import split_sentences
from albert_core.text.tokenization import AnyTokenizer, Tokenizer, preprocess_sentences
from services.preprocess.config import PreprocessConfig, Unit
from services.preprocess.layout import Layout, kept_units
from services.preprocess.space import unit_bytes

MAX_SKIP_EXAMPLES = 10  # skip details kept per file in the manifest
GROUP_CHARS = 8_000_000  # a document group also closes at this many characters (bounds worker memory)
HELDOUT_BATCH = 256  # held-out documents written at a time
MARKER_SHA256 = ("sha256", "heldout_sha256", "pieces_sha256")  # a done marker's digests of Layout.unit_files
# What a unit's CPU time is spent on (its marker's `cpu_phases`): reading the records (decompression, JSON/XML,
# wikitext), their sha256, sentence splitting, ALBERT's text normalization (WordPiece's is inside its encode),
# SentencePiece/WordPiece, SOP/NSP pairs, Arrow arrays, Parquet writes, and committing (piece counts, sha256 of the
# outputs, the marker).
PHASES = ("read", "hash", "sentences", "clean", "encode", "pairs", "arrow", "parquet", "commit")


class PhaseClock:
    """This process's CPU seconds by phase: each `lap(phase)` charges the time since the previous lap to `phase`
    (one process_time call a lap, a few per document)."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._last = time.process_time()

    def lap(self, phase: str) -> None:
        now = time.process_time()
        self.seconds[phase] += now - self._last
        self._last = now

    def rounded(self) -> dict[str, float]:
        return {phase: round(seconds, 4) for phase, seconds in self.seconds.items()}


@dataclass
class FileStats:
    documents: int = 0  # records read (Documents and Skips)
    used: int = 0
    heldout: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> documents
    skip_examples: list[dict[str, str]] = field(default_factory=list)  # the first few: location, reason, detail
    sentences: int = 0
    tokens: int = 0  # tokens of its documents (held out included)

    def skip(self, location: str, reason: str, detail: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.skip_examples) < MAX_SKIP_EXAMPLES:
            self.skip_examples.append({"location": location, "reason": reason, "detail": detail})


@dataclass
class _Doc:
    file: str
    location: str
    hash: int  # document_hash of its text
    sentences: list[str]
    ids: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class StreamData:
    """What a unit whose region is a stream chunk reads: the chunk's bytes, and why the stream could not be read
    past them ("" when it could)."""

    payload: bytes
    error: str = ""


class UnitTransform:
    """One unit's documents → example tables (one per document group) + held-out batches + counts.

    `heldout` takes the held-out documents, a HELDOUT_SCHEMA table at a time; `stream` is what a unit whose region
    is a stream chunk reads; `clock` is charged with the CPU time of each phase."""

    def __init__(
        self,
        unit: Unit,
        tokenizer: AnyTokenizer,
        config: PreprocessConfig,
        *,
        heldout: Callable[[pa.Table], None],
        stream: StreamData | None = None,
        clock: PhaseClock | None = None,
    ):
        self.unit, self.tokenizer, self.config, self.stream = unit, tokenizer, config, stream
        self.clock = clock or PhaseClock()
        self.pair_config = config.pair_config()
        self.files = {f.path: FileStats() for f in unit.files}
        self.pair_counts: Counter[str] = Counter()
        self.pieces = np.zeros(tokenizer.vocab_size, dtype=np.int64)  # of the examples' input_ids
        self._heldout_sink = heldout
        self._heldout: dict[str, list] = {"doc_id": [], "sentences": [], "word_starts": []}
        self.heldout_documents = 0
        self.rows = 0
        self.example_tokens = 0
        self._threshold = int(config.heldout_fraction * 2**64)

    def records(self) -> Iterator[tuple[str, Document | Skip]]:
        """(file, record) of every document the unit reads, in order."""
        config = self.config
        options = {
            "fmt": config.fmt,
            "on_error": config.on_error,
            "text_field": config.text_field,
            "split": config.split,
            "max_document_chars": config.max_document_chars,
        }
        if self.unit.region is not None:
            (f,) = self.unit.files
            payload = None if self.stream is None else self.stream.payload
            for record in read_region(f.path, self.unit.region, payload=payload, **options):
                yield f.path, record
            if self.stream is not None and self.stream.error:  # the rest of the stream is unreadable
                line = self.unit.region.start + payload.count(b"\n")
                detail = f"the stream could not be read further: {self.stream.error}"
                skip = Skip(f.path, f"line {line}", "unreadable", detail)
                if config.on_error == "fail":
                    raise CorpusError(skip)
                yield f.path, skip
            return
        for f in self.unit.files:
            for record in read_documents(f.path, **options):
                yield f.path, record

    def tables(self) -> Iterator[pa.Table]:
        """Example tables in EXAMPLE_SCHEMA, in a fixed order. Raises CorpusError under on_error="fail"."""
        group: list[_Doc] = []
        chars = 0
        lap = self.clock.lap
        for path, record in self.records():
            lap("read")
            stats = self.files[path]
            stats.documents += 1
            if isinstance(record, Skip):
                stats.skip(record.location, record.reason, record.detail)
                continue
            h = document_hash(record.text)
            lap("hash")
            doc = _Doc(path, record.location, h, split_sentences(record.text))
            lap("sentences")
            if h < self._threshold:
                self._hold_out(doc)
                continue
            group.append(doc)
            chars += len(record.text)
            if len(group) >= self.config.docs_per_group or chars >= GROUP_CHARS:
                yield self._pairs(group)
                group, chars = [], 0
        lap("read")
        if group:
            yield self._pairs(group)
        self._flush_heldout()

    def _encode(self, docs: list[_Doc]) -> None:
        sentences = [s for d in docs for s in d.sentences]
        tok = self.tokenizer
        if isinstance(tok, Tokenizer):  # SentencePiece: ALBERT's normalization timed apart from the encode
            texts = preprocess_sentences(tok, sentences)
            self.clock.lap("clean")
            ids = tok.encode_preprocessed(texts)
        else:
            ids = tok.encode_batch(sentences)
        start = 0
        for d in docs:
            d.ids = ids[start : start + len(d.sentences)]
            start += len(d.sentences)
            stats = self.files[d.file]
            stats.sentences += len(d.sentences)
            stats.tokens += sum(len(s) for s in d.ids)
        self.clock.lap("encode")

    def _hold_out(self, doc: _Doc) -> None:
        self._encode([doc])
        self.files[doc.file].heldout += 1
        sentences = [s for s in doc.ids if s]
        table = self.tokenizer.word_start_table
        self._heldout["doc_id"].append(doc.hash >> 1)
        self._heldout["sentences"].append(sentences)
        self._heldout["word_starts"].append([table[np.asarray(s, dtype=np.int64)].tolist() for s in sentences])
        self.heldout_documents += 1
        self.clock.lap("arrow")
        if len(self._heldout["doc_id"]) >= HELDOUT_BATCH:
            self._flush_heldout()

    def _flush_heldout(self) -> None:
        if self._heldout["doc_id"]:
            table = pa.Table.from_pydict(self._heldout, schema=HELDOUT_SCHEMA)
            self.clock.lap("arrow")
            self._heldout_sink(table)
            self._heldout = {"doc_id": [], "sentences": [], "word_starts": []}
            self.clock.lap("parquet")

    def _pairs(self, docs: list[_Doc]) -> pa.Table:
        self._encode(docs)
        tok = self.tokenizer
        rngs = [np.random.default_rng([self.config.seed, d.hash]) for d in docs]
        result = create_pairs(
            [d.ids for d in docs], config=self.pair_config, rng=rngs, cls_id=tok.cls_id, sep_id=tok.sep_id
        )
        used = np.zeros(len(docs), dtype=bool)
        used[[e.doc_index for e in result.examples]] = True
        for d, was_used in zip(docs, used, strict=True):
            n_tokens = sum(len(s) for s in d.ids)
            if was_used:
                self.files[d.file].used += 1
            else:  # create_pairs' rule: fewer than two tokens in all
                reason = "no_tokens" if n_tokens == 0 else "single_token"
                self.files[d.file].skip(d.location, reason, f"{n_tokens} tokens: a pair needs at least 2")
        if int((~used).sum()) != sum(result.skipped_documents.values()):
            raise AssertionError(f"unit {self.unit.index}: pair skips {result.skipped_documents} != unused documents")
        self.pair_counts.update(result.counts)
        self.clock.lap("pairs")
        table = self._table(result.examples)
        self.rows += table.num_rows
        self.clock.lap("arrow")
        return table

    def _table(self, examples) -> pa.Table:
        n = len(examples)
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum([len(e.input_ids) for e in examples], out=offsets[1:])
        total = int(offsets[-1])  # the columns read straight from the examples' lists (no array per example)
        ids = np.fromiter(chain.from_iterable(e.input_ids for e in examples), dtype=np.int32, count=total)
        types = np.fromiter(chain.from_iterable(e.token_type_ids for e in examples), dtype=np.int8, count=total)
        starts = self.tokenizer.word_start_table[ids]
        labels = np.array([e.pair_label for e in examples], dtype=np.int8)
        rows = np.arange(self.rows, self.rows + n, dtype=np.int64)
        self.example_tokens += len(ids)
        self.pieces += np.bincount(ids, minlength=self.pieces.size)
        offsets_arr = pa.array(offsets)
        return pa.Table.from_arrays(
            [
                pa.array(example_id(self.unit.index, 0) + rows),
                pa.ListArray.from_arrays(offsets_arr, pa.array(ids)),
                pa.ListArray.from_arrays(offsets_arr, pa.array(types)),
                pa.ListArray.from_arrays(offsets_arr, pa.array(starts)),
                pa.array(labels),
            ],
            schema=EXAMPLE_SCHEMA,
        )

    def summary(self) -> dict[str, Any]:
        return {
            "unit": self.unit.index,
            "shard": self.unit.shard_name,
            "rows": self.rows,
            "example_tokens": self.example_tokens,
            "heldout_documents": self.heldout_documents,
            "pair_counts": dict(sorted(self.pair_counts.items())),
            "files": {path: asdict(stats) for path, stats in self.files.items()},
        }


def write_unit(
    unit: Unit,
    tokenizer: AnyTokenizer,
    config: PreprocessConfig,
    fingerprint: str,
    layout: Layout | None = None,
    stream: StreamData | None = None,
) -> dict[str, Any]:
    """Transform one unit and commit it: its shard, held-out part and piece counts renamed into place, then the
    done marker (the commit point). Each is written as it is made (a partial file), never held whole. A full disk
    removes the partial files and raises DiskFull (the unit is not committed; the finished ones are kept)."""
    layout = layout or Layout(config.output)
    kept = functools.partial(kept_units, layout)
    needed = unit_bytes(unit) + 8 * tokenizer.vocab_size  # about: its shard and held-out part, its piece counts
    with disk_full_as(layout.shard(unit), needed, kept):
        return _write_unit(unit, tokenizer, config, fingerprint, layout, stream)


def _write_unit(
    unit: Unit, tokenizer: AnyTokenizer, config: PreprocessConfig, fingerprint: str, layout: Layout, stream
) -> dict[str, Any]:
    started, cpu_started = time.perf_counter(), time.process_time()
    clock = PhaseClock()
    outputs = layout.unit_files(unit)  # shard, held-out part, piece counts
    partials = [layout.partial(path) for path in outputs]
    layout.marker(unit).unlink(missing_ok=True)
    try:
        with (
            pq.ParquetWriter(partials[0], EXAMPLE_SCHEMA, **PARQUET_WRITE_OPTIONS) as shard,
            pq.ParquetWriter(partials[1], HELDOUT_SCHEMA, **PARQUET_WRITE_OPTIONS) as heldout,
        ):
            transform = UnitTransform(unit, tokenizer, config, heldout=heldout.write_table, stream=stream, clock=clock)
            clock.lap("parquet")
            for table in transform.tables():
                if table.num_rows:
                    shard.write_table(table, row_group_size=table.num_rows)
                clock.lap("parquet")
        clock.lap("parquet")
        UnigramBaseline(transform.pieces).save_as(partials[2])
    except BaseException:
        for partial in partials:
            partial.unlink(missing_ok=True)
        raise
    for partial, path in zip(partials, outputs, strict=True):
        os.replace(partial, path)
    summary = transform.summary()
    summary.update(
        fingerprint=fingerprint,
        **{key: file_sha256(path) for key, path in zip(MARKER_SHA256, outputs, strict=True)},
        seconds=round(time.perf_counter() - started, 3),
        cpu_seconds=round(time.process_time() - cpu_started, 3),
        input_bytes=unit.size,
        region=None if unit.region is None else asdict(unit.region),
        worker=f"{socket.gethostname()}:{os.getpid()}",
        worker_peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),  # Linux: KiB
    )
    clock.lap("commit")
    summary["cpu_phases"] = clock.rounded()  # the marker's own writing is the one thing not counted
    try:
        atomic_write_json(layout.marker(unit), summary, kept_units(layout))
    except DiskFull:  # the unit is not committed: its files go, so that the space they took is free again
        for path in outputs:
            path.unlink(missing_ok=True)
        raise
    return summary


def phase_totals(summaries: list[dict[str, Any]]) -> dict[str, float]:
    """The CPU seconds of these units' markers by phase (PHASES), summed."""
    return {phase: round(sum(s.get("cpu_phases", {}).get(phase, 0.0) for s in summaries), 3) for phase in PHASES}


def completed_summary(layout: Layout, unit: Unit, fingerprint: str) -> dict[str, Any] | None:
    """The unit's marker if it matches this plan and its shard, held-out part and counts still have their sha256."""
    try:
        summary = json.loads(layout.marker(unit).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("fingerprint") != fingerprint:
        return None
    for path, key in zip(layout.unit_files(unit), MARKER_SHA256, strict=True):
        if not path.is_file() or file_sha256(path) != summary.get(key):
            return None
    return summary
