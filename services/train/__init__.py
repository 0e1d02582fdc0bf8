"""Pretraining on Ray Train: data-parallel ALBERT + LAMB, exactly resumable.

Where things are:
- driver.py   `run_pretraining`: checks, the worker plan, one TorchTrainer, the result
- plan.py     what the driver decides: vocabulary, shard files, PJRT runtime, the frozen WorkerPlan
- worker.py   the loop each worker runs (resume, input, step, after-step hooks)
- data.py     a worker's input: its slice of each global batch in the run's example order, masked and prefetched
- step.py     one training step in plain torch (no Ray): masking, accumulation, all-reduce, clip, update
- backends.py step backends (eager CPU/CUDA, XLA) behind one interface; xla.py holds the XLA primitives
- record.py   where rank 0 keeps the run's record (the coordinator, or a ledger of its own)
- state.py    training checkpoints: model, optimizer, scheduler, data position, RNG, in plain files
"""

from services.run.log import read_metrics
from services.train.driver import TrainResult, run_pretraining
from services.train.plan import COLUMNS, config_hash, pjrt_device_for, plan_data, resolve_token_ids
from services.train.step import (
    StepStats,
    TokenIds,
    accumulate_gradients,
    make_micro_batch,
    optimizer_for,
    step_seed,
    train_step,
)
from services.train.worker import STOP_ENV, TRACE_ENV, SimulatedCrash, trace_step, train_loop_per_worker

__all__ = [
    "COLUMNS",
    "STOP_ENV",
    "TRACE_ENV",
    "SimulatedCrash",
    "StepStats",
    "TokenIds",
    "TrainResult",
    "accumulate_gradients",
    "config_hash",
    "make_micro_batch",
    "optimizer_for",
    "pjrt_device_for",
    "plan_data",
    "read_metrics",
    "resolve_token_ids",
    "run_pretraining",
    "step_seed",
    "trace_step",
    "train_loop_per_worker",
    "train_step",
]
