"""The training input: how fast it makes masked batches (`--input-only`, no model) and whether it stalls the demo
model's steps (the default).

--input-only: rows/s of the input alone, next to what accelerators consume. Synthetic rows (no demo needed): full
[CLS] A [SEP] B [SEP] pairs (90%, the rest a quarter to all of the length) of Zipf-distributed piece ids, three
quarters of them word starts, at 128 and 512 tokens. Measured, with a worker's share of a step of `--step-rows`
rows in micro-batches of 32 (glibc set to keep freed memory, as input processes run):

- masker, per core: the rows masked per second in this process, bench/bench_masking.py's plain per-row 15% masker
  on each micro-batch against `mlm_batches` on the step's rows at once (what a worker runs), in interleaved rounds;
  their ratio is on the same rows in the same run
- input, per worker: Parquet shards written to a temporary directory and read as a worker reads them
  (services.train.input: the example order, rows by row group, masking), in the thread (input_workers = 0) and
  in 1 and 2 input processes; rows/s after the first step (the start-up, printed apart)
- demand: the rows/s an accelerator consumes at 50% of its dense bf16 peak, for the presets' shapes:
      FLOPs/token = 3 x (forward)                                    (albert_core.model.modeling.estimate_flops...)
      forward = L x [2 x (4 H^2 + 2 H F)  +  4 T H]                  (matmuls: q, k, v, out, up, down; attention
                                                                      scores and context, T = sequence length)
                + 2 E H                                              (embedding projection E -> H)
                + 0.15 x (2 H E + 2 E V)                             (MLM head on the 15% masked tokens)
      rows/s = 0.5 x peak / (FLOPs/token x T),  peak: H200 989 TFLOP/s, TPU v4 chip 275 TFLOP/s
  Sharing cuts parameters, not FLOPs. albert-base at 128 tokens on an H200: 3 x (12 x 14.55M + 0.20M + 1.19M)
  = 0.528 GFLOP/token, so 494.5e12 / (0.528e9 x 128) = ~7,300 rows/s; the table prints each, with the headroom
  (the input's best rows/s per worker / demand; target >= 2x).

--plan: shard sets of real size, 100M and 1B examples in files of 100,000 rows (1,000 and 10,000 files whose rows
are empty: their footers hold the row counts, which is all planning reads). Measured: `plan_data` (each file's
footer, the manifest checks), the pickled size of the shard set every worker receives, and a worker's start-up on
the epoch order (`ShardSet.order`, then the rows of a first step and of a step across the epoch's end): seconds,
and the memory the order keeps and peaks at (tracemalloc: numpy's arrays included).

--launch-bound: what input in the thread costs a loop like an accelerator's, whose Python launches kernels and
holds the GIL most of the step (here: `--ops` tiny in-place torch adds on the CPU, about `--step-ms` a step),
against input in processes. Each step also takes a worker's step of `--step-rows` rows at `--length` tokens
from the input; the same steps with input in the thread, in 1 and 2 processes, and with batches made before timing
(none), interleaved in rounds. Reported: the median step (not counting any wait for the batch) per way, and its
difference to none's. An H200 training albert-base at 128 tokens takes a worker's 256 rows in about 35 ms, and the
input makes them in about 5 ms of a core: the defaults.

Default (the stall): training steps/s reading the shards as a worker does vs from tensors already in memory
(target >= 0.95). The same model, optimizer and step (`services.train.step.train_step`) run on the same shards,
two ways:

- memory     the micro-batches read and masked before timing starts; each step only computes
- stream     what a Ray Train worker does (services/train/input.py): the run's shuffled example order
             (albert_core.examples.order), rows read by Parquet row group (`ShardRows`), dynamic masking, two steps
             ahead in a background thread (`--input-workers 0`) or in input processes (`--input-workers N`), then
             the same step; the time of a step includes waiting for its batch

Blocks of `--steps` steps alternate (memory, stream, memory, stream, ...), so a busy neighbour slows both alike.
Each stream block opens a new stream, as a (re)started worker does; its first step carries the stream's start-up
(reading the first row groups), printed apart. Block against block is noisy on a shared machine, so each stream step
also times its wait for the batch: the ratio compute / whole step is the stall measured within the same steps.
torch uses `--threads` (default: every core, as the 2 workers of the demo do together), so reading and masking
compete with compute for the CPUs.

The model is the `--recipe` (default tiny, the demo's model: the fastest step, where an input stall shows most) with
its micro-batch size; the shards default to the demo's (run `albert demo` once to make them), or `--synthetic` writes
128-token shards of an 8,000-piece vocabulary to a temporary directory.

    python bench/bench_input.py --input-only [--step-rows 512] [--rows 4096] [--rounds 3] [--workers 0,1,2]
    python bench/bench_input.py --plan [--plan-sizes 100000000,1000000000]
    python bench/bench_input.py --launch-bound [--step-rows 256] [--length 128] [--step-ms 35] [--steps 40]
    python bench/bench_input.py [--shards DIR | --synthetic] [--recipe tiny] [--steps 10] [--rounds 2]
                                [--threads N] [--input-workers 0]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import pickle
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from albert_core.examples.shards import EXAMPLE_SCHEMA, example_id
from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import AlbertForPreTraining, estimate_flops_per_token
from albert_core.text.tokenization import TokenIds
from services.rundir.config import RunConfig
from services.train.follow import EpochData
from services.train.input import InputPlan, keep_freed_memory, open_input
from services.train.plan import ShardSet, plan_data, resolve_token_ids
from services.train.step import optimizer_for, train_step

DEFAULT_SHARDS = Path(".cache/albert/sample-shards-8000-128")
VERSION_1 = EpochData.of(1, {})  # every epoch on the shard set's first (only) version
MICRO_BATCH = 32
SPECIAL = frozenset((0, 1, 2, 3, 4))  # ALBERT's pad, unk, [CLS], [SEP], [MASK]
PEAK = {"H200": 989e12, "TPU v4": 275e12}  # dense bf16 FLOP/s
PRESETS = ("albert-base", "albert-large", "albert-xxlarge")
MFU = 0.5


# --- synthetic rows and shards ------------------------------------------------------------------------------------


def realistic_rows(n: int, length: int, rng: np.random.Generator, *, vocab: int = 30_000, first: int = 0):
    """n rows as `ShardRows.read` returns them (object columns of arrays): [CLS] A [SEP] B [SEP], 90% of them full
    length, Zipf-distributed pieces, three quarters of them word starts."""
    columns: dict[str, list] = {name: [] for name in ("input_ids", "token_type_ids", "word_starts")}
    for _ in range(n):
        size = length if rng.random() < 0.9 else int(rng.integers(length // 4, length))
        n_a = int(rng.integers(1, size - 3))
        pieces = (rng.zipf(1.3, size - 3) - 1) % (vocab - 5) + 5
        starts = rng.random(size) < 0.75
        starts[[0, n_a + 1, size - 1]] = True
        columns["input_ids"].append(np.concatenate([[2], pieces[:n_a], [3], pieces[n_a:], [3]]).astype(np.int32))
        columns["token_type_ids"].append(np.r_[np.zeros(n_a + 2, np.int8), np.ones(size - n_a - 2, np.int8)])
        columns["word_starts"].append(starts)
    rows = {name: np.empty(n, dtype=object) for name in columns}
    for name, values in columns.items():
        rows[name][:] = values
    rows["example_id"] = np.arange(first, first + n, dtype=np.int64)
    rows["pair_label"] = rng.integers(0, 2, n).astype(np.int8)
    return rows


def write_shards(directory: Path, *, length: int, rows_per_file: int, files: int, vocab: int) -> ShardSet:
    """Parquet shards of `realistic_rows` in the preprocessor's schema, as one part."""
    train = directory / "train"
    train.mkdir(parents=True)
    rng = np.random.default_rng(length)
    paths = []
    for f in range(files):
        rows = realistic_rows(rows_per_file, length, rng, vocab=vocab)
        rows["example_id"] = np.asarray([example_id(f, r) for r in range(rows_per_file)], dtype=np.int64)
        table = pa.table({name: list(rows[name]) if rows[name].dtype == object else rows[name]
                          for name in EXAMPLE_SCHEMA.names}, schema=EXAMPLE_SCHEMA)  # fmt: skip
        path = train / f"shard-{f:05d}.parquet"
        pq.write_table(table, path, row_group_size=1024)
        paths.append(str(path))
    return ShardSet(str(directory), tuple(paths), (rows_per_file,) * files, (files,), ("part-0",), ("",) * files)


