"""n-gram whole-word masking: the paper's distribution is the specification (DESIGN.md §3), checked statistically.

The masker (albert_core.examples.masking) is the definition of the masks, so nothing is compared bit for bit with
another implementation; instead: 15% of the real tokens, p(n) proportional to 1/n for spans of n <= 3 whole words,
80/10/10, never a special token, and each row's mask a function of its tokens and key alone. Every check runs on
fixed seeds; each tolerance is a bound derived in its test (binomial standard errors, chi-square quantiles at
p = 1e-6), not a number fitted to the result.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2

from albert_core.examples import draws
from albert_core.examples.batch import mlm_batches
from albert_core.examples.masking import IGNORE_INDEX, MASK_SCHEME, MaskSettings, mask_rows, ngram_probs

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
SPECIAL = (PAD, UNK, CLS, SEP, MASK)
VOCAB = 30_000
SETTINGS = MaskSettings(VOCAB, SPECIAL, MASK)
P_FALSE_ALARM = 1e-6  # each statistical test fails a correct masker with about this probability
Z = 4.9  # the two-sided normal quantile of P_FALSE_ALARM


def make_example(rng: np.random.Generator, length: int = 512, segments: int = 2, pad: int = 0):
    """[CLS] A [SEP] B [SEP] (segments=2) or [CLS] A [SEP] (1), then `pad` pads, with English-like words of 1-4
    pieces, mostly 1 (as SentencePiece on prose)."""
    real = length - pad
    ids = rng.integers(5, VOCAB, size=length)
    pieces = rng.choice([1, 2, 3, 4], size=real, p=[0.72, 0.18, 0.07, 0.03])
    word_starts = np.zeros(length, dtype=bool)
    starts = np.cumsum(pieces) - pieces
    word_starts[starts[starts < real]] = True
    specials = [0, real - 1] + ([int(rng.integers(real // 5, real - real // 5))] if segments == 2 else [])
    ids[specials], word_starts[specials] = (CLS, SEP, SEP)[: len(specials)], True
    ids[real:], word_starts[real:] = PAD, True
    return ids, word_starts


def masked(examples, *, seed: int = 0, epoch: int = 0, first_id: int = 0, settings=SETTINGS):
    """(originals, inputs, labels), each rows x length, and the Masked of the examples (one length) in one call."""
    ids = np.stack([e[0] for e in examples])
    starts = np.stack([e[1] for e in examples])
    n_rows, length = ids.shape
    result = mask_rows(ids.ravel(), starts.ravel(), np.arange(n_rows + 1) * length, seed=seed,
                       epochs=np.full(n_rows, epoch), example_ids=np.arange(first_id, first_id + n_rows),
                       settings=settings)  # fmt: skip
    inputs, labels = ids.copy(), np.full(ids.shape, IGNORE_INDEX)
    inputs.reshape(-1)[result.positions] = result.inputs
    labels.reshape(-1)[result.positions] = result.labels
    return ids, inputs, labels, result


@pytest.fixture(scope="module")
def stats():
    """3,000 masked 512-token examples of two segments, 3,000 of 128 tokens."""
    rng = np.random.default_rng(1234)
    out = {}
    for length in (512, 128):
        examples = [make_example(rng, length) for _ in range(3000)]
        out[length] = (*masked(examples, seed=8), np.stack([ws for _, ws in examples]))
    return out


def word_boundaries(ids: np.ndarray, word_starts: np.ndarray) -> np.ndarray:
    """boundary[i]: a word may start at i (a flagged piece, a special token, after a special token, or the end)."""
    special = np.isin(ids, SPECIAL)
    boundary = np.ones(ids.size + 1, dtype=bool)
    boundary[:-1] = word_starts | special
    boundary[1:-1] |= special[:-1]
    return boundary


def test_ngram_probabilities_are_harmonic():
    np.testing.assert_allclose(ngram_probs(3), [6 / 11, 3 / 11, 2 / 11])
    np.testing.assert_allclose(ngram_probs(1), [1.0])


@pytest.mark.parametrize(("length", "max_ngram"), [(512, 3), (128, 3), (512, 5)])
def test_span_lengths_follow_the_harmonic_distribution(length, max_ngram):
    """One-segment rows, where no span is dropped for crossing a [SEP]: the spans taken and dropped by step 4 are
    stopping times over i.i.d. lengths, so the kept spans' lengths are distributed as p(n) (Wald's identity).
    Pearson's chi-square against p(n), below its 1 - 1e-6 quantile."""
    rng = np.random.default_rng(length + max_ngram)
    examples = [make_example(rng, length, segments=1) for _ in range(1500)]
    words = masked(examples, seed=3, settings=MaskSettings(VOCAB, SPECIAL, MASK, max_ngram=max_ngram))[3].span_words
    observed = np.bincount(words, minlength=max_ngram + 1)[1:]
    expected = ngram_probs(max_ngram) * words.size
    assert observed.sum() == words.size  # no span longer than max_ngram
    assert ((observed - expected) ** 2 / expected).sum() < chi2.ppf(1 - P_FALSE_ALARM, df=max_ngram - 1)


