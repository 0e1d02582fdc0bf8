"""The XLA backend on PJRT CPU: same numbers as eager CPU, one graph per bucket, checkpoints readable by plain torch."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch_xla = pytest.importorskip(
    "torch_xla", reason="torch_xla is not installed: run the XLA tier with scripts/test_xla.sh (its own venv)"
)

import torch  # noqa: E402

from albert_core.examples.masking import IGNORE_INDEX  # noqa: E402
from albert_core.model.checkpoint import load_model  # noqa: E402
from albert_core.model.modeling import AlbertForPreTraining  # noqa: E402
from albert_core.optim import make_optimizer, make_scheduler  # noqa: E402
from services.train.xla import (  # noqa: E402
    compile_count,
    device_loader,
    max_predictions_for,
    setup_xla_worker,
    static_batch,
    static_batches,
    static_pretraining_loss,
    to_cpu,
    xla_train_step,
)
from tests.xla.tiny import BUCKETS, pair_batch, tiny_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LOSS_TOLERANCE = 1e-4  # absolute, on losses of ~6 (float32 sums in a different order on XLA)
PARAM_TOLERANCE = 1e-4


def to_device(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def eager_step(model, optimizer, scheduler, batch: dict[str, np.ndarray]) -> tuple[float, float, float]:
    """The reference: the model's own forward (masked positions only) and the same update, in eager CPU torch.

    Returns loss, gradient norm before clipping, MLM accuracy.
    """
    model.train()
    optimizer.zero_grad(set_to_none=True)
    tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
    out = model(**tensors)
    out.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    labels = tensors["mlm_labels"][tensors["mlm_labels"] != IGNORE_INDEX]
    mlm_acc = (out.mlm_logits.argmax(-1) == labels).float().mean()
    return out.loss.item(), grad_norm.item(), mlm_acc.item()


def lamb(model):
    optimizer = make_optimizer(model, lr=0.01)
    return optimizer, make_scheduler(optimizer, warmup_steps=2, total_steps=20)


# --- static batches (host side) ------------------------------------------------------------------------


def test_static_batch_pads_to_the_smallest_bucket_that_holds_the_longest_row():
    batch = static_batch(pair_batch([20, 33], seed=1), buckets=BUCKETS)
    assert batch["input_ids"].shape == (2, 64)
    assert static_batch(pair_batch([20, 31], seed=1), buckets=BUCKETS)["input_ids"].shape == (2, 32)


def test_static_batch_keeps_every_predicted_position_and_target_in_order():
    raw = pair_batch([30, 60, 45], seed=2)
    batch = static_batch(raw, buckets=BUCKETS)
    K = max_predictions_for(64)
    assert batch["mlm_positions"].shape == batch["mlm_targets"].shape == (3, K)
    for r in range(3):
        where = np.flatnonzero(raw["mlm_labels"][r] != IGNORE_INDEX)
        n = where.size
        assert batch["mlm_positions"][r, :n].tolist() == where.tolist()
        assert batch["mlm_targets"][r, :n].tolist() == raw["mlm_labels"][r, where].tolist()
        assert (batch["mlm_targets"][r, n:] == IGNORE_INDEX).all()


def test_static_batch_rejects_a_row_longer_than_the_largest_bucket():
    with pytest.raises(ValueError, match="70 tokens, more than the largest bucket \\(64\\)"):
        static_batch(pair_batch([70], seed=3), buckets=BUCKETS)


def test_static_batch_rejects_more_predictions_than_max_predictions():
    with pytest.raises(ValueError, match="row 0 .* more than max_predictions=2"):
        static_batch(pair_batch([60], seed=3), buckets=BUCKETS, max_predictions=2)


def test_padding_rows_leave_the_loss_and_the_token_count_unchanged():
    torch.manual_seed(0)
    model = AlbertForPreTraining(tiny_config())
    raw = pair_batch([25, 40, 31], seed=4)
    exact_batch = static_batch(raw, buckets=BUCKETS)
    padded_batch = static_batch(raw, buckets=BUCKETS, batch_size=8)
    exact = static_pretraining_loss(model, exact_batch)
    padded = static_pretraining_loss(model, padded_batch)
    assert padded_batch["input_ids"].shape == (8, 64)
    assert torch.isfinite(padded.loss)
    torch.testing.assert_close(padded.loss, exact.loss, atol=1e-6, rtol=1e-6)
    assert int(padded_batch["num_tokens"]) == int(exact_batch["num_tokens"]) == 25 + 40 + 31


def test_static_loss_equals_the_model_forward_loss_on_cpu():
    torch.manual_seed(0)
    model = AlbertForPreTraining(tiny_config())
    raw = pair_batch([25, 40, 31, 58], seed=5)
    reference = model(**{k: torch.from_numpy(v) for k, v in raw.items()})
    static = static_pretraining_loss(model, static_batch(raw, buckets=BUCKETS))
    torch.testing.assert_close(static.mlm_loss, reference.mlm_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(static.pair_loss, reference.pair_loss, atol=1e-6, rtol=1e-6)


# --- on the XLA device ---------------------------------------------------------------------------------


def test_setup_selects_the_cpu_runtime_from_pjrt_device(worker):
    assert worker.runtime == "CPU"
    assert worker.device.type == "xla"
    assert (worker.rank, worker.world_size) == (0, 1)


def test_setup_rejects_an_unknown_pjrt_device():
    with pytest.raises(ValueError, match="PJRT_DEVICE: expected one of TPU, CPU, CUDA, got 'GPUX'"):
        setup_xla_worker("gpux")


@pytest.mark.parametrize("position_bias", ["none", "rotary", "alibi"])
def test_lamb_steps_on_xla_match_eager_cpu(worker, position_bias):
    torch.manual_seed(0)
    cpu_model = AlbertForPreTraining(tiny_config(position_bias=position_bias))
    initial = copy.deepcopy(cpu_model.state_dict())
    xla_model = copy.deepcopy(cpu_model).to(worker.device)
    cpu_opt, cpu_sched = lamb(cpu_model)
    xla_opt, xla_sched = lamb(xla_model)
    lengths = [[30, 22, 17, 29], [60, 41, 33, 50], [12, 31, 25, 20], [64, 35, 48, 28], [27, 19, 30, 32]]
    eager, xla = [], []
    for step, rows in enumerate(lengths):
        raw = pair_batch(rows, seed=100 + step, first_id=10 * step)
        eager.append(eager_step(cpu_model, cpu_opt, cpu_sched, raw))
        batch = to_device(static_batch(raw, buckets=BUCKETS), worker.device)
        stats = xla_train_step(xla_model, xla_opt, batch, scheduler=xla_sched)
        xla.append((stats.loss.item(), stats.grad_norm.item(), stats.mlm_acc.item()))
    eager, xla = np.array(eager), np.array(xla)
    diffs = np.abs(eager - xla).max(axis=0)
    print(f"\neager loss {eager[:, 0].round(6).tolist()}\nxla   loss {xla[:, 0].round(6).tolist()}")
    print(f"max |diff|: loss {diffs[0]:.2e}, grad norm {diffs[1]:.2e} (~{eager[:, 1].mean():.2f}), mlm acc {diffs[2]}")
    assert diffs[0] <= LOSS_TOLERANCE
    assert diffs[1] <= LOSS_TOLERANCE * eager[:, 1].max()
    assert diffs[2] == 0.0
    xla_params = to_cpu(xla_model.state_dict())
    worst = max((xla_params[k] - v).abs().max().item() for k, v in cpu_model.state_dict().items())
    moved = max((initial[k] - v).abs().max().item() for k, v in cpu_model.state_dict().items())
    print(f"max |param diff| after 5 steps {worst:.2e}; max |param change| {moved:.2e}")
    assert moved > 100 * PARAM_TOLERANCE  # the steps really update the weights: matching is not trivial
    assert worst <= PARAM_TOLERANCE


def test_compile_count_counts_a_new_graph(worker):
    before = compile_count()
    x = torch.arange(12.0, device=worker.device).reshape(3, 4)
    (x @ x.T + 0.5).sum().item()
    assert compile_count() == before + 1


def test_compile_cache_dir_receives_the_compiled_graphs(tmp_path):
    # A fresh process: the cache must be chosen before torch_xla's first computation. (PJRT CPU can only write
    # the cache; reading it back, which skips the compile, works on TPU/GPU runtimes.)
    script = (
        "import sys, torch\n"
        "from services.train.xla import compile_count, setup_xla_worker\n"
        "worker = setup_xla_worker('CPU', compile_cache_dir=sys.argv[1])\n"
        "x = torch.arange(12.0, device=worker.device).reshape(3, 4)\n"
        "(x @ x.T + 0.25).sum().item()\n"
        "print('compiles', compile_count())\n"
    )
    cache = tmp_path / "cache"
    run = subprocess.run(
        [sys.executable, "-c", script, str(cache)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "1"
    assert len(list(cache.iterdir())) == 1


def test_graphs_stay_bounded_by_the_buckets_across_varied_lengths_and_a_changing_lr(worker):
    torch.manual_seed(0)
    model = AlbertForPreTraining(tiny_config()).to(worker.device)
    optimizer, scheduler = lamb(model)
    rng = np.random.default_rng(7)
    per_step, lrs = [], []
    for step in range(12):
        short = step % 2 == 0  # alternate buckets; real lengths vary within each
        lengths = rng.integers(8, 33, size=3) if short else rng.integers(33, 65, size=3)  # 3 rows: shapes of its own
        raw = pair_batch(lengths.tolist(), seed=200 + step, first_id=10 * step)
        before = compile_count()
        lrs.append(optimizer.param_groups[0]["lr"])
        batch = to_device(static_batch(raw, buckets=BUCKETS, batch_size=3), worker.device)
        xla_train_step(model, optimizer, batch, scheduler=scheduler).loss.item()
        per_step.append(compile_count() - before)
    print(f"\ncompiles per step: {per_step}; lr per step: {np.round(lrs, 5).tolist()}")
    assert all(a != b for a, b in zip(lrs, lrs[1:], strict=False))  # the learning rate changes every step
    assert per_step[0] == 1  # a shape no earlier test compiled: the count below is this test's own
    assert sum(per_step) <= len(BUCKETS) + 1  # first step (creates the optimizer state) + one per bucket
    assert sum(per_step[3:]) == 0  # once each bucket has run a steady step, nothing compiles again


def test_accumulated_micro_batches_take_the_step_of_the_whole_batch(worker):
    torch.manual_seed(0)
    whole_model = AlbertForPreTraining(tiny_config()).to(worker.device)
    split_model = copy.deepcopy(whole_model)
    raw = pair_batch([30, 28, 12, 10], seed=800)
    halves = [{k: v[i : i + 2] for k, v in raw.items()} for i in (0, 2)]
    # The halves hold different numbers of masked tokens: averaging each half's mean would weigh them wrongly.
    assert (halves[0]["mlm_labels"] != IGNORE_INDEX).sum() != (halves[1]["mlm_labels"] != IGNORE_INDEX).sum()
    whole = xla_train_step(
        whole_model, lamb(whole_model)[0], to_device(static_batch(raw, buckets=BUCKETS), worker.device)
    )
    split = xla_train_step(
        split_model,
        lamb(split_model)[0],
        [to_device(static_batch(half, buckets=BUCKETS), worker.device) for half in halves],
    )
    for name in ("loss", "mlm_loss", "pair_loss", "mlm_acc", "pair_acc", "grad_norm", "tokens"):
        torch.testing.assert_close(getattr(split, name).cpu(), getattr(whole, name).cpu(), atol=1e-5, rtol=1e-5)
    split_params = to_cpu(split_model.state_dict())
    for key, value in to_cpu(whole_model.state_dict()).items():
        torch.testing.assert_close(split_params[key], value, atol=1e-6, rtol=1e-5)


def test_dropout_steps_follow_the_seed_and_compile_once(worker):
    torch.manual_seed(0)
    base = AlbertForPreTraining(tiny_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))
    raw = pair_batch([30, 22, 17, 29], seed=900)
    runs = {}
    for name, seeds in (("a", [1, 2, 3, 4]), ("again", [1, 2, 3, 4]), ("other", [5, 6, 7, 8])):
        model = copy.deepcopy(base).to(worker.device)
        optimizer, scheduler = lamb(model)
        batch = to_device(static_batch(raw, buckets=BUCKETS), worker.device)
        losses, compiles = [], []
        for seed in seeds:
            before = compile_count()
            losses.append(xla_train_step(model, optimizer, batch, scheduler=scheduler, seed=seed).loss.item())
            compiles.append(compile_count() - before)
        runs[name] = (losses, compiles)
    print(f"\ndropout runs (losses, compiles per step): {runs}")
    assert runs["again"][0] == runs["a"][0]  # the same seeds draw the same dropout masks
    assert all(x != y for x, y in zip(runs["other"][0], runs["a"][0], strict=True))
    assert sum(runs["again"][1]) == sum(runs["other"][1]) == 0  # a new seed is data, not a new graph


def test_device_loader_delivers_the_static_batches_on_the_device(worker):
    raws = [pair_batch([20, 40], seed=300 + i, first_id=2 * i) for i in range(3)]
    expected = [static_batch(raw, buckets=BUCKETS) for raw in raws]
    got = list(device_loader(static_batches(raws, buckets=BUCKETS), worker.device))
    assert len(got) == 3
    for want, batch in zip(expected, got, strict=True):
        assert batch["input_ids"].device.type == "xla"
        for key, value in want.items():
            assert torch.equal(batch[key].cpu(), value), key


def test_checkpoint_saved_from_xla_loads_on_cpu_with_the_same_outputs(worker, tmp_path):
    from services.train.state import TrainerState
    from services.train.xla import save_xla_train_state

    torch.manual_seed(0)
    model = AlbertForPreTraining(tiny_config()).to(worker.device)
    optimizer, scheduler = lamb(model)
    for step in range(2):
        raw = pair_batch([30, 22, 17, 29], seed=400 + step, first_id=4 * step)
        batch = to_device(static_batch(raw, buckets=BUCKETS), worker.device)
        xla_train_step(model, optimizer, batch, scheduler=scheduler)
    assert (
        save_xla_train_state(tmp_path / "ckpt", model, optimizer, scheduler, TrainerState(step=2)) == tmp_path / "ckpt"
    )
    restored = load_model(tmp_path / "ckpt").eval()
    model.eval()
    probe = {k: torch.from_numpy(v) for k, v in pair_batch([28, 45], seed=499).items()}
    inputs = {k: probe[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    with torch.no_grad():
        on_cpu = restored(**inputs)
        on_xla = model(**to_device(inputs, worker.device))
    torch.testing.assert_close(on_xla.mlm_logits.cpu(), on_cpu.mlm_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(on_xla.pair_logits.cpu(), on_cpu.pair_logits, atol=1e-5, rtol=1e-5)


def test_bf16_step_loss_is_close_to_fp32(worker):
    torch.manual_seed(0)
    base = AlbertForPreTraining(tiny_config())
    raw = pair_batch([30, 12, 31, 22], seed=500)
    losses = {}
    for precision in ("fp32", "bf16"):
        model = copy.deepcopy(base).to(worker.device)
        optimizer, _ = lamb(model)
        batch = to_device(static_batch(raw, buckets=BUCKETS), worker.device)
        losses[precision] = xla_train_step(model, optimizer, batch, precision=precision).loss.item()
    print(f"\nfirst-step loss fp32 {losses['fp32']:.6f} bf16 {losses['bf16']:.6f}")
    assert losses["bf16"] != losses["fp32"]  # autocast really ran the matmuls in bf16
    assert abs(losses["bf16"] - losses["fp32"]) <= 0.005 * losses["fp32"]


def test_unknown_precision_is_rejected_naming_the_field(worker):
    model = AlbertForPreTraining(tiny_config()).to(worker.device)
    optimizer, _ = lamb(model)
    batch = to_device(static_batch(pair_batch([20], seed=600), buckets=BUCKETS), worker.device)
    with pytest.raises(ValueError, match="train.precision: expected one of fp32, bf16, got 'fp16'"):
        xla_train_step(model, optimizer, batch, precision="fp16")


# --- summing over Ray workers through host copies (host_reduce) ----------------------------------------


def doubled(host: torch.Tensor) -> torch.Tensor:
    """The host all-reduce of two workers that hold the same values (a SUM over identical replicas), in place."""
    assert host.device.type == "cpu"  # the step hands the reduce host copies, as gloo needs
    return host.mul_(2)


def test_host_reduce_over_two_identical_workers_takes_the_step_of_the_batch_twice(worker):
    torch.manual_seed(0)
    reduced_model = AlbertForPreTraining(tiny_config()).to(worker.device)
    twice_model = copy.deepcopy(reduced_model)
    reduced_opt, reduced_sched = lamb(reduced_model)
    twice_opt, twice_sched = lamb(twice_model)
    rng = np.random.default_rng(11)
    reduced, twice, compiles, tokens = [], [], [], []
    for step in range(8):
        short = step % 2 == 0  # both buckets, lengths varying within each: graphs must not follow the counts
        lengths = rng.integers(8, 33, size=4) if short else rng.integers(33, 65, size=4)
        raw = pair_batch(lengths.tolist(), seed=1000 + step, first_id=10 * step)
        tokens.append(2 * int(lengths.sum()))
        batch = to_device(static_batch(raw, buckets=BUCKETS), worker.device)
        before = compile_count()
        got = xla_train_step(reduced_model, reduced_opt, batch, scheduler=reduced_sched, host_reduce=doubled)
        compiles.append(compile_count() - before)
        want = xla_train_step(twice_model, twice_opt, [batch, batch], scheduler=twice_sched)
        keys = ("loss", "mlm_loss", "pair_loss", "mlm_acc", "pair_acc", "grad_norm", "tokens")
        reduced.append([getattr(got, k).item() for k in keys])
        twice.append([getattr(want, k).item() for k in keys])
    reduced, twice = np.array(reduced), np.array(twice)
    print(f"\nhost-reduced loss {reduced[:, 0].round(6).tolist()}\nbatch-twice  loss {twice[:, 0].round(6).tolist()}")
    print(f"max |diff| per stat {np.abs(reduced - twice).max(axis=0).tolist()}; compiles per step {compiles}")
    assert np.ptp(reduced[:, 0]) > 0.01  # the steps differ: matching is not trivial
    np.testing.assert_allclose(reduced, twice, rtol=1e-5, atol=1e-6)
    assert reduced[:, 6].tolist() == tokens  # the token count is the global one
    reduced_params = to_cpu(reduced_model.state_dict())
    for key, value in to_cpu(twice_model.state_dict()).items():
        torch.testing.assert_close(reduced_params[key], value, atol=1e-6, rtol=1e-5)
    # per bucket: the counts graph and the forward/backward graph; then the update (first step: + optimizer state)
    assert sum(compiles) <= 2 * len(BUCKETS) + 2
    assert sum(compiles[4:]) == 0  # once each bucket has run a steady step, nothing compiles again
