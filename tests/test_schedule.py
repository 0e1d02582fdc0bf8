"""Evaluation schedules on a real run: `albert eval schedule|list|cancel`, retention, and the scheduler on Ray.

The argument checks and retention need no Ray. The Ray test is one short real pretraining run (2 workers on the
session's local Ray, 12 steps, a checkpoint every 2, keep_last 2): a schedule of every 4 steps is attached once the
run has its first checkpoint, its scheduler actor is SIGKILLed after its first evaluation (Ray restarts it), and
every matching checkpoint must end up evaluated exactly once.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from services import cluster
from services.cli import main
from services.eval.schedule import Scheduler, run_config_of, start_runner
from services.rundir import log as run_log
from services.rundir import schedules
from services.rundir.config import RunConfig
from services.rundir.ledger import RunLedger
from services.rundir.schedules import RESULT_KIND, ScheduleSpec
from services.terminal import EXIT_DATA, EXIT_USAGE
from tests.runs import run_training
from tests.test_coordinator import flip_a_bit, write_checkpoint
from tests.test_train import run_config, write_heldout, write_shards


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)
    return value


@pytest.fixture
def ledger_run(tmp_path) -> RunLedger:
    """A run directory with its ledger (ledger.json) and held-out documents; no training."""
    shards = write_heldout(tmp_path / "shards")
    config = RunConfig.from_dict(
        {"run": {"name": "r", "output_dir": str(tmp_path)}, "data": {"shards": str(shards)}, "train": {"keep_last": 1}}
    )
    return RunLedger(tmp_path / "r", "r", config.to_dict())


# --- the CLI refuses bad input before Ray starts ---------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message, status",
    [
        (["eval", "schedule", "{missing}", "--every", "4"], "RUN {missing}: no such run directory", EXIT_DATA),
        (["eval", "schedule", "{run}", "--every", "0"], "--every 0: must be at least 1", EXIT_USAGE),
        (
            ["eval", "schedule", "{run}", "--every", "4", "--task", "polarity"],
            "--task-data: give one data directory",
            EXIT_USAGE,
        ),
        (
            ["eval", "schedule", "{run}", "--every", "4", "--heldout", "{missing}"],
            "--heldout {missing}: no such file",
            EXIT_DATA,
        ),
        (["eval", "schedule", "{run}", "--every", "4", "--name", "a/b"], "--name 'a/b'", EXIT_DATA),
        (["eval", "schedule", "{run}", "--every", "4", "--name", "recipe"], "the run's own evaluations", EXIT_USAGE),
        (["eval", "cancel", "{run}", "nothing"], "no schedule 'nothing' on this run", EXIT_DATA),
    ],
)
def test_bad_arguments_are_one_line_naming_the_argument_and_exit_2_or_65(
    ledger_run, tmp_path, capsys, monkeypatch, argv, message, status
):
    def connect(*_args, **_kwargs):
        raise AssertionError("albert eval connected to Ray before checking its arguments")

    # Another test of the session may have started Ray in this process already: what must hold is that the refusal
    # comes before the command connects (services.cluster.connect is the one way it does).
    monkeypatch.setattr(cluster, "connect", connect)
    ray_before = ray.is_initialized()
    paths = {"run": str(ledger_run.run_dir), "missing": str(tmp_path / "nowhere")}
    code = main([arg.format(**paths) for arg in argv])
    err = capsys.readouterr().err
    assert code == status
    assert message.format(**paths) in err and len(err.strip().splitlines()) == 1
    assert ray.is_initialized() == ray_before


def test_eval_list_and_cancel_work_from_the_run_directory(ledger_run, capsys):
    assert main(["eval", "list", str(ledger_run.run_dir)]) == 0
    assert "no evaluation schedules" in capsys.readouterr().out
    schedules.create_or_attach(ledger_run.run_dir, ScheduleSpec("every-4", 4, "/h"))
    assert main(["eval", "cancel", str(ledger_run.run_dir), "every-4"]) == 0
    assert main(["eval", "list", str(ledger_run.run_dir)]) == 0
    assert "every-4: every 4, 0 done" in capsys.readouterr().out
    assert schedules.load(ledger_run.run_dir, "every-4").cancelled


# --- retention ---------------------------------------------------------------------------------------------------


def test_retention_keeps_the_checkpoints_a_live_schedule_has_not_evaluated_yet(ledger_run):
    schedules.create_or_attach(ledger_run.run_dir, ScheduleSpec("every-2", 2, "/h"))
    root = ledger_run.run_dir / "checkpoints"
    for step in (2, 3, 4, 5):
        ledger_run.checkpoint_saved(step, write_checkpoint(root / f"step_{step:08d}", step))
    assert [c.step for c in ledger_run.state.checkpoints] == [2, 4, 5]  # keep_last 1, and 2 and 4 held

    schedules.update(ledger_run.run_dir, "every-2", lambda s: s.mark_done(2, "x"))
    ledger_run.checkpoint_saved(7, write_checkpoint(root / "step_00000007", 7))
    assert [c.step for c in ledger_run.state.checkpoints] == [4, 7]  # 2 was evaluated: freed


# --- the run's config of record -----------------------------------------------------------------------------------


def checkpoint_of_step(root: Path, step: int) -> str:
    """A checkpoint whose trainer.json holds the training state's step (what run_finished reads)."""
    return write_checkpoint(root / f"step_{step:08d}", step)