@pytest.mark.parametrize("length", [512, 128])
def test_each_row_predicts_its_budget_of_15_percent_less_under_one_span(stats, length):
    """The budget is round(0.15 x real tokens) and never exceeded; dropping whole spans from the front undershoots
    it by less than the span straddling the overshoot, whose mean is the size-biased span mean E[X^2] / E[X]."""
    originals, _, labels, _, _ = stats[length]
    real = (~np.isin(originals, SPECIAL)).sum(axis=1)
    budget = np.floor(real * 0.15 + 0.5)
    predicted = (labels != IGNORE_INDEX).sum(axis=1)
    assert (predicted <= budget).all()
    span_tokens = np.diff(np.flatnonzero(np.diff(np.r_[False, labels.ravel() != IGNORE_INDEX, False])))[::2]
    assert (budget - predicted).mean() < (span_tokens**2).mean() / span_tokens.mean()
    assert abs(budget.sum() / real.sum() - 0.15) <= 0.5 / real.min()  # rounding each row's budget


@pytest.mark.parametrize("length", [512, 128])
def test_chosen_tokens_split_80_mask_10_random_10_kept(stats, length):
    """Each chosen token's action is an independent draw: binomial proportions within Z standard errors. A random
    id equal to the original (p = 1/29,995) counts as kept, well inside the tolerance."""
    originals, inputs, labels, _, _ = stats[length]
    chosen = labels != IGNORE_INDEX
    n = chosen.sum()
    for share, expected in (
        ((inputs[chosen] == MASK).mean(), 0.8),
        ((inputs[chosen] == originals[chosen]).mean(), 0.1),
        (((inputs[chosen] != MASK) & (inputs[chosen] != originals[chosen])).mean(), 0.1),
    ):
        assert abs(share - expected) < Z * np.sqrt(expected * (1 - expected) / n)


def test_random_replacements_are_uniform_over_the_non_special_ids():
    """vocab 12: ids 0-4 are special or [MASK], so random ids are 5-11, each with probability 1/7 (chi-square)."""
    rng = np.random.default_rng(0)
    examples = []
    for _ in range(400):
        ids, ws = make_example(rng, 512)
        examples.append((np.where(np.isin(ids, SPECIAL), ids, 5 + ids % 7), ws))
    originals, inputs, labels, _ = masked(examples, settings=MaskSettings(12, SPECIAL, MASK))
    chosen = labels != IGNORE_INDEX
    action_random = chosen & (inputs != MASK) & (inputs != originals)
    assert np.isin(inputs[action_random], np.arange(5, 12)).all()
    replaced = inputs[chosen & (inputs != MASK)]  # random (any id of 5-11) and kept (uniform too: 5 + id % 7)
    observed = np.bincount(replaced, minlength=12)[5:]
    expected = replaced.size / 7
    assert ((observed - expected) ** 2 / expected).sum() < chi2.ppf(1 - P_FALSE_ALARM, df=6)


def test_labels_hold_the_original_ids_and_unchosen_tokens_are_unchanged(stats):
    originals, inputs, labels, _, _ = stats[512]
    chosen = labels != IGNORE_INDEX
    np.testing.assert_array_equal(labels[chosen], originals[chosen])
    np.testing.assert_array_equal(inputs[~chosen], originals[~chosen])


def test_special_tokens_and_padding_are_never_masked():
    rng = np.random.default_rng(3)
    originals, inputs, labels, _ = masked([make_example(rng, 512, pad=p) for p in (0, 400, 100, 511)], seed=5)
    special = np.isin(originals, SPECIAL)
    assert (labels[special] == IGNORE_INDEX).all()
    np.testing.assert_array_equal(inputs[special], originals[special])
    assert (labels[1, 112:] == IGNORE_INDEX).all() and (labels[1] != IGNORE_INDEX).sum() <= round(109 * 0.15)


