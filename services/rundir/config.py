"""RunConfig: one typed description of a pretraining run, loaded from a TOML recipe in configs/ (its sections:
services.rundir.sections), with `--set` overrides merged in.

Every field is checked in one place, when a config is built from its dict form (RunConfig.from_dict: a recipe with
its --set, an experiment's cell), before any Ray worker starts; errors name the field as `section.field`. A config
read back to be compared (RunConfig.parse) has its types checked only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from albert_core.examples.shape import shape_fields, shape_problem
from albert_core.model.config import AlbertConfig, ConfigError
from services.rundir.fields import check_value, parse_text, type_hints
from services.rundir.sections import (
    CHECKPOINT_PRESET,
    SECTION_TYPES,
    DataSection,
    EvalSection,
    FinetuneSection,
    ModelSection,
    OptimSection,
    RunSection,
    TrainSection,
    check_eval,
    check_finetune,
    check_optim,
    check_train,
)
from services.terminal import UsageError

# The shipped recipes are package data of this package (services/rundir/recipes/, experiment specs in its experiments/),
# found through importlib.resources in a checkout and in an installed wheel alike. A checkout's configs/ is a link to
# that folder, so paths written configs/NAME.toml work there, and resolve_config_path maps them anywhere else.
RECIPES_PACKAGE, RECIPES_FOLDER, CHECKOUT_FOLDER = "services.rundir", "recipes", "configs"


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    finetune: FinetuneSection = field(default_factory=FinetuneSection)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    def model_config(self, vocab_size: int | None = None) -> AlbertConfig:
        overrides = dict(self.model.overrides)
        if vocab_size is not None and not overrides.get("vocab_size"):
            overrides["vocab_size"] = vocab_size
        try:
            if self.model.preset == CHECKPOINT_PRESET:  # the checkpoint's config, whole, in overrides
                return AlbertConfig.from_dict(overrides)
            return AlbertConfig.preset(self.model.preset, **overrides)
        except ConfigError as err:
            raise ConfigError(f"model.{err}") from None
        except TypeError as err:
            raise ConfigError(f"model.overrides: {err}") from None

    def validate(self) -> None:
        """Every field checked, alone and against the others; ConfigError naming the first that is wrong. Called in one
        place, from_dict: a RunConfig built from a recipe or an experiment's cell is checked there, and the path to
        the workers (services.train.driver.prepare_run) takes it as it is."""
        name = self.run.name
        if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
            raise ConfigError(
                f"run.name: expected a plain directory name (the run lives in output_dir/name), got {name!r}"
            )
        if self.model.preset == CHECKPOINT_PRESET and not self.model.init_from:
            raise ConfigError(
                f"model.preset: {CHECKPOINT_PRESET!r} is the model of model.init_from, which is empty; start such "
                "a run with albert pretrain --init-from DIR"
            )
        self.model_config(vocab_size=self.model.overrides.get("vocab_size") or 30000)
        if self.model.mlm_bias_init not in ("zeros", "unigram"):
            raise ConfigError(f"model.mlm_bias_init: expected zeros or unigram, got {self.model.mlm_bias_init!r}")
        _positive(
            self, "train", ("global_batch_size", "micro_batch_size", "num_workers", "cpus_per_worker", "log_every")
        )
        _positive(self, "train", ("checkpoint_every", "keep_last"))
        _positive(self, "optim", ("total_steps",))
        check_train(self.train)
        check_optim(self.optim)
        if self.optim.clock == "time" and not self.train.max_seconds:
            raise ConfigError(
                'optim.clock: "time" runs the schedule over the wall-clock budget, but train.max_seconds is 0 '
                "(no budget)"
            )
        d = self.data
        if d.continue_from_init and not self.model.init_from:
            raise ConfigError(
                "data.continue_from_init: needs model.init_from (the checkpoint whose data position to take)"
            )
        for part, weight in d.mixture.items():
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 <= weight < math.inf:
                raise ConfigError(f"data.mixture: {part!r}: expected a weight >= 0, got {weight!r}")
        if d.sop_order not in ("stored", "epoch"):
            raise ConfigError(f"data.sop_order: expected stored or epoch, got {d.sop_order!r}")
        for name, shape_name in shape_fields(DataSection).items():
            if problem := shape_problem(shape_name, getattr(d, name)):
                raise ConfigError(f"data.{name}: {problem}")
        positions = self.model_config(30000).max_position_embeddings
        if d.max_seq_length > positions:
            raise ConfigError(
                f"data.max_seq_length: {d.max_seq_length} exceeds the model's max_position_embeddings ({positions})"
            )
        check_eval(self.eval)
        check_finetune(self.finetune)

    # --- serialization -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> RunConfig:
        """The config of a recipe's dict form, checked (validate); errors start with `source` (none if it is empty)."""
        config = cls.parse(data, source=source)
        try:
            config.validate()
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}" if source else str(err)) from None
        return config

    @classmethod
    def parse(cls, data: dict[str, Any], *, source: str = "config") -> RunConfig:
        """The config of a dict form with each field's type checked but not the recipe's checks (validate): to read
        back a config that was checked when its run started (a resume compares it with the recipe's)."""
        try:
            return cls(**_build_sections(data))
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}" if source else str(err)) from None

    @classmethod
    def load(cls, path: str | Path, overrides: Mapping[str, Any] | None = None) -> RunConfig:
        """A recipe (a path, or the name of a shipped one) with `overrides` merged in (merge_fields): values from
        code, or SetText from `--set`. An error caused by a `--set` value names that flag, others the recipe."""
        path = resolve_config_path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path}: not valid TOML ({err})") from None
        set_by = merge_fields(data, overrides or {}, origin=str(path))
        try:
            return cls.from_dict(data, source="")
        except ConfigError as err:
            field_name = str(err).split(":", 1)[0]
            raise ConfigError(f"{set_by.get(field_name, str(path))}: {err}") from None


