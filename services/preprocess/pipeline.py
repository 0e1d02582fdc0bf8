"""`albert preprocess`: corpora → Parquet shards of `[CLS] A [SEP] B [SEP]` examples + manifest.json, on Ray Data.

The job is planned before anything is read (services.preprocess.plan): the input files are cut into *units* of
about `shard_input_bytes` of input: consecutive small files, or one region of a big file (a byte range on record
boundaries, Parquet row groups, bzip2 streams of a multistream dump: albert_core.text.regions), so that every CPU of
the cluster shares a big file. A single-stream compressed file (.gz, .bz2 without an index, .xz, .zst) cannot be
entered in the middle: one reader streams it and cuts it into chunks of whole records as it goes, and each chunk
is a unit handed to the workers with its bytes. One unit becomes one shard, `<output>/train/shard-XXXXX.parquet`
(XXXXX = unit index), so a shard's content depends only on its input and the seed, never on scheduling:

    units (one row each) ┬─ Ray Data map_batches (tasks of 1 CPU; the tokenizer built once per worker process)
    stream files ─ flat_map: read once, cut into chunks ┘
        per unit: read its documents → held out? (sha256 of the text) → split_sentences → encode (SentencePiece
                  or WordPiece: albert_core.text.tokenization.load_tokenizer)
                  → create_pairs per group of `docs_per_group` documents (each document's draws seeded by
                    (seed, its hash); NSP draws its random B in the group) → Arrow tables in EXAMPLE_SCHEMA
        → the shard, its held-out documents and its piece counts, each written as made to a partial file, renamed
        → a done marker (.progress/shard-XXXXX.json: sha256s and counts) written last: the commit point
    driver: progress in input bytes (rate, ETA); the held-out parts merged into heldout/documents.parquet;
            piece counts summed (the unigram baseline); manifest.json

A shard set holds one or more *parts*: a plain run writes part 0; `--append-to` adds part k (services.preprocess.
append) planned and run by the same code, its units numbered after the set's shards (so shard names and example
ids stay unique), its progress in .progress/part-k/ and its held-out documents in heldout/part-k.parquet.
manifest.json lists every part (services.preprocess.manifest) and is the commit point of each.

Resume: a rerun into the same output keeps every unit whose marker matches the plan and whose files still have
their recorded sha256 (a stream is read again, its finished chunks cut but not redone); everything else is
redone from scratch. An output made by a different plan is refused rather than mixed.

Accounting: every record the corpus reader yields is one document read, and is exactly one of used (it gave
examples), held out, or skipped (a reader Skip by its reason, or a pair skip: `no_tokens` / `single_token`).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from albert_core.examples.shards import HELDOUT_SCHEMA, PARQUET_WRITE_OPTIONS
from albert_core.files import DiskFull, file_sha256, replacing
from albert_core.text.records import CorpusError, Skip
from albert_core.text.regions import STREAM_EXPANSION, stream_chunks
from albert_core.text.tokenization import AnyTokenizer
from services.cluster import connect
from services.preprocess.checks import check_examples
from services.preprocess.config import STREAM_UNITS, InputFile, PreprocessConfig, StreamInput, Unit
from services.preprocess.layout import Layout, kept_units
from services.preprocess.manifest import commit_part, manifest_head, part_entry
from services.preprocess.plan import Plan, PreprocessJob, plan_preprocess
from services.preprocess.unit import StreamData, completed_summary, phase_totals, write_unit

# ----------------------------------------------------------------------------------------------------------
# Ray Data glue


_TOKENIZERS: dict[str, AnyTokenizer] = {}  # per worker process: the tokenizer and word-start table built once


def _worker_tokenizer(tokenizer: AnyTokenizer) -> AnyTokenizer:
    """The process's ready copy of `tokenizer` (Ray reuses worker processes across tasks)."""
    cached = _TOKENIZERS.get(tokenizer.sha256)
    if cached is None or (cached.lower_case, cached.keep_accents) != (tokenizer.lower_case, tokenizer.keep_accents):
        _ = tokenizer.encode(""), tokenizer.word_start_table
        _TOKENIZERS[tokenizer.sha256] = cached = tokenizer
    return cached


