"""LAMB, decay groups and schedules (albert_core.optim).

The reference LAMB below is written from the formula in DESIGN.md §3, one tensor at a time, and shares no code
with the implementation.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from albert_core.optim import (
    Lamb,
    linear_warmup_poly_decay,
    make_optimizer,
    make_scheduler,
    param_groups_for,
    set_schedule_position,
    time_position,
)

LR = 0.01
BETAS = (0.9, 0.999)
EPS = 1e-6
WD = 0.01
STEPS = 6


class TinyModel(nn.Module):
    """Several shapes, LayerNorm, biases (one zero-initialised), an all-zero weight, a 3-D weight, a tied weight
    and an unused parameter (grad None)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 5)
        self.proj = nn.Linear(5, 7)
        nn.init.zeros_(self.proj.bias)
        self.LayerNorm = nn.LayerNorm(7)
        self.zero_proj = nn.Linear(7, 4, bias=False)
        nn.init.zeros_(self.zero_proj.weight)
        self.mix = nn.Parameter(0.01 * torch.randn(2, 4, 5))
        self.decoder = nn.Linear(5, 11)
        self.decoder.weight = self.embed.weight  # tied
        self.unused = nn.Linear(3, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, T, 5)
        h = self.LayerNorm(torch.tanh(self.proj(x)))  # (B, T, 7)
        z = self.zero_proj(h)  # (B, T, 4)
        y = torch.einsum("btk,jkd->btd", z, self.mix) + x  # (B, T, 5)
        return self.decoder(torch.tanh(y))  # (B, T, 11)


def make_model(seed: int = 0) -> TinyModel:
    torch.manual_seed(seed)
    return TinyModel()


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 11, (3, 6), generator=g), torch.randint(0, 11, (3, 6), generator=g)) for _ in range(n)]


def backward(model: TinyModel, ids: torch.Tensor, targets: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    logits = model(ids)
    nn.functional.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1)).backward()


def reference_lamb_step(named_params, state, *, lr, betas, eps, weight_decay, bias_correction, trust_clip):
    """One LAMB step from the formula. named_params: (name, param) pairs; state: dict name -> dict."""
    beta1, beta2 = betas
    with torch.no_grad():
        for name, p in named_params:
            if p.grad is None:
                continue
            excluded = "norm" in name.lower() or name.endswith("bias")
            lam = 0.0 if excluded else weight_decay
            s = state.setdefault(name, {"m": torch.zeros_like(p), "v": torch.zeros_like(p), "t": 0})
            s["t"] += 1
            g = p.grad
            s["m"] = beta1 * s["m"] + (1 - beta1) * g
            s["v"] = beta2 * s["v"] + (1 - beta2) * g * g
            if bias_correction:
                m_hat = s["m"] / (1 - beta1 ** s["t"])
                v_hat = s["v"] / (1 - beta2 ** s["t"])
            else:
                m_hat, v_hat = s["m"], s["v"]
            r = m_hat / (torch.sqrt(v_hat) + eps)
            u = r + lam * p
            ratio = 1.0
            if not excluded:
                w_norm = float(torch.sqrt((p * p).sum()))
                u_norm = float(torch.sqrt((u * u).sum()))
                if w_norm > 0 and u_norm > 0:
                    phi = w_norm if trust_clip is None else min(max(w_norm, trust_clip[0]), trust_clip[1])
                    ratio = phi / u_norm
            p.copy_(p - lr * ratio * u)


def run_lamb(model, *, steps, foreach, bias_correction=False, trust_clip=None, lr=LR) -> Lamb:
    opt = Lamb(
        param_groups_for(model, WD),
        lr=lr,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        bias_correction=bias_correction,
        trust_clip=trust_clip,
        foreach=foreach,
    )
    for ids, targets in batches(steps):
        backward(model, ids, targets)
        opt.step()
    return opt


