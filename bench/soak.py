"""Soak test (`bash scripts/soak.sh`): a tiny pretraining run on a simulated multi-node Ray cluster under a
randomized schedule of real faults, checked against an uninterrupted run of the same seed.

The cluster (tests/ray_clusters.py: `ray.cluster_utils.Cluster`, every node on 127.0.0.1) is a head node and two
worker nodes of 1 CPU each. Each run is `albert pretrain --config RECIPE --address CLUSTER` in a process of its own
(the example trace installed, tests/worker_callbacks.py): 2 workers of 1 CPU with an input process each, the run's
coordinator, evaluations every `--eval-every` steps. The faults (bench/soak_faults.py's table, every kind once per
round of 11, in a random order, 2 to 5 steps after the previous fault's recovery):

- worker_kill, node_loss (a fresh node joins), input_kill (a worker's input process): SIGKILL; Ray Train restarts
  the worker group from the last checkpoint;
- coordinator_kill (it restarts from ledger.json), evaluator_kill (the coordinator relaunches it; a worker_kill
  when none runs);
- driver_sigterm, worker_sigterm: a graceful stop (a checkpoint at the next step, exit 143), after which the soak
  starts the same command again, which resumes;
- stop_then_worker_kill, stop_then_coordinator_kill: SIGTERM to the driver, then within a step a SIGKILL;
- drain_notice: `ray drain-node` with a preemption deadline, the node removed at it (train.preemption_check_every
  = 1: a checkpoint at every step from the notice on);
- checkpoint_stall: rank 0's process stopped for 4-12 s while it writes a checkpoint.

The summary, per fault and per kind: recovered or not, seconds from the fault to the next trained step (to the
actor answering again), steps rolled back against what its kind may lose (a stop: no completed step; a drained
node: the step in flight; a kill, or a kill during a stop: back to the last checkpoint) and steps redone; examples
lost (the example ids of each step's final attempt against the uninterrupted run: must be 0); whether the final
weights are bitwise those of the uninterrupted run. Exit status 1 when anything was lost, not recovered or differs.

    python bench/soak.py [--faults 8] [--seed N] [--eval-every 12] [--work DIR] [--summary FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
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
from bench import soak_faults  # noqa: E402
from services.cluster import coordinator_name  # noqa: E402
from services.rundir import evaluations  # noqa: E402
from services.rundir.config import RunConfig  # noqa: E402
from services.rundir.fields import to_toml  # noqa: E402
from services.train.driver import result_of  # noqa: E402
from tests.ray_clusters import loopback_cluster  # noqa: E402
from tests.synthetic import write_random_shards  # noqa: E402
from tests.worker_callbacks import callbacks_command, read_trace  # noqa: E402

VOCAB, SEQ = 96, 32
ROWS_PER_FILE = (80, 80, 80, 84)  # 2 workers x 8 rows a step: 20 steps an epoch


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
    """The run's recipe (the soak run and the uninterrupted one differ only in their names)."""
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
                "checkpoint_every": soak_faults.CHECKPOINT_EVERY,
                "keep_last": 3,
                "dropout_removal_step": total_steps // 2,
                "max_failures": 1000,
                "input_workers": 1,  # an input process per worker, for input_kill
                "preemption_check_every": 1,  # a drained node's notice is saved at the next step
            },
            "eval": {"every_steps": eval_every, "batch_size": 8, "heldout_batches": 2},
        }
    )


# --------------------------------------------------------------------------------------------------
# the driver