# --- --input-only --------------------------------------------------------------------------------------------------


def masker_rates(length: int, n_rows: int, step_rows: int, rounds: int) -> dict[str, float]:
    """Rows/s of the plain per-row masker on each micro-batch and of the batch masker on each step's rows."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_masking import rates  # a script beside this one

    return rates(length, n_rows, step_rows, MICRO_BATCH, rounds)


def input_rates(shards: ShardSet, length: int, step_rows: int, steps: int, workers: list[int], rounds: int):
    """{processes: (rows/s, seconds to the first step)} of a worker's input, per number of input processes (0: the
    thread), medians of interleaved rounds. The rate leaves out the first 2 steps of each process: spawned processes
    start together, in about a second and a half each, while the first step is already out."""
    run = RunConfig()
    run.train = dataclasses.replace(run.train, global_batch_size=step_rows, micro_batch_size=MICRO_BATCH)
    run.data = dataclasses.replace(run.data, max_seq_length=length)
    plan = InputPlan(shards, run, TokenIds(vocab_size=30_000), (VERSION_1,), VERSION_1, 0, steps, rank=0, world=1)
    measured: dict[int, list[tuple[float, float]]] = {n: [] for n in workers}
    for _ in range(rounds):
        for n in workers:
            start = time.perf_counter()
            with open_input(plan, workers=n, pin=False) as items:
                next(items)
                first = time.perf_counter()
                for _ in range(2 * max(n, 1) - 1):
                    next(items)
                warm = time.perf_counter()
                made = sum(1 for _ in items)
                end = time.perf_counter()
            measured[n].append((made * step_rows / (end - warm), first - start))
    return {n: tuple(statistics.median(v) for v in zip(*values, strict=True)) for n, values in measured.items()}


def demand(preset: str, length: int, device: str) -> tuple[float, float]:
    """(GFLOP per token, rows/s) an accelerator trains at MFU of its peak, for the preset at this length."""
    config = AlbertConfig.preset(preset, vocab_size=30_000)
    flops = estimate_flops_per_token(config, length, mlm_fraction=0.15)
    return flops / 1e9, MFU * PEAK[device] / (flops * length)


def input_only(args) -> None:
    keep_freed_memory()  # as in input processes
    workers = [int(w) for w in args.workers.split(",")]
    print(f"numpy {np.__version__}, torch {torch.__version__}; {args.rows} rows per masker round, steps of "
          f"{args.step_rows} rows in micro-batches of {MICRO_BATCH}; on a shared 2-core machine")  # fmt: skip
    best: dict[int, float] = {}
    print("\n| tokens | plain per-row masker (rows/s/core) | batch masker (rows/s/core) | x | "
          + " | ".join(f"input, {'thread' if n == 0 else f'{n} process' + 'es' * (n > 1)} (rows/s/worker)"
                       for n in workers) + " |")  # fmt: skip
    print("|---|---|---|---|" + "---|" * len(workers))
    with tempfile.TemporaryDirectory() as tmp:
        for length in (128, 512):
            masker = masker_rates(length, args.rows, args.step_rows, args.rounds)
            before, now = masker["plain"], masker["batch"]
            shards = write_shards(Path(tmp) / str(length), length=length, rows_per_file=args.step_rows * 8, files=4,
                                  vocab=30_000)  # fmt: skip
            rates = input_rates(shards, length, args.step_rows, args.input_steps, workers, args.rounds)
            best[length] = max(rate for rate, _ in rates.values())
            cells = " | ".join(f"{rate:,.0f} (start-up {startup:.1f} s)" for rate, startup in rates.values())
            print(f"| {length} | {before:,.0f} | {now:,.0f} | {now / before:.2f} | {cells} |")
    print("\n| preset | accelerator (50% of bf16 peak) | tokens | GFLOP/token | rows/s consumed | input rows/s | "
          "headroom |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for preset in PRESETS:
        for device in PEAK:
            for length in (128, 512):
                gflop, rows = demand(preset, length, device)
                print(f"| {preset} | {device} | {length} | {gflop:.3f} | {rows:,.0f} | {best[length]:,.0f} | "
                      f"{best[length] / rows:.1f}x |")  # fmt: skip


# --- --plan --------------------------------------------------------------------------------------------------------

FILE_ROWS = 100_000


def write_empty_shards(train: Path, files: int) -> None:
    """`files` shard files of FILE_ROWS rows each, every list empty: real footers, almost no data."""
    train.mkdir(parents=True)
    n = FILE_ROWS
    columns = {
        "example_id": pa.array(np.zeros(n, dtype=np.int64)),
        "pair_label": pa.array(np.zeros(n, dtype=np.int8)),
        **{f.name: pa.array([[]] * n, type=f.type) for f in EXAMPLE_SCHEMA if pa.types.is_list(f.type)},
    }
    table = pa.table(columns).select(EXAMPLE_SCHEMA.names).cast(EXAMPLE_SCHEMA)
    for f in range(files):
        pq.write_table(table, train / f"shard-{f:05d}.parquet")


def plan_row(directory: Path, examples: int) -> str:
    files = examples // FILE_ROWS
    write_empty_shards(directory / "train", files)
    run = RunConfig()
    start = time.perf_counter()
    shards = plan_data(directory, run)
    planned = time.perf_counter() - start
    tracemalloc.start()
    start = time.perf_counter()
    order = shards.order(shards.version, run.run.seed)
    n = order.num_examples
    rows, _ = order.rows_at(np.arange(0, 512))
    first = time.perf_counter() - start
    start = time.perf_counter()
    order.rows_at(np.arange(n - 256, n + 256))
    crossing = time.perf_counter() - start
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    size = len(pickle.dumps(shards)) / 1e6
    return (
        f"| {n:,} | {files:,} | {order.num_blocks:,} | {planned:.2f} | {size:.1f} | {first:.2f} | {crossing:.2f} | "
        f"{kept / 1e6:.0f} | {peak / 1e6:.0f} |"
    )


def plan(args) -> None:
    print("| examples | files | blocks | plan_data (s) | shard set pickled (MB) | order: first step (s) | step across "
          "the epoch end (s) | order keeps (MB) | peak (MB) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for examples in (int(n) for n in args.plan_sizes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            print(plan_row(Path(tmp), examples), flush=True)


# --- --launch-bound ------------------------------------------------------------------------------------------------


def launch_bound(args) -> None:
    steps = launch_bound_steps(args.step_rows, args.length, args.step_ms, args.steps, args.rounds)
    base = statistics.median(steps["none"])
    print(f"a loop of tiny torch ops, ~{args.step_ms:.0f} ms a step, taking {args.step_rows} rows x {args.length} "
          f"tokens a step; {args.rounds} rounds of {args.steps} steps each way; on a shared 2-core machine\n\n"
          "| input | median step (ms) | vs none |\n|---|---|---|")  # fmt: skip
    for name, values in steps.items():
        median = statistics.median(values)
        print(f"| {name} | {median * 1e3:.1f} | {100 * (median / base - 1):+.1f}% |")


def launch_bound_steps(step_rows: int, length: int, step_ms: float, n: int, rounds: int) -> dict[str, list[float]]:
    """The step times of a launch-bound loop with input made beforehand (none), in the thread, in 1 and 2 processes,
    interleaved in rounds."""
    torch.set_num_threads(1)
    x = torch.zeros(4)
    ops = calibrate_ops(x, step_ms / 1e3)
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_shards(Path(tmp), length=length, rows_per_file=step_rows * 16, files=4, vocab=30_000)
        run = RunConfig()
        run.train = dataclasses.replace(run.train, global_batch_size=step_rows, micro_batch_size=MICRO_BATCH)
        run.data = dataclasses.replace(run.data, max_seq_length=length)
        plan = InputPlan(shards, run, TokenIds(vocab_size=30_000), (1,), 0, n + 4, rank=0, world=1)
        with open_input(plan, workers=0, pin=False) as items:
            made = list(items)
        modes = {"none": None, "thread": 0, "1 process": 1, "2 processes": 2}
        steps: dict[str, list[float]] = {name: [] for name in modes}
        for _ in range(rounds):
            for name, workers in modes.items():
                steps[name] += launch_steps(x, ops, plan, workers, made, n)
    return steps


def calibrate_ops(x: torch.Tensor, seconds: float) -> int:
    start = time.perf_counter()
    for _ in range(2000):
        x.add_(1)
    return max(1, int(seconds / ((time.perf_counter() - start) / 2000)))


def launch_steps(x: torch.Tensor, ops: int, plan: InputPlan, workers: int | None, made: list, n: int) -> list[float]:
    """The time of each step's launches (waits for the batch not counted), the input made as `workers` says."""
    source = contextlib.nullcontext(iter(made)) if workers is None else open_input(plan, workers=workers, pin=False)
    times = []
    with source as items:
        for i in range(n + 2):
            next(items)
            start = time.perf_counter()
            for _ in range(ops):
                x.add_(1)
            if i >= 2:  # after the processes' start
                times.append(time.perf_counter() - start)
    return times


