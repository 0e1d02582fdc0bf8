"""Input stall: training steps/s streaming from Ray Data vs from tensors already in memory (target >= 0.95).

The same model, optimizer and step (`services.train.train_step`) run on the same shards, two ways:

- memory     the micro-batches read and masked before timing starts; each step only computes
- stream     what a Ray Train worker does (services/train.py): `ray.data.read_parquet` of the shard files with the
             train loop's options, `iter_batches(prefetch_batches=2)`, dynamic masking (`make_micro_batch`) in the
             step's thread, then the same step; the time of a step includes waiting for its batch and masking it

Blocks of `--steps` steps alternate (memory, stream, memory, stream, ...), so a busy neighbour slows both alike.
Each stream block opens a new iterator, as each epoch of the train loop does; its first step carries the stream's
start-up, which a run pays once per epoch: the ratio is printed with it and without it (steady state). Block
against block is noisy on a shared machine, so each stream step also times its own parts: the ratio compute /
whole step (waiting for the batch + masking + compute) is the stall measured within the same steps.
torch uses `--threads` (default: every core, as the 2 workers of the demo do together), so reading and masking
compete with compute for the CPUs.

The model is the `--recipe` (default tiny, the demo's albert-tiny: the fastest step, where an input stall shows
most) with its micro-batch size; the shards default to the demo's (run `albert demo` once to make them).

    python bench/bench_input.py [--shards DIR] [--recipe tiny] [--steps 10] [--rounds 2] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from albert_core.model import AlbertForPreTraining
from services.run_config import RunConfig
from services.train import COLUMNS, make_micro_batch, optimizer_for, resolve_token_ids, train_step

DEFAULT_SHARDS = Path(".cache/albert/sample-shards-8000-128")


def memory_batches(files: list[Path], n: int, batch_size: int, masked) -> list[dict[str, torch.Tensor]]:
    """The first n micro-batches of the shards, read with pyarrow and masked, as the stream would give them."""
    table = pq.ParquetFile(files[0]).read(columns=COLUMNS)
    for path in files[1:]:
        if table.num_rows >= n * batch_size:
            break
        table = pa.concat_tables([table, pq.read_table(path, columns=COLUMNS)])
    if table.num_rows < n * batch_size:
        sys.exit(
            f"--shards: {n} micro-batches of {batch_size} need {n * batch_size} rows, the shards hold {table.num_rows}"
        )
    batches = []
    for b in range(n):
        part = table.slice(b * batch_size, batch_size)
        rows = {name: part.column(name).to_numpy(zero_copy_only=False) for name in COLUMNS}
        batches.append(masked(rows))
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=Path, default=DEFAULT_SHARDS, help="an `albert preprocess` output directory")
    parser.add_argument("--recipe", default="tiny", help="run config whose model and micro-batch size are used")
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--rounds", type=int, default=2, help="memory + stream block pairs")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, every core)")
    args = parser.parse_args()
    files = sorted((args.shards / "train").glob("shard-*.parquet"))
    if not files:
        sys.exit(
            f"--shards: no train/shard-*.parquet under {args.shards}; run `albert demo` once, or pass --shards DIR"
        )
    if args.threads:
        torch.set_num_threads(args.threads)

    import ray

    run = RunConfig.load(args.recipe)
    ids = resolve_token_ids(args.shards, run)
    batch_size = run.train.micro_batch_size

    def masked(rows):
        return make_micro_batch(rows, seed=run.run.seed, epoch=0, ids=ids, data=run.data)

    torch.manual_seed(run.run.seed)
    model = AlbertForPreTraining(run.model_config(ids.vocab_size))
    model.train()
    optimizer, scheduler = optimizer_for(model, run.optim)  # the recipe's optimizer and schedule

    def step(batch) -> None:
        train_step(model, optimizer, scheduler, [batch], grad_clip=run.optim.grad_clip)

    in_memory = memory_batches(files, args.steps, batch_size, masked)
    ray.init(num_cpus=max(2, torch.get_num_threads()), include_dashboard=False, log_to_driver=False)
    dataset = ray.data.read_parquet([str(f) for f in files], columns=COLUMNS, shuffle=None, num_cpus=0)
    dataset.context.enable_progress_bars = False
    dataset.context.execution_options.preserve_order = True
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {run.model.preset}, micro-batch {batch_size} x "
        f"<= {run.data.max_seq_length}; {len(files)} shard files in {args.shards}; {args.rounds} rounds of "
        f"{args.steps} steps each way"
    )
    for batch in in_memory[:2]:  # warm-up: allocator, first-step optimizer state
        step(batch)

    memory_s: list[float] = []
    stream_s: list[float] = []  # every stream step after a block's first: batch wait + masking + compute
    input_s: list[float] = []  # the part of those spent waiting for the batch and masking it
    first_s: list[float] = []  # the first step of each stream block (the stream's start-up)
    for _ in range(args.rounds):
        for batch in in_memory:
            start = time.perf_counter()
            step(batch)
            memory_s.append(time.perf_counter() - start)
        batches = dataset.iter_batches(batch_size=batch_size, batch_format="numpy", drop_last=True, prefetch_batches=2)
        rows_iter = iter(batches)
        for i in range(args.steps):
            start = time.perf_counter()
            batch = masked(next(rows_iter))
            ready = time.perf_counter()
            step(batch)
            end = time.perf_counter()
            if i == 0:
                first_s.append(end - start)
            else:
                stream_s.append(end - start)
                input_s.append(ready - start)
        close = getattr(rows_iter, "close", None)
        if close is not None:
            close()
    ray.shutdown()

    memory_rate = len(memory_s) / sum(memory_s)
    steady_rate = len(stream_s) / sum(stream_s)
    full_rate = (len(stream_s) + len(first_s)) / (sum(stream_s) + sum(first_s))
    within = 1 - sum(input_s) / sum(stream_s)
    print(f"memory  {memory_rate:6.2f} steps/s (median step {statistics.median(memory_s) * 1e3:.0f} ms)")
    print(
        f"stream  {steady_rate:6.2f} steps/s steady (median step {statistics.median(stream_s) * 1e3:.0f} ms, of which "
        f"waiting for the batch and masking it: median {statistics.median(input_s) * 1e3:.1f} ms, max "
        f"{max(input_s) * 1e3:.1f} ms); {full_rate:.2f} steps/s with each block's first step (start-up median "
        f"{statistics.median(first_s):.2f} s)"
    )
    print(
        f"input stall ratio stream / memory, block against block: {steady_rate / memory_rate:.3f} steady, "
        f"{full_rate / memory_rate:.3f} with a new epoch's start-up every {args.steps} steps (noisy when busy)"
    )
    print(f"input stall ratio within the stream's steps (compute / whole step): {within:.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
