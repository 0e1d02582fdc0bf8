"""A run's checkpoints have one owner (services.rundir.checkpoints) and the ledger's index is a cache of the disk:
a resume, `albert pretrain --dry-run` and `albert status` name the same checkpoint, in a copied run directory too;
`albert status` names no damaged checkpoint as the best and calls a run live only while its coordinator runs; a run
directory written before the ledger's file was renamed still shows and resumes.

Real checkpoints written by the train loop's save code, real ledgers, the real commands; no training, no Ray.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from albert_core.examples.shards import HELDOUT_FILE
from albert_core.model.modeling import AlbertForPreTraining
from albert_core.optim import make_optimizer
from services.cli import main
from services.rundir import schedules
from services.rundir.checkpoints import CHECKPOINTS_DIR, checkpoint_dir
from services.rundir.config import RunConfig
from services.rundir.evaluations import recipe_spec, record_result
from services.rundir.fields import to_toml
from services.rundir.ledger import LEDGER_FILE, OLD_LEDGER_FILE, RunLedger
from services.rundir.status import HEARTBEAT_FILE, LIVE_WITHIN_S, read_status
from services.train.state import TrainerState, load_train_state, save_train_state
from tests.test_train import VOCAB, run_config, write_heldout, write_shards

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def recipe(tmp_path) -> Path:
    """A recipe file for runs under tmp_path/runs, on real shards (and the held-out documents a dry run wants);
    total_steps 8, every checkpoint kept."""
    config = run_config(tmp_path, write_heldout(write_shards(tmp_path / "shards")), "s1", keep_last=10)
    path = tmp_path / "s1.toml"
    path.write_text(to_toml(config.to_dict()))
    return path


def config_of(recipe: Path, name: str) -> RunConfig:
    return RunConfig.load(recipe, {"run.name": name})


def model_and_optimizer(config: RunConfig, seed: int = 0):
    torch.manual_seed(seed)
    model = AlbertForPreTraining(config.model_config(VOCAB))
    return model, make_optimizer(model, name="adamw", lr=1e-3)


def started_run(config: RunConfig, steps: tuple[int, ...]) -> RunLedger:
    """The run directory a run that saved `steps` leaves: its ledger, its metrics log, its checkpoints."""
    ledger = RunLedger(config.run_dir, config.run.name, config.to_dict())
    model, optimizer = model_and_optimizer(config)
    for step in steps:
        path = save_train_state(
            checkpoint_dir(config.run_dir / CHECKPOINTS_DIR, step), model, optimizer, None, TrainerState(step=step)
        )
        ledger.report(step, {"loss": 1.0})
        assert ledger.checkpoint_saved(step, str(path), {"loss": 1.0}).accepted
    return ledger


def evaluated(config: RunConfig, ledger: RunLedger, accuracy: dict[int, float]) -> dict[int, str]:
    """The run's own evaluations (its schedule "recipe") of its checkpoints, with these held-out MLM accuracies;
    returns step -> checkpoint path."""
    paths = {c.step: c.path for c in ledger.state.checkpoints}
    recipe = schedules.adopt(config.run_dir, recipe_spec(config, Path(config.data.shards) / HELDOUT_FILE)).spec
    for step, acc in accuracy.items():
        record_result(config.run_dir, recipe, config, step, paths[step], {"mlm_acc": acc, "mlm_loss": 1.0})
    return paths


def damage(checkpoint: Path) -> None:
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))


def albert(*argv: str, capsys) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def status_of(run_dir: Path, capsys) -> dict:
    return json.loads(albert("status", str(run_dir), capsys=capsys))


def test_a_copied_run_directory_resumes_from_its_own_checkpoints_and_dry_run_status_and_resume_agree(recipe, capsys):
    """cp -a runs/s1 runs/s5, then s5's newest checkpoint damaged: everything names s5's step 4."""
    s1 = config_of(recipe, "s1")
    started_run(s1, (2, 4, 6))
    s5_dir = s1.run_dir.parent / "s5"
    shutil.copytree(s1.run_dir, s5_dir, symlinks=True)
    own = s5_dir.resolve() / CHECKPOINTS_DIR
    damage(own / "step_00000006")

    status = status_of(s5_dir, capsys)
    dry = albert("pretrain", "--config", str(recipe), "--resume", str(s5_dir), "--dry-run", capsys=capsys)
    s5 = config_of(recipe, "s5")
    resume_from = RunLedger(s5.run_dir, "s5", s5.to_dict()).latest_good_checkpoint()  # what rank 0 resumes from
    model, optimizer = model_and_optimizer(s5, seed=1)
    resumed = load_train_state(resume_from, model, optimizer, None)

    assert resume_from == str(own / "step_00000004") and resumed.step == 4
    assert f"run s5: {s5_dir.resolve()} (resumes from step 4)" in dry.splitlines()[0]
    assert status["resume_from"] == resume_from and status["run_dir"] == str(s5_dir.resolve())
    assert status["run_name"] == "s5"
    assert [c["path"] for c in status["checkpoints"]] == [str(own / "step_00000002"), resume_from]
    assert status_of(s5_dir, capsys)["resume_from"] == resume_from  # once the resume has opened the ledger, too
    assert status_of(s1.run_dir, capsys)["resume_from"] == str(s1.run_dir.resolve() / CHECKPOINTS_DIR / "step_00000006")


def test_status_names_no_damaged_checkpoint_as_the_best_or_as_the_one_to_resume_from(recipe, capsys):
    config = config_of(recipe, "s1")
    paths = evaluated(config, started_run(config, (2, 4, 6)), {2: 0.3, 4: 0.9, 6: 0.6})
    before = status_of(config.run_dir, capsys)
    damage(Path(paths[4]))
    damage(Path(paths[6]))
    after = status_of(config.run_dir, capsys)
    assert (before["best_checkpoint"], before["resume_from"]) == (paths[4], paths[6])
    assert (after["best_checkpoint"], after["resume_from"]) == (paths[2], paths[2])
    assert [c["step"] for c in after["checkpoints"]] == [2]
    assert [(r["step"], "checksum mismatch" in r["reason"]) for r in after["refused"]] == [(4, True), (6, True)]


def test_a_copied_run_directory_names_its_own_checkpoint_as_the_best(recipe, capsys):
    """The evaluations copied with a run directory name the source's checkpoints: the copy's status names its own
    copy of the best one, before and after a ledger opened the copy."""
    s1 = config_of(recipe, "s1")
    evaluated(s1, started_run(s1, (2, 4, 6)), {2: 0.3, 4: 0.9, 6: 0.6})
    s5_dir = s1.run_dir.parent / "s5"
    shutil.copytree(s1.run_dir, s5_dir, symlinks=True)
    own_best = str(s5_dir.resolve() / CHECKPOINTS_DIR / "step_00000004")
    assert status_of(s5_dir, capsys)["best_checkpoint"] == own_best
    s5 = config_of(recipe, "s5")
    RunLedger(s5.run_dir, "s5", s5.to_dict())
    assert status_of(s5_dir, capsys)["best_checkpoint"] == own_best
    assert status_of(s1.run_dir, capsys)["best_checkpoint"] == str(
        s1.run_dir.resolve() / CHECKPOINTS_DIR / "step_00000004"
    )


BEATING = "import sys, time; from services.rundir.status import touch_heartbeat; touch_heartbeat(sys.argv[1]); "


def test_a_run_is_live_while_its_coordinator_process_runs_and_not_once_it_has_exited(recipe):
    run_dir = config_of(recipe, "s1").run_dir
    started_run(config_of(recipe, "s1"), (2,))
    coordinator = subprocess.Popen(
        [sys.executable, "-c", BEATING + "print('beat', flush=True); time.sleep(120)", str(run_dir)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert coordinator.stdout.readline().strip() == "beat"
        assert read_status(run_dir)["live"] is True
    finally:
        coordinator.kill()
        coordinator.wait()
    status = read_status(run_dir)
    assert status["live"] is False and status["heartbeat_age_s"] < LIVE_WITHIN_S  # at once, not LIVE_WITHIN_S later


def test_a_heartbeat_from_another_host_is_live_while_it_is_fresh(recipe):
    run_dir = config_of(recipe, "s1").run_dir
    started_run(config_of(recipe, "s1"), (2,))
    (run_dir / HEARTBEAT_FILE).write_text(json.dumps({"host": "another-host", "pid": 1}))
    assert read_status(run_dir)["live"] is True
    stale = time.time() - LIVE_WITHIN_S - 1
    os.utime(run_dir / HEARTBEAT_FILE, (stale, stale))
    assert read_status(run_dir)["live"] is False


def test_a_run_directory_with_the_old_coordinator_json_shows_in_status_then_resumes_and_is_renamed_once(recipe, capsys):
    config = config_of(recipe, "s1")
    started_run(config, (2, 4))
    os.replace(config.run_dir / LEDGER_FILE, config.run_dir / OLD_LEDGER_FILE)  # as main before issue 35 left it
    newest = str(config.run_dir.resolve() / CHECKPOINTS_DIR / "step_00000004")

    status = status_of(config.run_dir, capsys)
    assert (status["step"], status["resume_from"]) == (4, newest)
    assert not (config.run_dir / LEDGER_FILE).exists()  # reading renames nothing
    dry = albert("pretrain", "--config", str(recipe), "--resume", str(config.run_dir), "--dry-run", capsys=capsys)
    assert "(resumes from step 4)" in dry.splitlines()[0]
    assert RunLedger(config.run_dir, "s1", config.to_dict()).latest_good_checkpoint() == newest  # the resume
    assert (config.run_dir / LEDGER_FILE).is_file() and not (config.run_dir / OLD_LEDGER_FILE).exists()
    RunLedger(config.run_dir, "s1", config.to_dict())
    lines = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["now"] for line in lines if line.get("event") == "ledger_file_renamed"] == [LEDGER_FILE]
    assert status_of(config.run_dir, capsys)["resume_from"] == newest
