"""Experiment specs (configs/experiments/*.toml): the grid of cells, and each cell's RunConfig and preprocess options.

docs/experiments.md describes the format. Building a spec builds and validates every cell's RunConfig, so errors
surface before anything runs; `services.experiments.cells` runs the cells.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from albert_core.examples.shape import shape_field, shape_fields, shape_problem
from albert_core.model.config import ConfigError
from services.rundir.config import RunConfig, merge_fields, resolve_config_path

RUNS_DIR = "runs"
# What a finished cell measures (services.experiments.cells.evaluate_cell), the metrics tables and claims can name.
RESULT_METRICS = (
    "mlm_acc", "mlm_loss", "sop_acc", "nsp_acc", "sop_probe", "nsp_probe", "l2_roughness", "cosine_roughness",
)  # fmt: skip


@dataclass
class PreprocessSpec:
    """How the shards of every cell are built (services.preprocess.config.PreprocessConfig fields; the pair task and
    short_seq_prob are the example shape's, albert_core.examples.shape, and max_seq_length is the recipe's)."""

    inputs: list[str]
    tokenizer: str
    cache: str = ".cache/albert/experiments"
    objective: str = shape_field("objective")
    short_seq_prob: float = shape_field("short_seq_prob")
    seed: int = 12345
    heldout_fraction: float = 0.02
    shard_mb: float = 1.0
    split: str = "file"
    fmt: str = "auto"
    text_field: str = "text"


@dataclass
class ProbeSpec:
    examples: int = 512  # pairs per half (train / test) at most
    tasks: list[str] = field(default_factory=lambda: ["sop", "nsp"])
    l2: float = 1e-3


@dataclass(frozen=True)
class Cell:
    name: str
    values: dict[str, Any]  # dotted field -> value
    group: str = ""  # the cell without its seed (= name when the spec has no seeds)


@dataclass
class Claim:
    """A finding of the paper as a comparison the report can decide: `metric` of group `higher` exceeds that of
    `lower` (a group name, or a number such as 0.5 for chance)."""

    text: str
    metric: str
    higher: str
    lower: str | float
    paper: str = ""  # the paper's numbers, quoted in the report


@dataclass
class ExperimentSpec:
    name: str
    recipe: str
    output_dir: str = "runs/experiments"
    description: str = ""
    notes: str = ""  # what the report says under the spec's tables (markdown)
    cells_dir: str = ""  # where finished cells' markers go (default <output_dir>/<name>/cells); e.g. under reports/
    set: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    cells: list[dict[str, Any]] = field(default_factory=list)
    preprocess: PreprocessSpec | None = None
    probe: ProbeSpec = field(default_factory=ProbeSpec)
    seeds: list[int] = field(default_factory=list)  # each cell runs once per seed (run.seed), named <cell>_seed-<s>
    reference: str = ""  # the group differences are taken against (default: the first)
    claims: list[Claim] = field(default_factory=list)
    source: str = "experiment"

    @property
    def directory(self) -> Path:
        return Path(self.output_dir) / self.name

    @property
    def markers(self) -> Path:
        """The finished cells' markers: small JSON results (with each cell's training curve) that can be kept
        apart from the runs and their checkpoints, e.g. committed under reports/."""
        return Path(self.cells_dir) if self.cells_dir else self.directory / "cells"

    @classmethod
    def load(cls, path: str | Path) -> ExperimentSpec:
        """A spec file, or a shipped spec by name (`table4-small`) or checkout path (configs/experiments/...)."""
        path = resolve_config_path(path, kind="experiments")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML ({err})") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "experiment") -> ExperimentSpec:
        known = {"experiment", "set", "grid", "cells", "preprocess", "probe", "claims"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: [{unknown[0]}]: unknown table (expected {', '.join(sorted(known))})")
        head = dict(data.get("experiment", {}))
        for required in ("name", "recipe"):
            if not isinstance(head.get(required), str) or not head[required]:
                raise ConfigError(f"{source}: experiment.{required}: expected a non-empty string")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", head["name"]):
            raise ConfigError(f"{source}: experiment.name: use letters, digits, '.', '_' and '-', got {head['name']!r}")
        head_fields = {"name", "recipe", "output_dir", "cells_dir", "description", "notes", "seeds", "reference"}
        extra = sorted(set(head) - head_fields)
        if extra:
            raise ConfigError(f"{source}: experiment.{extra[0]}: unknown field")
        grid = data.get("grid", {})
        for key, values in grid.items():
            if not isinstance(values, list) or not values:
                raise ConfigError(f"{source}: grid.{key}: expected a non-empty list of values, got {values!r}")
        cells = data.get("cells", [])
        if not isinstance(cells, list) or not all(isinstance(c, dict) for c in cells):
            raise ConfigError(f"{source}: cells: expected an array of tables ([[cells]])")
        preprocess = None
        if "preprocess" in data:
            preprocess = _dataclass_from(PreprocessSpec, data["preprocess"], f"{source}: preprocess")
        probe = _dataclass_from(ProbeSpec, data.get("probe", {}), f"{source}: probe")
        bad = [t for t in probe.tasks if t not in ("sop", "nsp")]
        if bad:
            raise ConfigError(f"{source}: probe.tasks: expected 'sop' and/or 'nsp', got {bad[0]!r}")
        seeds = head.get("seeds", [])
        if not isinstance(seeds, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in seeds):
            raise ConfigError(f"{source}: experiment.seeds: expected a list of integers, got {seeds!r}")
        if len(set(seeds)) != len(seeds):
            raise ConfigError(f"{source}: experiment.seeds: the seeds must differ, got {seeds!r}")
        claims = data.get("claims", [])
        if not isinstance(claims, list):
            raise ConfigError(f"{source}: claims: expected an array of tables ([[claims]])")
        claims = [_dataclass_from(Claim, c, f"{source}: claims[{i}]") for i, c in enumerate(claims)]
        spec = cls(
            name=head["name"],
            recipe=head["recipe"],
            output_dir=head.get("output_dir", "runs/experiments"),
            description=head.get("description", ""),
            notes=head.get("notes", ""),
            cells_dir=head.get("cells_dir", ""),
            set=dict(data.get("set", {})),
            grid=dict(grid),
            cells=list(cells),
            preprocess=preprocess,
            probe=probe,
            seeds=list(seeds),
            reference=head.get("reference", ""),
            claims=claims,
            source=source,
        )
        spec.validate()
        return spec

    def expand(self) -> list[Cell]:
        """The cells to run: each group once per seed (seed slowest, so every group has a first result early),
        or the groups themselves when the spec has no seeds."""
        groups = self.groups()
        if not self.seeds:
            return groups
        return [
            Cell(f"{g.name}_seed-{seed}", {**g.values, "run.seed": seed}, g.name) for seed in self.seeds for g in groups
        ]

    def groups(self) -> list[Cell]:
        """The grid's combinations (first axis slowest), then the explicit cells; names must be unique."""
        combos = [dict(zip(self.grid, values, strict=True)) for values in itertools.product(*self.grid.values())]
        if not self.grid:
            combos = []
        cells = [Cell(cell_name(values), values, cell_name(values)) for values in combos]
        for explicit in self.cells:
            values = {k: v for k, v in explicit.items() if k != "name"}
            name = explicit.get("name", cell_name(values))
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._=-]+", name):
                raise ConfigError(
                    f"{self.source}: cells: name: use letters, digits, '.', '_', '=' and '-', got {name!r}"
                )
            cells.append(Cell(name, values, name))
        if not cells:
            cells = [Cell(cell_name({}), {}, cell_name({}))]  # no axes: one cell, the recipe with [set]
        seen: dict[str, dict] = {}
        for cell in cells:
            if cell.name in seen:
                raise ConfigError(f"{self.source}: two cells are both named {cell.name!r} ({seen[cell.name]})")
            seen[cell.name] = cell.values
        return cells

    def validate(self) -> None:
        """Build every cell's RunConfig (and preprocess options): all errors surface before any run starts."""
        names = [g.name for g in self.groups()]
        if self.reference and self.reference not in names:
            raise ConfigError(
                f"{self.source}: experiment.reference: no cell named {self.reference!r} ({', '.join(names)})"
            )
        for i, claim in enumerate(self.claims):
            if claim.metric not in RESULT_METRICS:
                raise ConfigError(
                    f"{self.source}: claims[{i}].metric: expected one of {', '.join(RESULT_METRICS)}, "
                    f"got {claim.metric!r}"
                )
            sides = [claim.higher] + ([claim.lower] if isinstance(claim.lower, str) else [])
            for side in sides:
                if side not in names:
                    raise ConfigError(f"{self.source}: claims[{i}]: no cell named {side!r} ({', '.join(names)})")
        for cell in self.expand():
            cell_config(self, cell)
            if self.preprocess is None and any(k.startswith("preprocess.") for k in self.fields_of(cell)):
                raise ConfigError(
                    f"{self.source}: cell {cell.name}: preprocess.* fields need a [preprocess] table "
                    "(inputs, tokenizer) to build the shards from"
                )

    def fields_of(self, cell: Cell) -> dict[str, Any]:
        return {**self.set, **cell.values}