# --- the stall, with the demo model ---------------------------------------------------------------------------------


def stream(shards: ShardSet, run: RunConfig, ids: TokenIds, steps: int, workers: int):
    """A worker's input for `steps` steps of one micro-batch: rank 0 of 1 from data position 0."""
    run = dataclasses.replace(run, train=dataclasses.replace(run.train, global_batch_size=run.train.micro_batch_size))
    return open_input(
        InputPlan(shards, run, ids, (VERSION_1,), VERSION_1, 0, steps, rank=0, world=1), workers=workers, pin=False
    )


def shard_set(directory: Path) -> ShardSet:
    files = tuple(str(f) for f in sorted((directory / "train").glob("shard-*.parquet")))
    if not files:
        sys.exit(f"--shards: no train/shard-*.parquet under {directory}; run `albert demo` once, or pass --synthetic")
    rows = tuple(pq.ParquetFile(f).metadata.num_rows for f in files)
    return ShardSet(str(directory), files, rows, (len(files),), ("part-0",), ("",) * len(files))


def stall(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    run = RunConfig.load(args.recipe)
    with tempfile.TemporaryDirectory() as tmp:
        if args.synthetic:
            shards = write_shards(Path(tmp), length=run.data.max_seq_length, rows_per_file=4096, files=2, vocab=8000)
            ids = TokenIds(vocab_size=8000)
        else:
            shards, ids = shard_set(args.shards), resolve_token_ids(args.shards, run)
        modes = [int(w) for w in args.input_workers.split(",")]
        stall_rounds(args, run, shards, ids, modes)


def stall_rounds(args, run: RunConfig, shards: ShardSet, ids: TokenIds, modes: list[int]) -> None:
    torch.manual_seed(run.run.seed)
    model = AlbertForPreTraining(run.model_config(ids.vocab_size))
    model.train()
    optimizer, scheduler = optimizer_for(model, run.optim)  # the recipe's optimizer and schedule

    def step(batch) -> None:
        train_step(model, optimizer, scheduler, [batch], grad_clip=run.optim.grad_clip)

    with stream(shards, run, ids, args.steps, 0) as ahead:
        in_memory = [micro[0] for _, micro in ahead]  # the same batches the stream gives
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {run.model.preset}, micro-batch "
        f"{run.train.micro_batch_size} x <= {run.data.max_seq_length}; {len(shards.files)} shard files in "
        f"{shards.directory}; {args.rounds} rounds of {args.steps} steps each way; input in "
        + ", ".join("the thread" if n == 0 else f"{n} process(es)" for n in modes)
    )
    for batch in in_memory[:2]:  # warm-up: allocator, first-step optimizer state
        step(batch)
    memory_s: list[float] = []
    timed = {n: {"stream": [], "input": [], "first": [], "compute": []} for n in modes}
    for _ in range(args.rounds):
        for batch in in_memory:
            start = time.perf_counter()
            step(batch)
            memory_s.append(time.perf_counter() - start)
        for n in modes:
            with stream(shards, run, ids, args.steps, n) as steps:
                for i in range(args.steps):
                    start = time.perf_counter()
                    _, (batch,) = next(steps)
                    ready = time.perf_counter()
                    step(batch)
                    end = time.perf_counter()
                    if i == 0:
                        timed[n]["first"].append(end - start)
                    else:
                        timed[n]["stream"].append(end - start)
                        timed[n]["input"].append(ready - start)
                        timed[n]["compute"].append(end - ready)
    report_stall(memory_s, timed, args.steps)


