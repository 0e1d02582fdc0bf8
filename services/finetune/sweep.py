"""`albert finetune --search ...`: a sweep of fine-tuning settings, every point x seed a Ray Tune trial
(services.finetune.trials), the points chosen by the median of their seeds' dev scores (the paper's protocol).

    <output>/sweep.json          the sweep: task, the searched fields, each point's settings, the seeds
    <output>/points/point_NN/seed_<s>/  one run (as `albert finetune` writes a seed's folder)
    <output>/results.csv         a row per point: its settings, median and IQR of the primary dev metric, every seed
    <output>/results.md          the same table in markdown, the best point marked
    <output>/summary.json|md, ensemble/   the best point's summary and ensemble, as `albert finetune` writes them
    <output>/tune/               Ray Tune's experiment state: the same command resumes it

Scores in results.csv are the metric's own values (GLUE accuracies as fractions); results.md and the console show
them as the summary table does (x100 but SQuAD's).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from albert_core.files import atomic_write_json, atomic_write_text
from services.finetune.search import Grid, point_label
from services.finetune.trials import TUNE_DIR, reused_line, run_trials
from services.terminal import UsageError, printable

if TYPE_CHECKING:
    from albert_core.finetune.config import FinetuneConfig

SWEEP_FILE = "sweep.json"
POINTS_DIR = "points"


@dataclass
class PointScores:
    """One point's seeds and their primary dev scores (None: the seed was stopped early by --early-stop). Its median
    and IQR are over the seeds that finished: all of them, unless --early-stop stopped some."""

    index: int
    point: dict[str, Any]
    seeds: list[int]
    scores: list[float | None]

    @property
    def finished(self) -> list[float]:
        return [s for s in self.scores if s is not None]

    @property
    def complete(self) -> bool:
        return len(self.finished) == len(self.scores)

    @property
    def median(self) -> float | None:
        return float(np.median(self.finished)) if self.finished else None

    @property
    def iqr(self) -> float | None:
        if not self.finished:
            return None
        return float(np.percentile(self.finished, 75) - np.percentile(self.finished, 25))


def best_point(rows: Sequence[PointScores]) -> PointScores:
    """The point of the highest median over its finished seeds; the first such on a tie. Without --early-stop every
    seed finishes; with it, ASHA stops runs one by one (not points), so a point's median may cover fewer seeds."""
    scored = [r for r in rows if r.finished]
    if not scored:
        raise RuntimeError("albert finetune --search: no run finished (every one was stopped early)")
    return max(scored, key=lambda r: (_finite(r.median), -r.index))


def _finite(value: float | None) -> float:
    return value if value is not None and value == value else float("-inf")


def sweep_configs(
    grid: Grid, make: Any, seeds: Sequence[int], output: Path
) -> tuple[list[FinetuneConfig], list[tuple[int, int]]]:
    """Every point x seed's config (`make(point, point_output)` -> one config per seed), and (point, seed) of each.
    A point the run config refuses (an lr <= 0, a batch size of 0) is one line naming it."""
    configs, where = [], []
    for i, point in enumerate(grid.points):
        try:
            point_configs = make(point, output / POINTS_DIR / f"point_{i:02d}")
        except ValueError as error:
            raise UsageError(f"albert finetune: --search point {point_label(point)}: {error}") from None
        configs += point_configs
        where += [(i, seed) for seed in seeds]
    return configs, where


def check_sweep_file(output: Path, record: dict[str, Any]) -> None:
    """Write output/sweep.json, or refuse when it holds another sweep (a resume must run the same trials)."""
    path = output / SWEEP_FILE
    if path.is_file():
        try:
            earlier = json.loads(path.read_text())
        except json.JSONDecodeError:
            earlier = None
        if earlier != record:
            raise UsageError(
                f"albert finetune: {output} holds another sweep ({path} differs from this command's); "
                "give another --output, or the same command to resume it"
            )
        return
    output.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record)


