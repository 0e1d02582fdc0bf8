"""Soak test (`make soak`): a tiny pretraining run on a simulated multi-node Ray cluster under a randomized schedule
of real faults, checked against an uninterrupted run of the same seed.

The cluster (tests/ray_clusters.py: `ray.cluster_utils.Cluster`, every node on 127.0.0.1) is a head node and two
worker nodes of 1 CPU each; training runs 2 workers of 1 CPU with its coordinator (evaluations every `--eval-every`
steps). Faults, drawn at random steps:

- worker_kill: SIGKILL of a training worker process (Ray Train restarts the group from the last checkpoint);
- node_loss: a worker node hosting a training worker is removed, and a fresh node joins in its place;
- coordinator_kill: SIGKILL of the coordinator actor (it restarts from ledger.json);
- evaluator_kill: SIGKILL of a running evaluator (the coordinator relaunches it); a worker_kill when none runs.

The summary: faults injected and recovered, seconds from each fault to the next trained step (or to the actor
answering again), work lost per fault (steps trained twice), examples lost (the example ids of each step's final
attempt against the uninterrupted run: must be 0), and whether the final weights are bitwise those of the
uninterrupted run. Exit status 1 when anything was lost or differs.

    python bench/soak.py [--faults 8] [--seed N] [--eval-every 12] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/: the loopback cluster, the step callbacks, the random shards

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from albert_core.examples.shards import HELDOUT_FILE, HELDOUT_SCHEMA  # noqa: E402
from services.cluster import coordinator_name  # noqa: E402
from services.rundir.config import RunConfig  # noqa: E402
from services.train.callbacks import installed  # noqa: E402
from services.train.coordinator import get_or_create_coordinator  # noqa: E402
from services.train.driver import launch, prepare_run  # noqa: E402
from tests.ray_clusters import add_loopback_node, loopback_cluster  # noqa: E402
from tests.synthetic import write_random_shards  # noqa: E402
from tests.worker_callbacks import TraceExamples, read_trace  # noqa: E402

VOCAB, SEQ = 96, 32
ROWS_PER_FILE = (80, 80, 80, 84)  # 2 workers x 8 rows a step: 20 steps an epoch
CHECKPOINT_EVERY = 4
KINDS = ("worker_kill", "node_loss", "coordinator_kill", "evaluator_kill")


# --------------------------------------------------------------------------------------------------
# data and config


def write_shards(root: Path, seed: int = 0) -> Path:
    """Parquet shards of random [CLS] A [SEP] B [SEP] rows and held-out documents (what preprocess writes)."""
    rng = np.random.default_rng(seed)
    write_random_shards(root / "train", ROWS_PER_FILE, vocab_size=VOCAB, rng=rng)
    docs = []
    for doc in range(12):
        lengths = rng.integers(4, 9, size=4)
        sentences = [rng.integers(5, VOCAB, n).tolist() for n in lengths]
        docs.append({"doc_id": doc, "sentences": sentences, "word_starts": [[True] * len(s) for s in sentences]})
    (root / HELDOUT_FILE).parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(docs, schema=HELDOUT_SCHEMA), root / HELDOUT_FILE)
    (root / "manifest.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return root


def soak_config(work: Path, shards: Path, name: str, total_steps: int, eval_every: int) -> RunConfig:
    model = dict(embedding_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
    return RunConfig.from_dict(
        {
            "run": {"name": name, "output_dir": str(work / "runs"), "seed": 7},
            "model": {"preset": "albert-tiny", "overrides": {**model, "max_position_embeddings": 64}},
            "data": {"shards": str(shards), "max_seq_length": SEQ},
            "optim": {"lr": 0.01, "warmup_steps": 2, "total_steps": total_steps},
            "train": {
                "global_batch_size": 16,
                "micro_batch_size": 4,
                "num_workers": 2,
                "log_every": 1,
                "checkpoint_every": CHECKPOINT_EVERY,
                "keep_last": 3,
                "dropout_removal_step": total_steps // 2,
                "max_failures": 1000,
            },
            "eval": {"every_steps": eval_every, "batch_size": 8, "heldout_batches": 2},
        }
    )


# --------------------------------------------------------------------------------------------------
# the trace and the faults


def live_actors(class_name: str, states: tuple[str, ...] = ("ALIVE",)) -> list[dict[str, Any]]:
    import ray

    return [
        a
        for a in ray._private.state.actors().values()  # the GCS actor table (no dashboard needed)
        if a["ActorClassName"] == class_name and a["State"] in states and a["Pid"]
    ]


EVALUATOR_STATES = ("ALIVE", "PENDING_CREATION")  # an evaluator of this tiny model is killed while it starts


class FaultSchedule:
    """Follows the trace; injects one fault at each scheduled step, then waits for the recovery it measures.

    `run` goes in the main thread (Ray registers signal handlers when a node is added), training in another.
    """

    def __init__(self, cluster, trace_dir: Path, run_dir: Path, coordinator, schedule: list[tuple[int, str]], rng):
        self.cluster, self.trace_dir, self.run_dir, self.coordinator = cluster, trace_dir, run_dir, coordinator
        self.schedule, self.rng = schedule, rng
        self.faults: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        stale: set[int] = set()  # worker processes a fault already replaced
        try:
            for at_step, kind in self.schedule:
                while True:
                    live = [r for r in read_trace(self.trace_dir) if r["pid"] not in stale]
                    if live and max(r["step"] for r in live) >= at_step:
                        break
                    if self.stopped.wait(0.01):
                        return
                if kind == "evaluator_kill" and not live_actors("IntrinsicEvaluator", EVALUATOR_STATES):
                    kind = "worker_kill"
                fault = {"kind": kind, "at_step": at_step, "pids": sorted({r["pid"] for r in live})}
                fault.update(getattr(self, kind)(live))
                self.faults.append(fault)
                if kind in ("worker_kill", "node_loss"):
                    stale |= set(fault["pids"])
                    self.wait_for_new_workers(fault, stale)
        except BaseException as err:  # reported by main
            self.error = err

    def wait_for_new_workers(self, fault: dict[str, Any], stale: set[int]) -> None:
        while not self.stopped.wait(0.01):
            new = [r for r in read_trace(self.trace_dir) if r["pid"] not in stale and r["time"] > fault["time"]]
            if new:
                fault["recovery_s"] = new[0]["time"] - fault["time"]
                fault["resumed_from"] = new[0]["step"] - 1
                return

    def worker_kill(self, live) -> dict[str, Any]:
        newest = {r["rank"]: r for r in live}
        victim = newest[self.rng.choice(sorted(newest))]
        started = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        return {"time": started, "detail": f"rank {victim['rank']} pid {victim['pid']}"}

    def node_loss(self, live) -> dict[str, Any]:
        on = {a["Address"]["NodeID"] for a in live_actors("RayTrainWorker")}
        node = next(n for n in sorted(self.cluster.worker_nodes, key=lambda n: n.node_id) if n.node_id in on)
        started = time.time()
        self.cluster.remove_node(node)
        add_loopback_node(self.cluster)  # the replacement an autoscaler would bring
        return {"time": started, "detail": f"node {node.node_id[:8]}"}

    def coordinator_kill(self, live) -> dict[str, Any]:
        import ray

        (actor,) = [a for a in live_actors("Coordinator") if a["Name"] == self.coordinator[1]]
        started = time.time()
        os.kill(actor["Pid"], signal.SIGKILL)
        ray.get(self.coordinator[0].status.remote(), timeout=300)  # answered by the restarted actor
        return {"time": started, "recovery_s": time.time() - started, "detail": f"pid {actor['Pid']}"}

    def evaluator_kill(self, live) -> dict[str, Any]:
        actor = live_actors("IntrinsicEvaluator", EVALUATOR_STATES)[0]
        started = time.time()
        os.kill(actor["Pid"], signal.SIGKILL)
        step = int(actor["Name"].split(":")[2])
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # the coordinator notices on its next call and relaunches
            lines = [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]
            later = [r for r in lines if r["step"] == step and r["time"] > started]
            if any(r.get("event") == "eval_retried" for r in later):
                return {"time": started, "recovery_s": time.time() - started, "detail": actor["Name"]}
            if any(r["kind"] == "eval" for r in later):  # its result was in before the kill landed
                return {"time": started, "recovery_s": 0.0, "detail": actor["Name"] + " (had finished)"}
            time.sleep(0.05)
        return {"time": started, "detail": actor["Name"]}


# --------------------------------------------------------------------------------------------------
# the soak


def traced_run(config: RunConfig, trace_dir: Path, **kwargs):
    with installed(TraceExamples(trace_dir)):
        started = time.monotonic()
        prepared = prepare_run(config, **kwargs)
        result = prepared.finished if prepared.finished is not None else launch(prepared.plan)
        return result, time.monotonic() - started


def consumed(trace: list[dict[str, Any]]) -> dict[tuple[int, int], list[int]]:
    return {(r["rank"], r["step"]): r["example_ids"] for r in trace}  # the last attempt of each step counts


def draw_schedule(rng: random.Random, n_faults: int) -> tuple[list[tuple[int, str]], int]:
    steps, at = [], 2
    for _ in range(n_faults):
        at += rng.randint(2, 5)
        steps.append((at, rng.choice(KINDS)))
    return steps, at + CHECKPOINT_EVERY + 2


def print_faults(faults: list[dict[str, Any]], per_step: int) -> None:
    """A line per fault, the recoveries by kind and the work lost (`per_step`: examples a step trains)."""
    recovered = [f for f in faults if "recovery_s" in f]
    for f in faults:
        seconds = f"{f['recovery_s']:.1f}s" if "recovery_s" in f else "not recovered"
        print(
            f"  step {f['at_step']:>3}  {f['kind']:<17} {f['detail']:<32} recovered in {seconds:<14}"
            f"steps redone {f['steps_redone']}"
        )
    print(f"recoveries: {len(recovered)}/{len(faults)}")
    for kind in KINDS:
        times = [f["recovery_s"] for f in recovered if f["kind"] == kind]
        if times:
            print(
                f"  {kind:<17} n={len(times)}  seconds to recover: min {min(times):.1f}  "
                f"median {statistics.median(times):.1f}  max {max(times):.1f}"
            )
    redone = [f["steps_redone"] for f in faults]
    print(
        f"work lost per fault: max {max(redone, default=0)} steps = {max(redone, default=0) * per_step} examples "
        f"(checkpoint every {CHECKPOINT_EVERY} steps); total {sum(redone) * per_step} examples trained twice"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=8)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    parser.add_argument("--eval-every", type=int, default=12)
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    args = parser.parse_args()

    import ray

    rng = random.Random(args.seed)
    schedule, total_steps = draw_schedule(rng, args.faults)
    work = args.work or Path(tempfile.mkdtemp(prefix="albert-soak-"))
    print(f"soak: seed {args.seed}, {total_steps} steps, {args.faults} faults, work dir {work}", flush=True)
    shards = write_shards(work / "shards")

    cluster = loopback_cluster(2)
    try:
        reference_config = soak_config(work, shards, "reference", total_steps, args.eval_every)
        reference, reference_s = traced_run(reference_config, work / "trace-reference", resume=False)
        print(f"uninterrupted run: {reference_s:.0f}s", flush=True)

        config = soak_config(work, shards, f"soak-{args.seed}", total_steps, args.eval_every)
        name = coordinator_name(config.run.name)
        actor = get_or_create_coordinator(config.run_dir, config.run.name, config.to_dict())
        injector = FaultSchedule(cluster, work / "trace-soak", config.run_dir, (actor, name), schedule, rng)
        outcome: dict[str, Any] = {}

        def train() -> None:
            try:
                outcome["run"] = traced_run(config, work / "trace-soak", resume=False, coordinator=name)
            except BaseException as err:  # raised below, in the main thread
                outcome["error"] = err
            finally:
                injector.stopped.set()

        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()
        injector.run()
        trainer.join()
        for error in (outcome.get("error"), injector.error):
            if error is not None:
                raise error
        result, soak_s = outcome["run"]
        counts = ray.get(actor.wait_for_evals.remote(timeout=600), timeout=660)
    finally:
        ray.shutdown()
        cluster.shutdown()

    faults = injector.faults
    trace = read_trace(work / "trace-soak")
    for fault in faults:
        if fault["kind"] in ("worker_kill", "node_loss"):
            reached = max(r["step"] for r in trace if r["pid"] in fault["pids"])
            fault["steps_redone"] = reached - fault.get("resumed_from", reached)
        else:
            fault["steps_redone"] = 0
    want, got = consumed(read_trace(work / "trace-reference")), consumed(trace)
    lost = sum(len(set(ids) - set(got.get(key, []))) for key, ids in want.items())
    extra = sum(len(ids) for key, ids in got.items() if key not in want)
    a, b = load_file(reference.checkpoint / "model.safetensors"), load_file(result.checkpoint / "model.safetensors")
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    recovered = [f for f in faults if "recovery_s" in f]
    print(f"\nfaults injected: {len(faults)} in {soak_s:.0f}s (uninterrupted: {reference_s:.0f}s)")
    print_faults(faults, config.train.global_batch_size)
    print(f"examples lost: {lost} of {sum(len(v) for v in want.values())}; steps not in the reference: {extra}")
    print(f"evaluations: {counts}")
    print(f"final weights equal the uninterrupted run: {'yes' if same else 'NO'}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    ok = same and lost == 0 and extra == 0 and len(recovered) == len(faults) and counts["failed"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
