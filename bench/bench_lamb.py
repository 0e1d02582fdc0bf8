"""Time one optimizer step on albert-base parameter shapes: LAMB foreach vs LAMB per-tensor vs AdamW(foreach).

Plain tensors with the shapes of albert-base (V=30000, E=128, H=768, FFN=3072, one shared layer), random grads,
the same decay groups the trainer uses (LayerNorm/bias: no decay, no adaptation). Prints ms per step and the
ratio of each against torch.optim.AdamW(foreach=True) measured in the same run.

    python bench/bench_lamb.py [--device cpu|cuda] [--steps 5] [--rounds 7] [--warmup 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from albert_core.optim import Lamb, is_no_decay

V, E, H, FFN, MAX_POS, TYPES = 30000, 128, 768, 3072, 512, 2


def albert_base_shapes() -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (V, E),
        "embeddings.position_embeddings.weight": (MAX_POS, E),
        "embeddings.token_type_embeddings.weight": (TYPES, E),
        "embeddings.LayerNorm.weight": (E,),
        "embeddings.LayerNorm.bias": (E,),
        "encoder.embedding_hidden_mapping_in.weight": (H, E),
        "encoder.embedding_hidden_mapping_in.bias": (H,),
    }
    layer = "encoder.layer."
    for proj in ("query", "key", "value", "dense"):
        shapes[f"{layer}attention.{proj}.weight"] = (H, H)
        shapes[f"{layer}attention.{proj}.bias"] = (H,)
    shapes[f"{layer}attention.LayerNorm.weight"] = (H,)
    shapes[f"{layer}attention.LayerNorm.bias"] = (H,)
    shapes[f"{layer}ffn.weight"] = (FFN, H)
    shapes[f"{layer}ffn.bias"] = (FFN,)
    shapes[f"{layer}ffn_output.weight"] = (H, FFN)
    shapes[f"{layer}ffn_output.bias"] = (H,)
    shapes[f"{layer}full_layer_layer_norm.weight"] = (H,)
    shapes[f"{layer}full_layer_layer_norm.bias"] = (H,)
    shapes["pooler.weight"] = (H, H)
    shapes["pooler.bias"] = (H,)
    shapes["predictions.dense.weight"] = (E, H)
    shapes["predictions.dense.bias"] = (E,)
    shapes["predictions.LayerNorm.weight"] = (E,)
    shapes["predictions.LayerNorm.bias"] = (E,)
    shapes["predictions.bias"] = (V,)  # decoder weight is tied to the word embeddings
    shapes["sop_classifier.weight"] = (2, H)
    shapes["sop_classifier.bias"] = (2,)
    return shapes


def make_params(device: torch.device) -> list[dict]:
    g = torch.Generator(device="cpu").manual_seed(0)
    decay, no_decay = [], []
    for name, shape in albert_base_shapes().items():
        p = torch.nn.Parameter((0.02 * torch.randn(shape, generator=g)).to(device))
        p.grad = (1e-3 * torch.randn(shape, generator=g)).to(device)
        (no_decay if is_no_decay(name) else decay).append(p)
    return [
        {"params": decay, "weight_decay": 0.01, "adapt": True},
        {"params": no_decay, "weight_decay": 0.0, "adapt": False},
    ]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], None], device: torch.device, steps: int) -> float:
    """Milliseconds per step over `steps` back-to-back steps."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=5, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=7, help="rounds; candidates alternate within each round")
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device)

    n = sum(p.numel() for g in make_params(torch.device("cpu")) for p in g["params"])
    print(f"albert-base shapes: {n / 1e6:.2f}M parameters, device={device}, threads={torch.get_num_threads()}")

    optimizers = {
        "adamw foreach": torch.optim.AdamW(
            [{k: v for k, v in g.items() if k != "adapt"} for g in make_params(device)],
            lr=1e-3,
            eps=1e-6,
            foreach=True,
        ),
        "lamb foreach": Lamb(make_params(device), lr=1e-3, foreach=True),
        "lamb per-tensor": Lamb(make_params(device), lr=1e-3, foreach=False),
    }
    for opt in optimizers.values():
        for _ in range(args.warmup):
            opt.step()
    # Interleave candidates round by round (rotating the order) so that load from other processes hits all of
    # them alike; report the median and the minimum over rounds.
    times: dict[str, list[float]] = {label: [] for label in optimizers}
    labels = list(optimizers)
    for r in range(args.rounds):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            times[label].append(time_steps(optimizers[label].step, device, args.steps))

    med = {label: statistics.median(ts) for label, ts in times.items()}
    best = {label: min(ts) for label, ts in times.items()}
    base_med, base_best = med["adamw foreach"], best["adamw foreach"]
    print(f"{'optimizer':<18}{'median ms':>11}{'min ms':>9}{'median/AdamW':>14}{'min/AdamW':>11}")
    for label in optimizers:
        print(
            f"{label:<18}{med[label]:>11.2f}{best[label]:>9.2f}"
            f"{med[label] / base_med:>13.2f}x{best[label] / base_best:>10.2f}x"
        )


if __name__ == "__main__":
    main()
