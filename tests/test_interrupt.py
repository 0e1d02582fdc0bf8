"""Ctrl-C and resume, as a user at a terminal does them: `albert pretrain` in its own session, SIGINT sent to its
whole process group (what a terminal's Ctrl-C does), then the same command again.

The scenario that used to hang: a run stopped while an evaluation was pending, resumed with 2 training workers on
a 2-CPU machine and eval.cpus = 1. The relaunched evaluator took a CPU before the workers started, so they never
did, and Ctrl-C no longer stopped anything. Real Ray (embedded, started by the CLI), real training, real files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from albert_core.model.config import ConfigError
from services.eval.schedule import evaluator_slots
from tests.conftest import default_sigint
from tests.test_faults import shards  # noqa: F401  (the module fixture: 4 shard files and held-out documents)
from tests.test_train import MODEL, SEQ, run_config
from tests.worker_callbacks import callbacks_command

pytestmark = [pytest.mark.ray]

ALBERT = str(Path(sys.executable).with_name("albert"))


def write_recipe(path: Path, shards_dir: Path, runs: Path) -> Path:
    model = ", ".join(f"{k} = {v}" for k, v in MODEL.items())
    path.write_text(
        f"""
[run]
name = "ctrl-c"
output_dir = "{runs}"
seed = 7
[model]
preset = "albert-tiny"
overrides = {{ vocab_size = 0, {model} }}
[data]
shards = "{shards_dir}"
max_seq_length = {SEQ}
[optim]
lr = 0.01
warmup_steps = 2
total_steps = 5000
[train]
global_batch_size = 16
micro_batch_size = 4
num_workers = 2
log_every = 2
checkpoint_every = 4
keep_last = 3
[eval]
every_steps = 4
batch_size = 8
heldout_batches = 2
cpus = 1
"""
    )
    return path


class Terminal:
    """`albert pretrain` as a terminal runs it: its own session, Ctrl-C to the whole process group."""

    def __init__(self, recipe: Path, run_dir: Path, *extra: str, trace: Path | None = None):
        """`trace`: the workers trace the example ids of each step there (tests/worker_callbacks.py)."""
        self.run_dir = run_dir
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.log = (run_dir.parent / f"console-{time.time_ns()}.log").open("w")
        args = ["pretrain", "--config", str(recipe), "--no-progress", *extra]
        args = callbacks_command(args, trace=trace) if trace else [ALBERT, *args]
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        env.pop("RAY_ADDRESS", None)
        self.process = subprocess.Popen(
            args, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=default_sigint
        )

    def ctrl_c(self) -> None:
        os.killpg(self.process.pid, signal.SIGINT)

    def terminate(self) -> None:
        """SIGTERM to the driver alone, as `kill PID`, Ray's job supervisor or a container runtime sends it."""
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise AssertionError(
                f"albert pretrain did not exit within {timeout} s:\n{self.console()[-3000:]}"
            ) from None

    def console(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def wait_for_step_past(self, step: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"albert pretrain exited {self.process.returncode}:\n{self.console()[-3000:]}")
            newest = max(checkpoint_steps(self.run_dir), default=0)
            if newest > step:
                return newest
            time.sleep(0.2)
        self.process.kill()
        raise AssertionError(f"no checkpoint past step {step} within {timeout} s:\n{self.console()[-3000:]}")


def checkpoint_steps(run_dir: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*")]


def events(run_dir: Path, name: str) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line.get("event") == name]


def test_ctrl_c_checkpoints_and_stops_and_a_resume_with_a_pending_evaluation_trains_on(tmp_path, shards):  # noqa: F811
    recipe = write_recipe(tmp_path / "recipe.toml", shards, tmp_path / "runs")
    run_dir = tmp_path / "runs" / "ctrl-c"

    first = Terminal(recipe, run_dir)
    first.wait_for_step_past(8, timeout=240)
    first.ctrl_c()
    assert first.wait(timeout=90) == 130
    stopped = events(run_dir, "stopped")
    assert len(stopped) == 1 and stopped[0]["checkpoint_step"] == max(checkpoint_steps(run_dir))
    assert f"stopped at step {stopped[0]['step']}" in first.console()
    assert "Traceback" not in first.console()

    # The resumed run: evaluations were left pending; its 2 workers must get the 2 CPUs all the same.
    second = Terminal(recipe, run_dir)
    second.wait_for_step_past(stopped[0]["step"] + 4, timeout=240)
    resumed = events(run_dir, "resumed")
    assert [(e["step"], e["workers"]) for e in resumed] == [(stopped[0]["step"], 2)]
    second.ctrl_c()
    time.sleep(0.5)
    second.ctrl_c()  # the second Ctrl-C: at once
    assert second.wait(timeout=60) == 130
    assert "stopped at once" in second.console()
    # Resuming on another worker count (the issue's `train.num_workers=1` traceback): tests/test_resize.py.


def traced_steps(trace: Path) -> list[tuple[int, int]]:
    """(rank, step) of every step a worker started (TraceExamples), a step redone after a stop again."""
    lines = [json.loads(line) for path in sorted(trace.glob("rank*.jsonl")) for line in path.read_text().splitlines()]
    return [(line["rank"], line["step"]) for line in lines]


@pytest.mark.parametrize("target", ["driver", "worker"])
def test_sigterm_checkpoints_at_the_stop_step_exits_143_and_the_resume_redoes_no_step(target, tmp_path, shards):  # noqa: F811
    """`kill PID` of a local `albert pretrain` at step ~20, or of one of its Ray Train worker processes: the run
    saves a checkpoint at its next step, exits 143, and the same command resumes from that very step: no step is
    trained twice."""
    recipe = write_recipe(tmp_path / "recipe.toml", shards, tmp_path / "runs")
    run_dir, trace = tmp_path / "runs" / "ctrl-c", tmp_path / "trace"
    first = Terminal(recipe, run_dir, trace=trace)
    first.wait_for_step_past(16, timeout=240)
    if target == "driver":
        first.terminate()
    else:  # rank 1's process (its trace lines name it)
        pid = next(json.loads(line)["pid"] for line in (trace / "rank1.jsonl").read_text().splitlines())
        os.kill(pid, signal.SIGTERM)
    assert first.wait(timeout=60) == 143, first.console()[-3000:]
    asked, stopped = events(run_dir, "stop_requested"), events(run_dir, "stopped")
    where = "the driver" if target == "driver" else f"worker rank 1 (pid {pid}"
    assert [e["signal"] for e in asked] == ["SIGTERM"] and f"SIGTERM on {where}" in asked[0]["reason"]
    assert len(stopped) == 1 and stopped[0]["signal"] == "SIGTERM"
    stop_step = stopped[0]["step"]
    assert stopped[0]["checkpoint_step"] == stop_step == max(checkpoint_steps(run_dir))
    assert f"stopped at step {stop_step}" in first.console() and "Traceback" not in first.console()
    if target == "worker":  # the resume after a stop is the same as the driver's
        return

    second = Terminal(recipe, run_dir, trace=trace)
    second.wait_for_step_past(stop_step + 2, timeout=240)
    second.terminate()
    assert second.wait(timeout=60) == 143, second.console()[-3000:]
    assert [e["step"] for e in events(run_dir, "resumed")] == [stop_step]
    steps = traced_steps(trace)
    redone = len(steps) - len(set(steps))
    print(f"\nSIGTERM at step {stop_step}: steps redone by the resume {redone}")
    assert redone == 0, sorted(s for s in steps if steps.count(s) > 1)
    assert {step for _, step in steps} >= set(range(1, stop_step + 3))


def test_a_sigterm_whose_graceful_stop_does_not_end_within_its_grace_stops_at_once_with_143():
    """run_interruptibly on the main thread: SIGTERM calls the graceful stop with the signal's name; a call that
    does not end within grace_s is abandoned (StoppedAtOnce, exit 143); one that ends in time returns its value."""
    from services.train.interrupt import StoppedAtOnce, run_interruptibly

    before = signal.getsignal(signal.SIGTERM)
    asked: list[str] = []
    ended = threading.Event()

    def stops_when_asked() -> str:
        os.kill(os.getpid(), signal.SIGTERM)
        ended.wait(10)
        return "checkpointed"

    def graceful(name: str) -> None:
        asked.append(name)
        ended.set()

    assert run_interruptibly(stops_when_asked, graceful_stop=graceful, what="run t", grace_s=5) == "checkpointed"
    assert asked == ["SIGTERM"]

    def never_ends() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)

    started = time.monotonic()
    with pytest.raises(StoppedAtOnce, match="did not end within 0.5 s of SIGTERM") as stop:
        run_interruptibly(never_ends, graceful_stop=asked.append, what="run t", grace_s=0.5)
    assert stop.value.exit_status == 143 and asked == ["SIGTERM", "SIGTERM"]
    assert time.monotonic() - started < 5
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back


def test_workers_ray_cannot_place_fail_within_the_startup_timeout_naming_what_is_missing(
    ray_local,
    tmp_path,
    shards,  # noqa: F811
):
    from tests.runs import run_training

    config = run_config(tmp_path, shards, "too-many-workers", num_workers=3, global_batch_size=12, startup_timeout_s=5)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"could not place 3 workers .* the cluster has CPU 2"):
        run_training(config)
    assert time.monotonic() - started < 90


@pytest.mark.parametrize(
    ("eval_cpus", "training", "cluster", "expected"),
    [
        (1, 2, 2, (0.0, 1)),  # no spare CPU: one evaluator at a time, on none
        (1, 1, 2, (1, 1)),
        (1, 2, 8, (1, 6)),
        (2, 4, 7, (2, 1)),
        (0, 1, 8, (0.0, 1)),  # eval.cpus = 0: beside training, one at a time
        (4, 4, 6, (0.0, 1)),  # spare 2 < 4
    ],
)
def test_evaluators_hold_only_cpus_beyond_the_training_workers(eval_cpus, training, cluster, expected):
    assert evaluator_slots(eval_cpus, training_cpus=training, cluster_cpus=cluster) == expected
