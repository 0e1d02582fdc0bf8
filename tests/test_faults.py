"""Reliability under failure, on a real multi-node Ray cluster simulated on this machine.

The cluster (`ray.cluster_utils.Cluster`) is a head node and two worker nodes of 1 CPU each, real raylets and
object stores. Training runs 2 workers of 1 CPU, so one CPU is spare: it hosts evaluators, or takes over when a
node goes. The faults are real:

- SIGKILL of a training worker process, at a random step (its pid comes from the example trace,
  tests/worker_callbacks.py), three times in one run: Ray Train restarts the worker group (`train.max_failures`);
- removal of a worker node that hosts a training worker (its raylet and every process on it are killed);
- SIGKILL of the run's coordinator actor and of an evaluator actor (pids from the GCS actor table);
- SIGKILL of an `albert preprocess` job after its first shard is committed;
- checkpoints damaged on disk (truncated, bit-flipped, a file missing) before a resume; a disk that fills up
  during a save (a small tmpfs, root only) or a file-size limit (RLIMIT_FSIZE, any user).

Every faulty run is compared with one uninterrupted run of the same seed: the final weights are bitwise equal on
CPU, and each step trained on the same example ids (the trace's last attempt of every (rank, step)). The steps to
kill at are drawn at random: ALBERT_FAULT_SEED replays a draw (failure messages print it).

Time: the training scenarios (marked slow: five TorchTrainer runs, four worker-group restarts) take most of the
module's minutes; the preprocess and disk-full tests take about 30 s (`-m "not slow"`).

The session's `ray_local` and this cluster cannot be up together: one Python process holds one Ray connection, and
the driver here must be connected to the cluster to reach its nodes and actor table. So the module fixture shuts
the local instance down when it is up, and starts it again afterwards, as tests/conftest.py does, for the modules
that follow. (A subprocess per scenario would keep both, but could not reach the cluster's nodes from the test.)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from albert_core.examples.shards import HELDOUT_FILE, HELDOUT_SCHEMA, example_id
from albert_core.files import DiskFull
from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import AlbertForPreTraining
from albert_core.optim import make_optimizer, make_scheduler
from albert_core.text.tokenization import TokenizerTrainConfig, train_tokenizer
from services.cluster import connect, coordinator_name
from services.preprocess.config import PreprocessConfig
from services.preprocess.layout import PROGRESS_DIR
from services.preprocess.pipeline import run_preprocess
from services.rundir.checkpoints import latest_good, list_checkpoints, verify
from services.rundir.log import read_metrics
from services.rundir.status import read_status
from services.train.callbacks import installed
from services.train.coordinator import get_or_create_coordinator
from services.train.state import TrainerState, save_train_state
from tests.ray_clusters import (
    add_loopback_node,
    descendants,
    listening_addresses,
    live_actors,
    loopback_cluster,
    on_loopback,
)
from tests.runs import run_training
from tests.test_train import MODEL, VOCAB, run_config, write_shards
from tests.tmpfs import small_tmpfs as tmpfs
from tests.worker_callbacks import HoldAfterStep, TraceExamples, read_trace

pytestmark = [pytest.mark.ray]

FILE_ROWS = (40, 40, 40, 44)  # 2 workers x 8 rows per step: 10 steps per epoch, so step 10 starts epoch 1
TOTAL_STEPS = 16
CHECKPOINT_EVERY = 3  # checkpoints at 3, 6, 9, 12, 15 and 16
POLL_S = 0.01
SEED = int(os.environ.get("ALBERT_FAULT_SEED", time.time_ns() % 2**31))
FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer_corpus.txt"


# --------------------------------------------------------------------------------------------------
# the cluster


@dataclass
class FaultCluster:
    cluster: Any  # ray.cluster_utils.Cluster
    rng: random.Random

    @property
    def address(self) -> str:
        return self.cluster.address

    def worker_node_hosting(self, class_name: str):
        """A worker node (never the head, where the driver and the Train controller live) with a live actor."""
        on = {a["Address"]["NodeID"] for a in live_actors(class_name)}
        return next(node for node in sorted(self.cluster.worker_nodes, key=lambda n: n.node_id) if node.node_id in on)


@pytest.fixture(scope="module")
def cluster():
    import ray

    restore_local = ray.is_initialized()
    if restore_local:
        ray.shutdown()
    c = loopback_cluster(2)
    try:
        yield FaultCluster(c, random.Random(SEED))
    finally:
        ray.shutdown()
        c.shutdown()
        if restore_local:
            connect(num_cpus=2)  # tests/conftest.py's ray_local


def test_every_node_of_the_cluster_is_on_loopback_and_listens_nowhere_else(cluster):
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 3 and {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}
    listening = listening_addresses(descendants(os.getpid()))  # the nodes' processes are this process's children
    assert len({pid for pid in listening.values()}) >= 3, "the reader sees the nodes' servers"
    assert sorted(address for address in listening if not on_loopback(address[0])) == []


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout:.0f}s waiting for {what} (ALBERT_FAULT_SEED={SEED})")
        time.sleep(0.05)


# --------------------------------------------------------------------------------------------------
# data and runs


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = write_shards(tmp_path_factory.mktemp("shards"), FILE_ROWS)
    rng = np.random.default_rng(1)
    docs = []
    for doc in range(12):
        lengths = rng.integers(4, 9, size=4)
        docs.append(
            {
                "doc_id": doc,
                "sentences": [rng.integers(5, VOCAB, n).tolist() for n in lengths],
                "word_starts": [[True] * int(n) for n in lengths],
            }
        )
    (root / HELDOUT_FILE).parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(docs, schema=HELDOUT_SCHEMA), root / HELDOUT_FILE)
    return root


def faults_config(root: Path, shards: Path, name: str, **eval_section):
    config = run_config(
        root,
        shards,
        name,
        checkpoint_every=CHECKPOINT_EVERY,
        keep_last=10,
        dropout_removal_step=8,
        max_failures=4,
    )
    config.optim.total_steps = TOTAL_STEPS
    config.eval.batch_size, config.eval.heldout_batches = 8, 2
    for key, value in eval_section.items():
        setattr(config.eval, key, value)
    config.validate()
    return config


def consumed(trace: list[dict[str, Any]]) -> dict[tuple[int, int], list[int]]:
    """(rank, step) -> example ids of the attempt that counts: the last one (a redone step is traced again)."""
    return {(r["rank"], r["step"]): r["example_ids"] for r in trace}


def weights(result) -> dict[str, torch.Tensor]:
    """The final weights, copied: load_file's tensors can share pages with the file, which a test then damages."""
    return {name: tensor.clone() for name, tensor in load_file(result.checkpoint / "model.safetensors").items()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differ, f"tensors differ from the uninterrupted run: {differ[:5]} (ALBERT_FAULT_SEED={SEED})"


# Faults are injected from a thread that follows the trace while the driver is inside launch(plan).
Action = Callable[[list[dict[str, Any]]], dict[str, Any]]


@dataclass
class Fault:
    at_step: int  # injected once a live worker has started this step (or a later one)
    action: Action  # gets the trace lines of the live attempt; returns what it did
    restarts_workers: bool  # the next fault waits for the new worker processes


@dataclass(eq=False)  # a Thread must stay hashable
class Injector(threading.Thread):
    trace_dir: Path
    faults: list[Fault]
    injected: list[dict[str, Any]] = field(default_factory=list)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        super().__init__(daemon=True)
        self.stopped = threading.Event()

    def run(self) -> None:
        stale: set[int] = set()
        try:
            for fault in self.faults:
                while True:
                    live = [r for r in read_trace(self.trace_dir) if r["pid"] not in stale]
                    if live and max(r["step"] for r in live) >= fault.at_step:
                        break
                    if self.stopped.wait(POLL_S):
                        return
                started = time.time()
                done = fault.action(live)
                pids = sorted({r["pid"] for r in live})
                self.injected.append({"at_step": fault.at_step, "time": started, "pids": pids, **done})
                if fault.restarts_workers:
                    stale |= {r["pid"] for r in live}
        except BaseException as err:  # surfaced by the test
            self.error = err

    def __enter__(self) -> Injector:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.join(timeout=60)


def recoveries(trace: list[dict[str, Any]], injected: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each worker-restarting fault: the last step its worker group started (`step`, by any rank), the step
    training resumed from (the restarted group's first step - 1), the steps redone (started again, up to the last
    step *every* rank of the group started), and seconds from the fault to the first step of the restarted group.

    No barrier holds the ranks together between steps (a step's all-reduce does, inside it): while rank 0 writes a
    checkpoint the other ranks may start the next step, so a kill during that write leaves one rank a step ahead,
    in a step no rank finished. That step is redone too (`step`), but counts in no checkpoint interval."""
    out = []
    for fault in injected:
        group = [r for r in trace if r["pid"] in fault["pids"]]
        reached = max(r["step"] for r in group)
        every_rank = min(max(r["step"] for r in group if r["rank"] == rank) for rank in {r["rank"] for r in group})
        before = {r["pid"] for r in trace if r["time"] <= fault["time"]}
        first = next(r for r in trace if r["time"] > fault["time"] and r["pid"] not in before)
        out.append(
            {
                "step": reached,
                "resumed_from": first["step"] - 1,
                "steps_redone": every_rank - (first["step"] - 1),
                "seconds": first["time"] - fault["time"],
            }
        )
    return out


def kill_a_worker(rng: random.Random) -> Action:
    def action(live: list[dict[str, Any]]) -> dict[str, Any]:
        newest = {}
        for r in live:
            newest[r["rank"]] = r
        victim = newest[rng.choice(sorted(newest))]
        os.kill(victim["pid"], signal.SIGKILL)
        return {"kind": "worker_killed", "rank": victim["rank"], "pid": victim["pid"]}

    return action


def train_traced(config, trace_dir: Path, faults: list[Fault] = (), callbacks=(), **kwargs):
    """run_training with the example trace (and `callbacks`) on, injecting `faults`; returns (result, trace,
    injected)."""
    with installed(TraceExamples(trace_dir), *callbacks), Injector(trace_dir, list(faults)) as injector:
        result = run_training(config, **kwargs)
    if injector.error is not None:
        raise injector.error
    return result, read_trace(trace_dir), injector.injected


# --------------------------------------------------------------------------------------------------
# the runs (module fixtures: each runs once, the tests below read it)


@pytest.fixture(scope="module")
def uninterrupted(cluster, shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    config = faults_config(root, shards, "uninterrupted")
    result, trace, _ = train_traced(config, root / "trace", resume=False)
    return result, trace


@pytest.fixture(scope="module")
def worker_kills(cluster, shards, tmp_path_factory):
    """Three SIGKILLs of a random worker at random steps, one in each third of the run."""
    root = tmp_path_factory.mktemp("kills")
    config = faults_config(root, shards, "kills")
    rng = cluster.rng
    steps = [rng.randint(2, 4), rng.randint(6, 8), rng.randint(10, 12)]
    faults = [Fault(step, kill_a_worker(rng), restarts_workers=True) for step in steps]
    started = time.monotonic()
    result, trace, injected = train_traced(config, root / "trace", faults, resume=False)
    return result, trace, injected, time.monotonic() - started


@pytest.fixture(scope="module")
def node_removed(cluster, shards, tmp_path_factory):
    """A worker node that hosts a training worker is removed mid-run; a spare node is added back afterwards."""
    root = tmp_path_factory.mktemp("node")
    config = faults_config(root, shards, "node")

    def remove_node(live):
        node = cluster.worker_node_hosting("RayTrainWorker")
        cluster.cluster.remove_node(node)
        return {"kind": "node_removed", "node_id": node.node_id}

    fault = Fault(cluster.rng.randint(3, 8), remove_node, restarts_workers=True)
    try:
        result, trace, injected = train_traced(config, root / "trace", [fault], resume=False)
    finally:
        add_loopback_node(cluster.cluster)
        cluster.cluster.wait_for_nodes()
    return result, trace, injected


@pytest.fixture(scope="module")
def coordinated(cluster, shards, tmp_path_factory):
    """A run with its coordinator; the coordinator is SIGKILLed at a random early step, then the evaluator of the
    step-6 checkpoint while training goes on (held after step 6 until the evaluator is killed: a step of this tiny
    model is shorter than an evaluator's start). Evaluations at steps 6, 12 and 16 (the last checkpoint)."""
    import ray

    root = tmp_path_factory.mktemp("coordinated")
    config = faults_config(root, shards, f"coordinated-{SEED}", every_steps=6)
    name = coordinator_name(config.run.name)
    coordinator = get_or_create_coordinator(config.run_dir, config.run.name, config.to_dict())
    ray.get(coordinator.status.remote())

    def kill_coordinator(live):
        (actor,) = [a for a in live_actors("Coordinator") if a["Name"] == name]
        os.kill(actor["Pid"], signal.SIGKILL)
        return {"kind": "coordinator_killed", "pid": actor["Pid"]}

    def kill_evaluator(live):  # as soon as its process exists: it evaluates this tiny model in a blink
        actor = wait_for(lambda: live_actors("IntrinsicEvaluator", starting=True), 120, "an evaluator to start")[0]
        os.kill(actor["Pid"], signal.SIGKILL)
        steps = [r["step"] for r in read_trace(root / "trace")]
        (root / "evaluator-killed").touch()  # HoldAfterStep lets training go on
        return {"kind": "evaluator_killed", "name": actor["Name"], "training_step": max(steps)}

    faults = [
        Fault(cluster.rng.randint(2, 4), kill_coordinator, restarts_workers=False),
        Fault(6, kill_evaluator, restarts_workers=False),
    ]
    hold = HoldAfterStep(6, root / "evaluator-killed")
    result, trace, injected = train_traced(config, root / "trace", faults, [hold], resume=False, coordinator=name)
    counts = ray.get(coordinator.wait_for_evals.remote(timeout=300), timeout=330)
    yield config, coordinator, result, trace, injected, counts
    ray.kill(coordinator, no_restart=True)


@pytest.fixture(scope="module")
def damaged_then_resumed(coordinated):
    """The coordinated run's last three checkpoints damaged on disk, then the run resumed (same coordinator)."""
    import ray

    config, coordinator, finished, _, _, _ = coordinated
    kept = {step: path.resolve() for step, path in list_checkpoints(config.run_dir / "checkpoints")}
    assert sorted(kept) == [3, 6, 9, 12, 15, 16]
    before = weights(finished)
    damage = {
        16: ("model.safetensors", "truncated"),
        15: ("optimizer.safetensors", "checksum mismatch"),
        12: ("trainer.json", "missing"),
    }
    for step, (name, _) in damage.items():
        path = kept[step] / name
        if step == 16:
            path.write_bytes(path.read_bytes()[:-100])
        elif step == 15:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x10
            path.write_bytes(bytes(data))
        else:
            path.unlink()
    trace_dir = config.run_dir.parent / "trace-resumed"
    result, trace, _ = train_traced(config, trace_dir, resume=True, coordinator=coordinator_name(config.run.name))
    ray.get(coordinator.wait_for_evals.remote(timeout=300), timeout=330)
    return config, damage, kept, before, result, trace


# --------------------------------------------------------------------------------------------------
# a training worker killed three times


@pytest.mark.slow
def test_three_worker_kills_were_injected_at_distinct_steps(worker_kills):
    _, _, injected, _ = worker_kills
    assert [f["kind"] for f in injected] == ["worker_killed"] * 3, f"ALBERT_FAULT_SEED={SEED}: {injected}"
    assert len({f["pid"] for f in injected}) == 3


@pytest.mark.slow
def test_the_run_survives_three_worker_kills_and_ends_with_the_uninterrupted_weights(worker_kills, uninterrupted):
    result, _, injected, seconds = worker_kills
    assert result.step == TOTAL_STEPS
    assert_same_weights(weights(result), weights(uninterrupted[0]))
    print(f"\nworker kills after steps {[f['at_step'] for f in injected]}: run took {seconds:.1f}s")


@pytest.mark.slow
def test_after_worker_kills_every_step_trained_on_the_uninterrupted_examples(worker_kills, uninterrupted):
    _, trace, _, _ = worker_kills
    assert consumed(trace) == consumed(uninterrupted[1])


@pytest.mark.slow
def test_a_step_redone_after_a_kill_read_the_same_examples_as_its_first_attempt(worker_kills):
    _, trace, injected, _ = worker_kills
    first: dict[tuple[int, int], list[int]] = {}
    redone = set()
    for r in trace:
        key = (r["rank"], r["step"])
        if key in first:
            redone.add(r["step"])
            assert r["example_ids"] == first[key], f"rank {r['rank']} step {r['step']} read other examples"
        first.setdefault(key, r["example_ids"])
    expected = {s for f in recoveries(trace, injected) for s in range(f["resumed_from"] + 1, f["step"] + 1)}
    assert redone == expected


@pytest.mark.slow
def test_each_kill_resumes_from_the_last_checkpoint_before_it_and_loses_at_most_its_interval(worker_kills):
    _, trace, injected, _ = worker_kills
    for recovery in recoveries(trace, injected):
        assert recovery["resumed_from"] % CHECKPOINT_EVERY == 0, recovery
        assert 0 <= recovery["steps_redone"] <= CHECKPOINT_EVERY, f"ALBERT_FAULT_SEED={SEED}: {recovery}"
        print(f"\nkill at step {recovery['step']}: resumed from {recovery['resumed_from']}, {recovery['seconds']:.1f}s")


@pytest.mark.slow
def test_the_metrics_log_has_each_step_once_with_the_uninterrupted_losses(worker_kills, uninterrupted):
    def losses(result):
        trained = [r for r in read_metrics(result.metrics_file) if r["kind"] == "train"]
        return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in trained]

    assert losses(worker_kills[0]) == losses(uninterrupted[0])


# --------------------------------------------------------------------------------------------------
# a node removed


@pytest.mark.slow
def test_removing_a_node_that_hosts_a_worker_restarts_training_on_the_remaining_nodes(node_removed):
    result, trace, injected = node_removed
    (fault,) = injected
    assert fault["kind"] == "node_removed"
    (recovery,) = recoveries(trace, injected)
    assert result.step == TOTAL_STEPS
    assert 0 <= recovery["steps_redone"] <= CHECKPOINT_EVERY, f"ALBERT_FAULT_SEED={SEED}: {recovery}"
    print(f"\nnode removed after step {recovery['step']}: resumed from {recovery['resumed_from']}")


@pytest.mark.slow
def test_after_a_node_removal_the_global_batch_and_the_weights_are_those_of_the_uninterrupted_run(
    node_removed, uninterrupted
):
    result, trace, _ = node_removed
    state = json.loads((result.checkpoint / "trainer.json").read_text())["state"]
    assert (state["world_size"], state["micro_batch_size"]) == (2, 4)
    assert consumed(trace) == consumed(uninterrupted[1])
    assert_same_weights(weights(result), weights(uninterrupted[0]))


# --------------------------------------------------------------------------------------------------
# the coordinator and an evaluator killed


@pytest.mark.slow
def test_a_killed_coordinator_restarts_and_the_run_completes_with_the_uninterrupted_weights(coordinated, uninterrupted):
    _, _, result, trace, injected, _ = coordinated
    assert [f["kind"] for f in injected] == ["coordinator_killed", "evaluator_killed"]
    assert result.step == TOTAL_STEPS
    assert consumed(trace) == consumed(uninterrupted[1])
    assert_same_weights(weights(result), weights(uninterrupted[0]))


@pytest.mark.slow
def test_after_the_coordinator_restart_the_metrics_log_has_every_step_once(coordinated):
    config, _, _, _, _, _ = coordinated
    records = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, TOTAL_STEPS + 1))


@pytest.mark.slow
def test_after_the_coordinator_restart_its_index_holds_every_checkpoint_on_disk(coordinated):
    config, coordinator, _, _, _, _ = coordinated
    import ray

    status = ray.get(coordinator.status.remote())
    on_disk = [step for step, _ in reversed(list_checkpoints(config.run_dir / "checkpoints"))]
    assert [c["step"] for c in status["checkpoints"]] == on_disk == [3, 6, 9, 12, 15, 16]
    assert status["step"] == TOTAL_STEPS
    assert read_status(config.run_dir)["checkpoints"] == status["checkpoints"]  # ledger.json agrees


@pytest.mark.slow
def test_a_killed_evaluator_is_retried_and_every_scheduled_evaluation_finishes(coordinated):
    config, _, _, _, injected, counts = coordinated
    assert counts == {"pending": 0, "done": 3, "failed": 0, "missing": 0}
    records = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    retried = [r for r in records if r.get("event") == "eval_retried"]
    assert [r["step"] for r in retried] == [6], f"evaluator killed: {injected[1]}"
    assert sorted(r["step"] for r in records if r["kind"] == "eval") == [6, 12, 16]


@pytest.mark.slow
def test_the_evaluator_was_killed_while_training_was_still_running(coordinated):
    _, _, _, _, injected, _ = coordinated
    assert injected[1]["training_step"] < TOTAL_STEPS, injected[1]


# --------------------------------------------------------------------------------------------------
# damaged checkpoints on resume (end to end, through the coordinator)


@pytest.mark.slow
def test_resume_skips_damaged_checkpoints_with_an_event_naming_the_file_and_the_damage(damaged_then_resumed):
    config, damage, kept, _, _, _ = damaged_then_resumed
    records = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    corrupt = {r["step"]: r["reason"] for r in records if r.get("event") == "checkpoint_corrupt"}
    assert sorted(corrupt) == sorted(damage)
    for step, (name, kind) in damage.items():
        assert str(kept[step] / name) in corrupt[step] and kind in corrupt[step], corrupt[step]


@pytest.mark.slow
def test_resume_continues_from_the_newest_good_checkpoint_and_redoes_the_steps_after_it(damaged_then_resumed):
    _, _, _, _, result, trace = damaged_then_resumed
    assert sorted({r["step"] for r in trace}) == list(range(10, TOTAL_STEPS + 1))  # from step 9, the newest good
    assert result.step == TOTAL_STEPS
    for _, path in list_checkpoints(result.checkpoint.parent):
        verify(path)  # the damaged ones were rewritten whole


@pytest.mark.slow
def test_resume_past_damaged_checkpoints_ends_with_the_same_weights(damaged_then_resumed, uninterrupted):
    _, _, _, before, result, trace = damaged_then_resumed
    assert_same_weights(weights(result), before)
    reference = consumed(uninterrupted[1])
    assert consumed(trace) == {key: ids for key, ids in reference.items() if key[1] >= 10}


# --------------------------------------------------------------------------------------------------
# a preprocess job killed after its first shard


def write_corpus(root: Path, n_files: int = 24) -> Path:
    texts = FIXTURE.read_text(encoding="utf-8").splitlines()
    root.mkdir(parents=True)
    for i in range(n_files):
        body = " ".join(texts[(7 * i + j) % len(texts)] for j in range(12))
        (root / f"doc_{i:03d}.txt").write_text(
            body + "\n\n" + " ".join(texts[(3 * i + j) % len(texts)] for j in range(9))
        )
    return root


@pytest.fixture(scope="module")
def preprocess_killed(cluster, tmp_path_factory):
    """`albert preprocess` (a job on the cluster) SIGKILLed once its first shard marker appears, then rerun."""
    import ray

    root = tmp_path_factory.mktemp("preprocess")
    corpus = write_corpus(root / "corpus")
    texts = FIXTURE.read_text(encoding="utf-8").splitlines()
    tokenizer = train_tokenizer(texts, root / "tokenizer", TokenizerTrainConfig(vocab_size=300))
    out = root / "out"
    args = [
        str(Path(sys.executable).with_name("albert")),
        "preprocess",
        "--input",
        str(corpus),
        "--tokenizer",
        str(tokenizer),
        "--output",
        str(out),
        "--max-seq-length",
        "48",
        "--shard-mb",
        "0.001",  # a shard per input file
        "--heldout-fraction",
        "0.1",
    ]
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    log = (root / "killed.log").open("w")
    job = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: list((out / PROGRESS_DIR).glob("shard-*.json")) or job.poll() is not None, 180, "a marker")
        os.kill(job.pid, signal.SIGKILL)
    finally:
        job.wait(timeout=60)
    markers_at_kill = len(list((out / PROGRESS_DIR).glob("shard-*.json")))
    killed_with = job.returncode
    wait_for(  # the job's tasks go with its driver
        lambda: all(j["IsDead"] for j in ray._private.state.jobs() if j["DriverPid"] == job.pid), 60, "job death"
    )
    rerun = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    clean = run_preprocess(
        PreprocessConfig(
            inputs=[str(corpus)],
            tokenizer=str(tokenizer),
            output=str(root / "clean"),
            max_seq_length=48,
            shard_input_bytes=int(0.001 * (1 << 20)),
            heldout_fraction=0.1,
            progress=False,
        )
    )
    return out, manifest, clean, markers_at_kill, killed_with


