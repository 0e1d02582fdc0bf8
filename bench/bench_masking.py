"""The batch masker against a plain per-row 15% masker, in rows/s, on rows as a training worker reads them.

Rows: synthetic [CLS] A [SEP] B [SEP] pairs (90% full length, the rest a quarter to all of it; Zipf-distributed
piece ids, three quarters of them word starts) written to a Parquet table in the shard schema and read back as
`services.train.data.ShardRows.read` reads them: `column.to_numpy()` of the Arrow list columns, one numpy array a
row. Timed in interleaved rounds (median reported), at 128 and 512 tokens, in this one process:

- plain     the cheapest honest per-row masker: each micro-batch's padded arrays (input_ids, attention_mask,
            token_type_ids, mlm_labels, pair_labels) filled row by row, each non-special token of a row chosen with
            p = 0.15 from one running numpy generator, then 80% [MASK] / 10% random / 10% kept
- batch     what a worker runs: `albert_core.examples.batch.mlm_batches` on a step's rows in one call, cut into
            micro-batches (whole-word n-gram spans, seeded per example and epoch)

The ratio batch / plain is the number to read (targets: >= 0.84 at 512 tokens, >= 1.3 at 128).

    python bench/bench_masking.py [--step-rows 512] [--micro-batch 64] [--rows 4096] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import torch

from albert_core.examples.batch import mlm_batches
from albert_core.examples.masking import IGNORE_INDEX
from albert_core.examples.shards import EXAMPLE_SCHEMA

PAD, CLS, SEP, MASK = 0, 2, 3, 4
SPECIAL = (0, 1, 2, 3, 4)  # ALBERT's pad, unk, [CLS], [SEP], [MASK]
VOCAB = 30_000


def worker_rows(n: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    """n rows in the shard schema, through Arrow, as a worker's reader returns them (object columns of arrays)."""
    rng = np.random.default_rng(seed)
    columns: dict[str, list] = {name: [] for name in ("input_ids", "token_type_ids", "word_starts")}
    for _ in range(n):
        size = length if rng.random() < 0.9 else int(rng.integers(length // 4, length))
        n_a = int(rng.integers(1, size - 3))
        pieces = (rng.zipf(1.3, size - 3) - 1) % (VOCAB - 5) + 5
        starts = rng.random(size) < 0.75
        starts[[0, n_a + 1, size - 1]] = True
        columns["input_ids"].append(np.concatenate([[CLS], pieces[:n_a], [SEP], pieces[n_a:], [SEP]]))
        columns["token_type_ids"].append(np.r_[np.zeros(n_a + 2, np.int8), np.ones(size - n_a - 2, np.int8)])
        columns["word_starts"].append(starts)
    table = pa.table(
        {
            "example_id": np.arange(n, dtype=np.int64),
            "pair_label": rng.integers(0, 2, n).astype(np.int8),
            **{
                name: [list(map(int, v)) if name != "word_starts" else list(map(bool, v)) for v in values]
                for name, values in columns.items()
            },  # fmt: skip
        }
    )
    table = table.select([f.name for f in EXAMPLE_SCHEMA if f.name in table.column_names])
    table = table.cast(pa.schema([EXAMPLE_SCHEMA.field(name) for name in table.column_names]))
    return {name: table.column(name).to_numpy() for name in table.column_names}


def plain_batch(ids_rows, type_rows, pair_labels, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A micro-batch padded to its longest row (a multiple of 8), each row masked i.i.d. at 15%, 80/10/10."""
    lengths = np.fromiter(map(len, ids_rows), dtype=np.int64, count=len(ids_rows))
    width = -(-int(lengths.max()) // 8) * 8
    inside = np.arange(width)[None, :] < lengths[:, None]
    ids = np.concatenate(ids_rows).astype(np.int64)
    masked, labels = ids.copy(), np.full(ids.size, IGNORE_INDEX, dtype=np.int64)
    start = 0
    for n in lengths.tolist():  # row by row, one running generator
        row = ids[start : start + n]
        at = start + np.flatnonzero((rng.random(n) < 0.15) & (row > MASK))  # ids 0-4: pad, unk, [CLS], [SEP], [MASK]
        labels[at] = ids[at]
        action = rng.random(at.size)
        masked[at[action < 0.8]] = MASK
        random_at = at[(action >= 0.8) & (action < 0.9)]
        masked[random_at] = rng.integers(5, VOCAB, size=random_at.size)
        start += n
    batch = {"input_ids": masked, "attention_mask": None, "token_type_ids": np.concatenate(type_rows),
             "mlm_labels": labels}  # fmt: skip
    for name, fill in (("input_ids", PAD), ("token_type_ids", 0), ("mlm_labels", IGNORE_INDEX)):
        padded = np.full(inside.shape, fill, dtype=np.int64)
        padded[inside] = batch[name]
        batch[name] = padded
    batch["attention_mask"] = inside.astype(np.int64)
    batch["pair_labels"] = np.asarray(pair_labels, dtype=np.int64)
    return batch


def rates(length: int, n_rows: int, step_rows: int, micro: int, rounds: int) -> dict[str, float]:
    """Median rows/s of the plain and the batch masker on the same rows, interleaved rounds after a warm-up."""
    rows = worker_rows(n_rows, length, seed=length)
    columns = [rows[name] for name in ("input_ids", "token_type_ids", "pair_label", "word_starts", "example_id")]

    def plain() -> None:
        rng = np.random.default_rng(1)
        for a in range(0, n_rows, micro):
            plain_batch(rows["input_ids"][a : a + micro], rows["token_type_ids"][a : a + micro],
                        rows["pair_label"][a : a + micro], rng)  # fmt: skip

    def batch() -> None:
        for a in range(0, n_rows, step_rows):
            mlm_batches(*(c[a : a + step_rows] for c in columns), micro_batch=micro, seed=1, epoch=0, seq_len=None,
                        vocab_size=VOCAB, special_ids=SPECIAL, mask_id=MASK)  # fmt: skip

    variants: dict[str, Callable[[], None]] = {"plain": plain, "batch": batch}
    for fn in variants.values():
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
    return {name: n_rows / statistics.median(values) for name, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-rows", type=int, default=512, help="a worker's rows per step (one mlm_batches call)")
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--rows", type=int, default=4096, help="rows per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lengths", default="128,512")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"numpy {np.__version__}; {args.rows} rows a round, steps of {args.step_rows} rows, micro-batches of "
          f"{args.micro_batch}, {args.rounds} interleaved rounds (medians)\n")  # fmt: skip
    print("| tokens | plain per-row 15% (rows/s) | batch masker (rows/s) | batch / plain |\n|---|---|---|---|")
    for length in (int(n) for n in args.lengths.split(",")):
        measured = rates(length, args.rows, args.step_rows, args.micro_batch, args.rounds)
        plain, batch = measured["plain"], measured["batch"]
        print(f"| {length} | {plain:,.0f} | {batch:,.0f} | {batch / plain:.2f} |", flush=True)


if __name__ == "__main__":
    main()