def config_of_total(tmp_path: Path, total_steps: int) -> dict:
    return RunConfig.from_dict(
        {
            "run": {"name": "r", "output_dir": str(tmp_path)},
            "data": {"shards": str(tmp_path / "shards")},
            "optim": {"total_steps": total_steps, "warmup_steps": 10},
            "train": {"keep_last": 1},
        }
    ).to_dict()


def complete_schedule(run_dir: Path, name: str, every: int) -> None:
    """A schedule whose scheduler evaluated every matching checkpoint of a finished run, and so completed."""
    schedules.create_or_attach(run_dir, ScheduleSpec(name, every, "/h"))
    scheduler = Scheduler(run_dir, name)
    scheduler.reconcile()
    for step in scheduler.observe()[0].pending:
        schedules.update(run_dir, name, lambda s, step=step: s.mark_done(step, "x"))
    assert scheduler.observe()[0].complete


def test_a_run_resumed_with_a_larger_total_steps_is_unfinished_for_its_schedules(tmp_path):
    write_heldout(tmp_path / "shards")
    config = functools.partial(config_of_total, tmp_path)
    run_dir, root = tmp_path / "r", tmp_path / "r" / "checkpoints"
    first = RunLedger(run_dir, "r", config(1000))
    first.checkpoint_saved(1000, checkpoint_of_step(root, 1000))  # the run finished
    complete_schedule(run_dir, "every-1000", 1000)
    ledger = RunLedger(run_dir, "r", config(5000))  # resumed with --set optim.total_steps=5000
    assert run_config_of(run_dir).optim.total_steps == 5000
    (change,) = ledger.state.config_history
    assert change.step == 1000 and change.changed == {"optim.total_steps": [1000, 5000]}
    assert not ledger.state.finished
    assert not schedules.load(run_dir, "every-1000").complete  # it holds the resumed run's checkpoints again

    schedules.create_or_attach(run_dir, ScheduleSpec("every-500", 500, "/h"))
    scheduler = Scheduler(run_dir, "every-500")
    scheduler.reconcile()
    state, due = scheduler.observe()
    assert due == 1000 and not state.complete
    schedules.update(run_dir, "every-500", lambda s: s.mark_done(1000, "x"))
    state, due = scheduler.observe()
    assert due is None and not state.complete  # the run trains on to 5000: its checkpoints are still to come
    for step in (1500, 2000, 2100):
        ledger.checkpoint_saved(step, checkpoint_of_step(root, step))
    assert [c.step for c in ledger.state.checkpoints] == [1500, 2000, 2100]  # held for the schedules


def test_a_live_scheduler_reads_the_config_a_resume_brought(tmp_path):
    write_heldout(tmp_path / "shards")
    run_dir, root = tmp_path / "r", tmp_path / "r" / "checkpoints"
    first = RunLedger(run_dir, "r", config_of_total(tmp_path, 1000))
    first.checkpoint_saved(500, checkpoint_of_step(root, 500))  # stopped (Ctrl-C) at step 500 of 1000
    schedules.create_or_attach(run_dir, ScheduleSpec("every-500", 500, "/h"))
    scheduler = Scheduler(run_dir, "every-500")
    scheduler.reconcile()
    assert scheduler.observe()[1] == 500
    schedules.update(run_dir, "every-500", lambda s: s.mark_done(500, "x"))
    resumed = RunLedger(run_dir, "r", config_of_total(tmp_path, 5000))  # total_steps raised
    resumed.checkpoint_saved(1000, checkpoint_of_step(root, 1000))
    state, due = scheduler.observe()
    assert due == 1000 and not state.complete
    schedules.update(run_dir, "every-500", lambda s: s.mark_done(1000, "x"))
    assert not scheduler.observe()[0].complete  # step 1000 is not the run's end any more


# --- a checkpoint saved again at the same step ----------------------------------------------------------------------


