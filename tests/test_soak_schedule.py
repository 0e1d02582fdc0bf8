"""The soak's schedule and its accounting of what each fault lost (bench/soak_faults.py), without Ray: the soak
itself (bench/soak.py) runs outside the suite."""

from __future__ import annotations

import random

from bench.soak_faults import CHECKPOINT_EVERY, KINDS, draw_schedule, rollbacks


def test_a_schedule_of_as_many_faults_as_kinds_draws_every_kind_with_gaps_of_2_to_5_steps():
    schedule = draw_schedule(random.Random(5), len(KINDS) + 5)
    assert {kind for _, kind in schedule} == set(KINDS)
    assert all(2 <= gap <= 5 for gap, _ in schedule)
    assert schedule == draw_schedule(random.Random(5), len(KINDS) + 5)  # the seed replays it


def trace_of(*steps_by_time: tuple[float, int]) -> list[dict]:
    """Both ranks start each (time, step) together."""
    return [{"time": t, "rank": rank, "step": step} for t, step in steps_by_time for rank in (0, 1)]


def test_a_kill_that_resumes_from_the_last_checkpoint_rolls_back_to_it_within_the_kill_bound():
    # steps 1..11 started; killed at t=11.5; the restart resumes from the checkpoint at 8 and trains 9.. again
    trace = trace_of(*[(float(s), s) for s in range(1, 12)], (20.0, 9), (21.0, 10), (22.0, 11), (23.0, 12))
    faults = [{"kind": "worker_kill", "time": 11.5, "recovery_s": 8.5}]
    rollbacks(trace, faults)
    assert faults[0]["rolled_back"] == 3 and faults[0]["steps_redone"] == 3
    assert faults[0]["recovered"] and KINDS["worker_kill"].may_roll_back == CHECKPOINT_EVERY


def test_a_stop_that_redoes_a_completed_step_is_not_recovered():
    # the stop at step 6 saved at 5 only: the resume trains step 6 again
    trace = trace_of(*[(float(s), s) for s in range(1, 7)], (20.0, 6), (21.0, 7))
    faults = [{"kind": "driver_sigterm", "time": 6.5, "recovery_s": 13.5, "exit": 143}]
    rollbacks(trace, faults)
    assert faults[0]["rolled_back"] == 1 and not faults[0]["recovered"]


def test_a_stop_that_resumes_at_its_stop_step_loses_nothing_and_a_later_fault_owns_its_own_redo():
    trace = trace_of(*[(float(s), s) for s in range(1, 7)], (20.0, 7), (21.0, 8), (22.0, 9), (30.0, 8), (31.0, 9))
    faults = [
        {"kind": "driver_sigterm", "time": 6.5, "recovery_s": 13.5, "exit": 143},
        {"kind": "worker_kill", "time": 22.5, "recovery_s": 7.5},
    ]
    rollbacks(trace, faults)
    assert [(f["rolled_back"], f["recovered"]) for f in faults] == [(0, True), (2, True)]
