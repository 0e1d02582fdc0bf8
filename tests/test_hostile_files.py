"""Hostile files and careless set-ups (issue 32): no run deletes another's checkpoints, no job uploads a secret, no
file can exhaust the machine. Each test builds the file or the set-up a user (or an attacker who can write one
input) could make, runs the real code on it, and checks the one-line refusal or the counted skip it gets.
README.md, "Reliability: hostile files and set-ups", lists them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from ray._private.runtime_env.packaging import create_package

from albert_core.checkpoint import save_model
from albert_core.config import AlbertConfig
from albert_core.model import AlbertForPreTraining
from services import cluster
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


# --- 2. no job uploads a secret ----------------------------------------------------------------------------------

SECRETS = (
    ".env", ".env.production", ".netrc", ".ray/auth_token", "albert-ray.token", "tls/server.pem", "tls/server.key",
    "id_rsa", "id_ed25519.pub", ".aws/credentials", "gcp-credentials.json", ".git-credentials", ".ssh/config",
    "configs/.env", "kube/kubeconfig",
)  # fmt: skip


def test_the_job_package_leaves_out_files_that_hold_secrets(tmp_path):
    work = tmp_path / "work"
    for name in (*SECRETS, "train.py", "configs/tiny.toml", "docs/keys.md"):
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text("x")
    env = cluster.build_runtime_env(work)
    package = tmp_path / "package.zip"  # what the Jobs client uploads, zipped by Ray's own packaging code
    create_package(str(work), package, include_gitignore=True, excludes=env["excludes"])
    with zipfile.ZipFile(package) as zipped:
        assert sorted(zipped.namelist()) == ["configs/tiny.toml", "docs/keys.md", "train.py"]


def private_token(path: Path, token: str = "s3cr3t") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(token)
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("how", ["--token-file", "RAY_AUTH_TOKEN_PATH"])
def test_submit_refuses_a_token_file_inside_the_uploaded_working_directory(tmp_path, how):
    work = tmp_path / "work"
    token = private_token(work / "secrets" / "albert-ray.token")
    options = {"token_file": token, "environ": {}} if how == "--token-file" else {"environ": {how: str(token)}}
    with pytest.raises(cluster.JobsError) as refused:  # before anything is packaged or sent
        cluster.submit("model", ["info"], address="http://127.0.0.1:9", working_dir=work, **options)
    assert str(refused.value) == (
        f"{how}: token file {token} lies inside the working directory {work} that is uploaded: keep it outside "
        "(e.g. ~/.ray/, mode 600) and point RAY_AUTH_TOKEN_PATH or --token-file at it"
    )


def test_a_token_file_outside_the_working_directory_goes_on_to_the_job_server(tmp_path):
    token = private_token(tmp_path / "home" / ".ray" / "albert.token")
    (tmp_path / "work").mkdir()
    with pytest.raises(cluster.JobsError, match="cannot reach the Ray job server at http://127.0.0.1:9"):
        cluster.submit("model", ["info"], address="http://127.0.0.1:9", working_dir=tmp_path / "work",
                       token_file=token, environ={})  # fmt: skip


# --- 9. the token file's permissions ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_token_file_others_can_read_or_write_is_refused_as_ssh_refuses_such_a_key(tmp_path, mode):
    token = private_token(tmp_path / "albert.token")
    token.chmod(mode)
    with pytest.raises(cluster.JobsError) as refused:
        cluster.resolve_token(environ={"RAY_AUTH_TOKEN_PATH": str(token)})
    assert str(refused.value) == (
        f"RAY_AUTH_TOKEN_PATH: token file {token} is accessible by others (mode {mode:o}): chmod 600 {token}"
    )
    token.chmod(0o600)
    assert cluster.resolve_token(environ={"RAY_AUTH_TOKEN_PATH": str(token)}) == "s3cr3t"
