"""deploy.md's "Try it locally first" walkthrough, executed command for command as the page shows it.

It runs in a scratch copy of the repository's code, in which the sample shards `configs/tiny.toml` reads
(README's first command writes them; that takes minutes) are stand-ins made here: real Parquet shards of random
pieces with held-out documents. Everything else is the page's own commands: the loopback token-auth cluster of
scripts/local_cluster.sh, `albert submit` uploading the copy, Ray Train on the worker nodes, `albert status`.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.test_train import write_heldout, write_shards

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy.md"
CODE = ("albert_core", "services", "configs", "scripts", "pyproject.toml")
pytestmark = pytest.mark.ray


def walkthrough() -> str:
    section = DEPLOY.read_text().split("## Try it locally first", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sample_shards(directory: Path) -> None:
    write_heldout(write_shards(directory, (64, 64, 64, 64)), docs=12, sentence_length=8, seed=3)


@pytest.fixture(scope="module")
def scratch():
    root = Path(tempfile.mkdtemp(prefix="albert-walk-", dir="/tmp"))  # short: Ray's socket paths live under it
    work = root / "albert"
    for name in CODE:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, work / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, work / name)
    sample_shards(work / ".cache" / "albert" / "sample-shards-8000-128")
    venv = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "RAY_API"))}
    env.update(
        PATH=f"{venv}{os.pathsep}{env.get('PATH', '')}",
        ALBERT_VENV=str(venv.parent),
        ALBERT_CLUSTER_DIR=str(root / "cluster"),
        ALBERT_GCS_PORT=str(free_port()),
        ALBERT_DASHBOARD_PORT=str(free_port()),
        ALBERT_OBJECT_STORE_MB="256",
    )
    try:
        yield work, env
    finally:
        stop = ["bash", "scripts/local_cluster.sh", "stop"]
        subprocess.run(stop, cwd=work, env=env, capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def walked(scratch):
    work, env = scratch
    script = "set -e\n" + "".join(f"echo '+ {line}'\n{line}\n" for line in walkthrough().splitlines() if line)
    done = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=900)
    return work, env, done


def test_the_walkthrough_runs_as_written_and_trains_on_the_cluster(walked):
    work, _, done = walked
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]  # albert's own; stdout also carries the job's log
    assert "data.shards: .cache/albert/sample-shards-8000-128 -> " in console  # made absolute before the upload
    assert re.search(r"raysubmit_\w+ SUCCEEDED", console)
    run = work / "runs" / "trial"
    assert (run / "checkpoints").is_dir() and (run / "eval.md").is_file()
    assert '"run_name": "trial"' in console  # albert status, from the URL the page exports


def test_the_token_the_walkthrough_uses_stays_outside_the_uploaded_working_directory(walked):
    work, env, done = walked
    token = Path(env["ALBERT_CLUSTER_DIR"]) / "auth_token"  # what `local_cluster.sh env` exports
    assert f"RAY_AUTH_TOKEN_PATH={token}" in done.stdout + done.stderr
    assert not token.resolve().is_relative_to(work.resolve())
    assert token.stat().st_mode & 0o077 == 0  # albert submit refuses a token file others can read


def test_each_checkpoint_is_on_disk_once(walked):
    work, _, _ = walked
    run = work / "runs" / "trial"
    assert list((run / "checkpoints").glob("step_*/model.safetensors"))
    assert not list((run / "ray").rglob("*.safetensors"))


def test_submitting_a_finished_run_again_says_so_and_trains_nothing(walked):
    work, env, _ = walked
    again = subprocess.run(
        ["albert", "pretrain", "--config", "configs/tiny.toml", "--set", "run.name=trial", "--set",
         "train.max_seconds=10"],
        cwd=work, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "already finished at step" in again.stdout
    assert "Ray" not in again.stdout + again.stderr  # decided before Ray starts


def test_a_recipe_error_is_reported_before_anything_is_uploaded(walked):
    work, env, _ = walked  # the cluster is stopped by now: an upload would fail with "cannot reach"
    bad = subprocess.run(
        ["albert", "submit", "pretrain", "--config", "configs/tiny.toml", "--set", "optim.warmup_steps=5000"],
        cwd=work, env={**env, "RAY_ADDRESS": "http://127.0.0.1:9", "RAY_AUTH_MODE": "disabled"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 65  # bad config (services.terminal.EXIT_DATA)
    assert bad.stderr.startswith("albert: error: ") and "optim.warmup_steps" in bad.stderr
    assert "cannot reach" not in bad.stderr and "submitted" not in bad.stdout


def test_piping_albert_into_head_is_quiet():
    shown = subprocess.Popen(
        [str(Path(sys.executable).with_name("albert")), "model", "info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    shown.stdout.close()  # what `| head` does once it has its lines
    assert shown.stderr.read() == b""
    assert shown.wait(timeout=60) == 141