def test_masks_spread_evenly_over_positions(stats):
    """The masked share of each eighth of the positions against the whole rows' share, within Z standard errors
    of a ratio estimate over independent rows (the spans make tokens within a row correlated, rows are not)."""
    originals, _, labels, _, _ = stats[512]
    real = ~np.isin(originals, SPECIAL)
    chosen = (labels != IGNORE_INDEX).reshape(len(labels), 8, -1).sum(axis=2)
    counted = real.reshape(len(real), 8, -1).sum(axis=2)
    overall = chosen.sum() / counted.sum()
    rate = chosen.sum(axis=0) / counted.sum(axis=0)
    error = np.sqrt(((chosen - overall * counted) ** 2).sum(axis=0)) / counted.sum(axis=0)
    assert (np.abs(rate - overall) < Z * error).all()


def test_masked_runs_start_and_end_on_word_boundaries(stats):
    originals, _, labels, _, starts = stats[128]
    for ids, ws, row in zip(originals, starts, labels, strict=True):
        chosen = np.concatenate(([False], row != IGNORE_INDEX, [False]))
        boundary = word_boundaries(ids, ws)
        assert boundary[np.flatnonzero(~chosen[:-1] & chosen[1:])].all()
        assert boundary[np.flatnonzero(chosen[:-1] & ~chosen[1:])].all()


def rows_of(examples, order, epoch=0):
    """The batch columns of mlm_batches for these examples (by index) in this order; ids are the indices."""
    return (
        [examples[i][0] for i in order], [np.zeros(examples[i][0].size, np.int8) for i in order],
        [0] * len(order), [examples[i][1] for i in order], list(order),
    )  # fmt: skip


def by_example(columns, **kwargs) -> dict[int, tuple]:
    """Each example's (input_ids, labels) from mlm_batches on these columns."""
    batches = mlm_batches(*columns, seed=7, epoch=0, seq_len=512, vocab_size=VOCAB, special_ids=SPECIAL,
                          mask_id=MASK, **kwargs)  # fmt: skip
    inputs = np.concatenate([b["input_ids"] for b in batches])
    labels = np.concatenate([b["mlm_labels"] for b in batches])
    return {example: (inputs[r], labels[r]) for r, example in enumerate(columns[4])}


def test_a_rows_mask_depends_neither_on_its_batch_nor_the_order_nor_the_worker_count():
    rng = np.random.default_rng(9)
    examples = [make_example(rng, int(rng.integers(40, 513)) if i % 3 else 512) for i in range(48)]
    examples = [(np.r_[ids, [PAD] * (512 - ids.size)], np.r_[ws, [True] * (512 - ws.size)]) for ids, ws in examples]
    whole = by_example(rows_of(examples, range(48)), micro_batch=None)
    shuffled = by_example(rows_of(examples, rng.permutation(48)), micro_batch=5)
    for workers in (2, 3):
        for rank in range(workers):
            part = by_example(rows_of(examples, range(rank, 48, workers)), micro_batch=4)
            for example, (inputs, labels) in part.items():
                np.testing.assert_array_equal(inputs, whole[example][0])
                np.testing.assert_array_equal(labels, whole[example][1])
    for example, (inputs, labels) in shuffled.items():
        np.testing.assert_array_equal(inputs, whole[example][0])
        np.testing.assert_array_equal(labels, whole[example][1])


def splitmix64(z: int) -> int:
    """SplitMix64's output function in Python integers: the reference for the array version."""
    m = 2**64 - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_draws_are_splitmix64_of_the_key_and_counter():
    keys = draws.example_keys(2**40 + 3, np.array([0, 7]), np.array([5, 2**50]))
    g = 0x9E3779B97F4A7C15
    for key in keys.tolist():
        got = draws.draws(np.uint64(key), 3, np.arange(4))
        expected = [splitmix64((key + ((3 << 32) + c + 1) * g) % 2**64) for c in range(4)]
        assert got.tolist() == expected
    salt, seed, epoch, example = 0xA1BE127A5C0FFEE1, 2**40 + 3, 7, 2**50
    key = splitmix64(salt ^ seed)
    key = splitmix64(((key + g) % 2**64) ^ epoch)
    assert keys[1] == splitmix64(((key + g) % 2**64) ^ example)


def test_the_high_and_low_halves_of_the_draws_are_uniform():
    """Chi-square over 16 bins of each half of 160,000 draws of consecutive counters and consecutive keys."""
    bits = draws.draws(draws.example_keys(0, np.zeros(400, int), np.arange(400))[:, None], 1, np.arange(400))
    for half in (bits >> np.uint64(60), (bits >> np.uint64(28)) & np.uint64(15)):
        observed = np.bincount(half.ravel().astype(np.int64), minlength=16)
        expected = bits.size / 16
        assert ((observed - expected) ** 2 / expected).sum() < chi2.ppf(1 - P_FALSE_ALARM, df=15)


