"""Training throughput of our step vs transformers' ALBERT + AdamW, with MFU against a measured GEMM peak.

Both models have the albert-base shape (V=30000, E=128, H=768, 12 layers sharing one, FFN 3072) and start from the
same weights (ours converted with albert_core.model.interop.to_hf). Both train on the same batch of 8 × 128 tokens,
n-gram masked by albert_core.examples.batch. Dropout is 0.1 in both.

- ours: AlbertForPreTraining, MLM decoded at the masked positions only (~15% of tokens), one
  `services.train.step.train_step`: forward, backward, global-norm clip 1.0, LAMB, schedule.
- transformers: AlbertForPreTraining(labels=..., sentence_order_label=...), which decodes every position, plus
  clip 1.0 and torch.optim.AdamW(foreach=True).

The two alternate one timed step at a time, which is fair on a shared machine; the best and the median step
are printed. For each: tokens/s, GFLOP/s (model FLOPs from albert_core.model.modeling.estimate_flops_per_token, counting
the work each model does: ours decodes ~15% of positions), and MFU against the fp32 `torch.mm` peak (the better
of a measurement before and one after the timed steps, in the same run). Then the ratios ours / transformers for
our eager step and for our step with `train.compile` (model.modeling.compile_backbone), all three interleaved.

    python bench/bench_train.py [--steps 10] [--warmup 2] [--no-compile] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import torch

from albert_core.examples.batch import mlm_batch
from albert_core.model.config import AlbertConfig
from albert_core.model.interop import to_hf
from albert_core.model.modeling import AlbertForPreTraining, compile_backbone, estimate_flops_per_token
from albert_core.optim import make_optimizer, make_scheduler
from services.train.step import train_step

BATCH, SEQ, VOCAB = 8, 128, 30000


def gemm_peak(
    n: int = 2048, reps: int = 5, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> float:
    """Best FLOP/s of an n×n×n torch.mm in `dtype` on `device` (default: fp32 on the CPU), now."""
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None
    torch.mm(a, b)
    sync()
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def make_batch(seed: int = 0, *, batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """`batch` full rows of `seq` random pieces ([CLS] A [SEP] B [SEP]), n-gram masked, as CPU tensors."""
    rng = np.random.default_rng(seed)
    rows, types, starts = [], [], []
    for _ in range(batch):
        split = int(rng.integers(20, seq - 20))
        ids = [2, *rng.integers(5, vocab, split - 2), 3, *rng.integers(5, vocab, seq - split - 1), 3]
        rows.append(ids)
        types.append([0] * split + [1] * (seq - split))
        ws = rng.random(seq) < 0.75
        ws[0] = True
        starts.append(ws)
    masked = mlm_batch(
        rows,
        types,
        rng.integers(0, 2, batch),
        starts,
        list(range(batch)),
        seed=1,
        epoch=0,
        seq_len=seq,
        vocab_size=vocab,
        special_ids=(0, 1, 2, 3, 4),
        mask_id=4,
    )
    return {k: torch.from_numpy(v) for k, v in masked.items()}


def build_ours(
    config: AlbertConfig,
    compiled: bool = False,
    *,
    device: str | torch.device = "cpu",
    autocast_dtype: torch.dtype | None = None,
):
    """Our model on `device` and one train_step of it (autocast to `autocast_dtype` when given, as train.precision
    "bf16" does); the step takes a CPU batch and moves it, as the workers' step does."""
    torch.manual_seed(0)
    model = AlbertForPreTraining(config).to(device)
    model.train()
    optimizer = make_optimizer(model, lr=1e-4)
    scheduler = make_scheduler(optimizer, warmup_steps=0, total_steps=10_000)
    if compiled:
        compile_backbone(model)

    def step(batch):
        train_step(model, optimizer, scheduler, [batch], grad_clip=1.0, device=device, autocast_dtype=autocast_dtype)

    return model, step


