"""MLM + sentence-pair training batches from pair examples, with dynamic n-gram masking.

The rows of a batch are masked together (albert_core.examples.masking), each by its tokens and its key (seed, epoch,
example id) alone: not by the batch it lands in, the worker that builds it, or the order rows arrive in. A resumed run
re-creates the same masks, and a new epoch draws new ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from albert_core.examples.masking import IGNORE_INDEX, Masked, MaskSettings, mask_rows

PAD_MULTIPLE = 8  # seq_len=None pads to the longest row rounded up to this, so few distinct shapes reach compile


def padded_length(longest: int, multiple: int = PAD_MULTIPLE) -> int:
    """``longest`` rounded up to a multiple of ``multiple`` (at least one multiple)."""
    return max(multiple, -(-longest // multiple) * multiple)


def mlm_batch(
    input_ids: Sequence[Sequence[int]],
    token_type_ids: Sequence[Sequence[int]],
    pair_labels: Sequence[int],
    word_starts: Sequence[Sequence[bool]],
    example_ids: Sequence[int],
    *,
    seed: int,
    epoch: int | Sequence[int],
    seq_len: int | None,
    vocab_size: int,
    special_ids: Iterable[int],
    mask_id: int,
    pad_id: int = 0,
    mask_prob: float = 0.15,
    max_ngram: int = 3,
) -> dict[str, np.ndarray]:
    """A masked batch: input_ids, attention_mask, token_type_ids, mlm_labels (B x T, int64) and pair_labels (B,).

    `epoch` is one epoch for every row, or one per row (a batch that crosses an epoch boundary of the example
    stream). seq_len=None pads to the longest row rounded up to a multiple of 8; an int pads every batch to exactly
    that (static shapes for XLA) and rejects longer rows. Padding has attention_mask 0, token type 0 and label -100.
    Row r is masked by its tokens and its key (seed, its epoch, example_ids[r]) alone (albert_core.examples.masking).
    """
    return mlm_batches(
        input_ids, token_type_ids, pair_labels, word_starts, example_ids, micro_batch=None, seed=seed, epoch=epoch,
        seq_len=seq_len, vocab_size=vocab_size, special_ids=special_ids, mask_id=mask_id, pad_id=pad_id,
        mask_prob=mask_prob, max_ngram=max_ngram,
    )[0]  # fmt: skip


def mlm_batches(
    input_ids: Sequence[Sequence[int]],
    token_type_ids: Sequence[Sequence[int]],
    pair_labels: Sequence[int],
    word_starts: Sequence[Sequence[bool]],
    example_ids: Sequence[int],
    *,
    micro_batch: int | None,
    seed: int,
    epoch: int | Sequence[int],
    seq_len: int | None,
    vocab_size: int,
    special_ids: Iterable[int],
    mask_id: int,
    pad_id: int = 0,
    mask_prob: float = 0.15,
    max_ngram: int = 3,
) -> list[dict[str, np.ndarray]]:
    """`mlm_batch` of each run of `micro_batch` rows (None: all of them), masked together: the masker's work is
    partly per call, so one call for a training step's micro-batches is faster than one per micro-batch. Each
    micro-batch is padded on its own, and equals what `mlm_batch` makes of its rows."""
    n_rows = len(input_ids)
    for name, column in (
        ("token_type_ids", token_type_ids),
        ("pair_labels", pair_labels),
        ("word_starts", word_starts),
        ("example_ids", example_ids),
    ):
        if len(column) != n_rows:
            raise ValueError(f"mlm_batch: {name} has {len(column)} rows but input_ids has {n_rows}")
    if n_rows == 0:
        raise ValueError("mlm_batch: empty batch (no rows)")
    if seq_len is not None and seq_len < 1:
        raise ValueError(f"mlm_batch: seq_len must be a positive int or None, got {seq_len}")
    special = [int(i) for i in special_ids]
    if pad_id not in special:
        special.append(pad_id)

    lengths = _lengths(input_ids)
    groups = [slice(a, a + (micro_batch or n_rows)) for a in range(0, n_rows, micro_batch or n_rows)]
    widths = [seq_len or padded_length(int(lengths[group].max())) for group in groups]
    example_ids = np.asarray(example_ids, dtype=np.int64).reshape(n_rows)
    for group, width in zip(groups, widths, strict=True):
        _check_rows(lengths[group], _lengths(token_type_ids[group]), _lengths(word_starts[group]),
                    example_ids[group], width, first=group.start)  # fmt: skip
    flat_ids = np.concatenate(input_ids)
    if flat_ids.dtype.kind not in "iu":  # rows given as lists, all of them empty
        flat_ids = flat_ids.astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    masked = mask_rows(
        flat_ids,
        np.concatenate(word_starts),
        offsets,
        seed=seed,
        epochs=np.broadcast_to(np.asarray(epoch, dtype=np.int64), (n_rows,)),
        example_ids=example_ids,
        settings=MaskSettings(vocab_size, tuple(special), mask_id, mask_prob, max_ngram),
    )
    flat_types = np.concatenate(token_type_ids)
    pairs = np.asarray(pair_labels, dtype=np.int64).reshape(n_rows)
    return [
        _micro_batch(group, width, offsets, flat_ids, flat_types, masked, pad_id) | {"pair_labels": pairs[group]}
        for group, width in zip(groups, widths, strict=True)
    ]


def _micro_batch(group: slice, width: int, offsets, flat_ids, flat_types, masked: Masked, pad_id: int) -> dict:
    """The padded arrays of the rows of `group` (laid end to end from offsets[group.start]), masked as `masked` says
    (its positions are ascending, so a group's are one slice of them)."""
    first, stop = group.start, min(group.stop, offsets.size - 1)
    a, b = offsets[first], offsets[stop]
    inside = np.arange(width)[None, :] < np.diff(offsets[first : stop + 1])[:, None]
    p, q = np.searchsorted(masked.positions, (a, b))
    rows = masked.rows[p:q]
    at = (rows - first) * width + masked.positions[p:q] - offsets[rows]
    input_ids = _padded(flat_ids[a:b], inside, pad_id)
    input_ids.reshape(-1)[at] = masked.inputs[p:q]
    labels = np.full(inside.shape, IGNORE_INDEX, dtype=np.int64)
    labels.reshape(-1)[at] = masked.labels[p:q]
    return {
        "input_ids": input_ids,
        "attention_mask": inside.astype(np.int64),
        "token_type_ids": _padded(flat_types[a:b], inside, 0),
        "mlm_labels": labels,
    }


def _lengths(column: Sequence[Sequence]) -> np.ndarray:
    return np.fromiter((len(row) for row in column), dtype=np.int64, count=len(column))


def _padded(flat: np.ndarray, inside: np.ndarray, fill: int) -> np.ndarray:
    """The rows laid end to end in `flat`, left-aligned in a rows x width int64 array, `fill` past each row's end."""
    out = np.full(inside.shape, fill, dtype=np.int64)
    out[inside] = flat  # row-major: the rows one after another
    return out


def _check_rows(lengths, type_lengths, start_lengths, example_ids, width: int, first: int = 0) -> None:
    """Every row fits the width and has one token type and one word-start flag per token; the first row that does
    not is named (rows numbered from `first`)."""
    bad = (lengths > width) | (type_lengths != lengths) | (start_lengths != lengths)
    if not bad.any():
        return
    r = int(np.argmax(bad))
    n, where = int(lengths[r]), f"mlm_batch: row {first + r} (example {int(example_ids[r])})"
    if n > width:
        raise ValueError(f"{where} has {n} tokens, more than seq_len={width}")
    for name, size in (("token_type_ids", type_lengths[r]), ("word_starts", start_lengths[r])):
        if size != n:
            raise ValueError(f"{where} has {int(size)} {name} for {n} input_ids")
