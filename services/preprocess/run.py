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

import hashlib
import json
import os
import posixpath
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from albert_core.corpus import (
    FORMATS,
    MAX_DOCUMENT_CHARS,
    ON_ERROR,
    SPLITS,
    CorpusError,
    Skip,
    list_inputs,
)
from albert_core.pairs import OBJECTIVES, PairConfig
from albert_core.shards import EXAMPLE_SCHEMA, HELDOUT_FILE, HELDOUT_SCHEMA, MANIFEST_FILE, TRAIN_DIR
from albert_core.tokenization import Tokenizer
from services.preprocess.checks import (
    EXPECTED_INPUT,
    MISSING_HINT,
    check_examples,
    check_output,
    check_tokenizer,
    missing_input,
)
from services.preprocess.manifest import commit_part, manifest_head, part_entry
from services.preprocess.manifest import write_json_atomic as _write_json_atomic
from services.preprocess.unit import UnitTransform

if TYPE_CHECKING:
    from collections.abc import Sequence

PROGRESS_DIR = ".progress"  # plan.json, done markers, partial files
PLAN_FILE = "plan.json"
LOCK_FILE = "manifest.lock"  # in .progress/: held while manifest.json is rewritten or an append claims its part


@dataclass
class PreprocessConfig:
    inputs: list[str]
    tokenizer: str  # spiece.model or a directory holding it
    output: str
    objective: str = "sop"  # sop | nsp | none
    max_seq_length: int = 512
    short_seq_prob: float = 0.1
    seed: int = 12345
    on_error: str = "skip"  # a bad file or record in the inputs: skip: a counted skip; fail: the job stops naming
    # file and line/record
    skip_missing_inputs: bool = False  # an input matching nothing: False: an error before anything runs; True: a
    # `missing` skip (the CLI's explicit --on-error skip)
    # Documents reserved for intrinsic evaluation, chosen by a hash of (file, location): stable across runs/seeds.
    heldout_fraction: float = 0.01
    # Consecutive input files are grouped into one shard up to this many bytes on disk (compressed size for
    # .gz/.bz2/.xz). A larger single file is one shard on its own: the reader cannot split files.
    shard_input_bytes: int = 16 << 20
    # Documents per create_pairs call: NSP takes its random B from another document of the same group.
    docs_per_group: int = 256
    fmt: str = "auto"  # corpus format (albert_core.corpus.FORMATS)
    text_field: str = "text"  # JSONL / Parquet field holding the document
    split: str = "file"  # plain text: one document per file, or per blank-line separated paragraph block
    max_document_chars: int = MAX_DOCUMENT_CHARS
    num_cpus: int | None = None  # concurrent tasks (one CPU each); None: every CPU of the Ray cluster
    progress: bool = True  # a progress bar over input files on the driver

    def __post_init__(self) -> None:
        if isinstance(self.inputs, str | os.PathLike):
            self.inputs = [self.inputs]
        self.inputs = [str(p) for p in self.inputs]
        self.tokenizer, self.output = str(self.tokenizer), str(self.output)
        if not self.inputs:
            raise ValueError("PreprocessConfig.inputs: expected at least one input path")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"PreprocessConfig.objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"PreprocessConfig.on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.fmt not in FORMATS:
            raise ValueError(f"PreprocessConfig.fmt must be one of {FORMATS}, got {self.fmt!r}")
        if self.split not in SPLITS:
            raise ValueError(f"PreprocessConfig.split must be one of {SPLITS}, got {self.split!r}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"PreprocessConfig.heldout_fraction must be in [0, 1), got {self.heldout_fraction!r}")
        for name in ("shard_input_bytes", "docs_per_group", "max_document_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PreprocessConfig.{name} must be an int >= 1, got {value!r}")
        if self.num_cpus is not None and (not isinstance(self.num_cpus, int) or self.num_cpus < 1):
            raise ValueError(f"PreprocessConfig.num_cpus must be None or an int >= 1, got {self.num_cpus!r}")
        self.pair_config()  # validates max_seq_length and short_seq_prob

    def pair_config(self) -> PairConfig:
        return PairConfig(
            max_seq_length=self.max_seq_length, short_seq_prob=self.short_seq_prob, objective=self.objective
        )

    def output_options(self) -> dict[str, Any]:
        """The options that decide the shards' bytes (not where they go, how fast, or what failure does)."""
        skip = {"inputs", "tokenizer", "output", "on_error", "skip_missing_inputs", "num_cpus", "progress"}
        return {k: v for k, v in asdict(self).items() if k not in skip}


# ----------------------------------------------------------------------------------------------------------
# planning


@dataclass(frozen=True)
class InputFile:
    path: str  # as list_inputs gives it (what the reader opens, and the manifest's key)
    key: str  # relative to the input it was found under: hashed for the held-out choice, so moving a corpus
    # directory keeps the same documents held out
    size: int  # bytes on disk; 0 for a path that does not exist (the reader reports it as missing)


@dataclass(frozen=True)
class Unit:
    index: int
    files: tuple[InputFile, ...]

    @property
    def shard_name(self) -> str:
        return f"shard-{self.index:05d}.parquet"

    def to_json(self) -> str:
        return json.dumps({"index": self.index, "files": [asdict(f) for f in self.files]})

    @classmethod
    def from_json(cls, text: str) -> Unit:
        data = json.loads(text)
        return cls(data["index"], tuple(InputFile(**f) for f in data["files"]))


def _file_key(path: str, root: str) -> str:
    """`path` relative to the input `root` it was listed under (spelled as list_inputs spells paths: absolute,
    or a full URL); the file name where root names the file itself or a glob."""
    fs, stripped = fsspec.core.url_to_fs(root)
    base = (fs.unstrip_protocol(stripped) if "://" in root else stripped).rstrip("/")
    if path.startswith(base + "/"):
        return path[len(base) + 1 :]
    return posixpath.basename(path.rstrip("/")) or path


def _size(path: str) -> int:
    try:
        fs, root = fsspec.core.url_to_fs(path)
        return int(fs.size(root)) if fs.isfile(root) else 0
    except (OSError, ValueError):
        return 0


def list_input_files(config: PreprocessConfig) -> list[InputFile]:
    """The input files in order (each input expanded by list_inputs, sorted; a file named twice is kept once). An
    input that matches nothing is a ValueError naming it, unless config.skip_missing_inputs."""
    files: list[InputFile] = []
    seen: set[str] = set()
    missing_roots = []
    for root in config.inputs:
        try:
            paths = list_inputs(root, fmt=config.fmt)
            missing = missing_input(root, paths)
        except (ImportError, OSError) as err:  # e.g. gs:// without gcsfs, a directory it may not list
            raise ValueError(f"input {root}: cannot be listed ({err})") from None
        if missing and not config.skip_missing_inputs:
            raise ValueError(f"input {root}: {missing} ({MISSING_HINT})")
        if missing:
            missing_roots.append(root)
        if not paths:
            known = "a known extension" if config.fmt == "auto" else f"format {config.fmt}"
            raise ValueError(f"{root}: no input files found (expected files with {known}, not hidden)")
        for path in paths:
            if path not in seen:
                seen.add(path)
                files.append(InputFile(path, _file_key(path, root), _size(path)))
    if len(missing_roots) == len(config.inputs):
        raise ValueError(f"input {' '.join(missing_roots)}: none of the inputs exists ({EXPECTED_INPUT})")
    return files


def plan_units(files: list[InputFile], shard_input_bytes: int, first: int = 0) -> list[Unit]:
    """Consecutive files grouped while they hold at most shard_input_bytes (a bigger file stands alone); the units
    are numbered from `first` (an appended part continues its shard set's numbering)."""
    units: list[Unit] = []
    current: list[InputFile] = []
    size = 0
    for f in files:
        if current and size + f.size > shard_input_bytes:
            units.append(Unit(first + len(units), tuple(current)))
            current, size = [], 0
        current.append(f)
        size += f.size
    if current:
        units.append(Unit(first + len(units), tuple(current)))
    return units


def plan_fingerprint(config: PreprocessConfig, tokenizer: Tokenizer, units: list[Unit]) -> str:
    plan = {
        "options": config.output_options(),
        "tokenizer_sha256": tokenizer.sha256,
        "units": [[asdict(f) for f in u.files] for u in units],
    }
    if units and units[0].index:  # an appended part (part 0's fingerprints stay as they were)
        plan["first_unit"] = units[0].index
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------------------
# output layout, markers, atomic writes


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _Layout:
    """Where one part's files go. Shards of every part: train/. Part 0 (a plain preprocess): progress in
    .progress/, held-out documents in heldout/documents.parquet; part k of an append: .progress/part-k/ and
    heldout/part-k.parquet."""

    def __init__(self, output: str, part: int = 0):
        self.root, self.part = Path(output), part
        self.train = self.root / TRAIN_DIR
        self.lock = self.root / PROGRESS_DIR / LOCK_FILE
        self.progress = self.root / PROGRESS_DIR / (f"part-{part}" if part else "")
        self.plan = self.progress / PLAN_FILE
        self.manifest = self.root / MANIFEST_FILE
        self.heldout_name = f"{posixpath.dirname(HELDOUT_FILE)}/part-{part}.parquet" if part else HELDOUT_FILE
        self.heldout = self.root / self.heldout_name

    def shard(self, unit: Unit) -> Path:
        return self.train / unit.shard_name

    def marker(self, unit: Unit) -> Path:
        return self.progress / f"shard-{unit.index:05d}.json"

    def heldout_part(self, unit: Unit) -> Path:
        return self.progress / f"heldout-{unit.index:05d}.parquet"

    def partial(self, path: Path) -> Path:
        return self.progress / f"{path.name}.partial"


def write_unit(
    unit: Unit, tokenizer: Tokenizer, config: PreprocessConfig, fingerprint: str, layout: _Layout | None = None
) -> dict[str, Any]:
    """Transform one unit and commit it: shard + held-out part renamed into place, then the done marker."""
    started, cpu_started = time.perf_counter(), time.process_time()
    layout = layout or _Layout(config.output)
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
        sha256=_sha256_file(shard),
        heldout_sha256=_sha256_file(heldout),
        seconds=round(time.perf_counter() - started, 3),
        cpu_seconds=round(time.process_time() - cpu_started, 3),
    )
    _write_json_atomic(layout.marker(unit), summary)
    return summary


