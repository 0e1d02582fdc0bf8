"""A worker's training input, ahead of its loop: each step's rows read in the run's example order and masked into
its micro-batches in one call (services.train.data, albert_core.examples.batch.mlm_batches), `depth` steps ahead.

`train.input_workers` chooses where that work runs:

- 0: a background thread of the training process (`Prefetch`). Reading and masking then share the process's GIL
  with the loop's own Python (kernel launches, the optimizer).
- N >= 1: N input processes (a torch DataLoader of spawned workers). Process k makes steps k, k + N, k + 2N, ...
  of the same plan and the loader takes them in turn, so the loop gets exactly the steps, in the order, a thread
  gives: the data position, resume and worker-count independence do not depend on N. A step comes back packed
  (`PackedStep`) and a thread of the training process unpacks it ahead of the loop.

On CUDA (`pin`) the micro-batches arrive in pinned memory (the thread that makes or unpacks them pins them), so
`tensor.to(device, non_blocking=True)` in the step copies without blocking the host.

Every item is (rows, micro-batches) as `host_steps` yields it, each micro-batch's rows cut down to their example
ids (what the loop reads of them: its step callbacks, services.train.callbacks).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from albert_core.text.tokenization import TokenIds
from services.rundir.config import RunConfig
from services.train.data import DamagedShard, Prefetch, ShardRows, host_steps
from services.train.follow import EpochData, data_stream
from services.train.plan import ShardSet
from services.train.step import make_micro_batches

HostStep = tuple[list[dict[str, np.ndarray]], list[dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class InputPlan:
    """What a worker's input needs (picklable: input processes receive it): the shard set, the run, what each decided
    epoch trains on (services.train.follow: the recorded epochs and, for a run that does not follow its shard set,
    the `tail` every later epoch trains), and the worker's steps from data position `position`."""

    shards: ShardSet
    config: RunConfig
    token_ids: TokenIds
    epochs: tuple[EpochData, ...]
    tail: EpochData | None
    position: int
    steps: int
    rank: int
    world: int

    def items(self, *, first: int = 0, every: int = 1, pin: bool = False) -> Iterator[HostStep]:
        """Steps first, first + every, ... of the plan; it ends before a step past the decided epochs."""
        t = self.config.train
        stream = data_stream(self.shards, self.config.run.seed, list(self.epochs), tail=self.tail)
        order = self.shards.order(self.shards.version, self.config.run.seed)
        reader = ShardRows(self.shards.files, order, sha256=self.shards.sha256)
        mask_step = functools.partial(self._mask_step, micro_batch=t.micro_batch_size)
        for step in range(first, self.steps, every):
            one = host_steps(
                reader,
                position=self.position + step * t.global_batch_size,
                steps=1,
                global_batch=t.global_batch_size,
                micro_batch=t.micro_batch_size,
                rank=self.rank,
                world=self.world,
                mask_step=mask_step,
                stream=stream,
            )
            item = next(one, None)
            if item is None:
                return
            rows, micro = item
            if pin:
                micro = [{k: v.pin_memory() for k, v in batch.items()} for batch in micro]
            yield [{"example_id": part["example_id"]} for part in rows], micro

    def _mask_step(self, rows, epochs, *, micro_batch: int) -> list[dict[str, torch.Tensor]]:
        return make_micro_batches(
            rows,
            seed=self.config.run.seed,
            epoch=epochs,
            ids=self.token_ids,
            data=self.config.data,
            micro_batch=micro_batch,
        )


class _StepsOfProcess(torch.utils.data.IterableDataset):
    """The steps of one input process: k, k + N, ... (k, N from the DataLoader's worker info), packed."""

    def __init__(self, plan: InputPlan):
        self.plan = plan

    def __iter__(self) -> Iterator[PackedStep | DamagedShard]:
        """Packed steps; a damaged shard comes back as an item (its one line), not as the loader's re-raised copy
        of the exception, whose message is the input process's whole traceback."""
        info = torch.utils.data.get_worker_info()
        first, every = (info.id, info.num_workers) if info is not None else (0, 1)
        try:
            for rows, micro in self.plan.items(first=first, every=every):
                yield PackedStep.pack(rows, micro)
        except DamagedShard as damage:
            yield damage


