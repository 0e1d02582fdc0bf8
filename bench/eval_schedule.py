"""Evaluation schedules on a real tiny run (issue 15, item 1): exactly once under kills, and what they cost training.

Everything runs through the CLI, as a user on one machine would (each command with its own embedded Ray):

- exactly once: `albert pretrain` of the tiny recipe (a checkpoint every --checkpoint-every steps, keep_last 2);
  `albert eval schedule RUN --every E` attached once the run has its checkpoint at 3 x checkpoint-every; the training
  process group SIGKILLed twice and resumed with `albert pretrain --resume` each time; the schedule's actor
  SIGKILLed once (Ray restarts it). Counted: the schedule's result lines per matching step in metrics.jsonl
  (each must be 1), the matching checkpoints the run saved, and those the schedule names missing.
- cost: the same recipe trained without a schedule and with one attached from the start, alternately
  (--pairs times), on the same machine in the same session: steps per second from the train lines' times after the
  first 100 steps, and the ratio with / without.

    python bench/eval_schedule.py [--steps 600] [--every 100] [--pairs 2] [--work DIR] [--skip-cost]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from services.rundir import log as run_log  # noqa: E402
from services.rundir import schedules  # noqa: E402
from services.rundir.checkpoints import CHECKPOINTS_DIR  # noqa: E402
from services.rundir.ledger import LEDGER_FILE  # noqa: E402
from services.rundir.schedules import RESULT_KIND  # noqa: E402

ALBERT = [sys.executable, "-m", "services.cli"]


def recipe(work: Path, name: str, steps: int, checkpoint_every: int) -> list[str]:
    sets = {
        "run.name": name,
        "run.output_dir": str(work / "runs"),
        "optim.total_steps": steps,
        "optim.warmup_steps": min(400, steps // 10),
        "optim.decay_steps": steps // 5,
        "train.checkpoint_every": checkpoint_every,
        "train.keep_last": 2,
        "eval.every_steps": 0,  # the run's own evaluations off: only the schedule evaluates
    }
    return ["--config", "tiny", "--no-progress", *[arg for k, v in sets.items() for arg in ("--set", f"{k}={v}")]]


def start(argv: list[str], log: Path) -> subprocess.Popen:
    """A command in its own session (so that it and every process it starts can be killed together)."""
    handle = open(log, "a")  # the child keeps it open; closed when it exits
    return subprocess.Popen([*ALBERT, *argv], cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the command's session (the CLI, its embedded Ray, its workers)."""
    for pid in session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def session_pids(sid: int, containing: str = "") -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) == sid and containing in (entry / "cmdline").read_text(errors="replace"):
                pids.append(int(entry.name))
        except (ProcessLookupError, PermissionError, FileNotFoundError):
            continue
    return pids


def newest_checkpoint(run_dir: Path) -> int:
    steps = [int(p.name.split("_")[1]) for p in (run_dir / CHECKPOINTS_DIR).glob("step_*")]
    return max(steps, default=0)


