"""`albert experiment report SPEC... --output reports/small-scale.md`: one markdown report over several experiment
specs, regenerated from their finished cells (with `--run`, after running the unfinished ones; finished cells are
skipped).

For each spec: its description, the per-seed table, the groups' means ± standard errors with differences to the
reference group (95% intervals), its claims with verdicts, its notes, the training curves of MLM and pair-task
accuracy (mean over seeds, from each cell's metrics.jsonl) and, when its cells measured them, the layer transitions
of Figure 1 (mean over seeds). At the top: every claim's verdict in one table, the commands, and the machine time
of the cells. PNGs and each spec's results.csv go to `<out stem>/` beside the markdown.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from albert_core.files import atomic_write_bytes
from services.experiments.cells import METRIC_COLUMNS, RESULTS_CSV, collect_results, write_tables
from services.experiments.spec import ExperimentSpec, cell_config
from services.experiments.stats import claims_markdown, format_difference, group_results, judge, summary_markdown

if TYPE_CHECKING:
    pass

SMOOTH = 10  # training log lines per point of the curves (moving mean)


Results = list[dict[str, Any]]  # a spec's finished cells (collect_results), read once per report


def spec_section(spec: ExperimentSpec, results: Results, assets: Path, link: str) -> list[str]:
    """The markdown of one spec (and its PNGs, its results.csv copy under `assets`)."""
    write_tables(spec)
    shutil.copyfile(spec.directory / RESULTS_CSV, assets / f"{spec.name}.csv")
    lines = [f"## {spec.name}", "", spec.description, ""]
    lines += [f"Spec: `{spec.source}`. Every cell: `{link}/{spec.name}.csv`.", ""]
    if not results:
        return [*lines, "No cell has finished yet.", ""]
    lines += [summary_markdown(spec, results, METRIC_COLUMNS), ""]
    if spec.claims:
        lines += [claims_markdown(spec, results), ""]
    if spec.notes:
        lines += [spec.notes.strip(), ""]
    groups = group_results(spec, results)
    curves = plot_curves(spec, groups, assets / f"{spec.name}-curves.png")
    if curves is not None:
        lines += [f"![training curves of {spec.name}]({link}/{curves.name})", ""]
    heldout = plot_heldout(spec, groups, assets / f"{spec.name}-heldout.png")
    if heldout is not None:
        lines += [f"![held-out pair accuracy of {spec.name}]({link}/{heldout.name})", ""]
    layers = plot_layers(spec, groups, assets / f"{spec.name}-layers.png")
    if layers is not None:
        lines += [f"![layer transitions of {spec.name}]({link}/{layers.name})", ""]
    return lines


def verdict_rows(specs: list[ExperimentSpec], results: dict[str, Results]) -> list[str]:
    """Every claim of every spec: the spec, the paper's claim, our difference [95%] and the verdict."""
    lines = ["| experiment | claim (paper) | ours: difference [95%] | verdict |", "|---|---|---|---|"]
    for spec in specs:
        for v in judge(spec, group_results(spec, results[spec.name])):
            paper = f"{v.claim.text} ({v.claim.paper})" if v.claim.paper else v.claim.text
            ours = f"{v.claim.metric} {format_difference(v.claim.metric, v.difference)}"
            lines.append(f"| {spec.name} | {paper} | {ours} | {v.text} |")
    return lines


def cell_seconds(result: dict) -> float:
    """A finished cell's machine time: wall seconds of its preprocessing, training and evaluation."""
    return sum(float(result.get(k) or 0) for k in ("train_s", "preprocess_s", "eval_s"))


def _work(spec: ExperimentSpec) -> float:
    """A cell's training work in step-layers (its cost at the small specs' width, where the step is the cost)."""
    config = cell_config(spec, spec.expand()[0])
    return float(config.optim.total_steps * config.model_config(8).num_hidden_layers)


def time_rows(specs: list[ExperimentSpec], results: dict[str, Results]) -> list[str]:
    """Per spec: cells finished of planned, machine hours so far and for all its cells. A spec with no finished
    cell is estimated from the others' seconds per step-layer."""
    done = {s.name: [cell_seconds(r) for r in results[s.name]] for s in specs}
    measured = [(sum(done[s.name]), len(done[s.name]) * _work(s)) for s in specs if done[s.name]]
    per_unit = sum(t for t, _ in measured) / sum(w for _, w in measured) if measured else None
    lines = ["| experiment | cells | hours so far | hours for all cells |", "|---|---|---|---|"]
    total_so_far = total_all = 0.0
    for spec in specs:
        seconds, planned = done[spec.name], len(spec.expand())
        if seconds:
            every = sum(seconds) / len(seconds) * planned
        else:
            every = per_unit * _work(spec) * planned if per_unit else math.nan
        total_so_far, total_all = total_so_far + sum(seconds), total_all + every
        estimate = "" if seconds else " (estimated)"
        lines.append(f"| {spec.name} | {len(seconds)} of {planned} | {sum(seconds) / 3600:.2f} | "
                     f"{every / 3600:.2f}{estimate} |")  # fmt: skip
    lines.append(f"| all | | {total_so_far / 3600:.2f} | {total_all / 3600:.2f} |")
    return lines


