"""Time masking of one 512-token example: n-gram whole-word masking vs plain random 15% token masking.

The baseline is the cheapest honest alternative, in numpy on the same examples: each non-special token chosen
with p=0.15, then 80% [MASK] / 10% random / 10% kept. Variants timed in interleaved rounds (median reported):

- baseline      plain random token masking, one running generator
- ngram         albert_core.examples.masking.ngram_mask, one running generator
- ngram+rng     ngram_mask with example_rng(seed, epoch, example_id) per example (what training does)
- mlm_batch     albert_core.examples.batch.mlm_batch on 64-row batches, per row (masking + padding + seeding, all rows
                of a batch at once; bench/bench_input.py --input-only compares it with the per-row code)

    python bench/bench_masking.py [--examples 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from albert_core.examples.batch import mlm_batch
from albert_core.examples.masking import IGNORE_INDEX, example_rng, ngram_mask

PAD, CLS, SEP, MASK = 0, 2, 3, 4
SPECIAL = (PAD, CLS, SEP)
VOCAB = 30_000
LENGTH = 512


def make_examples(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """[CLS] A [SEP] B [SEP] with English-like words of 1-4 pieces (mostly 1)."""
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(n):
        ids = rng.integers(5, VOCAB, size=LENGTH)
        pieces = rng.choice([1, 2, 3, 4], size=LENGTH, p=[0.72, 0.18, 0.07, 0.03])
        starts = np.concatenate(([0], np.cumsum(pieces)))
        word_starts = np.zeros(LENGTH, dtype=bool)
        word_starts[starts[starts < LENGTH]] = True
        sep = int(rng.integers(100, 400))
        ids[[0, sep, LENGTH - 1]] = (CLS, SEP, SEP)
        word_starts[[0, sep, LENGTH - 1]] = True
        examples.append((ids, word_starts))
    return examples


def random_token_mask(ids: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Baseline: i.i.d. 15% of non-special tokens, 80/10/10."""
    special = (ids == PAD) | (ids == CLS) | (ids == SEP)
    positions = np.flatnonzero((rng.random(ids.size) < 0.15) & ~special)
    labels = np.full(ids.size, IGNORE_INDEX, dtype=np.int64)
    labels[positions] = ids[positions]
    out = ids.copy()
    action = rng.random(positions.size)
    out[positions[action < 0.8]] = MASK
    random_at = positions[(action >= 0.8) & (action < 0.9)]
    out[random_at] = rng.integers(5, VOCAB, size=random_at.size)
    return out, labels


def timed(fn: Callable[[], None], n_examples: int) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) / n_examples * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    examples = make_examples(args.examples)
    n = len(examples)

    def baseline() -> None:
        rng = np.random.default_rng(1)
        for ids, _ in examples:
            random_token_mask(ids, rng)

    def ngram() -> None:
        rng = np.random.default_rng(1)
        for ids, ws in examples:
            ngram_mask(ids, ws, rng=rng, vocab_size=VOCAB, special_ids=SPECIAL, mask_id=MASK)

    def ngram_seeded() -> None:
        for i, (ids, ws) in enumerate(examples):
            ngram_mask(ids, ws, rng=example_rng(1, 0, i), vocab_size=VOCAB, special_ids=SPECIAL, mask_id=MASK)

    def batched() -> None:
        for first in range(0, n, 64):
            chunk = examples[first : first + 64]
            mlm_batch(
                [ids for ids, _ in chunk],
                [np.zeros(LENGTH, dtype=np.int64)] * len(chunk),
                [0] * len(chunk),
                [ws for _, ws in chunk],
                list(range(first, first + len(chunk))),
                seed=1,
                epoch=0,
                seq_len=LENGTH,
                vocab_size=VOCAB,
                special_ids=SPECIAL,
                mask_id=MASK,
            )

    variants = {"baseline": baseline, "ngram": ngram, "ngram+rng": ngram_seeded, "mlm_batch": batched}
    for fn in variants.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            times[name].append(timed(fn, n))

    base = statistics.median(times["baseline"])
    print(f"{n} examples of {LENGTH} tokens, {args.rounds} interleaved rounds, median us per example")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:>10}: {median:8.1f} us/example   x{median / base:5.2f} vs baseline")


if __name__ == "__main__":
    main()
