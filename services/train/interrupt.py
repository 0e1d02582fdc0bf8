"""Ctrl-C and SIGTERM during a long driver call: the first asks for a graceful stop, a second one stops at once.

Ray Train's `fit()` installs its own SIGINT handler when it runs on the main thread: it aborts the run without a
checkpoint, and a run still waiting for its workers ignores it. So the driver runs `fit()` on a helper thread and
keeps SIGINT and SIGTERM on the main thread, where `run_interruptibly` handles them. SIGTERM is what `albert jobs
stop`, Ray's job supervisor and Kubernetes send: its graceful stop is bounded (train.stop_grace_s), since SIGKILL
follows it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)
HANDLED = (signal.SIGINT, signal.SIGTERM)


class StoppedAtOnce(KeyboardInterrupt):
    """The call was abandoned without a graceful stop: a second signal, the first when the call has none, or a SIGTERM
    whose graceful stop did not end within its grace period. `signal_name`: the signal that ended it."""

    def __init__(self, message: str, signal_name: str = "SIGINT"):
        super().__init__(message)
        self.signal_name = signal_name

    @property
    def exit_status(self) -> int:
        return 128 + int(signal.Signals[self.signal_name])


def describe(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def run_interruptibly(
    call: Callable[[], T],
    *,
    graceful_stop: Callable[[str], None] | None,
    what: str,
    grace_s: float | None = None,
) -> T:
    """Run `call` on a daemon thread while the main thread keeps SIGINT and SIGTERM; returns its value or raises its
    error.

    The first signal calls `graceful_stop` with its name (for training: checkpoint at the next step and end there)
    and waits on; a second one raises StoppedAtOnce. After a SIGTERM the wait lasts at most `grace_s` seconds (None:
    as long as it takes), then StoppedAtOnce. Off the main thread (a test's helper) `call` runs directly.
    """
    if threading.current_thread() is not threading.main_thread():
        return call()
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as err:  # handed to the main thread as it is
            outcome["error"] = err

    signals: list[int] = []
    deadline: list[float] = []

    def on_signal(signum, frame) -> None:
        signals.append(signum)
        name = signal.Signals(signum).name
        if len(signals) == 1 and graceful_stop is not None:
            bound = f" (at most {grace_s:g} s)" if signum == signal.SIGTERM and grace_s is not None else ""
            print(
                f"albert: {describe(signum)}: {what} stops after saving a checkpoint at its next step{bound} "
                f"({describe(signum)} again: stop at once)",
                file=sys.stderr,
                flush=True,
            )
            if signum == signal.SIGTERM and grace_s is not None:
                deadline.append(time.monotonic() + grace_s)
            graceful_stop(name)
            return
        raise StoppedAtOnce(f"{what}: stopped at once on {describe(signum)}", name)

    thread = threading.Thread(target=target, name=what, daemon=True)
    previous = {signum: signal.signal(signum, on_signal) for signum in HANDLED}
    try:
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            if deadline and time.monotonic() > deadline[0] and thread.is_alive():
                raise StoppedAtOnce(
                    f"{what}: its next step did not end within {grace_s:g} s of SIGTERM; stopped without a checkpoint",
                    "SIGTERM",
                )
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


_RAY_SIGTERM: list = []  # in a Ray Train worker process: Ray's own SIGTERM handler (it exits the process)
_SIGTERM_SENDERS: list[threading.Event] = []  # the thread of the handler installed now waits on its event


def ask_to_stop_on_sigterm(coordinator: str, rank: int) -> None:
    """In a Ray Train worker process: a SIGTERM (a node shutting down, Kubernetes deleting the pod, `kill PID`) asks
    the run, through its coordinator, for the same graceful stop as the driver's: every worker saves a checkpoint
    at its next step and stops. Must run on the process's main thread (Ray's own handler there would exit it).

    The handler only sets an event: a thread of its own makes the Ray calls. A handler runs on the main thread
    inside whatever actor task runs Python there, and Ray calls made from it crashed the worker (the soak's
    worker_sigterm: `Check failed: task_index_ == 0` in Ray's SetCurrentTask), which then lost the steps since the
    last checkpoint."""
    import ray

    from services import RAY_NAMESPACE

    where = f"worker rank {rank} (pid {os.getpid()}, node {ray.get_runtime_context().get_node_id()[:12]})"
    asked = threading.Event()

    def send() -> None:
        asked.wait()
        if asked in _SIGTERM_SENDERS:  # not uninstalled meanwhile
            ray.get_actor(coordinator, namespace=RAY_NAMESPACE).request_stop.remote("SIGTERM", where)

    def on_sigterm(signum, frame) -> None:
        asked.set()

    threading.Thread(target=send, name="albert-sigterm", daemon=True).start()
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    _SIGTERM_SENDERS.append(asked)
    if not _RAY_SIGTERM:
        _RAY_SIGTERM.append(previous)


def leave_sigterm_to_ray() -> None:
    """Undo `ask_to_stop_on_sigterm` (on the process's main thread): Ray's handler again; its thread ends."""
    if _RAY_SIGTERM:
        signal.signal(signal.SIGTERM, _RAY_SIGTERM[0])
    while _SIGTERM_SENDERS:
        _SIGTERM_SENDERS.pop().set()


@contextlib.contextmanager
def stop_gracefully_on_sigterm(coordinator: str, rank: int) -> Iterator[bool]:
    """From the training thread of a Ray Train worker, around its training: `ask_to_stop_on_sigterm` on the worker
    actor's main thread (the actor runs its calls there), and Ray's handler back once training returned or failed:
    a SIGTERM then is Ray tearing the worker group down (after another worker failed), which must not stop the run.
    Yields False, and the worker keeps Ray's handler, where installing fails."""
    installed = _on_actor_thread(ask_to_stop_on_sigterm, coordinator, rank)
    if not installed:
        log.warning("rank %d: SIGTERM to this worker will not checkpoint first", rank)
    try:
        yield installed
    finally:
        if installed:
            _on_actor_thread(leave_sigterm_to_ray)


def _on_actor_thread(fn: Callable[..., None], *args) -> bool:
    """Run fn(*args) on the current Ray actor's main thread; False (logged) where that fails."""
    import ray
    from ray.exceptions import RayError

    try:
        actor = ray.get_runtime_context().current_actor
        ray.get(actor.execute.remote(fn, *args), timeout=30)
    except (RayError, AttributeError, ValueError) as err:
        log.warning("%s on the worker's main thread failed: %s", fn.__name__, err)
        return False
    return True