class Driver:
    """`albert pretrain --config RECIPE --address CLUSTER` in a process of its own, as a user starts it, with the
    example trace installed (tests/worker_callbacks.py); a fault that ends it is followed by `start()` again: the
    same command, which resumes. Its console goes to `log`."""

    def __init__(self, recipe: Path, trace: Path, address: str, log: Path, step_seconds: float = 0.0):
        args = ["pretrain", "--config", str(recipe), "--address", address, "--no-progress"]
        self.command = callbacks_command(args, trace=trace, step_seconds=step_seconds)
        self.log = log
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        env.pop("RAY_ADDRESS", None)
        with self.log.open("a") as out:
            out.write(f"\n--- start {self.starts + 1}: {' '.join(self.command)}\n")
            out.flush()
            self.process = subprocess.Popen(self.command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)  # fmt: skip
        self.starts += 1

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text()[-chars:]

    def finish(self, timeout: float) -> int:
        """Its exit status once it ends on its own (killed after `timeout` seconds)."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            raise RuntimeError(f"the driver did not finish within {timeout:g} s:\n{self.tail()}") from None


def write_recipe(config: RunConfig, path: Path) -> Path:
    path.write_text(to_toml(config.to_dict()))
    return path


def uninterrupted(config: RunConfig, work: Path, address: str) -> float:
    """The reference run: the same command, no fault; its seconds."""
    started = time.monotonic()
    driver = Driver(
        write_recipe(config, work / "reference.toml"), work / "trace-reference", address, work / "reference.log"
    )
    driver.start()
    status = driver.finish(timeout=1800)
    if status != 0:
        raise RuntimeError(f"the uninterrupted run exited {status}:\n{driver.tail()}")
    return time.monotonic() - started


# --------------------------------------------------------------------------------------------------
# the summary


def consumed(trace: list[dict[str, Any]]) -> dict[tuple[int, int], list[int]]:
    return {(r["rank"], r["step"]): r["example_ids"] for r in trace}  # the last attempt of each step counts


def by_kind(faults: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind: count, recovered, seconds to recover (min, median, max), most steps rolled back against its bound,
    steps redone."""
    table = {}
    for kind, spec in soak_faults.KINDS.items():
        mine = [f for f in faults if f["kind"] == kind]
        times = [f["recovery_s"] for f in mine if "recovery_s" in f]
        if not mine:
            continue
        table[kind] = {
            "n": len(mine),
            "recovered": sum(f["recovered"] for f in mine),
            "recovery_s": [round(min(times), 1), round(statistics.median(times), 1), round(max(times), 1)]
            if times
            else None,
            "rolled_back_max": max(f["rolled_back"] for f in mine),
            "may_roll_back": spec.may_roll_back,
            "steps_redone": sum(f["steps_redone"] for f in mine),
        }
    return table


def print_summary(summary: dict[str, Any]) -> None:
    injected = f"{len(summary['faults'])} of {summary['scheduled']} in {summary['soak_s']:.0f}s"
    print(f"\nfaults injected: {injected} (uninterrupted: {summary['uninterrupted_s']:.0f}s); "
          f"driver started {summary['driver_starts']} times")  # fmt: skip
    for fault in summary["faults"]:
        mark = "ok" if fault["recovered"] else "FAILED"
        print(f"  {soak_faults.summary_line(fault)}  rolled back {fault['rolled_back']}/{fault['may_roll_back']}  "
              f"redone {fault['steps_redone']}  {mark}")  # fmt: skip
    print(f"recovered: {sum(f['recovered'] for f in summary['faults'])}/{len(summary['faults'])}")
    print(f"  {'kind':<27}{'n':>3}{'ok':>4}  {'recovery s (min/med/max)':<26}{'rolled back (bound)':<21}redone")
    for kind, row in summary["by_kind"].items():
        seconds = "/".join(f"{t:g}" for t in row["recovery_s"]) if row["recovery_s"] else "-"
        bound = f"{row['rolled_back_max']} ({row['may_roll_back']})"
        print(f"  {kind:<27}{row['n']:>3}{row['recovered']:>4}  {seconds:<26}{bound:<21}{row['steps_redone']}")
    print(f"examples lost: {summary['examples_lost']} of {summary['examples']}; "
          f"steps not in the reference: {summary['extra_steps']}")  # fmt: skip
    print(f"evaluations: {summary['evaluations']}")
    print(f"final weights equal the uninterrupted run: {'yes' if summary['weights_equal'] else 'NO'}")