def _rows(batch: dict[str, np.ndarray]) -> Iterator[tuple[Unit, StreamData | None]]:
    """(unit, its stream chunk's bytes and read error, for a chunk) of each row."""
    for text, payload, error in zip(batch["unit"], batch["payload"], batch["error"], strict=True):
        unit = Unit.from_json(str(text))
        is_chunk = unit.region is not None and unit.region.how == "chunk"
        yield unit, (StreamData(bytes(payload), str(error)) if is_chunk else None)


def _write_shards(
    batch: dict[str, np.ndarray], tokenizer: AnyTokenizer, config: PreprocessConfig, fingerprint: str, layout: Layout
):
    """map_batches task: commit each unit of the batch; a CorpusError or a full disk (DiskFull) comes back as data, so
    the driver can raise it as its one line (not wrapped in Ray's task error)."""
    tokenizer = _worker_tokenizer(tokenizer)
    out = []
    for unit, data in _rows(batch):
        try:
            summary = write_unit(unit, tokenizer, config, fingerprint, layout, data)
        except CorpusError as err:
            summary = {"unit": unit.index, "error": asdict(err.skip)}
        except DiskFull as err:
            summary = {"unit": unit.index, "disk_full": str(err), "path": err.path}
        out.append(json.dumps(summary))
    return {"summary": np.array(out, dtype=object)}


def _stream_units(row: dict[str, Any], config: PreprocessConfig, done: frozenset[int]) -> Iterator[dict[str, Any]]:
    """flat_map over a stream file: its chunks as units with their bytes (those of `done` units cut, not handed on)."""
    stream = StreamInput(InputFile(**json.loads(row["file"])), int(row["first"]))
    read_to = 0
    for chunk in stream_chunks(stream.file.path, STREAM_EXPANSION * config.shard_input_bytes, fmt=config.fmt):
        unit = stream.unit(chunk.index, chunk.region(), chunk.compressed_end - read_to)
        read_to = chunk.compressed_end
        if unit.index not in done:
            yield {"unit": unit.to_json(), "payload": chunk.data, "error": chunk.error}


