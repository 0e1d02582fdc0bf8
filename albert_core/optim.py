"""LAMB optimizer, decay groups and learning-rate schedules.

LAMB (You et al. 2019), as ALBERT uses it:

    m = β1·m + (1−β1)·g            v = β2·v + (1−β2)·g²
    m̂, v̂ = m, v                    (or bias-corrected: m/(1−β1ᵗ), v/(1−β2ᵗ))
    r = m̂ / (√v̂ + ε)
    u = r + λ·θ
    θ ← θ − η · φ(‖θ‖)/‖u‖ · u      trust ratio φ(‖θ‖)/‖u‖ is 1 where either norm is 0

φ is the identity or a clip to [γl, γu] (`trust_clip`). LayerNorm and bias parameters get λ = 0 and no layer
adaptation (trust ratio 1): `param_groups_for` builds those groups by parameter name. The original ALBERT code
uses no bias correction and clips the global gradient norm at 1.0; the clip belongs to the training step
(`torch.nn.utils.clip_grad_norm_`), not to the optimizer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "Lamb",
    "param_groups_for",
    "is_no_decay",
    "linear_warmup_poly_decay",
    "make_scheduler",
    "make_optimizer",
]


# --------------------------------------------------------------------------------------------------
# LAMB


class Lamb(torch.optim.Optimizer):
    """LAMB with a multi-tensor (torch._foreach_*) path and a plain per-tensor path.

    Per-group options: lr, betas, eps, weight_decay, bias_correction, trust_clip, adapt (layer adaptation on;
    False makes the trust ratio 1) and foreach (None: multi-tensor when all of the group's parameters are on
    one device).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = False,
        trust_clip: tuple[float, float] | None = None,
        foreach: bool | None = None,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Lamb: lr must be >= 0, got {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Lamb: eps must be >= 0, got {eps}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lamb: betas must be two numbers in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Lamb: weight_decay must be >= 0, got {weight_decay}")
        if trust_clip is not None:
            _check_trust_clip(trust_clip)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            trust_clip=None if trust_clip is None else tuple(trust_clip),
            adapt=True,
            foreach=foreach,
        )
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group_index, group in enumerate(self.param_groups):
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"Lamb does not support sparse gradients: parameter {_param_name(group, i)} "
                        f"(group {group_index}, shape {tuple(p.shape)}) has a sparse grad; "
                        "use a dense embedding (sparse=False)"
                    )
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            if not params:
                continue

            foreach = group["foreach"]
            if foreach is None:
                foreach = len({p.device for p in params}) == 1
            update_fn = _lamb_foreach if foreach else _lamb_per_tensor
            update_fn(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                steps,
                lr=group["lr"],
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                bias_correction=group["bias_correction"],
                trust_clip=group["trust_clip"],
                adapt=group["adapt"],
            )
        return loss


def _check_trust_clip(trust_clip: tuple[float, float]) -> None:
    if len(trust_clip) != 2 or not 0.0 <= trust_clip[0] <= trust_clip[1]:
        raise ValueError(f"Lamb: trust_clip must be (low, high) with 0 <= low <= high, got {trust_clip}")


def _param_name(group: dict[str, Any], index: int) -> str:
    names = group.get("param_names")
    return repr(names[index]) if names else f"#{index}"


