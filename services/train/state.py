"""Training checkpoints: everything a run needs to continue exactly where it stopped, in plain files.

A training checkpoint is a directory (e.g. `<run_dir>/checkpoints/step_00001000`):

    config.json          AlbertConfig                      } albert_core.model.checkpoint.save_model: the model alone
    model.safetensors    weights under canonical names     } loads with albert_core.model.checkpoint.load_model
    optimizer.safetensors  optimizer state tensors, keyed "<parameter name>.<state key>" (e.g. ".exp_avg")
    trainer.json         step, epoch, data position (examples seen), the masks' scheme, dropout, scheduler state,
                         optimizer hyperparameters and non-tensor state, torch/numpy/python RNG states, run config
                         hash, last metrics
    CHECKSUMS.json       sha256 and size of every other file (written last)

Nothing is pickled: tensors are safetensors, the rest is JSON, so loading a checkpoint cannot run code. This module
holds the torch side (state dicts, optimizer, RNG); services.rundir.checkpoints owns the directory: its names, the
atomic write with its checksums (`writing`), `verify` (what a rename cannot catch: a disk that lost or changed
bytes later) and `latest_good`, the newest checkpoint that verifies.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import logging
import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from albert_core.examples.masking import MASK_SCHEME
from albert_core.files import TRAINER_FILE, WEIGHTS_FILE, CorruptCheckpoint
from albert_core.model.checkpoint import CheckpointError, load_weights, read_checkpoint, save_model
from services.rundir.checkpoints import FORMAT, OPTIMIZER_FILE, VERSION, read_trainer_json, verify, writing

log = logging.getLogger(__name__)


@dataclass
class TrainerState:
    """The loop's own position. Saved in trainer.json beside the model and optimizer."""

    step: int = 0  # optimizer updates done
    epoch: int = 0  # the pass over the data the next example belongs to (examples_seen // examples per epoch)
    examples_seen: int = 0  # the data position: examples of the run's stream trained so far (examples.order)
    # What each epoch trains on, for every epoch that holds a trained example (and, in a run that follows its shard
    # set, the next one once decided): the shard set's version (its number of parts) and the data.mixture in force.
    # A resume replays them whatever the config says now (services.train.follow). epoch_versions is empty in a
    # checkpoint written before shard sets had parts (they had one); epoch_mixtures in one written before mixtures
    # were recorded (the run's configured mixture is taken).
    epoch_versions: list[int] = field(default_factory=list)
    epoch_mixtures: list[dict[str, float]] = field(default_factory=list)
    # The definition of the masks the run trained under (albert_core.examples.masking.MASK_SCHEME); a checkpoint
    # written before it was recorded holds none: scheme 1 (services.train.plan.check_mask_scheme).
    mask_scheme: int = MASK_SCHEME
    dropout: float = 0.0  # dropout probability applied to the model now
    config_hash: str = ""  # sha256 of the run config the checkpoint was written under
    world_size: int = 1
    micro_batch_size: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # the last metrics reported at this step
    train_seconds: float = 0.0  # wall time spent in the training loop up to this step, summed over resumes
    lr_scale: float = 1.0  # applied to the schedule's learning rate since the last divergence rollback
    rollbacks: int = 0  # divergence rollbacks so far (train.on_divergence = "rollback")

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str) -> TrainerState:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CorruptCheckpoint(f"{source}: unknown trainer state field {unknown[0]!r}")
        return cls(**{"mask_scheme": 1, **data})


# --------------------------------------------------------------------------------------------------
# save


def save_train_state(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    state: TrainerState,
    carry: Sequence[str | Path] = (),
) -> Path:
    """Write a complete training checkpoint at `directory` atomically; returns `directory`. The files of `carry` (the
    run's tokenizer) are copied into it and listed in its checksums too.

    The RNG states of this process (torch, CUDA, numpy, python) are captured now. An existing checkpoint at the
    same path (e.g. a damaged one being rewritten after a resume) is replaced whole.
    """
    final = Path(directory)
    try:
        needed = functools.partial(_checkpoint_bytes, model, optimizer, carry)
        with writing(final, extra=[Path(path).name for path in carry], needed=needed, step=state.step) as tmp:
            for path in carry:
                shutil.copyfile(path, tmp / Path(path).name)
            save_model(tmp, _unwrap(model))
            tensors, optimizer_json = _flatten_optimizer(optimizer)
            save_file(tensors, str(tmp / OPTIMIZER_FILE), metadata={"format": FORMAT})
            trainer = {
                "format": FORMAT,
                "version": VERSION,
                "step": state.step,  # also at the top level: readers that only want the step (services/eval)
                "state": dataclasses.asdict(state),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "optimizer": optimizer_json,
                "rng": _capture_rng(),
            }
            (tmp / TRAINER_FILE).write_bytes(_to_json(trainer, TRAINER_FILE).encode())
    except (OSError, SafetensorError) as err:  # a full disk is DiskFull (services.rundir.checkpoints.writing)
        raise OSError(f"{final}: checkpoint not saved, earlier checkpoints are untouched ({err})") from err
    return final


