"""The training step on a CUDA GPU. Every test is marked `cuda` and skipped where torch.cuda.is_available() is False.

    python -m pytest -m cuda -q tests/test_cuda.py        (bench/device_check.py runs them on a GPU machine)

- bf16 autocast: a forward/backward stays close to fp32 (loss within 2%, gradient cosine >= 0.99) and ran in bf16.
- checkpoints: a state saved on the GPU (services.train.state) loads on the CPU with equal weights and optimizer
  state, and resumed on the GPU gives the uninterrupted run's next losses.
- placement: train_step(device="cuda") keeps parameters and optimizer state on the GPU, its loss finite and equal to
  the CPU's step within 1e-4.
- attention: SDPA restricted to a fused kernel (memory-efficient with the padding mask, flash without a mask in
  bf16) runs the model and matches the math kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from albert_core.examples.batch import mlm_batch
from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import AlbertForPreTraining
from albert_core.optim import make_optimizer, make_scheduler
from services.train.state import TrainerState, load_train_state, save_train_state
from services.train.step import train_step

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

VOCAB = 1000
MODEL = dict(  # small, with GPU-friendly heads (head_dim 64)
    embedding_size=64,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=256,
    max_position_embeddings=128,
)


def make_batch(seed: int, rows: int = 8, longest: int = 64) -> dict[str, torch.Tensor]:
    """Masked [CLS] A [SEP] B [SEP] rows of random pieces, of different lengths (the first one half as long), so
    the batch has padding; CPU tensors as make_micro_batch gives them."""
    rng = np.random.default_rng(seed)
    ids, types, starts = [], [], []
    for row in range(rows):
        n = longest // 2 if row == 0 else int(rng.integers(longest // 2, longest + 1))
        split = int(rng.integers(3, n - 2))
        ids.append([2, *rng.integers(5, VOCAB, split - 2), 3, *rng.integers(5, VOCAB, n - split - 1), 3])
        types.append([0] * split + [1] * (n - split))
        starts.append(rng.random(n) < 0.7)
    batch = mlm_batch(
        ids,
        types,
        rng.integers(0, 2, rows),
        starts,
        list(range(rows)),
        seed=seed,
        epoch=0,
        seq_len=None,
        vocab_size=VOCAB,
        special_ids=(0, 1, 2, 3, 4),
        mask_id=4,
    )
    return {k: torch.from_numpy(v) for k, v in batch.items()}


def cuda(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.cuda() for k, v in batch.items()}


def trainer(device: str, seed: int = 0):
    """A dropout-free model on `device`, LAMB and its schedule (made after the model is placed, as the workers do)."""
    torch.manual_seed(seed)
    model = AlbertForPreTraining(AlbertConfig.preset("albert-tiny", vocab_size=VOCAB, **MODEL)).to(device)
    model.set_dropout(0.0)
    optimizer = make_optimizer(model, lr=1e-3)
    return model, optimizer, make_scheduler(optimizer, warmup_steps=0, total_steps=100)


def step(trained, micro: list[dict[str, torch.Tensor]], device: str) -> float:
    model, optimizer, scheduler = trained
    return train_step(model, optimizer, scheduler, micro, grad_clip=1.0, device=device).loss.item()


def test_bf16_autocast_forward_and_backward_stay_close_to_fp32():
    batch = cuda(make_batch(0))
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, _, _ = trainer("cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = model(**batch)
        out.loss.backward()
        runs[dtype] = out, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    (fp32, grad32), (bf16, grad16) = runs[torch.float32], runs[torch.bfloat16]
    assert fp32.mlm_logits.dtype == torch.float32 and bf16.mlm_logits.dtype == torch.bfloat16  # autocast ran
    assert torch.isfinite(bf16.loss) and grad16.dtype == torch.float32  # gradients of the fp32 weights
    assert bf16.loss.item() != fp32.loss.item()
    assert bf16.loss.item() == pytest.approx(fp32.loss.item(), rel=2e-2)
    assert F.cosine_similarity(grad16, grad32, dim=0).item() >= 0.99


def test_a_checkpoint_saved_on_the_gpu_loads_on_the_cpu_and_resumes_on_the_gpu(tmp_path):
    batches = [[make_batch(seed)] for seed in range(3)]
    trained = trainer("cuda")
    step(trained, batches[0], "cuda")
    path = save_train_state(tmp_path / "step_00000001", *trained, TrainerState(step=1))

    on_cpu = trainer("cpu", seed=1)  # other weights: the load has to replace them
    assert load_train_state(path, *on_cpu, restore_rng=False).step == 1
    for p, q in zip(trained[0].parameters(), on_cpu[0].parameters(), strict=True):
        assert q.device.type == "cpu"
        torch.testing.assert_close(q, p.detach().cpu(), rtol=0, atol=0)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(on_cpu[1].state[q][key], trained[1].state[p][key].cpu(), rtol=0, atol=0)

    resumed = trainer("cuda", seed=1)
    load_train_state(path, *resumed)
    assert all(p.device.type == "cuda" for p in resumed[0].parameters())
    assert all(s["exp_avg"].device.type == "cuda" for s in resumed[1].state.values())
    expected = [step(trained, micro, "cuda") for micro in batches[1:]]
    got = [step(resumed, micro, "cuda") for micro in batches[1:]]
    assert got[0] == pytest.approx(expected[0], abs=1e-6)  # the same weights and batch
    assert got[1] == pytest.approx(expected[1], abs=1e-4)  # after a backward, whose atomic adds may reorder sums


def test_train_step_on_cuda_keeps_parameters_and_optimizer_state_on_the_gpu():
    micro = [make_batch(0), make_batch(1)]
    model, optimizer, scheduler = trainer("cuda")
    stats = train_step(model, optimizer, scheduler, micro, grad_clip=1.0, device="cuda")
    assert stats.loss.device.type == "cuda" and torch.isfinite(stats.loss)
    assert stats.grad_norm.device.type == "cuda" and torch.isfinite(stats.grad_norm)
    assert stats.tokens == sum(int(mb["attention_mask"].sum()) for mb in micro)
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 and p.grad is None for p in model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert state and all(v.device.type == "cuda" for v in state)
    assert all(v.device.type == "cpu" for mb in micro for v in mb.values())  # the step moved copies

    cpu_model, cpu_optimizer, cpu_scheduler = trainer("cpu")
    cpu_stats = train_step(cpu_model, cpu_optimizer, cpu_scheduler, micro, grad_clip=1.0)
    assert stats.loss.item() == pytest.approx(cpu_stats.loss.item(), abs=1e-4)
    for p, q in zip(model.parameters(), cpu_model.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("kernel", "dtype", "masked", "tolerance"),
    [
        (SDPBackend.EFFICIENT_ATTENTION, torch.float32, True, 1e-4),
        (SDPBackend.EFFICIENT_ATTENTION, torch.bfloat16, True, 5e-2),
        (SDPBackend.FLASH_ATTENTION, torch.bfloat16, False, 5e-2),
    ],
    ids=["efficient-fp32-mask", "efficient-bf16-mask", "flash-bf16"],
)
def test_sdpa_fused_kernel_runs_the_model_and_matches_the_math_kernel(kernel, dtype, masked, tolerance):
    model, _, _ = trainer("cuda")
    model.eval()
    batch = cuda(make_batch(0))
    mask = batch["attention_mask"] if masked else None
    assert not masked or bool((batch["attention_mask"] == 0).any())  # the mask has padding to hide

    def hidden(kernels: list[SDPBackend]) -> torch.Tensor:
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
        with torch.no_grad(), sdpa_kernel(kernels), autocast:
            return model.albert(batch["input_ids"], mask, batch["token_type_ids"]).last_hidden_state.float()

    fused = hidden([kernel])  # raises "No available kernel" where the fused kernel cannot take these inputs
    reference = hidden([SDPBackend.MATH])
    keep = batch["attention_mask"].bool() if masked else torch.ones_like(batch["attention_mask"], dtype=torch.bool)
    assert torch.isfinite(fused[keep]).all()
    torch.testing.assert_close(fused[keep], reference[keep], rtol=tolerance, atol=tolerance)
