"""Planning a preprocess run before anything is read: the input files listed, cut into units, the plan's
fingerprint, and the output claimed for it (`plan_preprocess`), so that a mistake costs no Ray start-up."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import fsspec

from albert_core.examples.shards import MANIFEST_FILE, TRAIN_DIR
from albert_core.files import HeldLock, atomic_write_json
from albert_core.text.corpus import Region, list_inputs
from albert_core.text.regions import is_index, plan_file
from albert_core.text.tokenization import AnyTokenizer
from services.preprocess.checks import EXPECTED_INPUT, MISSING_HINT, check_output, check_tokenizer, missing_input
from services.preprocess.config import STREAM_UNITS, InputFile, PreprocessConfig, StreamInput, Unit
from services.preprocess.layout import PLAN_FILE, PROGRESS_DIR, Layout

# What decides the examples beyond the options: 3 = documents identified by the sha256 of their text (held-out
# choice, pair draws), big files cut into regions. A .progress/ of another version is not resumed.
PREPROCESS_VERSION = 3


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
            if is_index(path):  # a multistream dump's index is read with its dump
                continue
            if path not in seen:
                seen.add(path)
                files.append(InputFile(path, _size(path)))
    if len(missing_roots) == len(config.inputs):
        raise ValueError(f"input {' '.join(missing_roots)}: none of the inputs exists ({EXPECTED_INPUT})")
    return files


def region_bytes(region: Region, file_size: int, regions: int) -> int:
    """The bytes on disk a region reads: its byte range, or its file's even share for row groups."""
    return region.stop - region.start if region.how in ("bytes", "bz2_streams") else file_size // regions


@dataclass(frozen=True)
class Plan:
    """The units of a run (in order; each a shard), and the compressed files it cuts into units as it reads them."""

    units: tuple[Unit, ...]
    streams: tuple[StreamInput, ...] = ()

    @property
    def input_bytes(self) -> int:
        """Bytes on disk the run reads."""
        return sum(u.size for u in self.units) + sum(s.file.size for s in self.streams)

    def fingerprint(self, config: PreprocessConfig, tokenizer: AnyTokenizer) -> str:
        plan = {
            "options": config.output_options(),
            "tokenizer_sha256": tokenizer.sha256,
            "units": [json.loads(u.to_json()) for u in self.units],
            "streams": [[asdict(s.file), s.first] for s in self.streams],
            "version": PREPROCESS_VERSION,
        }
        return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


def plan_units(files: list[InputFile], config: PreprocessConfig, first: int = 0) -> Plan:
    """Consecutive files grouped while they hold at most shard_input_bytes; a bigger file cut into regions of about
    that size (or read as a stream it is cut into as it is read); units numbered from `first` (an appended part
    continues its shard set's numbering), stream chunks after them."""
    target = config.shard_input_bytes
    units: list[Unit] = []
    big: list[InputFile] = []
    current: list[InputFile] = []
    size = 0

    def close() -> None:
        nonlocal current, size
        if current:
            units.append(Unit(first + len(units), tuple(current), size=size))
            current, size = [], 0

    for f in files:
        cut = plan_file(f.path, f.size, target, fmt=config.fmt, split=config.split)
        if cut.stream:
            big.append(f)
            continue
        if cut.regions:
            close()
            for region in cut.regions:
                units.append(Unit(first + len(units), (f,), region, region_bytes(region, f.size, len(cut.regions))))
            continue
        if current and size + f.size > target:
            close()
        current.append(f)
        size += f.size
    close()
    after = first + len(units)
    return Plan(tuple(units), tuple(StreamInput(f, after + i * STREAM_UNITS) for i, f in enumerate(big)))


def _prepare_output(layout: Layout, config: PreprocessConfig, fingerprint: str, plan: Plan) -> HeldLock:
    if not layout.plan.is_file() and (layout.train.exists() or layout.manifest.exists()):
        raise ValueError(
            f"{layout.root}: has {TRAIN_DIR}/ or {MANIFEST_FILE} but no {PROGRESS_DIR}/{PLAN_FILE}: not a resumable "
            "preprocess output; use a new --output directory"
        )
    refused = (
        f"{layout.root}: holds a preprocess run with other inputs, input sizes, tokenizer or options "
        f"({layout.plan}); use a new --output directory or delete this one"
    )
    return claim_plan(layout, config, fingerprint, plan, refused)


def claim_plan(layout: Layout, config: PreprocessConfig, fingerprint: str, plan: Plan, refused: str) -> HeldLock:
    """The part's progress folder made and claimed for this plan (its plan.json) and its run lock taken (returned:
    the caller holds it until the run ends), or ValueError(refused) when it holds another plan, or one naming the
    output when another run is writing it now (a resubmitted job); partial files an interrupted run left there are
    removed."""
    lock = HeldLock.try_acquire(layout.run_lock)
    if lock is None:
        raise ValueError(
            f"{layout.root}: another albert preprocess is writing into {layout.root} right now (it holds "
            f"{layout.run_lock}); wait for it to end, or stop it, then rerun this command to resume"
        )
    try:
        _claim(layout, config, fingerprint, plan, refused)
    except BaseException:
        lock.release()
        raise
    return lock


def _claim(layout: Layout, config: PreprocessConfig, fingerprint: str, plan: Plan, refused: str) -> None:
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
            "inputs": sorted({f.path for u in plan.units for f in u.files} | {s.file.path for s in plan.streams}),
            "units": len(plan.units),
            "streams": len(plan.streams),
        }
        atomic_write_json(layout.plan, plan)
    for stale in layout.progress.glob("*.partial"):  # left by an interrupted run
        stale.unlink()


@dataclass(frozen=True)
class PreprocessJob:
    """A checked and planned run, made before Ray starts (plan_preprocess; services.preprocess.append for a part
    appended to a shard set)."""

    tokenizer: AnyTokenizer
    plan: Plan
    fingerprint: str
    lock: HeldLock  # the part's run lock, held from the claim until the run ends
    part: int = 0  # the part of the shard set it writes (0: a plain preprocess)
    name: str = "part-0"

    def layout(self, output: str) -> Layout:
        return Layout(output, self.part)

    def release(self) -> None:
        """Let another run write the part (run_preprocess does this when it ends)."""
        self.lock.release()


def plan_preprocess(config: PreprocessConfig) -> PreprocessJob:
    """Everything before Ray, so that a mistake costs no Ray start-up: the output checked, the tokenizer loaded
    and checked against max_seq_length, the inputs listed (ValueError for one matching nothing), the units
    planned, and the output claimed for this plan (plan.json; an output of another plan is refused)."""
    check_output(config.output)
    tokenizer = check_tokenizer(config)
    plan = plan_units(list_input_files(config), config)
    fingerprint = plan.fingerprint(config, tokenizer)
    lock = _prepare_output(Layout(config.output), config, fingerprint, plan)
    return PreprocessJob(tokenizer, plan, fingerprint, lock)
