"""The run coordinator actor: metrics log, checkpoint verification and retention, the run's own evaluations (its
schedule "recipe", run by the coordinator), recovery.

Real Ray (the session's local instance), real checkpoint directories (tiny models saved by the train loop's own
save_train_state), a real held-out Parquet file. No training.
"""

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch
from ray._private.state import actors

from albert_core.examples.shards import HELDOUT_FILE, HELDOUT_SCHEMA
from albert_core.files import CHECKSUM_FILE, LEGACY_CHECKSUM_FILE, METRICS_FILE, CorruptCheckpoint
from albert_core.model.checkpoint import save_model
from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import AlbertForPreTraining
from albert_core.optim import make_optimizer
from services import RAY_NAMESPACE
from services.cli import main
from services.cluster import coordinator_name
from services.eval.evaluate import UnknownTask
from services.eval.schedule import Scheduler, evaluator_prefix
from services.rundir import schedules
from services.rundir.checkpoints import MODEL_FILES, TRAINING_FILES, verify
from services.rundir.cli import run_status
from services.rundir.config import RunConfig
from services.rundir.evaluations import recipe_spec, record_result
from services.rundir.ledger import LEDGER_FILE, OLD_LEDGER_FILE, RunLedger
from services.rundir.schedules import RECIPE
from services.rundir.status import HEARTBEAT_FILE, LIVE_WITHIN_S, read_status
from services.train.coordinator import get_or_create_coordinator
from services.train.record import CoordinatorRecord
from services.train.state import TrainerState, save_train_state

VOCAB = 64
TOKEN = 9  # every held-out token: a model biased to it predicts every masked token right


