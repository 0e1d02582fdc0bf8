"""What the driver decides before any worker starts: the vocabulary, the data plan, the PJRT runtime, and the
frozen `WorkerPlan` every worker receives."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from albert_core.config import ConfigError
from albert_core.files import CorruptCheckpoint
from albert_core.shards import EXAMPLE_SCHEMA, MANIFEST_FILE, TRAIN_DIR, ManifestError, ShardsManifest
from albert_core.tokenization import SPECIAL_PIECES, TokenIds, Tokenizer
from albert_core.unigram import UnigramBaseline, load_or_count
from services.run_config import RunConfig, TrainSection
from services.train.state import read_trainer_json

log = logging.getLogger(__name__)

COLUMNS = [f.name for f in EXAMPLE_SCHEMA]


def resolve_token_ids(shards_dir: Path, config: RunConfig) -> TokenIds:
    """Vocabulary size and special ids, from the first of these that exists.

    1. `model.overrides.vocab_size`, if set (non-zero). The special ids are ALBERT's layout: <pad>=0, <unk>=1,
       [CLS]=2, [SEP]=3, [MASK]=4.
    2. The tokenizer the shards were made with (`albert_core.shards.ShardsManifest.tokenizer_model`).
    3. `vocab_size` in manifest.json (at the top level or under `"tokenizer"`), again with ALBERT's layout.
    """
    override = config.model.overrides.get("vocab_size") or 0
    if override:
        return TokenIds(vocab_size=int(override))
    try:
        manifest = ShardsManifest.read(shards_dir)
    except ManifestError as err:
        raise ConfigError(f"data.shards: {err}") from None
    model = manifest.tokenizer_model()
    if model is not None:
        return TokenIds.from_tokenizer(Tokenizer.load(model))
    if manifest.vocab_size is not None and manifest.vocab_size > len(SPECIAL_PIECES):
        return TokenIds(vocab_size=manifest.vocab_size)
    raise ConfigError(
        f"data.shards: cannot tell the vocabulary size: no spiece.model in {shards_dir} or {shards_dir / 'tokenizer'}, "
        f"and {shards_dir / MANIFEST_FILE} has no vocab_size; set model.overrides.vocab_size"
    )


def shard_files(shards_dir: Path) -> dict[str, int]:
    """Every train shard file (sorted, absolute) with its row count; errors name data.shards and the file."""
    train_dir = shards_dir / TRAIN_DIR
    if not shards_dir.is_dir():
        raise ConfigError(f"data.shards: {shards_dir} does not exist (expected a preprocess output directory)")
    if not train_dir.is_dir():
        raise ConfigError(f"data.shards: {shards_dir} has no {TRAIN_DIR}/ directory of Parquet shards")
    files = sorted(str(p.resolve()) for p in train_dir.rglob("*.parquet"))
    if not files:
        raise ConfigError(f"data.shards: {train_dir} holds no .parquet files")
    rows = {}
    for path in files:
        try:
            meta = pq.ParquetFile(path)
        except Exception as err:  # pyarrow raises several types for a damaged footer
            raise ConfigError(f"data.shards: {path}: not a readable Parquet file ({err})") from None
        missing = [c for c in COLUMNS if c not in meta.schema_arrow.names]
        if missing:
            raise ConfigError(f"data.shards: {path}: lacks column {missing[0]!r} (expected {', '.join(COLUMNS)})")
        rows[path] = meta.metadata.num_rows
    return rows


def plan_data(shards_dir: Path, config: RunConfig) -> dict[str, int]:
    """The shard files and their row counts, checked to hold at least one global batch."""
    rows = shard_files(shards_dir)
    total = sum(rows.values())
    if total < config.train.global_batch_size:
        raise ConfigError(_too_few_examples(shards_dir, len(rows), total, config.train))
    _check_sequence_length(shards_dir, config)
    return rows


def _check_sequence_length(shards_dir: Path, config: RunConfig) -> None:
    """Rows longer than data.max_seq_length would fail the first step on a worker: refuse them here instead, by
    the max_seq_length the shards were preprocessed with (manifest.json's config; unknown: not checked)."""
    try:
        made = ShardsManifest.read(shards_dir).max_seq_length
    except ManifestError:
        return
    wanted = config.data.max_seq_length
    if made is not None and made > wanted:
        raise ConfigError(
            f"data.max_seq_length: {wanted}, but {shards_dir} was preprocessed with --max-seq-length {made} (its "
            f"{MANIFEST_FILE}); preprocess again with --max-seq-length {wanted} into a new --output, or train on "
            f"these with --set data.max_seq_length={made}"
        )


def _too_few_examples(shards_dir: Path, n_files: int, total: int, t: TrainSection) -> str:
    """plan_data's refusal, with the exact ways on: more text, or the largest global batch these examples hold."""
    start = f"train.global_batch_size: {t.global_batch_size} examples per step, but {shards_dir / TRAIN_DIR}"
    shards = f"{n_files} shard{'' if n_files == 1 else 's'}"
    more = "preprocess more text into a new --output (a shorter --max-seq-length also makes more examples)"
    if total == 0:
        return f"{start} holds no examples ({shards} of 0 rows); {more}"
    if total < t.num_workers:
        return f"{start} holds only {total} in {shards}, fewer than train.num_workers = {t.num_workers}; {more}"
    micro = min(t.micro_batch_size, total // t.num_workers)
    fit = total // (micro * t.num_workers) * micro * t.num_workers
    sets = f"--set train.global_batch_size={fit}"
    if micro != t.micro_batch_size:
        sets += f" --set train.micro_batch_size={micro}"
    return f"{start} holds only {total} in {shards}; {more}, or train on these with {sets}"


def unigram_for(shards_dir: Path, config: RunConfig) -> UnigramBaseline | None:
    """The shard set's unigram baseline (counted once, then stored beside its manifest); None without train shards."""
    train_dir = Path(shards_dir) / TRAIN_DIR
    files = sorted(train_dir.rglob("*.parquet")) if train_dir.is_dir() else []
    if not files:
        return None
    ids = resolve_token_ids(Path(shards_dir), config)
    return load_or_count(shards_dir, files, ids.vocab_size, ids.special_ids)


def config_hash(config: RunConfig) -> str:
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode()).hexdigest()


def init_data_position(init_from: Path) -> int:
    """The data position (examples seen) where the run that wrote checkpoint `init_from` stopped reading."""
    try:
        state = read_trainer_json(init_from)["state"]
    except CorruptCheckpoint as err:
        raise ConfigError(f"data.continue_from_init: {init_from} has no readable training state ({err})") from None
    if "examples_seen" not in state:
        raise ConfigError(f"data.continue_from_init: {init_from} records no data position (examples_seen)")
    return int(state["examples_seen"])


def pjrt_device_for(train: TrainSection, environ: Mapping[str, str] = os.environ) -> str:
    """The PJRT runtime of backend "xla" workers (TPU, CUDA or CPU), decided on the driver before any starts.

    The resources the workers hold decide it: TPU in `train.resources_per_worker` -> TPU, GPU -> CUDA. The
    driver's own PJRT_DEVICE does not override them: the TPU cluster recipes set PJRT_DEVICE=CPU on the head
    node, where the driver runs, and TPU on the TPU hosts. Without accelerator resources the workers use the PJRT
    CPU runtime, but only when that is asked for with PJRT_DEVICE=CPU in the driver's environment (tests, a
    laptop), so a TPU run that forgot its resources fails here instead of training on CPUs.
    """
    resources = train.resources_per_worker
    tpu, gpu = resources.get("TPU", 0) > 0, resources.get("GPU", 0) > 0
    if tpu and gpu:
        raise ConfigError("train.resources_per_worker: both TPU and GPU; backend 'xla' runs on one PJRT runtime")
    if tpu:
        return "TPU"
    if gpu:
        return "CUDA"
    asked = environ.get("PJRT_DEVICE", "").strip().upper()
    if asked == "CPU":
        return "CPU"
    if not asked:
        raise ConfigError(
            "train.resources_per_worker: backend 'xla' with no TPU or GPU per worker would run on the PJRT CPU "
            "runtime, which is used only when asked for: set PJRT_DEVICE=CPU in the driver's environment, or give "
            "the workers accelerators, e.g. resources_per_worker = {TPU = 1}"
        )
    if asked in ("TPU", "CUDA"):
        wanted = "TPU" if asked == "TPU" else "GPU"
        raise ConfigError(
            f"train.resources_per_worker: PJRT_DEVICE={asked} in the driver's environment but the workers hold no "
            f"{wanted}; add it, e.g. resources_per_worker = {{{wanted} = 1}}"
        )
    raise ConfigError(f"PJRT_DEVICE: expected CPU, TPU or CUDA in the driver's environment, got {asked!r}")


@dataclass(frozen=True)
class WorkerPlan:
    """Everything a worker needs, decided on the driver (it travels to every worker as train_loop_config)."""

    run: RunConfig
    run_dir: str
    token_ids: TokenIds
    shard_files: tuple[str, ...]  # sorted, absolute: the file numbering of the example order
    rows_per_file: tuple[int, ...]
    coordinator: str | None = None  # the run's coordinator actor; None: rank 0 keeps the ledger itself
    pjrt_device: str | None = None  # backend "xla": the PJRT runtime (pjrt_device_for)
    init_from: str | None = None  # model.init_from, resolved
    init_data_position: int | None = None  # data.continue_from_init: the source run's examples seen
    unigram_dir: str | None = None  # model.mlm_bias_init = "unigram": the shard set holding unigram.npy
    stop_after_step: int | None = None  # ALBERT_STOP_AFTER_STEP: simulate a crash right after this step
    trace_examples: str | None = None  # ALBERT_TRACE_EXAMPLES: a directory for per-step example-id traces

    @property
    def num_examples(self) -> int:
        return sum(self.rows_per_file)

    @property
    def checkpoints(self) -> Path:
        return Path(self.run_dir) / CHECKPOINTS_DIR


CHECKPOINTS_DIR = "checkpoints"
