"""Training MLM loss of stacking-small's cells against total training steps: stacking-small.png and .csv.

The stacked path is the 2-layer cell (steps 1-300) followed by the stacked 4-layer cell (its steps 1-300 drawn at
301-600); the scratch cell is drawn as it ran. Each point is the mean of the step losses logged in a 50-step window
(train.log_every = 10, so 5 logged steps of 32 sequences each).

    .venv/bin/python reports/plateau/stacking_curves.py [runs/experiments/stacking-small] [reports/plateau]
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from services.rundir.log import read_metrics

WINDOW = 50
PATHS = {  # label -> [(cell, step offset), ...]
    "stacked: 2L x 300, then 4L x 300": [("2L-300", 0), ("4L-stacked-300", 300)],
    "scratch: 4L x 600": [("4L-scratch-600", 0)],
}


def curve(experiment: Path, sharing: str, parts: list[tuple[str, int]]) -> list[tuple[int, float]]:
    points: dict[int, list[float]] = {}
    for cell, offset in parts:
        run = experiment / "runs" / f"stacking-small-{sharing}-{cell}"
        for record in read_metrics(run):
            if record.get("kind") == "train" and "mlm_loss" in record:
                step = record["step"] + offset
                points.setdefault((step - 1) // WINDOW, []).append(record["mlm_loss"])
    return [((window + 1) * WINDOW, sum(v) / len(v)) for window, v in sorted(points.items())]


def main(experiment: Path, out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    rows = []
    for ax, sharing in zip(axes, ("none", "all"), strict=True):
        for label, parts in PATHS.items():
            points = curve(experiment, sharing, parts)
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3, label=label)
            rows += [{"sharing": sharing, "path": label, "step": s, "mlm_loss": round(v, 4)} for s, v in points]
        ax.axvline(300, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"sharing {sharing}")
        ax.set_xlabel("total training steps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel(f"train MLM loss (mean over {WINDOW} steps)")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "stacking-small.png", dpi=110)
    with (out / "stacking-small-curves.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["sharing", "path", "step", "mlm_loss"], lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    args = sys.argv[1:]
    runs = Path(args[0] if args else "runs/experiments/stacking-small")
    main(runs, Path(args[1] if len(args) > 1 else "reports/plateau"))
