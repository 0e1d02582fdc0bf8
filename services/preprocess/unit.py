"""The per-unit work of `albert preprocess`: one unit's documents → example tables (one per document group),
held-out rows and counts (UnitTransform), written and committed (`write_unit`: the shard and held-out part
renamed into place, then the done marker). Runs in the Ray Data workers; pure Python + pyarrow, no Ray."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from albert_core.corpus import Document, Skip, read_documents
from albert_core.files import file_sha256
from albert_core.pairs import create_pairs
from albert_core.sentences import split_sentences
from albert_core.shards import EXAMPLE_SCHEMA, HELDOUT_SCHEMA, example_id
from albert_core.tokenization import Tokenizer
from services.preprocess.config import PreprocessConfig, Unit
from services.preprocess.layout import Layout, write_json_atomic

MAX_SKIP_EXAMPLES = 10  # skip details kept per file in the manifest
GROUP_CHARS = 8_000_000  # a document group also closes at this many characters (bounds worker memory)


def heldout_hash(key: str, location: str) -> int:
    """A 64-bit hash of a document's file key and location: held out when below fraction * 2**64."""
    digest = hashlib.sha256(f"{key}\0{location}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def preprocess_sentences(tokenizer: Tokenizer, sentences: list[str]) -> list[str]:
    """[tokenizer.preprocess(s) for s in sentences] in one call on the newline-joined text. Equal because
    sentences hold no newline (split_sentences collapses whitespace) and every step stops at a newline
    (NFKD reordering, the final-sigma rule of lower())."""
    if not sentences:
        return []
    text = "\n".join(sentences)
    if text.count("\n") != len(sentences) - 1:  # a sentence with a newline: the plain way
        return [tokenizer.preprocess(s) for s in sentences]
    return tokenizer.preprocess(text).split("\n")


@dataclass
class FileStats:
    documents: int = 0  # records read (Documents and Skips)
    used: int = 0
    heldout: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> documents
    skip_examples: list[dict[str, str]] = field(default_factory=list)  # the first few: location, reason, detail
    sentences: int = 0
    tokens: int = 0  # SentencePiece tokens of its documents (held out included)

    def skip(self, location: str, reason: str, detail: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.skip_examples) < MAX_SKIP_EXAMPLES:
            self.skip_examples.append({"location": location, "reason": reason, "detail": detail})


@dataclass
class _Doc:
    file: str
    location: str
    sentences: list[str]
    ids: list[list[int]] = field(default_factory=list)


class UnitTransform:
    """One unit's documents → example tables (one per document group) + held-out rows + counts."""

    def __init__(self, unit: Unit, tokenizer: Tokenizer, config: PreprocessConfig):
        self.unit, self.tokenizer, self.config = unit, tokenizer, config
        self.pair_config = config.pair_config()
        self.files = {f.path: FileStats() for f in unit.files}
        self.pair_counts: Counter[str] = Counter()
        self.heldout: dict[str, list] = {"doc_id": [], "sentences": [], "word_starts": []}
        self.rows = 0
        self.example_tokens = 0
        self.groups = 0
        self._threshold = int(config.heldout_fraction * 2**64)

    def tables(self) -> Iterator[pa.Table]:
        """Example tables in EXAMPLE_SCHEMA, in a fixed order. Raises CorpusError under on_error="fail"."""
        config = self.config
        group: list[_Doc] = []
        chars = 0
        for f in self.unit.files:
            stats = self.files[f.path]
            records = read_documents(
                f.path,
                fmt=config.fmt,
                on_error=config.on_error,
                text_field=config.text_field,
                split=config.split,
                max_document_chars=config.max_document_chars,
            )
            for record in records:
                stats.documents += 1
                if isinstance(record, Skip):
                    stats.skip(record.location, record.reason, record.detail)
                    continue
                h = heldout_hash(f.key, record.location)
                if h < self._threshold:
                    self._hold_out(f.path, record, h >> 1)
                    continue
                group.append(_Doc(f.path, record.location, split_sentences(record.text)))
                chars += len(record.text)
                if len(group) >= config.docs_per_group or chars >= GROUP_CHARS:
                    yield self._pairs(group)
                    group, chars = [], 0
        if group:
            yield self._pairs(group)

    def _encode(self, docs: list[_Doc]) -> None:
        sentences = [s for d in docs for s in d.sentences]
        ids = self.tokenizer.sp.encode(preprocess_sentences(self.tokenizer, sentences), num_threads=1)
        start = 0
        for d in docs:
            d.ids = ids[start : start + len(d.sentences)]
            start += len(d.sentences)
            stats = self.files[d.file]
            stats.sentences += len(d.sentences)
            stats.tokens += sum(len(s) for s in d.ids)

    def _hold_out(self, path: str, record: Document, doc_id: int) -> None:
        doc = _Doc(path, record.location, split_sentences(record.text))
        self._encode([doc])
        self.files[path].heldout += 1
        sentences = [s for s in doc.ids if s]
        table = self.tokenizer.word_start_table
        self.heldout["doc_id"].append(doc_id)
        self.heldout["sentences"].append(sentences)
        self.heldout["word_starts"].append([table[np.asarray(s, dtype=np.int64)].tolist() for s in sentences])

    def _pairs(self, docs: list[_Doc]) -> pa.Table:
        self._encode(docs)
        rng = np.random.default_rng([self.config.seed, self.unit.index, self.groups])
        self.groups += 1
        tok = self.tokenizer
        result = create_pairs(
            [d.ids for d in docs], config=self.pair_config, rng=rng, cls_id=tok.cls_id, sep_id=tok.sep_id
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
        table = self._table(result.examples)
        self.rows += table.num_rows
        return table

    def _table(self, examples) -> pa.Table:
        n = len(examples)
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum([len(e.input_ids) for e in examples], out=offsets[1:])
        ids = np.concatenate([np.asarray(e.input_ids, dtype=np.int32) for e in examples] + [np.zeros(0, np.int32)])
        types = np.concatenate([np.asarray(e.token_type_ids, dtype=np.int8) for e in examples] + [np.zeros(0, np.int8)])
        starts = self.tokenizer.word_start_table[ids]
        labels = np.array([e.pair_label for e in examples], dtype=np.int8)
        rows = np.arange(self.rows, self.rows + n, dtype=np.int64)
        self.example_tokens += len(ids)
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

    def heldout_table(self) -> pa.Table:
        return pa.Table.from_pydict(self.heldout, schema=HELDOUT_SCHEMA)

    def summary(self) -> dict[str, Any]:
        return {
            "unit": self.unit.index,
            "shard": self.unit.shard_name,
            "rows": self.rows,
            "example_tokens": self.example_tokens,
            "heldout_documents": len(self.heldout["doc_id"]),
            "pair_counts": dict(sorted(self.pair_counts.items())),
            "files": {path: asdict(stats) for path, stats in self.files.items()},
        }


def write_unit(
    unit: Unit, tokenizer: Tokenizer, config: PreprocessConfig, fingerprint: str, layout: Layout | None = None
) -> dict[str, Any]:
    """Transform one unit and commit it: shard + held-out part renamed into place, then the done marker."""
    started, cpu_started = time.perf_counter(), time.process_time()
    layout = layout or Layout(config.output)
    shard, heldout = layout.shard(unit), layout.heldout_part(unit)
    partial_shard, partial_heldout = layout.partial(shard), layout.partial(heldout)
    layout.marker(unit).unlink(missing_ok=True)
    transform = UnitTransform(unit, tokenizer, config)
    try:
        with pq.ParquetWriter(partial_shard, EXAMPLE_SCHEMA, compression="zstd") as writer:
            for table in transform.tables():
                if table.num_rows:
                    writer.write_table(table, row_group_size=table.num_rows)
        pq.write_table(transform.heldout_table(), partial_heldout, compression="zstd")
    except BaseException:
        partial_shard.unlink(missing_ok=True)
        partial_heldout.unlink(missing_ok=True)
        raise
    os.replace(partial_shard, shard)
    os.replace(partial_heldout, heldout)
    summary = transform.summary()
    summary.update(
        fingerprint=fingerprint,
        sha256=file_sha256(shard),
        heldout_sha256=file_sha256(heldout),
        seconds=round(time.perf_counter() - started, 3),
        cpu_seconds=round(time.process_time() - cpu_started, 3),
    )
    write_json_atomic(layout.marker(unit), summary)
    return summary


def completed_summary(layout: Layout, unit: Unit, fingerprint: str) -> dict[str, Any] | None:
    """The unit's marker if it matches this plan and its shard and held-out part still have their sha256."""
    try:
        summary = json.loads(layout.marker(unit).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("fingerprint") != fingerprint:
        return None
    for path, key in ((layout.shard(unit), "sha256"), (layout.heldout_part(unit), "heldout_sha256")):
        if not path.is_file() or file_sha256(path) != summary.get(key):
            return None
    return summary
