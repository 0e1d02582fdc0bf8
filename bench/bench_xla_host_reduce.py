"""What the XLA backend's host all-reduce costs: 2 Ray-style workers (one PJRT CPU replica each, gloo) vs 1.

Two measurements, each in fresh processes (torch.multiprocessing, a gloo group on 127.0.0.1 as Ray Train sets up):

- step: `xla_train_step` on the tiny model of the XLA test tier (2 layers, H=64, vocab 200; 67K parameters), one
  micro-batch of 4 rows in the 64-token bucket per worker, LAMB. 1 worker without a reduce (one graph per step)
  against 2 workers with `host_reduce` (counts and gradients read back, summed over gloo, sent back; three graphs
  per step). The worker counts alternate `--repeats` times; the median step of each run after `--warmup` steps
  (the compiles) is printed, and the ratio of the medians.
- transfer: the part of that reduce that grows with the model, for albert-base (11.7M parameters) and
  albert-xxlarge (222.6M) sizes of float32 buffer: device -> host copy, gloo all-reduce over 2 workers, host ->
  device copy, each timed on rank 0 (median of `--transfer-repeats`).

On PJRT CPU the "device" is host memory, so the copies here are memcpy and say nothing of a TPU's PCIe/host link;
the gloo time is over loopback between 2 processes on one machine, not a data-centre network. Read the numbers as
the overhead of the mechanism, and rescale the transfer for your interconnect (deploy.md, XLA section).

    ~/.cache/albert/venv-xla/bin/python bench/bench_xla_host_reduce.py [--steps 20] [--warmup 3] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BUCKETS = (32, 64)
SIZES = {"albert-base": 11_683_584, "albert-xxlarge": 222_595_584}  # parameters, counted with transformers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup(rank: int, world: int, port: int):
    os.environ["PJRT_DEVICE"] = "CPU"
    from services.train.xla import setup_xla_worker

    worker = setup_xla_worker("CPU")
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return worker


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def tiny_batch(seed: int) -> dict[str, np.ndarray]:
    """4 random [CLS] A [SEP] B [SEP] rows of 40..64 tokens, n-gram masked by albert_core.examples.batch.mlm_batch."""
    from albert_core.examples.batch import mlm_batch

    rng = np.random.default_rng(seed)
    ids, types, words = [], [], []
    for length in rng.integers(40, 65, size=4).tolist():
        len_a = int(rng.integers(1, length - 3))
        row = rng.integers(5, 200, size=length)
        row[[0, len_a + 1, length - 1]] = (2, 3, 3)
        starts = rng.random(length) < 0.75
        starts[[0, len_a + 1, length - 1]] = True
        ids.append(row.tolist())
        types.append([0] * (len_a + 2) + [1] * (length - len_a - 2))
        words.append(starts.tolist())
    labels = rng.integers(2, size=4).tolist()
    return mlm_batch(
        ids,
        types,
        labels,
        words,
        list(range(4)),
        seed=seed,
        epoch=0,
        seq_len=None,
        vocab_size=200,
        special_ids=(0, 2, 3),
        mask_id=4,
    )


def step_worker(rank: int, world: int, port: int, steps: int, warmup: int, out) -> None:
    worker = setup(rank, world, port)
    from albert_core.model.config import AlbertConfig
    from albert_core.model.modeling import AlbertForPreTraining
    from albert_core.optim import make_optimizer, make_scheduler
    from services.train.xla import compile_count, static_batch, xla_train_step

    config = AlbertConfig.preset(
        "albert-tiny",
        vocab_size=200,
        embedding_size=32,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = AlbertForPreTraining(config).to(worker.device)
    optimizer = make_optimizer(model, lr=0.01)
    scheduler = make_scheduler(optimizer, warmup_steps=2, total_steps=10 * (steps + warmup))
    batches = [
        {k: v.to(worker.device) for k, v in static_batch(tiny_batch(100 * rank + i), buckets=BUCKETS).items()}
        for i in range(4)
    ]
    reduce = all_reduce_sum if world > 1 else None
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        stats = xla_train_step(model, optimizer, batches[step % 4], scheduler=scheduler, host_reduce=reduce)
        stats.loss.item()  # waits for the step's graph: both variants end on a finished step
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put((statistics.median(times[warmup:]), compile_count(), sum(p.numel() for p in model.parameters())))
    if world > 1:
        dist.destroy_process_group()


def transfer_worker(rank: int, world: int, port: int, repeats: int, out) -> None:
    worker = setup(rank, world, port)
    results = {}
    for name, n in SIZES.items():
        on_device = torch.ones(n, device=worker.device)
        down, reduce, up = [], [], []
        for _ in range(repeats + 1):  # the first one compiles the sum that waits for the copy back: not counted
            dist.barrier()
            t0 = time.perf_counter()
            host = on_device.cpu()
            t1 = time.perf_counter()
            all_reduce_sum(host)
            t2 = time.perf_counter()
            back = host.to(worker.device)
            back.sum().item()  # the copy is done once a graph has read it
            t3 = time.perf_counter()
            down.append(t1 - t0)
            reduce.append(t2 - t1)
            up.append(t3 - t2)
        assert float(host[0]) == world
        results[name] = tuple(statistics.median(x[1:]) for x in (down, reduce, up))
        del on_device, host, back
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def spawn(fn, world: int, *args):
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(fn, args=(world, free_port(), *args, out), nprocs=world, join=True, start_method="spawn")
    return out.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--transfer-repeats", type=int, default=3)
    parser.add_argument("--no-transfer", action="store_true")
    args = parser.parse_args()

    medians = {1: [], 2: []}
    for _ in range(args.repeats):
        for world in (1, 2):
            median, compiles, params = spawn(step_worker, world, args.steps, args.warmup)
            medians[world].append(median)
            reduce = "host reduce over gloo" if world > 1 else "no reduce"
            print(f"{world} worker(s), {reduce}: median step {median * 1e3:.2f} ms; {compiles} graphs compiled")
    one, two = min(medians[1]), min(medians[2])
    print(f"tiny model ({params:,} parameters), best median step: 1 worker {one * 1e3:.2f} ms, 2 workers with host")
    print(f"reduce {two * 1e3:.2f} ms: ratio {two / one:.2f}x, +{(two - one) * 1e3:.2f} ms per step")
    if args.no_transfer:
        return
    results = spawn(transfer_worker, 2, args.transfer_repeats)
    for name, (down, reduce, up) in results.items():
        mb = SIZES[name] * 4 / 1e6
        sent = 2 * (2 - 1) / 2 * mb  # a ring all-reduce sends 2(n-1)/n of the buffer per worker
        print(
            f"{name} gradients ({mb:.0f} MB float32), 2 workers on PJRT CPU: device->host {down * 1e3:.0f} ms, "
            f"gloo all-reduce {reduce * 1e3:.0f} ms ({sent / max(reduce, 1e-9) / 1e3:.2f} GB/s sent per worker), "
            f"host->device {up * 1e3:.0f} ms; total {(down + reduce + up) * 1e3:.0f} ms"
        )


if __name__ == "__main__":
    main()