def completed_summary(layout: _Layout, unit: Unit, fingerprint: str) -> dict[str, Any] | None:
    """The unit's marker if it matches this plan and its shard and held-out part still have their sha256."""
    try:
        summary = json.loads(layout.marker(unit).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("fingerprint") != fingerprint:
        return None
    for path, key in ((layout.shard(unit), "sha256"), (layout.heldout_part(unit), "heldout_sha256")):
        if not path.is_file() or _sha256_file(path) != summary.get(key):
            return None
    return summary


def _prepare_output(layout: _Layout, config: PreprocessConfig, fingerprint: str, units: list[Unit]) -> None:
    if not layout.plan.is_file() and (layout.train.exists() or layout.manifest.exists()):
        raise ValueError(
            f"{layout.root}: has {TRAIN_DIR}/ or {MANIFEST_FILE} but no {PROGRESS_DIR}/{PLAN_FILE}: not a resumable "
            "preprocess output; use a new --output directory"
        )
    refused = (
        f"{layout.root}: holds a preprocess run with other inputs, input sizes, tokenizer or options "
        f"({layout.plan}); use a new --output directory or delete this one"
    )
    claim_plan(layout, config, fingerprint, units, refused)


def claim_plan(layout: _Layout, config: PreprocessConfig, fingerprint: str, units: list[Unit], refused: str) -> None:
    """The part's progress folder made and claimed for this plan (its plan.json), or ValueError(refused) when it
    holds another plan; partial files an interrupted run left there are removed."""
    if layout.plan.is_file():
        try:
            old = json.loads(layout.plan.read_text()).get("fingerprint")
        except (OSError, ValueError, AttributeError):
            old = None
        if old != fingerprint:
            raise ValueError(refused)
    for d in (layout.train, layout.progress, layout.heldout.parent):
        d.mkdir(parents=True, exist_ok=True)
    if not layout.plan.is_file():
        plan = {
            "fingerprint": fingerprint,
            "options": config.output_options(),
            "units": [[f.path for f in u.files] for u in units],
        }
        _write_json_atomic(layout.plan, plan)
    for stale in layout.progress.glob("*.partial"):  # left by an interrupted run
        stale.unlink()


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
    batch: dict[str, np.ndarray], tokenizer: Tokenizer, config: PreprocessConfig, fingerprint: str, layout: _Layout
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


@dataclass(frozen=True)
class PreprocessJob:
    """A checked and planned run, made before Ray starts (plan_preprocess; services.preprocess.append for a part
    appended to a shard set)."""

    tokenizer: Tokenizer
    units: Sequence[Unit]
    fingerprint: str
    part: int = 0  # the part of the shard set it writes (0: a plain preprocess)
    name: str = "part-0"

    def layout(self, output: str) -> _Layout:
        return _Layout(output, self.part)


def plan_preprocess(config: PreprocessConfig) -> PreprocessJob:
    """Everything before Ray, so that a mistake costs no Ray start-up: the output checked, the tokenizer loaded
    and checked against max_seq_length, the inputs listed (ValueError for one matching nothing), the units
    planned, and the output claimed for this plan (plan.json; an output of another plan is refused)."""
    check_output(config.output)
    tokenizer = check_tokenizer(config)
    units = plan_units(list_input_files(config), config.shard_input_bytes)
    fingerprint = plan_fingerprint(config, tokenizer, units)
    _prepare_output(_Layout(config.output), config, fingerprint, units)
    return PreprocessJob(tokenizer, tuple(units), fingerprint)


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


def _run_units(config: PreprocessConfig, job: PreprocessJob, layout: _Layout) -> tuple[list[dict], dict[str, Any]]:
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


def _merge_heldout(layout: _Layout, units: list[Unit]) -> str:
    tables = [pq.read_table(layout.heldout_part(u), schema=HELDOUT_SCHEMA) for u in units]
    table = pa.concat_tables(tables) if tables else HELDOUT_SCHEMA.empty_table()
    partial = layout.partial(layout.heldout)
    pq.write_table(table, partial, compression="zstd")
    os.replace(partial, layout.heldout)
    return _sha256_file(layout.heldout)