def tiny_model(vocab_size: int = VOCAB, knows_the_token: bool = False) -> AlbertForPreTraining:
    torch.manual_seed(0)
    config = AlbertConfig(
        vocab_size=vocab_size,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    model = AlbertForPreTraining(config)
    if knows_the_token:
        with torch.no_grad():
            model.mlm_head.bias[TOKEN] = 50.0
    return model


def write_checkpoint(directory: Path, step: int, model: AlbertForPreTraining | None = None) -> str:
    """A checkpoint directory as the train loop leaves it (its save_train_state): weights, config, optimizer,
    trainer.json and their checksums."""
    model = model or tiny_model()
    optimizer = make_optimizer(model, name="adamw", lr=1e-3)
    return str(save_train_state(directory, model, optimizer, None, TrainerState(step=step)))


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def metrics_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def events(run_dir: Path, name: str) -> list[dict]:
    return [line for line in metrics_lines(run_dir) if line["kind"] == "event" and line["event"] == name]


def evaluator_handle(run_dir: Path, step: int, timeout: float = 60.0):
    """The live evaluator of a step of the run's own schedule, once it is launched."""
    prefix = evaluator_prefix(run_dir, RECIPE, step)
    deadline = time.monotonic() + timeout
    while True:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
        if names:
            return ray.get_actor(names[0], namespace=RAY_NAMESPACE)
        assert time.monotonic() < deadline, f"no evaluator of step {step} was launched"
        time.sleep(0.05)


def counts(pending: int = 0, done: int = 0, failed: int = 0, missing: int = 0) -> dict[str, int]:
    return {"pending": pending, "done": done, "failed": failed, "missing": missing}


class Run:
    """A run directory, shards with held-out documents, and its coordinator (killed at teardown)."""

    _count = 0

    def __init__(self, tmp_path: Path, **sections):
        Run._count += 1
        self.name = f"test-run-{Run._count}-{time.time_ns()}"
        self.dir = tmp_path / "runs" / self.name
        self.shards = tmp_path / "shards"
        heldout = self.shards / HELDOUT_FILE
        heldout.parent.mkdir(parents=True, exist_ok=True)
        lengths = (6, 5, 7)
        rows = [
            {"doc_id": i, "sentences": [[TOKEN] * n for n in lengths], "word_starts": [[True] * n for n in lengths]}
            for i in range(30)
        ]
        pq.write_table(pa.Table.from_pylist(rows, schema=HELDOUT_SCHEMA), heldout)
        config = {
            "run": {"name": self.name, "output_dir": str(tmp_path / "runs"), "seed": 3},
            "data": {"shards": str(self.shards), "max_seq_length": 32},
            "train": {"keep_last": 2, **sections.get("train", {})},
            "eval": {"every_steps": 0, "batch_size": 16, "heldout_batches": 2, **sections.get("eval", {})},
            "optim": sections.get("optim", {}),
        }
        self.config = RunConfig.from_dict(config).to_dict()
        self.actor = get_or_create_coordinator(self.dir, self.name, self.config)
        ray.get(self.actor.__ray_ready__.remote(), timeout=120)  # up before any checkpoint, as in a run

    def checkpoint(self, step: int, model=None) -> str:
        return write_checkpoint(self.dir / "checkpoints" / f"step_{step:06d}", step, model)

    def call(self, method: str, *args, **kwargs):
        return ray.get(getattr(self.actor, method).remote(*args, **kwargs), timeout=120)


@pytest.fixture
def make_run(ray_local, tmp_path):
    runs = []

    def make(**sections) -> Run:
        runs.append(Run(tmp_path, **sections))
        return runs[-1]

    yield make
    for run in runs:
        ray.kill(run.actor, no_restart=True)


# --- checksums (no Ray) ----------------------------------------------------------------------------------------


def test_verify_accepts_an_intact_checkpoint(tmp_path):
    path = write_checkpoint(tmp_path / "ckpt", 5)
    assert set(verify(path)["files"]) == set(TRAINING_FILES)


def test_verify_names_the_file_whose_bytes_changed(tmp_path):
    path = write_checkpoint(tmp_path / "ckpt", 5)
    flip_a_bit(tmp_path / "ckpt" / "model.safetensors")
    with pytest.raises(CorruptCheckpoint, match=r"model.safetensors: checksum mismatch"):
        verify(path)


def test_verify_names_a_listed_file_that_is_missing(tmp_path):
    path = write_checkpoint(tmp_path / "ckpt", 5)
    (tmp_path / "ckpt" / "trainer.json").unlink()
    with pytest.raises(CorruptCheckpoint, match="trainer.json: missing"):
        verify(path)


def test_verify_refuses_a_directory_without_checksums(tmp_path):
    save_model(tmp_path / "ckpt", tiny_model())
    with pytest.raises(CorruptCheckpoint, match=f"{CHECKSUM_FILE}: missing"):
        verify(tmp_path / "ckpt", MODEL_FILES)


def test_verify_of_the_model_files_alone_still_checks_every_listed_file(tmp_path):
    """What evaluation asks (MODEL_FILES listed) is less than what a resume asks, never fewer checksums checked."""
    path = write_checkpoint(tmp_path / "ckpt", 5)
    assert set(verify(path, MODEL_FILES)["files"]) == set(TRAINING_FILES)
    flip_a_bit(tmp_path / "ckpt" / "optimizer.safetensors")
    with pytest.raises(CorruptCheckpoint, match=r"optimizer.safetensors: checksum mismatch"):
        verify(path, MODEL_FILES)


# --- metrics log ---------------------------------------------------------------------------------------------


def test_reports_are_appended_to_metrics_jsonl_as_train_lines(make_run):
    run = make_run()
    for step, loss in ((10, 6.5), (20, 5.25), (30, 4.0)):
        run.call("report", step, {"loss": loss, "lr": 0.001})
    train = [line for line in metrics_lines(run.dir) if line["kind"] == "train"]
    assert [(line["step"], line["loss"], line["lr"]) for line in train] == [
        (10, 6.5, 0.001),
        (20, 5.25, 0.001),
        (30, 4.0, 0.001),
    ]
    assert all(isinstance(line["time"], float) for line in train)
    assert run.call("status")["step"] == 30


def test_a_retried_report_is_written_once(make_run):
    run = make_run()
    run.call("report", 10, {"loss": 6.5})
    run.call("report", 10, {"loss": 6.5})
    assert [line["step"] for line in metrics_lines(run.dir) if line["kind"] == "train"] == [10]


def test_a_resumed_run_replaces_the_train_lines_from_its_resume_step(make_run):
    run = make_run()
    for step in (10, 20, 30):
        run.call("report", step, {"loss": 1.0})
    run.call("report", 20, {"loss": 0.9})  # resumed from the checkpoint at step 10
    train = [(line["step"], line["loss"]) for line in metrics_lines(run.dir) if line["kind"] == "train"]
    assert train == [(10, 1.0), (20, 0.9)]
    assert [(e["previous_step"], e["train_lines_dropped"]) for e in events(run.dir, "train_lines_replaced")] == [
        (30, 2)
    ]


def test_dropout_removal_at_the_configured_step_is_an_event(make_run):
    run = make_run(train={"dropout_removal_step": 20})
    for step in (10, 20, 30):
        run.call("report", step, {"loss": 1.0})
    assert [(e["step"], e["previous"], e["dropout"]) for e in events(run.dir, "dropout_removed")] == [(20, 0.1, 0.0)]
    assert run.call("status")["dropout"]["removed_at"] == 20


def test_a_dropout_value_reported_by_the_train_loop_is_noted_when_it_changes(make_run):
    run = make_run()
    for step, p in ((10, 0.1), (20, 0.1), (30, 0.0), (40, 0.0)):
        run.call("report", step, {"loss": 1.0, "dropout": p})
    assert [e["step"] for e in events(run.dir, "dropout_removed")] == [30]


def test_a_half_written_last_line_is_cut_when_the_coordinator_starts(make_run, tmp_path):
    run = make_run()
    run.call("report", 10, {"loss": 1.0})
    ray.kill(run.actor, no_restart=True)
    with open(run.dir / METRICS_FILE, "a") as f:
        f.write('{"step": 20, "time": 1.0, "kind": "tr')  # the process died mid-write
    run.actor = get_or_create_coordinator(run.dir, run.name, run.config)
    run.call("report", 20, {"loss": 0.5})
    lines = metrics_lines(run.dir)  # every line parses
    assert [line["step"] for line in lines if line["kind"] == "train"] == [10, 20]
    assert len(events(run.dir, "metrics_log_repaired")) == 1


# --- checkpoints -----------------------------------------------------------------------------------------------


def test_retention_keeps_the_last_k_checkpoints_and_deletes_the_others(make_run):
    run = make_run(train={"keep_last": 2})
    steps = (100, 200, 300, 400)
    paths = [run.checkpoint(step) for step in steps]
    for step, path in zip(steps, paths, strict=True):
        assert run.call("checkpoint_saved", step, path, {"loss": 1.0})["accepted"]
    assert [Path(p).exists() for p in paths] == [False, False, True, True]
    assert [c["step"] for c in run.call("status")["checkpoints"]] == [300, 400]


def test_retention_also_keeps_the_best_checkpoint_by_heldout_mlm_accuracy(make_run):
    run = make_run(train={"keep_last": 1}, eval={"every_steps": 200})
    models = {100: None, 200: tiny_model(knows_the_token=True), 300: None, 400: None}
    paths = {step: run.checkpoint(step, model) for step, model in models.items()}
    for step, path in paths.items():
        run.call("checkpoint_saved", step, path)
    assert run.call("wait_for_evals", 120) == counts(done=2)
    status = run.call("status")
    assert [c["step"] for c in status["checkpoints"]] == [200, 400]
    assert status["best_checkpoint"] == paths[200]
    assert {step: Path(path).exists() for step, path in paths.items()} == {100: False, 200: True, 300: False, 400: True}


def test_a_bit_flipped_checkpoint_is_refused(make_run):
    run = make_run()
    path = run.checkpoint(100)
    flip_a_bit(Path(path) / "model.safetensors")
    result = run.call("checkpoint_saved", 100, path)
    assert result["accepted"] is False
    assert "model.safetensors: checksum mismatch" in result["reason"]
    assert run.call("status")["checkpoints"] == []
    assert run.call("latest_good_checkpoint") is None
    assert [e["path"] for e in events(run.dir, "checkpoint_refused")] == [path]


def test_latest_good_checkpoint_skips_a_checkpoint_corrupted_after_it_was_saved(make_run):
    run = make_run()
    older, newer = run.checkpoint(100), run.checkpoint(200)
    run.call("checkpoint_saved", 100, older)
    run.call("checkpoint_saved", 200, newer)
    assert run.call("latest_good_checkpoint") == newer
    flip_a_bit(Path(newer) / "model.safetensors")
    assert run.call("latest_good_checkpoint") == older
    assert [c["step"] for c in run.call("status")["checkpoints"]] == [100]


# --- evaluations -----------------------------------------------------------------------------------------------


def test_a_checkpoint_on_the_eval_schedule_gets_an_eval_line_with_the_three_accuracies(make_run):
    run = make_run(eval={"every_steps": 100})
    assert run.call("checkpoint_saved", 100, run.checkpoint(100, tiny_model(knows_the_token=True)))["eval_scheduled"]
    assert not run.call("checkpoint_saved", 150, run.checkpoint(150))["eval_scheduled"]
    assert run.call("wait_for_evals", 120) == counts(done=1)
    (line,) = [line for line in metrics_lines(run.dir) if line["kind"] == "eval"]
    assert line["step"] == 100
    assert line["mlm_acc"] == 1.0
    assert 0.0 <= line["sop_acc"] <= 1.0 and 0.0 <= line["nsp_acc"] <= 1.0
    assert line["sop_examples"] > 0 and line["nsp_examples"] > 0
    table = (run.dir / "eval.md").read_text().splitlines()
    assert table[0].startswith("| step | mlm_acc | mlm_loss | sop_acc | nsp_acc |")
    assert table[2].startswith("| 100 | 1.0000 |")


@ray.remote
class CpuHolder:
    """Holds CPUs as training workers do (the test cluster has 2)."""

    def ready(self) -> bool:
        return True


def test_evaluators_of_eval_cpus_0_run_while_training_holds_every_cpu_and_those_of_1_wait(make_run):
    holder = CpuHolder.options(num_cpus=2).remote()
    try:
        ray.get(holder.ready.remote(), timeout=60)
        waiting, beside = make_run(eval={"every_steps": 100}), make_run(eval={"every_steps": 100, "cpus": 0})
        for run in (waiting, beside):
            assert run.call("checkpoint_saved", 100, run.checkpoint(100))["eval_scheduled"]
        assert beside.call("wait_for_evals", 120) == counts(done=1)
        assert waiting.call("wait_for_evals", 2) == counts(pending=1)
    finally:
        ray.kill(holder, no_restart=True)
    assert waiting.call("wait_for_evals", 120) == counts(done=1)  # once the CPUs are free


def test_a_reopened_coordinator_relaunches_pending_evaluations_only_once_training_reports(make_run):
    """A resumed run's evaluations left pending must not take the CPUs its workers are about to ask for."""
    run = make_run(eval={"every_steps": 100}, train={"num_workers": 2, "global_batch_size": 64})
    run.call("checkpoint_saved", 100, run.checkpoint(100))
    evaluator = evaluator_handle(run.dir, 100)
    ray.kill(run.actor, no_restart=True)  # the driver's Ctrl-C: the coordinator goes, its evaluation stays pending
    ray.kill(evaluator, no_restart=True)
    run.actor = get_or_create_coordinator(run.dir, run.name, run.config)
    assert run.call("status")["evals"]["pending"] == [100]
    holder = CpuHolder.options(num_cpus=2).remote()  # the resumed run's 2 training workers
    try:
        ray.get(holder.ready.remote(), timeout=60)
        run.call("report", 110, {"loss": 1.0})  # training has its workers: now the evaluation may run, beside it
        assert run.call("wait_for_evals", 120) == counts(done=1)
    finally:
        ray.kill(holder, no_restart=True)
    assert events(run.dir, "eval_cpus_shared")[0]["training_cpus"] == 2


def test_the_checkpoint_at_total_steps_is_evaluated_off_the_schedule(make_run):
    run = make_run(eval={"every_steps": 0}, optim={"total_steps": 120, "warmup_steps": 10})
    assert not run.call("checkpoint_saved", 100, run.checkpoint(100))["eval_scheduled"]
    assert run.call("checkpoint_saved", 120, run.checkpoint(120))["eval_scheduled"]
    assert run.call("wait_for_evals", 120) == counts(done=1)
    assert run.call("status")["evals"]["done"] == [120]


def test_a_checkpoint_marked_final_is_evaluated_off_the_schedule(make_run):
    run = make_run(eval={"every_steps": 0})
    assert run.call("checkpoint_saved", 70, run.checkpoint(70), final=True)["eval_scheduled"]
    assert run.call("status")["evals"]["pending"] == [70]


def test_an_evaluator_that_dies_is_relaunched(make_run):
    run = make_run(eval={"every_steps": 100})
    run.call("checkpoint_saved", 100, run.checkpoint(100))
    ray.kill(evaluator_handle(run.dir, 100))
    run.call("report", 110, {"loss": 1.0})  # training calls go on while the evaluation is retried
    assert run.call("wait_for_evals", 120) == counts(done=1)
    assert [e["deaths"] for e in events(run.dir, "eval_retried")] == [1]
    assert [line["step"] for line in metrics_lines(run.dir) if line["kind"] == "eval"] == [100]


def test_an_evaluation_that_raises_is_recorded_as_failed_and_the_run_goes_on(make_run):
    run = make_run(eval={"every_steps": 100})
    # A model whose vocabulary does not hold the held-out token ids: the evaluation raises.
    run.call("checkpoint_saved", 100, run.checkpoint(100, tiny_model(vocab_size=8)))
    assert run.call("wait_for_evals", 120) == counts(failed=1)
    (failure,) = events(run.dir, "eval_failed")
    assert f"token id {TOKEN} outside the vocabulary" in failure["reason"]
    run.call("report", 120, {"loss": 1.0})
    assert run.call("status")["step"] == 120


# --- recovery and reading --------------------------------------------------------------------------------------


def test_a_killed_coordinator_restarts_from_its_state_file_with_nothing_lost(make_run):
    run = make_run(eval={"every_steps": 100})
    run.call("report", 90, {"loss": 2.0})
    run.call("checkpoint_saved", 50, run.checkpoint(50))
    run.call("checkpoint_saved", 100, run.checkpoint(100))  # its evaluation is running when the actor dies
    before = run.call("status")
    ray.kill(run.actor, no_restart=False)
    after = run.call("status")  # waits for the restart
    assert after == before
    assert run.call("wait_for_evals", 120) == counts(done=1)
    run.call("report", 110, {"loss": 1.5})
    assert [line["step"] for line in metrics_lines(run.dir) if line["kind"] == "train"] == [90, 110]
    assert [line["step"] for line in metrics_lines(run.dir) if line["kind"] == "eval"] == [100]


def test_a_delivered_batch_run_again_is_applied_once_even_by_a_restarted_coordinator(make_run):
    """Ray runs a deliver call again on a restarted coordinator, possibly after the dead one had applied it: each
    numbered call is applied once (the numbers live in ledger.json); another sender's numbers are its own."""
    run = make_run()
    path = run.checkpoint(20)
    calls = [
        (1, "report", (10, {"loss": 2.0}), {}),
        (2, "report", (20, {"loss": 1.5}), {}),
        (3, "checkpoint_saved", (20, path, {"loss": 1.5}), {"final": False}),
        (4, "event", (20, "warning", {"message": "slow disk"}), {}),
    ]
    run.call("deliver", "rank0-a", calls)
    run.call("deliver", "rank0-a", calls[1:])
    restart(run.actor)
    run.call("deliver", "rank0-a", calls)
    run.call("deliver", "rank0-b", [(1, "report", (30, {"loss": 1.0}), {})])
    assert [line["step"] for line in metrics_lines(run.dir) if line["kind"] == "train"] == [10, 20, 30]
    assert [e["message"] for e in events(run.dir, "warning")] == ["slow disk"]
    assert [e["step"] for e in events(run.dir, "checkpoint_saved")] == [20]
    assert events(run.dir, "train_lines_replaced") == []
    with pytest.raises(ray.exceptions.RayTaskError, match="'status' is not one of"):
        run.call("deliver", "rank0-a", [(5, "status", (), {})])


def test_reports_sent_across_a_coordinator_kill_reach_the_log_in_order_once_each(make_run):
    """The train loop's record sends without waiting while the coordinator dies and restarts: every line arrives,
    once, in step order (Ray alone runs the calls queued for a restarted actor in any order)."""
    run = make_run()
    record = CoordinatorRecord(coordinator_name(run.name))
    pid = actors(actor_id=run.actor._actor_id.hex())["Pid"]
    for step in range(1, 201):
        record.report(step, {"loss": 1.0 / step})
        if step == 20:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.002)
    record.event(200, "warning", message="the last line")
    train = [line["step"] for line in metrics_lines(run.dir) if line["kind"] == "train"]
    assert train == list(range(1, 201))
    assert events(run.dir, "train_lines_replaced") == []
    assert metrics_lines(run.dir)[-1]["event"] == "warning"  # an event returns once the lines before it are in


