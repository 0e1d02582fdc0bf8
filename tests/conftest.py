"""Shared fixtures. `ray_local`: one local Ray instance for the whole test session, shared by every Ray test, started
as every albert command starts it (services.cluster.connect: albert's namespace, on 127.0.0.1 only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The XLA tier runs in its own torch-xla virtualenv (scripts/test_xla.sh), not in the main suite.
collect_ignore = ["xla"]

CHECKOUT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def away_from_the_checkout(tmp_path_factory):
    """Every test runs in a scratch working directory, never in the checkout: what the main job (or any earlier run)
    left there under relative paths (`.cache/albert/`, `runs/`) is not seen by the suite, and the suite leaves
    nothing there. Tests that need the checkout name it (CHECKOUT, or cwd=ROOT in a subprocess)."""
    before, path = Path.cwd(), os.environ.get("PYTHONPATH")
    # Ray workers find the checkout's packages (tests/ too: the step callbacks tests install) through PYTHONPATH,
    # not through the working directory they would otherwise inherit from the driver.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHECKOUT), path) if p)
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(before)
    if path is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = path


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
