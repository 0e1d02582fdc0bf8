"""`albert eval run` (a checkpoint's held-out metrics, services.eval.evaluate) and `albert eval schedule | list |
cancel` (evaluation schedules on a run: services.eval.schedule, services.rundir.schedules). `albert evaluate
CHECKPOINT`, the old spelling of `eval run`, still works with a deprecation line.

Every argument is checked before Ray starts (a bad one is one line naming it: exit 2 for options that conflict, 65
for a bad value or path; services.terminal). `schedule` creates the
schedule's file (or attaches to the one of the same name and job) and starts its scheduler: on a cluster (--address,
or RAY_ADDRESS inside a Ray job) a detached actor that outlives the command; on the embedded local Ray the command
follows it until the schedule is complete (Ctrl-C stops it; the same command carries on later). `list` and
`cancel` need only the run directory; they show and cancel the run's own schedule, "recipe" (its recipe's [eval],
run by its coordinator), too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from albert_core.examples.shape import ExampleShape
from albert_core.examples.shards import HELDOUT_FILE
from albert_core.files import DiskFull
from services.rundir import schedules
from services.rundir.schedules import RESULT_KIND, ScheduleSpec
from services.terminal import EXIT_FAILED, UsageError


def schedule_spec(args: argparse.Namespace) -> tuple[Path, ScheduleSpec]:
    """The run directory and the schedule asked for; raises ValueError / FileNotFoundError naming the argument."""
    from services.eval.evaluate import check_tasks
    from services.eval.schedule import run_config_of

    run_dir = run_directory(args.run)
    config = run_config_of(run_dir)
    if args.every < 1:
        raise UsageError(f"--every {args.every}: must be at least 1 (evaluate checkpoints whose step is a multiple)")
    if len(args.task_data) != len(args.task):
        raise UsageError(
            f"--task-data: give one data directory per --task, in the same order ({len(args.task)} tasks, "
            f"{len(args.task_data)} directories)"
        )
    task_data = [str(Path(d).resolve()) for d in args.task_data]
    for task, directory in zip(args.task, task_data, strict=True):
        if not Path(directory).is_dir():
            raise FileNotFoundError(f"--task-data {directory}: no such directory (the data of --task {task})")
    try:
        check_tasks(args.task, dict(zip(args.task, task_data, strict=True)))
    except ValueError as err:
        raise ValueError(f"--task: {err}") from None
    heldout = Path(args.heldout) if args.heldout else Path(config.data.shards) / HELDOUT_FILE
    if not heldout.is_file():
        where = "" if args.heldout else f" (the run's data.shards/{HELDOUT_FILE}; pass --heldout PATH)"
        raise FileNotFoundError(f"--heldout {heldout}: no such file{where}")
    if args.cpus < 0 or args.poll_s <= 0:
        raise UsageError("--cpus must be >= 0 and --poll-s > 0")
    name = args.name or default_name(args.every, args.task, args.heldout)
    if name == schedules.RECIPE:
        raise UsageError(
            f"--name {name}: the run's own evaluations ([eval] of its recipe) have that name; choose another"
        )
    spec = ScheduleSpec(
        name=schedules.check_name(name),
        every=args.every,
        heldout=str(heldout.resolve()),
        tasks=tuple(args.task),
        task_data=tuple(task_data),
        task_seeds=args.task_seeds,
        task_max_steps=args.task_max_steps,
        cpus=args.cpus,
    )
    return run_dir, spec


def run_directory(run: str) -> Path:
    path = Path(run)
    if not path.is_dir():
        raise FileNotFoundError(f"RUN {run}: no such run directory")
    return path.resolve()


def default_name(every: int, tasks: list[str], heldout: str | None) -> str:
    parts = [f"every-{every}", *tasks]
    if heldout:
        parts.append("heldout-" + hashlib.sha1(str(Path(heldout).resolve()).encode()).hexdigest()[:6])
    return "-".join(parts)


def cmd_eval_schedule(args: argparse.Namespace) -> int:
    from services.cluster import connect
    from services.eval.schedule import Scheduler, runner_name, start_runner
    from services.finetune.seeds import recipe_defaults

    run_dir, spec = schedule_spec(args)  # every check before Ray starts
    state, created = schedules.create_or_attach(run_dir, spec)
    print(f"schedule {spec.name} {'created' if created else 'attached'} on {run_dir}: {spec.describe()}")
    defaults = recipe_defaults(run_dir=run_dir) if spec.tasks else None
    if defaults is not None:
        given = {"max_steps": "--task-max-steps"} if spec.task_max_steps and "max_steps" in defaults.overrides else {}
        print(defaults.describe(given))
    on_cluster = bool(args.address or os.environ.get("RAY_ADDRESS"))
    connect(args.address, worker_logs=False)
    if args.once:
        state = Scheduler(run_dir, spec.name, poll_s=args.poll_s).run(threading.Event(), once=True)
        print(progress_line(state.summary()))
        return 0
    runner = start_runner(run_dir, spec.name, detached=on_cluster, poll_s=args.poll_s)
    if on_cluster and not args.follow:
        print(
            f"its scheduler runs on the cluster (actor {runner_name(run_dir, spec.name)}); "
            f"progress: albert eval list {args.run}; stop it: albert eval cancel {args.run} {spec.name}"
        )
        return 0
    return follow(run_dir, spec.name, runner, poll_s=args.poll_s)


def follow(run_dir: Path, name: str, runner: Any, *, poll_s: float) -> int:
    """Print the schedule's results as they are appended, until it is complete or cancelled or its runner fails."""
    from services.rundir import log as run_log

    stop, error = threading.Event(), []  # error: [the runner's error, whether it is a full disk's line]
    threading.Thread(target=_watch, args=(run_dir, name, runner, stop, error, poll_s), daemon=True).start()
    for record in run_log.follow(run_dir, stop, poll_s=poll_s):
        if record.get("kind") == RESULT_KIND and record.get("schedule") == name:
            accuracies = "  ".join(f"{k} {record[k]:.4f}" for k in ("mlm_acc", "sop_acc") if k in record)
            print(f"{name} @ step {record['step']}: {accuracies}", flush=True)
    summary = schedules.load(run_dir, name).summary()
    print(progress_line(summary))
    if error and error[1]:
        raise DiskFull(error[0])  # its one line, exit status EXIT_DISK_FULL
    if error:
        print(f"albert: error: the scheduler of {name} failed: {error[0]}")
        return EXIT_FAILED
    return 0