def test_a_checkpoint_the_restarted_coordinator_indexed_from_disk_is_evaluated_once(make_run):
    """The train loop wrote a checkpoint and the coordinator died before its checkpoint_saved call arrived: the
    restarted coordinator's ledger indexes it again from disk, and the run's schedule (not the ledger) evaluates it;
    the late call (Ray retries it) adds no second evaluation."""
    run = make_run(eval={"every_steps": 100})
    run.call("report", 90, {"loss": 2.0})
    path = run.checkpoint(100)
    restart(run.actor)
    assert [line["step"] for line in events(run.dir, "checkpoint_reindexed")] == [100]
    deadline = time.monotonic() + 30  # the schedule's thread looks at the run on its own (at start, then every 2 s)
    while (pending := run.call("status")["evals"]["pending"]) != [100] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pending == [100]
    run.call("report", 110, {"loss": 1.5})  # training goes on: the evaluation may run
    assert run.call("checkpoint_saved", 100, path)["accepted"]
    assert run.call("wait_for_evals", 120) == counts(done=1)
    assert [line["step"] for line in metrics_lines(run.dir) if line["kind"] == "eval"] == [100]


def restart(actor, timeout: float = 60.0) -> None:
    """Kill the actor's process and wait until Ray has restarted it (ray.kill returns before the kill lands)."""

    def restarts() -> tuple[int, str]:
        info = actors(actor_id=actor._actor_id.hex())
        return info["NumRestarts"], info["State"]

    before, _ = restarts()
    ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + timeout
    while restarts() != (before + 1, "ALIVE"):
        assert time.monotonic() < deadline, "the actor was not restarted"
        time.sleep(0.05)


