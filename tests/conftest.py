"""Shared fixtures. `ray_local`: one local Ray instance for the whole test session, shared by every Ray test, started
as every albert command starts it (services.cluster.connect: albert's namespace, on 127.0.0.1 only)."""

from __future__ import annotations

import os

import pytest

# The XLA tier runs in its own torch-xla virtualenv (scripts/test_xla.sh), not in the main suite.
collect_ignore = ["xla"]


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray (2 CPUs, no dashboard, on loopback only), started once per session and shut down at its end."""
    import ray

    from services.cluster import connect

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback-only test cluster
    started = not ray.is_initialized()
    if started:
        connect(num_cpus=2)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module's tests (fine-tuning tests measure nothing that more threads would help)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def default_sigint() -> None:
    """A Popen preexec_fn: SIGINT at its default in the child, so Python installs its Ctrl-C handler there even when
    the tests run with SIGINT ignored (a background job of a non-interactive shell, as some CI launchers are)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
