"""The XLA tier: runs in the torch-xla virtualenv (scripts/test_xla.sh), on PJRT_DEVICE=CPU unless set.

The main suite does not collect this directory. Collected anyway without torch_xla, its test modules skip with a
reason that says how to run them (each starts with pytest.importorskip("torch_xla")).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla picks its runtime


@pytest.fixture(scope="session")
def worker():
    from services.train.xla import setup_xla_worker

    return setup_xla_worker()