def attached(run_dir: Path, name: str, every: int) -> Scheduler:
    schedules.create_or_attach(run_dir, ScheduleSpec(name, every, "/h"))
    scheduler = Scheduler(run_dir, name)
    scheduler.reconcile()
    return scheduler


def test_a_checkpoint_saved_again_is_evaluated_though_the_scheduler_looked_while_it_was_being_replaced(ledger_run):
    root = ledger_run.run_dir / "checkpoints"
    path = Path(checkpoint_of_step(root, 4))
    ledger_run.checkpoint_saved(4, str(path))
    scheduler = attached(ledger_run.run_dir, "every-2", 2)
    assert scheduler.observe()[1] == 4
    # A resume saves step 4 again (services.train.state._replace_dir): the old directory is moved aside, then the
    # new one renamed in. The scheduler looks in between.
    aside = path.with_name(f".{path.name}.old-1")
    os.replace(path, aside)
    state, due = scheduler.observe()
    assert due is None and 4 in state.missing
    checkpoint_of_step(root, 4)
    shutil.rmtree(aside)
    state, due = scheduler.observe()
    assert due == 4 and 4 not in state.missing


def test_a_step_that_failed_on_a_corrupt_checkpoint_is_retried_once_the_checkpoint_is_saved_again(ledger_run):
    root = ledger_run.run_dir / "checkpoints"
    path = Path(checkpoint_of_step(root, 2))
    ledger_run.checkpoint_saved(2, str(path))
    flip_a_bit(path / "model.safetensors")
    scheduler = attached(ledger_run.run_dir, "every-2", 2)
    scheduler.launch(scheduler.observe()[1])  # fails verification: recorded failed, no evaluator started
    state, due = scheduler.observe()
    assert due is None and 2 in state.failed  # the same damaged checkpoint is not evaluated again
    shutil.rmtree(path)
    checkpoint_of_step(root, 2)  # the resumed run saves step 2 again, intact
    state, due = scheduler.observe()
    assert due == 2 and 2 not in state.failed


# --- a real run, its scheduler killed once ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scheduled_run(ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("scheduled")
    shards = write_heldout(write_shards(root / "shards"))
    config = run_config(root, shards, "scheduled", checkpoint_every=2, keep_last=2)
    config.optim.total_steps = 12
    training = threading.Thread(target=run_training, args=(config,), kwargs={"resume": False})
    training.start()
    run_dir = config.run_dir.resolve()
    wait_for(lambda: list((run_dir / "checkpoints").glob("step_*")), 180, "the run's first checkpoint")
    spec = ScheduleSpec("every-4", 4, str((shards / "heldout" / "documents.parquet").resolve()), cpus=1.0)
    schedules.create_or_attach(run_dir, spec)  # attached mid-run
    runner = start_runner(run_dir, "every-4", detached=False, poll_s=0.2)
    wait_for(lambda: schedules.load(run_dir, "every-4").done, 180, "the schedule's first evaluation")
    os.kill(ray.get(runner.pid.remote()), signal.SIGKILL)
    killed_after = dict(schedules.load(run_dir, "every-4").done)
    training.join(timeout=300)
    state = wait_for(lambda: (s := schedules.load(run_dir, "every-4")).complete and s, 180, "the schedule to complete")
    return run_dir, state, killed_after


@pytest.mark.ray
def test_every_matching_checkpoint_is_evaluated_exactly_once_across_a_scheduler_kill(scheduled_run):
    run_dir, state, killed_after = scheduled_run
    lines = [r for r in run_log.read_metrics(run_dir) if r.get("kind") == RESULT_KIND]
    assert sorted(r["step"] for r in lines) == [4, 8, 12]
    assert all(r["schedule"] == "every-4" and 0 <= r["mlm_acc"] <= 1 for r in lines)
    assert sorted(state.done) == [4, 8, 12] and not state.missing and not state.failed
    assert state.starts == 2  # the first scheduler and the one Ray restarted after the kill
    assert killed_after and set(killed_after) < {4, 8, 12}


@pytest.mark.ray
def test_a_complete_schedule_holds_no_checkpoint_and_shows_in_the_run_status(scheduled_run):
    run_dir, _, _ = scheduled_run
    code = main(["status", str(run_dir)])
    assert code == 0
    (summary,) = schedules.summaries(run_dir)
    assert summary["done"] == 3 and summary["last_step"] == 12 and summary["complete"]
    assert schedules.held_and_lapsed(run_dir, [4, 8, 12], math.inf) == (set(), [])


