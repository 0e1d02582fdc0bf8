"""The unigram floor of MLM: predicting every masked piece from the training shards' piece frequencies alone.

Early MLM training first learns exactly this predictor (the most frequent pieces), then leaves it once context
starts to help. A held-out MLM accuracy is only meaningful next to the floor on the same masked positions, so
evaluation scores both (`albert_core.evaluation`), and a run's health check compares them.

`UnigramBaseline` holds the piece counts of a shard set: computed once per shard set by `count_pieces` and stored
beside its manifest as `unigram.npy` (plain int64 counts; numpy format, loaded without pickle).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

UNIGRAM_FILE = "unigram.npy"


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
        with open(tmp, "wb") as f:
            np.save(f, self.counts.astype(np.int64), allow_pickle=False)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, directory: str | Path, vocab_size: int | None = None) -> UnigramBaseline:
        path = Path(directory) / UNIGRAM_FILE
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
        column = pq.read_table(path, columns=["input_ids"]).column("input_ids").combine_chunks()
        ids = column.values.to_numpy(zero_copy_only=False).astype(np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"{path}: input_ids hold a piece outside the vocabulary of {vocab_size}")
        counts += np.bincount(ids, minlength=vocab_size)
    counts[list(special_ids)] = 0
    return UnigramBaseline(counts)


def load_or_count(
    shards_dir: str | Path, shard_files: Iterable[str | Path], vocab_size: int, special_ids: Iterable[int]
) -> UnigramBaseline:
    """The shard set's stored baseline, or count it now and store it beside the manifest."""
    shards_dir = Path(shards_dir)
    if (shards_dir / UNIGRAM_FILE).is_file():
        try:
            return UnigramBaseline.load(shards_dir, vocab_size)
        except ValueError:
            pass  # a stale or damaged file: count again
    baseline = count_pieces(shard_files, vocab_size, special_ids)
    try:
        baseline.save(shards_dir)
    except OSError:
        pass  # a read-only shard set: the counts still serve this process
    return baseline