def sweep_record(task: str, grid: Grid, seeds: Sequence[int], configs: Sequence[FinetuneConfig]) -> dict[str, Any]:
    """What sweep.json holds: enough that a resume with other settings is refused."""
    runs = [json.loads(json.dumps(dataclasses.asdict(c), default=str)) for c in configs]
    return {"task": task, "searched": grid.values, "points": grid.points, "seeds": list(seeds), "runs": runs}


def run_sweep(
    grid: Grid,
    configs: Sequence[FinetuneConfig],
    where: Sequence[tuple[int, int]],
    output: Path,
    *,
    num_cpus: float,
    num_gpus: float,
    progress: bool,
    early_stop: str | None,
    address: str | None,
) -> tuple[list[PointScores], list[list[dict[str, Any]]], int]:
    """The trials, then each point's scores and finished results, and how many runs a resume reused."""
    points = grid.points
    labels = [f"[{point_label(points[i])}] " for i, _ in where]
    outcome = run_trials(
        configs,
        output / TUNE_DIR,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        progress=progress,
        early_stop=early_stop,
        labels=labels,
        address=address,
    )
    rows = [PointScores(i, p, [], []) for i, p in enumerate(points)]
    finished: list[list[dict[str, Any]]] = [[] for _ in points]
    for (i, seed), result in zip(where, outcome.results, strict=True):
        rows[i].seeds.append(seed)
        rows[i].scores.append(None if result is None else float(result["dev"][result["metric"]]))
        if result is not None:
            finished[i].append(result)
    return rows, finished, outcome.reused


def write_table(rows: Sequence[PointScores], best: PointScores, task: str, metric: str, output: Path) -> str:
    """results.csv and results.md; returns the markdown table (what the console shows)."""
    fields = list(rows[0].point)
    seeds = rows[0].seeds
    text = io.StringIO(newline="")
    out = csv.writer(text)
    out.writerow(["point", *fields, f"median_{metric}", f"iqr_{metric}", *(f"seed_{s}" for s in seeds), "best"])
    for r in rows:
        cells = [r.index, *r.point.values(), _raw(r.median), _raw(r.iqr), *(_raw(s) for s in r.scores)]
        out.writerow([*cells, "best" if r is best else ""])
    atomic_write_text(output / "results.csv", text.getvalue())
    scale = 1.0 if task in ("squad1", "squad2") else 100.0
    head = ["point", *fields, f"median {metric}", "IQR", *(f"seed {s}" for s in seeds)]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        median = _shown(r.median, scale) + (
            "" if r.complete or not r.finished else f" ({len(r.finished)} of {len(r.scores)})"
        )
        cells = [str(r.index), *map(str, r.point.values()), median, _shown(r.iqr, scale)]
        cells += [_shown(s, scale, "stopped") for s in r.scores]
        if r is best:
            cells = [f"**{c}**" for c in cells]
            cells[0] += " (best)"
        lines.append("| " + " | ".join(cells) + " |")
    unit = "" if scale == 1.0 else " (x100)"
    title = f"# {task}: {len(rows)} points x {len(seeds)} seeds, median dev {metric}{unit}, best point {best.index}"
    table = "\n".join(lines)
    atomic_write_text(output / "results.md", f"{title}\n\n{table}\n")
    return table


def _raw(value: float | None) -> str:
    return "" if value is None else repr(value)


def _shown(value: float | None, scale: float, none: str = "") -> str:
    return none if value is None else f"{scale * value:.2f}"


def print_table(table: str, best: PointScores, reused: int, total: int, output: Path) -> None:
    print()
    print(printable(table))
    seeds = [seed for seed, score in zip(best.seeds, best.scores, strict=True) if score is not None]
    print(f"best point: {point_label(best.point)} (median {best.median:.4f} over seeds {seeds})")
    if not best.complete:
        print(
            f"--early-stop stopped {len(best.seeds) - len(seeds)} of its {len(best.seeds)} seeds: for the median of "
            "every seed, run that point alone (without --search)"
        )
    if reused:
        print(reused_line(reused, total))
    print(f"wrote {output / 'results.csv'} and {output / 'results.md'}")
