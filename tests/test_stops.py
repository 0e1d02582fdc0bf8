"""Stops other than a signal to `albert pretrain` (tests/test_interrupt.py): `albert preprocess` ended by SIGTERM
keeps its finished units, releases its run lock and exits 143, and the rerun resumes; a node drained with a
preemption notice under a training run (opt-in: the simulated multi-node cluster of tests/test_faults.py) gets a
checkpoint at the notice step on every worker, and the restart resumes from it. Real Ray, real files."""

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

from albert_core.files import HeldLock
from albert_core.text.tokenization import TokenizerTrainConfig, train_tokenizer
from services.preprocess.layout import PROGRESS_DIR, Layout
from services.rundir.log import read_metrics
from services.train.callbacks import installed
from tests.ray_clusters import add_loopback_node, drain
from tests.runs import run_training
from tests.test_faults import FIXTURE, cluster, shards, wait_for, write_corpus  # noqa: F401 (fixtures)
from tests.test_resize import CLUSTER_SOAK_ENV
from tests.test_train import run_config
from tests.worker_callbacks import TraceExamples, read_trace

ALBERT = str(Path(sys.executable).with_name("albert"))


@pytest.mark.ray
def test_sigterm_to_preprocess_keeps_its_finished_units_releases_its_lock_and_the_rerun_resumes(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", n_files=40)
    texts = FIXTURE.read_text(encoding="utf-8").splitlines()
    tokenizer = train_tokenizer(texts, tmp_path / "tokenizer", TokenizerTrainConfig(vocab_size=300))
    out = tmp_path / "out"
    args = [ALBERT, "preprocess", "--input", str(corpus), "--tokenizer", str(tokenizer), "--output", str(out),
            "--max-seq-length", "48", "--shard-mb", "0.001", "--num-cpus", "1"]  # fmt: skip
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    log = (tmp_path / "stopped.log").open("w")
    job = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: list((out / PROGRESS_DIR).glob("shard-*.json")) or job.poll() is not None, 180, "a marker")
        job.send_signal(signal.SIGTERM)
        status = job.wait(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    console = (tmp_path / "stopped.log").read_text()
    markers = len(list((out / PROGRESS_DIR).glob("shard-*.json")))
    assert status == 143, console[-3000:]
    assert "terminated (SIGTERM)" in console and "Traceback" not in console, console[-3000:]
    assert not (out / "manifest.json").exists()  # stopped before it finished
    lock = HeldLock.try_acquire(Layout(out).run_lock)  # free at once: a rerun is not refused as "running"
    assert lock is not None
    lock.release()

    started = time.monotonic()
    rerun = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    timings = json.loads((out / "manifest.json").read_text())["timings"]
    print(f"\npreprocess SIGTERM: {markers} units kept, rerun {time.monotonic() - started:.1f}s, {timings}")
    assert timings["shards_resumed"] >= markers >= 1


def events(run_dir: Path, name: str) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r.get("event") == name]


@pytest.mark.skipif(
    os.environ.get(CLUSTER_SOAK_ENV) != "1",
    reason=f"a 1-2 minute multi-node run, kept out of the default suite's time budget: {CLUSTER_SOAK_ENV}=1 runs it",
)
@pytest.mark.ray
@pytest.mark.slow
def test_a_drained_node_gets_a_checkpoint_at_the_notice_step_and_the_restart_resumes_from_it(
    cluster,  # noqa: F811
    shards,  # noqa: F811
    tmp_path,
):
    """2 workers on the 3-node cluster; the node of one of them is drained with a 15 s deadline at step ~6 and
    removed at the deadline. train.max_failures = 0: the run survives only if the restart counts as a preemption."""
    config = run_config(tmp_path, shards, "drained", checkpoint_every=1000, preemption_check_every=2,
                        log_every=2, dropout_removal_step=0, startup_timeout_s=60)  # fmt: skip
    config.optim.total_steps = 120
    trace, deadline_s, seen = tmp_path / "trace", 15, {}

    def preempt() -> None:
        wait_for(lambda: trace.is_dir() and max((r["step"] for r in read_trace(trace)), default=0) >= 6, 240, "step 6")
        node = cluster.worker_node_hosting("RayTrainWorker")
        drain(cluster.address, node.node_id, deadline_s)
        seen.update(node=node.node_id, drained_at=time.time())
        time.sleep(deadline_s)
        cluster.cluster.remove_node(node)
        seen["removed_at_step"] = max(r["step"] for r in read_trace(trace))

    injector = threading.Thread(target=preempt, daemon=True)
    with installed(TraceExamples(trace)):
        injector.start()
        try:
            result = run_training(config, resume=False)
        finally:
            injector.join(timeout=120)
            add_loopback_node(cluster.cluster)
            cluster.cluster.wait_for_nodes()
    run_dir = config.run_dir
    notices, resumed = events(run_dir, "preemption_notice"), events(run_dir, "resumed")
    steps = [(r["rank"], r["step"]) for r in read_trace(trace)]
    redone = len(steps) - len(set(steps))
    print(f"\ndrain: {seen}\nnotices {notices}\nresumed {resumed}\nsteps redone {redone}")
    assert result.step == 120
    assert len(notices) == 1 and notices[0]["nodes"] == [seen["node"]]
    assert notices[0]["deadline"] == pytest.approx(seen["drained_at"] + deadline_s, abs=5)
    notice_step = notices[0]["step"]
    assert notice_step % 2 == 0 and notice_step == notices[0]["checkpoint_step"]
    saved = {e["step"] for e in events(run_dir, "checkpoint_saved")}
    assert notice_step in saved
    # the restart resumes from the last checkpoint saved while the notice stood (every check after it)
    assert len(resumed) == 1 and resumed[0]["step"] >= notice_step and resumed[0]["step"] in saved
    assert redone <= config.train.preemption_check_every * config.train.num_workers