def _checkpoint_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, carry: Sequence[str | Path]) -> int:
    """About the bytes a checkpoint of this model and optimizer takes: its tensors and the files it carries."""
    moments = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    tensors = [*_unwrap(model).parameters(), *moments]
    return sum(t.numel() * t.element_size() for t in tensors) + sum(Path(p).stat().st_size for p in carry)


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DistributedDataParallel and friends hold the model in .module


def _flatten_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors keyed "<parameter name>.<state key>"; everything else (groups, scalar state) as JSON."""
    state_dict = optimizer.state_dict()
    names = _index_names(state_dict["param_groups"])
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, values in state_dict["state"].items():
        name = names[index]
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(name, {})[key] = value
    return tensors, {
        "class": type(optimizer).__name__,
        "param_groups": state_dict["param_groups"],
        "scalars": scalars,
    }


def _index_names(param_groups: list[dict[str, Any]]) -> dict[int, str]:
    """Parameter index -> name (the group's "param_names" when present, else "param<index>")."""
    names = {}
    for group in param_groups:
        group_names = group.get("param_names") or [f"param{i}" for i in group["params"]]
        names.update(zip(group["params"], group_names, strict=True))
    return names


def _capture_rng() -> dict[str, Any]:
    np_state = np.random.get_state()
    version, internal, gauss = random.getstate()
    rng: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "numpy": {
            "bit_generator": np_state[0],
            "keys": np_state[1].tolist(),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return rng


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _to_json(data: Any, what: str) -> str:
    def refuse(value: Any) -> Any:
        if isinstance(value, (np.integer, np.floating)):
            return value.item()
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value.item()
        raise TypeError(f"{what}: cannot store a {type(value).__name__} as JSON ({value!r:.80})")

    return json.dumps(data, indent=1, default=refuse) + "\n"


# --------------------------------------------------------------------------------------------------
# load


def load_train_state(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    *,
    restore_rng: bool = True,
) -> TrainerState:
    """Verify, then restore model weights, optimizer, scheduler, RNG states and dropout; returns the loop state."""
    directory = Path(directory)
    verify(directory)
    trainer = read_trainer_json(directory)
    state = TrainerState.from_dict(trainer["state"], source=str(directory / TRAINER_FILE))

    target = _unwrap(model)
    _, weights = read_checkpoint(directory)
    missing = load_weights(target, weights)
    if missing:
        raise CheckpointError(f"{directory / WEIGHTS_FILE}: lacks {len(missing)} model tensors, e.g. {missing[:3]}")

    _load_optimizer(directory, optimizer, trainer["optimizer"])
    if scheduler is not None:
        if trainer["scheduler"] is None:
            raise CheckpointError(f"{directory / TRAINER_FILE}: has no scheduler state but a scheduler was given")
        scheduler.load_state_dict(trainer["scheduler"])
    if restore_rng:
        _restore_rng(trainer["rng"])
    config = getattr(target, "config", None)
    if hasattr(target, "set_dropout") and getattr(config, "hidden_dropout_prob", state.dropout) != state.dropout:
        target.set_dropout(state.dropout)  # the run removed (or changed) dropout: every dropout takes its value
    return state


def _load_optimizer(directory: Path, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    path = directory / OPTIMIZER_FILE
    if saved["class"] != type(optimizer).__name__:
        raise CheckpointError(f"{path}: holds {saved['class']} state, the run uses {type(optimizer).__name__}")
    current = optimizer.state_dict()["param_groups"]
    saved_groups = saved["param_groups"]
    current_names = [g.get("param_names") or g["params"] for g in current]
    saved_names = [g.get("param_names") or g["params"] for g in saved_groups]
    if current_names != saved_names:
        raise CheckpointError(f"{path}: parameter groups differ from the optimizer's (different model or grouping)")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise CorruptCheckpoint(f"{path}: unreadable safetensors file ({err})") from None
    names = _index_names(saved_groups)
    index_of = {name: index for index, name in names.items()}
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        name, _, slot = key.rpartition(".")
        if name not in index_of:
            raise CheckpointError(f"{path}: state for unknown parameter {name!r}")
        state.setdefault(index_of[name], {})[slot] = tensor
    for name, values in saved["scalars"].items():
        if name not in index_of:
            raise CheckpointError(f"{directory / TRAINER_FILE}: optimizer state for unknown parameter {name!r}")
        state.setdefault(index_of[name], {}).update(values)
    groups = [_tuples(g) for g in saved_groups]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _tuples(group: dict[str, Any]) -> dict[str, Any]:
    """JSON turned tuples into lists; optimizers expect betas (and LAMB's trust_clip) as tuples."""
    group = dict(group)
    for key in ("betas", "trust_clip"):
        if isinstance(group.get(key), list):
            group[key] = tuple(group[key])
    return group


def _restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(_tensor_from_b64(rng["torch"]))
    if "cuda" in rng and torch.cuda.is_available():
        states = [_tensor_from_b64(s) for s in rng["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    n = rng["numpy"]
    np.random.set_state(
        (n["bit_generator"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    p = rng["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))


def _tensor_from_b64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()