def cell_name(values: dict[str, Any]) -> str:
    """`objective-sop_sharing-all` from {"preprocess.objective": "sop", "model.overrides.sharing": "all"}."""
    if not values:
        return "base"
    parts = []
    for key, value in values.items():
        short = key.rsplit(".", 1)[-1]
        text = json.dumps(value) if not isinstance(value, str) else value
        parts.append(f"{short}-{text}")
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", "_".join(parts)).strip("-")


def _dataclass_from(cls, values: Any, where: str):
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a table, got {values!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown field (expected one of {', '.join(sorted(known))})")
    try:
        return cls(**values)
    except TypeError as err:
        raise ConfigError(f"{where}: {err}") from None


def cell_preprocess(spec: ExperimentSpec, cell: Cell, max_seq_length: int) -> dict[str, Any] | None:
    """The preprocess options of a cell (the [preprocess] table with its preprocess.* fields), or None."""
    if spec.preprocess is None:
        return None
    options = dataclasses.asdict(spec.preprocess)
    for key, value in spec.fields_of(cell).items():
        if key.startswith("preprocess."):
            name = key.removeprefix("preprocess.")
            if name not in options or name == "cache":
                raise ConfigError(f"{spec.source}: cell {cell.name}: {key}: not a preprocess option of a cell")
            options[name] = value
    for name, shape_name in shape_fields(PreprocessSpec).items():
        if problem := shape_problem(shape_name, options[name]):
            raise ConfigError(f"{spec.source}: cell {cell.name}: preprocess.{name}: {problem}")
    options["max_seq_length"] = max_seq_length
    return options


def shards_dir(options: dict[str, Any]) -> Path:
    """`<cache>/<objective>-<max_seq_length>-<hash of every option>`: one directory per distinct option set."""
    key = {k: v for k, v in options.items() if k != "cache"}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return Path(options["cache"]) / f"{options['objective']}-{options['max_seq_length']}-{digest}"


def cell_config(spec: ExperimentSpec, cell: Cell) -> RunConfig:
    """The cell's RunConfig: the recipe, then [set], then the cell's values; its own run name and directory.
    `model.init_from = "cell:NAME"` becomes the path of cell NAME's final checkpoint."""
    where = f"{spec.source}: cell {cell.name}"
    recipe = resolve_config_path(spec.recipe)
    data = tomllib.loads(recipe.read_text())
    fields_set = {k: v for k, v in spec.fields_of(cell).items() if not k.startswith("preprocess.")}
    merge_fields(data, fields_set, origin=where)
    data.setdefault("run", {}).update(name=f"{spec.name}-{cell.name}", output_dir=str(spec.directory / RUNS_DIR))
    if spec.preprocess is not None:
        seq = data.get("data", {}).get("max_seq_length", RunConfig().data.max_seq_length)
        data.setdefault("data", {})["shards"] = str(shards_dir(cell_preprocess(spec, cell, seq)))
    source = init_source(spec, cell)
    if source is not None:
        data["model"]["init_from"] = str(final_checkpoint(cell_config(spec, source)))
    return RunConfig.from_dict(data, source=where)


def init_source(spec: ExperimentSpec, cell: Cell) -> Cell | None:
    """The earlier cell whose final checkpoint `model.init_from = "cell:NAME"` names (with seeds: NAME's cell of
    the same seed), or None."""
    value = spec.fields_of(cell).get("model.init_from")
    if not isinstance(value, str) or not value.startswith("cell:"):
        return None
    name = value.removeprefix("cell:")
    if spec.seeds:
        name = f"{name}_seed-{cell.values['run.seed']}"
    cells = spec.expand()
    earlier = cells[: [c.name for c in cells].index(cell.name)]
    source = next((c for c in earlier if c.name == name), None)
    if source is None:
        names = ", ".join(c.name for c in earlier) or "none"
        raise ConfigError(
            f"{spec.source}: cell {cell.name}: model.init_from: {value!r} names no earlier cell of the spec "
            f"(earlier cells: {names})"
        )
    return source


def final_checkpoint(config: RunConfig) -> Path:
    """`<run_dir>/checkpoints/step_<total_steps>`: where a finished run's last checkpoint is (services.train.state)."""
    from services.rundir.checkpoints import CHECKPOINTS_DIR, checkpoint_dir

    return checkpoint_dir(config.run_dir / CHECKPOINTS_DIR, config.optim.total_steps)
