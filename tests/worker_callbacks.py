"""The tests' step callbacks (services.train.callbacks), run by every Ray Train worker of a pretraining run:

- `TraceExamples(directory)`: as each step starts, every worker appends {"step", "epoch", "rank", "pid", "time",
  "example_ids"} to `directory/rank<r>.jsonl` (`read_trace` reads them back). Written before the step, so every
  step a worker trained has its line, even when the worker dies right after it while another rank's checkpoint
  keeps it; a step redone after a failure is appended again (the last line of each (rank, step) is the attempt that
  counted). One O_APPEND write per line: lines are whole or absent.
- `CrashAfterStep(step)`: every worker raises SimulatedCrash right after that step (its checkpoint, if it has one,
  saved), unless the worker started from it (the resume after the crash trains on).
- `PaceSteps(seconds)`: every worker sleeps that long after each step, so that a tiny model's run lasts as long
  as a fault schedule needs (bench/soak.py).
- `HoldAfterStep(step, flag)`: every worker waits after that step (its checkpoint saved) until the file `flag`
  exists, at most `timeout` seconds: a test holds training there while it injects a fault beside it.

In a test's own process: `with installed(TraceExamples(d), CrashAfterStep(5)):` around the call that trains. For
an albert command in another process (a subprocess, a cluster job), `python -m tests.worker_callbacks [--trace DIR]
[--crash-after-step N] ALBERT_ARGS...` runs `albert ALBERT_ARGS...` with those callbacks installed, and the
repository on PYTHONPATH for the processes it starts (the workers import this module to unpickle them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.train.callbacks import StepCallback, installed


class SimulatedCrash(RuntimeError):
    """Raised by every worker right after CrashAfterStep's step."""


def crash_message(step: int) -> str:
    return f"simulated crash after step {step}"


class CrashAfterStep(StepCallback):
    def __init__(self, step: int):
        self.step = step

    def after_step(self, *, step: int, rank: int, started_at: int) -> None:
        if step == self.step and step > started_at:
            raise SimulatedCrash(crash_message(step))


class PaceSteps(StepCallback):
    def __init__(self, seconds: float):
        self.seconds = seconds

    def after_step(self, *, step: int, rank: int, started_at: int) -> None:
        time.sleep(self.seconds)


class HoldAfterStep(StepCallback):
    def __init__(self, step: int, flag: str | Path, timeout: float = 120.0):
        self.step, self.flag, self.timeout = step, Path(flag), timeout

    def after_step(self, *, step: int, rank: int, started_at: int) -> None:
        deadline = time.monotonic() + self.timeout
        while step == self.step and not self.flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)


class TraceExamples(StepCallback):
    def __init__(self, directory: str | Path):
        self.directory = Path(directory).resolve()
        self.directory.mkdir(parents=True, exist_ok=True)

    def before_step(self, *, step: int, epoch: int, rank: int, rows: Sequence[dict[str, Any]]) -> None:
        ids = [int(i) for r in rows for i in r["example_id"]]
        record = {
            "step": step,
            "epoch": epoch,
            "rank": rank,
            "pid": os.getpid(),
            "time": time.time(),
            "example_ids": ids,
        }
        fd = os.open(self.directory / f"rank{rank}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)


def read_trace(directory: Path) -> list[dict[str, Any]]:
    """Every line TraceExamples wrote, oldest first (a line half written by a killed worker is left out)."""
    lines = []
    for path in sorted(Path(directory).glob("rank*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().split("\n")[:-1]]
    return sorted(lines, key=lambda r: r["time"])


def callbacks_command(
    albert_args: Sequence[str],
    *,
    trace: Path | None = None,
    crash_after: int | None = None,
    step_seconds: float = 0.0,
    python: str = sys.executable,
) -> list[str]:
    """The command line of `albert ALBERT_ARGS...` with those callbacks installed (this module as the program)."""
    own = ["--trace", str(trace)] if trace is not None else []
    own += ["--crash-after-step", str(crash_after)] if crash_after is not None else []
    own += ["--step-seconds", str(step_seconds)] if step_seconds else []
    return [python, "-m", "tests.worker_callbacks", *own, *albert_args]


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.worker_callbacks", allow_abbrev=False)
    parser.add_argument("--trace", type=Path, help="TraceExamples into this directory")
    parser.add_argument("--crash-after-step", type=int, help="CrashAfterStep at this step")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="PaceSteps: sleep this long after each step")
    parser.add_argument("albert_args", nargs=argparse.REMAINDER, help="albert's command line")
    own = parser.parse_args(argv)
    callbacks: list[StepCallback] = [TraceExamples(own.trace)] if own.trace else []
    callbacks += [CrashAfterStep(own.crash_after_step)] if own.crash_after_step is not None else []
    callbacks += [PaceSteps(own.step_seconds)] if own.step_seconds else []
    from services.cli import main as albert

    repo = str(Path(__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join([repo, *filter(None, [os.environ.get("PYTHONPATH")])])
    with installed(*callbacks):
        return albert(own.albert_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