def test_a_stop_request_outlives_a_coordinator_restart_but_not_its_run(make_run):
    """Ctrl-C on the driver, then the coordinator's process dies before rank 0 polls: the restarted coordinator still
    asks training to stop. The next `albert pretrain` of the run (a new coordinator) is not stopped by it."""
    run = make_run()
    run.call("report", 40, {"loss": 2.0})
    run.call("request_stop", "SIGTERM")
    restart(run.actor)
    assert run.call("stop_requested") == "SIGTERM"
    ray.kill(run.actor, no_restart=True)
    run.actor = get_or_create_coordinator(run.dir, run.name, run.config)  # the resumed run's driver
    assert not run.call("stop_requested")
    assert [e["step"] for e in events(run.dir, "stop_requested")] == [40]


def recipe_scheduler(run_dir: Path, config: RunConfig) -> Scheduler:
    """The run's own schedule as its coordinator adopts it, and its scheduler (observing needs no Ray)."""
    schedules.adopt(run_dir, recipe_spec(config, run_dir / "heldout.parquet"))
    return Scheduler(run_dir, RECIPE)


def test_a_checkpoint_logged_as_saved_but_missing_from_the_state_file_is_indexed_again_on_reopen(tmp_path):
    """A coordinator killed between the checkpoint_saved line and its state write: the reopened ledger indexes the
    checkpoint again from disk (resume starts from it), unless it is gone since or does not verify; the run's
    schedule, which reads the disk and the log itself, has its evaluation due (the damaged one fails its
    verification)."""
    config = RunConfig.from_dict({"run": {"name": "r", "output_dir": str(tmp_path)}, "eval": {"every_steps": 100}})
    run_dir, checkpoints = tmp_path / "r", tmp_path / "r" / "checkpoints"
    ledger = RunLedger(run_dir, "r", config.to_dict())
    ledger.checkpoint_saved(100, write_checkpoint(checkpoints / "step_100", 100))
    for step in (150, 200, 300):  # each logged as saved, the state file not written after it (the crash)
        ledger.event(step, "checkpoint_saved", path=write_checkpoint(checkpoints / f"step_{step}", step))
    shutil.rmtree(checkpoints / "step_150")  # retention deleted it: its directory is gone, then the line says so
    ledger.event(150, "checkpoint_deleted", path=str(checkpoints / "step_150"))
    flip_a_bit(checkpoints / "step_300" / "model.safetensors")  # cut short by the same crash
    reopened = RunLedger(run_dir, "r", config.to_dict())
    assert [c.step for c in reopened.state.checkpoints] == [100, 200]
    assert reopened.latest_good_checkpoint() == str(checkpoints / "step_200")
    assert [line["step"] for line in events(run_dir, "checkpoint_reindexed")] == [200]
    assert [c.step for c in RunLedger(run_dir, "r", config.to_dict()).state.checkpoints] == [100, 200]  # once
    scheduler = recipe_scheduler(run_dir, config)
    assert scheduler.observe()[0].pending == [100, 200, 300]
    scheduler.launch(300)
    state = schedules.load(run_dir, RECIPE)
    assert state.pending == [100, 200] and "model.safetensors: checksum mismatch" in state.failed[300]


