"""The pretraining loop on Ray Train: data-parallel ALBERT + LAMB, exactly resumable.

Driver (`run_pretraining`) -> one `TorchTrainer` -> `num_workers` copies of `train_loop_per_worker`.

Exact resume. A run stopped at any point and resumed from its newest good checkpoint reproduces the
uninterrupted run's per-step losses bit for bit on CPU. Four things make that hold:

1. Each worker reads a fixed, ordered slice of the data. The driver sorts the train shard files and gives
   worker r the files `files[r::num_workers]`. This slice is a Ray Data dataset of its own (`train_<r>`), passed to
   the trainer unsplit (`DataConfig(datasets_to_split=[])`) and read with `shuffle=None` and
   `preserve_order=True`. The worker reads it with `get_dataset_shard(f"train_{rank}")`. Ray's streaming split
   hands out blocks to whichever worker asks first, which is fine for throughput but cannot be replayed; the
   fixed slices can. Workers must also step in lockstep: each one takes `steps_per_epoch × accumulation`
   micro-batches per epoch, where the driver computes `steps_per_epoch` from the Parquet row counts as the
   smallest any worker can fill. The unused tail of a larger slice is dropped in that epoch.
2. The data position is a pair of counters: (epoch, micro-batches consumed in the epoch). It is saved in
   every checkpoint. On resume each worker skips that many micro-batches of its slice, reading them but not
   masking or training on them.
3. Masks are dynamic but reproducible: `albert_core.batch.mlm_batch` seeds each row from (run seed, epoch,
   example_id), so a re-read row gets the same mask it had before the crash, and the next epoch draws a new one.
4. Dropout randomness is reseeded before every step from (run seed, rank, step). No RNG state has to survive a
   crash, and the draws do not depend on how many steps this process has run. The checkpoint still stores the
   process's RNG states (`services.train_state`).

Gradients. A global batch is micro × accumulation × workers rows. The MLM loss is averaged over the masked
tokens of the whole global batch, and the pair loss over its labelled rows. These counts are summed over
workers before the forward pass, and each micro-batch's loss is scaled by them. The gradient is then the same
however the batch is split into micro-batches and workers (tested: 4 × 2 equals 8 × 1). Workers sum their
gradients with one flat all-reduce per optimizer step, which also carries the step's statistics. ALBERT's
shared layers make that buffer small: 12M floats for albert-base. After that every worker clips the global norm
(`optim.grad_clip`) and applies LAMB to identical gradients, so replicas stay identical without a broadcast.

Budget. `train.max_seconds` > 0 ends the run at the first step that brings its training time (wall time in the
loop, summed over resumes through the checkpoints' `train_seconds`) to the budget: rank 0's clock decides and one
tiny broadcast per step tells every worker, so all stop at the same step, which is saved as the final checkpoint
(the coordinator evaluates it as the run's last). A resumed run whose budget is spent does not train further.

Reporting. Every `train.log_every` steps, every `train.checkpoint_every` steps and at the end, all workers call
`ray.train.report`, which acts as a barrier. On checkpoint steps rank 0 first writes a training checkpoint to
`<run_dir>/checkpoints/step_XXXXXXXX` (`services.train_state`) and attaches it. Rank 0 also sends the metrics
to the run's coordinator actor when one is named. Without a coordinator, rank 0 appends them to
`<run_dir>/metrics.jsonl`. When it starts (or resumes at step S) it first drops every line whose step is past
S, so a resumed run never duplicates a step, and it keeps the newest `train.keep_last` checkpoints. With a
coordinator, the coordinator owns metrics.jsonl and checkpoint retention.

Backends. `cpu` and `cuda` run the step above in eager torch (gloo / nccl all-reduce); with `train.compile` the
backbone is torch.compiled (albert_core.model.compile_backbone), the step otherwise the same. `xla` (TPU, or the PJRT
CPU/CUDA runtimes) runs services/xla_backend: the driver picks the PJRT runtime (`pjrt_device_for`) and each worker
sets it before torch_xla starts. The model moves to the XLA device before the optimizer is made. A background thread
masks each micro-batch, pads it to a fixed shape (sequence buckets 128 and data.max_seq_length, micro_batch_size
rows) and copies it to the device, reading exactly the micro-batches the CPU loop reads, so the data position and
exact resume work as above. Each step is one compiled graph (`xla_train_step`, dropout seeded from the same
`step_seed`); its statistics stay on the device and are read only when logged, with `xla_compiles` (graphs
compiled so far) added to the metrics. Checkpoints are the same files: synced, then copied tensor by tensor to
the CPU; a resume reads them on the CPU and copies them into the device model and optimizer. Gradients are summed
inside the step over the PJRT replicas (xm.all_reduce) when the runtime's replicas are the Ray workers; when each
worker is a PJRT runtime of one replica (the usual case: PJRT CPU, one TPU host per worker) they are summed over the
gloo group Ray Train set up, on host copies (`_xla_host_reduce`; services/xla_backend has the cost). Tested on PJRT
CPU with 1 and 2 workers (tests/xla/test_xla_train.py).

Ray Data reads the shards with its V1 Parquet path and `num_cpus=0` tasks. Its V2 path lists files in a task
that asks for a whole CPU, and while the Train workers hold every CPU of a small machine (2 workers × 1 CPU on 2
cores) that task never runs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import itertools
import json
import logging
import math
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from albert_core.batch import mlm_batch
from albert_core.checkpoint import atomic_write_bytes
from albert_core.config import ConfigError
from albert_core.files import CorruptCheckpoint
from albert_core.masking import IGNORE_INDEX
from albert_core.model import AlbertForPreTraining, compile_backbone
from albert_core.optim import make_optimizer, make_scheduler
from albert_core.shards import EXAMPLE_SCHEMA, MANIFEST_FILE, TRAIN_DIR
from albert_core.tokenization import MODEL_FILE, SPECIAL_PIECES, TokenIds, Tokenizer
from services.report import read_metrics
from services.run_config import DataSection, OptimSection, RunConfig, TrainSection
from services.train_state import (
    TrainerState,
    checkpoint_dir,
    latest_good,
    list_checkpoints,
    load_train_state,
    read_trainer_json,
    save_train_state,
)

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
STOP_ENV = "ALBERT_STOP_AFTER_STEP"  # simulate a crash right after step N (tests of resume)
# Debug, opt-in: a directory where every worker appends one line per step it starts, holding the example ids of
# that step, to `rank<r>.jsonl` (see `trace_step`). A step redone after a failure is appended again.
TRACE_ENV = "ALBERT_TRACE_EXAMPLES"
COORDINATOR_NAMESPACE = "albert"
COLUMNS = [f.name for f in EXAMPLE_SCHEMA]

__all__ = [
    "TokenIds",
    "DataPlan",
    "StepStats",
    "TrainResult",
    "SimulatedCrash",
    "resolve_token_ids",
    "plan_data",
    "make_micro_batch",
    "accumulate_gradients",
    "train_step",
    "train_loop_per_worker",
    "trace_step",
    "run_pretraining",
    "pjrt_device_for",
    "config_hash",
    "read_metrics",
]


class SimulatedCrash(RuntimeError):
    """Raised by every worker right after step ALBERT_STOP_AFTER_STEP (and its checkpoint, if any)."""


# --------------------------------------------------------------------------------------------------
# vocabulary and data plan (driver side; plain values that travel to the workers)


def resolve_token_ids(shards_dir: Path, config: RunConfig) -> TokenIds:
    """Vocabulary size and special ids, from the first of these that exists.

    1. `model.overrides.vocab_size`, if set (non-zero). The special ids are ALBERT's layout: <pad>=0, <unk>=1,
       [CLS]=2, [SEP]=3, [MASK]=4.
    2. The tokenizer the shards were made with: `spiece.model` in the shards directory, in `<shards>/tokenizer/`,
       or at the path the manifest names (`"tokenizer"`: a path, or an object with `"path"`, as services/preprocess
       writes; a relative path is tried as given, then under the shards directory).
    3. `vocab_size` in manifest.json (at the top level or under `"tokenizer"`), again with ALBERT's layout.
    """
    override = config.model.overrides.get("vocab_size") or 0
    if override:
        return TokenIds(vocab_size=int(override))
    manifest = _read_manifest(shards_dir)
    tokenizer_entry = manifest.get("tokenizer")
    candidates = [shards_dir / MODEL_FILE, shards_dir / "tokenizer" / MODEL_FILE]
    if isinstance(tokenizer_entry, str):
        candidates.append(Path(tokenizer_entry))
    elif isinstance(tokenizer_entry, dict) and isinstance(tokenizer_entry.get("path"), str):
        candidates.append(Path(tokenizer_entry["path"]))
    for path in [c if c.is_absolute() or c.exists() else shards_dir / c for c in candidates]:
        if path.is_dir():
            path = path / MODEL_FILE
        if path.is_file():
            return TokenIds.from_tokenizer(Tokenizer.load(path))
    size = manifest.get("vocab_size")
    if size is None and isinstance(tokenizer_entry, dict):
        size = tokenizer_entry.get("vocab_size")
    if isinstance(size, int) and size > len(SPECIAL_PIECES):
        return TokenIds(vocab_size=size)
    raise ConfigError(
        f"data.shards: cannot tell the vocabulary size: no {MODEL_FILE} in {shards_dir} or {shards_dir / 'tokenizer'}, "
        f"and {shards_dir / MANIFEST_FILE} has no vocab_size; set model.overrides.vocab_size"
    )


def _read_manifest(shards_dir: Path) -> dict[str, Any]:
    path = shards_dir / MANIFEST_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"data.shards: {path} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"data.shards: {path}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class DataPlan:
    """Which shard files each worker reads, and how many optimizer steps one epoch holds."""

    files_per_worker: tuple[tuple[str, ...], ...]
    rows_per_worker: tuple[int, ...]
    steps_per_epoch: int


def plan_data(shards_dir: Path, config: RunConfig) -> DataPlan:
    """Split the train shards by file (`files[r::workers]`) and size the epoch so every worker can fill it."""
    train_dir = shards_dir / TRAIN_DIR
    if not shards_dir.is_dir():
        raise ConfigError(f"data.shards: {shards_dir} does not exist (expected a preprocess output directory)")
    if not train_dir.is_dir():
        raise ConfigError(f"data.shards: {shards_dir} has no {TRAIN_DIR}/ directory of Parquet shards")
    files = sorted(str(p.resolve()) for p in train_dir.rglob("*.parquet"))
    if not files:
        raise ConfigError(f"data.shards: {train_dir} holds no .parquet files")
    t = config.train
    if len(files) < t.num_workers:
        raise ConfigError(
            f"train.num_workers: {t.num_workers} workers but {train_dir} has {len(files)} shard files; "
            "each worker reads whole files: use fewer workers or write more shards"
        )
    rows = {}
    for path in files:
        try:
            meta = pq.ParquetFile(path)
        except Exception as err:  # pyarrow raises several types for a damaged footer
            raise ConfigError(f"data.shards: {path}: not a readable Parquet file ({err})") from None
        missing = [c for c in COLUMNS if c not in meta.schema_arrow.names]
        if missing:
            raise ConfigError(f"data.shards: {path}: lacks column {missing[0]!r} (expected {', '.join(COLUMNS)})")
        rows[path] = meta.metadata.num_rows
    per_worker = tuple(tuple(files[r :: t.num_workers]) for r in range(t.num_workers))
    rows_per_worker = tuple(sum(rows[f] for f in fs) for fs in per_worker)
    rows_per_step = t.micro_batch_size * t.accumulation
    steps = min(rows_per_worker) // rows_per_step
    if steps == 0:
        raise ConfigError(
            f"data.shards: worker slices hold {min(rows_per_worker)} to {max(rows_per_worker)} examples, fewer than "
            f"one step needs per worker (micro_batch_size {t.micro_batch_size} x accumulation {t.accumulation})"
        )
    unused = sum(rows_per_worker) - steps * rows_per_step * t.num_workers
    if unused:
        log.info("each epoch uses %d steps; %d of %d examples are left out", steps, unused, sum(rows_per_worker))
    return DataPlan(per_worker, rows_per_worker, steps)


def config_hash(config: RunConfig) -> str:
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------------------------------
# one step (plain torch; a single process needs no Ray)


def make_micro_batch(
    rows: dict[str, np.ndarray], *, seed: int, epoch: int, ids: TokenIds, data: DataSection
) -> dict[str, torch.Tensor]:
    """Mask a micro-batch of shard rows (dynamic, seeded per example and epoch) into CPU tensors."""
    for i, row in enumerate(rows["input_ids"]):
        example = int(rows["example_id"][i])
        if len(row) > data.max_seq_length:
            raise ValueError(
                f"example {example} (shard {example >> 32}, row {example & 0xFFFFFFFF}) has {len(row)} tokens, "
                f"more than data.max_seq_length={data.max_seq_length}"
            )
        if len(row) and (int(np.max(row)) >= ids.vocab_size or int(np.min(row)) < 0):
            raise ValueError(
                f"example {example} (shard {example >> 32}, row {example & 0xFFFFFFFF}) has token id "
                f"{int(np.max(row))}, outside the vocabulary of {ids.vocab_size}"
            )
    batch = mlm_batch(
        rows["input_ids"],
        rows["token_type_ids"],
        rows["pair_label"],
        rows["word_starts"],
        rows["example_id"],
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
    return {k: torch.from_numpy(v) for k, v in batch.items()}


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


ReduceSum = Callable[[torch.Tensor], torch.Tensor]


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    *,
    device: torch.device | str = "cpu",
    autocast_dtype: torch.dtype | None = None,
    reduce_sum: ReduceSum | None = None,
) -> StepStats:
    """Forward/backward every micro-batch; leaves the gradient of the global-batch loss in `.grad`.

    The global batch is these micro-batches on every worker. The MLM loss is averaged over all of its masked
    tokens and the pair loss over all of its labelled rows, so the gradient does not depend on how the batch is
    split. `reduce_sum` sums a tensor over workers in place (an all-reduce); None means one process.
    """
    device = torch.device(device)
    reduce = reduce_sum or (lambda t: t)
    counts = torch.tensor(
        [
            [
                float((mb["mlm_labels"] != IGNORE_INDEX).sum()),
                float((mb["pair_labels"] != IGNORE_INDEX).sum()),
                float(mb["attention_mask"].sum()),
            ]
            for mb in micro_batches
        ],
        dtype=torch.float64,
    )
    totals = reduce(counts.sum(0).to(device)).tolist()  # float64 keeps integer counts exact
    n_masked, n_pairs, n_tokens = totals
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
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads] + [sums])
        reduce_sum(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
            offset += n
        sums = flat[offset:]

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
    return optimizer, make_scheduler(optimizer, warmup_steps=o.warmup_steps, total_steps=o.total_steps)


def step_seed(seed: int, rank: int, step: int) -> int:
    """The torch seed for dropout at (run seed, worker, step): reproducible without saved RNG state."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1, dtype=np.uint64)[0] >> 1)


