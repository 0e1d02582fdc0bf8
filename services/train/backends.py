"""Step backends: where the model lives and how one training step runs there. The worker loop calls only this
interface, so it has no backend branches.

- `EagerBackend` (cpu, cuda): eager torch, gradients summed over the workers with one flat all-reduce (gloo /
  nccl); with `train.compile` the backbone is torch.compiled (parameter names unchanged).
- `XlaBackend` (TPU, or the PJRT CPU / CUDA runtimes): services.train.xla. A background thread pads each host
  micro-batch to a fixed shape (sequence buckets 128 and data.max_seq_length, micro_batch_size rows) and copies it
  to the device, reading exactly the micro-batches the eager loop reads, so the data position and exact resume are
  the same. Each step is one compiled graph; its statistics stay on the device until logged. Gradients are summed
  over the PJRT replicas in the step (xm.all_reduce) when they are the Ray workers, or over the gloo group Ray
  Train set up through host copies when each worker is one replica (the usual case: PJRT CPU, a TPU host per
  worker). Checkpoints are the same files as the eager backend's, copied through the CPU.

Every backend owns: placing the model, placing step batches, the train step (accumulation and reduction
included), and saving and loading the training state.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from albert_core.model.modeling import AlbertForPreTraining, compile_backbone
from services.train.state import TrainerState, load_train_state, save_train_state
from services.train.step import ReduceSum, StepStats, train_step

if TYPE_CHECKING:
    from services.train.plan import WorkerPlan

HostStep = tuple[list[dict[str, np.ndarray]], list[dict[str, torch.Tensor]]]  # (shard rows, masked micro-batches)


class StepBackend(Protocol):
    device: torch.device

    def place(self, model: AlbertForPreTraining) -> None: ...

    def step_batches(self, host_steps: Iterator[HostStep]) -> contextlib.AbstractContextManager[Iterator[HostStep]]:
        """The host steps with their micro-batches where the step reads them (stops any reader when left)."""
        ...

    def train_step(self, model, optimizer, scheduler, micro, *, grad_clip: float, seed: int) -> StepStats: ...

    def save(self, directory: Path, model, optimizer, scheduler, state: TrainerState, carry=()) -> Path:
        """A training checkpoint (services.train.state), with the files of `carry` copied into it."""
        ...

    def load(self, directory: str, model, optimizer, scheduler) -> TrainerState: ...

    def metrics(self) -> dict[str, Any]:
        """Backend-specific numbers added to each metrics line."""
        ...


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


class EagerBackend:
    def __init__(self, device: torch.device, *, precision: str, compile: bool, reduce_sum: ReduceSum | None):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is not None:
            # Make the worker's GPU the current device: nccl calls that name no device use it (the worker's
            # broadcast_object_list, and its budget broadcast on "cuda"), else every worker of a node uses cuda:0.
            torch.cuda.set_device(self.device)
        self.autocast_dtype = torch.bfloat16 if precision == "bf16" else None
        self.compile = compile
        self.reduce_sum = reduce_sum

    def place(self, model: AlbertForPreTraining) -> None:
        model.to(self.device)
        if self.compile:
            compile_backbone(model)

    def step_batches(self, host_steps: Iterator[HostStep]) -> contextlib.AbstractContextManager[Iterator[HostStep]]:
        return contextlib.nullcontext(host_steps)  # micro-batches move to the device inside the step

    def train_step(self, model, optimizer, scheduler, micro, *, grad_clip: float, seed: int) -> StepStats:
        model.train()
        torch.manual_seed(seed)
        return train_step(
            model,
            optimizer,
            scheduler,
            micro,
            grad_clip=grad_clip,
            device=self.device,
            autocast_dtype=self.autocast_dtype,
            reduce_sum=self.reduce_sum,
        )

    def save(self, directory: Path, model, optimizer, scheduler, state: TrainerState, carry=()) -> Path:
        return save_train_state(directory, model, optimizer, scheduler, state, carry)

    def load(self, directory: str, model, optimizer, scheduler) -> TrainerState:
        return load_train_state(directory, model, optimizer, scheduler)

    def metrics(self) -> dict[str, Any]:
        return {}


def xla_host_reduce(worker, world: int, reduce_sum: ReduceSum | None) -> ReduceSum | None:
    """How an xla worker sums over the Ray workers: None = inside the step over the PJRT replicas (xm.all_reduce),
    else this reduce over the gloo group, applied to host copies of the step's counts and gradients.
    """
    if worker.world_size == world:  # one worker, or a PJRT runtime whose replicas are the workers (TPU multi-process)
        return None
    if worker.world_size == 1 and reduce_sum is not None:  # each worker one replica (PJRT CPU, one TPU host each)
        return reduce_sum
    if worker.world_size == 1:
        raise RuntimeError(
            f"train.num_workers: Ray started {world} xla workers without a torch.distributed group to sum their "
            "gradients over (Ray Train sets up gloo for backend 'xla')"
        )
    raise RuntimeError(
        f"train.num_workers: Ray started {world} workers but each one's PJRT {worker.runtime} runtime has "
        f"{worker.world_size} replicas; gradients are summed over the PJRT replicas when they are the workers, or "
        "over the workers through the host when each has one replica: set train.num_workers to "
        f"{worker.world_size}, or give each worker one device"
    )


class XlaBackend:
    def __init__(
        self,
        pjrt_device: str,
        *,
        world: int,
        reduce_sum: ReduceSum | None,
        precision: str,
        buckets: tuple[int, ...],
        batch_size: int,
        mask_prob: float,
        pad_id: int,
    ):
        os.environ["PJRT_DEVICE"] = pjrt_device  # torch_xla reads it when first imported
        from services.train import xla

        self.xla = xla
        worker = xla.setup_xla_worker(pjrt_device)
        self.device = worker.device
        self.host_reduce = xla_host_reduce(worker, world, reduce_sum)
        self.precision = precision
        self.static: Callable = lambda batches: xla.static_batches(
            batches, buckets=buckets, batch_size=batch_size, mask_prob=mask_prob, pad_id=pad_id
        )

    def place(self, model: AlbertForPreTraining) -> None:
        model.to(self.device)  # before the optimizer is made

    @contextlib.contextmanager
    def step_batches(self, host_steps: Iterator[HostStep]) -> Iterator[Iterator[HostStep]]:
        """A background thread pads and copies the micro-batches to the device ahead of the step; the rows go
        through a FIFO beside it (for the step callbacks, services.train.callbacks)."""
        rows_read: deque[tuple[list[dict[str, np.ndarray]], int]] = deque()

        def host() -> Iterator[dict[str, torch.Tensor]]:
            for rows, micro in host_steps:
                rows_read.append((rows, len(micro)))
                yield from micro

        loader = self.xla.device_loader(self.static(host()), self.device)

        def groups() -> Iterator[HostStep]:
            while True:
                first = next(loader, None)
                if first is None:
                    return
                rows, accumulation = rows_read.popleft()
                micro = [first, *itertools.islice(loader, accumulation - 1)]
                if len(micro) < accumulation:
                    raise RuntimeError(f"the XLA device loader ended at micro-batch {len(micro)} of {accumulation}")
                yield rows, micro

        try:
            yield groups()
        finally:
            loader.close()  # stops its reading thread before the host iterator closes

    def train_step(self, model, optimizer, scheduler, micro, *, grad_clip: float, seed: int) -> StepStats:
        lr = optimizer.param_groups[0]["lr"]  # the rate this step applies (the scheduler steps inside)
        stats = self.xla.xla_train_step(
            model,
            optimizer,
            micro,
            scheduler=scheduler,
            max_grad_norm=grad_clip,
            precision=self.precision,
            seed=seed,
            host_reduce=self.host_reduce,
        )
        return StepStats(
            loss=stats.loss,
            mlm_loss=stats.mlm_loss,
            pair_loss=stats.pair_loss,
            mlm_acc=stats.mlm_acc,
            pair_acc=stats.pair_acc,
            tokens=stats.tokens,
            grad_norm=stats.grad_norm,
            lr=lr,
        )

    def save(self, directory: Path, model, optimizer, scheduler, state: TrainerState, carry=()) -> Path:
        return self.xla.save_xla_train_state(directory, model, optimizer, scheduler, state, carry)  # synced, via CPU

    def load(self, directory: str, model, optimizer, scheduler) -> TrainerState:
        return self.xla.load_xla_train_state(directory, model, optimizer, scheduler)  # files -> CPU -> device

    def metrics(self) -> dict[str, Any]:
        return {"xla_compiles": self.xla.compile_count()}  # grows only when a new graph appears


def backend_for(plan: WorkerPlan, *, world: int, reduce_sum: ReduceSum | None) -> StepBackend:
    """The step backend train.backend names, for this Ray Train worker."""
    t, data = plan.config.train, plan.config.data
    if t.backend == "xla":
        return XlaBackend(
            plan.pjrt_device,
            world=world,
            reduce_sum=reduce_sum,
            precision=t.precision,
            buckets=tuple(sorted({min(128, data.max_seq_length), data.max_seq_length})),
            batch_size=t.micro_batch_size,
            mask_prob=data.mask_prob,
            pad_id=plan.token_ids.pad_id,
        )
    import ray.train.torch

    return EagerBackend(ray.train.torch.get_device(), precision=t.precision, compile=t.compile, reduce_sum=reduce_sum)
