"""N-gram whole-word masking for masked-LM pretraining (SpanBERT / ALBERT style), a whole batch at once.

This module is the definition of the masks (scheme ``MASK_SCHEME``, recorded in every checkpoint). Each row's mask
is a function of its tokens and of its key (the run's seed, the epoch, the example id: ``albert_core.examples.draws``)
only, never of the batch it lands in, the worker, the order rows arrive in, or numpy's version.

A *word* is a word-start piece plus the continuation pieces that follow it; a special token ([CLS], [SEP], pad) is
never part of a word and a word never continues across one. A row with R real tokens gets a budget of
max(1, round(R x mask_prob)) predictions, grouped into spans of n whole words, p(n) = (1/n) / sum_{k<=N} (1/k):

1. Draw span lengths i.i.d. from p(n), a few more than the budget needs (draw i of stream 1, its high half); keep
   the first spans whose words fit the row.
2. Lay them out without overlap: each span takes a uniformly random point among the row's free words (the same
   draw's low half), and the spans follow one another in the order of their points, the free words in between.
3. Drop the spans that would cross a special token (a segment boundary).
4. In drawing order (a random order with respect to position), take spans until their tokens reach the budget,
   then drop spans from the front until the total fits: taking the crossing span whole keeps p(n) (Wald's identity:
   the count is a stopping time over i.i.d. lengths) where shortening it, as the original does, favours short spans.
   A row whose every taken span overruns its budget (a few real tokens) masks the first span's words that fit, or
   else one word that fits, the word with the smallest draw of stream 2.
5. Each chosen token (draw p of stream 3, p its position in the row): 80% [MASK], 10% a uniformly random
   non-special id, 10% kept.

Unlike the original create_pretraining_data, a span is never re-drawn shorter when it collides with an earlier one
or overruns the budget (both biased the histogram towards short spans), the budget is derived from the length (the
original silently capped it at 20), and every draw is keyed per example.

Scheme 1 (albert before this module) drew from numpy's PCG64 per row; its masks are not made any more. A run whose
checkpoints were written under it is refused on resume (services.train.plan.check_mask_scheme).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from albert_core.examples import draws
from albert_core.examples.shape import shape_field

MASK_SCHEME = 2  # the masks' definition (and data.sop_order = "epoch"'s draws); 1: numpy PCG64 streams per row
IGNORE_INDEX = -100
MASK_FRACTION = 0.8  # of the chosen tokens: replaced by [MASK]
RANDOM_FRACTION = 0.1  # of the chosen tokens: replaced by a random id (the remaining 10% are kept)
SPAN_OVERDRAW = 1.5  # how many more spans than the budget needs on average are drawn (step 1)
_SPANS, _FALLBACK, _TOKENS = 1, 2, 3  # the draw streams of steps 1-2, 4 and 5


def ngram_probs(max_ngram: int) -> np.ndarray:
    """p(n) for n = 1..max_ngram: (1/n) / sum_k (1/k). For max_ngram=3: 0.545, 0.273, 0.182."""
    if max_ngram < 1:
        raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
    inverse = 1.0 / np.arange(1, max_ngram + 1)
    return inverse / inverse.sum()


@dataclass(frozen=True)
class MaskSettings:
    """What the masks depend on besides the tokens and the keys."""

    vocab_size: int
    special_ids: tuple[int, ...]
    mask_id: int
    mask_prob: float = shape_field("mask_prob")
    max_ngram: int = shape_field("max_ngram")

    def __post_init__(self) -> None:
        if not 0.0 < self.mask_prob <= 1.0:
            raise ValueError(f"mask_prob must be in (0, 1], got {self.mask_prob}")
        if self.max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {self.max_ngram}")
        if self.vocab_size <= self.excluded.size:
            raise ValueError(f"vocab_size {self.vocab_size} leaves no non-special id for random replacement")

    @property
    def excluded(self) -> np.ndarray:
        """Ids never drawn as random replacements (sorted): the special ids and mask_id within the vocabulary."""
        ids = {i for i in (*self.special_ids, self.mask_id) if 0 <= i < self.vocab_size}
        return np.asarray(sorted(ids), dtype=np.int64)


@dataclass(frozen=True)
class Masked:
    """The chosen tokens of a batch of rows laid end to end: flat positions (ascending), the row of each, the id each
    takes in the input (`inputs`) and the id to predict there (`labels`, the original); and the length in words of
    every chosen span (`span_words`, in no particular order)."""

    positions: np.ndarray
    rows: np.ndarray
    inputs: np.ndarray
    labels: np.ndarray
    span_words: np.ndarray


def mask_rows(
    ids: np.ndarray,
    word_starts: np.ndarray,
    offsets: np.ndarray,
    *,
    seed: int,
    epochs: np.ndarray,
    example_ids: np.ndarray,
    settings: MaskSettings,
) -> Masked:
    """The masks of rows laid end to end: row b is ids[offsets[b]:offsets[b + 1]] (any integer dtype) with one
    word-start flag per token; epochs and example_ids have one entry per row."""
    offsets = np.asarray(offsets, dtype=np.int64)
    keys = draws.example_keys(seed, epochs, example_ids)
    special = _special(ids, settings.special_ids)
    words = _words(special, np.asarray(word_starts, dtype=bool), offsets)
    budget = np.where(words.count > 0, np.maximum(1, np.floor(words.real * settings.mask_prob + 0.5)), 0)
    spans = _place_spans(keys, words, budget.astype(np.int64), settings.max_ngram)
    first, stop = _taken(spans, words, budget.astype(np.int64), keys)
    positions, rows = _positions(words, first, stop, offsets)
    labels = ids[positions].astype(np.int64)
    inputs = _replaced(labels, draws.draws(keys[rows], _TOKENS, positions - offsets[rows]), settings)
    return Masked(positions, rows, inputs, labels, stop - first)


# ----------------------------------------------------------------------------------------------------------------
# internals


def _special(ids: np.ndarray, special_ids: Iterable[int]) -> np.ndarray:
    """ids in special_ids, by table lookup; ids outside the table are not special."""
    special_ids = [i for i in special_ids if i >= 0]
    table = np.zeros(max(special_ids, default=0) + 2, dtype=bool)  # the last entry stays False
    table[special_ids] = True
    if ids.size and ids.min() < 0:  # not token ids: clipped to -1 (the last entry) first
        return table[np.clip(ids, -1, table.size - 1)]
    return np.take(table, ids, mode="clip")  # ids past the table: its last entry


@dataclass(frozen=True)
class _Words:
    """The words of every row, numbered through the batch in row order. Word g starts at flat position at[g];
    first[b] is row b's first word (first[rows] = all words). tokens_before[g] counts the real tokens before at[g],
    so words [g, h) of a row hold tokens_before[h] - tokens_before[g] tokens. segment[g] counts the special tokens
    before at[g]: words g and h of a row lie in one segment when their counts are equal."""

    at: np.ndarray
    tokens_before: np.ndarray
    segment: np.ndarray
    first: np.ndarray

    @property
    def count(self) -> np.ndarray:
        """Words per row."""
        return np.diff(self.first)

    @property
    def real(self) -> np.ndarray:
        """Real (non-special) tokens per row."""
        return self.tokens_before[self.first[1:]] - self.tokens_before[self.first[:-1]]


def _words(special: np.ndarray, starts: np.ndarray, offsets: np.ndarray) -> _Words:
    """A non-special token starts a word if flagged, or if it follows a special token or starts its row; the word
    runs to the next word start or special token."""
    n = special.size
    if starts.shape != special.shape:
        raise ValueError(f"word_starts has {starts.size} flags for {n} tokens: one flag per token expected")
    first_piece = np.empty(n, dtype=bool)
    first_piece[1:] = special[:-1]
    first_piece[offsets[:-1][offsets[:-1] < n]] = True
    first_piece |= starts
    first_piece &= ~special
    at = np.flatnonzero(first_piece)
    specials_before = np.cumsum(special, dtype=np.int64 if n >= 2**31 else np.int32)
    segment = specials_before[at]
    tokens_before = np.empty(at.size + 1, dtype=np.int64)
    np.subtract(at, segment, out=tokens_before[:-1])
    tokens_before[-1] = n - (int(specials_before[-1]) if n else 0)
    return _Words(at, tokens_before, segment, np.searchsorted(at, offsets))


@dataclass(frozen=True)
class _Spans:
    """Per row (rows x K, in drawing order; `valid` marks a row's spans): the batch index of the first word and the
    length in words of each span placed by steps 1-3, and its tokens."""

    first: np.ndarray
    lengths: np.ndarray
    valid: np.ndarray
    tokens: np.ndarray


def _place_spans(keys: np.ndarray, words: _Words, budget: np.ndarray, max_ngram: int) -> _Spans:
    """Steps 1-3: span lengths, their layout among the row's words, the spans inside one segment."""
    n_words, n_real = words.count, words.real
    probs = ngram_probs(max_ngram)
    with np.errstate(divide="ignore", invalid="ignore"):
        wanted = np.ceil(SPAN_OVERDRAW * budget * n_words / (n_real * (probs @ np.arange(1, max_ngram + 1)))) + 4
    k = np.where(n_words > 0, np.minimum(budget, np.nan_to_num(wanted)), 0).astype(np.int64)
    column = np.arange(int(k.max(initial=0)))
    bits = draws.draws(keys[:, None], _SPANS, column[None, :])
    thresholds = np.floor(np.cumsum(probs)[:-1] * 2**32).astype(np.uint64)  # on the high 32 bits of each draw
    lengths = np.searchsorted(thresholds, bits >> np.uint64(32), side="right") + 1
    np.minimum(lengths, n_words[:, None], out=lengths)
    lengths[column[None, :] >= k[:, None]] = 0
    valid = (np.cumsum(lengths, axis=1) <= n_words[:, None]) & (lengths > 0)
    lengths *= valid
    # 2. the point of each span among the free words: the low 32 bits scaled to 0..free; spans laid out by point
    free = (n_words - lengths.sum(axis=1)).astype(np.uint64)
    point = np.where(valid, bits & draws.LOW32, np.uint64(2**32))
    by_point = np.argsort(point, axis=1, kind="stable")
    sorted_lengths = np.take_along_axis(lengths, by_point, axis=1)
    sorted_point = np.take_along_axis(point, by_point, axis=1)
    free_before = ((sorted_point * (free[:, None] + np.uint64(1))) >> np.uint64(32)).astype(np.int64)
    first = np.empty_like(lengths)
    np.put_along_axis(first, by_point, free_before + np.cumsum(sorted_lengths, axis=1) - sorted_lengths, axis=1)
    first = np.where(valid, first + words.first[:-1, None], 0)
    # 3. inside one segment: the first and the last word have as many special tokens before them
    last = np.maximum(first + lengths - 1, 0)
    if words.at.size:
        valid &= words.segment[first] == words.segment[last]
    tokens = np.where(valid, words.tokens_before[first + lengths] - words.tokens_before[first], 0)
    return _Spans(first, lengths, valid, tokens)


def _taken(spans: _Spans, words: _Words, budget: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Step 4: the chosen spans' (first word, last word + 1), 1-D arrays of batch word indices."""
    used = np.cumsum(spans.tokens, axis=1)
    before = used - spans.tokens
    total = np.where(spans.valid & (before < budget[:, None]), used, 0).max(axis=1, initial=0)
    over = np.maximum(total - budget, 0)
    keep = spans.valid & (before < budget[:, None]) & (before >= over[:, None])
    short = ~keep.any(axis=1) & (budget > 0)
    first, stop = spans.first[keep], (spans.first + spans.lengths)[keep]
    if short.any():
        extra_first, extra_stop = _short_rows(np.flatnonzero(short), spans, words, budget, keys)
        first, stop = np.concatenate((first, extra_first)), np.concatenate((stop, extra_stop))
    return first, stop


def _short_rows(rows: np.ndarray, spans: _Spans, words: _Words, budget: np.ndarray, keys: np.ndarray):
    """Rows that no whole span fits: the first span (in drawing order) whose first words fit the budget, cut to
    them; else the word that fits with the smallest draw of stream 2; else nothing."""
    first, lengths, valid = spans.first[rows], spans.lengths[rows], spans.valid[rows]
    room = words.tokens_before[first] + budget[rows, None]
    fitting = np.searchsorted(words.tokens_before, room, side="right") - 1 - first
    fitting = np.where(valid, np.minimum(fitting, lengths), 0)
    has_span = (fitting > 0).any(axis=1)
    pick = (fitting > 0).argmax(axis=1)
    out_first = first[np.arange(rows.size), pick][has_span]
    out_stop = out_first + fitting[np.arange(rows.size), pick][has_span]
    rest = rows[~has_span]
    count = words.count[rest]
    word = np.repeat(words.first[rest], count) + _ranks(count)
    row_of = np.repeat(np.arange(rest.size), count)
    fits = words.tokens_before[word + 1] - words.tokens_before[word] <= budget[rest][row_of]
    score = np.where(fits, draws.draws(keys[rest][row_of], _FALLBACK, word - words.first[rest][row_of]), 0)
    best = np.full(rest.size, -1, dtype=np.int64)
    order = np.lexsort((score, ~fits, row_of))  # by row, fitting words first, smallest draw first
    firsts = order[np.r_[0, np.cumsum(count)[:-1]][count > 0]] if order.size else order
    best[count > 0] = np.where(fits[firsts], word[firsts], -1)
    chosen = best[best >= 0]
    return np.concatenate((out_first, chosen)), np.concatenate((out_stop, chosen + 1))


def _ranks(count: np.ndarray) -> np.ndarray:
    """0..count[i]-1 for each i, concatenated."""
    return np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)


def _positions(words: _Words, first: np.ndarray, stop: np.ndarray, offsets: np.ndarray):
    """The flat token positions of the spans of words [first, stop) (batch word indices), ascending, and the row of
    each."""
    order = np.argsort(first)
    first, stop = first[order], stop[order]
    start = words.at[first]
    lengths = words.tokens_before[stop] - words.tokens_before[first]  # a span holds no special token
    positions = np.repeat(start, lengths) + _ranks(lengths)
    return positions, np.searchsorted(offsets, positions, side="right") - 1


def _replaced(labels: np.ndarray, bits: np.ndarray, settings: MaskSettings) -> np.ndarray:
    """Step 5: the input id of each chosen token: [MASK] (80%), a random non-special id (10%) or its own (10%)."""
    action = draws.high_unit(bits)
    excluded = settings.excluded
    random_ids = draws.below(bits, settings.vocab_size - excluded.size)
    # the k-th allowed id is k plus the number of excluded ids at or below it
    random_ids += np.searchsorted(excluded - np.arange(excluded.size), random_ids, side="right")
    inputs = np.where(action < MASK_FRACTION + RANDOM_FRACTION, random_ids, labels)
    inputs[action < MASK_FRACTION] = settings.mask_id
    return inputs
