"""Input stall: training steps/s reading the shards as a worker does vs from tensors already in memory (target >= 0.95).

The same model, optimizer and step (`services.train.train_step`) run on the same shards, two ways:

- memory     the micro-batches read and masked before timing starts; each step only computes
- stream     what a Ray Train worker does (services/train/data.py): the run's shuffled example order
             (albert_core.data_order), rows read by Parquet row group (`ShardRows`), dynamic masking, all in a
             background thread two steps ahead (`Prefetch`), then the same step; the time of a step includes waiting
             for its batch

Blocks of `--steps` steps alternate (memory, stream, memory, stream, ...), so a busy neighbour slows both alike.
Each stream block opens a new stream, as a (re)started worker does; its first step carries the stream's start-up
(reading the first row groups), printed apart. Block against block is noisy on a shared machine, so each stream step
also times its wait for the batch: the ratio compute / whole step is the stall measured within the same steps.
torch uses `--threads` (default: every core, as the 2 workers of the demo do together), so reading and masking
compete with compute for the CPUs.

The model is the `--recipe` (default tiny, the demo's model: the fastest step, where an input stall shows most) with
its micro-batch size; the shards default to the demo's (run `albert demo` once to make them).

    python bench/bench_input.py [--shards DIR] [--recipe tiny] [--steps 10] [--rounds 2] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from albert_core.data_order import ExampleOrder
from albert_core.model import AlbertForPreTraining
from services.run.config import RunConfig
from services.train.data import Prefetch, ShardRows, host_steps
from services.train.plan import resolve_token_ids
from services.train.step import make_micro_batch, optimizer_for, train_step

DEFAULT_SHARDS = Path(".cache/albert/sample-shards-8000-128")


def stream(files: list[Path], run: RunConfig, masked, steps: int) -> Prefetch:
    """A worker's input for `steps` steps of one micro-batch: rank 0 of 1 from data position 0."""
    order = ExampleOrder(tuple(pq.ParquetFile(f).metadata.num_rows for f in files), run.run.seed)
    batch = run.train.micro_batch_size
    source = host_steps(
        ShardRows([str(f) for f in files], order),
        position=0,
        steps=steps,
        global_batch=batch,
        micro_batch=batch,
        rank=0,
        world=1,
        mask=masked,
    )
    return Prefetch(source, depth=2)


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

    run = RunConfig.load(args.recipe)
    ids = resolve_token_ids(args.shards, run)
    batch_size = run.train.micro_batch_size

    def masked(rows, epochs):
        return make_micro_batch(rows, seed=run.run.seed, epoch=epochs, ids=ids, data=run.data)

    torch.manual_seed(run.run.seed)
    model = AlbertForPreTraining(run.model_config(ids.vocab_size))
    model.train()
    optimizer, scheduler = optimizer_for(model, run.optim)  # the recipe's optimizer and schedule

    def step(batch) -> None:
        train_step(model, optimizer, scheduler, [batch], grad_clip=run.optim.grad_clip)

    with stream(files, run, masked, args.steps) as ahead:
        in_memory = [micro[0] for _, micro in ahead]  # the same batches the stream gives
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
        with stream(files, run, masked, args.steps) as steps:
            for i in range(args.steps):
                start = time.perf_counter()
                _, (batch,) = next(steps)
                ready = time.perf_counter()
                step(batch)
                end = time.perf_counter()
                if i == 0:
                    first_s.append(end - start)
                else:
                    stream_s.append(end - start)
                    input_s.append(ready - start)

    memory_rate = len(memory_s) / sum(memory_s)
    steady_rate = len(stream_s) / sum(stream_s)
    full_rate = (len(stream_s) + len(first_s)) / (sum(stream_s) + sum(first_s))
    within = 1 - sum(input_s) / sum(stream_s)
    print(f"memory  {memory_rate:6.2f} steps/s (median step {statistics.median(memory_s) * 1e3:.0f} ms)")
    print(
        f"stream  {steady_rate:6.2f} steps/s steady (median step {statistics.median(stream_s) * 1e3:.0f} ms, of which "
        f"waiting for the batch: median {statistics.median(input_s) * 1e3:.1f} ms, max "
        f"{max(input_s) * 1e3:.1f} ms); {full_rate:.2f} steps/s with each block's first step (start-up median "
        f"{statistics.median(first_s):.2f} s)"
    )
    print(
        f"input stall ratio stream / memory, block against block: {steady_rate / memory_rate:.3f} steady, "
        f"{full_rate / memory_rate:.3f} with a new stream's start-up every {args.steps} steps (noisy when busy)"
    )
    print(f"input stall ratio within the stream's steps (compute / whole step): {within:.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
