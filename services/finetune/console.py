"""What `albert finetune` prints: a line per finished seed, the summary table (dev metrics per seed and their
median), and after Ctrl-C the partial summary of what had finished. Plain text, aligned; torch- and Ray-free.

Values are shown as the summary's markdown table shows them: GLUE / RACE / custom metrics in percent, SQuAD's
as the official script prints them (already percent).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from albert_core.files import METRICS_FILE
from services.terminal import printable

_SCALED_TASKS_EXCEPT = ("squad1", "squad2")


def _scale(task: str) -> float:
    return 1.0 if task in _SCALED_TASKS_EXCEPT else 100.0


def _metrics_text(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, int | float))


def seed_line(result: dict[str, Any], done: int, total: int) -> str:
    """A finished run: "seed 12346 finished (2/3): dev acc 0.8125, macro_f1 0.8012 at step 40 of 40"."""
    return (
        f"seed {result['seed']} finished ({done}/{total}): dev {_metrics_text(result['dev'])} "
        f"at step {result['best_step']} of {result['steps']}"
    )


def console_table(summary: dict[str, Any]) -> str:
    """The median_of_seeds summary as an aligned text table: a row per seed (and its best step), then the median."""
    names = list(summary["median"])
    scale = _scale(summary["task"])
    steps = {r["seed"]: r.get("best_step") for r in summary.get("results", [])}
    header = ["seed", *names] + (["best step"] if steps else [])
    rows = []
    for row in summary["per_seed"]:
        cells = [str(row["seed"]), *(f"{scale * row[k]:.2f}" for k in names)]
        rows.append(cells + ([str(steps.get(row["seed"], ""))] if steps else []))
    rows.append(["median", *(f"{scale * summary['median'][k]:.2f}" for k in names)] + ([""] if steps else []))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(padded).rstrip()

    unit = "" if scale == 1.0 else " (x100)"
    title = f"{summary['task']}: dev metrics{unit}, {summary['runs']} run{'s' if summary['runs'] != 1 else ''}"
    title += f" (primary: {summary['metric']})"
    return "\n".join([title, line(header), *(line(r) for r in rows)])


def print_summary(summary: dict[str, Any], output: Path) -> None:
    print()
    print(console_table(summary))
    for line in (summary.get("model"), summary.get("settings")):
        if line:
            print(printable(line))
    if summary.get("ensemble"):
        print(f"ensemble of {summary['ensemble']['runs']}: dev {_metrics_text(summary['ensemble']['dev'])}")
    if any(summary.get("test") or []):
        for row, test in zip(summary["seeds"], summary["test"], strict=False):
            if test:
                print(f"seed {row}: test {_metrics_text(test)}")
    print(f"wrote {output / 'summary.json'} and {output / 'summary.md'}")


def run_log(seed_dir: Path) -> list[dict[str, Any]]:
    """The dev evaluations a run has logged so far (its metrics.jsonl), [] when there are none."""
    path = seed_dir / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written when the run stopped
    return records


def unfinished_line(seed: int, history: Sequence[dict[str, Any]], metric: str | None, total: int | None) -> str:
    """A run that did not finish: its best dev evaluation so far (by `metric`; else its last), or none."""
    if not history:
        return f"seed {seed}: interrupted before its first dev evaluation"
    if metric is not None and all(metric in r for r in history):
        chosen, which = max(history, key=lambda r: _finite(r[metric])), "best"
    else:
        chosen, which = history[-1], "last"
    metrics = {k: v for k, v in chosen.items() if k not in ("step", "time", "train_loss", "lr")}
    at = f"step {chosen['step']}" + (f" of {total}" if total else "")
    return f"seed {seed}: interrupted; {which} dev evaluation so far at {at}: {_metrics_text(metrics)}"


def _finite(value: Any) -> float:
    return value if isinstance(value, int | float) and value == value else float("-inf")


def print_interrupted(
    summary: dict[str, Any] | None,
    unfinished: Sequence[str],
    planned: int,
    output: Path,
    wrote: bool,
    how: str = "interrupted (Ctrl-C)",
) -> None:
    """The partial summary after Ctrl-C (or SIGTERM: `how`): the finished runs' table (if any), then a line per
    unfinished run."""
    finished = 0 if summary is None else summary["runs"]
    print(f"\n{how}: {finished} of {planned} run{'s' if planned != 1 else ''} finished")
    if summary is not None:
        print(console_table(summary))
    for line in unfinished:
        print(line)
    if wrote:
        print(f"wrote {output / 'summary.json'} (interrupted: true)")
