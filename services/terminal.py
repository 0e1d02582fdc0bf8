"""What the command line shows a user: text from files and runs made safe to print, the exit statuses, and the
old spellings of renamed options.

Text from files and runs (labels, column names, file names, event messages) made safe to print on a terminal:

A label or a record can hold escape sequences (set the window title, clear the screen, move the cursor, write to the
clipboard), carriage returns that overwrite what was printed, or Unicode direction overrides that reorder it. Where
albert prints such text, `printable` shows each of those characters as a visible escape (`\\x1b`, `\\r`, `\\u202e`)
instead; newlines and tabs stay. Rich output (the live view) is printed with markup off, so `[bold]` stays text.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

# Exit statuses of every albert command (docs/guide.md, "Exit status"; `albert --help` prints them too).
EXIT_OK = 0
EXIT_FAILED = 1  # it ran and failed: a cluster job or an evaluation scheduler that failed, an unexpected error
EXIT_USAGE = 2  # the command line is wrong: an unknown option, a missing argument, options that conflict (argparse's)
EXIT_STOPPED = 3  # a pretraining run stopped early on its own (divergence with train.on_divergence = "stop")
EXIT_DATA = 65  # bad data or config: a recipe field, a --set value, a file's contents, a path that is not there
EXIT_DISK_FULL = 74  # a write met a full disk (albert_core.files.DiskFull; sysexits' EX_IOERR); the command resumes
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT); a pretraining run saved a checkpoint first
EXIT_PIPE = 141  # the output was closed (`albert ... | head`; 128 + SIGPIPE)
EXIT_TERMINATED = 143  # SIGTERM (`albert jobs stop`, Kubernetes); a pretraining run saved a checkpoint first
EXIT_CODES = {  # each meaning fits a line of `albert --help` on 80 columns
    EXIT_OK: "done",
    EXIT_FAILED: "it ran and failed: a cluster job, an evaluation scheduler, a bug",
    EXIT_USAGE: "usage: an unknown option, a missing argument, options that conflict",
    EXIT_STOPPED: "a pretraining run stopped early on a divergence (remedy printed)",
    EXIT_DATA: "bad data or config: a recipe field, a --set value, a file, a path",
    EXIT_DISK_FULL: "the disk filled up; what was kept is named, the same command resumes",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C); pretraining saves a checkpoint first",
    EXIT_PIPE: "the output was closed (albert ... | head)",
    EXIT_TERMINATED: "terminated (SIGTERM); pretraining saves a checkpoint first",
}


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `albert jobs stop`, Kubernetes), raised on the main thread: a command unwinds as after Ctrl-C
    (its KeyboardInterrupt paths: a partial summary, locks released, Ray tasks cancelled) and exits EXIT_TERMINATED."""


_sigterm_received = False  # set by the handler: code that catches Terminated and raises a plain KeyboardInterrupt
# (Ray's ray.wait and ray.get do) must not turn a SIGTERM into a Ctrl-C


def raise_on_sigterm() -> None:
    """SIGTERM raises Terminated on the main thread. `ray.init` replaces the handler with Ray's own (which exits at
    once, skipping a command's own clean-up): services.cluster.connect calls this again after it. Off the main
    thread: nothing."""
    import signal
    import threading

    def on_sigterm(signum, frame) -> None:
        global _sigterm_received
        _sigterm_received = True
        raise Terminated("terminated (SIGTERM)")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)


def interrupted_line(status: int) -> str:
    """How a command that ended with `status` (of `interrupted_status`) was stopped, for its last line."""
    return "terminated (SIGTERM)" if status == EXIT_TERMINATED else "interrupted (Ctrl-C)"


def stopped_status(signal_name: str | None) -> int:
    """The exit status of a pretraining run stopped on request: EXIT_TERMINATED after a SIGTERM, else
    EXIT_INTERRUPTED (a Ctrl-C)."""
    return EXIT_TERMINATED if signal_name == "SIGTERM" else EXIT_INTERRUPTED


def interrupted_status(interrupt: BaseException) -> int:
    """EXIT_TERMINATED when `interrupt` is, or was raised from or while handling, a Terminated, or when this process
    received a SIGTERM (a library in between may have raised its own KeyboardInterrupt instead); else
    EXIT_INTERRUPTED."""
    if _sigterm_received:
        return EXIT_TERMINATED
    seen: BaseException | None = interrupt
    while seen is not None:
        if isinstance(seen, Terminated):
            return EXIT_TERMINATED
        seen = seen.__cause__ or seen.__context__
    return EXIT_INTERRUPTED


class UsageError(ValueError):
    """A command line that cannot run as written: options that conflict or need another (exit EXIT_USAGE)."""


# C0 controls but tab and newline, DEL, C1 controls, and the Unicode bidirectional overrides and isolates.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: object) -> str:
    """`text` with every character that would act on the terminal shown as its Python escape."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))


class OldSpelling(argparse.Action):
    """Stores an option's value like `store`; given by one of its `old` spellings (e.g. --out for --output), also
    prints one deprecation line."""

    def __init__(self, option_strings: list[str], dest: str, *, old: tuple[str, ...], **kwargs: Any):
        self.old = old
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if option_string in self.old:
            new = next(s for s in self.option_strings if s not in self.old)
            print(f"albert: {option_string} is deprecated; use {new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_output_option(parser: argparse.ArgumentParser, *, help: str, **kwargs: Any) -> None:
    """`--output` (dest "output"); the old spelling --out still works, with a deprecation line."""
    help = f"{help} (--out: its old spelling, deprecated)"
    parser.add_argument("--output", "--out", dest="output", action=OldSpelling, old=("--out",), help=help, **kwargs)
