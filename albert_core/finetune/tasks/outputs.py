"""A model's raw outputs on one split of a downstream task (saved as .npz), and ensembles of several models'."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from albert_core.files import atomic_write_bytes


@dataclass
class TaskOutputs:
    """A model's raw outputs on one split: rows named by `ids` (example / window ids), float arrays by name.

    GLUE: "logits" (N, labels); SQuAD: "start_logits", "end_logits" (N windows, T), "answerable_logits" (N,);
    RACE: "logits" (N, 4). Saved as .npz so runs in other processes can be ensembled.
    """

    task: str
    split: str
    ids: list[str]
    arrays: dict[str, np.ndarray]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"__task__": np.array(self.task), "__split__": np.array(self.split), "__ids__": np.array(self.ids)}
        data = io.BytesIO()
        np.savez(data, **meta, **self.arrays)
        atomic_write_bytes(path, data.getvalue())
        return path

    @classmethod
    def load(cls, path: str | Path) -> TaskOutputs:
        with np.load(path, allow_pickle=False) as data:
            missing = [k for k in ("__task__", "__split__", "__ids__") if k not in data.files]
            if missing:
                raise ValueError(f"{path}: not a TaskOutputs file (no {missing[0]})")
            arrays = {k: data[k] for k in data.files if not k.startswith("__")}
            return cls(str(data["__task__"]), str(data["__split__"]), [str(i) for i in data["__ids__"]], arrays)


def ensemble(outputs: Sequence[TaskOutputs]) -> TaskOutputs:
    """The element-wise mean of several models' outputs on the same rows (logits / scores averaged)."""
    if not outputs:
        raise ValueError("ensemble: no outputs to average")
    first = outputs[0]
    for i, other in enumerate(outputs[1:], start=1):
        if (other.task, other.split) != (first.task, first.split):
            raise ValueError(
                f"ensemble: outputs[{i}] is {other.task}/{other.split}, outputs[0] is {first.task}/{first.split}"
            )
        if other.ids != first.ids:
            raise ValueError(f"ensemble: outputs[{i}] has different rows (ids) than outputs[0]")
        if set(other.arrays) != set(first.arrays):
            raise ValueError(
                f"ensemble: outputs[{i}] has arrays {sorted(other.arrays)}, expected {sorted(first.arrays)}"
            )
        for name, array in other.arrays.items():
            if array.shape != first.arrays[name].shape:
                raise ValueError(
                    f"ensemble: outputs[{i}].{name} has shape {array.shape}, expected {first.arrays[name].shape}"
                )
    arrays = {
        name: np.mean([o.arrays[name].astype(np.float64) for o in outputs], axis=0).astype(np.float32)
        for name in first.arrays
    }
    return TaskOutputs(first.task, first.split, list(first.ids), arrays)
