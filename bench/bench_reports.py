"""What reporting metrics costs a training step (issue 38): steps/s of `albert pretrain` with a metrics line every 1,
20 and 100 steps against none at all, on 1 and 2 workers, in one run.

Each run is `services.train.pretrain.pretrain` itself (the embedded Ray, the run's coordinator actor, Ray Train
workers, the driver's live view writing TensorBoard events from metrics.jsonl, the report at the end), on the tiny
recipe (configs/tiny.toml: H=64, 2 layers, global batch 32 of 128 tokens) and the demo's shards, with
`train.log_every` set to the interval ("none": larger than the run) and no checkpoint before the last step. The
shards are a few MB that the page cache holds and each worker's input thread reads ahead of the loop, so a step is
the model's work and the loop's own (launch-bound). A step callback on rank 0 (services.train.callbacks) notes the
time after each step; steps/s is measured from step --warmup to the step before the last (whose final checkpoint
is not a report), and a report's cost is the median duration of the steps that logged minus the median of the
others, in the same run. The intervals are interleaved in each repeat (none, 1, 20, 100, then again) so that a
change of load on the shared machine falls on all of them; each ratio is the median over repeats of
steps/s(interval) / steps/s(none) within one repeat.

    python bench/bench_reports.py [--workers 1 2] [--steps 300] [--repeats 2] [--json reports/reports.json]

Run it against another checkout (PYTHONPATH=/path/to/checkout) for the before/after comparison; `--label` names
the code measured in the JSON.

Target (issue 38): every ratio >= 0.98.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NONE = 0  # the interval that stands for "no reports": log_every larger than the run


class StepTimer:
    """Rank 0 notes perf_counter after each step; at `last` it writes them (step -> seconds) to `out`.

    It lives in this script: cloudpickle carries a class of `__main__` to the workers by value."""

    def __init__(self, out: str, last: int):
        self.out, self.last = out, last
        self.times: dict[int, float] = {}

    def before_step(self, **_) -> None:
        pass

    def after_step(self, *, step: int, rank: int, started_at: int) -> None:
        if rank != 0:
            return
        if not self.times:
            import torch

            torch.set_num_threads(1)
        self.times[step] = time.perf_counter()
        if step == self.last:
            Path(self.out).write_text(json.dumps(self.times))


def recipe(shards: Path, out_dir: Path, name: str, *, workers: int, every: int, steps: int):
    from services.rundir.config import RunConfig

    never = 10 * steps
    return RunConfig.load(
        REPO / "configs" / "tiny.toml",
        {
            "run.name": name,
            "run.output_dir": str(out_dir),
            "data.shards": str(shards),
            "optim.total_steps": steps,
            "optim.warmup_steps": 10,
            "optim.decay_steps": 10,
            "train.num_workers": workers,
            "train.log_every": every or never,
            "train.checkpoint_every": never,  # only the final checkpoint, after the measured steps
            "eval.heldout_batches": 1,  # the final checkpoint's evaluation, after the measured steps
        },
    )


def one_run(shards: Path, work: Path, *, workers: int, every: int, steps: int, warmup: int) -> dict:
    from services.train.callbacks import installed
    from services.train.pretrain import pretrain

    name = f"reports-w{workers}-e{every}-{time.monotonic_ns()}"
    config = recipe(shards, work, name, workers=workers, every=every, steps=steps)
    out = work / f"{name}.times.json"
    with installed(StepTimer(str(out), steps)):
        pretrain(config, progress=False)
    times = {int(k): v for k, v in json.loads(out.read_text()).items()}
    shutil.rmtree(work / name, ignore_errors=True)
    first, last = warmup, steps - 1  # the last step saves the final checkpoint: not measured
    durations = {s: times[s] - times[s - 1] for s in range(first + 1, last + 1)}
    logged = [d for s, d in durations.items() if every and s % every == 0]
    quiet = [d for s, d in durations.items() if not (every and s % every == 0)]
    median_ms = lambda xs: round(1000 * statistics.median(xs), 3) if xs else None  # noqa: E731
    return {
        "steps_per_s": (last - first) / (times[last] - times[first]),
        "logged_step_ms_median": median_ms(logged),
        "quiet_step_ms_median": median_ms(quiet),
        "reports_measured": len(logged),
    }


def report_ms(run: dict, none: dict) -> float | None:
    """A report's cost: the median step that logged minus the median step that did not (in the same run; every
    step logs at interval 1: the run without reports); None when no measured step logged."""
    if run["logged_step_ms_median"] is None:
        return None
    quiet = run["quiet_step_ms_median"] or none["quiet_step_ms_median"]
    return round(run["logged_step_ms_median"] - quiet, 3)


def measure(shards: Path, work: Path, workers: int, intervals: list[int], args) -> dict:
    repeats: list[dict[int, dict]] = []
    for r in range(args.repeats):
        runs = {}
        for every in [NONE, *intervals]:
            runs[every] = one_run(shards, work, workers=workers, every=every, steps=args.steps, warmup=args.warmup)
            print(f"workers {workers} repeat {r} every {every or 'none'}: {runs[every]}", flush=True)
        repeats.append(runs)
    out: dict = {
        "none_steps_per_s": [round(rep[NONE]["steps_per_s"], 3) for rep in repeats],
        "none_step_ms_median": [rep[NONE]["quiet_step_ms_median"] for rep in repeats],
    }
    for every in intervals:
        ratios = [rep[every]["steps_per_s"] / rep[NONE]["steps_per_s"] for rep in repeats]
        out[f"every_{every}"] = {
            "ratio": round(statistics.median(ratios), 4),
            "ratios": [round(x, 4) for x in ratios],
            "steps_per_s": [round(rep[every]["steps_per_s"], 3) for rep in repeats],
            "report_ms": [report_ms(rep[every], rep[NONE]) for rep in repeats],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--every", type=int, nargs="+", default=[1, 20, 100])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--shards", default=str(REPO / ".cache/albert/sample-shards-8000-128"))
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from services.cluster import connect

    connect(num_cpus=2, worker_logs=False)
    work = Path(tempfile.mkdtemp(prefix="albert-bench-reports-"))
    started = time.time()
    try:
        results = {str(w): measure(Path(args.shards), work, w, args.every, args) for w in args.workers}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    import services

    summary = {
        "label": args.label,
        "code": str(Path(services.__file__).resolve().parents[1]),
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "recipe": "configs/tiny.toml, global batch 32 x 128 tokens",
        "seconds": round(time.time() - started, 1),
        "workers": results,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