def test_the_preprocess_job_was_killed_with_shards_left_to_do(preprocess_killed):
    _, manifest, _, markers_at_kill, killed_with = preprocess_killed
    assert killed_with == -signal.SIGKILL
    assert 1 <= markers_at_kill < len(manifest["shards"])


def test_the_rerun_keeps_the_committed_shards_and_writes_only_the_others(preprocess_killed):
    _, manifest, _, markers_at_kill, _ = preprocess_killed
    timings = manifest["timings"]
    assert timings["shards_resumed"] >= markers_at_kill
    assert timings["shards_resumed"] + timings["shards_written"] == len(manifest["shards"])


def test_the_resumed_output_has_every_shard_once_and_every_example_id_once(preprocess_killed):
    out, manifest, _, _, _ = preprocess_killed
    names = [s["name"] for s in manifest["shards"]]
    assert names == [f"train/shard-{i:05d}.parquet" for i in range(len(names))]  # no gap
    assert sorted(p.name for p in (out / "train").iterdir()) == [n.split("/")[1] for n in names]  # no stray file
    for index, shard in enumerate(manifest["shards"]):
        ids = pq.read_table(out / shard["name"], columns=["example_id"])["example_id"].to_pylist()
        assert ids == [example_id(index, row) for row in range(shard["rows"])], shard["name"]
    assert sum(s["rows"] for s in manifest["shards"]) == manifest["examples"]
    docs = manifest["documents"]
    assert docs["read"] == docs["used"] + docs["heldout"] + docs["skipped"] == 24


