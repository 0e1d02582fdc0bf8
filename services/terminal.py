"""Text from files and runs (labels, column names, file names, event messages) made safe to print on a terminal.

A label or a record can hold escape sequences (set the window title, clear the screen, move the cursor, write to the
clipboard), carriage returns that overwrite what was printed, or Unicode direction overrides that reorder it. Where
albert prints such text, `printable` shows each of those characters as a visible escape (`\\x1b`, `\\r`, `\\u202e`)
instead; newlines and tabs stay. Rich output (the live view) is printed with markup off, so `[bold]` stays text.
"""

from __future__ import annotations

import re

# C0 controls but tab and newline, DEL, C1 controls, and the Unicode bidirectional overrides and isolates.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: object) -> str:
    """`text` with every character that would act on the terminal shown as its Python escape."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))
