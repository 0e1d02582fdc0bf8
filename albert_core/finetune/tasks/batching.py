"""Batches for the task adapters: padded input tensors, prediction batches by length, moves to the device."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from albert_core.examples.batch import padded_length


def _pad(rows: Sequence[Sequence[int]], width: int, value: int) -> Tensor:
    out = np.full((len(rows), width), value, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out)


def text_batch(rows: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, Tensor]:
    """input_ids / token_type_ids / attention_mask for (ids, types) rows, padded to the longest (rounded to 8)."""
    width = padded_length(max(len(ids) for ids, _ in rows))
    return {
        "input_ids": _pad([ids for ids, _ in rows], width, pad_id),
        "token_type_ids": _pad([types for _, types in rows], width, 0),
        "attention_mask": _pad([[1] * len(ids) for ids, _ in rows], width, 0),
    }


def by_length(lengths: Sequence[int], batch_size: int) -> Iterator[np.ndarray]:
    """Index batches in decreasing length (little padding at prediction time)."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def to_device(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
