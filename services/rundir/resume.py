"""The run's config of record, read from its directory (and from a checkpoint's: the run it belongs to), and what a
resume may change. The run's config of record (the ledger's `config`, the config its last start used
and its checkpoints were written under) against the config the resume starts with.

A resume under a changed recipe is refused before Ray starts, naming each changed field with both values, unless
the field is safe to change (SAFE_TO_CHANGE: the step budget and schedule, evaluation, checkpointing and logging,
the worker layout, the documented data changes) or the user allows it (`--allow-config-change FIELD...`). An allowed
change is then recorded by the ledger (config_history, a `config_changed` event) and takes effect as deploy.md
("Changing a run between resumes") describes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from albert_core.examples.shards import MANIFEST_FILE
from albert_core.model.config import AlbertConfig, ConfigError
from services.rundir.checkpoints import CHECKPOINTS_DIR, list_checkpoints
from services.rundir.config import RunConfig, config_changes
from services.rundir.fields import type_hints
from services.rundir.ledger import ledger_path
from services.rundir.sections import SECTION_TYPES

OVERRIDES = "model.overrides"

# Fields a resume changes without --allow-config-change: none of them changes what the saved weights, optimizer
# state and data position mean. The step budget and its schedule (a finished run trains on with a larger
# total_steps), evaluation, checkpointing and logging, the health policies, the worker layout (exact resume on any
# worker count and micro-batch), and data.follow / data.mixture (from the next epoch boundary).
SAFE_TO_CHANGE = (
    *("run.name", "run.output_dir"),  # the run directory itself, given by --resume
    *("optim.total_steps", "optim.warmup_steps", "optim.decay_steps", "train.max_seconds"),
    "eval",  # every eval.* field
    *("train.log_every", "train.checkpoint_every", "train.keep_last", "train.stall_seconds"),
    *("train.startup_timeout_s", "train.max_failures", "train.stop_grace_s", "train.preemption_check_every"),
    "train.max_preemption_failures",
    *("train.on_divergence", "train.divergence_factor", "train.rollback_lr_scale", "train.max_rollbacks"),
    *("train.num_workers", "train.min_workers", "train.micro_batch_size", "train.cpus_per_worker"),
    *("train.resources_per_worker", "train.compile"),
    *("data.follow", "data.mixture"),
    "finetune",  # defaults for fine-tuning the run's checkpoints later
    *("model.init_from", "data.continue_from_init"),  # how a new run starts; a resume loads its own checkpoint
)


def recorded_config(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's config of record, or None for a directory no run has started in (or whose state is unreadable:
    the ledger says why when the run starts)."""
    path = ledger_path(run_dir)
    try:
        config = json.loads(path.read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return config if isinstance(config, dict) else None


def run_dir_of_checkpoint(checkpoint: str | Path) -> Path | None:
    """The pretraining run a checkpoint belongs to (runs/NAME for runs/NAME/checkpoints/step_N, when runs/NAME holds
    the run's ledger), or None."""
    path = Path(checkpoint).resolve()
    run_dir = path.parent.parent
    if path.parent.name == CHECKPOINTS_DIR and ledger_path(run_dir).is_file():
        return run_dir
    return None


def recorded_run_config(run_dir: str | Path) -> RunConfig | None:
    """The run's config of record as a RunConfig, or None when there is none or it is not valid now."""
    recorded = recorded_config(run_dir)
    try:
        return RunConfig.from_dict(recorded, source="") if recorded is not None else None
    except (ConfigError, TypeError):
        return None


def field_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, list[Any]]:
    """config_changes with model.overrides split into its fields: "model.overrides.hidden_size" -> [64, 128]. A
    config recorded before a field existed counts as holding its default."""
    changed = config_changes(_with_defaults(before), _with_defaults(after))
    overrides = changed.pop(OVERRIDES, None)
    if overrides is not None:
        old, new = (v if isinstance(v, dict) else {} for v in overrides)
        for name in sorted(set(old) | set(new)):
            if old.get(name) != new.get(name):
                changed[f"{OVERRIDES}.{name}"] = [old.get(name), new.get(name)]
    return dict(sorted(changed.items()))


def _with_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    try:
        return RunConfig.parse(dict(config), source="").to_dict()
    except (ConfigError, TypeError):  # not a config of today's fields: compared as recorded
        return dict(config)


def check_field_names(names: Iterable[str]) -> None:
    """--allow-config-change names: a section, section.field, or model.overrides.FIELD (an AlbertConfig field)."""
    sections = SECTION_TYPES
    for name in names:
        section, _, rest = name.partition(".")
        field, _, deeper = rest.partition(".")
        known = section in sections and (not field or field in type_hints(sections[section]))
        if deeper:
            known = known and f"{section}.{field}" == OVERRIDES and deeper in type_hints(AlbertConfig)
        if not known:
            raise ConfigError(
                f"--allow-config-change {name}: not a field of the run config (expected SECTION, SECTION.FIELD or "
                f"model.overrides.FIELD; sections: {', '.join(sections)})"
            )


def allowed_by(field: str, names: Iterable[str]) -> bool:
    """Whether a changed field is covered by one of `names`: itself, its section, or model.overrides."""
    return any(field == name or field.startswith(name + ".") for name in names)


def check_resume_changes(run_dir: str | Path, config: RunConfig, allowed: Sequence[str] = ()) -> dict[str, list[Any]]:
    """The fields a resume of `run_dir` under `config` changes (all of them safe or allowed); ConfigError naming
    each refused field with both values. A directory without checkpoints is a new run: nothing to compare."""
    check_field_names(allowed)
    run_dir = Path(run_dir)
    recorded = recorded_config(run_dir)
    if recorded is None or not list_checkpoints(run_dir / CHECKPOINTS_DIR):
        return {}
    changed = field_changes(recorded, config.to_dict())
    if "data.shards" in changed and same_shard_set(*changed["data.shards"]):
        del changed["data.shards"]  # written another way (relative, absolute), or the same set moved
    refused = {k: v for k, v in changed.items() if not allowed_by(k, (*SAFE_TO_CHANGE, *allowed))}
    if refused:
        fields = "; ".join(f"{k}: {_show(v[0])} -> {_show(v[1])}" for k, v in refused.items())
        raise ConfigError(
            f"{run_dir}: resuming with a recipe that differs from the run's ({ledger_path(run_dir)}) in {fields}. "
            f"Resume with the run's recipe, or allow the change: --allow-config-change {' '.join(refused)}"
        )
    return changed


def same_shard_set(before: str, after: str) -> bool:
    """Whether two data.shards values name one shard set: the same directory from here, or two directories whose
    manifest.json (every part's files, rows and sha256) is the same."""
    try:
        if Path(before).resolve() == Path(after).resolve():
            return True
        old, new = Path(before) / MANIFEST_FILE, Path(after) / MANIFEST_FILE
        return old.is_file() and new.is_file() and old.read_bytes() == new.read_bytes()
    except (OSError, TypeError):
        return False


def describe_changes(changed: Mapping[str, list[Any]]) -> list[str]:
    """One line per changed field: `field: before -> after`."""
    return [f"{k}: {_show(v[0])} -> {_show(v[1])}" for k, v in changed.items()]


def _show(value: Any) -> str:
    return "(unset)" if value is None else json.dumps(value)
