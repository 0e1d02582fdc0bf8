"""The batch masker gives exactly the per-row masks: every draw of numpy's per-example generators, reproduced.

`albert_core.examples.batch.mlm_batch` masks all rows at once (albert_core.examples.masking_batch,
albert_core.examples.pcg64); the reference is `mlm_batch_per_row`, the row-by-row code through ``ngram_mask`` and
``example_rng``. Equality is checked array for array on many random rows of every special-token layout, both pair
objectives' layout and the MLM-only one.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import albert_core.examples.masking_batch as masking_batch
from albert_core.examples.batch import mlm_batch, mlm_batch_per_row
from albert_core.examples.masking import example_rng
from albert_core.examples.pcg64 import RowStreams, seed_pools

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
SPECIAL = frozenset((PAD, UNK, CLS, SEP, MASK))
SEEDS = (0, 1, 12345, 2**32 + 5, 2**70 + 3)


def stream_rows(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    epochs = rng.integers(0, 5, n)
    ids = rng.integers(0, 2**40, n)
    epochs[:2], ids[:4] = (0, 2**33), (0, 2**32 - 1, 2**32, 7)  # one word and two words of SeedSequence entropy
    return epochs, ids


@pytest.mark.parametrize("seed", SEEDS)
def test_seed_pools_are_seed_sequences_pools(seed):
    epochs, ids = stream_rows(40, np.random.default_rng(seed % 1000))
    pools = seed_pools(seed, epochs, ids)
    for r in range(40):
        expected = np.random.SeedSequence(seed, spawn_key=(int(epochs[r]), int(ids[r]))).pool
        np.testing.assert_array_equal(pools[r], expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_row_streams_draw_what_each_rows_generator_draws(seed):
    rng = np.random.default_rng(seed % 1000 + 1)
    epochs, ids = stream_rows(30, rng)
    streams = RowStreams(seed, epochs, ids)
    start, virtual = rng.integers(0, 300, 30), rng.integers(0, 600, 30)
    block, halves_block = streams.block(start, 37), streams.u32_block(virtual, 21)
    every = streams.u64(np.repeat(np.arange(30), 400), np.tile(np.arange(400), 30)).reshape(30, 400)
    for r in range(30):
        generator = example_rng(seed, int(epochs[r]), int(ids[r]))
        raw = generator.bit_generator.random_raw(400)
        np.testing.assert_array_equal(every[r], raw)
        np.testing.assert_array_equal(block[r], raw[start[r] : start[r] + 37])
        halves = np.stack([raw & 0xFFFFFFFF, raw >> 32], axis=1).ravel()  # pcg64_next32: low half first
        np.testing.assert_array_equal(halves_block[r], halves[virtual[r] : virtual[r] + 21])
        doubles = streams.doubles(np.full(5, r), np.arange(5))
        np.testing.assert_array_equal(doubles, example_rng(seed, int(epochs[r]), int(ids[r])).random(5))


# --------------------------------------------------------------------------------------------------------------
# whole batches

LAYOUTS = ("pair", "single", "plain", "scattered", "only_special", "short")


def make_row(layout: str, length: int, rng: np.random.Generator, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and word starts of one row: `pair` is [CLS] A [SEP] B [SEP] (SOP and NSP), `single` [CLS] A [SEP]
    (MLM only), `plain` no special tokens, `scattered` special ids anywhere (runs of them, padding inside),
    `only_special` nothing else, `short` a pair of 1-6 tokens."""
    if layout == "short":
        length = int(rng.integers(1, 7))
    ids = rng.integers(5, vocab, length)
    starts = rng.random(length) < rng.uniform(0.3, 1.0)
    if layout in ("pair", "short") and length >= 3:
        sep = int(rng.integers(1, length - 1))
        ids[[0, sep, length - 1]] = (CLS, SEP, SEP)
    elif layout == "single" and length >= 2:
        ids[[0, length - 1]] = (CLS, SEP)
    elif layout == "scattered":
        at = rng.random(length) < 0.15
        ids[at] = rng.choice(sorted(SPECIAL), size=int(at.sum()))
    elif layout == "only_special":
        ids[:] = rng.choice(sorted(SPECIAL), size=length)
    return ids, starts


