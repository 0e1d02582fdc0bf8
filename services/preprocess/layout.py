"""Where one part of a shard set goes on disk while it is made: shards, progress markers, partial files, the
held-out part and the plan; and what a run that met a full disk keeps (`kept_units`). Markers, the plan and the
manifest are written with albert_core.files.atomic_write_json.

    <output>/train/shard-XXXXX.parquet               every part's shards
    <output>/.progress/[part-k/]plan.json           the plan a part's run claimed (its fingerprint)
    <output>/.progress/[part-k/]shard-XXXXX.json    a unit's done marker (its commit point)
    <output>/.progress/manifest.lock                held while manifest.json is rewritten or a part is claimed
    <output>/.progress/[part-k/]run.lock            held by the one run writing the part, from its claim to its end
    <output>/heldout/documents.parquet | part-k.parquet
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from albert_core.examples.shards import HELDOUT_FILE, MANIFEST_FILE, TRAIN_DIR
from services.preprocess.config import Unit

PROGRESS_DIR = ".progress"  # plan.json, done markers, partial files
PLAN_FILE = "plan.json"
LOCK_FILE = "manifest.lock"  # in .progress/: held while manifest.json is rewritten or an append claims its part
RUN_LOCK_FILE = "run.lock"  # in a part's progress folder: held by the one run writing that part


class Layout:
    """Where one part's files go. Shards of every part: train/. Part 0 (a plain preprocess): progress in
    .progress/, held-out documents in heldout/documents.parquet; part k of an append: .progress/part-k/ and
    heldout/part-k.parquet."""

    def __init__(self, output: str, part: int = 0):
        self.root, self.part = Path(output), part
        self.train = self.root / TRAIN_DIR
        self.lock = self.root / PROGRESS_DIR / LOCK_FILE
        self.progress = self.root / PROGRESS_DIR / (f"part-{part}" if part else "")
        self.plan = self.progress / PLAN_FILE
        self.run_lock = self.progress / RUN_LOCK_FILE  # held by the run writing this part, while it runs
        self.manifest = self.root / MANIFEST_FILE
        self.heldout_name = f"{posixpath.dirname(HELDOUT_FILE)}/part-{part}.parquet" if part else HELDOUT_FILE
        self.heldout = self.root / self.heldout_name

    def shard(self, unit: Unit) -> Path:
        return self.train / unit.shard_name

    def marker(self, unit: Unit) -> Path:
        return self.progress / f"shard-{unit.index:05d}.json"

    def heldout_part(self, unit: Unit) -> Path:
        return self.progress / f"heldout-{unit.index:05d}.parquet"

    def pieces(self, unit: Unit) -> Path:
        """The piece counts of the unit's examples (albert_core.evaluation.unigram's format)."""
        return self.progress / f"unigram-{unit.index:05d}.npy"

    def unit_files(self, unit: Unit) -> tuple[Path, Path, Path]:
        """What a unit writes before its marker: its shard, held-out part and piece counts."""
        return self.shard(unit), self.heldout_part(unit), self.pieces(unit)

    def marked_units(self, low: int, high: int) -> list[int]:
        """The units numbered in [low, high) that have a done marker here (a stream's chunks, found on resume)."""
        found = []
        for marker in self.progress.glob("shard-*.json"):
            index = int(marker.stem.removeprefix("shard-"))
            if low <= index < high:
                found.append(index)
        return sorted(found)

    def partial(self, path: Path) -> Path:
        return self.progress / f"{path.name}.partial"


def kept_units(layout: Layout) -> str:
    """What a preprocess run that met a full disk keeps: its finished units (a rerun resumes them)."""
    done = len(list(layout.progress.glob("shard-*.json"))) if layout.progress.is_dir() else 0
    return f"the {done} finished unit(s) of {layout.progress} (the same command resumes them); manifest.json as it was"