def run_reference(model, *, steps, bias_correction=False, trust_clip=None) -> None:
    state: dict = {}
    for ids, targets in batches(steps):
        backward(model, ids, targets)
        reference_lamb_step(
            list(model.named_parameters()),
            state,
            lr=LR,
            betas=BETAS,
            eps=EPS,
            weight_decay=WD,
            bias_correction=bias_correction,
            trust_clip=trust_clip,
        )


def assert_params_close(a: nn.Module, b: nn.Module, atol: float = 1e-6, rtol: float = 1e-6) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------------------------------------------
# LAMB against the reference


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "per_tensor"])
@pytest.mark.parametrize("bias_correction", [False, True], ids=["no_bc", "bc"])
@pytest.mark.parametrize("trust_clip", [None, (0.5, 2.0)], ids=["no_clip", "clip"])
def test_lamb_matches_formula_reference_over_several_steps(foreach, bias_correction, trust_clip):
    model = make_model()
    ref = copy.deepcopy(model)
    start = copy.deepcopy(model)
    run_lamb(model, steps=STEPS, foreach=foreach, bias_correction=bias_correction, trust_clip=trust_clip)
    run_reference(ref, steps=STEPS, bias_correction=bias_correction, trust_clip=trust_clip)
    assert_params_close(model, ref)
    # the comparison is not vacuous: every used parameter moved
    for (name, p), (_, p0) in zip(model.named_parameters(), start.named_parameters(), strict=True):
        if not name.startswith("unused"):
            assert not torch.allclose(p, p0), name


def test_foreach_and_per_tensor_paths_agree():
    a, b = make_model(), make_model()
    run_lamb(a, steps=STEPS, foreach=True, bias_correction=True, trust_clip=(0.5, 2.0))
    run_lamb(b, steps=STEPS, foreach=False, bias_correction=True, trust_clip=(0.5, 2.0))
    assert_params_close(a, b)


def test_foreach_path_handles_mixed_dtypes_like_the_per_tensor_path():
    g = torch.Generator().manual_seed(5)
    init = [torch.randn(4, 3, generator=g), torch.randn(6, generator=g, dtype=torch.float64)]
    grads = [[torch.randn_like(t) for t in init] for _ in range(3)]
    results = []
    for foreach in (True, False):
        ps = [nn.Parameter(t.clone()) for t in init]
        opt = Lamb(ps, lr=LR, bias_correction=True, foreach=foreach)
        for step_grads in grads:
            for p, gr in zip(ps, step_grads, strict=True):
                p.grad = gr.clone()
            opt.step()
        results.append(ps)
    for a, b in zip(*results, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_trust_clip_changes_the_update_when_a_norm_is_outside_the_range():
    # embed.weight has norm ~7 and mix has norm ~0.1, both outside (0.5, 2.0)
    a, b = make_model(), make_model()
    run_lamb(a, steps=1, foreach=True)
    run_lamb(b, steps=1, foreach=True, trust_clip=(0.5, 2.0))
    assert not torch.allclose(a.embed.weight, b.embed.weight)
    assert not torch.allclose(a.mix, b.mix)


# ---------------------------------------------------------------------------------------------------------
# trust ratio edge cases


def first_step_r(g: torch.Tensor) -> torch.Tensor:
    """r after one step without bias correction: m = (1-β1)g, v = (1-β2)g²."""
    return (1 - BETAS[0]) * g / (torch.sqrt((1 - BETAS[1]) * g * g) + EPS)


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "per_tensor"])
def test_all_zero_weight_takes_a_step_with_trust_ratio_one(foreach):
    w = nn.Parameter(torch.zeros(4, 3))
    g = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    w.grad = g.clone()
    Lamb([w], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=foreach).step()
    torch.testing.assert_close(w.detach(), -LR * first_step_r(g), atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "per_tensor"])
