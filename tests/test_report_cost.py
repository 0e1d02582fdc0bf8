"""Rank 0's warning when handing metrics lines to the run's record takes a noticeable share of training time
(services.train.worker.note_report_cost), on a real plan and rank 0's own ledger, without Ray."""

from __future__ import annotations

import pytest

from services.rundir.log import read_metrics
from services.train.plan import make_plan
from services.train.record import LedgerRecord
from services.train.worker import REPORT_COST_MIN, Worker, note_report_cost
from tests.test_train import run_config, write_shards


@pytest.fixture
def rank0(tmp_path) -> Worker:
    config = run_config(tmp_path, write_shards(tmp_path / "shards"), "report-cost", num_workers=1)
    plan = make_plan(config, resume=False, coordinator=None)
    return Worker(plan, rank=0, world=1, distributed=False, backend=None, record=LedgerRecord(plan))


def warnings(worker: Worker) -> list[dict]:
    return [r for r in read_metrics(worker.plan.run_dir) if r.get("event") == "warning"]


def test_reports_taking_a_tenth_of_training_time_are_warned_about_once(rank0):
    for step in range(1, 3 * REPORT_COST_MIN):
        note_report_cost(rank0, step, 0.01, trained=0.1 * step)
    (warning,) = warnings(rank0)
    assert warning["step"] == REPORT_COST_MIN
    assert "10% of training time" in warning["message"] and "train.log_every = 1" in warning["message"]


def test_reports_taking_a_thousandth_of_training_time_are_not_warned_about(rank0):
    for step in range(1, 3 * REPORT_COST_MIN):
        note_report_cost(rank0, step, 0.001, trained=1.0 * step)
    assert warnings(rank0) == []
