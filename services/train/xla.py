"""The XLA backend of the train loop: device setup, static-shape batches, one train step, checkpoints via CPU.

XLA traces each step into a graph and compiles it once per distinct graph, so everything a step sees must keep
its shape and structure from step to step:

- batches are padded to a few fixed sequence lengths (buckets) and a fixed number of rows (`static_batch`);
- the MLM loss decodes a fixed number of positions per row (`mlm_positions`, padded, targets -100) instead of the
  model's boolean selection, whose size depends on the data (`static_pretraining_loss`);
- nothing in a step reads a value back to the host (a host reduce, below, excepted): the loss is returned as a
  device tensor;
- `torch_xla.sync()` ends each step, so one step is one graph (three with a host reduce).

With these, a run compiles one training graph per bucket, plus one for its very first step (the optimizer
state is created inside it). A learning rate of exactly 0 or 1 is baked into the graph as a constant (other
values are graph inputs), so a schedule that ends at 0 adds one graph per bucket for its last steps.
`compile_count` counts them. The train loop (services/train/backends.py, train.backend = "xla") does, per worker:

    worker = setup_xla_worker(pjrt_device)          # PJRT runtime (the driver chose it), device, rank/world
    model.to(worker.device); optimizer = make_optimizer(model, ...)   # optimizer after the move
    state = load_xla_train_state(checkpoint, model, optimizer, scheduler)   # on resume: files -> CPU -> device
    batches = static_batches(mlm_batches, buckets=(128, max_seq_length), batch_size=micro_batch_size)
    with device_loader(batches, worker.device) as loader:
        for micro_batches in accumulation groups of loader:
            stats = xla_train_step(model, optimizer, micro_batches, scheduler=scheduler, precision=..., seed=...)
            if step % log_every == 0: log({k: v.item() ...})             # the only host reads
            if step % checkpoint_every == 0: save_xla_train_state(directory, model, optimizer, scheduler, state)

Data parallelism. Two ways to sum the gradients, chosen by the train loop (services/train/backends.py):

- over the PJRT runtime's `xr.world_size()` replicas with `xm.all_reduce` inside the step (host_reduce=None),
  when the runtime's replicas are the data-parallel workers (a PJRT multi-process or SPMD job). The step stays one
  graph. Not tested here: XLA:CPU has no cross-device collectives (pytorch/xla#5005).
- over Ray workers that are each a PJRT runtime of one replica (a Ray Train worker is such a process: PJRT CPU, or
  one TPU host per worker), with `host_reduce`: a SUM over the workers of a CPU tensor, in place (train.py passes
  a gloo all-reduce over the group Ray Train set up). The step then reads back twice: the counts of the global
  batch (3 integers) before the losses are scaled, and after backward one flat float32 tensor of all gradients
  plus the step's statistics; each is summed on the host and sent back as device data. That is one device->host
  and one host->device copy of the gradients per step, plus a gloo ring all-reduce of them (each worker sends and
  receives ~2(n-1)/n of the buffer): 47 MB for albert-base (11.7M parameters), 0.9 GB for albert-xxlarge
  (223M). A step runs three graphs instead of one (counts; forward + backward; update), so a run compiles two
  graphs per bucket (per combination of buckets when accumulating) plus two for the update (first step,
  steady). Tested on PJRT CPU with 2 Ray workers (tests/xla/test_xla_train.py).

Several devices in one process (a TPU host's chips) need PJRT replicas or SPMD, which the loop does not set up:
a Ray worker drives one device, so a TPU slice runs one worker per chip (deploy.md).

Requires torch-xla 2.9 with torch 2.9 (scripts/xla_venv.sh builds that virtualenv).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

try:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.runtime as xr
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "services.train.xla needs torch-xla 2.9 (which needs torch 2.9.0 exactly); "
        "build its virtualenv with scripts/xla_venv.sh and run from there"
    ) from err

from albert_core.examples.masking import IGNORE_INDEX
from albert_core.model.modeling import AlbertForPreTraining
from services.train.state import TrainerState, load_train_state, save_train_state

PJRT_DEVICES = ("TPU", "CPU", "CUDA")
PRECISIONS = ("fp32", "bf16")


# --- device setup --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class XlaWorker:
    device: torch.device
    runtime: str  # the PJRT device type in use: TPU, CPU or CUDA
    rank: int  # global ordinal of this process's device
    world_size: int  # data-parallel replicas (processes x local devices)


def setup_xla_worker(pjrt_device: str | None = None, *, compile_cache_dir: str | Path | None = None) -> XlaWorker:
    """Select the PJRT runtime (argument, else $PJRT_DEVICE, else CPU) and return this process's XLA device.

    compile_cache_dir: write compiled graphs there and reuse them in later processes, so a restarted run skips
    its compiles (on TPU a large model's compile takes minutes). The PJRT CPU runtime writes entries but cannot
    read them back (it compiles again). Call this before anything else touches torch_xla: the runtime and the
    cache are chosen once per process.
    """
    wanted = (pjrt_device or os.environ.get("PJRT_DEVICE") or "CPU").upper()
    if wanted not in PJRT_DEVICES:
        raise ValueError(f"PJRT_DEVICE: expected one of {', '.join(PJRT_DEVICES)}, got {wanted!r}")
    os.environ["PJRT_DEVICE"] = wanted
    if compile_cache_dir is not None:
        Path(compile_cache_dir).mkdir(parents=True, exist_ok=True)
        xr.initialize_cache(str(compile_cache_dir), readonly=False)
    device = torch_xla.device()
    runtime = xr.device_type()
    if runtime != wanted:
        raise RuntimeError(
            f"PJRT_DEVICE: asked for {wanted} but this process's XLA runtime is already {runtime}; "
            "set PJRT_DEVICE before the first use of torch_xla"
        )
    return XlaWorker(device=device, runtime=runtime, rank=xr.global_ordinal(), world_size=xr.world_size())


def compile_count() -> int:
    """XLA graphs compiled so far in this process (torch_xla.debug.metrics "CompileTime" samples).

    A graph found in the persistent cache (compile_cache_dir) is not compiled and not counted.
    """
    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


# --- static-shape batches ------------------------------------------------------------------------------


def max_predictions_for(seq_len: int, mask_prob: float = 0.15) -> int:
    """Predicted positions per row at this length: examples.masking's budget for a row of seq_len real tokens."""
    return max(1, int(np.floor(seq_len * mask_prob + 0.5)))


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `length` tokens."""
    for bucket in sorted(buckets):
        if length <= bucket:
            return bucket
    raise ValueError(f"static_batch: a row has {length} tokens, more than the largest bucket ({max(buckets)})")


def static_batch(
    batch: Mapping[str, np.ndarray | Tensor],
    *,
    buckets: Sequence[int],
    batch_size: int | None = None,
    mask_prob: float = 0.15,
    max_predictions: int | None = None,
    pad_id: int = 0,
) -> dict[str, Tensor]:
    """An `albert_core.examples.batch.mlm_batch` batch reshaped for XLA: CPU int64 tensors of a few fixed shapes.

    Width: the smallest bucket holding the longest real row. Rows: padded to `batch_size` with rows that attend
    to one pad token and predict nothing (they add 0 to the loss and its gradient). MLM: `mlm_labels` (B, T)
    becomes `mlm_positions` and `mlm_targets` (B, K), the predicted positions in order, padded with position 0
    and target -100; K = `max_predictions` or the masking budget of a full bucket. `num_tokens` (0-d) counts the
    real tokens, for throughput.
    """
    for name in ("input_ids", "attention_mask", "token_type_ids", "mlm_labels", "pair_labels"):
        if name not in batch:
            raise ValueError(f"static_batch: batch lacks {name!r} (has {', '.join(sorted(batch))})")
    arrays = {k: np.asarray(v, dtype=np.int64) for k, v in batch.items()}
    attention = arrays["attention_mask"]
    rows, width = attention.shape
    real = attention.sum(axis=1)
    used_columns = np.flatnonzero(attention.any(axis=0))
    longest = int(used_columns[-1]) + 1 if used_columns.size else 1
    T = bucket_for(longest, buckets)
    B = rows if batch_size is None else batch_size
    if rows > B:
        raise ValueError(f"static_batch: {rows} rows, more than batch_size={B}")
    K = max_predictions if max_predictions is not None else max_predictions_for(T, mask_prob)
    if K < 1:
        raise ValueError(f"static_batch: max_predictions must be >= 1, got {K}")

    def padded(name: str, fill: int) -> np.ndarray:
        out = np.full((B, T), fill, dtype=np.int64)
        cut = min(width, T)
        out[:rows, :cut] = arrays[name][:, :cut]
        return out

    labels = padded("mlm_labels", IGNORE_INDEX)
    attention_mask = padded("attention_mask", 0)
    attention_mask[rows:, 0] = 1  # padding rows see one (pad) token: an all-masked row would softmax to NaN
    positions = np.zeros((B, K), dtype=np.int64)
    targets = np.full((B, K), IGNORE_INDEX, dtype=np.int64)
    for r in range(rows):
        where = np.flatnonzero(labels[r] != IGNORE_INDEX)
        if where.size > K:
            raise ValueError(
                f"static_batch: row {r} ({int(real[r])} tokens) has {where.size} predicted positions, more than "
                f"max_predictions={K} for bucket {T}; pass a larger max_predictions"
            )
        positions[r, : where.size] = where
        targets[r, : where.size] = labels[r, where]
    pair_labels = np.full((B,), IGNORE_INDEX, dtype=np.int64)
    pair_labels[:rows] = arrays["pair_labels"].reshape(rows)
    out = {
        "input_ids": padded("input_ids", pad_id),
        "attention_mask": attention_mask,
        "token_type_ids": padded("token_type_ids", 0),
        "mlm_positions": positions,
        "mlm_targets": targets,
        "pair_labels": pair_labels,
        "num_tokens": np.asarray(real.sum(), dtype=np.int64),
    }
    return {k: torch.from_numpy(v) for k, v in out.items()}


def static_batches(
    batches: Iterable[Mapping[str, np.ndarray | Tensor]],
    *,
    buckets: Sequence[int],
    batch_size: int | None = None,
    mask_prob: float = 0.15,
    max_predictions: int | None = None,
    pad_id: int = 0,
) -> Iterator[dict[str, Tensor]]:
    """`static_batch` over an iterator of batches (lazily, so it can feed a device loader)."""
    for batch in batches:
        yield static_batch(
            batch,
            buckets=buckets,
            batch_size=batch_size,
            mask_prob=mask_prob,
            max_predictions=max_predictions,
            pad_id=pad_id,
        )


class DeviceLoader:
    """Batches of CPU tensors moved to the XLA device by background threads, overlapping the step.

    torch_xla's ParallelLoader reads `batches` in one thread and copies them to the device in another. An error
    raised while producing a batch ends its iteration silently; here it is raised where the batches are read,
    after the batches produced before it. `close()` (or leaving a `with` block) stops the threads, e.g. when the
    loop stops early; the source iterator is no longer read once it returns.
    """

    def __init__(self, batches: Iterable[dict[str, Tensor]], device: torch.device, **loader_options):
        self._error: BaseException | None = None
        self._loader = pl.ParallelLoader(self._guarded(batches), [device], **loader_options)
        self._batches = self._loader.per_device_loader(device)

    def _guarded(self, batches: Iterable[dict[str, Tensor]]) -> Iterator[dict[str, Tensor]]:
        try:
            yield from batches
        except Exception as err:  # raised again in the reading thread by __next__
            self._error = err

    def __iter__(self) -> DeviceLoader:
        return self

    def __next__(self) -> dict[str, Tensor]:
        try:
            return next(self._batches)
        except StopIteration:
            if self._error is not None:
                raise self._error from None
            raise

    def close(self) -> None:
        self._loader.close()

    def __enter__(self) -> DeviceLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def device_loader(batches: Iterable[dict[str, Tensor]], device: torch.device) -> DeviceLoader:
    """Batches of CPU tensors moved to the XLA device by background threads, overlapping the step."""
    return DeviceLoader(batches, device)


# --- the step ------------------------------------------------------------------------------------------


@dataclass
class StaticLosses:
    """Sums over one static batch (0-d tensors): divide by global counts to get means."""

    mlm_sum: Tensor  # cross-entropy summed over the predicted positions
    pair_sum: Tensor
    mlm_correct: Tensor
    pair_correct: Tensor
    mlm_count: Tensor  # predicted positions (targets != -100)
    pair_count: Tensor

    @property
    def mlm_loss(self) -> Tensor:
        return self.mlm_sum / self.mlm_count.clamp(min=1)

    @property
    def pair_loss(self) -> Tensor:
        return self.pair_sum / self.pair_count.clamp(min=1)

    @property
    def loss(self) -> Tensor:
        """MLM mean + pair mean; a part with no targets adds 0, as the model's forward leaves it out."""
        return self.mlm_loss + self.pair_loss


def static_pretraining_loss(model: AlbertForPreTraining, batch: Mapping[str, Tensor]) -> StaticLosses:
    """MLM + pair losses from a `static_batch`, equal to the model's forward with mlm_labels.

    The forward decodes a data-dependent number of positions; here each row decodes exactly K gathered
    positions and padding targets (-100) are left out.
    """
    out = model.albert(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    hidden = out.last_hidden_state
    positions = batch["mlm_positions"]
    gathered = hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # (B, K, H)
    mlm_logits = model.mlm_head(gathered, model.albert.embeddings.word_embeddings.weight).flatten(0, 1)
    pair_logits = model.pair_head(model.classifier_dropout(out.pooled_output))
    mlm_targets, pair_targets = batch["mlm_targets"].flatten(), batch["pair_labels"]
    return StaticLosses(
        mlm_sum=F.cross_entropy(mlm_logits.float(), mlm_targets, ignore_index=IGNORE_INDEX, reduction="sum"),
        pair_sum=F.cross_entropy(pair_logits.float(), pair_targets, ignore_index=IGNORE_INDEX, reduction="sum"),
        mlm_correct=(mlm_logits.argmax(-1) == mlm_targets).sum(),  # argmax is never -100: padding never counts
        pair_correct=(pair_logits.argmax(-1) == pair_targets).sum(),
        mlm_count=(mlm_targets != IGNORE_INDEX).sum(),
        pair_count=(pair_targets != IGNORE_INDEX).sum(),
    )


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on the device for precision "bf16"; nothing for "fp32"."""
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


@dataclass
class XlaStepStats:
    """One step's numbers, as 0-d device tensors averaged over the global batch: .item() them only to log."""

    loss: Tensor
    mlm_loss: Tensor
    pair_loss: Tensor
    mlm_acc: Tensor
    pair_acc: Tensor
    grad_norm: Tensor  # before clipping
    tokens: Tensor  # real (non-pad) tokens in the global batch


HostReduce = Callable[[Tensor], Tensor]  # sums a CPU tensor over the Ray workers, in place (gloo all-reduce)


def xla_train_step(
    model: AlbertForPreTraining,
    optimizer: torch.optim.Optimizer,
    micro_batches: Mapping[str, Tensor] | Sequence[Mapping[str, Tensor]],
    *,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    max_grad_norm: float = 1.0,
    precision: str = "fp32",
    seed: int | None = None,
    host_reduce: HostReduce | None = None,
) -> XlaStepStats:
    """One optimizer update from `static_batch`es already on the device (one, or several to accumulate).

    As the eager step (services/train/step.py): the MLM loss is averaged over every predicted position of the global
    batch (all micro-batches on all replicas or workers) and the pair loss over every labelled row, so the update
    does not depend on how the batch is split; gradients are summed over them, the global norm is clipped at
    max_grad_norm (<= 0: not clipped), then the optimizer and scheduler step. seed reseeds the device RNG
    (dropout) for this step.

    Without host_reduce the sums run over the PJRT runtime's replicas (xm.all_reduce, none when there is one) and
    the whole step is one graph, ended by torch_xla.sync(); nothing is read back. With host_reduce (this process
    is one PJRT replica of several Ray workers) they run over the workers through host copies, so the step reads
    back twice and runs three graphs: the counts (read back, reduced, sent back as data), forward + backward ending
    in one flat tensor of the gradients and statistics (read back, reduced, sent back), and the update.
    """
    if isinstance(micro_batches, Mapping):
        micro_batches = [micro_batches]
    if not micro_batches:
        raise ValueError("xla_train_step: no micro-batches")
    device = micro_batches[0]["input_ids"].device
    replicas = xr.world_size()
    if host_reduce is not None and replicas > 1:
        raise ValueError(
            f"xla_train_step: host_reduce with {replicas} PJRT replicas; sum over the replicas (xm.all_reduce, "
            "host_reduce=None) or run one replica per process"
        )
    if seed is not None:
        xm.set_rng_state(seed, device=device)
    model.train()
    optimizer.zero_grad(set_to_none=True)

    counts = torch.stack(  # predicted positions, labelled pairs, real tokens
        [
            torch.stack(
                [(mb["mlm_targets"] != IGNORE_INDEX).sum(), (mb["pair_labels"] != IGNORE_INDEX).sum(), mb["num_tokens"]]
            )
            for mb in micro_batches
        ]
    ).sum(0)
    if host_reduce is not None:
        counts = host_sum(counts, host_reduce).to(device)  # device data: global counts are inputs, not constants
    elif replicas > 1:
        counts = xm.all_reduce(xm.REDUCE_SUM, counts)
    n_mlm, n_pair = counts[:2].clamp(min=1).unbind()
    sums = accumulate(model, micro_batches, n_mlm=n_mlm, n_pair=n_pair, precision=precision)
    if host_reduce is not None:
        sums = host_sum_gradients(model, sums, host_reduce)
    elif replicas > 1:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        xm.all_reduce(xm.REDUCE_SUM, grads + [sums])  # in place: each replica's loss is already globally scaled
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else math.inf)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    stats = XlaStepStats(  # computed before the sync, so they are outputs of the step's graph
        loss=(sums[0] / n_mlm + sums[1] / n_pair),
        mlm_loss=sums[0] / n_mlm,
        pair_loss=sums[1] / n_pair,
        mlm_acc=sums[2] / n_mlm,
        pair_acc=sums[3] / n_pair,
        grad_norm=grad_norm.detach(),
        tokens=counts[2],
    )
    torch_xla.sync()
    return stats


def accumulate(
    model: AlbertForPreTraining,
    micro_batches: Sequence[Mapping[str, Tensor]],
    *,
    n_mlm: Tensor,
    n_pair: Tensor,
    precision: str,
) -> Tensor:
    """Forward + backward of each micro-batch, its losses scaled by the global counts; returns the summed
    (mlm loss, pair loss, mlm correct, pair correct). A function of its own so that no per-micro-batch tensor
    outlives it: a live one would be computed again by the next graph that syncs (the update's, with a host
    reduce), tying that graph to the bucket.
    """
    sums = []
    for mb in micro_batches:
        with autocast(precision, mb["input_ids"].device):
            part = static_pretraining_loss(model, mb)
        (part.mlm_sum / n_mlm + part.pair_sum / n_pair).backward()
        sums.append(torch.stack([part.mlm_sum, part.pair_sum, part.mlm_correct.float(), part.pair_correct.float()]))
    return torch.stack(sums).sum(0).detach()


def host_sum(tensor: Tensor, host_reduce: HostReduce) -> Tensor:
    """A device tensor's value summed over the workers, on the host.

    .cpu() runs the graph that computes this tensor (only it) and copies the result; host_reduce sums the copy
    over the workers in place.
    """
    host = tensor.cpu()
    host_reduce(host)
    return host


def host_sum_gradients(model: nn.Module, sums: Tensor, host_reduce: HostReduce) -> Tensor:
    """Set every trainable parameter's .grad to its sum over the workers; return `sums` summed likewise.

    The gradients (zeros where a parameter got none, as the CPU path does) and `sums` are concatenated on the
    device into one float32 tensor, copied to the host, summed over the workers in one all-reduce, split there and
    sent back to the device in one batched transfer: each .grad arrives as device data of its own, so the update's
    graph has the same inputs at every step and carries no slicing of a flat buffer.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads] + [sums.float()])
    for p in params:
        p.grad = None  # only `flat` is computed: the graph does not output the gradients twice
    host = host_sum(flat, host_reduce)
    pieces = host.split([p.numel() for p in params] + [sums.numel()])
    cpu_grads = [piece.view_as(p).to(p.dtype) for piece, p in zip(pieces, params, strict=False)]
    on_device = xm.send_cpu_data_to_device(cpu_grads + [pieces[-1]], sums.device)
    for p, grad in zip(params, on_device, strict=False):
        p.grad = grad
    return on_device[-1]


# --- checkpoints through the CPU -----------------------------------------------------------------------


def to_cpu(tree):
    """Tensors in nested dicts/lists/tuples copied to the CPU (device state made host-readable)."""
    if isinstance(tree, Tensor):
        return tree.detach().cpu()
    if isinstance(tree, Mapping):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(v) for v in tree)
    return tree


def save_xla_train_state(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    state: TrainerState,
    carry: Sequence[str | Path] = (),
) -> Path:
    """A training checkpoint (services.train.state) of a model and optimizer on the XLA device, on rank 0.

    Pending device work is synced first, so the copies read finished values; save_train_state then copies each
    weight and optimizer tensor to the CPU and writes the same files as a CPU run (plain torch reads them).
    """
    torch_xla.sync()
    return save_train_state(directory, model, optimizer, scheduler, state, carry)


def load_xla_train_state(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
) -> TrainerState:
    """Resume a model and optimizer already on the XLA device from a training checkpoint.

    The files are verified and read on the CPU; the weights are copied into the device parameters and the
    optimizer's load_state_dict moves its state to its parameters' device. One sync then materializes them, so
    the first training step's graph does not carry the copies.
    """
    state = load_train_state(directory, model, optimizer, scheduler)
    torch_xla.sync()
    return state