def test_zero_update_leaves_parameter_unchanged_and_finite(foreach):
    w = nn.Parameter(torch.randn(5, 2))
    before = w.detach().clone()
    w.grad = torch.zeros_like(w)
    Lamb([w], lr=LR, weight_decay=0.0, foreach=foreach).step()
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w.detach(), before, atol=0, rtol=0)


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "per_tensor"])
def test_group_without_adaptation_steps_by_lr_times_r(foreach):
    # a large-norm parameter: with adaptation the step would be ~‖θ‖/‖u‖ times larger
    w = nn.Parameter(10.0 * torch.ones(6))
    g = torch.linspace(-1.0, 1.0, 6)
    w.grad = g.clone()
    Lamb([{"params": [w], "adapt": False, "weight_decay": 0.0}], lr=LR, betas=BETAS, eps=EPS, foreach=foreach).step()
    torch.testing.assert_close(w.detach(), 10.0 - LR * first_step_r(g), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "per_tensor"])
def test_adapted_step_has_norm_lr_times_weight_norm(foreach):
    w = nn.Parameter(torch.randn(3, 7, generator=torch.Generator().manual_seed(3)))
    before = w.detach().clone()
    w.grad = torch.randn(3, 7, generator=torch.Generator().manual_seed(4))
    Lamb([w], lr=LR, weight_decay=WD, foreach=foreach).step()
    step_norm = torch.linalg.vector_norm(w.detach() - before)
    torch.testing.assert_close(step_norm, LR * torch.linalg.vector_norm(before), atol=1e-7, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# grads: None and sparse


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "per_tensor"])
def test_parameters_without_grad_are_skipped(foreach):
    model = make_model()
    opt = run_lamb(model, steps=2, foreach=foreach)
    fresh = make_model()
    assert model.unused.weight not in opt.state
    torch.testing.assert_close(model.unused.weight, fresh.unused.weight, atol=0, rtol=0)


def test_sparse_grad_raises_error_naming_the_parameter():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = Lamb(param_groups_for(emb, WD), lr=LR)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=r"sparse gradients: parameter 'weight'"):
        opt.step()


