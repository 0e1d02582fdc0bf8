"""Downstream tasks: readers for the official GLUE, SQuAD and RACE distributions, their input features, and each
family's fine-tuning adapter (GlueData, SquadData, RaceData; docs/finetuning.md)."""

from __future__ import annotations

from pathlib import Path


class DataFormatError(ValueError):
    """A downstream data file does not have the format its task expects.

    The message names the file, the place in it (line, record or question) and what was expected.
    """

    def __init__(self, path: str | Path, where: str, problem: str):
        self.path = str(path)
        self.where = where
        self.problem = problem
        super().__init__(f"{self.path}: {where}: {problem}" if where else f"{self.path}: {problem}")
