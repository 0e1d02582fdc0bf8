"""What one preemption check costs a training step: `ray.train.get_preemption_info()` timed inside a Ray Train
worker group (a barrier across the workers, answered with rank 0's view), beside a tiny model's training step timed
in the same workers, to pick `train.preemption_check_every`.

    python bench/bench_preemption_check.py [--workers 2] [--calls 200] [--json reports/preemption_check.json]

Each worker times `--calls` checks back to back (the per-call median and p90 on rank 0), then the same number of
`torch.distributed.barrier()` calls (the floor a cross-worker agreement costs over gloo), then 20 training steps
of the tiny test model (tests/test_train.py's shape, micro-batch 4 x 64 tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def timed(fn, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def loop(config: dict) -> None:
    import torch
    import torch.distributed as dist
    from ray import train

    from albert_core.model.config import AlbertConfig
    from albert_core.model.modeling import AlbertForPreTraining

    calls = config["calls"]
    checks = timed(train.get_preemption_info, calls)
    barriers = timed(dist.barrier, calls)
    model_config = AlbertConfig(vocab_size=300, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    model = AlbertForPreTraining(model_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(5, 300, (4, 64))

    def step() -> None:
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids),
                    mlm_labels=ids, pair_labels=torch.zeros(4, dtype=torch.long))  # fmt: skip
        out.loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()

    steps = timed(step, 20)[2:]
    ms = lambda xs: round(1000 * statistics.median(xs), 3)
    p90 = lambda xs: round(1000 * statistics.quantiles(xs, n=10)[8], 3)
    if train.get_context().get_world_rank() == 0:  # written here: Ray Train 2.60 gives no metrics without a checkpoint
        numbers = {
            "check_ms": ms(checks),
            "check_p90_ms": p90(checks),
            "barrier_ms": ms(barriers),
            "step_ms": ms(steps),
        }
        Path(config["out"]).write_text(json.dumps(numbers))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json")
    args = parser.parse_args()
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from services.cluster import connect  # an embedded Ray on loopback, as albert's commands start it

    connect(num_cpus=args.workers)
    out = Path("/tmp/albert-bench/preemption-check.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    TorchTrainer(
        loop,
        train_loop_config={"calls": args.calls, "out": str(out)},
        scaling_config=ScalingConfig(num_workers=args.workers),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name="bench-preemption", storage_path=str(Path("/tmp/albert-bench").resolve())),
    ).fit()
    m = json.loads(out.read_text())
    for every in (1, 10, 100):
        m[f"overhead_every_{every}_pct"] = round(100 * m["check_ms"] / every / m["step_ms"], 3)
    m.update(workers=args.workers, calls=args.calls)
    print(json.dumps(m))
    if args.json:
        Path(args.json).write_text(json.dumps(m, indent=1) + "\n")


if __name__ == "__main__":
    main()