def test_a_checkpoint_found_on_disk_before_its_save_call_arrives_is_recorded_by_that_call_once(tmp_path):
    """A coordinator that (re)opens its ledger after the train loop wrote a checkpoint, before the loop's
    checkpoint_saved call reached it: the index has it from disk, and the call still records it (its line, its
    metrics, retention); the same call retried then changes nothing."""
    config = RunConfig.from_dict({"run": {"name": "r", "output_dir": str(tmp_path)}, "train": {"keep_last": 1}})
    run_dir, checkpoints = tmp_path / "r", tmp_path.resolve() / "r" / "checkpoints"
    RunLedger(run_dir, "r", config.to_dict()).checkpoint_saved(100, write_checkpoint(checkpoints / "step_100", 100))
    newer = write_checkpoint(checkpoints / "step_200", 200)
    reopened = RunLedger(run_dir, "r", config.to_dict())  # the restarted coordinator
    assert [c.step for c in reopened.state.checkpoints] == [100, 200]
    result = reopened.checkpoint_saved(200, newer, {"loss": 1.5})
    assert result.accepted and result.deleted == [str(checkpoints / "step_100")]
    assert reopened.checkpoint(200).metrics == {"loss": 1.5}
    assert reopened.checkpoint_saved(200, newer, {"loss": 1.5}).accepted  # Ray retries the call
    assert [line["step"] for line in events(run_dir, "checkpoint_saved")] == [100, 200]


