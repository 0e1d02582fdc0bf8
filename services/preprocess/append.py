"""`albert preprocess --append-to SHARDS --input ...`: a corpus added to a finished shard set as its next part.

The part is planned like a plain preprocess and run by the same `run_preprocess`, with the set's tokenizer and the
set's shape options (objective, lengths, seed, held-out fraction, document groups: what decides an example; one
given on the command line must equal the set's). Its units are numbered after the set's shards, so its shard
files continue the numbering in train/ and its example ids are new; its progress is in .progress/part-<k>/ (an
interrupted append resumes when the same command is rerun), its held-out documents in heldout/part-<k>.parquet
(heldout/documents.parquet stays part 0's, so held-out evaluation stays comparable across an append). manifest.json
gains the part only when every shard of it is written (services.preprocess.manifest.commit_part): the commit point.

Refused before Ray, each in one line naming the option or file: a SHARDS without manifest.json, --output other than
SHARDS, a tokenizer of another sha256, a shape option that differs from the set's, an input file already in a part
of the set, a part name the set already has, a .progress/part-<k>/ claimed by an unfinished append of other inputs.
The part index is read and its folder claimed under the set's manifest lock, so concurrent appends never share one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from albert_core.examples.shards import MANIFEST_FILE, ShardsManifest
from albert_core.files import file_lock
from albert_core.text.tokenization import AnyTokenizer
from services.preprocess.checks import check_output, check_tokenizer
from services.preprocess.config import DEFAULTS, SHAPE, SHAPE_FLAGS, InputFile, PreprocessConfig
from services.preprocess.layout import Layout
from services.preprocess.manifest import stored_parts
from services.preprocess.plan import PreprocessJob, claim_plan, list_input_files, plan_units

SHARD_NUMBER = re.compile(r"shard-(\d+)\.parquet$")


def plan_append(config: PreprocessConfig, shard_set: ShardsManifest, tokenizer: str | None, part_name: str | None):
    """The job of appending config.inputs to `shard_set` (config.output) as a part named `part_name` (default
    part-<k>), everything checked before Ray (ValueError naming the option or file). `tokenizer` is the one the
    command line gave (None: the set's own)."""
    check_output(config.output)
    loaded = check_tokenizer(config)
    check_same_tokenizer(loaded, shard_set, tokenizer)
    return claim_part(config, loaded, list_input_files(config), part_name)


def finished_shard_set(root: str) -> ShardsManifest:
    if not (Path(root) / MANIFEST_FILE).is_file():
        raise ValueError(
            f"--append-to {root}: no {MANIFEST_FILE}, so not a finished shard set (albert preprocess writes it last; "
            "rerun the preprocess that made it to finish it)"
        )
    return ShardsManifest.read(root)


def set_shape(shard_set: ShardsManifest, given: dict[str, Any]) -> dict[str, Any]:
    """The set's shape options; one given on the command line (not None) that differs is a ValueError naming it."""
    made = shard_set.data.get("config") or {}
    shape = {name: made.get(name, DEFAULTS[name]) for name in SHAPE}
    for name, flag in SHAPE_FLAGS.items():
        if given[name] is not None and given[name] != shape[name]:
            raise ValueError(
                f"{flag} {given[name]}: the shard set {shard_set.directory} was made with {flag} {shape[name]}, and "
                f"an appended part takes the set's (leave {flag} out)"
            )
    return shape


def set_tokenizer(shard_set: ShardsManifest, given: str | None) -> str:
    """--tokenizer, or the tokenizer model the set's manifest names."""
    if given is not None:
        return given
    model = shard_set.tokenizer_model()
    if model is None:
        named = (shard_set.data.get("tokenizer") or {}).get("path")
        raise ValueError(f"--append-to {shard_set.directory}: its tokenizer {named} is not found; give --tokenizer")
    return str(model)


def check_same_tokenizer(tokenizer: AnyTokenizer, shard_set: ShardsManifest, given: str | None) -> None:
    """ValueError unless `tokenizer` is the set's: the same model (sha256) and the same text preprocessing (the
    casing and accents the manifest records): the same model read with other settings makes other pieces."""
    what = f"--tokenizer {given}" if given is not None else f"the shard set's tokenizer {tokenizer.name}"
    recorded = shard_set.data.get("tokenizer") if isinstance(shard_set.data.get("tokenizer"), dict) else {}
    checks = [("sha256", tokenizer.sha256, shard_set.tokenizer_sha256)]
    checks += [(name, getattr(tokenizer, name), recorded.get(name)) for name in ("lower_case", "keep_accents")]
    for name, mine, theirs in checks:
        if mine != theirs and (name == "sha256" or theirs is not None):  # settings a manifest did not record: as made
            raise ValueError(
                f"{what}: {name} {mine}, but the shard set {shard_set.directory} was tokenized with {name} {theirs}; "
                "an appended part must use the set's tokenizer as the set was made with it"
            )


def claim_part(
    config: PreprocessConfig, tokenizer: AnyTokenizer, files: list[InputFile], name: str | None
) -> PreprocessJob:
    """Under the set's manifest lock: its parts re-read, the inputs and the part name checked against them, the
    units numbered after its shards, and .progress/part-<k>/ claimed for this plan."""
    root = config.output
    with file_lock(Layout(root).lock):
        shard_set = finished_shard_set(root)
        parts = shard_set.parts
        check_new_inputs(files, shard_set)
        k = len(parts)
        name = name if name is not None else f"part-{k}"
        for part in parts:
            if part.name == name:
                raise ValueError(
                    f'--part-name {name}: the shard set {root} already has a part "{name}" (part {part.index})'
                )
        plan = plan_units(files, config, first=next_unit(shard_set))
        fingerprint = plan.fingerprint(config, tokenizer)
        layout = Layout(root, k)
        refused = (
            f"{layout.progress}: holds an unfinished append of part {k} with other inputs, input sizes or options; "
            "rerun the same command or delete it"
        )
        lock = claim_plan(layout, config, fingerprint, plan, refused)
    return PreprocessJob(tokenizer, plan, fingerprint, lock, part=k, name=name)


def next_unit(shard_set: ShardsManifest) -> int:
    """The first unit number an appended part takes: one past every shard's of the set (stream chunks leave gaps
    in the numbering, so it is not the count of shards)."""
    numbers = [int(m.group(1)) for part in shard_set.parts for name in part.shards if (m := SHARD_NUMBER.search(name))]
    return max(numbers, default=-1) + 1


def check_new_inputs(files: list[InputFile], shard_set: ShardsManifest) -> None:
    """ValueError naming the first input file that a part of the set already holds (a corpus appended twice would
    be trained on twice)."""
    owners = {
        path: (k, part["name"])
        for k, part in enumerate(stored_parts(shard_set.data))
        for shard in part["shards"]
        for path in shard["files"]
    }
    for f in files:
        if f.path in owners:
            k, name = owners[f.path]
            raise ValueError(
                f'input file {f.path}: already in part {k} "{name}" of the shard set {shard_set.directory}'
            )
