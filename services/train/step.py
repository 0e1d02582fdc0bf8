"""One training step in plain torch: masking a micro-batch, accumulating the global-batch gradient, the update.

Imports only torch, numpy and albert_core, so a single process (a GPU check, a benchmark) runs exactly the step
the Ray workers run. The global batch is micro × accumulation × workers rows. The MLM loss is averaged over the
masked tokens of the whole global batch and the pair loss over its labelled rows: the counts are summed over
workers before the forward pass and each micro-batch's loss is scaled by them, so the gradient is the same however
the batch is split (tested: 4 × 2 equals 8 × 1). Workers sum gradients with one flat all-reduce per step, which
also carries the step's statistics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from albert_core.evaluation.unigram import UnigramBaseline
from albert_core.examples.batch import mlm_batches
from albert_core.examples.masking import IGNORE_INDEX
from albert_core.examples.pairs import order_draws, reorder_pair
from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import AlbertForPreTraining
from albert_core.optim import make_optimizer, make_scheduler
from albert_core.text.tokenization import TokenIds

if TYPE_CHECKING:  # plain dataclasses of the run config; read by attribute only
    from services.rundir.sections import DataSection, OptimSection

ReduceSum = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the workers in place (an all-reduce)


def make_micro_batch(
    rows: dict[str, np.ndarray], *, seed: int, epoch: int, ids: TokenIds, data: DataSection
) -> dict[str, torch.Tensor]:
    """Mask a micro-batch of shard rows (dynamic, seeded per example and epoch) into CPU tensors."""
    return make_micro_batches(rows, seed=seed, epoch=epoch, ids=ids, data=data, micro_batch=None)[0]


def make_micro_batches(
    rows: dict[str, np.ndarray],
    *,
    seed: int,
    epoch: int | np.ndarray,
    ids: TokenIds,
    data: DataSection,
    micro_batch: int | None,
) -> list[dict[str, torch.Tensor]]:
    """`make_micro_batch` of each run of `micro_batch` rows (None: one micro-batch of all), masked in one call:
    a worker's rows of a whole step at once (albert_core.examples.batch.mlm_batches)."""
    check_shard_rows(rows, ids, data)
    if data.sop_order == "epoch":
        rows = redraw_orders(rows, seed=seed, epoch=epoch)
    batches = mlm_batches(
        rows["input_ids"],
        rows["token_type_ids"],
        rows["pair_label"],
        rows["word_starts"],
        rows["example_id"],
        micro_batch=micro_batch,
        seed=seed,
        epoch=epoch,
        seq_len=data.max_seq_length if data.static_shapes else None,
        vocab_size=ids.vocab_size,
        special_ids=ids.special_ids,
        mask_id=ids.mask_id,
        pad_id=ids.pad_id,
        mask_prob=data.mask_prob,
        max_ngram=data.max_ngram,
    )
    return [{k: torch.from_numpy(v) for k, v in batch.items()} for batch in batches]


def check_shard_rows(rows: dict[str, np.ndarray], ids: TokenIds, data: DataSection) -> None:
    """Every row fits data.max_seq_length and the vocabulary; the first that does not is named."""
    lengths = np.fromiter((len(row) for row in rows["input_ids"]), dtype=np.int64, count=len(rows["input_ids"]))
    highest, lowest = np.zeros_like(lengths), np.zeros_like(lengths)
    filled = np.flatnonzero(lengths > 0)
    if filled.size:
        tokens = np.concatenate([rows["input_ids"][i] for i in filled])
        starts = np.cumsum(lengths[filled]) - lengths[filled]
        highest[filled], lowest[filled] = np.maximum.reduceat(tokens, starts), np.minimum.reduceat(tokens, starts)
    too_long = lengths > data.max_seq_length
    outside = (lengths > 0) & ((highest >= ids.vocab_size) | (lowest < 0))
    if not (too_long | outside).any():
        return
    i = int(np.argmax(too_long | outside))
    example = int(rows["example_id"][i])
    where = f"example {example} (shard {example >> 32}, row {example & 0xFFFFFFFF})"
    if too_long[i]:
        raise ValueError(f"{where} has {lengths[i]} tokens, more than data.max_seq_length={data.max_seq_length}")
    raise ValueError(f"{where} has token id {int(highest[i])}, outside the vocabulary of {ids.vocab_size}")


def redraw_orders(rows: dict[str, np.ndarray], *, seed: int, epoch: int | np.ndarray) -> dict[str, np.ndarray]:
    """data.sop_order = "epoch": each SOP row in the order drawn for it in this epoch (albert_core.examples.pairs)."""
    epochs = np.broadcast_to(np.asarray(epoch, dtype=np.int64), (len(rows["input_ids"]),))
    swapped = order_draws(seed, epochs, np.asarray(rows["example_id"], dtype=np.int64))
    columns = ("input_ids", "token_type_ids", "word_starts", "pair_label")
    out = {name: np.empty(len(epochs), dtype=object) for name in columns}
    for i in range(len(epochs)):
        stored = [rows[name][i] for name in columns[:3]]
        values = reorder_pair(*(np.asarray(v) for v in stored), int(rows["pair_label"][i]), int(swapped[i]))
        for name, value in zip(columns, values, strict=True):
            out[name][i] = value
    out["pair_label"] = out["pair_label"].astype(np.int64)
    return {**rows, **out}