def test_a_final_checkpoint_indexed_again_on_reopen_keeps_its_final_evaluation(tmp_path):
    """The budget (or a stop) ends a run off the eval schedule; its coordinator is killed between the final
    checkpoint's checkpoint_saved line and the state write: the reopened ledger knows the run finished (no stalled
    event) and the run's schedule still evaluates it off the every_steps schedule."""
    config = RunConfig.from_dict({"run": {"name": "r", "output_dir": str(tmp_path)}, "eval": {"every_steps": 100}})
    run_dir, checkpoints = tmp_path / "r", tmp_path / "r" / "checkpoints"
    ledger = RunLedger(run_dir, "r", config.to_dict())
    ledger.checkpoint_saved(100, write_checkpoint(checkpoints / "step_100", 100))
    before = (run_dir / LEDGER_FILE).read_bytes()
    ledger.checkpoint_saved(130, write_checkpoint(checkpoints / "step_130", 130), final=True)
    (run_dir / LEDGER_FILE).write_bytes(before)  # the state write the kill prevented
    reopened = RunLedger(run_dir, "r", config.to_dict())
    assert [c.step for c in reopened.state.checkpoints] == [100, 130]
    assert reopened.state.finished
    assert recipe_scheduler(run_dir, config).observe()[0].pending == [100, 130]