def summarize(args, work: Path, configs: tuple[RunConfig, RunConfig], faults, seconds, driver) -> dict[str, Any]:
    reference, soak = configs
    trace = read_trace(work / "trace-soak")
    soak_faults.rollbacks(trace, faults)
    want, got = consumed(read_trace(work / "trace-reference")), consumed(trace)
    a = load_file(result_of(reference).checkpoint / "model.safetensors")
    b = load_file(result_of(soak).checkpoint / "model.safetensors")
    return {
        "seed": args.seed,
        "command": " ".join(["python", "bench/soak.py", *sys.argv[1:]]),
        "total_steps": soak.optim.total_steps,
        "scheduled": args.faults,
        "uninterrupted_s": round(seconds[0], 1),
        "soak_s": round(seconds[1], 1),
        "driver_starts": driver.starts,
        "faults": [{k: v for k, v in f.items() if k not in ("time", "recovered_at")} for f in faults],
        "by_kind": by_kind(faults),
        "examples": sum(len(v) for v in want.values()),
        "examples_lost": sum(len(set(ids) - set(got.get(key, []))) for key, ids in want.items()),
        "extra_steps": sum(1 for key in got if key not in want),
        "evaluations": evaluations.counts(evaluations.recipe_state(soak.run_dir)),
        "weights_equal": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
    }


def passed(summary: dict[str, Any]) -> bool:
    faults = summary["faults"]
    return (
        len(faults) == summary["scheduled"]
        and all(f["recovered"] for f in faults)
        and summary["examples_lost"] == 0
        and summary["extra_steps"] == 0
        and summary["weights_equal"]
        and summary["evaluations"]["failed"] == 0
    )


# --------------------------------------------------------------------------------------------------
# the soak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=8)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    parser.add_argument("--eval-every", type=int, default=12)
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--kinds", type=lambda v: v.split(","), default=None, help="only these kinds (debugging)")
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=0.5,
        help="the faulted run sleeps this long after each step (its tiny steps would end the run before the faults)",
    )
    parser.add_argument("--summary", type=Path, default=None, help="write the summary here (JSON)")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    schedule = soak_faults.draw_schedule(rng, args.faults, args.kinds)
    total_steps = soak_faults.total_steps_for(schedule)
    work = args.work or Path(tempfile.mkdtemp(prefix="albert-soak-"))
    print(f"soak: seed {args.seed}, {total_steps} steps, {args.faults} faults, work dir {work}", flush=True)
    print("schedule: " + ", ".join(f"+{gap} {kind}" for gap, kind in schedule), flush=True)
    shards = write_shards(work / "shards")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])

    cluster = loopback_cluster(2)
    try:
        reference = soak_config(work, shards, "reference", total_steps, args.eval_every)
        reference_s = uninterrupted(reference, work, cluster.address)
        print(f"uninterrupted run: {reference_s:.0f}s", flush=True)

        config = soak_config(work, shards, f"soak-{args.seed}", total_steps, args.eval_every)
        recipe = write_recipe(config, work / "soak.toml")
        driver = Driver(recipe, work / "trace-soak", cluster.address, work / "soak.log", args.step_seconds)
        name = coordinator_name(config.run.name)
        injector = soak_faults.Injector(cluster, driver, work / "trace-soak", config.run_dir, name, schedule, rng)
        started = time.monotonic()
        driver.start()
        injector.run()
        status = driver.finish(timeout=1800)
        if status != 0:
            raise RuntimeError(f"the soak run exited {status}:\n{driver.tail()}")
        soak_s = time.monotonic() - started
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()

    summary = summarize(args, work, (reference, config), injector.faults, (reference_s, soak_s), driver)
    print_summary(summary)
    if args.summary:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(json.dumps(summary, indent=1) + "\n")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if passed(summary) else 1


if __name__ == "__main__":
    sys.exit(main())