@dataclass
class StepStats:
    """One optimizer step over the global batch (summed over workers). Tensors: read them only when logging."""

    loss: torch.Tensor
    mlm_loss: torch.Tensor
    pair_loss: torch.Tensor
    mlm_acc: torch.Tensor
    pair_acc: torch.Tensor
    tokens: int | torch.Tensor  # real (non-pad) tokens in the global batch (XLA: a device scalar)
    grad_norm: torch.Tensor | None = None
    lr: float = 0.0


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    *,
    device: torch.device | str = "cpu",
    autocast_dtype: torch.dtype | None = None,
    reduce_sum: ReduceSum | None = None,
) -> StepStats:
    """Forward/backward every micro-batch; leaves the gradient of the global-batch loss in `.grad`.

    The global batch is these micro-batches on every worker. `reduce_sum` sums a tensor over workers in place
    (an all-reduce); None means one process.
    """
    device = torch.device(device)
    counts = torch.tensor([_counts(mb) for mb in micro_batches], dtype=torch.float64).reshape(-1, 3)
    totals = counts.sum(0)  # float64 keeps integer counts exact
    if reduce_sum is not None:  # summed where the group's backend reads tensors (nccl: the GPU), read back here
        totals = reduce_sum(totals.to(device)).cpu()
    n_masked, n_pairs, n_tokens = totals.tolist()  # on the host: one process reads them without a device sync
    sums = torch.zeros(4, dtype=torch.float32, device=device)  # mlm loss, pair loss, mlm correct, pair correct
    for mb, (mb_masked, mb_pairs, _) in zip(micro_batches, counts.tolist(), strict=True):
        mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
        with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            out = model(
                input_ids=mb["input_ids"],
                attention_mask=mb["attention_mask"],
                token_type_ids=mb["token_type_ids"],
                mlm_labels=mb["mlm_labels"],
                pair_labels=mb["pair_labels"],
            )
        loss = torch.zeros((), device=device)
        if mb_masked:
            mlm_sum = out.mlm_loss.float() * mb_masked
            loss = loss + mlm_sum / n_masked
            labels = mb["mlm_labels"][mb["mlm_labels"] != IGNORE_INDEX]
            sums[0] += mlm_sum.detach()
            sums[2] += (out.mlm_logits.argmax(-1) == labels).sum()
        if mb_pairs:
            pair_sum = out.pair_loss.float() * mb_pairs
            loss = loss + pair_sum / n_pairs
            labelled = mb["pair_labels"] != IGNORE_INDEX
            sums[1] += pair_sum.detach()
            sums[3] += (out.pair_logits.argmax(-1)[labelled] == mb["pair_labels"][labelled]).sum()
        if loss.requires_grad:
            loss.backward()
    if reduce_sum is not None:
        sums = _reduce_gradients(model, sums, reduce_sum)
    mlm_loss = sums[0] / max(n_masked, 1.0)
    pair_loss = sums[1] / max(n_pairs, 1.0)
    return StepStats(
        loss=mlm_loss + pair_loss,
        mlm_loss=mlm_loss,
        pair_loss=pair_loss,
        mlm_acc=sums[2] / max(n_masked, 1.0),
        pair_acc=sums[3] / max(n_pairs, 1.0),
        tokens=int(n_tokens),
    )


def _counts(mb: dict[str, torch.Tensor]) -> list[float]:
    """Masked positions, labelled pairs and real tokens of one micro-batch."""
    return [
        float((mb["mlm_labels"] != IGNORE_INDEX).sum()),
        float((mb["pair_labels"] != IGNORE_INDEX).sum()),
        float(mb["attention_mask"].sum()),
    ]


def _reduce_gradients(model: torch.nn.Module, sums: torch.Tensor, reduce_sum: ReduceSum) -> torch.Tensor:
    """Sum every gradient and the step's statistics over the workers in one flat all-reduce."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads] + [sums])
    reduce_sum(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
        offset += n
    return flat[offset:]


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    *,
    grad_clip: float,
    device: torch.device | str = "cpu",
    autocast_dtype: torch.dtype | None = None,
    reduce_sum: ReduceSum | None = None,
) -> StepStats:
    """One optimizer update: accumulate, clip the global gradient norm (grad_clip <= 0: no clip), LAMB, schedule."""
    stats = accumulate_gradients(
        model, micro_batches, device=device, autocast_dtype=autocast_dtype, reduce_sum=reduce_sum
    )
    params = [p for p in model.parameters() if p.grad is not None]
    stats.grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf)
    stats.lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return stats


def optimizer_for(
    model: torch.nn.Module, o: OptimSection
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The optimizer (LAMB or AdamW, parameter groups by name) and schedule that a run's `optim` section describes."""
    optimizer = make_optimizer(
        model,
        name=o.name,
        lr=o.lr,
        weight_decay=o.weight_decay,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        bias_correction=o.bias_correction if o.name == "lamb" else None,
        trust_clip=tuple(o.trust_clip) if o.trust_clip else None,
    )
    schedule = make_scheduler(
        optimizer, warmup_steps=o.warmup_steps, total_steps=o.total_steps, decay_steps=o.decay_steps
    )
    return optimizer, schedule


def initial_model(config: AlbertConfig, seed: int, unigram: UnigramBaseline | None = None) -> AlbertForPreTraining:
    """A new run's model: weights drawn under `seed`; with `unigram` (model.mlm_bias_init = "unigram"), the MLM
    bias starts at the shard set's piece log frequencies. A resumed or stacked run loads its weights over these."""
    torch.manual_seed(seed)
    model = AlbertForPreTraining(config)
    if unigram is not None:
        model.init_mlm_bias(torch.from_numpy(unigram.log_probs()).float())
    return model


def step_seed(seed: int, rank: int, step: int) -> int:
    """The torch seed for dropout at (run seed, worker, step): reproducible without saved RNG state."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1, dtype=np.uint64)[0] >> 1)