@dataclass(frozen=True)
class PackedStep:
    """A step from an input process: its micro-batches' tensors in one byte buffer, each in the narrowest integer
    type that holds its values, and where each lies in it (key, the tensor's dtype, the stored dtype, shape, offset).

    The loader pickles the numpy buffer through its pipe. Narrow types cut it about 3x (ids and labels fit int32,
    masks and token types int8); a thread of the training process widens them again (`unpack`). The loader's
    default, a shared-memory segment per tensor, measured slower here: page faults on every new segment."""

    rows: list[dict[str, np.ndarray]]
    data: np.ndarray  # uint8
    layout: tuple[tuple[tuple[str, torch.dtype, np.dtype, tuple[int, ...], int], ...], ...]

    @classmethod
    def pack(cls, rows: list[dict[str, np.ndarray]], micro: list[dict[str, torch.Tensor]]) -> PackedStep:
        arrays = [{key: _narrow(tensor.numpy()) for key, tensor in batch.items()} for batch in micro]
        layout, offset = [], 0
        for batch, narrow in zip(micro, arrays, strict=True):
            layout.append([])
            for key, array in narrow.items():
                layout[-1].append((key, batch[key].dtype, array.dtype, array.shape, offset))
                offset += array.nbytes
        data = np.empty(offset, dtype=np.uint8)
        for narrow, places in zip(arrays, layout, strict=True):
            for array, (*_, at) in zip(narrow.values(), places, strict=True):
                data[at : at + array.nbytes] = array.reshape(-1).view(np.uint8)
        return cls(rows, data, tuple(tuple(places) for places in layout))

    def unpack(self, *, pin: bool = False) -> HostStep:
        """The step's micro-batches in their own dtypes (in pinned memory with `pin`)."""
        micro = []
        for places in self.layout:
            batch = {}
            for key, dtype, stored, shape, at in places:
                narrow = torch.from_numpy(self.data[at : at + math.prod(shape) * stored.itemsize].view(stored))
                batch[key] = torch.empty(shape, dtype=dtype, pin_memory=pin).copy_(narrow.view(shape))
            micro.append(batch)
        return self.rows, micro


def _narrow(array: np.ndarray) -> np.ndarray:
    """An integer array in the narrowest of int8, int16, int32 that holds its values (else as it is)."""
    if array.dtype.kind not in "iu" or array.size == 0:
        return array
    low, high = int(array.min()), int(array.max())
    for dtype in (np.int8, np.int16, np.int32):
        if np.iinfo(dtype).min <= low and high <= np.iinfo(dtype).max:
            return array.astype(dtype)
    return array


def keep_freed_memory(_worker_id: int = 0) -> None:
    """Make glibc keep freed blocks of up to 32 MiB in the process instead of returning them to the system: the
    masker's numpy temporaries are such blocks, allocated again every step, and each return costs page faults on the
    next allocation (bench/bench_input.py --input-only measures the difference). For input processes, which only
    read and mask; elsewhere (not glibc) it does nothing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: blocks below this come from the heap
    libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD: the heap keeps this much free memory


def _unpacked(steps: Iterator[PackedStep | DamagedShard], pin: bool) -> Iterator[HostStep]:
    for packed in steps:
        if isinstance(packed, DamagedShard):
            raise packed
        yield packed.unpack(pin=pin)


def _as_made(item):
    return item  # not the loader's default, which would turn the example ids into tensors


@contextlib.contextmanager
def open_input(plan: InputPlan, *, workers: int, pin: bool, depth: int = 2) -> Iterator[Iterator[HostStep]]:
    """The plan's steps, made `depth` ahead by a thread (workers = 0) or by `workers` input processes; whatever
    makes them stops when the block is left."""
    if workers == 0:
        prefetch = Prefetch(plan.items(pin=pin), depth=depth)
        try:
            yield prefetch
        finally:
            prefetch.close()
        return
    loader = torch.utils.data.DataLoader(
        _StepsOfProcess(plan),
        batch_size=None,  # an item is a whole step, made by one process
        num_workers=workers,
        prefetch_factor=max(1, -(-depth // workers)),
        collate_fn=_as_made,
        worker_init_fn=keep_freed_memory,
        multiprocessing_context="spawn",  # not fork: the training process runs threads (Ray, torch)
        persistent_workers=False,
    )
    steps = iter(loader)
    unpacked = Prefetch(_unpacked(steps, pin), depth=1)  # widened (and pinned) off the loop
    try:
        yield unpacked
    finally:
        unpacked.close()
        steps._shutdown_workers()  # noqa: SLF001 - stop the processes now, not when the iterator is collected
