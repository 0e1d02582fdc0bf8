"""The unigram floor of MLM: predicting every masked piece from the training shards' piece frequencies alone.

Early MLM training first learns exactly this predictor (the most frequent pieces), then leaves it once context
starts to help. A held-out MLM accuracy is only meaningful next to the floor on the same masked positions, so
evaluation scores both (`albert_core.evaluation.intrinsic`), and a run's health check compares them.

`UnigramBaseline` holds the piece counts of a shard set: computed once per shard set by `count_pieces` and stored
beside its manifest as `unigram.npy` (plain int64 counts; numpy format, loaded without pickle).
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

UNIGRAM_FILE = "unigram.npy"  # a shard set's counts before they were kept per part and version


def part_unigram_file(part: int) -> str:
    """Part k's piece counts, relative to the shard set."""
    return f"unigram/part-{part}.npy"


def version_unigram_file(version: int) -> str:
    """The piece counts of a shard set's version v (its first v parts), relative to the shard set."""
    return f"unigram/version-{version}.npy"


@dataclass(frozen=True)
class UnigramBaseline:
    """Piece counts over the training shards (special pieces count 0)."""

    counts: np.ndarray  # (V,) int64

    @property
    def vocab_size(self) -> int:
        return int(self.counts.size)

    @property
    def prediction(self) -> int:
        """The piece the unigram predictor always answers: the most frequent one."""
        return int(np.argmax(self.counts))

    def log_probs(self) -> np.ndarray:
        """Add-one smoothed log frequencies of every piece."""
        smoothed = self.counts.astype(np.float64) + 1.0
        return np.log(smoothed / smoothed.sum())

    def score(self, labels: np.ndarray) -> tuple[int, float]:
        """(correct predictions, summed negative log-likelihood) of the unigram predictor on these target pieces."""
        labels = np.asarray(labels, dtype=np.int64)
        if labels.size and (labels.min() < 0 or labels.max() >= self.vocab_size):
            raise ValueError(f"unigram baseline: target piece outside its vocabulary of {self.vocab_size}")
        return int((labels == self.prediction).sum()), float(-self.log_probs()[labels].sum())

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / UNIGRAM_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        self.save_as(tmp)
        tmp.replace(path)
        return path

    def save_as(self, path: str | Path) -> Path:
        """The counts written to exactly this file (no suffix added, not atomic: the caller renames it). Made in memory
        first: numpy's own write to a file says a full disk only as "N requested and M written", without its errno."""
        data = io.BytesIO()
        np.save(data, self.counts.astype(np.int64), allow_pickle=False)
        with open(path, "wb") as f:
            f.write(data.getvalue())
        return Path(path)

    @classmethod
    def load(cls, directory: str | Path, vocab_size: int | None = None) -> UnigramBaseline:
        return cls.load_file(Path(directory) / UNIGRAM_FILE, vocab_size)

    @classmethod
    def load_file(cls, path: str | Path, vocab_size: int | None = None) -> UnigramBaseline:
        try:
            counts = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: not a unigram counts file ({err})") from None
        if counts.ndim != 1 or counts.dtype.kind not in "iu" or (counts < 0).any():
            raise ValueError(
                f"{path}: expected one non-negative integer count per piece, got {counts.dtype}{counts.shape}"
            )
        if vocab_size is not None and counts.size != vocab_size:
            raise ValueError(f"{path}: counts for {counts.size} pieces, the vocabulary has {vocab_size}")
        return cls(counts.astype(np.int64))


def count_pieces(shard_files: Iterable[str | Path], vocab_size: int, special_ids: Iterable[int]) -> UnigramBaseline:
    """Count every piece of the `input_ids` column of these Parquet shards; special pieces are never targets."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for path in shard_files:
        for batch in pq.ParquetFile(path).iter_batches(columns=["input_ids"], batch_size=8192):  # bounded memory
            ids = batch.column(0).flatten().to_numpy(zero_copy_only=False)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(f"{path}: input_ids hold a piece outside the vocabulary of {vocab_size}")
            counts += np.bincount(ids, minlength=vocab_size)
    counts[list(special_ids)] = 0
    return UnigramBaseline(counts)


def stored_file(shards_dir: str | Path, version: int | None = None) -> Path | None:
    """Where a shard set keeps the piece counts of `version` (None: the newest its manifest names; a set made
    before counts were kept per version has one unigram.npy), or None when it keeps none."""
    from albert_core.examples.shards import ShardsManifest

    shards_dir = Path(shards_dir)
    if version is not None:
        path = shards_dir / version_unigram_file(version)
        return path if path.is_file() else None
    named = ShardsManifest.read(shards_dir).data.get("unigram") or {}
    for path in (shards_dir / str(named.get("file", "")), shards_dir / UNIGRAM_FILE):
        if path.is_file():
            return path
    return None


def load_or_count(
    shards_dir: str | Path,
    shard_files: Iterable[str | Path],
    vocab_size: int,
    special_ids: Iterable[int],
    version: int | None = None,
) -> UnigramBaseline:
    """The shard set's stored baseline (of `version`, else its newest), or counted now over `shard_files` and
    stored beside the manifest (as that version's file, else as unigram.npy)."""
    stored = stored_file(shards_dir, version)
    if stored is not None:
        try:
            return UnigramBaseline.load_file(stored, vocab_size)
        except ValueError:
            pass  # a stale or damaged file: count again
    baseline = count_pieces(shard_files, vocab_size, special_ids)
    path = Path(shards_dir) / (version_unigram_file(version) if version is not None else UNIGRAM_FILE)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        baseline.save_as(path.with_name(f".{path.name}.tmp")).replace(path)
    except OSError:
        pass  # a read-only shard set: the counts still serve this process
    return baseline