def _watch(run_dir: Path, name: str, runner: Any, stop: threading.Event, error: list[str], poll_s: float) -> None:
    import ray
    from ray.exceptions import RayError

    while not stop.is_set():
        time.sleep(poll_s)
        try:
            progress = ray.get(runner.progress.remote(), timeout=60)
        except RayError:  # the runner ended itself: the schedule is complete or cancelled
            progress = {"error": None, "complete": True}
        if progress["error"]:
            error += [progress["error"], progress.get("disk_full", False)]
        if progress["error"] or not schedules.load(run_dir, name).active():
            stop.set()


def progress_line(s: dict[str, Any]) -> str:
    state = "cancelled" if s["cancelled"] else "complete" if s["complete"] else "live" if s.get("live") else "idle"
    when = " and ".join([f"every {s['every']}"] * bool(s["every"]) + ["at the end"] * bool(s.get("final")))
    line = (
        f"{s['name']}: {when}, {s['done']} done, {s['pending']} pending, {s['missing']} missing, "
        f"{s['failed']} failed, last evaluated step {s['last_step']} ({state})"
    )
    for step, why in {**s["missing_steps"], **s["failed_steps"]}.items():
        line += f"\n  step {step}: {why}"
    return line


def cmd_eval_list(args: argparse.Namespace) -> int:
    summaries = schedules.summaries(run_directory(args.run))
    if not summaries:
        print(f"no evaluation schedules on {args.run}")
    for summary in summaries:
        print(progress_line(summary))
    return 0


def cmd_eval_cancel(args: argparse.Namespace) -> int:
    run_dir = run_directory(args.run)

    def cancel(state: schedules.ScheduleState) -> None:
        state.cancelled = True

    state = schedules.update(run_dir, schedules.check_name(args.name), cancel)
    stopped = False
    if args.address:
        from services.cluster import connect
        from services.eval.schedule import stop_runner

        connect(args.address)
        stopped = stop_runner(run_dir, args.name)
    how = "its scheduler was stopped" if stopped else "its scheduler stops at its next poll"
    print(f"cancelled {args.name} ({state.summary()['done']} evaluated); {how}; the checkpoints it held are freed at "
          "the run's next retention")  # fmt: skip
    return 0


