"""The tiny model and real masked batches the XLA tier trains on."""

from __future__ import annotations

import numpy as np

from albert_core.examples.batch import mlm_batch
from albert_core.model.config import AlbertConfig

PAD, CLS, SEP, MASK = 0, 2, 3, 4
SPECIAL = (PAD, CLS, SEP)
BUCKETS = (32, 64)


def tiny_config(**overrides) -> AlbertConfig:
    """albert-tiny cut down: 2 layers, H=64, E=32, vocab 200, no dropout (XLA and CPU draw different masks)."""
    fields = dict(
        vocab_size=200,
        embedding_size=32,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
    )
    return AlbertConfig.preset("albert-tiny", **{**fields, **overrides})


def pair_batch(
    lengths: list[int], *, seed: int, vocab_size: int = 200, first_id: int = 0, seq_len: int | None = None
) -> dict[str, np.ndarray]:
    """A real masked MLM/SOP batch (albert_core.examples.batch.mlm_batch) of random pair rows with the given lengths."""
    rng = np.random.default_rng(seed)
    ids, types, words = [], [], []
    for length in lengths:
        len_a = int(rng.integers(1, length - 3))
        row = rng.integers(5, vocab_size, size=length)
        row[[0, len_a + 1, length - 1]] = (CLS, SEP, SEP)
        starts = rng.random(length) < 0.75
        starts[[0, len_a + 1, length - 1]] = True
        ids.append(row.tolist())
        types.append([0] * (len_a + 2) + [1] * (length - len_a - 2))
        words.append(starts.tolist())
    return mlm_batch(
        ids,
        types,
        rng.integers(2, size=len(lengths)).tolist(),
        words,
        list(range(first_id, first_id + len(lengths))),
        seed=seed,
        epoch=0,
        seq_len=seq_len,
        vocab_size=vocab_size,
        special_ids=SPECIAL,
        mask_id=MASK,
    )
