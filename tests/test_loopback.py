"""The Ray that albert starts itself listens on 127.0.0.1 only: every node has the loopback address, and no port its
processes (GCS, raylet, object manager, agents, workers, the driver) listen on is open on another interface.

The session's Ray (tests/conftest.py's `ray_local`) is started as every albert command starts an embedded Ray
(services.cluster.connect); the multi-node cluster of tests/test_faults.py is checked there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.ray_clusters import descendants, listening_addresses, on_loopback

pytestmark = [pytest.mark.ray]


def test_every_node_of_the_local_ray_has_the_loopback_address(ray_local):
    nodes = [n for n in ray_local.nodes() if n["Alive"]]
    assert nodes and {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}


def test_no_port_of_the_local_ray_listens_beyond_loopback(ray_local):
    @ray_local.remote(num_cpus=0)
    class Pid:
        def get(self) -> int:
            return os.getpid()

    actor = Pid.remote()
    worker = ray_local.get(actor.get.remote())  # a worker process, with its own server, is up
    listening = listening_addresses(descendants(os.getpid()))
    names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in listening.values()}
    assert {"gcs_server", "raylet"} <= names and worker in listening.values(), "the reader sees Ray's servers"
    assert sorted(address for address in listening if not on_loopback(address[0])) == []
    ray_local.kill(actor)