# --------------------------------------------------------------------------------------------------
# metrics.jsonl (used when no coordinator owns it)


def _truncate_metrics(path: Path, after_step: int) -> None:
    """Drop lines past `after_step`: a resumed run will write those steps again."""
    if not path.exists():
        return
    kept = [r for r in read_metrics(path) if int(r.get("step", 0)) <= after_step]
    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in kept).encode())


def _append_metrics(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def _prune_checkpoints(root: Path, keep: int) -> None:
    for _, path in list_checkpoints(root)[keep:]:
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# the worker


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point. `config` is built by `run_pretraining` (see `_loop_config`)."""
    import ray
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    run = RunConfig.from_dict(config["run_config"], source="train_loop_config")
    ids = TokenIds(**config["token_ids"])
    t, o = run.train, run.optim
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    if world != t.num_workers:
        raise RuntimeError(f"train.num_workers is {t.num_workers} but Ray started {world} workers")
    xla = _xla_backend(config["pjrt_device"]) if t.backend == "xla" else None
    if xla is not None:
        worker = xla.setup_xla_worker(config["pjrt_device"])
        device = worker.device
    else:
        device = ray.train.torch.get_device()
    distributed = dist.is_available() and dist.is_initialized() and world > 1
    reduce_sum = _all_reduce_sum if distributed else None
    xla_host_reduce = _xla_host_reduce(worker, world, reduce_sum) if xla is not None else None
    autocast_dtype = torch.bfloat16 if t.precision == "bf16" else None

    torch.manual_seed(run.run.seed)  # identical initial weights on every worker
    model = AlbertForPreTraining(run.model_config(ids.vocab_size)).to(device)  # before the optimizer (XLA needs it)
    if t.compile:
        compile_backbone(model)
    optimizer, scheduler = optimizer_for(model, o)
    run_dir = Path(config["run_dir"])
    checkpoints = run_dir / CHECKPOINTS_DIR
    metrics_path = run_dir / METRICS_FILE
    coordinator = _coordinator(config)

    # Rank 0 picks the checkpoint to resume from; everyone loads the same one.
    choice = [None]
    if rank == 0:
        found = _resume_point(coordinator, checkpoints)
        choice = [str(found) if found else None]
    if distributed:
        dist.broadcast_object_list(choice, src=0)
    initial_dropout = model.config.hidden_dropout_prob
    state = TrainerState(
        dropout=initial_dropout, config_hash=config_hash(run), world_size=world, micro_batch_size=t.micro_batch_size
    )
    if choice[0]:
        load = load_train_state if xla is None else xla.load_xla_train_state  # XLA: files -> CPU -> device
        state = load(choice[0], model, optimizer, scheduler)
        if (state.world_size, state.micro_batch_size) != (world, t.micro_batch_size):
            raise RuntimeError(
                f"{choice[0]}: written by {state.world_size} workers x micro-batch {state.micro_batch_size}; "
                f"this run has {world} x {t.micro_batch_size}, so the data position would not match"
            )
        if state.config_hash != config_hash(run):
            log.warning("%s: written under a different run config; continuing with the new one", choice[0])
        log.info("rank %d resumes from %s at step %d (epoch %d)", rank, choice[0], state.step, state.epoch)
    elif config.get("init_from"):  # a new run from another checkpoint's layers (model.init_from, albert_core.stacking)
        from albert_core.stacking import load_stacked

        load_stacked(model, config["init_from"])
        if config.get("init_data_position"):  # data.continue_from_init: read on where that run stopped
            state.epoch, state.batches_in_epoch = config["init_data_position"]
    if rank == 0:
        checkpoints.mkdir(parents=True, exist_ok=True)
        for stale in checkpoints.glob(".step_*"):  # temporaries of a save that crashed
            shutil.rmtree(stale, ignore_errors=True)
        if coordinator is None:
            _truncate_metrics(metrics_path, state.step)

    shard = ray.train.get_dataset_shard(f"train_{rank}")
    accumulation = t.accumulation
    per_epoch = config["steps_per_epoch"] * accumulation  # micro-batches each worker takes per epoch
    stop_after = config.get("stop_after_step")
    trace = Path(config["trace_examples"]) / f"rank{rank}.jsonl" if config.get("trace_examples") else None
    started_at = state.step
    window_start, window_tokens = time.perf_counter(), []  # tokens per step (XLA: device scalars, read when logging)
    buckets = tuple(sorted({min(128, run.data.max_seq_length), run.data.max_seq_length}))  # XLA sequence lengths

    loop_started, seconds_before = time.perf_counter(), state.train_seconds
    out_of_time = bool(t.max_seconds) and state.train_seconds >= t.max_seconds  # a finished budget run resumed

    while state.step < o.total_steps and not out_of_time:
        batches = shard.iter_batches(
            batch_size=t.micro_batch_size, batch_format="numpy", drop_last=True, prefetch_batches=2
        )
        rows_iter = iter(batches)
        loader = None
        try:
            for _ in range(state.batches_in_epoch):  # the part of this epoch consumed before the resume
                _next_rows(rows_iter, state, rank)
            epoch = state.epoch
            # The steps left in this epoch (or in the run, if it ends first), each `accumulation` micro-batches.
            steps = min(per_epoch - state.batches_in_epoch, (o.total_steps - state.step) * accumulation) // accumulation
            next_rows = functools.partial(_next_rows, rows_iter, state, rank)
            masked = functools.partial(make_micro_batch, seed=run.run.seed, epoch=epoch, ids=ids, data=run.data)
            if xla is None:
                step_batches = _host_step_batches(next_rows, masked, steps, accumulation)
            else:
                static = functools.partial(
                    xla.static_batches,
                    buckets=buckets,
                    batch_size=t.micro_batch_size,
                    mask_prob=run.data.mask_prob,
                    pad_id=ids.pad_id,
                )
                loader, step_batches = _xla_step_batches(xla, next_rows, masked, static, steps, accumulation, device)
            for rows, micro in step_batches:
                step = state.step + 1
                if trace is not None:  # before the step: a worker killed inside it leaves the line, and redoes it
                    trace_step(trace, step=step, epoch=epoch, rank=rank, rows=rows)
                if t.dropout_removal_step and step >= t.dropout_removal_step and state.dropout != 0.0:
                    model.set_dropout(0.0)
                    state.dropout = 0.0
                if xla is None:
                    model.train()
                    torch.manual_seed(step_seed(run.run.seed, rank, step))
                    stats = train_step(
                        model,
                        optimizer,
                        scheduler,
                        micro,
                        grad_clip=o.grad_clip,
                        device=device,
                        autocast_dtype=autocast_dtype,
                        reduce_sum=reduce_sum,
                    )
                else:
                    stats = _xla_train_step(
                        xla,
                        model,
                        optimizer,
                        scheduler,
                        micro,
                        grad_clip=o.grad_clip,
                        precision=t.precision,
                        seed=step_seed(run.run.seed, rank, step),
                        host_reduce=xla_host_reduce,
                    )
                state.step = step
                state.batches_in_epoch += accumulation
                if state.batches_in_epoch >= per_epoch:
                    state.epoch, state.batches_in_epoch = state.epoch + 1, 0
                window_tokens.append(stats.tokens)

                state.train_seconds = seconds_before + time.perf_counter() - loop_started
                if t.max_seconds:
                    out_of_time = _rank0_decides(state.train_seconds >= t.max_seconds, distributed)
                is_last = step == o.total_steps or out_of_time
                save = step % t.checkpoint_every == 0 or is_last
                if step % t.log_every == 0 or save:
                    tokens = sum(int(n) for n in window_tokens)
                    now = time.perf_counter()
                    metrics = _metrics(step, epoch, stats, tokens / max(now - window_start, 1e-9), state)
                    window_start, window_tokens = now, []
                    if xla is not None:
                        metrics["xla_compiles"] = xla.compile_count()  # grows only when a new graph appears
                    state.metrics = metrics
                    _publish(rank, metrics, metrics_path, coordinator)
                    checkpoint = None
                    if save and rank == 0:
                        save_state = save_train_state if xla is None else xla.save_xla_train_state  # via CPU copies
                        path = save_state(checkpoint_dir(checkpoints, step), model, optimizer, scheduler, state)
                        if coordinator is not None:
                            coordinator.checkpoint_saved.remote(step, str(path), metrics, final=is_last)
                        else:
                            _prune_checkpoints(checkpoints, t.keep_last)
                        checkpoint = ray.train.Checkpoint.from_directory(str(path))
                    if save:
                        ray.train.report(metrics, checkpoint=checkpoint, delete_local_checkpoint_after_upload=False)
                    else:
                        ray.train.report(metrics)
                if stop_after == step and step > started_at:
                    raise SimulatedCrash(f"{STOP_ENV}={stop_after}: stopping after step {step} to simulate a crash")
                if out_of_time:
                    log.info("train.max_seconds=%s spent at step %d: the run ends here", t.max_seconds, step)
                    break
        finally:
            if loader is not None:
                loader.close()  # stops its reading thread before the rows iterator closes
            close = getattr(rows_iter, "close", None)
            if close is not None:
                close()


def _host_step_batches(
    next_rows: Callable[[], dict[str, np.ndarray]],
    masked: Callable[[dict[str, np.ndarray]], dict[str, torch.Tensor]],
    steps: int,
    accumulation: int,
) -> Iterator[tuple[list[dict[str, np.ndarray]], list[dict[str, torch.Tensor]]]]:
    """(rows, masked micro-batches) for each of `steps` steps, read and masked when the step asks for them."""
    for _ in range(steps):
        rows = [next_rows() for _ in range(accumulation)]
        yield rows, [masked(r) for r in rows]


def _xla_backend(pjrt_device: str):
    """services.xla_backend, imported once PJRT_DEVICE is set: torch_xla reads it when first imported."""
    os.environ["PJRT_DEVICE"] = pjrt_device
    from services import xla_backend

    return xla_backend


def _xla_step_batches(xla, next_rows, masked, static, steps: int, accumulation: int, device):
    """(loader, iterator of (rows, micro-batches on the device)) for `steps` steps of the XLA loop.

    A background thread reads, masks and pads (`static`) the micro-batches and copies them to the device ahead of
    the step (`xla.device_loader`). It reads exactly steps x accumulation micro-batches, as the host loop does, so
    the data position stays exact. The rows go through a FIFO beside the loader, for ALBERT_TRACE_EXAMPLES.
    """
    rows_read: deque[dict[str, np.ndarray]] = deque()

    def host() -> Iterator[dict[str, torch.Tensor]]:
        for _ in range(steps * accumulation):
            rows = next_rows()
            rows_read.append(rows)
            yield masked(rows)

    loader = xla.device_loader(static(host()), device)

    def groups():
        for step in range(steps):
            micro = list(itertools.islice(loader, accumulation))
            if len(micro) < accumulation:
                raise RuntimeError(
                    f"the XLA device loader ended at micro-batch {len(micro)} of step {step + 1}/{steps}"
                )
            yield [rows_read.popleft() for _ in micro], micro

    return loader, groups()


def _xla_host_reduce(worker, world: int, reduce_sum: ReduceSum | None) -> ReduceSum | None:
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


def _xla_train_step(
    xla,
    model,
    optimizer,
    scheduler,
    micro,
    *,
    grad_clip: float,
    precision: str,
    seed: int,
    host_reduce: ReduceSum | None = None,
) -> StepStats:
    """One `xla.xla_train_step`; its statistics stay device tensors until the loop logs them."""
    lr = optimizer.param_groups[0]["lr"]  # the rate this step applies (the scheduler steps inside)
    stats = xla.xla_train_step(
        model,
        optimizer,
        micro,
        scheduler=scheduler,
        max_grad_norm=grad_clip,
        precision=precision,
        seed=seed,
        host_reduce=host_reduce,
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


def _rank0_decides(flag: bool, distributed: bool) -> bool:
    """Rank 0's flag on every worker (one tiny gloo broadcast), so that all of them stop at the same step."""
    if not distributed:
        return flag
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    decision = torch.tensor([int(flag)], device=device)
    dist.broadcast(decision, src=0)
    return bool(decision.item())


def _all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def trace_step(path: Path, *, step: int, epoch: int, rank: int, rows: Sequence[dict[str, np.ndarray]]) -> None:
    """Append {"step", "epoch", "rank", "pid", "time", "example_ids"} as a step starts (ALBERT_TRACE_EXAMPLES).

    Written before the step, so every step a worker trained has its line, even when the worker dies right after the
    step while another rank's checkpoint keeps it. A step redone after a failure is appended again: the last line
    of each (rank, step) is the attempt that counted. One O_APPEND write per line: lines are whole or absent.
    """
    ids = [int(i) for r in rows for i in r["example_id"]]
    record = {"step": step, "epoch": epoch, "rank": rank, "pid": os.getpid(), "time": time.time(), "example_ids": ids}
    line = json.dumps(record) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _next_rows(rows_iter, state: TrainerState, rank: int) -> dict[str, np.ndarray]:
    try:
        return next(rows_iter)
    except StopIteration:
        raise RuntimeError(
            f"worker {rank}: its data slice ran out at epoch {state.epoch}, micro-batch {state.batches_in_epoch}; "
            "the shard files changed since the run was planned"
        ) from None


def _metrics(step: int, epoch: int, stats: StepStats, tokens_per_s: float, state: TrainerState) -> dict[str, float]:
    values = {
        "loss": stats.loss,
        "mlm_loss": stats.mlm_loss,
        "pair_loss": stats.pair_loss,
        "mlm_acc": stats.mlm_acc,
        "pair_acc": stats.pair_acc,
        "grad_norm": stats.grad_norm,
    }
    metrics: dict[str, Any] = {"step": step, "epoch": epoch}
    metrics.update({k: float(v) for k, v in values.items()})
    if not math.isfinite(metrics["loss"]):
        raise FloatingPointError(f"step {step}: loss is {metrics['loss']} (mlm {metrics['mlm_loss']})")
    metrics.update(lr=float(stats.lr), tokens_per_s=float(tokens_per_s), dropout=float(state.dropout))
    metrics["train_seconds"] = round(state.train_seconds, 3)
    return metrics


def _publish(rank: int, metrics: dict[str, Any], metrics_path: Path, coordinator) -> None:
    if rank != 0:
        return
    if coordinator is not None:
        coordinator.report.remote(metrics["step"], metrics)  # fire and forget
    else:
        _append_metrics(metrics_path, {"kind": "train", "time": time.time(), **metrics})


def _coordinator(config: dict[str, Any]):
    name = config.get("coordinator")
    if not name:
        return None
    import ray

    return ray.get_actor(name, namespace=config.get("coordinator_namespace") or COORDINATOR_NAMESPACE)


def _resume_point(coordinator, checkpoints: Path) -> Path | None:
    if coordinator is not None:
        import ray

        found = ray.get(coordinator.latest_good_checkpoint.remote())
        return Path(found) if found else None
    return latest_good(checkpoints)


# --------------------------------------------------------------------------------------------------
# the driver


def _init_data_position(init_from: Path, train: TrainSection) -> tuple[int, int]:
    """(epoch, micro-batches consumed) where the run that wrote checkpoint `init_from` stopped reading its data."""
    try:
        state = read_trainer_json(init_from)["state"]
    except CorruptCheckpoint as err:
        raise ConfigError(f"data.continue_from_init: {init_from} has no readable training state ({err})") from None
    layout = (state.get("world_size"), state.get("micro_batch_size"))
    if layout != (train.num_workers, train.micro_batch_size):
        raise ConfigError(
            f"data.continue_from_init: {init_from} was written by {layout[0]} workers x micro-batch {layout[1]}; "
            f"this run has {train.num_workers} x {train.micro_batch_size}, so its data position does not carry over"
        )
    return int(state["epoch"]), int(state["batches_in_epoch"])


def pjrt_device_for(train: TrainSection, environ: Mapping[str, str] = os.environ) -> str:
    """The PJRT runtime of backend "xla" workers (TPU, CUDA or CPU), decided on the driver before any starts.

    The resources the workers hold decide it: TPU in `train.resources_per_worker` -> TPU, GPU -> CUDA. The
    driver's own PJRT_DEVICE does not override them: the TPU cluster recipes set PJRT_DEVICE=CPU on the head
    node, where the driver runs, and TPU on the TPU hosts. Without accelerator resources the workers use the PJRT
    CPU runtime, but only when that is asked for with PJRT_DEVICE=CPU in the driver's environment (tests, a
    laptop), so a TPU run that forgot its resources fails here instead of training on CPUs. The chosen value goes
    to the workers in the loop config; each sets PJRT_DEVICE before it imports torch_xla.
    """
    resources = train.resources_per_worker
    tpu, gpu = resources.get("TPU", 0) > 0, resources.get("GPU", 0) > 0
    if tpu and gpu:
        raise ConfigError("train.resources_per_worker: both TPU and GPU; backend 'xla' runs on one PJRT runtime")
    if tpu:
        return "TPU"
    if gpu:
        return "CUDA"
    asked = environ.get("PJRT_DEVICE", "").strip().upper()
    if asked == "CPU":
        return "CPU"
    if not asked:
        raise ConfigError(
            "train.resources_per_worker: backend 'xla' with no TPU or GPU per worker would run on the PJRT CPU "
            "runtime, which is used only when asked for: set PJRT_DEVICE=CPU in the driver's environment, or give "
            "the workers accelerators, e.g. resources_per_worker = {TPU = 1}"
        )
    if asked in ("TPU", "CUDA"):
        wanted = "TPU" if asked == "TPU" else "GPU"
        raise ConfigError(
            f"train.resources_per_worker: PJRT_DEVICE={asked} in the driver's environment but the workers hold no "
            f"{wanted}; add it, e.g. resources_per_worker = {{{wanted} = 1}}"
        )
    raise ConfigError(f"PJRT_DEVICE: expected CPU, TPU or CUDA in the driver's environment, got {asked!r}")


@dataclass
class TrainResult:
    run_dir: Path
    step: int  # the last step of the newest good checkpoint
    checkpoint: Path | None
    metrics: dict[str, float]  # reported at that step
    metrics_file: Path
    finished: bool = False  # the run reached optim.total_steps or spent train.max_seconds


def run_pretraining(
    config: RunConfig,
    *,
    shards_dir: Path | None = None,
    resume: bool = True,
    coordinator_name: str | None = None,
    callbacks: list | None = None,
) -> TrainResult:
    """Validate, plan the data, run the TorchTrainer to optim.total_steps; resumes from the newest good checkpoint.

    Everything that can be checked is checked before a worker starts. That covers the config, the shards
    directory (`data.shards`), the vocabulary, and whether the file count fits `train.num_workers`.
    resume=False refuses a run directory that already holds checkpoints rather than mixing two runs in it.
    """
    import ray
    import ray.train
    from ray.data import DataContext, ExecutionOptions
    from ray.train.torch import TorchConfig, TorchTrainer

    config.validate()
    t = config.train
    pjrt_device = None
    if t.backend == "xla":
        if importlib.util.find_spec("torch_xla") is None:
            raise ConfigError(
                "train.backend: 'xla' needs torch_xla (torch-xla 2.9 with torch 2.9.0) on the driver and every worker; "
                "scripts/xla_venv.sh builds that virtualenv, the TPU cluster recipes install it on every node"
            )
        pjrt_device = pjrt_device_for(t)
    if shards_dir is None:
        if not config.data.shards:
            raise ConfigError("data.shards: empty; point it at a preprocess output directory")
        shards_dir = Path(config.data.shards)
    shards_dir = Path(shards_dir).resolve()
    plan = plan_data(shards_dir, config)
    ids = resolve_token_ids(shards_dir, config)

    run_dir = config.run_dir.resolve()
    checkpoints = run_dir / CHECKPOINTS_DIR
    ray_storage = run_dir / "ray"
    init_from = Path(config.model.init_from).resolve() if config.model.init_from else None
    if init_from is not None:  # checked before a worker starts; the workers read it by absolute path
        from albert_core.stacking import check_init_source

        check_init_source(init_from, config.model_config(ids.vocab_size))
    init_position = _init_data_position(init_from, t) if config.data.continue_from_init else None
    if not resume and list_checkpoints(checkpoints):
        raise ConfigError(
            f"run.name: {run_dir} already holds checkpoints; resume it, or choose another run.name / run.output_dir"
        )
    if not resume:
        shutil.rmtree(ray_storage / config.run.name, ignore_errors=True)  # Ray would restore its old run state
    run_dir.mkdir(parents=True, exist_ok=True)
    stop_after = os.environ.get(STOP_ENV)
    trace = os.environ.get(TRACE_ENV)
    if trace:
        Path(trace).mkdir(parents=True, exist_ok=True)

    loop_config = {
        "run_config": config.to_dict(),
        "run_dir": str(run_dir),
        "token_ids": dataclasses.asdict(ids),
        "steps_per_epoch": plan.steps_per_epoch,
        "coordinator": coordinator_name,
        "coordinator_namespace": COORDINATOR_NAMESPACE,
        "stop_after_step": int(stop_after) if stop_after else None,
        "pjrt_device": pjrt_device,
        "trace_examples": str(Path(trace).resolve()) if trace else None,
        "init_from": str(init_from) if init_from else None,
        "init_data_position": init_position,
    }
    context = DataContext.get_current()
    saved_v2 = context.use_datasource_v2
    context.use_datasource_v2 = False  # see the module docstring: V2 listing needs a free CPU
    try:
        datasets = {
            f"train_{r}": ray.data.read_parquet(list(files), columns=COLUMNS, shuffle=None, num_cpus=0)
            for r, files in enumerate(plan.files_per_worker)
        }
        for dataset in datasets.values():
            dataset.context.enable_progress_bars = False  # one bar per epoch per worker is noise in the logs
    finally:
        context.use_datasource_v2 = saved_v2
    resources = {"CPU": t.cpus_per_worker, **t.resources_per_worker}
    use_gpu = t.backend == "cuda" or resources.get("GPU", 0) > 0
    tpu = {"use_tpu": True} if resources.get("TPU", 0) > 0 else {}  # Ray refuses a TPU resource without it
    try:
        scaling = ray.train.ScalingConfig(
            num_workers=t.num_workers, use_gpu=use_gpu, resources_per_worker=resources, **tpu
        )
    except (TypeError, ValueError) as err:
        raise ConfigError(f"train.resources_per_worker: Ray does not accept {resources} per worker ({err})") from None
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config,
        # xla: gloo carries the loop's control messages (resume choice) and, when each worker is one PJRT replica,
        # the host all-reduce of the gradients (services/xla_backend.host_sum_gradients).
        torch_config=TorchConfig(backend="nccl" if t.backend == "cuda" else "gloo"),
        scaling_config=scaling,
        run_config=ray.train.RunConfig(
            name=config.run.name,
            storage_path=str(ray_storage),
            failure_config=ray.train.FailureConfig(max_failures=t.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=t.keep_last),
            callbacks=callbacks,
        ),
        datasets=datasets,
        dataset_config=ray.train.DataConfig(
            datasets_to_split=[], execution_options=ExecutionOptions(preserve_order=True)
        ),
    )
    trainer.fit()

    final = latest_good(checkpoints)
    step, metrics, seconds = 0, {}, 0.0
    if final is not None:
        state = read_trainer_json(final)["state"]
        step, metrics, seconds = state["step"], state["metrics"], state.get("train_seconds", 0.0)
    finished = step >= config.optim.total_steps or bool(t.max_seconds and seconds >= t.max_seconds)
    return TrainResult(run_dir, step, final, metrics, run_dir / METRICS_FILE, finished)
