"""Shared fixtures."""

import pytest
import ray


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the whole test session (2 CPUs, no dashboard)."""
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()
