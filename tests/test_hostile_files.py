"""Hostile files and careless set-ups (issue 32): no run deletes another's checkpoints, no job uploads a secret, no
file can exhaust the machine. Each test builds the file or the set-up a user (or an attacker who can write one
input) could make, runs the real code on it, and checks the one-line refusal or the counted skip it gets.
README.md, "Reliability: hostile files and set-ups", lists them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from albert_core.checkpoint import save_model
from albert_core.config import AlbertConfig
from albert_core.model import AlbertForPreTraining
from services.run.config import RunConfig
from services.run.ledger import RunLedger


def tiny_config(**fields) -> AlbertConfig:
    sizes = dict(vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    return AlbertConfig(**{**sizes, "intermediate_size": 64, "max_position_embeddings": 64, **fields})


def write_checkpoint(directory: Path, step: int) -> str:
    """A training checkpoint as the train loop leaves it: weights, config, trainer.json and MANIFEST.json."""
    torch.manual_seed(0)
    save_model(directory, AlbertForPreTraining(tiny_config()))
    (directory / "trainer.json").write_text(json.dumps({"step": step}))
    files = {}
    for path in sorted(directory.iterdir()):
        data = path.read_bytes()
        files[path.name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (directory / "MANIFEST.json").write_text(json.dumps({"files": files}))
    return str(directory)


# --- 1. retention deletes only the run's own checkpoints ---------------------------------------------------------


def ledger_for(runs: Path, name: str, keep_last: int) -> RunLedger:
    config = RunConfig.from_dict({"run": {"name": name, "output_dir": str(runs)}, "train": {"keep_last": keep_last}})
    return RunLedger(runs / name, name, config.to_dict(), evaluates=False)


def test_a_copied_run_directory_never_deletes_the_checkpoints_of_the_run_it_was_copied_from(tmp_path):
    runs = tmp_path / "runs"
    a = ledger_for(runs, "a", keep_last=3)
    for step in (100, 200, 300):
        a.checkpoint_saved(step, write_checkpoint(runs / "a" / "checkpoints" / f"step_{step:08d}", step))
    shutil.copytree(runs / "a", runs / "b")  # cp -r runs/a runs/b: b's coordinator.json names a's checkpoints
    b = ledger_for(runs, "b", keep_last=1)
    result = b.checkpoint_saved(400, write_checkpoint(runs / "b" / "checkpoints" / "step_00000400", 400))
    assert result.accepted and result.deleted == []
    assert all((runs / "a" / "checkpoints" / f"step_{step:08d}").is_dir() for step in (100, 200, 300))
    assert [c.step for c in b.state.checkpoints] == [400]  # a's entries left b's index ...
    lines = [json.loads(line) for line in (runs / "b" / "metrics.jsonl").read_text().splitlines()]
    dropped = [line for line in lines if line.get("event") == "checkpoint_not_deleted"]
    assert [line["step"] for line in dropped] == [100, 200, 300]  # ... each with an event that says why
    assert all("outside" in line["reason"] and "/a/checkpoints/" in line["path"] for line in dropped)


def test_retention_still_deletes_the_runs_own_old_checkpoints(tmp_path):
    runs = tmp_path / "runs"
    a = ledger_for(runs, "a", keep_last=1)
    paths = [write_checkpoint(runs / "a" / "checkpoints" / f"step_{s:08d}", s) for s in (100, 200)]
    a.checkpoint_saved(100, paths[0])
    assert a.checkpoint_saved(200, paths[1]).deleted == [paths[0]]
    assert not Path(paths[0]).exists() and Path(paths[1]).is_dir()
