"""What the driver decides before any worker starts: the vocabulary, the data plan, the PJRT runtime, model.init_from,
the run directory, and the frozen `WorkerPlan` every worker receives (make_plan, which services.train.driver's
prepare_run calls)."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from albert_core.evaluation.intrinsic import pairable_heldout
from albert_core.evaluation.unigram import UnigramBaseline, load_or_count
from albert_core.examples.masking import MASK_SCHEME
from albert_core.examples.order import ExampleOrder
from albert_core.examples.shards import (
    EXAMPLE_SCHEMA,
    HELDOUT_FILE,
    MANIFEST_FILE,
    TRAIN_DIR,
    ManifestError,
    ShardsManifest,
)
from albert_core.files import CorruptCheckpoint, SpaceNeed, check_space, free_bytes
from albert_core.model.config import ConfigError
from albert_core.model.stacking import InitSummary, check_init_source
from albert_core.text.tokenization import SPECIAL_PIECES, TokenIds, load_tokenizer, tokenizer_files
from albert_core.text.vocabulary import Vocabulary, VocabularyMismatch, check_vocabulary, shards_vocabulary
from services.rundir.checkpoints import CHECKPOINTS_DIR, list_checkpoints, read_trainer_json
from services.rundir.config import RunConfig
from services.rundir.config import config_hash as config_hash_of
from services.rundir.sections import TrainSection
from services.train.callbacks import StepCallback, installed_callbacks
from services.train.space import run_space_need

log = logging.getLogger(__name__)

COLUMNS = [f.name for f in EXAMPLE_SCHEMA]


def make_plan(
    config: RunConfig,
    *,
    resume: bool,
    coordinator: str | None,
    dry_run: bool = False,
    newest: tuple[Path, int] | None = None,
) -> WorkerPlan:
    """The plan the workers get, with every check it needs (the backend, the shard set `data.shards`, the
    vocabulary, model.init_from, the run directory, its disk). dry_run: nothing written (no run directory made, no
    unigram counts stored: `albert pretrain --dry-run`). `newest`: the newest good checkpoint of the run directory
    and its step, where a resume starts (prepare_run found and verified it); None: a new run, or none yet."""
    pjrt_device = None
    if config.train.backend == "xla":
        if importlib.util.find_spec("torch_xla") is None:
            raise ConfigError(
                "train.backend: 'xla' needs torch_xla (torch-xla 2.9 with torch 2.9.0) on the driver and every worker; "
                "scripts/xla_venv.sh builds that virtualenv, the TPU cluster recipes install it on every node"
            )
        pjrt_device = pjrt_device_for(config.train)
    if not config.data.shards:
        raise ConfigError("data.shards: empty; point it at a preprocess output directory")
    shards_dir = Path(config.data.shards).resolve()
    tokenizer, vocabulary = shards_tokenizer(shards_dir)
    init_from = Path(config.model.init_from).resolve() if config.model.init_from else None
    if newest is not None:  # the run resumes its own checkpoint: model.init_from is not read
        check_shards_vocabulary(newest[0], vocabulary, "the resume")
        check_mask_scheme(newest[0])
        init_from = None
    elif init_from is not None:
        check_shards_vocabulary(init_from, vocabulary, "model.init_from")
    shards = plan_data(shards_dir, config)
    if coordinator is not None or dry_run:  # a run with a coordinator evaluates (--dry-run plans such a run)
        check_heldout(shards_dir, config)
    ids = resolve_token_ids(shards_dir, config)
    if config.model.mlm_bias_init == "unigram" and not dry_run:
        unigram_for(shards_dir, config)  # counted once per shard set, then read by every worker
    init = check_init_source(init_from, config.model_config(ids.vocab_size)) if init_from is not None else None
    carried = [path.resolve() for path in tokenizer_files(tokenizer)]  # absolute: the workers have their own cwd
    start_step = newest[1] if newest is not None else 0
    disk = run_space_need(config, ids.vocab_size, carried, resume=resume, start_step=start_step)
    disk_warning = check_space(disk, free_bytes(disk.path))  # NotEnoughSpace: refused
    run_dir = prepare_run_dir(config, resume=resume, dry_run=dry_run)
    return WorkerPlan(
        config=config,
        run_dir=str(run_dir),
        token_ids=ids,
        shards=shards,
        coordinator=coordinator,
        pjrt_device=pjrt_device,
        init_from=str(init_from) if init_from else None,
        init=init,
        init_data_position=init_data_position(init_from) if config.data.continue_from_init and init_from else None,
        unigram_dir=str(shards_dir) if config.model.mlm_bias_init == "unigram" else None,
        callbacks=installed_callbacks(),
        tokenizer_files=tuple(str(path) for path in carried),
        start_step=start_step,
        disk=disk,
        disk_warning=disk_warning,
    )


def check_shards_vocabulary(checkpoint: Path, vocabulary: Vocabulary | None, what: str) -> None:
    """Refuse shards made with another tokenizer than the checkpoint's (its kind, its file's sha256, its size)."""
    if vocabulary is not None:
        try:
            check_vocabulary(checkpoint, vocabulary, role="data.shards were made with")
        except VocabularyMismatch as err:
            raise ConfigError(f"{what}: {err}") from None


def check_mask_scheme(checkpoint: Path) -> None:
    """Refuse to resume a checkpoint written under another definition of the masks than this albert's: its examples
    would be masked anew, not as the run masked them. A checkpoint that records no scheme was written under scheme 1
    (numpy's PCG64 streams per row), whose masks albert no longer makes; its weights still start a new run."""
    scheme = read_trainer_json(checkpoint)["state"].get("mask_scheme", 1)
    if scheme != MASK_SCHEME:
        raise ConfigError(
            f"the resume: {checkpoint} was trained with mask scheme {scheme}, this albert masks with scheme "
            f"{MASK_SCHEME} only; start a new run from its weights: albert pretrain --config RECIPE "
            f"--init-from {checkpoint} --set run.name=NEW_NAME"
        )


def prepare_run_dir(config: RunConfig, *, resume: bool, dry_run: bool) -> Path:
    """The run directory, made (unless dry_run). A new run (resume=False) refuses one that already holds checkpoints
    rather than mixing two runs in it, and clears Ray Train's state of an earlier run there."""
    run_dir = config.run_dir.resolve()
    if not resume and list_checkpoints(run_dir / CHECKPOINTS_DIR):
        raise ConfigError(
            f"run.name: {run_dir} already holds checkpoints; resume it, or choose another run.name / run.output_dir"
        )
    if not dry_run:
        if not resume:
            shutil.rmtree(run_dir / "ray" / config.run.name, ignore_errors=True)  # Ray would restore its old state
        run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def resolve_token_ids(shards_dir: Path, config: RunConfig) -> TokenIds:
    """Vocabulary size and special ids: those of the tokenizer the shards were made with
    (`albert_core.examples.shards.ShardsManifest.tokenizer_model`), else those manifest.json records (`vocab_size`, at
    the top level or under `"tokenizer"`, and the special ids; ALBERT's layout when it records none). A non-zero
    `model.overrides.vocab_size` sets the size (the special ids stay the tokenizer's; ALBERT's layout, <pad>=0,
    <unk>=1, [CLS]=2, [SEP]=3, [MASK]=4, for shards that name none)."""
    override = int(config.model.overrides.get("vocab_size") or 0)
    try:
        manifest = ShardsManifest.read(shards_dir)
    except ManifestError as err:
        if override:
            return TokenIds(vocab_size=override)
        raise ConfigError(f"data.shards: {err}") from None
    model = manifest.tokenizer_model()
    if model is not None:
        ids = TokenIds.from_tokenizer(load_tokenizer(model))
    elif manifest.vocab_size is not None and manifest.vocab_size > len(SPECIAL_PIECES):
        ids = TokenIds(vocab_size=manifest.vocab_size, **manifest.special_ids)
    elif override:
        return TokenIds(vocab_size=override)
    else:
        raise ConfigError(
            f"data.shards: cannot tell the vocabulary size: no spiece.model in {shards_dir} or "
            f"{shards_dir / 'tokenizer'}, and {shards_dir / MANIFEST_FILE} has no vocab_size; set "
            "model.overrides.vocab_size"
        )
    return dataclasses.replace(ids, vocab_size=override) if override else ids


def shards_tokenizer(shards_dir: Path) -> tuple[Path | None, Vocabulary | None]:
    """The tokenizer the shards were made with (as load_tokenizer reads it) and its identity; None where the shard
    set does not say."""
    try:
        return ShardsManifest.read(shards_dir).tokenizer_model(), shards_vocabulary(shards_dir)
    except ManifestError:
        return None, None


@dataclass(frozen=True)
class ShardSet:
    """The train shard files of a shard set's newest version, part by part (albert_core.examples.shards.ShardPart), with
    their row counts. A set whose manifest lists no shards is one part of every `train/**/*.parquet` (sorted)."""

    directory: str
    files: tuple[str, ...]  # absolute: the file numbering of the example order (a part's files follow the last's)
    rows_per_file: tuple[int, ...]
    part_files: tuple[int, ...]  # files in each part
    part_names: tuple[str, ...]
    sha256: tuple[str, ...]  # of each file, as manifest.json records it ("" where it records none)

    @property
    def version(self) -> int:
        return len(self.part_files)

    @property
    def rows(self) -> dict[str, int]:
        return dict(zip(self.files, self.rows_per_file, strict=True))

    def order(self, version: int, seed: int, mixture: Mapping[str, float] | None = None) -> ExampleOrder:
        """The example order of version `version` (its first parts), weighted by `mixture` (data.mixture)."""
        if not 1 <= version <= self.version:
            raise ValueError(f"{self.directory}: has versions 1 to {self.version}, not {version}")
        parts = self.part_files[:version]
        weights = mixture_weights(self.part_names[:version], mixture) if mixture else None
        return ExampleOrder(self.rows_per_file[: sum(parts)], seed, part_files=parts, weights=weights)


def mixture_weights(part_names: Sequence[str], mixture: Mapping[str, float]) -> tuple[float, ...]:
    """data.mixture's weight of each part: by name, else the "*" entry, else 0 (not trained on)."""
    return tuple(float(mixture.get(name, mixture.get("*", 0.0))) for name in part_names)


def read_shard_set(shards_dir: Path) -> ShardSet:
    """The shard set's newest version as its manifest lists it, each file checked to be a readable shard with the
    rows the manifest records; errors name data.shards and the file."""
    if not shards_dir.is_dir():
        raise ConfigError(f"data.shards: {shards_dir} does not exist (expected a preprocess output directory)")
    try:
        parts = ShardsManifest.read(shards_dir).parts
    except ManifestError as err:
        raise ConfigError(f"data.shards: {err}") from None
    if not parts:
        files = _listed_files(shards_dir)
        rows = tuple(_shard_rows(f) for f in files)
        return ShardSet(str(shards_dir), files, rows, (len(files),), ("part-0",), ("",) * len(files))
    files, rows = [], []
    for part in parts:
        for name, listed in zip(part.shards, part.rows, strict=True):
            path = str((shards_dir / name).resolve())
            found = _shard_rows(path)
            if found != listed:
                raise ConfigError(
                    f"data.shards: {path}: has {found} rows, its manifest.json says {listed}; the shard set changed "
                    "after preprocessing"
                )
            files.append(path)
            rows.append(found)
    part_files = tuple(len(part.shards) for part in parts)
    names, digests = tuple(p.name for p in parts), tuple(d for p in parts for d in p.sha256)
    return ShardSet(str(shards_dir), tuple(files), tuple(rows), part_files, names, digests)


def _listed_files(shards_dir: Path) -> tuple[str, ...]:
    train_dir = shards_dir / TRAIN_DIR
    if not train_dir.is_dir():
        raise ConfigError(f"data.shards: {shards_dir} has no {TRAIN_DIR}/ directory of Parquet shards")
    files = sorted(str(p.resolve()) for p in train_dir.rglob("*.parquet"))
    if not files:
        raise ConfigError(f"data.shards: {train_dir} holds no .parquet files")
    return tuple(files)


def _shard_rows(path: str) -> int:
    try:
        meta = pq.ParquetFile(path)
    except FileNotFoundError:
        raise ConfigError(f"data.shards: {path}: listed in manifest.json but missing") from None
    except Exception as err:  # pyarrow raises several types for a damaged footer
        raise ConfigError(f"data.shards: {path}: not a readable Parquet file ({err})") from None
    missing = [c for c in COLUMNS if c not in meta.schema_arrow.names]
    if missing:
        raise ConfigError(f"data.shards: {path}: lacks column {missing[0]!r} (expected {', '.join(COLUMNS)})")
    return meta.metadata.num_rows


def plan_data(shards_dir: Path, config: RunConfig) -> ShardSet:
    """The shard set's files and row counts, checked to hold at least one global batch (of the rows data.mixture
    draws in the run's optim.total_steps: a part whose share rounds to no block in them counts none)."""
    shards = read_shard_set(shards_dir)
    _check_mixture(shards, config)
    total = 0
    if sum(shards.rows_per_file):  # (an empty set has no order to draw from)
        order = shards.order(shards.version, config.run.seed, config.data.mixture)
        total = order.rows_drawn(config.optim.total_steps * config.train.global_batch_size)
    if total < config.train.global_batch_size:
        refusal = _too_few_examples(shards_dir, len(shards.files), total, config.train)
        if config.data.mixture:
            refusal += " (counting only the rows data.mixture draws in the run's optim.total_steps)"
        raise ConfigError(refusal)
    try:
        manifest = ShardsManifest.read(shards_dir)
    except ManifestError:
        manifest = ShardsManifest(shards_dir)  # unreadable: what it would say is unknown, so not checked
    _check_sequence_length(manifest, config)
    _check_sop_order(manifest, config)
    return shards


def check_heldout(shards_dir: Path, config: RunConfig) -> None:
    """The run's evaluations ([eval]: every eval.every_steps and at the end) read the shard set's held-out documents:
    refuse a set whose held-out file is missing, holds none, or holds none that a SOP or NSP pair can be built from
    (each needs two tokens), instead of a run whose every evaluation fails."""
    heldout = shards_dir / HELDOUT_FILE
    when = f"every {config.eval.every_steps} steps and at the end" if config.eval.every_steps else "at the end"
    if not heldout.is_file():
        raise FileNotFoundError(
            f"data.shards: {heldout} not found; the run's evaluation ({when}) reads held-out documents from "
            f"<shards>/{HELDOUT_FILE}"
        )
    try:
        documents, pairable = pairable_heldout(str(heldout))
    except (OSError, pa.ArrowException) as err:
        raise ConfigError(f"data.shards: {heldout}: not a readable held-out file ({err})") from None
    if pairable:
        return
    fraction = ShardsManifest.read(shards_dir).heldout_fraction
    made = f" (made with --heldout-fraction {fraction:g})" if fraction is not None else ""
    found = "no documents" if not documents else f"{documents} documents, none of two tokens or more"
    raise ConfigError(
        f"data.shards: {heldout} holds {found}{made}, so the run's evaluations ({when}) could build no SOP or NSP "
        "pair; preprocess more text, or with a larger --heldout-fraction, into a new --output"
    )


def _check_mixture(shards: ShardSet, config: RunConfig) -> None:
    """data.mixture names parts of the set (or, for a run that follows it, parts still to come) and weighs some."""
    mixture = config.data.mixture
    if not mixture:
        return
    unknown = sorted(set(mixture) - set(shards.part_names) - {"*"})
    if unknown and not config.data.follow:
        raise ConfigError(
            f"data.mixture: {unknown[0]!r} is not a part of {shards.directory} (its parts: "
            f"{', '.join(shards.part_names)})"
        )
    if not any(mixture_weights(shards.part_names, mixture)):
        raise ConfigError(
            f"data.mixture: gives no part of {shards.directory} a weight above 0 (its parts: "
            f'{", ".join(shards.part_names)}; "*" weighs every part not named)'
        )


def _check_sequence_length(manifest: ShardsManifest, config: RunConfig) -> None:
    """Rows longer than data.max_seq_length would fail the first step on a worker: refuse them here instead, by
    the max_seq_length the shards were preprocessed with (manifest.json's config; unknown: not checked)."""
    shards_dir, made = manifest.directory, manifest.max_seq_length
    wanted = config.data.max_seq_length
    if made is not None and made > wanted:
        raise ConfigError(
            f"data.max_seq_length: {wanted}, but {shards_dir} was preprocessed with --max-seq-length {made} (its "
            f"{MANIFEST_FILE}); preprocess again with --max-seq-length {wanted} into a new --output, or train on "
            f"these with --set data.max_seq_length={made}"
        )


def _check_sop_order(manifest: ShardsManifest, config: RunConfig) -> None:
    """data.sop_order = "epoch" swaps segments: only SOP examples have two segments whose order is the label."""
    if config.data.sop_order == "epoch" and manifest.objective != "sop":
        raise ConfigError(
            f'data.sop_order: "epoch" redraws the order of SOP pairs, but {manifest.directory / MANIFEST_FILE} records '
            f"the objective {manifest.objective!r}; use an SOP shard set (albert preprocess --objective sop) or "
            "sop_order stored"
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
    return config_hash_of(config.to_dict())


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

    config: RunConfig  # the run's recipe, checked
    run_dir: str
    token_ids: TokenIds
    shards: ShardSet  # the shard set's newest version when the run was planned
    coordinator: str | None = None  # the run's coordinator actor; None: rank 0 keeps the ledger itself
    pjrt_device: str | None = None  # backend "xla": the PJRT runtime (pjrt_device_for)
    init_from: str | None = None  # model.init_from, resolved
    init: InitSummary | None = None  # what starting from model.init_from loads, and what it leaves initialized
    init_data_position: int | None = None  # data.continue_from_init: the source run's examples seen
    unigram_dir: str | None = None  # model.mlm_bias_init = "unigram": the shard set holding unigram.npy
    callbacks: tuple[StepCallback, ...] = ()  # installed in the driver's process (services.train.callbacks)
    tokenizer_files: tuple[str, ...] = ()  # the shards' tokenizer, copied into every checkpoint
    start_step: int = 0  # the step of the newest good checkpoint when planned: where a resume starts
    disk: SpaceNeed | None = None  # what the run's checkpoints will add to the run directory
    disk_warning: str | None = None  # the run directory's filesystem holds less than the run's checkpoints need

    @property
    def checkpoints(self) -> Path:
        return Path(self.run_dir) / CHECKPOINTS_DIR
