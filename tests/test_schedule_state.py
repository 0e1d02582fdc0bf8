"""An evaluation schedule's durable state (services.rundir.schedules): no Ray, real files."""

from __future__ import annotations

import math
import multiprocessing

import pytest

from services.rundir import log as run_log
from services.rundir import schedules
from services.rundir.schedules import RECIPE, RESULT_KIND, ScheduleSpec, ScheduleState


def spec(name: str = "every-10", every: int = 10, **fields) -> ScheduleSpec:
    return ScheduleSpec(name=name, every=every, heldout="/shards/heldout/documents.parquet", **fields)


def held(run_dir, steps) -> set[int]:
    """The steps the run's schedules hold from retention (their schedulers' leases taken as renewed)."""
    return schedules.held_and_lapsed(run_dir, steps, math.inf)[0]


def result_line(name: str, step: int) -> dict:
    return {"step": step, "time": 0.0, "kind": RESULT_KIND, "schedule": name, "checkpoint": f"step_{step}"}


def test_a_schedule_matches_the_positive_multiples_of_every():
    state = ScheduleState(spec(every=10))
    assert state.unsettled([0, 5, 10, 15, 20, 30, 25]) == [10, 20, 30]


def test_off_the_multiples_the_first_checkpoint_at_or_past_each_multiple_is_due():
    """Checkpoints every 300 steps, a schedule of every 500: each multiple gets the checkpoint that reaches it."""
    state = ScheduleState(spec(every=500))
    state.observe(on_disk=[300, 600, 900, 1200, 1500], saved={})
    assert state.pending == [600, 1200, 1500]


def test_a_final_schedule_also_evaluates_the_runs_last_checkpoint_and_another_does_not():
    final, plain = ScheduleState(spec(every=100, final=True)), ScheduleState(spec(every=100))
    for state in (final, plain):
        state.observe(on_disk=[100, 150, 170], saved={}, finals=[170])
    assert final.pending == [100, 170] and plain.pending == [100]


def test_the_runs_own_schedule_owns_the_eval_lines_and_another_schedule_only_its_own_lines():
    recipe, other = spec(RECIPE, final=True), spec("every-10")
    line = {"step": 10, "kind": "eval", "mlm_acc": 0.5}
    assert recipe.owns(line) and not other.owns(line)
    assert other.owns(result_line("every-10", 10)) and not other.owns(result_line("every-20", 10))
    assert not recipe.owns(result_line("every-10", 10))


def test_adopting_another_spec_keeps_what_the_schedule_settled(tmp_path):
    """A resume that changes the recipe's [eval]: the run's schedule takes the new spec, its results stay."""
    schedules.adopt(tmp_path, spec(RECIPE, every=100, final=True))
    schedules.update(tmp_path, RECIPE, lambda s: s.mark_done(100, "step_100", {"mlm_acc": 0.5}))
    state = schedules.adopt(tmp_path, spec(RECIPE, every=50, final=True))
    assert schedules.load(tmp_path, RECIPE) == state
    assert state.spec.every == 50 and state.done == {100: "step_100"} and state.metrics == {100: {"mlm_acc": 0.5}}


def test_steps_done_missing_or_failed_are_no_longer_due():
    state = ScheduleState(spec())
    state.mark_done(10, "a")
    state.mark_missing(20, "gone")
    state.mark_failed(30, "raised")
    assert state.unsettled([10, 20, 30, 40]) == [40]


def test_a_matching_step_saved_and_no_longer_on_disk_is_named_missing_with_its_reason():
    state = ScheduleState(spec())
    state.observe(on_disk=[30, 40], saved={10: "deleted by retention", 15: "deleted by retention"})
    assert state.missing == {10: "deleted by retention"}  # 15 does not match the schedule
    assert state.pending == [30, 40]