def _workers(config: PreprocessConfig) -> int:
    import ray

    if config.num_cpus is not None:
        return config.num_cpus
    connect()
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def _work_dataset(units: list[Unit], streams: list[StreamInput], done: set[int], fn, fn_kwargs, config):
    """One row per unit, and a reader per stream file that cuts it into unit rows as it reads; mapped by plain tasks
    of one CPU each (measured: as fast as an actor pool on this work, without its seconds of start-up)."""
    import ray.data

    workers = _workers(config)
    parts = []
    if units:
        rows = [{"unit": u.to_json(), "payload": b"", "error": ""} for u in units]
        parts.append(ray.data.from_items(rows, override_num_blocks=len(units)))
    if streams:
        rows = [{"file": json.dumps(asdict(s.file)), "first": s.first} for s in streams]
        readers = ray.data.from_items(rows, override_num_blocks=len(streams))
        # A reader decompresses and cuts (light next to tokenizing): it holds no CPU the workers need.
        parts.append(
            readers.flat_map(
                _stream_units,
                fn_kwargs={"config": config, "done": frozenset(done)},
                num_cpus=0,
                concurrency=min(len(streams), max(1, workers // 4)),
            )
        )
    ds = parts[0] if len(parts) == 1 else parts[0].union(*parts[1:])
    if streams:  # every chunk a block of its own, so each is a task of its own (not several to a block)
        ds.context.target_max_block_size = 1
    ds.context.enable_progress_bars = False
    ds.context.execution_options.preserve_order = False
    return ds.map_batches(
        fn,
        batch_size=1,
        batch_format="numpy",
        num_cpus=1,
        compute=ray.data.TaskPoolStrategy(size=max(1, min(workers, len(units) + 4 * len(streams)))),
        fn_kwargs=fn_kwargs,
    )


# ----------------------------------------------------------------------------------------------------------
# the driver


def _progress(config: PreprocessConfig, total: int, initial: int):
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="preprocess",
        disable=not config.progress,
    )


def run_preprocess(config: PreprocessConfig, job: PreprocessJob | None = None) -> dict[str, Any]:
    """Preprocess (or resume) into config.output; returns the manifest it writes there. `job`: plan_preprocess's
    (made here when None), or an append's: its part is added to the manifest (services.preprocess.manifest), part 0
    replaced with the parts appended to it kept. NoExamplesError (manifest.json untouched) when the part has no
    example."""
    started = time.perf_counter()
    job = job or plan_preprocess(config)
    try:
        return _run(config, job, started)
    finally:
        job.release()


def _run(config: PreprocessConfig, job: PreprocessJob, started: float) -> dict[str, Any]:
    layout = job.layout(config.output)
    summaries, timings = _run_units(config, job, layout)
    heldout_sha = _merge_heldout(layout, [s["unit"] for s in summaries])
    entry, files = part_entry(job.name, config.inputs, summaries, (layout.heldout_name, heldout_sha))
    check_examples({**entry, "files": files}, config.output)
    head = manifest_head(asdict(config), job.tokenizer)
    timings = {"total_s": round(time.perf_counter() - started, 3), **timings}
    return commit_part(layout, entry, files, head, job.tokenizer, timings, [s["unit"] for s in summaries])


def finished_units(layout: Layout, plan: Plan, fingerprint: str) -> dict[int, dict]:
    """The done markers that match this plan (a stream's: every chunk a previous run committed), by unit index."""
    done: dict[int, dict] = {}
    for unit in plan.units:
        if (summary := completed_summary(layout, unit, fingerprint)) is not None:
            done[unit.index] = summary
    for stream in plan.streams:
        for index in layout.marked_units(stream.first, stream.first + STREAM_UNITS):
            if (summary := completed_summary(layout, Unit(index, (stream.file,)), fingerprint)) is not None:
                done[index] = summary
    return done


def _run_units(config: PreprocessConfig, job: PreprocessJob, layout: Layout) -> tuple[list[dict], dict[str, Any]]:
    """Every unit's done marker (completed ones kept, the others written on Ray Data), in unit order; timings."""
    plan = job.plan
    summaries = finished_units(layout, plan, job.fingerprint)
    resumed = dict(summaries)
    pending = [u for u in plan.units if u.index not in summaries]
    pipeline_started = time.perf_counter()
    if pending or plan.streams:
        done_bytes = sum(s.get("input_bytes", 0) for s in summaries.values())
        with _progress(config, plan.input_bytes, done_bytes) as bar:
            kwargs = {"tokenizer": job.tokenizer, "config": config, "fingerprint": job.fingerprint, "layout": layout}
            ds = _work_dataset(pending, list(plan.streams), set(resumed), _write_shards, kwargs, config)
            for row in ds.iter_rows():
                summary = json.loads(row["summary"])
                if "error" in summary:
                    raise CorpusError(Skip(**summary["error"]))
                if "disk_full" in summary:
                    raise DiskFull(summary["disk_full"], summary["path"])
                summaries[summary["unit"]] = summary
                bar.update(summary["input_bytes"])
    pipeline_seconds = time.perf_counter() - pipeline_started
    written = [s for index, s in summaries.items() if index not in resumed]
    new_tokens = sum(f["tokens"] for s in written for f in s["files"].values())
    timings = {
        "pipeline_s": round(pipeline_seconds, 3),
        "shards_resumed": len(resumed),
        "shards_written": len(written),
        "tokens_per_s": round(new_tokens / pipeline_seconds, 1) if written and pipeline_seconds > 0 else None,
        "worker_s": round(sum(s["seconds"] for s in written), 3),  # wall time inside the tasks
        "worker_cpu_s": round(sum(s["cpu_seconds"] for s in written), 3),
        "worker_cpu_phases": phase_totals(written),  # where that CPU time went (services.preprocess.unit.PHASES)
        # the largest peak resident memory of a worker process that wrote a unit (its whole life, in MB)
        "worker_peak_rss_mb": max((s.get("worker_peak_rss_mb", 0) for s in written), default=None),
    }
    return [summaries[i] for i in sorted(summaries)], timings


def _merge_heldout(layout: Layout, units: list[int]) -> str:
    """The units' held-out parts, in unit order, copied batch by batch into the part's held-out file."""
    partial = layout.partial(layout.heldout)
    parts = [layout.heldout_part(Unit(index, ())) for index in units]
    needed = sum(p.stat().st_size for p in parts)  # about: the parts are merged as they are
    with (
        replacing(layout.heldout, partial, needed, functools.partial(kept_units, layout)),
        pq.ParquetWriter(partial, HELDOUT_SCHEMA, **PARQUET_WRITE_OPTIONS) as writer,
    ):
        for part in parts:
            for batch in pq.ParquetFile(part).iter_batches(batch_size=1024):
                writer.write_table(pa.Table.from_batches([batch], schema=HELDOUT_SCHEMA))
    return file_sha256(layout.heldout)
