"""Ctrl-C during a long driver call: the first SIGINT asks for a graceful stop, a second one stops at once.

Ray Train's `fit()` installs its own SIGINT handler when it runs on the main thread: it aborts the run without a
checkpoint, and a run still waiting for its workers ignores it. So the driver runs `fit()` on a helper thread and
keeps SIGINT on the main thread, where `run_interruptibly` handles it.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class StoppedAtOnce(KeyboardInterrupt):
    """The second Ctrl-C (or the first, when the call has no graceful stop): the call was abandoned."""


def run_interruptibly(call: Callable[[], T], *, graceful_stop: Callable[[], None] | None, what: str) -> T:
    """Run `call` on a daemon thread while the main thread keeps SIGINT; returns its value or raises its error.

    The first Ctrl-C calls `graceful_stop` (for training: checkpoint at the next step and end there) and waits on;
    a second one raises StoppedAtOnce. Off the main thread (a test's, a Ray job's helper) `call` runs directly.
    """
    if threading.current_thread() is not threading.main_thread():
        return call()
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as err:  # handed to the main thread as it is
            outcome["error"] = err

    presses = 0

    def on_sigint(signum, frame) -> None:
        nonlocal presses
        presses += 1
        if presses == 1 and graceful_stop is not None:
            print(
                f"albert: Ctrl-C: {what} stops after saving a checkpoint at its next step (Ctrl-C again: stop at once)",
                file=sys.stderr,
                flush=True,
            )
            graceful_stop()
            return
        raise StoppedAtOnce(f"{what}: stopped at once on Ctrl-C")

    thread = threading.Thread(target=target, name=what, daemon=True)
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
    finally:
        signal.signal(signal.SIGINT, previous)
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
