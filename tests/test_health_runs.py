"""Training health on real runs (local Ray): runs made to diverge and to plateau on purpose, a coordinator whose
run stalls, and the healthy runs that must stay quiet."""

from __future__ import annotations

import time

import pytest
import ray

from services.cluster import coordinator_name
from services.rundir.checkpoints import read_trainer_json
from services.rundir.log import read_metrics
from services.train.coordinator import get_or_create_coordinator
from tests.runs import run_training
from tests.test_train import run_config, write_heldout, write_shards

pytestmark = [pytest.mark.ray]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_heldout(write_shards(tmp_path_factory.mktemp("shards"), (32, 32)))


def events(run_dir, name: str) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["kind"] == "event" and r["event"] == name]


def diverging(tmp_path, shards, name: str, **train):
    """AdamW at lr 1.0: logged losses 5.25, 5.28, 5.25, then 11.98 at step 4, > 2x their median: a divergence."""
    config = run_config(tmp_path, shards, name, checkpoint_every=2, dropout_removal_step=0, **train)
    config.model.overrides.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config.optim.name, config.optim.lr, config.optim.warmup_steps = "adamw", 1.0, 8
    config.optim.total_steps = 10
    config.validate()
    return config


def test_a_diverging_run_under_stop_ends_at_the_divergence_and_says_why(ray_local, shards, tmp_path):
    config = diverging(tmp_path, shards, "diverge-stop")
    result = run_training(config, resume=False)
    assert not result.finished and result.stopped is not None
    assert "step 4" in result.stopped and "stopped (train.on_divergence is stop)" in result.stopped
    assert "lower optim.lr" in result.stopped
    assert result.step == 2  # the last checkpoint before it; nothing of step 4 is kept
    (event,) = events(config.run_dir, "divergence")
    assert event["step"] == 4 and event["action"].startswith("stopped")
    assert [r["step"] for r in read_metrics(config.run_dir) if r["kind"] == "train"] == [1, 2, 3]


def test_a_diverging_run_under_rollback_continues_from_the_last_checkpoint_at_a_lower_rate(ray_local, shards, tmp_path):
    config = diverging(tmp_path, shards, "diverge-rollback", on_divergence="rollback", rollback_lr_scale=0.01)
    result = run_training(config, resume=False)
    assert result.finished and result.step == 10 and result.stopped is None
    (event,) = events(config.run_dir, "divergence")
    assert event["step"] == 4 and event["action"] == "rolled back to step 2" and event["lr_scale"] == 0.01
    train = {r["step"]: r for r in read_metrics(config.run_dir) if r["kind"] == "train"}
    assert sorted(train) == list(range(1, 11))  # steps 3 and on trained again after the rollback
    assert [train[s]["lr_scale"] for s in (2, 3, 10)] == [1.0, 0.01, 0.01]
    assert train[6]["lr"] == pytest.approx(0.01 * 5 / 8)  # the schedule's rate at step 6, scaled
    state = read_trainer_json(result.checkpoint)
    assert (state["state"]["lr_scale"], state["state"]["rollbacks"]) == (0.01, 1)
    assert state["scheduler"]["base_lrs"][0] == pytest.approx(0.01)  # a resume continues at the scaled rate


def test_a_healthy_run_reports_no_health_event(ray_local, shards, tmp_path):
    config = run_config(tmp_path, shards, "healthy")
    result = run_training(config, resume=False)
    assert result.finished and result.stopped is None
    assert not [r for r in read_metrics(config.run_dir) if r.get("event") in ("divergence", "plateau", "stalled")]


def test_a_run_that_cannot_learn_gets_a_plateau_event_from_its_coordinator(ray_local, shards, tmp_path):
    config = run_config(tmp_path, shards, "flat", checkpoint_every=2, dropout_removal_step=0)
    config.optim.lr, config.optim.warmup_steps, config.optim.total_steps = 1e-9, 0, 6
    config.eval.every_steps, config.eval.batch_size, config.eval.heldout_batches = 2, 8, 2
    config.validate()
    coordinator = get_or_create_coordinator(config.run_dir, config.run.name, config.to_dict())
    try:
        run_training(config, resume=False, coordinator=coordinator_name(config.run.name))
        counts = ray.get(coordinator.wait_for_evals.remote(timeout=300))
        assert counts == {"pending": 0, "done": 3, "failed": 0, "missing": 0}
    finally:
        ray.kill(coordinator, no_restart=True)
    evals = [r for r in read_metrics(config.run_dir) if r["kind"] == "eval"]
    assert all("unigram_acc" in r and r["mlm_margin"] == pytest.approx(r["mlm_acc"] - r["unigram_acc"]) for r in evals)
    (event,) = events(config.run_dir, "plateau")
    assert event["step"] == 4 and "unigram baseline" in event["message"] and "optim.lr" in event["remedy"]


def test_the_coordinator_reports_a_stall_once_and_not_while_steps_arrive(ray_local, shards, tmp_path):
    config = run_config(tmp_path, shards, "stall", stall_seconds=1.0)
    coordinator = get_or_create_coordinator(config.run_dir, config.run.name, config.to_dict())
    try:
        for step in range(1, 8):  # a step every 0.25 s: no stall
            ray.get(coordinator.report.remote(step, {"loss": 5.0}))
            time.sleep(0.25)
        assert events(config.run_dir, "stalled") == []
        time.sleep(3.0)  # then nothing
        ray.get(coordinator.status.remote())
    finally:
        ray.kill(coordinator, no_restart=True)
    (event,) = events(config.run_dir, "stalled")
    assert event["step"] == 7 and "no training step reported for" in event["message"]
    assert "2 workers" in event["remedy"] and "ray status" in event["remedy"]