def random_batch(rng: np.random.Generator, layouts=LAYOUTS, lengths=(8, 40, 128, 512)):
    n = int(rng.integers(1, 70))
    vocab = int(rng.choice([300, 30_000]))
    longest = int(rng.choice(lengths))
    rows = [make_row(str(rng.choice(layouts)), int(rng.integers(1, longest + 1)), rng, vocab) for _ in range(n)]
    options = {
        "seed": int(rng.choice(SEEDS)),
        "epoch": rng.integers(0, 4, n) if rng.random() < 0.5 else int(rng.integers(0, 4)),
        "seq_len": None if rng.random() < 0.7 else max(len(ids) for ids, _ in rows) + int(rng.integers(0, 9)),
        "vocab_size": vocab,
        "special_ids": SPECIAL,
        "mask_id": MASK,
        "mask_prob": float(rng.choice([0.15, 0.15, 0.05, 0.3, 1.0])),
        "max_ngram": int(rng.integers(1, 5)),
    }
    columns = (
        [ids for ids, _ in rows],
        [np.zeros(len(ids), dtype=np.int64) for ids, _ in rows],
        rng.integers(0, 2, n).tolist(),
        [starts for _, starts in rows],
        rng.integers(0, 2**40, n).tolist(),
    )
    return columns, options


def assert_same_batches(columns, options) -> None:
    got, expected = mlm_batch(*columns, **options), mlm_batch_per_row(*columns, **options)
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key].dtype == expected[key].dtype
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_masks_equal_the_per_row_masks_for_every_layout(layout):
    rng = np.random.default_rng(LAYOUTS.index(layout))
    for _ in range(12):
        assert_same_batches(*random_batch(rng, layouts=(layout,)))


def test_batch_masks_equal_the_per_row_masks_on_mixed_batches():
    rng = np.random.default_rng(99)
    for _ in range(25):
        assert_same_batches(*random_batch(rng))


def realistic_rows(n: int, length: int, rng: np.random.Generator):
    """Full-length [CLS] A [SEP] B [SEP] rows of Zipf-distributed pieces, three quarters of them word starts."""
    ids, starts = zip(*(make_row("pair", length, rng, 30_000) for _ in range(n)), strict=True)
    return list(ids), [np.zeros(length, dtype=np.int64)] * n, [0] * n, list(starts), list(range(n))


def test_the_per_row_code_masks_almost_no_realistic_row(monkeypatch):
    calls = []
    per_row = masking_batch.ngram_mask
    monkeypatch.setattr(masking_batch, "ngram_mask", lambda *a, **k: calls.append(1) or per_row(*a, **k))
    rng = np.random.default_rng(5)
    for length in (128, 512):
        columns = realistic_rows(400, length, rng)
        options = {"seed": 3, "epoch": 1, "seq_len": None, "vocab_size": 30_000, "special_ids": SPECIAL, "mask_id": 4}
        assert_same_batches(columns, options)
    assert len(calls) < 800 // 100  # under 1% of the 800 rows (mlm_batch_per_row calls its own ngram_mask)


def test_rows_whose_permutation_needs_long_runs_of_draws_still_match(monkeypatch):
    monkeypatch.setattr(masking_batch, "_WINDOW", 1)  # every rejected draw goes to the row-by-row loop
    rng = np.random.default_rng(11)
    for _ in range(5):
        assert_same_batches(*random_batch(rng, layouts=("pair", "scattered")))


ROW = st.lists(st.tuples(st.integers(0, 12), st.booleans()), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(ROW, min_size=1, max_size=8), seed=st.integers(0, 2**40), epoch=st.integers(0, 3))
def test_any_rows_of_a_small_vocabulary_mask_as_the_per_row_code(rows, seed, epoch):
    columns = (
        [[token for token, _ in row] for row in rows],
        [[0] * len(row) for row in rows],
        [0] * len(rows),
        [[start for _, start in row] for row in rows],
        list(range(len(rows))),
    )
    options = {"seed": seed, "epoch": epoch, "seq_len": None, "vocab_size": 13, "special_ids": SPECIAL, "mask_id": 4}
    assert_same_batches(columns, options)