def test_a_step_already_done_is_never_named_missing_when_its_checkpoint_goes():
    state = ScheduleState(spec())
    state.mark_done(10, "a")
    state.observe(on_disk=[20], saved={10: "deleted by retention"})
    assert state.missing == {} and state.pending == [20]


def test_a_crash_between_the_result_line_and_the_record_neither_repeats_nor_loses_the_step(tmp_path):
    schedules.create_or_attach(tmp_path, spec())
    schedules.update(tmp_path, "every-10", lambda s: s.observe([10, 20], {}))
    run_log.append(tmp_path, result_line("every-10", 10))  # appended, then the scheduler died before recording
    assert schedules.load(tmp_path, "every-10").pending == [10, 20]

    results = [r for r in run_log.read_metrics(tmp_path) if r["kind"] == RESULT_KIND]
    state = schedules.update(tmp_path, "every-10", lambda s: s.reconcile(results))
    assert state.done == {10: "step_10"}
    assert state.pending == [20]
    assert state.unsettled([10, 20]) == [20]


def test_reconcile_takes_only_the_lines_of_its_own_schedule(tmp_path):
    state = ScheduleState(spec("a"))
    assert state.reconcile([result_line("b", 10), result_line("a", 20)]) == [20]
    assert list(state.done) == [20]


def test_the_state_file_round_trips_through_json(tmp_path):
    state = ScheduleState(spec(tasks=("polarity",), task_data=("/data/polarity",), task_max_steps=5, final=True))
    state.mark_done(10, "/run/checkpoints/step_00000010", {"mlm_acc": 0.25, "task/polarity/acc": 0.5})
    state.observe(on_disk=[15, 25], saved={}, finals=[25])
    state.mark_missing(20, "deleted by retention")
    state.cancelled = True
    again = ScheduleState.from_json(state.to_json(), tmp_path / "x.json")
    assert again == state


def test_attaching_with_another_job_under_the_same_name_is_refused(tmp_path):
    schedules.create_or_attach(tmp_path, spec(every=10))
    _, created = schedules.create_or_attach(tmp_path, spec(every=10, cpus=0.0))  # CPUs may differ
    assert not created
    with pytest.raises(ValueError, match="--name every-10: a schedule of that name exists"):
        schedules.create_or_attach(tmp_path, spec(every=20))


def test_a_cancelled_schedule_holds_no_checkpoint_and_cannot_be_attached_again(tmp_path):
    schedules.create_or_attach(tmp_path, spec())
    assert held(tmp_path, [10, 20, 25]) == {10, 20}

    def cancel(state):
        state.cancelled = True

    schedules.update(tmp_path, "every-10", cancel)
    assert held(tmp_path, [10, 20, 25]) == set()
    with pytest.raises(ValueError, match="cancelled"):
        schedules.create_or_attach(tmp_path, spec())


def test_an_unreadable_schedule_file_holds_nothing_and_does_not_stop_a_status(tmp_path):
    schedules.create_or_attach(tmp_path, spec("good"))
    (tmp_path / "schedules" / "bad.json").write_text("{")
    assert held(tmp_path, [10]) == {10}
    assert [s["name"] for s in schedules.summaries(tmp_path)] == ["good"]


def test_a_schedule_name_with_a_path_separator_is_refused():
    with pytest.raises(ValueError, match="--name"):
        schedules.check_name("../x")


def _hold_the_run_lock(run_dir: str, ready, release) -> None:
    with schedules.running(run_dir, "every-10") as held:
        assert held
        ready.set()
        release.wait(30)


def test_only_one_process_runs_a_schedule_and_the_lock_goes_with_it(tmp_path):
    context = multiprocessing.get_context("spawn")
    ready, release = context.Event(), context.Event()
    holder = context.Process(target=_hold_the_run_lock, args=(str(tmp_path), ready, release))
    holder.start()
    assert ready.wait(30)
    with schedules.running(tmp_path, "every-10") as held:
        assert not held
    holder.kill()
    holder.join()
    with schedules.running(tmp_path, "every-10") as held:
        assert held