def config_hash(config: dict[str, Any]) -> str:
    """sha256 of a run config's dict form (RunConfig.to_dict, keys sorted): the hash a checkpoint records."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """The fields two run configs' dict forms differ in: "section.field" -> [before, after] (a missing one: None)."""
    changed: dict[str, list[Any]] = {}
    for section in sorted(set(before) | set(after)):
        old, new = before.get(section), after.get(section)
        if not (isinstance(old, dict) and isinstance(new, dict)):
            if old != new:
                changed[section] = [old, new]
            continue
        for name in sorted(set(old) | set(new)):
            if old.get(name) != new.get(name):
                changed[f"{section}.{name}"] = [old.get(name), new.get(name)]
    return changed


def recipes_dir() -> Path:
    """The folder of the shipped recipes (package data)."""
    return Path(str(importlib.resources.files(RECIPES_PACKAGE).joinpath(RECIPES_FOLDER)))


def resolve_config_path(path: str | Path, *, kind: str = "") -> Path:
    """A recipe file: a path that exists, else a shipped one named `NAME` (`tiny` -> recipes/tiny.toml) or written
    as a checkout path (`configs/tiny.toml`). kind "experiments": experiment specs (recipes/experiments/)."""
    candidate = Path(path)
    if candidate.is_file():
        return candidate
    folder = recipes_dir() / kind
    name = str(path).removesuffix(".toml")
    if re.fullmatch(r"[A-Za-z0-9._-]+", name) and (folder / f"{name}.toml").is_file():
        return folder / f"{name}.toml"
    parts = candidate.parts
    if not candidate.is_absolute() and parts[:1] == (CHECKOUT_FOLDER,) and len(parts) > 1:
        shipped = recipes_dir().joinpath(*parts[1:])
        if shipped.is_file():
            return shipped
    what = "experiment spec" if kind else "config file"
    raise ConfigError(f"{path}: no such {what} (shipped: {', '.join(shipped_recipes(kind))})")


def shipped_recipes(kind: str = "") -> list[str]:
    """The names of the shipped recipes (kind "experiments": of the experiment specs)."""
    return sorted(p.stem for p in (recipes_dir() / kind).glob("*.toml"))


def _build_sections(data: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(data) - set(SECTION_TYPES))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown section (expected {', '.join(SECTION_TYPES)})")
    built = {}
    for name, section_cls in SECTION_TYPES.items():
        values = data.get(name, {})
        if not isinstance(values, dict):
            raise ConfigError(f"{name}: expected a table, got {type(values).__name__}")
        built[name] = _build_section(section_cls, values, name)
    return built


