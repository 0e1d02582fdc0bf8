"""Stops other than pretraining's (tests/test_interrupt.py): `albert preprocess` ended by SIGTERM keeps its
finished units, releases its run lock and exits 143; the rerun resumes. Real Ray (embedded), real files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from albert_core.files import HeldLock
from albert_core.tokenization import TokenizerTrainConfig, train_tokenizer
from services.preprocess.layout import PROGRESS_DIR, Layout
from tests.test_faults import FIXTURE, wait_for, write_corpus

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