def test_retention_keeps_the_checkpoints_the_runs_evaluations_need_and_then_only_the_best(tmp_path):
    """keep_last 1, evaluations every 100 steps: a checkpoint waiting for its evaluation stays; once the evaluations
    are done, the best by held-out MLM accuracy stays, the others go."""
    config = RunConfig.from_dict(
        {"run": {"name": "r", "output_dir": str(tmp_path)}, "train": {"keep_last": 1}, "eval": {"every_steps": 100}}
    )
    run_dir, checkpoints = tmp_path / "r", tmp_path / "r" / "checkpoints"
    ledger = RunLedger(run_dir, "r", config.to_dict())
    scheduler = recipe_scheduler(run_dir, config)
    for step in (100, 150, 200):
        ledger.checkpoint_saved(step, write_checkpoint(checkpoints / f"step_{step}", step))
        scheduler.observe()  # as the coordinator has the run's schedule do after each save
    assert [c.step for c in ledger.state.checkpoints] == [100, 200]
    for step, acc in ((100, 0.3), (200, 0.2)):
        record_result(run_dir, scheduler.spec, config, step, str(checkpoints / f"step_{step}"), {"mlm_acc": acc})
    ledger.checkpoint_saved(250, write_checkpoint(checkpoints / "step_250", 250))
    assert [c.step for c in ledger.state.checkpoints] == [100, 250]
    assert read_status(run_dir)["best_checkpoint"] == str(checkpoints / "step_100")


def old_run_directory(run_dir: Path, evals: list[dict]) -> None:
    """The run directory as the code before issue 35 left it: its ledger file coordinator.json, holding the
    ledger's `evals`, and each checkpoint's checksums in MANIFEST.json."""
    old = json.loads((run_dir / LEDGER_FILE).read_text())
    old["evals"], old["last_eval_scheduled"], old["plateau"] = evals, max(e["step"] for e in evals), False
    (run_dir / OLD_LEDGER_FILE).write_text(json.dumps(old))
    (run_dir / LEDGER_FILE).unlink()
    for checkpoint in (run_dir / "checkpoints").iterdir():
        os.replace(checkpoint / CHECKSUM_FILE, checkpoint / LEGACY_CHECKSUM_FILE)


def test_a_run_made_before_its_evaluations_were_a_schedule_keeps_them(tmp_path, capsys):
    """coordinator.json as the code before this one wrote it, with the ledger's `evals` (and MANIFEST.json
    checkpoints): `albert status` shows them before anything opened the run; opened again, they are the run's
    schedule's (one evaluations_moved event), the status reads the same, the resume starts from its newest
    checkpoint, and nothing is evaluated twice."""
    config = RunConfig.from_dict({"run": {"name": "r", "output_dir": str(tmp_path)}, "eval": {"every_steps": 100}})
    run_dir, checkpoints = tmp_path / "r", tmp_path / "r" / "checkpoints"
    ledger = RunLedger(run_dir, "r", config.to_dict())
    paths = {step: write_checkpoint(checkpoints / f"step_{step}", step) for step in (100, 200, 300)}
    for step, path in paths.items():
        ledger.checkpoint_saved(step, path)
    metrics = {"mlm_acc": 0.5, "mlm_loss": 2.0, "sop_acc": 0.6, "nsp_acc": 0.7}
    old_run_directory(run_dir, [
        {"step": 100, "path": paths[100], "status": "done", "metrics": metrics, "error": None, "launches": 1,
         "deaths": 0},
        {"step": 200, "path": paths[200], "status": "failed", "metrics": None, "error": "boom", "launches": 1,
         "deaths": 0},
        {"step": 300, "path": paths[300], "status": "pending", "metrics": None, "error": None, "launches": 0,
         "deaths": 0},
    ])  # fmt: skip

    before = read_status(run_dir)
    assert not (run_dir / LEDGER_FILE).exists() and not (run_dir / "schedules").exists()  # reading writes nothing
    assert RunLedger(run_dir, "r", config.to_dict()).latest_good_checkpoint() == paths[300]  # the resume
    status = read_status(run_dir)
    assert status["evals"] == {"pending": [300], "done": [100], "failed": [200], "missing": []}
    assert status["best_checkpoint"] == paths[100] and status["checkpoints"][0]["eval"] == metrics
    assert {k: v for k, v in before.items() if k != "heartbeat_age_s"} == {
        k: v for k, v in status.items() if k != "heartbeat_age_s"
    }
    assert "evals" not in json.loads((run_dir / LEDGER_FILE).read_text())
    assert not (run_dir / OLD_LEDGER_FILE).exists()
    RunLedger(run_dir, "r", config.to_dict())
    (moved,) = events(run_dir, "evaluations_moved")
    assert moved["count"] == 3 and moved["to"] == str(run_dir / "schedules" / "recipe.json")
    state = recipe_scheduler(run_dir, config).observe()[0]
    assert state.pending == [300] and state.failed == {200: "boom"}  # 200 is tried again only once saved again
    assert main(["eval", "list", str(run_dir)]) == 0
    assert "recipe: every 100 and at the end, 1 done, 1 pending, 0 missing, 1 failed" in capsys.readouterr().out