def test_the_resumed_output_equals_an_uninterrupted_preprocess_byte_for_byte(preprocess_killed):
    _, manifest, clean, _, _ = preprocess_killed
    assert [s["sha256"] for s in manifest["shards"]] == [s["sha256"] for s in clean["shards"]]
    assert manifest["heldout"]["sha256"] == clean["heldout"]["sha256"]
    assert manifest["examples"] == clean["examples"] > 0


# --------------------------------------------------------------------------------------------------
# a save that runs out of space (no cluster)


def tiny_training_state():
    torch.manual_seed(0)
    model = AlbertForPreTraining(AlbertConfig.preset("albert-tiny", vocab_size=VOCAB, **MODEL))
    optimizer = make_optimizer(model, lr=0.01)
    scheduler = make_scheduler(optimizer, warmup_steps=0, total_steps=10)
    ids = torch.randint(5, VOCAB, (2, 12))
    out = model(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        token_type_ids=torch.zeros_like(ids),
        mlm_labels=ids,
        pair_labels=torch.tensor([0, 1]),
    )
    out.loss.backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir())


@pytest.fixture
def small_tmpfs(tmp_path):
    """A tmpfs sized for one checkpoint and a half (mount needs root: skipped otherwise)."""
    model, optimizer, scheduler = tiny_training_state()
    size = checkpoint_bytes(save_train_state(tmp_path / "probe", model, optimizer, scheduler, TrainerState(step=1)))
    pages = (size * 3 // 2) // 4096 + 1
    with tmpfs(tmp_path / "disk", pages * 4096, "; the RLIMIT_FSIZE variant runs") as mount:
        yield mount


def test_a_save_on_a_full_disk_fails_naming_the_checkpoint_and_keeps_the_last_good_one(small_tmpfs):
    model, optimizer, scheduler = tiny_training_state()
    root = small_tmpfs / "checkpoints"
    good = save_train_state(root / "step_00000001", model, optimizer, scheduler, TrainerState(step=1))
    with pytest.raises(DiskFull, match=r"step_00000002: disk full .* kept .*step_00000001"):
        save_train_state(root / "step_00000002", model, optimizer, scheduler, TrainerState(step=2))
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]  # the partial one is gone
    assert latest_good(root) == good
    verify(good)
    assert shutil.disk_usage(small_tmpfs).free > checkpoint_bytes(good) // 3  # its space was given back


SAVE_UNDER_FILE_LIMIT = """
import json, resource, signal, sys
from pathlib import Path
from tests.test_faults import tiny_training_state
from services.rundir.checkpoints import latest_good, verify
from services.train.state import TrainerState, save_train_state
root = Path(sys.argv[1])
model, optimizer, scheduler = tiny_training_state()
good = save_train_state(root / "step_00000001", model, optimizer, scheduler, TrainerState(step=1))
limit = (good / "optimizer.safetensors").stat().st_size // 2
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
try:
    save_train_state(root / "step_00000002", model, optimizer, scheduler, TrainerState(step=2))
    error = None
except OSError as err:
    error = str(err)
verify(good)
print(json.dumps({"error": error, "entries": sorted(p.name for p in root.iterdir()), "latest": str(latest_good(root))}))
"""


def test_a_save_past_the_file_size_limit_fails_and_keeps_the_last_good_one(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SAVE_UNDER_FILE_LIMIT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"] is not None and "step_00000002: checkpoint not saved" in result["error"]
    assert "File too large" in result["error"]
    assert result["entries"] == ["step_00000001"]
    assert result["latest"] == str(tmp_path / "step_00000001")
