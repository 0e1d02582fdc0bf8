"""`albert finetune --search FIELD=V1,V2,...`: the grid of a sweep, read and checked before Ray starts.

FIELD is one of the command's options that shape one run, by its flag name (`lr`, `batch-size` or `batch_size`,
`--max-steps`); the values are read with that option's own type and choices. The grid is every combination of the
searches' values, in the order given (the first search varies slowest). Each problem is one line naming the
--search and what was expected; the ranges (lr > 0, batch_size >= 1, ...) are the run config's own checks, made on
every point before Ray starts (services.finetune.sweep). Torch- and Ray-free.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.terminal import UsageError

# The options of `albert finetune` that shape one run (the rest name the data, the seeds, the output, the cluster).
SEARCHABLE = (
    *("lr", "batch_size", "max_seq_length", "optimizer", "max_steps", "eval_every", "patience"),
    *("micro_batch_size", "precision", "pooling"),
)
MAX_TRIALS = 500  # points x seeds: above this a sweep is refused (a typo in a list, not a plan)


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


@dataclass(frozen=True)
class Grid:
    """The searched fields (dests, in the order given) and their values; `points` are every combination."""

    values: dict[str, list[Any]]

    @property
    def points(self) -> list[dict[str, Any]]:
        names = list(self.values)
        return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*self.values.values())]

    def trials(self, seeds: int) -> int:
        return len(self.points) * seeds


def point_label(point: Mapping[str, Any]) -> str:
    """ "lr=2e-05 batch_size=16": a point as its searched fields."""
    return " ".join(f"{k}={v}" for k, v in point.items())


def parse_search(specs: Sequence[str], options: Mapping[str, argparse.Action], given: Mapping[str, Any]) -> Grid:
    """The grid of `--search FIELD=V1,V2,...` options. `options`: the command's actions by dest; `given`: the values
    of the command line (a field searched and also given as its own option is refused)."""
    values: dict[str, list[Any]] = {}
    for spec in specs:
        name, sep, listed = spec.partition("=")
        field = name.strip().removeprefix("--").replace("-", "_")
        where = f"albert finetune: --search {spec}"
        if not sep or not field:
            raise UsageError(f"{where}: expected FIELD=V1,V2,... (for example lr=1e-5,2e-5)")
        if field not in options:
            raise UsageError(f"{where}: albert finetune has no option {flag(field)}; it searches {searchable()}")
        if field not in SEARCHABLE:
            raise UsageError(f"{where}: {flag(field)} is not a setting of one run; --search takes {searchable()}")
        if field in values:
            raise UsageError(f"{where}: {flag(field)} is searched twice; give its values in one list")
        if given.get(field) is not None:
            raise UsageError(f"{where}: {flag(field)} is also given on its own; give it one way")
        values[field] = _values(where, field, listed, options[field])
    return Grid(values)


def _values(where: str, field: str, listed: str, action: argparse.Action) -> list[Any]:
    items = [item.strip() for item in listed.split(",")]
    if not listed.strip():
        raise UsageError(f"{where}: the list of {flag(field)} values is empty")
    if any(not item for item in items):
        raise UsageError(f"{where}: an empty value in the list (expected values separated by single commas)")
    convert = action.type or str
    values = []
    for item in items:
        try:
            value = convert(item)
        except (TypeError, ValueError):
            kind = {int: "an integer", float: "a number"}.get(convert, "a value")
            raise UsageError(f"{where}: {item!r} is not {kind} ({flag(field)} takes {kind})") from None
        if action.choices is not None and value not in action.choices:
            raise UsageError(f"{where}: {item!r} is not one of {', '.join(map(str, action.choices))}")
        values.append(value)
    if len(set(values)) != len(values):
        raise UsageError(f"{where}: a value is listed twice")
    return values


def check_size(grid: Grid, seeds: int) -> None:
    """Refuse more than MAX_TRIALS trials, saying how many points and seeds made them."""
    total = grid.trials(seeds)
    if total > MAX_TRIALS:
        sizes = " x ".join(f"{len(v)} {k}" for k, v in grid.values.items())
        raise UsageError(
            f"albert finetune: --search: {sizes} values x {seeds} seeds = {total} trials, more than the cap of "
            f"{MAX_TRIALS}; search fewer values or seeds"
        )


def searchable() -> str:
    """The searchable options by their flag names: "lr, batch-size, ..."."""
    return ", ".join(f.replace("_", "-") for f in SEARCHABLE)