@pytest.mark.ray
def test_the_report_plots_the_schedules_results(scheduled_run):
    from services.rundir.report import write_report

    run_dir, _, _ = scheduled_run
    report = write_report(run_dir).read_text()
    assert "## Evaluation schedules" in report and "every-4" in report
    assert (Path(run_dir) / "schedules.png").is_file()


def test_submit_eval_makes_the_run_heldout_and_task_paths_absolute_under_the_uploaded_directory(tmp_path):
    from services.jobs.checks import prepare_job_args

    argv = ["schedule", "runs/x", "--every", "4", "--heldout=shards/h.parquet", "--task", "polarity"]
    args, notes = prepare_job_args("eval", [*argv, "--task-data", "data/p"], tmp_path)
    assert args == [
        "schedule", str(tmp_path / "runs/x"), "--every", "4", f"--heldout={tmp_path / 'shards/h.parquet'}",
        "--task", "polarity", "--task-data", str(tmp_path / "data/p"),
    ]  # fmt: skip
    assert len(notes) == 3
    assert prepare_job_args("eval", ["list", "/abs/run"], tmp_path) == (["list", "/abs/run"], [])


def test_submit_eval_passes_the_runs_relative_heldout_set_made_absolute(tmp_path):
    """A run trained here with a relative data.shards: the job, in the uploaded copy, could not find it."""
    from services.jobs.checks import prepare_job_args

    config = RunConfig.from_dict({"run": {"name": "r", "output_dir": str(tmp_path)}, "data": {"shards": "shards"}})
    RunLedger(tmp_path / "r", "r", config.to_dict())
    args, _ = prepare_job_args("eval", ["schedule", str(tmp_path / "r"), "--every", "4"], tmp_path)
    assert args[-1] == f"--heldout={tmp_path / 'shards' / 'heldout' / 'documents.parquet'}"


# --- a schedule holds checkpoints on a lease ------------------------------------------------------------------------


def test_a_schedule_whose_scheduler_is_gone_past_its_lease_releases_its_checkpoints_and_reports_them_when_back(
    tmp_path,
):
    """eval.schedule_lease_s = 60, keep_last 1, a schedule of every 100 steps. While its scheduler renews its lease
    the schedule holds its unevaluated checkpoints; once the lease is 2 minutes old retention deletes them again (one
    schedule_lease_expired event); the scheduler that comes back resumes at the oldest checkpoint left and names the
    steps it missed."""
    write_heldout(tmp_path / "shards")
    config = config_of_total(tmp_path, 5000)
    config["eval"]["schedule_lease_s"] = 60.0
    run_dir, root = tmp_path / "r", tmp_path / "r" / "checkpoints"
    ledger = RunLedger(run_dir, "r", config)
    ledger.checkpoint_saved(100, checkpoint_of_step(root, 100))
    attached(run_dir, "every-100", 100).observe()  # the scheduler runs: its heartbeat renews the lease
    schedules.touch_heartbeat(run_dir, "every-100")
    ledger.checkpoint_saved(200, checkpoint_of_step(root, 200))
    assert [c.step for c in ledger.state.checkpoints] == [100, 200]  # held, though keep_last is 1

    # The scheduler stops (its cluster went); two minutes pass.
    stale = time.time() - 120
    os.utime(run_dir / "schedules" / f"every-100{schedules.HEARTBEAT_SUFFIX}", (stale, stale))
    schedules.update(run_dir, "every-100", lambda s: setattr(s, "created", stale))
    ledger.checkpoint_saved(300, checkpoint_of_step(root, 300))
    ledger.checkpoint_saved(400, checkpoint_of_step(root, 400))
    assert [c.step for c in ledger.state.checkpoints] == [400]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000400"]
    (expired,) = [r for r in run_log.read_metrics(run_dir) if r.get("event") == "schedule_lease_expired"]
    assert expired["schedule"] == "every-100" and expired["released"] == [100, 200, 300]
    assert expired["idle_s"] >= 120 and expired["lease_s"] == 60.0

    back = Scheduler(run_dir, "every-100")  # `albert eval schedule` again
    back.reconcile()
    schedules.touch_heartbeat(run_dir, "every-100")
    state, due = back.observe()
    back.report_missed(state)
    assert due == 400 and not state.lease_lapsed
    (resumed,) = [r for r in run_log.read_metrics(run_dir) if r.get("event") == "schedule_resumed"]
    assert resumed["missed"] == [100, 200, 300] and resumed["resumes_at"] == 400
    assert sorted(state.missing) == [100, 200, 300]
    ledger.checkpoint_saved(500, checkpoint_of_step(root, 500))
    assert [c.step for c in ledger.state.checkpoints] == [400, 500]  # held again under the renewed lease