def _trust_ratio(w_norm: Tensor, u_norm: Tensor, trust_clip: tuple[float, float] | None) -> Tensor:
    """φ(‖θ‖)/‖u‖, or 1 where either norm is 0. Works elementwise on stacked norms."""
    phi = w_norm if trust_clip is None else w_norm.clamp(trust_clip[0], trust_clip[1])
    ok = (w_norm > 0) & (u_norm > 0)
    return torch.where(ok, phi / torch.where(ok, u_norm, 1.0), 1.0)


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms in at least float32 (bf16/fp16 norms of large tensors lose too much)."""
    return torch.promote_types(dtype, torch.float32)


def _lamb_per_tensor(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[int],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    trust_clip: tuple[float, float] | None,
    adapt: bool,
) -> None:
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if bias_correction:
            m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)
        else:
            m_hat, v_hat = m, v
        update = m_hat / (v_hat.sqrt() + eps)
        if weight_decay != 0:
            update.add_(p, alpha=weight_decay)
        if adapt:
            norm_dtype = _norm_dtype(p.dtype)
            w_norm = torch.linalg.vector_norm(p, dtype=norm_dtype)
            u_norm = torch.linalg.vector_norm(update, dtype=norm_dtype)
            update.mul_(_trust_ratio(w_norm, u_norm, trust_clip))
        p.add_(update, alpha=-lr)


def _lamb_foreach(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[int],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    trust_clip: tuple[float, float] | None,
    adapt: bool,
) -> None:
    # foreach kernels want one device and dtype per list: bucket by both (usually a single bucket).
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        buckets.setdefault((p.device, p.dtype), []).append(i)
    for idx in buckets.values():
        ps = [params[i] for i in idx]
        gs = [grads[i] for i in idx]
        ms = [exp_avgs[i] for i in idx]
        vs = [exp_avg_sqs[i] for i in idx]

        torch._foreach_mul_(ms, beta1)
        torch._foreach_add_(ms, gs, alpha=1 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
        # r = m̂ / (√v̂ + ε), built in one buffer: √v̂ + ε, inverted, times m, divided by (1 − β1ᵗ).
        updates = torch._foreach_sqrt(vs)
        if bias_correction:
            torch._foreach_div_(updates, [math.sqrt(1 - beta2 ** steps[i]) for i in idx])
        torch._foreach_add_(updates, eps)
        torch._foreach_reciprocal_(updates)
        torch._foreach_mul_(updates, ms)
        if bias_correction:
            torch._foreach_div_(updates, [1 - beta1 ** steps[i] for i in idx])
        if weight_decay != 0:
            torch._foreach_add_(updates, ps, alpha=weight_decay)
        if adapt:
            norm_dtype = _norm_dtype(ps[0].dtype)
            w_norms = torch.stack(torch._foreach_norm(ps, dtype=norm_dtype))
            u_norms = torch.stack(torch._foreach_norm(updates, dtype=norm_dtype))
            ratios = _trust_ratio(w_norms, u_norms, trust_clip)
            torch._foreach_mul_(updates, list(ratios.unbind()))
        torch._foreach_add_(ps, updates, alpha=-lr)


# --------------------------------------------------------------------------------------------------
# decay groups


def is_no_decay(name: str) -> bool:
    """LayerNorm parameters and biases: no weight decay and no layer adaptation."""
    return "norm" in name.lower() or name.endswith("bias")


def param_groups_for(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups by parameter name: decayed + layer-adapted, and LayerNorm/bias (no decay, trust ratio 1).

    Tied parameters appear once (named_parameters removes duplicates); frozen parameters are left out; a group
    with no parameters is left out. Each group carries "param_names" for error messages and state dicts.
    """
    decay: dict[str, Tensor] = {}
    no_decay: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if is_no_decay(name) else decay)[name] = p
    groups = [
        {"params": list(decay.values()), "param_names": list(decay), "weight_decay": weight_decay, "adapt": True},
        {"params": list(no_decay.values()), "param_names": list(no_decay), "weight_decay": 0.0, "adapt": False},
    ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError(f"param_groups_for: {type(model).__name__} has no trainable parameters")
    return groups


# --------------------------------------------------------------------------------------------------
# schedules


def linear_warmup_poly_decay(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    power: float = 1.0,
    end_factor: float = 0.0,
    decay_steps: int = 0,
) -> float:
    """LR multiplier: step/warmup_steps during warmup, then polynomial decay from 1 to end_factor at total_steps.

    The decay runs over [warmup_steps, total_steps] so the peak (1.0) is reached at warmup end; BERT/ALBERT's
    TF code decays over [0, total_steps] and lets warmup override the start, which differs by warmup/total
    (2.5% in the paper's recipe). decay_steps > 0 holds the peak until total_steps - decay_steps and decays over
    the last decay_steps only (warmup, stable, decay). After total_steps the multiplier stays at end_factor.
    """
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(
            f"schedule: need 0 <= warmup_steps < total_steps, got warmup_steps={warmup_steps}, "
            f"total_steps={total_steps}"
        )
    if step < 0:
        raise ValueError(f"schedule: step must be >= 0, got {step}")
    if not 0 <= decay_steps <= total_steps - warmup_steps:
        raise ValueError(f"schedule: need 0 <= decay_steps <= total_steps - warmup_steps, got {decay_steps}")
    if step < warmup_steps:
        return step / warmup_steps
    decay_from = total_steps - decay_steps if decay_steps else warmup_steps
    progress = min(1.0, max(0, step - decay_from) / (total_steps - decay_from))
    return end_factor + (1.0 - end_factor) * (1.0 - progress) ** power


def make_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    power: float = 1.0,
    end_factor: float = 0.0,
    decay_steps: int = 0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over linear_warmup_poly_decay; call scheduler.step() once after each optimizer.step()."""
    fn = functools.partial(
        linear_warmup_poly_decay,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        power=power,
        end_factor=end_factor,
        decay_steps=decay_steps,
    )
    fn(0)  # validate the arguments now, not at the first step
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def time_position(total_steps: int, seconds: float, max_seconds: float) -> int:
    """Where a schedule driven by a wall-clock budget stands: total_steps x the share of max_seconds spent, so that
    warmup_steps and decay_steps read as shares of the budget (optim.clock = "time"). Capped at total_steps."""
    if not max_seconds > 0:
        raise ValueError(f"time_position: max_seconds must be > 0, got {max_seconds}")
    return min(total_steps, int(total_steps * max(0.0, seconds) / max_seconds))


def set_schedule_position(scheduler: torch.optim.lr_scheduler.LambdaLR, position: int) -> None:
    """Move a LambdaLR schedule to `position` and set every group's rate there (base_lrs, so a rollback's scaled
    rates hold); the next optimizer step applies it. A time-driven schedule calls this after each step."""
    rates = [base * fn(position) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, rate in zip(scheduler.optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    scheduler.last_epoch = position
    scheduler._last_lr = rates  # what get_last_lr() reports


# --------------------------------------------------------------------------------------------------
# factory


def make_optimizer(
    model: torch.nn.Module,
    *,
    name: str = "lamb",
    lr: float,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    bias_correction: bool | None = None,
    trust_clip: tuple[float, float] | None = None,
) -> torch.optim.Optimizer:
    """LAMB (default) or AdamW (for ablations) over the same decay groups.

    bias_correction None means each optimizer's own default: off for LAMB (as the original), always on for
    AdamW (passing False with AdamW is an error, as is a trust_clip).
    """
    groups = param_groups_for(model, weight_decay)
    if name == "lamb":
        return Lamb(
            groups,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bool(bias_correction),
            trust_clip=trust_clip,
        )
    if name == "adamw":
        if trust_clip is not None:
            raise ValueError("make_optimizer: trust_clip is a LAMB option; AdamW has no trust ratio")
        if bias_correction is False:
            raise ValueError("make_optimizer: AdamW always uses bias correction; bias_correction=False is LAMB-only")
        for g in groups:
            del g["adapt"]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    raise ValueError(f"make_optimizer: name must be 'lamb' or 'adamw', got {name!r}")