def test_scheme_2_masks_are_pinned():
    """The masks of scheme 2 never change silently: a change of the definition needs a new MASK_SCHEME (and this
    pin updated with it), so that resuming a run of the old scheme is refused rather than masked anew."""
    assert MASK_SCHEME == 2
    ids = np.array([CLS, *range(100, 130), SEP, *range(200, 230), SEP])  # no numpy generator makes the row
    ws = np.arange(ids.size) % 3 != 2
    _, inputs, labels, _ = masked([(ids, ws)], seed=11, epoch=3, first_id=42)
    assert np.flatnonzero(labels[0] != IGNORE_INDEX).tolist() == PINNED_POSITIONS
    assert inputs[0][labels[0] != IGNORE_INDEX].tolist() == PINNED_INPUTS


PINNED_POSITIONS = [7, 8, 9, 10, 11, 33, 39, 51]
PINNED_INPUTS = [MASK] * 7 + [21618]


def test_two_word_example_still_gets_one_prediction():
    _, _, labels, _ = masked([(np.array([CLS, 100, SEP, 200, SEP]), np.ones(5, dtype=bool))])
    assert (labels != IGNORE_INDEX).sum() == 1


def test_a_word_longer_than_the_budget_is_never_split():
    ids = np.array([CLS, 10, 11, SEP, 12, 13, SEP])  # 4 real tokens: budget 1, every word has 2 pieces
    ws = np.array([1, 1, 0, 1, 1, 0, 1], dtype=bool)
    for i in range(20):
        _, _, labels, _ = masked([(ids, ws)], first_id=i)
        assert (labels == IGNORE_INDEX).all()


def test_example_of_only_special_tokens_masks_nothing():
    ids = np.array([CLS, SEP, SEP, PAD])
    _, inputs, labels, _ = masked([(ids, np.ones(4, dtype=bool))])
    assert (labels == IGNORE_INDEX).all()
    np.testing.assert_array_equal(inputs, ids[None, :])


@pytest.mark.parametrize("bad", [{"mask_prob": 0.0}, {"mask_prob": 1.5}, {"max_ngram": 0}, {"vocab_size": 5}])
def test_bad_settings_are_rejected(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        MaskSettings(**{"vocab_size": VOCAB, "special_ids": SPECIAL, "mask_id": MASK} | bad)


def test_negative_example_ids_are_rejected():
    with pytest.raises(ValueError, match="example_id must be a non-negative integer"):
        draws.example_keys(0, np.array([0]), np.array([-1]))


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.lists(st.integers(1, 4), min_size=1, max_size=60), st.integers(0, 59)), min_size=1, max_size=6
    ),
    seed=st.integers(0, 2**63),
    max_ngram=st.integers(1, 5),
)
def test_any_rows_keep_the_invariants(rows, seed, max_ngram):
    """Specials untouched, whole words, within budget, for arbitrary word layouts, rows of any lengths together."""
    examples = []
    for pieces, sep_after in rows:
        ws = np.concatenate([[True]] + [[True] + [False] * (n - 1) for n in pieces] + [[True]])
        ids = np.arange(100, 100 + ws.size)
        ids[0], ids[-1] = CLS, SEP
        sep = min(1 + sep_after, ws.size - 1)
        ids[sep], ws[sep] = SEP, True
        if sep + 1 < ws.size:
            ws[sep + 1] = True
        examples.append((ids, ws))
    flat_ids, flat_ws = np.concatenate([e[0] for e in examples]), np.concatenate([e[1] for e in examples])
    offsets = np.r_[0, np.cumsum([e[0].size for e in examples])]
    options = MaskSettings(VOCAB, SPECIAL, MASK, max_ngram=max_ngram)
    result = mask_rows(flat_ids, flat_ws, offsets, seed=seed, epochs=np.zeros(len(rows), int),
                       example_ids=np.arange(len(rows)), settings=options)  # fmt: skip
    chosen = np.zeros(flat_ids.size, dtype=bool)
    chosen[result.positions] = True
    for (ids, ws), a, b in zip(examples, offsets[:-1], offsets[1:], strict=True):
        special = np.isin(ids, SPECIAL)
        here = chosen[a:b]
        assert not here[special].any()
        assert here.sum() <= max(1, np.floor((~special).sum() * 0.15 + 0.5))
        padded = np.concatenate(([False], here, [False]))
        boundary = word_boundaries(ids, ws)
        assert boundary[np.flatnonzero(~padded[:-1] & padded[1:])].all()
        assert boundary[np.flatnonzero(padded[:-1] & ~padded[1:])].all()
    assert (result.span_words <= max_ngram).all()
