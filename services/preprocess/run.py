"""`albert preprocess`: corpora → Parquet shards of `[CLS] A [SEP] B [SEP]` examples + manifest.json, on Ray Data.

The job is planned before anything is read: the input files (sorted, as `list_inputs` expands them) are cut into
*units* of consecutive files holding about `shard_input_bytes` of input. One unit becomes one shard,
`<output>/train/shard-XXXXX.parquet` (XXXXX = unit index), so a shard's content depends only on its files and the
seed, never on scheduling:

    units (one row each) ─ Ray Data map_batches (tasks of 1 CPU; SentencePiece is built once per worker process)
        per unit: read_documents → held out? (hash of file + location) → split_sentences → SentencePiece encode
                  → create_pairs per group of `docs_per_group` documents (NSP draws its random B in the group;
                    the group's generator is seeded by (seed, unit, group)) → Arrow table in EXAMPLE_SCHEMA
        → the shard (pyarrow only, written to a partial file then renamed) + the unit's held-out documents
        → a done marker (.progress/shard-XXXXX.json: sha256s and counts) written last: the commit point
    driver: progress bar over input files; merges held-out parts into heldout/documents.parquet; manifest.json

A shard set holds one or more *parts*: a plain run writes part 0; `--append-to` adds part k (services.
preprocess_append) planned and run by the same code, its units numbered after the set's shards (so shard names and
example ids stay unique), its progress in .progress/part-k/ and its held-out documents in heldout/part-k.parquet.
manifest.json lists every part (services.preprocess.manifest) and is the commit point of each: it is rewritten
atomically under .progress/manifest.lock, part 0 replaced with the later parts kept, or one part added.

Resume: a rerun into the same output keeps every shard whose marker matches the plan and whose file still has the
recorded sha256; everything else is redone from scratch. An output made by a different plan (other inputs, sizes,
tokenizer or options) is refused rather than mixed. `stream_examples` runs the same transform and returns the rows
as a Dataset without writing anything.

Before Ray: `plan_preprocess` checks everything that can be checked without reading the corpus (services.
preprocess_checks): an input that matches nothing is an error (unless `skip_missing_inputs`: then it is a `missing`
skip), the tokenizer loads, the output can be written and holds no other plan. After the run, one that made no
training example is an error and writes no manifest.json.

Accounting: every record the corpus reader yields is one document read, and is exactly one of used (it gave
examples), held out, or skipped (a reader Skip by its reason, or a pair skip: `no_tokens` / `single_token`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from albert_core.corpus import CorpusError, Skip
from albert_core.files import file_sha256
from albert_core.shards import HELDOUT_SCHEMA
from albert_core.tokenization import Tokenizer
from services.preprocess.checks import check_examples
from services.preprocess.config import PreprocessConfig, Unit
from services.preprocess.layout import Layout
from services.preprocess.manifest import commit_part, manifest_head, part_entry
from services.preprocess.plan import PreprocessJob, list_input_files, plan_preprocess, plan_units
from services.preprocess.unit import UnitTransform, completed_summary, write_unit

# ----------------------------------------------------------------------------------------------------------
# planning


# ----------------------------------------------------------------------------------------------------------
# output layout, markers, atomic writes


# ----------------------------------------------------------------------------------------------------------
# Ray Data glue


_TOKENIZERS: dict[str, Tokenizer] = {}  # per worker process: SentencePiece and the word-start table built once


def _worker_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """The process's ready copy of `tokenizer` (Ray reuses worker processes across tasks)."""
    cached = _TOKENIZERS.get(tokenizer.sha256)
    if cached is None or (cached.lower_case, cached.keep_accents) != (tokenizer.lower_case, tokenizer.keep_accents):
        _ = tokenizer.sp, tokenizer.word_start_table
        _TOKENIZERS[tokenizer.sha256] = cached = tokenizer
    return cached


def _write_shards(
    batch: dict[str, np.ndarray], tokenizer: Tokenizer, config: PreprocessConfig, fingerprint: str, layout: Layout
):
    """map_batches task: commit each unit of the batch; a CorpusError comes back as data, so the driver can raise
    it naming the file and line/record (not wrapped in Ray's task error)."""
    tokenizer = _worker_tokenizer(tokenizer)
    out = []
    for text in batch["unit"]:
        unit = Unit.from_json(str(text))
        try:
            summary = write_unit(unit, tokenizer, config, fingerprint, layout)
        except CorpusError as err:
            summary = {"unit": unit.index, "error": asdict(err.skip)}
        out.append(json.dumps(summary))
    return {"summary": np.array(out, dtype=object)}


def _stream_tables(batch: dict[str, np.ndarray], tokenizer: Tokenizer, config: PreprocessConfig) -> Iterator[pa.Table]:
    tokenizer = _worker_tokenizer(tokenizer)
    for text in batch["unit"]:
        for table in UnitTransform(Unit.from_json(str(text)), tokenizer, config).tables():
            if table.num_rows:
                yield table


