"""The Ray clusters of the tests and benches, on loopback only, and a reader of what a Ray listens on.

- `loopback_cluster`: a multi-node Ray on this machine (`ray.cluster_utils.Cluster`: a head node and worker nodes,
  each with its own raylet and object store), every node on 127.0.0.1, this process connected to it as a driver
  through services.cluster.connect (albert's one way to start Ray). tests/test_faults.py and bench/soak.py use it.
- `loopback_env`: the environment for a Ray command-line tool (`ray drain-node`) run against such a cluster;
  `drain`: that command, a preemption notice with a deadline for one of its nodes.
- `live_actors`: the actors of a class with a live process, from the GCS actor table.
- `listening_addresses`: the local addresses the given processes accept connections on, from /proc (Linux).

The session's one-node Ray is tests/conftest.py's `ray_local` (services.cluster.connect's embedded Ray).
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def live_actors(class_name: str, *, starting: bool = False) -> list[dict[str, Any]]:
    """Actors of a class with a live process (`starting`: also those still in __init__), from the GCS actor table
    (no dashboard needed)."""
    import ray

    states = ("ALIVE", "PENDING_CREATION") if starting else ("ALIVE",)
    return [
        a
        for a in ray._private.state.actors().values()
        if a["ActorClassName"] == class_name and a["State"] in states and a["Pid"]
    ]


def loopback_cluster(worker_nodes: int, *, cpus: int = 1) -> Any:
    """A `ray.cluster_utils.Cluster` of a head node and `worker_nodes` worker nodes of `cpus` CPUs each, without
    dashboard, every node on 127.0.0.1, and this process connected to it (`ray.shutdown()`, then the cluster's
    `shutdown()`, end it). Ray's token auth is off (RAY_AUTH_MODE=disabled unless set) on this loopback cluster."""
    import ray
    from ray.cluster_utils import Cluster

    from services.cluster import LOOPBACK, connect, keep_loopback

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    keep_loopback()  # the nodes' and the GCS's 127.0.0.1 stay 127.0.0.1 in this process
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": cpus, "include_dashboard": False, "node_ip_address": LOOPBACK}
    )
    # Cluster records its address as "the current cluster", which a plain ray.init() elsewhere on this machine
    # would join; this driver connects by address, so the record goes.
    ray._common.utils.reset_ray_address()
    for _ in range(worker_nodes):
        add_loopback_node(cluster, cpus=cpus)
    cluster.wait_for_nodes()
    connect(cluster.address)
    return cluster


def loopback_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """`environ` (this process's by default) for a Ray command-line tool run against a loopback Ray (`ray
    drain-node --address 127.0.0.1:PORT`): with Ray's one-machine setting, which keep_loopback makes in this process,
    so that the tool keeps 127.0.0.1 too instead of the routable address, where nothing listens."""
    return {**(os.environ if environ is None else environ), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def drain(address: str, node_id: str, deadline_s: int) -> None:
    """`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`: what a preemption notice (a spot VM's, the KubeRay
    autoscaler's) does to a Ray node. It kills nothing: whoever drains kills the node at the deadline."""
    command = [str(Path(sys.executable).with_name("ray")), "drain-node", "--address", address, "--node-id", node_id,
               "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "test: spot VM reclaimed",
               "--deadline-remaining-seconds", str(deadline_s)]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=60, env=loopback_env())


def add_loopback_node(cluster: Any, *, cpus: int = 1) -> Any:
    """A worker node of `cpus` CPUs on 127.0.0.1 joins `cluster` (as an autoscaler would bring one)."""
    from services.cluster import LOOPBACK

    return cluster.add_node(num_cpus=cpus, node_ip_address=LOOPBACK)


def descendants(pid: int) -> set[int]:
    """`pid` and every process below it (children, their children...), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        found.add(current)
        todo += [c for c in children.get(current, []) if c not in found]
    return found


def listening_addresses(pids: set[int]) -> dict[tuple[str, int], int]:
    """{(local address, port): pid} of every TCP socket in LISTEN state that one of `pids` holds (IPv4 and IPv6,
    read from /proc/net/tcp and /proc/net/tcp6, matched to the processes through their file descriptors)."""
    owners: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owners[target[8:-1]] = pid
        except OSError:  # ended meanwhile, or not ours to read
            continue
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in owners:  # 0A: TCP_LISTEN
                found[_address(local)] = owners[inode]
    return found


def on_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1, or IPv4 loopback on a dual-stack socket (::ffff:127.0.0.1)."""
    address = ipaddress.ip_address(host)
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _address(hex_address: str) -> tuple[str, int]:
    """("127.0.0.1", 8265) from /proc/net/tcp's "0100007F:2049" (each 32-bit word in host byte order)."""
    hex_ip, hex_port = hex_address.split(":")
    raw = bytes.fromhex(hex_ip)
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian words (x86, arm64)
    return str(ipaddress.ip_address(packed)), int(hex_port, 16)
