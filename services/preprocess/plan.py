"""Planning a preprocess run before anything is read: the input files listed, cut into units, the plan's
fingerprint, and the output claimed for it (`plan_preprocess`), so that a mistake costs no Ray start-up."""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import fsspec

from albert_core.corpus import list_inputs
from albert_core.shards import MANIFEST_FILE, TRAIN_DIR
from albert_core.tokenization import Tokenizer
from services.preprocess.checks import EXPECTED_INPUT, MISSING_HINT, check_output, check_tokenizer, missing_input
from services.preprocess.config import InputFile, PreprocessConfig, Unit
from services.preprocess.layout import PLAN_FILE, PROGRESS_DIR, Layout, write_json_atomic


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


def _prepare_output(layout: Layout, config: PreprocessConfig, fingerprint: str, units: list[Unit]) -> None:
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


def claim_plan(layout: Layout, config: PreprocessConfig, fingerprint: str, units: list[Unit], refused: str) -> None:
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
        write_json_atomic(layout.plan, plan)
    for stale in layout.progress.glob("*.partial"):  # left by an interrupted run
        stale.unlink()


@dataclass(frozen=True)
class PreprocessJob:
    """A checked and planned run, made before Ray starts (plan_preprocess; services.preprocess.append for a part
    appended to a shard set)."""

    tokenizer: Tokenizer
    units: Sequence[Unit]
    fingerprint: str
    part: int = 0  # the part of the shard set it writes (0: a plain preprocess)
    name: str = "part-0"

    def layout(self, output: str) -> Layout:
        return Layout(output, self.part)


def plan_preprocess(config: PreprocessConfig) -> PreprocessJob:
    """Everything before Ray, so that a mistake costs no Ray start-up: the output checked, the tokenizer loaded
    and checked against max_seq_length, the inputs listed (ValueError for one matching nothing), the units
    planned, and the output claimed for this plan (plan.json; an output of another plan is refused)."""
    check_output(config.output)
    tokenizer = check_tokenizer(config)
    units = plan_units(list_input_files(config), config.shard_input_bytes)
    fingerprint = plan_fingerprint(config, tokenizer, units)
    _prepare_output(Layout(config.output), config, fingerprint, units)
    return PreprocessJob(tokenizer, tuple(units), fingerprint)