def test_read_status_reads_the_run_without_its_coordinator(make_run):
    run = make_run()
    run.call("report", 40, {"loss": 3.0})
    run.call("checkpoint_saved", 40, run.checkpoint(40))
    live = run.call("status")
    assert read_status(run.dir)["live"] is True  # from the file alone: the coordinator's heartbeat is fresh
    ray.kill(run.actor, no_restart=True)
    stale = time.time() - LIVE_WITHIN_S - 1
    os.utime(run.dir / HEARTBEAT_FILE, (stale, stale))  # as it is LIVE_WITHIN_S after the coordinator died
    offline = read_status(run.dir)
    assert offline["live"] is False and live["live"] is True and offline["heartbeat_age_s"] > LIVE_WITHIN_S
    same = ("live", "heartbeat_age_s")
    assert {k: v for k, v in offline.items() if k not in same} == {k: v for k, v in live.items() if k not in same}


def test_run_status_asks_the_live_coordinator_and_falls_back_to_the_state_file(make_run):
    run = make_run()
    run.call("report", 40, {"loss": 3.0})
    assert run_status(run.dir, run.name)["live"] is True
    ray.kill(run.actor, no_restart=True)
    offline = run_status(run.dir, run.name)
    assert offline["live"] is False and offline["step"] == 40


def test_read_status_names_a_directory_that_is_not_a_run(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{LEDGER_FILE}: no run ledger"):
        read_status(tmp_path)


def test_get_or_create_returns_the_live_coordinator_of_the_same_run(make_run):
    run = make_run()
    again = get_or_create_coordinator(run.dir, run.name, run.config)
    assert again._actor_id == run.actor._actor_id


def test_get_or_create_refuses_shards_without_heldout_documents(make_run, tmp_path):
    run = make_run()
    config = {**run.config, "data": {**run.config["data"], "shards": str(tmp_path / "elsewhere")}}
    with pytest.raises(FileNotFoundError, match="heldout/documents.parquet not found"):
        get_or_create_coordinator(run.dir, "other-run", config)


def test_get_or_create_refuses_a_downstream_task_nothing_evaluates(make_run):
    run = make_run()
    config = {**run.config, "eval": {**run.config["eval"], "tasks": ["boolq"], "task_data": {"boolq": "/data/BoolQ"}}}
    with pytest.raises(UnknownTask, match="no evaluator is registered for downstream task 'boolq'"):
        get_or_create_coordinator(run.dir, "other-run", config)


# --- downstream tasks in scheduled evaluations ------------------------------------------------------------------


def write_polarity_task(directory: Path, per_label: int = 40) -> Path:
    """A polarity task in gensim's pang_lee_polarity.cor format; the label shows in the words."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = [f"__label__pos a good film number {i} , warm and fine" for i in range(per_label)]
    lines += [f"__label__neg a bad film number {i} , dull and poor" for i in range(per_label)]
    (directory / "pang_lee_polarity.cor").write_text("\n".join(lines) + "\n")
    return directory


def test_eval_tasks_put_downstream_scores_in_the_metrics_log(make_run, tmp_path):
    from albert_core.text.tokenization import Tokenizer, TokenizerTrainConfig, train_tokenizer

    task_dir = write_polarity_task(tmp_path / "polarity")
    texts = (task_dir / "pang_lee_polarity.cor").read_text().replace("__label__", "").splitlines()
    run = make_run(
        eval={"tasks": ["polarity"], "task_data": {"polarity": str(task_dir)}, "task_seeds": 1, "task_max_steps": 4}
    )
    # The run keeps its tokenizer beside its checkpoints (runs/NAME/spiece.model), as `albert pretrain` does.
    train_tokenizer(texts, run.dir, TokenizerTrainConfig(vocab_size=60, allow_smaller_vocab=True))
    vocab = Tokenizer.load(run.dir).vocab_size
    run.call("checkpoint_saved", 10, run.checkpoint(10, tiny_model(vocab_size=max(vocab, TOKEN + 1))), {}, final=True)
    run.call("wait_for_evals", 300)
    evals = [line for line in metrics_lines(run.dir) if line["kind"] == "eval"]
    assert len(evals) == 1
    assert 0.0 <= evals[0]["task/polarity/acc"] <= 1.0
    assert "mlm_acc" in evals[0]