def write_report(specs: list[ExperimentSpec], out: Path, *, title: str, command: str) -> Path:
    assets = out.with_suffix("")
    assets.mkdir(parents=True, exist_ok=True)
    results = {spec.name: collect_results(spec) for spec in specs}
    sections = [line for spec in specs for line in spec_section(spec, results[spec.name], assets, assets.name)]
    finished = sum(len(r) for r in results.values())
    planned = sum(len(s.expand()) for s in specs)
    lines = [
        f"# {title}",
        "",
        f"Generated by `{command}` from the finished cells ({finished} of {planned}). Rerunning it with `--run` "
        "runs the unfinished cells first and skips the finished ones.",
        "",
        "## Verdicts",
        "",
        *verdict_rows(specs, results),
        "",
        "A claim is reproduced when the 95% interval of our difference lies on the paper's side of 0, not "
        "reproduced when it lies on the other side, and not resolved when it contains 0.",
        "",
        "## Machine time",
        "",
        *time_rows(specs, results),
        "",
        "Wall seconds of each cell's preprocessing, training and evaluation, one cell at a time on the machine.",
        "",
        *sections,
    ]
    atomic_write_bytes(out, "\n".join(lines).encode())
    return out


# ============================================================================================================
# figures


def _group_curves(groups: dict[str, Results]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """group -> metric -> [(step, mean over the group's seeds)] of the training log's mlm_acc and pair_acc (the
    markers' "curve"), a moving mean of SMOOTH points."""
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for group, results in groups.items():
        runs = [{int(step): (mlm, pair) for step, mlm, pair in r["curve"]} for r in results if r.get("curve")]
        if not runs:
            continue
        common = sorted(set.intersection(*(set(run) for run in runs)))
        for index, metric in enumerate(("mlm_acc", "pair_acc")):
            means = [sum(run[s][index] for run in runs) / len(runs) for s in common]
            window = [means[max(0, i - SMOOTH + 1) : i + 1] for i in range(len(means))]
            curves.setdefault(group, {})[metric] = [(s, sum(w) / len(w)) for s, w in zip(common, window, strict=True)]
    return curves


def plot_curves(spec: ExperimentSpec, groups: dict[str, Results], path: Path) -> Path | None:
    """Training MLM and pair-task accuracy per group (mean over seeds, moving mean of SMOOTH log lines). A group
    whose pair accuracy is 0 throughout trained without labelled pairs (objective none) and has no pair curve."""
    curves = _group_curves(groups)
    if not curves:
        return None
    lines = {
        label: {group: metrics[metric] for group, metrics in curves.items() if any(v for _, v in metrics[metric])}
        for label, metric in (("training MLM accuracy", "mlm_acc"), ("training pair-task accuracy", "pair_acc"))
    }
    return _two_panels(lines, "step", f"{spec.name}: mean over seeds", path, points=False)


def plot_heldout(spec: ExperimentSpec, groups: dict[str, Results], path: Path) -> Path | None:
    """Held-out SOP and NSP accuracy of the pair head per group and step (mean over seeds), for specs whose cells
    were evaluated more than once (eval.every_steps)."""
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {"held-out SOP accuracy": {}, "held-out NSP accuracy": {}}
    for group, results in groups.items():
        runs = [{int(e[0]): e for e in r.get("evals", [])} for r in results]
        common = sorted(set.intersection(*(set(run) for run in runs)))
        if len(common) < 2:
            continue
        for column, label in ((2, "held-out SOP accuracy"), (3, "held-out NSP accuracy")):
            panels[label][group] = [(s, sum(run[s][column] for run in runs) / len(runs)) for s in common]
    if not panels["held-out SOP accuracy"]:
        return None
    return _two_panels(panels, "step", f"{spec.name}: the pair head on held-out pairs, mean over seeds", path)


def plot_layers(spec: ExperimentSpec, groups: dict[str, Results], path: Path) -> Path | None:
    """Figure 1: each group's L2 distance and cosine similarity per layer (mean over seeds), when measured."""
    layered = {g: [r["layers"] for r in rs if r.get("layers")] for g, rs in groups.items()}
    layered = {g: runs for g, runs in layered.items() if runs}
    if not layered:
        return None
    lines = {
        label: {
            group: [(row["layer"], sum(run[i][key] for run in runs) / len(runs)) for i, row in enumerate(runs[0])]
            for group, runs in layered.items()
        }
        for label, key in (("L2 distance (input, output)", "l2"), ("cosine similarity (input, output)", "cosine"))
    }
    return _two_panels(lines, "layer", f"{spec.name}: layer transitions on held-out pairs, mean over seeds", path)


def _two_panels(
    panels: dict[str, dict[str, list[tuple[float, float]]]], xlabel: str, title: str, path: Path, *, points: bool = True
) -> Path:
    """Side by side, one panel per ylabel: one line per group of (x, y) points (marked unless `points` is False)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(11, 4))
    marker = "o" if points else None
    for ax, (ylabel, lines) in zip(axes, panels.items(), strict=True):
        for group, points in lines.items():
            ax.plot([x for x, _ in points], [y for _, y in points], marker=marker, label=group)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