# ---------------------------------------------------------------------------------------------------------
# resume


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "per_tensor"])
def test_state_dict_round_trip_continues_identically(foreach):
    data = batches(6)

    def make(model):
        opt = Lamb(param_groups_for(model, WD), lr=LR, bias_correction=True, foreach=foreach)
        return opt, make_scheduler(opt, warmup_steps=2, total_steps=10)

    def train(model, opt, sched, part):
        for ids, targets in part:
            backward(model, ids, targets)
            opt.step()
            sched.step()

    straight = make_model()
    opt, sched = make(straight)
    train(straight, opt, sched, data)

    first = make_model()
    opt, sched = make(first)
    train(first, opt, sched, data[:3])
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    resumed = make_model(seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    opt, sched = make(resumed)
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    train(resumed, opt, sched, data[3:])

    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------------------
# decay groups


def group_names(groups):
    return [set(g["param_names"]) for g in groups]


def test_layernorm_and_bias_get_no_decay_and_no_adaptation():
    groups = param_groups_for(make_model(), 0.02)
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.02 and decay["adapt"] is True
    assert no_decay["weight_decay"] == 0.0 and no_decay["adapt"] is False
    assert set(no_decay["param_names"]) == {
        "proj.bias",
        "LayerNorm.weight",
        "LayerNorm.bias",
        "decoder.bias",
        "unused.bias",
    }
    assert set(decay["param_names"]) == {"embed.weight", "proj.weight", "zero_proj.weight", "mix", "unused.weight"}


def test_snake_case_layer_norm_and_norm_names_are_excluded():
    model = nn.ModuleDict({"layer_norm": nn.LayerNorm(3), "final_norm": nn.LayerNorm(3), "dense": nn.Linear(3, 3)})
    decay, no_decay = param_groups_for(model, WD)
    assert set(decay["param_names"]) == {"dense.weight"}
    assert set(no_decay["param_names"]) == {
        "layer_norm.weight",
        "layer_norm.bias",
        "final_norm.weight",
        "final_norm.bias",
        "dense.bias",
    }


def test_tied_parameter_appears_once():
    model = make_model()
    params = [p for g in param_groups_for(model, WD) for p in g["params"]]
    assert sum(p is model.embed.weight for p in params) == 1
    assert len(params) == len({id(p) for p in params})


def test_frozen_parameters_are_left_out():
    model = make_model()
    model.proj.weight.requires_grad_(False)
    names = set().union(*group_names(param_groups_for(model, WD)))
    assert "proj.weight" not in names and "proj.bias" in names


def test_model_with_only_decayed_parameters_gets_one_group():
    groups = param_groups_for(nn.Linear(3, 3, bias=False), WD)
    assert group_names(groups) == [{"weight"}]


# ---------------------------------------------------------------------------------------------------------
# schedules


@pytest.mark.parametrize(
    ("step", "expected"),
    [(0, 0.0), (50, 0.5), (100, 1.0), (550, 0.5), (1000, 0.0), (1200, 0.0)],
    ids=["start", "mid_warmup", "warmup_end", "mid_decay", "end", "after_end"],
)
def test_linear_warmup_then_linear_decay_values(step, expected):
    got = linear_warmup_poly_decay(step, warmup_steps=100, total_steps=1000)
    assert math.isclose(got, expected, abs_tol=1e-12)


def test_poly_decay_power_and_end_factor():
    # halfway through decay: end + (1 - end) * 0.5 ** power
    got = linear_warmup_poly_decay(550, warmup_steps=100, total_steps=1000, power=2.0, end_factor=0.1)
    assert math.isclose(got, 0.1 + 0.9 * 0.25)
    assert math.isclose(linear_warmup_poly_decay(1000, warmup_steps=100, total_steps=1000, end_factor=0.1), 0.1)


def test_paper_recipe_schedule_peaks_at_warmup_end():
    kw = dict(warmup_steps=3125, total_steps=125_000)
    assert math.isclose(linear_warmup_poly_decay(3125, **kw), 1.0)
    assert linear_warmup_poly_decay(3124, **kw) < 1.0 and linear_warmup_poly_decay(3126, **kw) < 1.0
    assert linear_warmup_poly_decay(125_000, **kw) == 0.0


def test_zero_warmup_starts_at_full_lr():
    assert linear_warmup_poly_decay(0, warmup_steps=0, total_steps=10) == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(step=0, warmup_steps=10, total_steps=10),
        dict(step=0, warmup_steps=-1, total_steps=10),
        dict(step=-1, warmup_steps=1, total_steps=10),
    ],
)
def test_schedule_rejects_bad_arguments(kwargs):
    step = kwargs.pop("step")
    with pytest.raises(ValueError, match="schedule"):
        linear_warmup_poly_decay(step, **kwargs)


def test_make_scheduler_sets_group_lrs_from_the_multiplier():
    model = make_model()
    opt = make_optimizer(model, lr=0.00176)
    sched = make_scheduler(opt, warmup_steps=4, total_steps=12)
    seen = []
    for _ in range(12):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    for step, lrs in enumerate(seen):
        want = 0.00176 * linear_warmup_poly_decay(step, warmup_steps=4, total_steps=12)
        assert all(math.isclose(lr, want, abs_tol=1e-15) for lr in lrs), (step, lrs, want)


