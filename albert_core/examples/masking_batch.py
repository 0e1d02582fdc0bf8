"""N-gram whole-word masking for a whole batch at once, giving exactly ``ngram_mask``'s masks.

``albert_core.examples.masking.ngram_mask`` with ``rng=example_rng(seed, epoch, example_id)`` masks one row with about
thirty small numpy calls and a seeded generator of its own; most of its time is the calls' overhead, not the tokens.
Here the same steps run once over every row of a batch, and every random draw is computed from the row's PCG64
stream (``albert_core.examples.pcg64.RowStreams``) at the very place in that stream where the row's own generator
would make it:

    draws of one row, in order                              what they are in numpy
    1. k1 = min(budget, wanted) doubles: span lengths        rng.random(k1)
    2. one 32-bit draw per span with j > 0: the slots        rng.choice(pop, size=n_spans, replace=False,
       (Floyd's algorithm, j = pop - n_spans ... pop - 1)        shuffle=False): Lemire-bounded draws in [0, j]
    3. 32-bit draws, rejected until (x & mask(i)) <= i,      rng.permutation(n_inside): Fisher-Yates from the back
       for i = n_inside - 1 ... 1
    4. one double per chosen token: mask / random / keep    rng.random(n_positions)
    5. one 32-bit draw per randomly replaced token          rng.integers(0, vocab - excluded): Lemire-bounded

Steps 2, 3 and 5 share 32-bit halves of 64-bit outputs, and the doubles of step 4 leave a kept half for step 5.

A row takes the reference path (``ngram_mask`` with its own generator) when it hits a case drawn too rarely to be
worth vectorizing, so the result is exact for every row either way: a Lemire draw whose low word falls under the
range (probability ~ range / 2**32, where numpy may reject and redraw), a row whose whole spans cannot fit its budget
(the short-row fallback of ``_sample_spans``), a permutation that needs more draws than were generated, or a row
without words. tests/test_masking_batch.py compares every array with the per-row code.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from albert_core.examples.masking import (
    _SPAN_OVERDRAW,
    IGNORE_INDEX,
    MASK_FRACTION,
    RANDOM_FRACTION,
    _ngram_cdf,
    example_rng,
    ngram_mask,
)
from albert_core.examples.pcg64 import RowStreams, to_doubles
from albert_core.examples.shape import shape_field

_M32 = np.uint64(0xFFFFFFFF)
_WINDOW = 16  # 32-bit draws looked at per permutation step (each is accepted with probability >= 1/2)
_TOKEN_CHUNK = 32_768  # tokens per piece of the token-wide passes
_MAX_POPULATION = 10_000  # rng.choice switches to a tail shuffle above this many words: the reference path


@dataclass
class _Words:
    """The words of every row, numbered through the batch in row order. Word g starts at flat position at[g] of the
    rows x width tokens; first[b] is row b's first word (first[rows] = all words). tokens_before[g] counts the real
    (non-special) tokens before at[g], so words [g, h) of a row hold tokens_before[h] - tokens_before[g] tokens and
    word g ends at at[g] + tokens_before[g + 1] - tokens_before[g]. segment[g] counts the special tokens before at[g]:
    words g and h of a row lie in one segment when their counts are equal."""

    at: np.ndarray
    tokens_before: np.ndarray
    segment: np.ndarray
    first: np.ndarray

    @property
    def count(self) -> np.ndarray:
        return np.diff(self.first)

    @property
    def real(self) -> np.ndarray:
        """Real tokens per row."""
        return self.tokens_before[self.first[1:]] - self.tokens_before[self.first[:-1]]

    def end(self, g: np.ndarray) -> np.ndarray:
        """The flat position just past word g."""
        return self.at[g] + self.tokens_before[g + 1] - self.tokens_before[g]


def _words(special: np.ndarray, starts: np.ndarray) -> _Words:
    """Words as `_sample_spans` finds them: a non-special token starts one if flagged or if it follows a special
    token (or the row start); it runs to the next word start or special token. Made `_TOKEN_CHUNK` tokens of rows
    at a time, which keeps the temporaries in the cache."""
    n_rows, width = special.shape
    rows_per_chunk = max(1, _TOKEN_CHUNK // max(width, 1))
    at, segment, counts, specials = [], [], [], 0
    for first_row in range(0, n_rows, rows_per_chunk):
        part = slice(first_row, first_row + rows_per_chunk)
        chunk = special[part]
        follows = np.ones_like(chunk)
        follows[:, 1:] = chunk[:, :-1]
        first_piece = ~chunk & (starts[part] | follows)
        here = np.flatnonzero(first_piece)
        specials_before = np.cumsum(chunk.ravel(), dtype=np.int32)  # at a word start: the specials before it
        at.append(here + first_row * width)
        segment.append(specials_before[here] + specials)
        counts.append(first_piece.sum(axis=1))
        specials += int(specials_before[-1]) if specials_before.size else 0
    at_all = np.concatenate(at) if at else np.zeros(0, dtype=np.int64)
    segment_all = np.concatenate(segment).astype(np.int64) if segment else np.zeros(0, dtype=np.int64)
    tokens_before = np.empty(at_all.size + 1, dtype=np.int64)
    tokens_before[:-1] = at_all - segment_all
    tokens_before[-1] = special.size - specials
    first = np.zeros(n_rows + 1, dtype=np.int64)
    if counts:
        np.cumsum(np.concatenate(counts), out=first[1:])
    return _Words(at_all, tokens_before, segment_all, first)


@dataclass
class _Spans:
    """Per row (padded rows x K arrays, `valid` marks the row's entries): first word (within the row) and length in
    words of each span, in the order the row's step has them."""

    first_word: np.ndarray
    lengths: np.ndarray
    valid: np.ndarray


def _span_lengths(streams: RowStreams, words: _Words, budget: np.ndarray, max_ngram: int) -> tuple[np.ndarray, ...]:
    """Step 1: span lengths (rows x K, 0 past each row's n_spans), n_spans, and k1 (the doubles drawn)."""
    n_words, n_real = words.count, words.real
    cdf, mean_words = _ngram_cdf(max_ngram)
    with np.errstate(divide="ignore", invalid="ignore"):
        wanted = np.ceil(_SPAN_OVERDRAW * budget * n_words / (n_real * mean_words)) + 4
    k1 = np.where(n_words > 0, np.minimum(budget, np.nan_to_num(wanted)), 0).astype(np.int64)
    draws = to_doubles(streams.block(np.zeros_like(k1), int(k1.max(initial=0))))
    lengths = np.searchsorted(cdf, draws, side="right") + 1
    lengths = np.minimum(np.minimum(lengths, max_ngram), n_words[:, None])
    lengths[np.arange(lengths.shape[1])[None, :] >= k1[:, None]] = 0
    fits = (np.cumsum(lengths, axis=1) <= n_words[:, None]) & (lengths > 0)
    n_spans = fits.sum(axis=1)
    return np.where(fits, lengths, 0), n_spans, k1


def _choice_draws(lengths: np.ndarray, n_spans: np.ndarray, n_words: np.ndarray) -> tuple[np.ndarray, ...]:
    """Floyd's j of each span (j = n_free + i) and the 32-bit draws rng.choice makes: one per span with j > 0."""
    n_free = n_words - lengths.sum(axis=1)
    j = n_free[:, None] + np.arange(lengths.shape[1])[None, :]
    n_choice = np.where(n_spans > 0, n_spans - (n_free == 0), 0)
    return j, n_choice


def _floyd_slots(draws: np.ndarray, j: np.ndarray, lengths: np.ndarray, n_spans: np.ndarray):
    """Step 2: the spans placed by the slots rng.choice(n_spans + n_free, n_spans, replace=False, shuffle=False)
    gives, from its 32-bit draws (rows x K, the draw of span i is number i - 1 when j starts at 0, else i); and the
    rows where a Lemire draw may have been rejected."""
    k = lengths.shape[1]
    i = np.arange(k)
    valid = i < n_spans[:, None]
    drawn = valid & (j > 0)
    index = np.clip(i[None, :] - (j[:, :1] == 0), 0, max(draws.shape[1] - 1, 0))
    x = np.take_along_axis(draws, index, axis=1) if draws.shape[1] else np.zeros_like(j, dtype=np.uint64)
    span = (j + 1).astype(np.uint64)
    m = x * span
    unsure = (drawn & ((m & _M32) < span)).any(axis=1)
    val = np.where(drawn, (m >> np.uint64(32)).astype(np.int64), 0)
    result = np.where(_floyd_duplicates(val, j, valid), j, val)
    slots = np.sort(np.where(valid, result, np.iinfo(np.int64).max), axis=1)
    first_word = np.where(valid, slots - i + (np.cumsum(lengths, axis=1) - lengths), 0)
    return _Spans(first_word, lengths, valid), unsure


def _floyd_duplicates(val: np.ndarray, j: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Which spans Floyd's algorithm gives j_i instead of val_i: those whose val_i the set already holds.

    The set holds val_i when an earlier span k inserted it: as its own val (val_k = val_i, k not a duplicate) or as
    its j (j_k = val_i, so k = c_i = val_i - n_free, and k a duplicate). Of the spans drawing one value, all but the
    first are duplicates: if the first inserted its val, the set holds it; if it was a duplicate, c < first < later
    is one too. So span i is a duplicate when it is not the first to draw its value, or when c_i < i is one: chains
    that a few rounds resolve (each round settles one more link; they are rarely longer than one).
    """
    k = val.shape[1]
    i = np.arange(k)
    first = _first_occurrences(np.where(valid, val, np.iinfo(np.int32).max))  # past n_spans: never a duplicate
    c = val - j[:, :1]
    chained = valid & first & (c >= 0) & (c < i)
    c = np.clip(c, 0, max(k - 1, 0))
    dup = valid & ~first
    for _ in range(k):
        update = dup | (chained & np.take_along_axis(dup, c, axis=1))
        if np.array_equal(update, dup):
            break
        dup = update
    return dup


def _first_occurrences(values: np.ndarray) -> np.ndarray:
    """True where an entry of a row of non-negative values is the first (leftmost) of its row to hold its value."""
    n_rows, k = values.shape
    keys = np.sort(values * k + np.arange(k), axis=1)  # by value, then by position
    ordered = keys // k
    first = np.ones(values.shape, dtype=bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    out = np.empty_like(first)
    out[np.arange(n_rows)[:, None], keys % k] = first
    return out


def _inside(spans: _Spans, words: _Words) -> _Spans:
    """Step 3 of _sample_spans: keep the spans whose first and last word lie in one segment, in order."""
    g = np.minimum(words.first[:-1, None] + spans.first_word, max(words.at.size - 1, 0))
    last = np.clip(g + spans.lengths - 1, 0, None)
    inside = spans.valid & (words.segment[g] == words.segment[last]) if words.at.size else spans.valid
    order = np.argsort(~inside, axis=1, kind="stable")
    keep = np.take_along_axis(inside, order, axis=1)
    return _Spans(
        np.take_along_axis(spans.first_word, order, axis=1) * keep,
        np.take_along_axis(spans.lengths, order, axis=1) * keep,
        keep,
    )


def _permutation(draws: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Step 3: rng.permutation(n) for each row from its 32-bit draws (rows x D, taken from the left): Fisher-Yates
    from the back, swapping i = n - 1 ... 1 with j = the first draw x with (x & mask(i)) <= i, where mask(i) is the
    smallest all-ones number >= i. Returns the permutations (rows x max n) and the draws used per row."""
    n_rows, width = n.size, int(n.max(initial=0))
    order = np.tile(np.arange(width, dtype=np.int64), (n_rows, 1))
    steps = width - 1
    if steps <= 0:
        return order, np.zeros(n_rows, dtype=np.int64)
    i = np.maximum(n[:, None] - 1 - np.arange(steps)[None, :], 0)  # past a row's last step: i = 0, a no-op swap
    j, used = _fisher_yates_draws(draws, i)
    flat = order.reshape(-1)
    base = (np.arange(n_rows) * width)[:, None]
    here, there = (base + i).T.copy(), (base + j).T.copy()
    for s in range(steps):
        kept = flat[here[s]]
        flat[here[s]] = flat[there[s]]
        flat[there[s]] = kept
    return order, used


def _fisher_yates_draws(draws: np.ndarray, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The j of each step (rows x steps) and the draws used per row: step s takes the first draw from where step
    s - 1 stopped with (x & mask) <= i[:, s]. A step with i = 0 (mask 0) takes one draw and no row's step after it
    draws: those draws are not counted."""
    n_rows, steps = i.shape
    mask = i.copy()
    for shift in (1, 2, 4, 8, 16):
        mask |= mask >> shift
    i_t, mask_t = i.T.astype(np.uint32), mask.T.astype(np.uint32)
    padded = np.zeros((n_rows, draws.shape[1] + steps + _WINDOW), dtype=np.uint32)
    padded[:, : draws.shape[1]] = draws
    windows = sliding_window_view(padded, _WINDOW, axis=1)
    rows = np.arange(n_rows)
    at = np.zeros(n_rows, dtype=np.int64)
    j = np.empty((steps, n_rows), dtype=np.uint32)
    for s in range(steps):  # the first accepted draw among the next _WINDOW of each row
        candidates = windows[rows, at] & mask_t[s][:, None]
        first = (candidates <= i_t[s][:, None]).argmax(axis=1)
        j[s] = candidates[rows, first]
        at += first + 1
    j = j.T.astype(np.int64)
    for r in np.flatnonzero((j > i).any(axis=1)):  # _WINDOW rejections in a row (p <= 2**-16 a step): one by one
        at[r] = _fisher_yates_row(padded[r], i[r], mask[r], j[r])
    return j, at - (steps - (i > 0).sum(axis=1))


def _fisher_yates_row(draws: np.ndarray, i: np.ndarray, mask: np.ndarray, out: np.ndarray) -> int:
    """One row's steps, draw by draw (into `out`); returns the draws taken, as the vectorized loop counts them."""
    t = 0
    for s in range(i.size):
        while (int(draws[t]) & int(mask[s])) > int(i[s]):
            t += 1
        out[s] = int(draws[t]) & int(mask[s])
        t += 1
    return t


def _taken(spans: _Spans, order: np.ndarray, words: _Words, budget: np.ndarray) -> tuple[np.ndarray, ...]:
    """Step 4 of _sample_spans on the permuted spans: take spans until their tokens reach the budget, then drop
    spans from the front until the total fits. Returns the taken spans' (first word, last word + 1) as batch word
    indices (rows x K, `keep` marks them), and the rows where no whole span fits (the reference path)."""
    first_word = np.take_along_axis(spans.first_word, order, axis=1)
    lengths = np.take_along_axis(spans.lengths, order, axis=1)
    valid = np.take_along_axis(spans.valid, order, axis=1)
    g = words.first[:-1, None] + first_word
    tokens = np.where(valid, words.tokens_before[g + lengths] - words.tokens_before[g], 0)
    used = np.cumsum(tokens, axis=1)
    n_inside = valid.sum(axis=1)
    n_taken = np.minimum((valid & (used < budget[:, None])).sum(axis=1) + 1, n_inside)
    last_used = np.take_along_axis(used, np.maximum(n_taken - 1, 0)[:, None], axis=1)[:, 0] if used.size else 0
    over = np.where(n_taken > 0, last_used - budget, 0)
    n_dropped = np.where(over > 0, (valid & (used < over[:, None])).sum(axis=1) + 1, 0)
    column = np.arange(first_word.shape[1])
    keep = valid & (column >= n_dropped[:, None]) & (column < n_taken[:, None])
    return g, g + lengths, keep, n_dropped >= n_taken


def _positions(words: _Words, first: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """The flat token positions of the spans of words [first, stop) (1-D arrays of batch word indices), ascending."""
    order = np.argsort(first)
    start, end = words.at[first[order]], words.end(stop[order] - 1)
    lengths = end - start
    before = np.cumsum(lengths) - lengths
    return np.repeat(start - before, lengths) + np.arange(int(lengths.sum()))


@dataclass(frozen=True)
class MaskSettings:
    """What ``ngram_mask`` takes besides the tokens and the generator."""

    vocab_size: int
    special_ids: tuple[int, ...]
    mask_id: int
    mask_prob: float = shape_field("mask_prob")
    max_ngram: int = shape_field("max_ngram")

    @property
    def excluded(self) -> np.ndarray:
        """Ids never drawn as random replacements (sorted): the special ids and mask_id within the vocabulary."""
        ids = {i for i in (*self.special_ids, self.mask_id) if 0 <= i < self.vocab_size}
        return np.asarray(sorted(ids), dtype=np.int64)


def _special(ids: np.ndarray, special_ids: Iterable[int]) -> np.ndarray:
    """ids in special_ids, by table lookup; ids outside the table are not special."""
    special_ids = [i for i in special_ids if i >= 0]
    table = np.zeros(max(special_ids, default=0) + 2, dtype=bool)  # the last entry stays False
    table[special_ids] = True
    if ids.size and ids.min() < 0:  # not token ids: clipped to -1 (the last entry) first
        return table[np.clip(ids, -1, table.size - 1)]
    return np.take(table, ids, mode="clip")  # ids past the table: its last entry


def ngram_mask_rows(
    ids: np.ndarray,
    word_starts: np.ndarray,
    lengths: np.ndarray,
    *,
    seed: int,
    epochs: np.ndarray,
    example_ids: np.ndarray,
    settings: MaskSettings,
) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, mlm_labels) of every row: row b's first lengths[b] entries equal ``ngram_mask(ids[b, :n],
    word_starts[b, :n], rng=example_rng(seed, epochs[b], example_ids[b]), ...)``; past them input_ids keeps `ids` and
    mlm_labels is IGNORE_INDEX. `ids` and `word_starts` are rows x width (int64, bool), padded with anything."""
    ids = np.asarray(ids, dtype=np.int64)
    n_rows, width = ids.shape
    lengths = np.asarray(lengths, dtype=np.int64)
    epochs = np.broadcast_to(np.asarray(epochs, dtype=np.int64), (n_rows,))
    example_ids = np.asarray(example_ids, dtype=np.int64)
    excluded = settings.excluded
    if not 0.0 < settings.mask_prob <= 1.0 or settings.max_ngram < 1:
        raise ValueError(f"ngram_mask_rows: bad mask_prob {settings.mask_prob} or max_ngram {settings.max_ngram}")
    if settings.vocab_size <= excluded.size:
        raise ValueError(f"vocab_size {settings.vocab_size} leaves no non-special id for random replacement")
    special = _special(ids, settings.special_ids) | (np.arange(width)[None, :] >= lengths[:, None])
    masked, labels = ids.copy(), np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)
    exact = n_rows > 0 and width <= _MAX_POPULATION and settings.vocab_size - excluded.size < 2**31
    reference = np.ones(n_rows, dtype=bool)
    if exact:
        streams = RowStreams(seed, epochs, example_ids)
        reference = _fast_rows(streams, ids, special, np.asarray(word_starts, dtype=bool), settings, masked, labels)
    for r in np.flatnonzero(reference):
        n = int(lengths[r])
        masked[r, :n], labels[r, :n] = ngram_mask(
            ids[r, :n],
            word_starts[r, :n],
            rng=example_rng(seed, int(epochs[r]), int(example_ids[r])),
            mask_prob=settings.mask_prob,
            max_ngram=settings.max_ngram,
            vocab_size=settings.vocab_size,
            special_ids=settings.special_ids,
            mask_id=settings.mask_id,
        )
        masked[r, n:], labels[r, n:] = ids[r, n:], IGNORE_INDEX
    return masked, labels


def _fast_rows(streams, ids, special, starts, settings: MaskSettings, masked, labels) -> np.ndarray:
    """Mask every row into `masked` and `labels`, vectorized; returns the rows left for the reference path."""
    words = _words(special, starts)
    budget = np.maximum(1, np.floor(words.real * settings.mask_prob + 0.5)).astype(np.int64)
    lengths, n_spans, k1 = _span_lengths(streams, words, budget, settings.max_ngram)
    j, n_choice = _choice_draws(lengths, n_spans, words.count)
    room = n_spans + (3 * n_spans) // 4 + 16  # the permutation's draws: ~1.36 per span, rarely past this
    choice_draws = streams.u32_block(2 * k1, int(n_choice.max(initial=0)))
    perm_draws = streams.u32_block(2 * k1 + n_choice, int(room.max(initial=0)))
    spans, unsure = _floyd_slots(choice_draws, j, lengths, n_spans)
    spans = _inside(spans, words)
    order, n_perm = _permutation(perm_draws, spans.valid.sum(axis=1))
    first, stop, keep, short = _taken(spans, order, words, budget)
    reference = unsure | short | (words.count == 0) | (n_perm > room)
    positions = _positions(words, first[keep], stop[keep])
    end32 = 2 * k1 + n_choice + n_perm  # the virtual index of the next 32-bit draw
    _replace(streams, ids, positions, end32, settings, masked, labels, reference)
    return reference


def _replace(streams, ids, positions, end32, settings: MaskSettings, masked, labels, reference) -> None:
    """Steps 4-5 at the chosen flat positions: label them; a double each picks [MASK] (80%), a random id (10%) or
    keep (10%); the random ids are Lemire-bounded 32-bit draws, the kept high half first. Rows where Lemire may
    have rejected a draw are added to `reference`."""
    n_rows, width = ids.shape
    flat_ids, flat_masked, flat_labels = ids.reshape(-1), masked.reshape(-1), labels.reshape(-1)
    after = (end32 + 1) // 2  # the first 64-bit output no 32-bit draw has touched
    rows = positions // width
    n_positions = np.bincount(rows, minlength=n_rows)
    rank = np.arange(rows.size) - (np.cumsum(n_positions) - n_positions)[rows]
    action = to_doubles(streams.block(after, int(n_positions.max(initial=0)))[rows, rank])
    flat_labels[positions] = flat_ids[positions]
    flat_masked[positions[action < MASK_FRACTION]] = settings.mask_id
    at = (action >= MASK_FRACTION) & (action < MASK_FRACTION + RANDOM_FRACTION)
    rows, positions = rows[at], positions[at]
    n_random = np.bincount(rows, minlength=n_rows)
    rank = np.arange(rows.size) - (np.cumsum(n_random) - n_random)[rows]
    odd = end32[rows] % 2 == 1  # a kept high half: the first random id's draw
    virtual = np.where(odd & (rank == 0), end32[rows], 2 * (after + n_positions)[rows] + rank - odd)
    excluded = settings.excluded
    span = np.uint64(settings.vocab_size - excluded.size)
    m = streams.u32(rows, virtual) * span
    reference |= np.bincount(rows[(m & _M32) < span], minlength=n_rows) > 0
    draw = (m >> np.uint64(32)).astype(np.int64)
    flat_masked[positions] = draw + np.searchsorted(excluded - np.arange(excluded.size), draw, side="right")