def report_stall(memory_s: list[float], timed: dict[int, dict[str, list[float]]], steps: int) -> None:
    """Steps/s of each way, and two stall ratios; with input in the thread and in processes, the compute time of
    the same steps against the memory blocks' (the input's cost to the step beyond waiting: the GIL, the cores)."""
    memory_rate, memory_median = len(memory_s) / sum(memory_s), statistics.median(memory_s)
    print(f"memory  {memory_rate:6.2f} steps/s (median step {memory_median * 1e3:.1f} ms)")
    for n, t in timed.items():
        where = "thread " if n == 0 else f"{n} proc "
        stream_s, input_s, first_s = t["stream"], t["input"], t["first"]
        steady_rate = len(stream_s) / sum(stream_s)
        full_rate = (len(stream_s) + len(first_s)) / (sum(stream_s) + sum(first_s))
        within = 1 - sum(input_s) / sum(stream_s)
        compute = statistics.median(t["compute"])
        print(
            f"{where} {steady_rate:6.2f} steps/s steady (median step {statistics.median(stream_s) * 1e3:.1f} ms, of "
            f"which waiting for the batch: median {statistics.median(input_s) * 1e3:.1f} ms, max "
            f"{max(input_s) * 1e3:.1f} ms; compute median {compute * 1e3:.1f} ms, "
            f"{100 * (compute / memory_median - 1):+.1f}% vs memory); {full_rate:.2f} steps/s with each block's "
            f"first step (start-up median {statistics.median(first_s):.2f} s)"
        )
        print(
            f"        stall ratio stream / memory, block against block: {steady_rate / memory_rate:.3f} steady, "
            f"{full_rate / memory_rate:.3f} with a new stream's start-up every {steps} steps (noisy when busy); "
            f"within the stream's steps (compute / whole step): {within:.3f} (target >= 0.95)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-only", action="store_true", help="the input's rows/s without a model, and demand")
    parser.add_argument("--step-rows", type=int, default=512, help="--input-only: a worker's rows per step")
    parser.add_argument("--rows", type=int, default=4096, help="--input-only: rows per masker round")
    parser.add_argument("--input-steps", type=int, default=64, help="--input-only: steps per input measurement")
    parser.add_argument("--workers", default="0,1,2", help="--input-only: input processes to measure (0: thread)")
    parser.add_argument("--launch-bound", action="store_true", help="the thread's cost to a launch-bound loop")
    parser.add_argument("--length", type=int, default=128, help="--launch-bound: tokens per row")
    parser.add_argument("--step-ms", type=float, default=35.0, help="--launch-bound: the loop's work per step")
    parser.add_argument("--plan", action="store_true", help="planning and the epoch order at 100M and 1B examples")
    parser.add_argument("--plan-sizes", default="100000000,1000000000", help="--plan: examples of each shard set")
    parser.add_argument("--shards", type=Path, default=DEFAULT_SHARDS, help="an `albert preprocess` output directory")
    parser.add_argument("--synthetic", action="store_true", help="write synthetic 128-token shards instead")
    parser.add_argument("--recipe", default="tiny", help="run config whose model and micro-batch size are used")
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default: 3 --input-only, else 2)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, every core)")
    parser.add_argument("--input-workers", default="0", help="input processes of each stream block (0: thread), "
                        "e.g. 0,1 to compare")  # fmt: skip
    args = parser.parse_args()
    if args.launch_bound:
        args.rounds = args.rounds or 3
        args.step_rows = 256 if args.step_rows == 512 else args.step_rows
        launch_bound(args)
    elif args.plan:
        plan(args)
    elif args.input_only:
        args.rounds = args.rounds or 3
        input_only(args)
    else:
        args.rounds = args.rounds or 2
        stall(args)


if __name__ == "__main__":
    main()
