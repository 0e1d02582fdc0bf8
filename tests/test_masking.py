"""n-gram whole-word masking: the statistics are the specification (DESIGN.md §3)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from albert_core.examples import masking
from albert_core.examples.masking import IGNORE_INDEX, Spans, example_rng, ngram_mask, ngram_probs


def sample_spans(token_ids, word_starts, *, rng, special_ids, mask_prob=0.15, max_ngram=3) -> Spans:
    """The spans ngram_mask chooses for one example (its first draws from `rng`), as it chooses them."""
    ids, starts = masking._check_example(token_ids, word_starts)
    special = masking._special_mask(ids, np.asarray(list(special_ids), dtype=np.int64))
    return masking._sample_spans(special, starts, rng, mask_prob, max_ngram, None)


PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
SPECIAL = (PAD, CLS, SEP)
VOCAB = 30_000
N_STAT_EXAMPLES = 20_000


def mask(ids, ws, rng: np.random.Generator, **overrides) -> tuple[np.ndarray, np.ndarray]:
    """ngram_mask with this file's vocabulary and special ids."""
    kwargs = {"vocab_size": VOCAB, "special_ids": SPECIAL, "mask_id": MASK} | overrides
    return ngram_mask(ids, ws, rng=rng, **kwargs)


def make_example(rng: np.random.Generator, length: int = 512, pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """[CLS] A [SEP] B [SEP] (+ pad) with English-like words: 1-4 pieces, mostly 1 (as SentencePiece on prose)."""
    real = length - pad
    ids = rng.integers(5, VOCAB, size=length)
    pieces = rng.choice([1, 2, 3, 4], size=real, p=[0.72, 0.18, 0.07, 0.03])
    starts = np.concatenate(([0], np.cumsum(pieces)))
    word_starts = np.zeros(length, dtype=bool)
    word_starts[starts[starts < real]] = True
    sep = int(rng.integers(real // 5, real - real // 5))
    ids[[0, sep, real - 1]] = (CLS, SEP, SEP)
    ids[real:] = PAD
    word_starts[[0, sep, real - 1]] = True
    word_starts[real:] = True
    return ids, word_starts


@pytest.fixture(scope="module")
def examples() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1234)
    return [make_example(rng) for _ in range(500)]


def word_boundaries(ids: np.ndarray, word_starts: np.ndarray) -> np.ndarray:
    """boundary[i]: a word may start at i (a flagged piece, a special token, after a special token, or the end)."""
    special = np.isin(ids, SPECIAL)
    boundary = np.ones(ids.size + 1, dtype=bool)
    boundary[:-1] = word_starts | special
    boundary[1:-1] |= special[:-1]
    return boundary


@pytest.fixture(scope="module")
def span_stats(examples):
    """Spans of 20k masked 512-token examples."""
    n_words = []
    for i in range(N_STAT_EXAMPLES):
        ids, ws = examples[i % len(examples)]
        spans = sample_spans(ids, ws, rng=example_rng(7, 0, i), special_ids=SPECIAL)
        n_words.append(spans.n_words)
    return np.concatenate(n_words)


@pytest.fixture(scope="module")
def mask_stats(examples):
    """(original ids, masked ids, labels) stacked over 20k masked 512-token examples."""
    originals, masked, labels = [], [], []
    for i in range(N_STAT_EXAMPLES):
        ids, ws = examples[i % len(examples)]
        out, lab = mask(ids, ws, example_rng(8, 0, i))
        originals.append(ids)
        masked.append(out)
        labels.append(lab)
    return np.stack(originals), np.stack(masked), np.stack(labels)


def test_ngram_probabilities_are_harmonic():
    np.testing.assert_allclose(ngram_probs(3), [6 / 11, 3 / 11, 2 / 11])
    np.testing.assert_allclose(ngram_probs(1), [1.0])


def test_span_length_histogram_matches_harmonic_distribution(span_stats):
    histogram = np.bincount(span_stats, minlength=4)[1:] / span_stats.size
    np.testing.assert_allclose(histogram, ngram_probs(3), atol=0.02)


def test_span_length_histogram_holds_for_short_sequences():
    rng = np.random.default_rng(5)
    pool = [make_example(rng, length=128) for _ in range(200)]
    n_words = np.concatenate(
        [
            sample_spans(*pool[i % len(pool)], rng=example_rng(3, 0, i), special_ids=SPECIAL).n_words
            for i in range(N_STAT_EXAMPLES // 2)
        ]
    )
    histogram = np.bincount(n_words, minlength=4)[1:] / n_words.size
    np.testing.assert_allclose(histogram, ngram_probs(3), atol=0.02)


def test_masked_fraction_is_15_percent_of_real_tokens(mask_stats):
    originals, _, labels = mask_stats
    real = ~np.isin(originals, SPECIAL)
    fraction = (labels != IGNORE_INDEX).sum() / real.sum()
    assert abs(fraction - 0.15) <= 0.005


def test_no_example_predicts_more_than_its_budget(mask_stats):
    originals, _, labels = mask_stats
    budget = np.floor((~np.isin(originals, SPECIAL)).sum(axis=1) * 0.15 + 0.5)
    assert ((labels != IGNORE_INDEX).sum(axis=1) <= budget).all()


def test_chosen_tokens_split_80_mask_10_random_10_kept(mask_stats):
    originals, masked, labels = mask_stats
    chosen = labels != IGNORE_INDEX
    to_mask = (masked[chosen] == MASK).mean()
    kept = (masked[chosen] == originals[chosen]).mean()
    random = 1.0 - to_mask - kept
    assert abs(to_mask - 0.8) < 0.01
    assert abs(kept - 0.1) < 0.01
    assert abs(random - 0.1) < 0.01


def test_labels_hold_the_original_ids_of_chosen_tokens(mask_stats):
    originals, _, labels = mask_stats
    chosen = labels != IGNORE_INDEX
    np.testing.assert_array_equal(labels[chosen], originals[chosen])


def test_unchosen_tokens_are_left_unchanged(mask_stats):
    originals, masked, labels = mask_stats
    unchosen = labels == IGNORE_INDEX
    np.testing.assert_array_equal(masked[unchosen], originals[unchosen])


def test_special_tokens_are_never_masked(mask_stats):
    originals, masked, labels = mask_stats
    special = np.isin(originals, SPECIAL)
    assert (labels[special] == IGNORE_INDEX).all()
    np.testing.assert_array_equal(masked[special], originals[special])


def test_masks_spread_evenly_over_positions(mask_stats):
    originals, _, labels = mask_stats
    real = ~np.isin(originals, SPECIAL)
    chosen = labels != IGNORE_INDEX
    rate_per_eighth = chosen.reshape(len(chosen), 8, -1).sum(axis=(0, 2)) / real.reshape(len(real), 8, -1).sum(
        axis=(0, 2)
    )
    assert np.abs(rate_per_eighth - 0.15).max() < 0.01


def test_spans_are_whole_words_that_never_overlap_or_cross_special_tokens(examples):
    for i, (ids, ws) in enumerate(examples):
        spans = sample_spans(ids, ws, rng=example_rng(9, 0, i), special_ids=SPECIAL)
        boundary = word_boundaries(ids, ws)
        assert boundary[spans.starts].all() and boundary[spans.ends].all()
        assert (spans.ends[:-1] <= spans.starts[1:]).all()
        assert not np.isin(ids[spans.positions()], SPECIAL).any()
        counted_words = [int(boundary[s:e].sum()) for s, e in zip(spans.starts, spans.ends, strict=True)]
        assert counted_words == spans.n_words.tolist()


def test_masked_runs_start_and_end_on_word_boundaries(mask_stats, examples):
    _, _, labels = mask_stats
    for i in range(len(examples)):
        ids, ws = examples[i]
        chosen = np.concatenate(([False], labels[i] != IGNORE_INDEX, [False]))
        run_starts = np.flatnonzero(~chosen[:-1] & chosen[1:])
        run_ends = np.flatnonzero(chosen[:-1] & ~chosen[1:])
        boundary = word_boundaries(ids, ws)
        assert boundary[run_starts].all() and boundary[run_ends].all()


def test_masked_positions_are_the_sampled_spans(examples):
    ids, ws = examples[0]
    spans = sample_spans(ids, ws, rng=example_rng(1, 2, 3), special_ids=SPECIAL)
    _, labels = mask(ids, ws, example_rng(1, 2, 3))
    np.testing.assert_array_equal(np.flatnonzero(labels != IGNORE_INDEX), spans.positions())


def test_random_replacements_are_never_special_ids():
    vocab = 12  # 0..4 special or [MASK]: random draws land on 5..11 only
    rng = np.random.default_rng(0)
    ids, ws = make_example(rng, length=512)
    ids = np.where(np.isin(ids, SPECIAL), ids, 5 + ids % 7)
    replaced = []
    for i in range(300):
        out, labels = mask(ids, ws, example_rng(0, 0, i), vocab_size=vocab, special_ids=(*SPECIAL, UNK))
        chosen = labels != IGNORE_INDEX
        replaced.append(out[chosen & (out != MASK) & (out != ids)])
    replaced = np.concatenate(replaced)
    assert replaced.size > 500
    assert set(np.unique(replaced).tolist()) == set(range(5, 12))


def test_same_example_rng_recreates_the_same_mask(examples):
    ids, ws = examples[0]
    first = mask(ids, ws, example_rng(11, 3, 42))
    again = mask(ids, ws, example_rng(11, 3, 42))
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])


@pytest.mark.parametrize("other", [(12, 3, 42), (11, 4, 42), (11, 3, 43)])
def test_changing_seed_epoch_or_example_changes_the_mask(examples, other):
    ids, ws = examples[0]
    _, base = mask(ids, ws, example_rng(11, 3, 42))
    _, changed = mask(ids, ws, example_rng(*other))
    assert not np.array_equal(base, changed)


def test_max_predictions_caps_the_number_of_predictions(examples):
    for i, (ids, ws) in enumerate(examples[:50]):
        _, labels = mask(ids, ws, example_rng(0, 0, i), max_predictions=5)
        assert 1 <= (labels != IGNORE_INDEX).sum() <= 5


def test_padding_is_never_masked_and_does_not_count_toward_the_budget():
    rng = np.random.default_rng(3)
    ids, ws = make_example(rng, length=512, pad=400)
    for i in range(50):
        _, labels = mask(ids, ws, example_rng(0, 0, i))
        assert (labels[112:] == IGNORE_INDEX).all()
        assert (labels != IGNORE_INDEX).sum() <= round(109 * 0.15)


def test_two_word_example_still_gets_one_prediction():
    ids = np.array([CLS, 100, SEP, 200, SEP])
    ws = np.ones(5, dtype=bool)
    _, labels = mask(ids, ws, example_rng(0, 0, 0))
    assert (labels != IGNORE_INDEX).sum() == 1


def test_example_of_only_special_tokens_masks_nothing():
    ids = np.array([CLS, SEP, SEP, PAD])
    out, labels = mask(ids, np.ones(4, bool), example_rng(0, 0, 0))
    assert (labels == IGNORE_INDEX).all()
    np.testing.assert_array_equal(out, ids)


def test_word_starts_of_the_wrong_length_are_rejected():
    with pytest.raises(ValueError, match="word_starts has 3 entries but token_ids has 4"):
        mask([2, 5, 6, 3], [True, True, False], example_rng(0, 0, 0))


@pytest.mark.parametrize("bad", [{"mask_prob": 0.0}, {"mask_prob": 1.5}, {"max_ngram": 0}, {"max_predictions": -1}])
def test_bad_parameters_are_rejected(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        mask([2, 5, 3], [True] * 3, example_rng(0, 0, 0), **bad)


def test_example_rng_rejects_negative_ids():
    with pytest.raises(ValueError, match="example_id"):
        example_rng(0, 0, -1)


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.integers(1, 4), min_size=1, max_size=60),
    sep_after=st.integers(0, 59),
    seed=st.integers(0, 2**32 - 1),
    max_ngram=st.integers(1, 5),
)
def test_any_example_keeps_the_invariants(pieces, sep_after, seed, max_ngram):
    """Specials untouched, whole words, within budget, for arbitrary word layouts."""
    ws = np.concatenate([[True]] + [[True] + [False] * (n - 1) for n in pieces] + [[True]])
    ids = np.arange(100, 100 + ws.size)
    ids[0], ids[-1] = CLS, SEP
    sep = min(1 + sep_after, ws.size - 1)
    ids[sep], ws[sep] = SEP, True
    if sep + 1 < ws.size:
        ws[sep + 1] = True
    out, labels = mask(ids, ws, np.random.default_rng(seed), max_ngram=max_ngram)
    special = np.isin(ids, SPECIAL)
    n_real = int((~special).sum())
    chosen = labels != IGNORE_INDEX
    assert not chosen[special].any()
    assert chosen.sum() <= max(1, np.floor(n_real * 0.15 + 0.5))
    padded = np.concatenate(([False], chosen, [False]))
    boundary = word_boundaries(ids, ws)
    assert boundary[np.flatnonzero(~padded[:-1] & padded[1:])].all()
    assert boundary[np.flatnonzero(padded[:-1] & ~padded[1:])].all()


def test_a_word_longer_than_the_budget_is_never_split():
    ids = np.array([CLS, 10, 11, SEP, 12, 13, SEP])  # 4 real tokens: budget 1, every word has 2 pieces
    ws = np.array([1, 1, 0, 1, 1, 0, 1], dtype=bool)
    for i in range(20):
        _, labels = mask(ids, ws, example_rng(0, 0, i))
        assert (labels == IGNORE_INDEX).all()