def build_hf(ours: AlbertForPreTraining, *, autocast_dtype: torch.dtype | None = None):
    """transformers' AlbertForPreTraining with our model's weights, on our model's device, and one AdamW step of
    it (forward under autocast to `autocast_dtype` when given)."""
    import transformers

    device = next(ours.parameters()).device
    state, hf_config = to_hf(ours.state_dict(), ours.config)
    hf_config = {k: v for k, v in hf_config.items() if k not in ("model_type", "architectures", "transformers_version")}
    model = transformers.AlbertForPreTraining(transformers.AlbertConfig(**hf_config))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise RuntimeError(f"transformers rejected weights: {unexpected[:3]}")
    model.to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)

    def step(batch):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            out = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                token_type_ids=batch["token_type_ids"],
                labels=batch["mlm_labels"],
                sentence_order_label=batch["pair_labels"],
            )
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step


def interleaved(steps: dict, batch, n: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """n timed steps of each, alternating one step at a time, so a busy neighbour slows all of them alike.

    Returns (wall seconds, CPU seconds of this process) per step. With one thread the CPU time is the work a
    step did, which other processes on the machine barely change; wall time also counts the waits for a core.
    """
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(n):
        for name, step in steps.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            step(batch)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    config = AlbertConfig.preset("albert-base", vocab_size=VOCAB)
    batch = make_batch()
    tokens = BATCH * SEQ
    masked_fraction = float((batch["mlm_labels"] != -100).float().mean())
    flops_ours = estimate_flops_per_token(config, SEQ, mlm_fraction=masked_fraction) * tokens
    flops_hf = estimate_flops_per_token(config, SEQ, mlm_fraction=1.0) * tokens
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; albert-base, batch {BATCH} x {SEQ}")
    print(
        f"masked fraction {masked_fraction:.3f}; model GFLOP/step: ours {flops_ours / 1e9:.0f}, hf {flops_hf / 1e9:.0f}"
    )

    peak = gemm_peak()
    print(f"fp32 GEMM peak (2048^3 torch.mm, best of 5): {peak / 1e9:.1f} GFLOP/s")

    ours_model, ours_step = build_ours(config)
    _, hf_step = build_hf(ours_model)
    steps = {"ours": ours_step, "hf": hf_step}
    if not args.no_compile:
        _, steps["compiled"] = build_ours(config, compiled=True)
    warmup_s = {}
    for name, step in steps.items():
        start = time.perf_counter()
        for _ in range(args.warmup):
            step(batch)
        warmup_s[name] = time.perf_counter() - start
    times, cpu_times = interleaved(steps, batch, args.steps)
    peak_after = gemm_peak()
    peak = max(peak, peak_after)

    def line(name: str, seconds: list[float], flops: float) -> None:
        best, median = min(seconds), statistics.median(seconds)
        print(
            f"{name:<34} median {median * 1e3:6.0f} ms/step ({tokens / median:5.0f} tokens/s), "
            f"best {best * 1e3:6.0f} ms ({tokens / best:5.0f} tokens/s, {flops / best / 1e9:5.1f} GFLOP/s, "
            f"MFU {flops / best / peak:5.1%})"
        )

    def ratio(name: str) -> None:
        best = min(times["hf"]) / min(times[name])
        median = statistics.median(times["hf"]) / statistics.median(times[name])
        cpu = statistics.median(cpu_times["hf"]) / statistics.median(cpu_times[name])
        print(
            f"throughput {name} / transformers: {best:.2f}x on best steps, {median:.2f}x on medians (wall); "
            f"{cpu:.2f}x per CPU-second (medians; the load-robust figure with --threads 1)"
        )

    print(f"fp32 GEMM peak after the timed steps: {peak_after / 1e9:.1f} GFLOP/s; MFU uses the better of the two")
    line("ours (masked-only MLM, LAMB)", times["ours"], flops_ours)
    if "compiled" in times:
        print(f"  (compiled: its first {args.warmup} steps, compiling included, took {warmup_s['compiled']:.0f} s)")
        line("ours + train.compile", times["compiled"], flops_ours)
    line("transformers + AdamW", times["hf"], flops_hf)
    ratio("ours")
    if "compiled" in times:
        ratio("compiled")


if __name__ == "__main__":
    main()
