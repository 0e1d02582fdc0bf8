"""The faults of the soak (bench/soak.py): the table of fault kinds, the schedule drawn from a seed, the injector
that follows the run's example trace, injects each fault and waits for its recovery, and what each kind may lose.

Every kind is one method of `Injector`, named as the kind. What a kind may lose is counted in steps rolled back: a
worker that trains a step it (or the rank before it) had already started, goes back that many steps. A stop loses
no completed step (0); a drained node, at most the step in flight when it goes (1); a kill, at most what lies past
the last checkpoint (`train.checkpoint_every`); a kill during a stop, likewise.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.ray_clusters import add_loopback_node, descendants, drain
from tests.worker_callbacks import read_trace

CHECKPOINT_EVERY = 4
NOTHING, IN_FLIGHT, TO_CHECKPOINT = 0, 1, CHECKPOINT_EVERY  # steps a fault may roll a worker back
STALL_S = (4.0, 12.0)  # how long a stalled checkpoint write stands still (drawn)
# A preemption notice's deadline, after which the node is removed. Ray Train's PreemptionWatcher polls the drain
# state every 5 s, so a notice reaches the workers up to 5 s plus a step (2 s here) after the drain: with 6 s the
# node was once gone before it did (seed 4242's first soak: no notice, back to the last checkpoint, as a kill).
DRAIN_DEADLINE_S = 15
WAIT_S = 300  # the longest wait for a recovery, a driver's exit, an answer


@dataclass(frozen=True)
class Kind:
    what: str
    may_roll_back: int  # steps
    exit_status: int | None = None  # a kind that ends the driver: its expected exit status (the soak restarts it)


KINDS: dict[str, Kind] = {
    "worker_kill": Kind("SIGKILL of a training worker process", TO_CHECKPOINT),
    "node_loss": Kind("a worker node hosting a training worker removed; a fresh node joins", TO_CHECKPOINT),
    "coordinator_kill": Kind("SIGKILL of the coordinator actor (restarts from ledger.json)", NOTHING),
    "evaluator_kill": Kind("SIGKILL of a running evaluator (a worker_kill when none runs)", NOTHING),
    "driver_sigterm": Kind("SIGTERM to the driver: it checkpoints, exits 143; the command again", NOTHING, 143),
    "worker_sigterm": Kind("SIGTERM to a training worker: the same stop as the driver's", NOTHING, 143),
    "drain_notice": Kind(f"`ray drain-node` with a {DRAIN_DEADLINE_S} s deadline, the node removed at it", IN_FLIGHT),
    "stop_then_worker_kill": Kind("SIGTERM to the driver, then within a step SIGKILL of a worker", TO_CHECKPOINT, 143),
    "stop_then_coordinator_kill": Kind(
        "SIGTERM to the driver, then within a step SIGKILL of the coordinator", TO_CHECKPOINT, 143
    ),
    "input_kill": Kind("SIGKILL of a worker's input process (train.input_workers = 1)", TO_CHECKPOINT),
    "checkpoint_stall": Kind("rank 0 stopped (SIGSTOP) for N s while it writes a checkpoint", NOTHING),
}
EVALUATOR_STATES = ("ALIVE", "PENDING_CREATION")  # an evaluator of this tiny model is killed while it starts


def draw_schedule(rng: random.Random, n_faults: int, only: list[str] | None = None) -> list[tuple[int, str]]:
    """(gap, kind) per fault: each fault comes `gap` (2 to 5) steps after the previous one's recovery; the kinds (all,
    or `only` those) in rounds of a random order of all of them, so that 11 or more faults inject every kind."""
    choices = sorted(only or KINDS)
    kinds: list[str] = []
    while len(kinds) < n_faults:
        kinds += rng.sample(choices, len(choices))
    return [(rng.randint(2, 5), kind) for kind in kinds[:n_faults]]


def total_steps_for(schedule: list[tuple[int, str]]) -> int:
    """Steps enough for every fault: its gap, the steps trained while it is injected and recovers (a drain's
    deadline: most, 7 at 2 s a step), and a few at the end past a checkpoint."""
    return 2 + sum(gap + 6 + (6 if kind == "drain_notice" else 0) for gap, kind in schedule) + CHECKPOINT_EVERY + 2


def live_actors(class_name: str, states: tuple[str, ...] = ("ALIVE",)) -> list[dict[str, Any]]:
    import ray

    return [
        a
        for a in ray._private.state.actors().values()  # the GCS actor table (no dashboard needed)
        if a["ActorClassName"] == class_name and a["State"] in states and a["Pid"]
    ]


class Injector:
    """Follows the trace; injects each scheduled fault, then waits for the recovery it measures. `driver` is the
    soak run's `albert pretrain` process (bench/soak.py's Driver): faults that end it start it again.

    `run` goes in the main thread (Ray registers signal handlers when a node is added)."""

    def __init__(self, cluster, driver, trace_dir: Path, run_dir: Path, coordinator: str, schedule, rng):
        self.cluster, self.driver, self.trace_dir, self.run_dir = cluster, driver, trace_dir, run_dir
        self.coordinator, self.schedule, self.rng = coordinator, schedule, rng
        self.faults: list[dict[str, Any]] = []
        self.since = 0.0  # the position counts trace lines from this time (the last recovery)

    def run(self) -> None:
        """Every fault of the schedule; returns early when the run finished first (the summary counts it)."""
        for gap, kind in self.schedule:
            trace = self.wait_for_step(gap)
            if trace is None:
                return
            drawn = kind
            if kind == "evaluator_kill" and not live_actors("IntrinsicEvaluator", EVALUATOR_STATES):
                kind = "worker_kill"
            now = [r for r in trace if r["time"] >= self.since]
            fault = {"kind": kind, "at_step": max(r["step"] for r in now)}
            fault.update(getattr(self, kind)(self.newest_by_rank(now)))
            if drawn != kind:
                fault.update(drawn=drawn, detail=f"{fault['detail']} (drawn: {drawn}, none ran)")
            self.since = fault.get("recovered_at", fault["time"])
            self.faults.append(fault)
            print(f"  fault {len(self.faults)}: {summary_line(fault)}", flush=True)

    # --- following the run ---

    def wait_for_step(self, gap: int) -> list[dict[str, Any]] | None:
        """The trace once the run is `gap` steps past its position at the last recovery and past every step traced
        so far (a rolled-back run has trained its lost steps again); None when the driver finished first."""
        trace = read_trace(self.trace_dir)
        start = max((r["step"] for r in trace if r["time"] >= self.since), default=0)
        target = max(start + gap, max((r["step"] for r in trace), default=0) + 1)
        while True:
            now = [r for r in trace if r["time"] >= self.since]
            if now and max(r["step"] for r in now) >= target:
                return trace
            status = self.driver.process.poll()
            if status == 0:
                return None
            if status is not None:
                raise RuntimeError(f"the driver exited {status} unasked:\n{self.driver.tail()}")
            time.sleep(0.05)
            trace = read_trace(self.trace_dir)

    @staticmethod
    def newest_by_rank(lines: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
        return {r["rank"]: r for r in lines}  # the trace is in time order: each rank's newest line wins

    def step_seconds(self) -> float:
        """The run's recent seconds per step (the median gap between rank 0's last lines)."""
        times = [r["time"] for r in read_trace(self.trace_dir) if r["rank"] == 0][-8:]
        return statistics.median(b - a for a, b in zip(times, times[1:], strict=False)) if len(times) > 1 else 0.5

    def wait_for_new_workers(self, started: float, stale: set[int]) -> dict[str, Any]:
        """{"recovery_s", "recovered_at"} at the first step a worker process not in `stale` traced after `started`."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            new = [r for r in read_trace(self.trace_dir) if r["pid"] not in stale and r["time"] > started]
            if new:
                return {"recovery_s": new[0]["time"] - started, "recovered_at": new[0]["time"]}
            if self.driver.process.poll() is not None:
                raise RuntimeError(f"the driver exited {self.driver.process.returncode}:\n{self.driver.tail()}")
            time.sleep(0.05)
        return {}

    def restart_driver(self, started: float, stale: set[int]) -> dict[str, Any]:
        """After a fault that ends the driver: its exit status, then the same command again (it resumes), recovered
        at its workers' first step."""
        try:
            status = self.driver.process.wait(timeout=WAIT_S)
        except Exception:
            self.driver.process.kill()
            raise RuntimeError(f"the driver did not exit within {WAIT_S} s:\n{self.driver.tail()}") from None
        stops = [r for r in self.metrics() if r.get("event") == "stopped" and r["time"] > started]
        self.driver.start()
        stopped_at = {"stopped_at": stops[-1]["step"]} if stops else {}
        return {"exit": status, **stopped_at, **self.wait_for_new_workers(started, stale)}

    def metrics(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]

    def coordinator_pid(self) -> int:
        (actor,) = [a for a in live_actors("Coordinator") if a["Name"] == self.coordinator]
        return actor["Pid"]

    # --- the kinds (KINDS), each given the newest trace line of every rank ---

    def worker_kill(self, newest) -> dict[str, Any]:
        victim = newest[self.rng.choice(sorted(newest))]
        started = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        return {"time": started, "detail": f"rank {victim['rank']} pid {victim['pid']}", **self.recovered(started)}

    def recovered(self, started: float) -> dict[str, Any]:
        """Recovery by a new worker group (every process traced so far is stale)."""
        return self.wait_for_new_workers(started, {r["pid"] for r in read_trace(self.trace_dir)})

    def node_loss(self, newest) -> dict[str, Any]:
        node = self.node_hosting_a_worker()
        started = time.time()
        self.cluster.remove_node(node)
        add_loopback_node(self.cluster)  # the replacement an autoscaler would bring
        return {"time": started, "detail": f"node {node.node_id[:8]}", **self.recovered(started)}

    def node_hosting_a_worker(self):
        on = {a["Address"]["NodeID"] for a in live_actors("RayTrainWorker")}
        return next(n for n in sorted(self.cluster.worker_nodes, key=lambda n: n.node_id) if n.node_id in on)

    def coordinator_kill(self, newest) -> dict[str, Any]:
        import ray

        from services import RAY_NAMESPACE

        pid = self.coordinator_pid()
        started = time.time()
        os.kill(pid, signal.SIGKILL)
        actor = ray.get_actor(self.coordinator, namespace=RAY_NAMESPACE)
        ray.get(actor.status.remote(), timeout=WAIT_S)  # answered by the restarted actor
        now = time.time()
        return {"time": started, "recovery_s": now - started, "recovered_at": now, "detail": f"pid {pid}"}

    def evaluator_kill(self, newest) -> dict[str, Any]:
        actor = live_actors("IntrinsicEvaluator", EVALUATOR_STATES)[0]
        started = time.time()
        os.kill(actor["Pid"], signal.SIGKILL)
        step = int(actor["Name"].split(":")[2])
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:  # the coordinator notices on its next call and relaunches
            later = [r for r in self.metrics() if r["step"] == step and r["time"] > started]
            if any(r.get("event") == "eval_retried" for r in later):
                return {"time": started, "recovery_s": time.time() - started, "detail": actor["Name"]}
            if any(r["kind"] == "eval" for r in later):  # its result was in before the kill landed
                return {"time": started, "recovery_s": 0.0, "detail": actor["Name"] + " (had finished)"}
            time.sleep(0.05)
        return {"time": started, "detail": actor["Name"]}

    def driver_sigterm(self, newest) -> dict[str, Any]:
        pid, started = self.driver.process.pid, time.time()
        self.driver.process.send_signal(signal.SIGTERM)
        return {"time": started, "detail": f"driver pid {pid}", **self.restart_driver(started, self.all_pids())}

    def all_pids(self) -> set[int]:
        return {r["pid"] for r in read_trace(self.trace_dir)}

    def worker_sigterm(self, newest) -> dict[str, Any]:
        victim = newest[self.rng.choice(sorted(newest))]
        started = time.time()
        os.kill(victim["pid"], signal.SIGTERM)
        detail = f"rank {victim['rank']} pid {victim['pid']}"
        return {"time": started, "detail": detail, **self.restart_driver(started, self.all_pids())}

    def drain_notice(self, newest) -> dict[str, Any]:
        node = self.node_hosting_a_worker()
        started = time.time()
        drain(self.cluster.address, node.node_id, DRAIN_DEADLINE_S)
        time.sleep(max(0.0, started + DRAIN_DEADLINE_S - time.time()))
        self.cluster.remove_node(node)  # at the deadline, as the cloud takes the VM
        add_loopback_node(self.cluster)
        recovery = self.recovered(started)
        notices = [r for r in self.metrics() if r.get("event") == "preemption_notice" and r["time"] > started]
        noticed = f", notice saved at step {notices[0]['step']}" if notices else ", no notice event"
        return {"time": started, "detail": f"node {node.node_id[:8]}{noticed}", **recovery}

    def stop_then_worker_kill(self, newest) -> dict[str, Any]:
        victim = newest[self.rng.choice(sorted(newest))]
        delay = self.rng.uniform(0, self.step_seconds())
        started = time.time()
        self.driver.process.send_signal(signal.SIGTERM)
        time.sleep(delay)
        os.kill(victim["pid"], signal.SIGKILL)
        detail = f"kill rank {victim['rank']} {delay:.2f}s after"
        return {"time": started, "detail": detail, **self.restart_driver(started, self.all_pids())}

    def stop_then_coordinator_kill(self, newest) -> dict[str, Any]:
        pid, delay = self.coordinator_pid(), self.rng.uniform(0, self.step_seconds())
        started = time.time()
        self.driver.process.send_signal(signal.SIGTERM)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        detail = f"kill coordinator {delay:.2f}s after"
        return {"time": started, "detail": detail, **self.restart_driver(started, self.all_pids())}

    def input_kill(self, newest) -> dict[str, Any]:
        victim = newest[self.rng.choice(sorted(newest))]
        inputs = sorted(p for p in descendants(victim["pid"]) - {victim["pid"]} if is_input_process(p))
        if not inputs:
            raise RuntimeError(f"rank {victim['rank']} (pid {victim['pid']}) has no input process")
        started = time.time()
        os.kill(inputs[0], signal.SIGKILL)
        detail = f"rank {victim['rank']}'s input pid {inputs[0]}"
        return {"time": started, "detail": detail, **self.recovered(started)}

    def checkpoint_stall(self, newest) -> dict[str, Any]:
        """Rank 0's process is stopped while a temporary checkpoint directory of its write exists (or, when the
        polling missed the write for 3 checkpoints, right after one), then continued `seconds` later."""
        pid, seconds = newest[0]["pid"], round(self.rng.uniform(*STALL_S), 1)
        checkpoints = self.run_dir / "checkpoints"
        caught, deadline = False, newest[0]["step"] + 3 * CHECKPOINT_EVERY
        while not caught and max(r["step"] for r in read_trace(self.trace_dir)) <= deadline:
            for _ in range(200):  # 2 ms polls between looks at the trace
                if any(name.startswith(".step_") for name in os.listdir(checkpoints)):
                    caught = True
                    break
                time.sleep(0.002)
        started = time.time()
        os.kill(pid, signal.SIGSTOP)
        mid_write = caught and any(name.startswith(".step_") for name in os.listdir(checkpoints))
        time.sleep(seconds)
        os.kill(pid, signal.SIGCONT)
        step = max(r["step"] for r in read_trace(self.trace_dir))
        where = "mid-write" if mid_write else "right after a write"
        recovery = self.wait_for_step_after(step, started, time.time())
        return {"time": started, "detail": f"rank 0 pid {pid} {seconds:g}s {where}", **recovery}

    def wait_for_step_after(self, step: int, started: float, since: float) -> dict[str, Any]:
        """Recovered (from `started`) at the first step past `step` traced after `since`."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            later = [r for r in read_trace(self.trace_dir) if r["step"] > step and r["time"] >= since]
            if later:
                return {"recovery_s": later[0]["time"] - started, "recovered_at": later[0]["time"]}
            time.sleep(0.05)
        return {}


def is_input_process(pid: int) -> bool:
    """A DataLoader process (torch spawns it through multiprocessing; not multiprocessing's resource tracker)."""
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


# --------------------------------------------------------------------------------------------------
# what each fault cost


def rollbacks(trace: list[dict[str, Any]], faults: list[dict[str, Any]]) -> None:
    """Per fault, from the trace lines between it and the next fault: `steps_redone` (attempts of a (rank, step)
    started before, the work lost; most of any rank) and `rolled_back` (the deepest going-back of a rank: its
    highest step started before, minus the step it trained again, plus one), checked against the kind's bound."""
    high: dict[int, int] = {}
    ends = [f["time"] for f in faults[1:]] + [float("inf")]
    lines = iter(trace)
    line = next(lines, None)
    for fault, end in zip(faults, ends, strict=True):
        redone: dict[int, int] = {}
        deepest = 0
        while line is not None and line["time"] < end:
            rank, step = line["rank"], line["step"]
            if line["time"] >= fault["time"] and step <= high.get(rank, 0):
                redone[rank] = redone.get(rank, 0) + 1
                deepest = max(deepest, high[rank] - step + 1)
            high[rank] = max(high.get(rank, 0), step)
            line = next(lines, None)
        fault["steps_redone"] = max(redone.values(), default=0)
        fault["rolled_back"] = deepest
        fault["may_roll_back"] = KINDS[fault["kind"]].may_roll_back
        fault["recovered"] = recovered(fault)


def recovered(fault: dict[str, Any]) -> bool:
    """Recovered in time, within its kind's bound of steps rolled back, with the driver's expected exit status."""
    kind = KINDS[fault["kind"]]
    exit_ok = kind.exit_status is None or fault.get("exit") == kind.exit_status
    return "recovery_s" in fault and fault["rolled_back"] <= kind.may_roll_back and exit_ok


def summary_line(fault: dict[str, Any]) -> str:
    seconds = f"{fault['recovery_s']:.1f}s" if "recovery_s" in fault else "not recovered"
    status = f" exit {fault['exit']}" if "exit" in fault else ""
    return f"step {fault['at_step']:>3}  {fault['kind']:<26} {fault['detail']:<44} {seconds}{status}"