def _workers(config: PreprocessConfig, n_units: int) -> int:
    import ray

    if config.num_cpus is not None:
        wanted = config.num_cpus
    else:
        if not ray.is_initialized():
            ray.init()
        wanted = int(ray.cluster_resources().get("CPU", 1))
    return max(1, min(wanted, n_units))


def _units_dataset(units: list[Unit], fn, fn_kwargs: dict, config: PreprocessConfig):
    """One row and one block per unit, mapped by plain tasks of one CPU each (measured: as fast as an actor pool
    on this work, and without an actor pool's seconds of start-up per run)."""
    import ray.data

    ds = ray.data.from_items([{"unit": u.to_json()} for u in units], override_num_blocks=len(units))
    ds.context.enable_progress_bars = False
    ds.context.execution_options.preserve_order = True
    return ds.map_batches(
        fn,
        batch_size=1,
        batch_format="numpy",
        num_cpus=1,
        compute=ray.data.TaskPoolStrategy(size=_workers(config, len(units))),
        fn_kwargs=fn_kwargs,
    )


def stream_examples(config: PreprocessConfig):
    """The examples as a ray.data.Dataset of EXAMPLE_SCHEMA rows, made on the fly (nothing is written): the same
    rows, ids and order as the shards run_preprocess writes."""
    tokenizer = Tokenizer.load(config.tokenizer)
    units = plan_units(list_input_files(config), config.shard_input_bytes)
    return _units_dataset(units, _stream_tables, {"tokenizer": tokenizer, "config": config}, config)


# ----------------------------------------------------------------------------------------------------------
# the driver


def _progress(config: PreprocessConfig, total: int, initial: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="file", desc="preprocess", disable=not config.progress)


def run_preprocess(config: PreprocessConfig, job: PreprocessJob | None = None) -> dict[str, Any]:
    """Preprocess (or resume) into config.output; returns the manifest it writes there. `job`: plan_preprocess's
    (made here when None), or an append's: its part is added to the manifest (services.preprocess.manifest), part 0
    replaced with the parts appended to it kept. NoExamplesError (manifest.json untouched) when the part has no
    example."""
    started = time.perf_counter()
    job = job or plan_preprocess(config)
    layout = job.layout(config.output)
    summaries, timings = _run_units(config, job, layout)
    heldout_sha = _merge_heldout(layout, list(job.units))
    entry, files = part_entry(job.name, config.inputs, job.units, summaries, (layout.heldout_name, heldout_sha))
    check_examples({**entry, "files": files}, config.output)
    head = manifest_head(asdict(config), job.tokenizer)
    timings = {"total_s": round(time.perf_counter() - started, 3), **timings}
    return commit_part(layout, entry, files, head, job.tokenizer, timings)


def _run_units(config: PreprocessConfig, job: PreprocessJob, layout: Layout) -> tuple[list[dict], dict[str, Any]]:
    """Every unit's done marker (completed ones kept, the others written on Ray Data), in unit order; timings."""
    units = list(job.units)
    summaries: dict[int, dict] = {}
    for unit in units:
        done = completed_summary(layout, unit, job.fingerprint)
        if done is not None:
            summaries[unit.index] = done
    resumed = len(summaries)
    pending = [u for u in units if u.index not in summaries]

    pipeline_started = time.perf_counter()
    if pending:
        n_files = {u.index: len(u.files) for u in units}
        with _progress(config, sum(n_files.values()), sum(n_files[i] for i in summaries)) as bar:
            kwargs = {"tokenizer": job.tokenizer, "config": config, "fingerprint": job.fingerprint, "layout": layout}
            ds = _units_dataset(pending, _write_shards, kwargs, config)
            for row in ds.iter_rows():
                summary = json.loads(row["summary"])
                if "error" in summary:
                    raise CorpusError(Skip(**summary["error"]))
                summaries[summary["unit"]] = summary
                bar.update(n_files[summary["unit"]])
    pipeline_seconds = time.perf_counter() - pipeline_started
    new_tokens = sum(f["tokens"] for u in pending for f in summaries[u.index]["files"].values())
    timings = {
        "pipeline_s": round(pipeline_seconds, 3),
        "shards_resumed": resumed,
        "shards_written": len(pending),
        "tokens_per_s": round(new_tokens / pipeline_seconds, 1) if pending and pipeline_seconds > 0 else None,
        "worker_s": round(sum(summaries[u.index]["seconds"] for u in pending), 3),  # wall time inside the tasks
        "worker_cpu_s": round(sum(summaries[u.index]["cpu_seconds"] for u in pending), 3),
    }
    return [summaries[u.index] for u in units], timings


def _merge_heldout(layout: Layout, units: list[Unit]) -> str:
    tables = [pq.read_table(layout.heldout_part(u), schema=HELDOUT_SCHEMA) for u in units]
    table = pa.concat_tables(tables) if tables else HELDOUT_SCHEMA.empty_table()
    partial = layout.partial(layout.heldout)
    pq.write_table(table, partial, compression="zstd")
    os.replace(partial, layout.heldout)
    return file_sha256(layout.heldout)
