"""The disk a pretraining run will take in its run directory, checked before Ray starts (albert_core.files): its
checkpoints, each the float32 weights, the optimizer's moments and the run's tokenizer files (within 0.02% of a
22.9M-parameter checkpoint on disk, 1.1% of the tiny recipe's 0.6M), as many at once as retention keeps plus the one
being written.

Below one checkpoint the run is refused (it could keep no step); below what it will hold at once, warned.
Evaluations still pending keep their checkpoints from retention a while, and the metrics log, the report and Ray's
files under the run directory grow too: the warning is a floor."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from albert_core.files import SpaceNeed, size
from albert_core.model.checkpoint import expected_shapes
from albert_core.model.config import AlbertConfig
from services.rundir.checkpoints import CHECKPOINTS_DIR, list_checkpoints
from services.rundir.config import RunConfig

OPTIMIZER_MOMENTS = {"lamb": 2, "adamw": 2}  # float32 tensors the optimizer keeps per parameter (exp_avg, exp_avg_sq)
JSON_ALLOWANCE = 1 << 17  # config.json, trainer.json (30 kB: its RNG states, the schedule), CHECKSUMS.json


def parameter_count(config: AlbertConfig) -> int:
    """The parameters a checkpoint of AlbertForPreTraining holds (heads included; the MLM decoder is the tied word
    embeddings), from the tensor shapes the checkpoint format expects: nothing is allocated."""
    return sum(math.prod(shape) for shape in expected_shapes(config).values())


def checkpoint_bytes(config: AlbertConfig, optimizer: str, carried: int = 0) -> int:
    """The bytes of one training checkpoint: float32 weights, the optimizer's float32 moments, the files it carries
    (`carried` bytes: the run's tokenizer) and its JSON files."""
    moments = OPTIMIZER_MOMENTS.get(optimizer, 2)
    return parameter_count(config) * 4 * (1 + moments) + carried + JSON_ALLOWANCE


def checkpoint_count(config: RunConfig, after_step: int = 0) -> int:
    """Checkpoints the run saves after `after_step`: each multiple of train.checkpoint_every, and the last step."""
    total, every = config.optim.total_steps, config.train.checkpoint_every
    saved = total // every - min(after_step, total) // every
    return saved + (1 if total % every and after_step < total else 0)


def run_space_need(
    config: RunConfig, vocab_size: int, carried: Sequence[str | Path], *, resume: bool, start_step: int = 0
) -> SpaceNeed:
    """What the run's checkpoints will add to its run directory (a resume, from the checkpoint of `start_step`:
    beyond the checkpoints already there)."""
    run_dir = config.run_dir.resolve()
    existing = len(list_checkpoints(run_dir / CHECKPOINTS_DIR)) if resume else 0
    keep = config.train.keep_last
    held = min(keep + 1, existing + checkpoint_count(config, start_step))
    new = max(0, held - existing)
    one = checkpoint_bytes(
        config.model_config(vocab_size), config.optim.name, sum(Path(p).stat().st_size for p in carried)
    )
    why = f"train.keep_last {keep}, and the one being written" if held == keep + 1 else "all the run writes"
    what = f"the run's {new} new checkpoint{'s' if new != 1 else ''} of {size(one)} ({why}"
    what += f"; {existing} already there)" if existing else ")"
    return SpaceNeed("run.output_dir", str(run_dir), new * one, one if new else 0, "checkpoint", what)