def test_a_schedule_moved_to_a_position_matches_one_stepped_there_and_resumes_from_it():
    model = make_model()
    stepped, moved = make_optimizer(model, lr=1e-3), make_optimizer(model, lr=1e-3)
    a = make_scheduler(stepped, warmup_steps=4, total_steps=20, decay_steps=6)
    b = make_scheduler(moved, warmup_steps=4, total_steps=20, decay_steps=6)
    for _ in range(17):
        stepped.step()
        a.step()
    set_schedule_position(b, 17)
    assert [g["lr"] for g in moved.param_groups] == [g["lr"] for g in stepped.param_groups] == [0.5e-3] * 2
    assert b.get_last_lr() == a.get_last_lr() and b.last_epoch == 17
    b.base_lrs = [2e-3, 2e-3]  # a rollback's scaled rates hold when the schedule moves again
    set_schedule_position(b, 2)
    assert [g["lr"] for g in moved.param_groups] == [1e-3, 1e-3]
    resumed = make_scheduler(make_optimizer(model, lr=1e-3), warmup_steps=4, total_steps=20, decay_steps=6)
    resumed.load_state_dict(b.state_dict())
    assert resumed.last_epoch == 2 and resumed.base_lrs == [2e-3, 2e-3]


@pytest.mark.parametrize(
    ("seconds", "position"), [(0.0, 0), (-1.0, 0), (30.0, 250), (59.99, 499), (60.0, 500), (600.0, 500)]
)
def test_time_position_is_the_share_of_the_budget_spent_capped_at_total_steps(seconds, position):
    assert time_position(500, seconds, 60.0) == position


def test_time_position_needs_a_budget():
    with pytest.raises(ValueError, match="max_seconds must be > 0"):
        time_position(500, 1.0, 0.0)


def test_make_scheduler_rejects_bad_arguments_at_construction():
    opt = make_optimizer(make_model(), lr=1e-3)
    with pytest.raises(ValueError, match="warmup_steps"):
        make_scheduler(opt, warmup_steps=20, total_steps=10)


# ---------------------------------------------------------------------------------------------------------
# factory and validation


def test_make_optimizer_builds_lamb_with_decay_groups():
    opt = make_optimizer(make_model(), lr=0.00176, trust_clip=(0.0, 10.0))
    assert isinstance(opt, Lamb)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert [g["adapt"] for g in opt.param_groups] == [True, False]
    assert all(g["bias_correction"] is False and g["trust_clip"] == (0.0, 10.0) for g in opt.param_groups)


def test_make_optimizer_builds_adamw_with_the_same_groups():
    model = make_model()
    lamb, adamw = make_optimizer(model, lr=1e-3), make_optimizer(model, name="adamw", lr=1e-3)
    assert isinstance(adamw, torch.optim.AdamW)
    assert [g["param_names"] for g in adamw.param_groups] == [g["param_names"] for g in lamb.param_groups]
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.01, 0.0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(name="sgd"), "'lamb' or 'adamw'"),
        (dict(name="adamw", trust_clip=(0.0, 1.0)), "trust_clip"),
        (dict(name="adamw", bias_correction=False), "bias correction"),
    ],
)
def test_make_optimizer_rejects_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_optimizer(make_model(), lr=1e-3, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [dict(lr=-1.0), dict(eps=-1e-6), dict(betas=(0.9, 1.0)), dict(weight_decay=-0.1), dict(trust_clip=(2.0, 1.0))],
)
def test_lamb_rejects_bad_hyperparameters(kwargs):
    with pytest.raises(ValueError, match="Lamb"):
        Lamb([nn.Parameter(torch.zeros(2))], **kwargs)


def test_warmup_stable_decay_holds_the_peak_and_decays_over_the_last_steps_only():
    from albert_core.optim import linear_warmup_poly_decay

    values = [linear_warmup_poly_decay(s, warmup_steps=10, total_steps=100, decay_steps=20) for s in range(0, 101, 5)]
    assert values[:3] == [0.0, 0.5, 1.0]  # warmup
    assert values[2:17] == [1.0] * 15  # stable until step 80
    assert values[17:] == pytest.approx([0.75, 0.5, 0.25, 0.0])  # linear to 0 over the last 20
    with pytest.raises(ValueError, match="decay_steps"):
        linear_warmup_poly_decay(0, warmup_steps=10, total_steps=100, decay_steps=95)
