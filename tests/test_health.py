"""Training health: the plateau, divergence and stall checks, and the events a run's record keeps of them."""

from __future__ import annotations

import math

from services.rundir import schedules
from services.rundir.config import RunConfig
from services.rundir.evaluations import recipe_spec, record_result
from services.rundir.health import divergence, plateau, stalled
from services.rundir.log import read_metrics


def test_a_plateau_is_the_last_evaluations_after_warmup_all_within_the_margin_of_the_floor():
    evals = [(50, 0.02, 0.07), (100, 0.07, 0.07), (200, 0.075, 0.07)]
    found = plateau(evals, warmup_steps=60, margin=0.01, count=2)
    assert found is not None and found.event == "plateau"
    assert "0.0750" in found.message and "step 200" in found.message and "unigram baseline (0.0700)" in found.message
    assert "optim.lr" in found.remedy


def test_no_plateau_when_an_evaluation_leaves_the_floor_or_before_enough_evaluations_after_warmup():
    assert plateau([(100, 0.07, 0.07), (200, 0.12, 0.07)], warmup_steps=0, margin=0.01, count=2) is None
    assert plateau([(10, 0.07, 0.07), (100, 0.07, 0.07)], warmup_steps=30, margin=0.01, count=2) is None
    assert plateau([(100, 0.07, 0.07), (200, 0.07, 0.07)], warmup_steps=0, margin=0.01, count=0) is None


def test_a_non_finite_loss_or_gradient_norm_is_a_divergence():
    assert divergence(7, math.nan, 1.0, [], 3.0).event == "divergence"
    found = divergence(7, 5.0, math.inf, [5.0] * 10, 3.0)
    assert found is not None and "gradient norm inf" in found.message
    assert 'train.on_divergence = "rollback"' in found.remedy


def test_a_loss_spike_over_the_running_median_is_a_divergence_and_ordinary_noise_is_not():
    recent = [6.0, 5.9, 6.1, 5.8, 6.0, 5.9]
    found = divergence(40, 25.0, 3.0, recent, 3.0)
    assert found is not None and "4.2x the median" in found.message
    assert divergence(40, 7.5, 3.0, recent, 3.0) is None
    assert divergence(40, 25.0, 3.0, recent, 0.0) is None  # spike check off
    assert divergence(40, 25.0, 3.0, recent[:2], 3.0) is None  # too little history


def test_a_stall_message_names_the_resources_the_workers_wait_for():
    found = stalled(612.4, 20, limit=600, workers=2, resources={"CPU": 1})
    assert found.event == "stalled" and "612 s (last step 20)" in found.message
    assert "2 workers" in found.remedy and "1 CPU each" in found.remedy and "train.stall_seconds" in found.remedy


class Run:
    """A run directory with its own evaluation schedule (as its coordinator adopts it); no Ray."""

    def __init__(self, tmp_path, **eval_section):
        self.config = RunConfig.from_dict(
            {
                "run": {"name": "h", "output_dir": str(tmp_path)},
                "optim": {"warmup_steps": 10, "total_steps": 1000},
                "eval": {"every_steps": 100, **eval_section},
            }
        )
        self.run_dir = tmp_path / "h"
        self.spec = schedules.adopt(self.run_dir, recipe_spec(self.config, tmp_path / "heldout.parquet")).spec

    def evaluated(self, step: int, result: dict) -> None:
        """An evaluation of the step's checkpoint finished with this result."""
        record_result(self.run_dir, self.spec, self.config, step, f"/ckpt/step_{step}", result)


def evaluate(run: Run, step: int, acc: float, floor: float = 0.07) -> None:
    run.evaluated(step, {"mlm_acc": acc, "unigram_acc": floor, "mlm_margin": acc - floor})


def plateau_events(run: Run) -> list[dict]:
    return [r for r in read_metrics(run.run_dir) if r["kind"] == "event" and r["event"] == "plateau"]


def test_the_runs_evaluations_report_a_plateau_once_while_it_lasts_and_again_after_a_relapse(tmp_path):
    run = Run(tmp_path)
    evaluate(run, 100, 0.070)
    assert plateau_events(run) == []
    evaluate(run, 200, 0.072)
    evaluate(run, 300, 0.071)
    assert [e["step"] for e in plateau_events(run)] == [200]
    assert "remedy" in plateau_events(run)[0]
    evaluate(run, 400, 0.20)  # it learned
    evaluate(run, 500, 0.075)
    evaluate(run, 600, 0.074)
    assert [e["step"] for e in plateau_events(run)] == [200, 600]


def test_a_healthy_run_gets_no_plateau_event(tmp_path):
    run = Run(tmp_path)
    for step, acc in ((100, 0.09), (200, 0.15), (300, 0.22)):
        evaluate(run, step, acc)
    assert plateau_events(run) == []


def test_evaluations_without_a_baseline_never_report_a_plateau(tmp_path):
    run = Run(tmp_path)
    for step in (100, 200, 300):
        run.evaluated(step, {"mlm_acc": 0.0})
    assert plateau_events(run) == []