def cmd_eval_run(args: argparse.Namespace) -> int:
    from services.eval.evaluate import IntrinsicOptions, evaluate_checkpoint

    task_data = dict(pair.split("=", 1) for pair in args.task_data)
    options = IntrinsicOptions(max_seq_length=args.max_seq_length, max_examples=args.max_examples)
    result = evaluate_checkpoint(args.checkpoint, args.heldout, options=options, tasks=args.task, task_data=task_data)
    print(json.dumps(result, indent=2, default=str))
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """`albert evaluate CHECKPOINT ...`: `albert eval run --checkpoint CHECKPOINT ...` under its old name."""
    print(
        f"albert: `albert evaluate CHECKPOINT` is deprecated; use `albert eval run --checkpoint {args.checkpoint}`",
        file=sys.stderr,
    )
    return cmd_eval_run(args)


def _evaluation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heldout", required=True, help="<shards>/heldout/documents.parquet")
    parser.add_argument("--max-seq-length", type=int, default=ExampleShape.max_seq_length)
    parser.add_argument("--max-examples", type=int, default=640)
    parser.add_argument("--task", action="append", default=[], help="a downstream task, e.g. sst2")
    parser.add_argument("--task-data", action="append", default=[], metavar="TASK=DIR")


def register(commands: argparse._SubParsersAction) -> None:
    """`albert eval run|schedule|list|cancel`; `albert evaluate` (deprecated, not listed)."""
    evals = commands.add_parser(
        "eval",
        help="score a checkpoint, or a run's checkpoints as it trains",
        description="Held-out MLM / SOP / NSP accuracy (and downstream tasks) of one checkpoint (run), or of a run's "
        "checkpoints as they are saved (schedule, list, cancel).",
    )
    actions = evals.add_subparsers(dest="action", required=True)
    run = actions.add_parser("run", help="held-out MLM/SOP/NSP accuracy (+ downstream tasks) of one checkpoint")
    run.add_argument("--checkpoint", required=True, help="a model directory (ours or transformers')")
    _evaluation_options(run)
    run.set_defaults(func=cmd_eval_run)
    _register_schedules(actions)

    evaluate = commands.add_parser(
        "evaluate", description="Deprecated: albert eval run --checkpoint CHECKPOINT (same options)."
    )  # no help=: not listed by `albert --help`
    evaluate.add_argument("checkpoint", help="a model directory (ours or transformers')")
    _evaluation_options(evaluate)
    evaluate.set_defaults(func=cmd_evaluate)


def _register_schedules(actions: argparse._SubParsersAction) -> None:
    """`albert eval schedule|list|cancel`."""
    s = actions.add_parser("schedule", help="evaluate a run's checkpoint at each multiple of --every steps, once")
    s.add_argument("run", help="the run directory (runs/NAME)")
    s.add_argument("--every", type=int, required=True, help="the first checkpoint at or past each multiple of it")
    s.add_argument("--name", help="the schedule's name (default: every-N[-TASK...][-heldout-HASH])")
    s.add_argument("--task", action="append", default=[], help="a downstream task, e.g. polarity (repeatable)")
    s.add_argument("--task-data", action="append", default=[], metavar="DIR", help="its data, one per --task")
    s.add_argument("--task-seeds", type=int, default=0, help="fine-tuning seeds per task (0: the task's protocol)")
    s.add_argument("--task-max-steps", type=int, default=0, help="fine-tuning steps per task (0: the protocol)")
    s.add_argument("--heldout", help="held-out documents (default: the run's <data.shards>/heldout/documents.parquet)")
    s.add_argument("--cpus", type=float, default=1.0, help="per evaluator, only beyond training's CPUs (else 0)")
    s.add_argument("--poll-s", type=float, default=2.0, help="seconds between looks at the run directory")
    s.add_argument("--address", help="Ray cluster address (auto, ray://host:10001); default: embedded local Ray")
    mode = s.add_mutually_exclusive_group()
    mode.add_argument("--follow", action="store_true", help="on a cluster: print results until it is complete")
    mode.add_argument("--once", action="store_true", help="evaluate what is due now, here, and exit")
    s.set_defaults(func=cmd_eval_schedule)
    listing = actions.add_parser(
        "list", help="a run's schedules (its own, recipe, too): done, pending, missing, failed"
    )
    listing.add_argument("run")
    listing.set_defaults(func=cmd_eval_list)
    cancel = actions.add_parser("cancel", help="cancel a schedule (its scheduler stops, its checkpoints are freed)")
    cancel.add_argument("run")
    cancel.add_argument("name")
    cancel.add_argument("--address", help="Ray cluster address: also stop its scheduler actor at once")
    cancel.set_defaults(func=cmd_eval_cancel)