def _build_section(section_cls: type, values: dict[str, Any], name: str):
    known = {f.name: f for f in fields(section_cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{name}.{unknown[0]}: unknown field (expected one of {', '.join(known)})")
    defaults = section_cls()
    for key, value in values.items():
        expected = getattr(defaults, key)
        if not _same_kind(expected, value) and not (key == "trust_clip" and isinstance(value, list)):
            raise ConfigError(f"{name}.{key}: expected {type(expected).__name__}, got {value!r}")
    return section_cls(**values)


def _same_kind(expected: Any, value: Any) -> bool:
    if isinstance(expected, bool) or isinstance(value, bool):
        return isinstance(expected, bool) and isinstance(value, bool)
    if isinstance(expected, float):
        return isinstance(value, (int, float))
    if expected is None:
        return True
    return isinstance(value, type(expected))


def _positive(config: RunConfig, section: str, names: tuple[str, ...]) -> None:
    values = getattr(config, section)
    for name in names:
        value = getattr(values, name)
        if value < 1:
            raise ConfigError(f"{section}.{name}: expected a positive integer, got {value}")


@dataclass(frozen=True)
class SetText:
    """A value as `--set SECTION.FIELD=TEXT` gave it: merge_fields parses it by the field's declared type."""

    text: str


def parse_sets(pairs: Sequence[str]) -> dict[str, SetText]:
    """`--set section.field=value` pairs (repeatable; a later one wins) as {dotted field: its text}."""
    overrides = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or "." not in key.strip(". "):
            raise UsageError(f"--set {pair}: expected SECTION.FIELD=VALUE, e.g. --set optim.lr=0.001")
        overrides[key.strip()] = SetText(text)
    return overrides


def merge_fields(data: dict[str, Any], overrides: Mapping[str, Any], *, origin: str) -> dict[str, str]:
    """Set each dotted field of `overrides` in a recipe's dict form (as tomllib reads it), changing nothing else.

    Keys are `section.field` or `model.overrides.FIELD` (an AlbertConfig field); a table given for
    `model.overrides` sets the fields it names and keeps the recipe's others. A SetText value is parsed by the
    field's declared type (a str field takes any text; TOML for the rest), any other value is checked against it.
    Errors name where the value came from: `--set KEY=TEXT`, else `origin: KEY`. Returns, for each field set from
    `--set`, the name its config errors start with ("train.num_workers", "model.hidden_size") -> that `--set`.
    """
    set_by = {}
    for dotted, value in overrides.items():
        where = f"--set {dotted}={value.text}" if isinstance(value, SetText) else f"{origin}: {dotted}"
        try:
            for name in _merge_one(data, dotted, value):
                if isinstance(value, SetText):
                    set_by[name] = where
        except (ConfigError, ValueError) as err:
            raise ConfigError(f"{where}: {err}") from None
    return set_by


def _merge_one(data: dict[str, Any], dotted: str, value: Any) -> list[str]:
    """Set one dotted field; returns the names config errors about it start with."""
    section, _, rest = dotted.partition(".")
    if section not in SECTION_TYPES:
        raise ConfigError(f"unknown section {section!r} (expected {', '.join(SECTION_TYPES)})")
    name, _, deeper = rest.partition(".")
    hints = type_hints(SECTION_TYPES[section])
    if name not in hints:
        raise ConfigError(f"unknown field of [{section}] (expected one of {', '.join(hints)})")
    table = _table(data, section)
    if (section, name) == ("model", "overrides"):
        overrides = _table(table, "overrides", where="model.overrides")
        if deeper:
            return [_merge_model_field(overrides, deeper, value)]
        fields_given = parse_text(dict[str, Any], value.text) if isinstance(value, SetText) else value
        check_value(dict[str, Any], fields_given)
        return [_merge_model_field(overrides, key, v) for key, v in fields_given.items()]
    if deeper:
        raise ConfigError(f"only model.overrides.FIELD goes deeper than SECTION.FIELD ({section}.{name} has no fields)")
    table[name] = _typed(hints[name], value)
    return [f"{section}.{name}"]


def _merge_model_field(overrides: dict[str, Any], name: str, value: Any) -> str:
    hints = type_hints(AlbertConfig)
    if name not in hints:
        raise ConfigError(f"{name!r} is not a model field (model.overrides: expected one of {', '.join(hints)})")
    overrides[name] = _typed(hints[name], value)
    return f"model.{name}"


def _typed(hint: Any, value: Any) -> Any:
    """A SetText parsed by the field's type; any other value checked against it."""
    if isinstance(value, SetText):
        return parse_text(hint, value.text)
    check_value(hint, value)
    return value


def _table(data: dict[str, Any], key: str, *, where: str | None = None) -> dict[str, Any]:
    table = data.setdefault(key, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{where or key}: is not a table in the recipe ({table!r})")
    return table