def wait_until(condition, timeout: float, what: str, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(poll)
    return value


def steps_per_second(run_dir: Path, skip: int = 100) -> float:
    lines = run_log.last_per_step([r for r in run_log.read_metrics(run_dir) if r.get("kind") == "train"])
    lines = [r for r in lines if r["step"] >= skip]
    return (lines[-1]["step"] - lines[0]["step"]) / (lines[-1]["time"] - lines[0]["time"])


# --- exactly once ------------------------------------------------------------------------------------------------


def exactly_once(work: Path, steps: int, every: int, checkpoint_every: int) -> dict[str, Any]:
    name = "killed"
    run_dir = work / "runs" / name
    log = work / f"{name}.log"
    argv = ["pretrain", *recipe(work, name, steps, checkpoint_every)]
    training = start(argv, log)
    wait_until(lambda: newest_checkpoint(run_dir) >= 3 * checkpoint_every, 900, "the third checkpoint")
    attached_at = newest_checkpoint(run_dir)
    scheduler = start(["eval", "schedule", str(run_dir), "--every", str(every), "--poll-s", "1"], log)
    kills = []
    for fraction in (0.4, 0.7):  # the training killed twice, each time resumed from its newest checkpoint
        wait_until(lambda f=fraction: newest_checkpoint(run_dir) >= f * steps, 1800, f"{fraction:.0%} of the run")
        kill_session(training)
        kills.append({"training_killed_at_checkpoint": newest_checkpoint(run_dir)})
        if fraction == 0.4:
            kill_scheduler(run_dir, f"every-{every}", scheduler, kills)
        training = start([*argv, "--resume", str(run_dir)], log)
    training.wait(timeout=1800)
    scheduler.wait(timeout=900)
    return count(run_dir, every, attached_at, kills, training.returncode, scheduler.returncode)


def kill_scheduler(run_dir: Path, name: str, scheduler: subprocess.Popen, kills: list[dict[str, Any]]) -> None:
    """SIGKILL the schedule's actor process once it has evaluated something; Ray restarts it."""
    wait_until(lambda: schedules.load(run_dir, name).done, 900, "a first scheduled evaluation")
    (pid,) = wait_until(lambda: session_pids(scheduler.pid, "ScheduleRunner"), 60, "the scheduler actor's process")
    done = sorted(schedules.load(run_dir, name).done)
    os.kill(pid, signal.SIGKILL)
    kills.append({"scheduler_killed_after": done})


def count(run_dir: Path, every: int, attached_at: int, kills, train_rc: int, schedule_rc: int) -> dict[str, Any]:
    records = run_log.read_metrics(run_dir)
    results = [r["step"] for r in records if r.get("kind") == RESULT_KIND]
    saved = sorted({r["step"] for r in records if r.get("event") == "checkpoint_saved"})
    matching = [s for s in saved if s % every == 0]
    state = schedules.load(run_dir, f"every-{every}")
    per_step = {s: results.count(s) for s in matching}
    return {
        "attached_at_checkpoint": attached_at,
        "kills": kills,
        "checkpoints_saved": len(saved),
        "matching_checkpoints": matching,
        "result_lines_per_matching_step": per_step,
        "exactly_once": all(n == 1 for n in per_step.values()) and sorted(results) == matching,
        "missing": state.missing,
        "failed": state.failed,
        "scheduler_starts": state.starts,
        "complete": state.complete,
        "return_codes": {"last_training": train_rc, "scheduler": schedule_rc},
    }


# --- cost ---------------------------------------------------------------------------------------------------------


def cost(work: Path, steps: int, every: int, checkpoint_every: int, pairs: int) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"without": [], "with": []}
    for i in range(pairs):
        for mode in ("without", "with"):
            name = f"cost-{mode}-{i}"
            run_dir = work / "runs" / name
            log = work / f"{name}.log"
            training = start(["pretrain", *recipe(work, name, steps, checkpoint_every)], log)
            scheduler = None
            if mode == "with":
                wait_until(lambda d=run_dir: (d / LEDGER_FILE).is_file(), 600, f"the run's {LEDGER_FILE}")
                scheduler = start(["eval", "schedule", str(run_dir), "--every", str(every), "--poll-s", "1"], log)
            training.wait(timeout=1800)
            if scheduler is not None:
                scheduler.wait(timeout=900)
            rates[mode].append(steps_per_second(run_dir))
            print(f"{name}: {rates[mode][-1]:.2f} steps/s", flush=True)
    ratio = statistics.mean(rates["with"]) / statistics.mean(rates["without"])
    return {"steps_per_s": rates, "ratio_with_over_without": ratio}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--skip-kills", action="store_true")
    args = parser.parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="eval-schedule-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"work": str(work), "steps": args.steps, "every": args.every}
    if not args.skip_kills:
        summary["exactly_once"] = exactly_once(work, args.steps, args.every, args.checkpoint_every)
        print(json.dumps(summary["exactly_once"], indent=1), flush=True)
    if not args.skip_cost:
        summary["cost"] = cost(work, args.steps, args.every, args.checkpoint_every, args.pairs)
    print(json.dumps(summary, indent=1))
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0 if summary.get("exactly_once", {}).get("exactly_once", True) else 1


if __name__ == "__main__":
    sys.exit(main())
