"""The run coordinator: one named Ray actor per run that keeps the run's record and decides what happens to its
checkpoints.

It owns three files in the run directory:

- `metrics.jsonl`: one JSON object per line with "step", "time" and "kind" ("train": what the train loop reported;
  "event": dropout changes, checkpoints saved / refused / deleted, evaluation failures; "eval": held-out metrics);
- `eval.md`: the evaluations as a markdown table, rewritten whole after each result;
- `coordinator.json`: its state (checkpoint index, evaluations, step, dropout), written atomically after every
  change, so a restarted coordinator (`max_restarts=-1`) carries on where the last one stopped. Lines that reached
  metrics.jsonl before a crash but not the state are reconciled on start: the last train step and finished
  evaluations are read back, and a half-written last line is cut off.

Checkpoints are verified against their MANIFEST.json (sha256 and size of every file) before they are indexed.
Retention keeps the last `train.keep_last` checkpoints, the best by held-out MLM accuracy, and any checkpoint an
evaluation is still running on; the rest are deleted from disk. Evaluations run in `IntrinsicEvaluator` actors
launched without blocking; results are collected on every later call, in `poll()` and in `wait_for_evals()`. An
evaluator that dies is relaunched up to MAX_EVAL_RETRIES times; one that raises is recorded as failed. Neither
touches training.
"""

from __future__ import annotations

import json
import math
import operator
import shutil
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from albert_core.files import CorruptCheckpoint, atomic_write_bytes, verify_manifest
from albert_core.shards import HELDOUT_FILE
from services.eval import IntrinsicEvaluator, IntrinsicOptions, check_tasks, options_dict
from services.run_config import RunConfig

NAMESPACE = "albert"
STATE_FILE = "coordinator.json"
METRICS_FILE = "metrics.jsonl"
EVAL_TABLE_FILE = "eval.md"
REQUIRED_CHECKPOINT_FILES = ("config.json", "model.safetensors")
MAX_EVAL_RETRIES = 2  # relaunches of an evaluator that died
STATE_VERSION = 1
EVAL_COLUMNS = ("mlm_acc", "mlm_loss", "sop_acc", "nsp_acc")
_RESERVED_KEYS = ("kind", "time")


def coordinator_name(run_name: str) -> str:
    return f"albert-coordinator:{run_name}"


def evaluator_name(run_name: str, step: int, launch: int) -> str:
    """Name of the evaluator actor for one launch of one step's evaluation (namespace "albert")."""
    return f"albert-eval:{run_name}:{step}:{launch}"


# --- checkpoint verification -----------------------------------------------------------------------------------


def verify_checkpoint(directory: str | Path) -> dict[str, Any]:
    """The checkpoint's MANIFEST.json checks out and lists the model files evaluation loads."""
    return verify_manifest(directory, REQUIRED_CHECKPOINT_FILES)


# --- the actor -------------------------------------------------------------------------------------------------


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Coordinator:
    def __init__(
        self,
        run_dir: str,
        run_name: str,
        config_dict: dict[str, Any],
        heldout_path: str,
        evaluator_options: dict[str, Any] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_name = run_name
        self.config = RunConfig.from_dict(config_dict, source="coordinator config")
        self.heldout_path = heldout_path
        self.intrinsic = IntrinsicOptions.from_run_config(self.config)
        e = self.config.eval
        self.downstream = {
            "tasks": list(e.tasks),
            "task_data": dict(e.task_data),
            "seeds": e.task_seeds,
            "max_steps": e.task_max_steps,
        }
        self.evaluator_options = {"num_cpus": 1, **(evaluator_options or {})}
        self.state = self._load_state(config_dict)
        self._running: dict[int, tuple[ray.ObjectRef, Any]] = {}  # step -> (result ref, evaluator actor)
        self._reconcile_metrics_log()
        for entry in self.state["evals"]:
            if entry["status"] == "pending":  # its evaluator died with the previous coordinator
                self._launch(entry)
        self._save()

    # --- the train loop's calls ---

    def report(self, step: int, metrics: dict[str, Any]) -> None:
        """Append a train line; note dropout changes. Idempotent for a retried call (same step and metrics)."""
        self._collect()
        step = _check_step(step)
        if not isinstance(metrics, dict):
            raise ValueError(f"report(step={step}): metrics must be a dict, got {type(metrics).__name__}")
        metrics = _plain(metrics)
        reserved = [key for key in _RESERVED_KEYS if key in metrics]
        if reserved:
            raise ValueError(f"report(step={step}): metrics key {reserved[0]!r} is reserved for the metrics log")
        if metrics.get("step", step) != step:
            raise ValueError(f"report(step={step}): metrics carry a different step ({metrics['step']})")
        metrics.pop("step", None)
        last = self.state["last_train"]
        if last is not None and last["step"] == step and last["metrics"] == metrics:
            return
        if last is not None and step <= last["step"]:  # training resumed from an earlier checkpoint
            dropped = self._drop_train_lines_from(step)
            self._event(step, "resumed", previous_step=last["step"], train_lines_dropped=dropped)
        self._append({"step": step, "time": time.time(), "kind": "train", **metrics})
        self.state["last_train"] = {"step": step, "metrics": metrics}
        self.state["step"] = step
        self._note_dropout(step, metrics)
        self._save()

    def checkpoint_saved(
        self, step: int, path: str, metrics: dict[str, Any] | None = None, *, final: bool = False
    ) -> dict[str, Any]:
        """Verify, index, schedule an evaluation when one is due, apply retention.

        Returns {"accepted", "reason" (when refused), "eval_scheduled", "deleted": [paths]}. The run's last
        checkpoint (step >= optim.total_steps, or `final=True` for a run stopped early) is evaluated even off the
        every_steps schedule.
        """
        self._collect()
        step = _check_step(step)
        path = str(Path(path).resolve())
        known = self._checkpoint(step)
        if known is not None and known["path"] == path:  # a retried call
            return {"accepted": True, "eval_scheduled": self._eval(step) is not None, "deleted": []}
        try:
            verify_checkpoint(path)
        except CorruptCheckpoint as err:
            self.state["refused"].append({"step": step, "path": path, "reason": str(err), "time": time.time()})
            self._event(step, "checkpoint_refused", path=path, reason=str(err))
            self._save()
            return {"accepted": False, "reason": str(err), "eval_scheduled": False, "deleted": []}
        if known is not None:  # the same step saved again elsewhere (a resumed run): the new one replaces it
            self.state["checkpoints"].remove(known)
            self._event(step, "checkpoint_replaced", path=path, previous_path=known["path"])
        entry = {"step": step, "path": path, "metrics": _plain(metrics or {}), "time": time.time()}
        self.state["checkpoints"].append(entry)
        self.state["checkpoints"].sort(key=lambda c: c["step"])
        self._event(step, "checkpoint_saved", path=path)
        scheduled = self._eval_due(step, final)
        if scheduled:
            self._schedule_eval(step, path)
        deleted = self._apply_retention()
        self._save()
        return {"accepted": True, "eval_scheduled": scheduled, "deleted": deleted}

    def latest_good_checkpoint(self) -> str | None:
        """The newest indexed checkpoint that still matches its manifest; corrupt ones are dropped from the index."""
        self._collect()
        for entry in sorted(self.state["checkpoints"], key=lambda c: c["step"], reverse=True):
            try:
                verify_checkpoint(entry["path"])
                return entry["path"]
            except CorruptCheckpoint as err:
                self.state["checkpoints"].remove(entry)
                self.state["refused"].append({**entry, "reason": str(err), "time": time.time()})
                self._event(entry["step"], "checkpoint_corrupt", path=entry["path"], reason=str(err))
                self._save()
        return None

    # --- evaluations ---

    def poll(self) -> dict[str, int]:
        """Collect finished evaluations; returns the counts of pending / done / failed ones."""
        self._collect()
        return self._eval_counts()

    def wait_for_evals(self, timeout: float | None = None) -> dict[str, int]:
        """Block until no evaluation is pending (or `timeout` seconds pass); returns the counts."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._collect()
        while self._running:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            refs = [ref for ref, _ in self._running.values()]
            ray.wait(refs, num_returns=1, timeout=remaining)
            self._collect()
        return self._eval_counts()

    # --- reading ---

    def status(self) -> dict[str, Any]:
        self._collect()
        return status_from_state(self.state, live=True)

    # --- internals: evaluations ---

    def _eval_due(self, step: int, final: bool) -> bool:
        existing = self._eval(step)
        if existing is not None and existing["status"] in ("pending", "done"):
            return False
        every = self.config.eval.every_steps
        last = self.state["last_eval_scheduled"]
        on_schedule = every > 0 and step // every > (last if last is not None else 0) // every
        return on_schedule or final or step >= self.config.optim.total_steps

    def _schedule_eval(self, step: int, path: str) -> None:
        entry = self._eval(step)
        if entry is None:
            entry = {"step": step, "path": path, "launches": 0, "deaths": 0}
            self.state["evals"].append(entry)
        entry.update(status="pending", path=path, metrics=None, error=None)
        last = self.state["last_eval_scheduled"]
        self.state["last_eval_scheduled"] = step if last is None else max(last, step)
        self._launch(entry)

    def _launch(self, entry: dict[str, Any]) -> None:
        step = entry["step"]
        entry["launches"] += 1
        try:
            evaluator = IntrinsicEvaluator.options(
                name=evaluator_name(self.run_name, step, entry["launches"]),
                namespace=NAMESPACE,
                max_restarts=0,
                **self.evaluator_options,
            ).remote(self.heldout_path, options_dict(self.intrinsic), None, self.downstream)
            self._running[step] = (evaluator.evaluate.remote(entry["path"], step), evaluator)
        except (RayError, ValueError) as err:  # e.g. a name still held by a dead evaluator
            self._finish_failed(entry, f"could not launch an evaluator: {err}")

    def _collect(self) -> None:
        """Record every finished evaluation; relaunch evaluators that died, up to MAX_EVAL_RETRIES times."""
        if not self._running:
            return
        refs = {ref: step for step, (ref, _) in self._running.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        changed = False
        for ref in ready:
            step = refs[ref]
            _, evaluator = self._running.pop(step)
            entry = self._eval(step)
            try:
                result = ray.get(ref, timeout=0)
            except RayTaskError as err:  # the evaluation raised: retrying would raise again
                self._finish_failed(entry, _error_summary(err))
            except (RayActorError, RayError, GetTimeoutError) as err:  # the evaluator died
                entry["deaths"] += 1
                if entry["deaths"] <= MAX_EVAL_RETRIES:
                    self._event(step, "eval_retried", deaths=entry["deaths"], reason=_error_summary(err))
                    self._launch(entry)
                else:
                    self._finish_failed(entry, f"evaluator died {entry['deaths']} times: {_error_summary(err)}")
            else:
                self._finish_done(entry, result)
            ray.kill(evaluator, no_restart=True)
            changed = True
        if changed:
            self._apply_retention()
            self._write_eval_table()
            self._save()

    def _finish_done(self, entry: dict[str, Any], result: dict[str, Any]) -> None:
        metrics = {k: v for k, v in _plain(result).items() if k not in ("step", "checkpoint", "time")}
        entry.update(status="done", metrics=metrics, error=None)
        self._append(
            {"step": entry["step"], "time": time.time(), "kind": "eval", "checkpoint": entry["path"], **metrics}
        )

    def _finish_failed(self, entry: dict[str, Any], error: str) -> None:
        entry.update(status="failed", error=error)
        self._event(entry["step"], "eval_failed", path=entry["path"], reason=error)

    def _eval(self, step: int) -> dict[str, Any] | None:
        return next((e for e in self.state["evals"] if e["step"] == step), None)

    def _eval_counts(self) -> dict[str, int]:
        counts = {"pending": 0, "done": 0, "failed": 0}
        for entry in self.state["evals"]:
            counts[entry["status"]] += 1
        return counts

    # --- internals: checkpoints ---

    def _checkpoint(self, step: int) -> dict[str, Any] | None:
        return next((c for c in self.state["checkpoints"] if c["step"] == step), None)

    def _apply_retention(self) -> list[str]:
        """Delete checkpoints that are not among the last keep_last, not the best evaluated, not being evaluated."""
        checkpoints = self.state["checkpoints"]
        keep = {c["step"] for c in checkpoints[-self.config.train.keep_last :]}
        best = best_evaluation(self.state)
        if best is not None:
            keep.add(best["step"])
        keep |= {e["step"] for e in self.state["evals"] if e["status"] == "pending"}
        deleted = []
        for entry in [c for c in checkpoints if c["step"] not in keep]:
            path = Path(entry["path"])
            if self.run_dir.resolve().is_relative_to(path):  # never the run directory or a parent of it
                self._event(
                    entry["step"], "checkpoint_not_deleted", path=str(path), reason="contains the run directory"
                )
                continue
            try:
                shutil.rmtree(path)
            except FileNotFoundError:
                pass
            except OSError as err:
                self._event(entry["step"], "checkpoint_delete_failed", path=str(path), reason=str(err))
                continue
            checkpoints.remove(entry)
            deleted.append(str(path))
            self._event(entry["step"], "checkpoint_deleted", path=str(path))
        return deleted

    # --- internals: dropout ---

    def _note_dropout(self, step: int, metrics: dict[str, Any]) -> None:
        dropout = self.state["dropout"]
        if "dropout" in metrics:  # the train loop says what it runs with
            p = float(metrics["dropout"])
            if dropout["p"] is not None and p != dropout["p"]:
                event = "dropout_removed" if p == 0 else "dropout_changed"
                self._event(step, event, previous=dropout["p"], dropout=p)
                if p == 0:
                    dropout["removed_at"] = step
            dropout["p"] = p
        elif dropout["removal_step"] and dropout["removed_at"] is None and step >= dropout["removal_step"]:
            dropout["removed_at"] = dropout["removal_step"]
            self._event(dropout["removal_step"], "dropout_removed", previous=dropout["p"], dropout=0.0)
            dropout["p"] = 0.0

    # --- internals: files ---

    def _load_state(self, config_dict: dict[str, Any]) -> dict[str, Any]:
        path = self.run_dir / STATE_FILE
        if path.is_file():
            try:
                state = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}: not valid JSON ({err}); it is written atomically, so it was edited"
                ) from None
            if state.get("version") != STATE_VERSION:
                raise ValueError(f"{path}: state version {state.get('version')!r}, expected {STATE_VERSION}")
            return state
        model = self.config.model_config(vocab_size=30000)
        return {
            "version": STATE_VERSION,
            "run_name": self.run_name,
            "run_dir": str(self.run_dir),
            "config": config_dict,
            "started": time.time(),
            "step": 0,
            "last_train": None,  # {"step", "metrics"} of the last train line
            "dropout": {
                "p": model.hidden_dropout_prob,
                "removal_step": self.config.train.dropout_removal_step,
                "removed_at": None,
            },
            "checkpoints": [],  # {"step", "path", "metrics", "time"}, by step; only those on disk
            "refused": [],  # {"step", "path", "reason", "time"}
            "evals": [],  # {"step", "path", "status": pending|done|failed, "metrics", "error", "launches", "deaths"}
            "last_eval_scheduled": None,
        }

    def _reconcile_metrics_log(self) -> None:
        """Take back what reached metrics.jsonl after the last state write; cut a half-written last line."""
        path = self.run_dir / METRICS_FILE
        if not path.is_file():
            return
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            with open(path, "r+b") as f:
                f.truncate(keep)
            dropped = len(data) - keep
            data = data[:keep]
            self._event(self.state["step"], "metrics_log_repaired", dropped_bytes=dropped)
        for line in data.decode().splitlines():
            record = json.loads(line)
            if record.get("kind") == "train":
                metrics = {k: v for k, v in record.items() if k not in ("step", "time", "kind")}
                self.state["last_train"] = {"step": record["step"], "metrics": metrics}
                self.state["step"] = record["step"]
            elif record.get("kind") == "eval":
                entry = self._eval(record["step"])
                if entry is not None and entry["status"] == "pending":
                    metrics = {k: v for k, v in record.items() if k not in ("step", "time", "kind", "checkpoint")}
                    entry.update(status="done", metrics=metrics, error=None)

    def _drop_train_lines_from(self, step: int) -> int:
        """Rewrite metrics.jsonl without the train lines at or past `step` (a resumed run reports them again)."""
        path = self.run_dir / METRICS_FILE
        lines = path.read_text().splitlines(keepends=True) if path.is_file() else []
        records = [json.loads(line) for line in lines]
        kept = [line for line, r in zip(lines, records, strict=True) if r["kind"] != "train" or r["step"] < step]
        atomic_write_bytes(path, "".join(kept).encode())
        return len(lines) - len(kept)

    def _append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, allow_nan=True) + "\n"
        with open(self.run_dir / METRICS_FILE, "a") as f:
            f.write(line)
            f.flush()

    def _event(self, step: int, event: str, **fields: Any) -> None:
        self._append({"step": step, "time": time.time(), "kind": "event", "event": event, **fields})

    def _save(self) -> None:
        atomic_write_bytes(self.run_dir / STATE_FILE, (json.dumps(self.state, indent=1) + "\n").encode())

    def _write_eval_table(self) -> None:
        atomic_write_bytes(self.run_dir / EVAL_TABLE_FILE, eval_table(self.state).encode())


# --- reading a run without the actor ---------------------------------------------------------------------------


def best_evaluation(state: dict[str, Any]) -> dict[str, Any] | None:
    """The finished evaluation of an indexed checkpoint with the highest held-out MLM accuracy (later step on ties)."""
    indexed = {(c["step"], c["path"]) for c in state["checkpoints"]}
    done = [
        e
        for e in state["evals"]
        if e["status"] == "done" and (e["step"], e["path"]) in indexed and _finite(e["metrics"].get("mlm_acc"))
    ]
    return max(done, key=lambda e: (e["metrics"]["mlm_acc"], e["step"]), default=None)


def status_from_state(state: dict[str, Any], *, live: bool) -> dict[str, Any]:
    evals = {
        status: [e["step"] for e in state["evals"] if e["status"] == status] for status in ("pending", "done", "failed")
    }
    metrics_of = {e["step"]: e["metrics"] for e in state["evals"] if e["status"] == "done"}
    best = best_evaluation(state)
    last = state["last_train"]
    return {
        "run_name": state["run_name"],
        "run_dir": state["run_dir"],
        "live": live,
        "step": state["step"],
        "last_metrics": last["metrics"] if last else {},
        "dropout": dict(state["dropout"]),
        "checkpoints": [
            {"step": c["step"], "path": c["path"], "eval": metrics_of.get(c["step"])} for c in state["checkpoints"]
        ],
        "best_checkpoint": best["path"] if best else None,
        "evals": evals,
        "refused": [{"step": r["step"], "path": r["path"], "reason": r["reason"]} for r in state["refused"]],
    }


def read_status(run_dir: str | Path) -> dict[str, Any]:
    """A run's status from `<run_dir>/coordinator.json`, for when its coordinator is gone ("live": False)."""
    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no coordinator state; is {run_dir} a run directory?")
    return status_from_state(json.loads(path.read_text()), live=False)


def run_status(run_dir: str | Path, run_name: str, *, timeout: float = 30.0) -> dict[str, Any]:
    """`albert status RUN`: the live coordinator's status, or the saved one when it is gone (Ray must be up)."""
    try:
        actor = ray.get_actor(coordinator_name(run_name), namespace=NAMESPACE)
    except ValueError:
        return read_status(run_dir)
    try:
        return ray.get(actor.status.remote(), timeout=timeout)
    except (RayActorError, GetTimeoutError):
        return read_status(run_dir)


def eval_table(state: dict[str, Any]) -> str:
    lines = [
        "| step | " + " | ".join(EVAL_COLUMNS) + " | checkpoint |",
        "|---:|" + "---:|" * len(EVAL_COLUMNS) + "---|",
    ]
    for entry in sorted(state["evals"], key=lambda e: e["step"]):
        if entry["status"] == "done":
            cells = [_cell(entry["metrics"].get(name)) for name in EVAL_COLUMNS]
        elif entry["status"] == "failed":
            cells = ["failed"] + [""] * (len(EVAL_COLUMNS) - 1)
        else:
            continue
        lines.append(f"| {entry['step']} | " + " | ".join(cells) + f" | {Path(entry['path']).name} |")
    return "\n".join(lines) + "\n"


# --- getting the actor -----------------------------------------------------------------------------------------


def get_or_create_coordinator(
    run_dir: str | Path,
    run_name: str,
    config_dict: dict[str, Any],
    *,
    lifetime: str | None = None,
    evaluator_options: dict[str, Any] | None = None,
):
    """The run's coordinator actor: the live one if it exists, else a new one (which resumes coordinator.json).

    Checks on the driver what would make the actor fail later: the config, the held-out file evaluation reads
    (`<data.shards>/heldout/documents.parquet`) and the downstream tasks. `lifetime="detached"` outlives the driver.
    """
    config = RunConfig.from_dict(config_dict, source="run config")
    check_tasks(config.eval.tasks, config.eval.task_data)
    heldout = (Path(config.data.shards) / HELDOUT_FILE).resolve()
    if not heldout.is_file():
        raise FileNotFoundError(
            f"data.shards: {heldout} not found; evaluation reads held-out documents from <shards>/{HELDOUT_FILE}"
        )
    return Coordinator.options(
        name=coordinator_name(run_name), namespace=NAMESPACE, get_if_exists=True, lifetime=lifetime
    ).remote(str(Path(run_dir).resolve()), run_name, config_dict, str(heldout), evaluator_options)


# --- helpers ---------------------------------------------------------------------------------------------------


def _check_step(step: Any) -> int:
    if isinstance(step, bool):
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    try:
        step = operator.index(step)  # int and numpy integers; not floats
    except TypeError:
        raise ValueError(f"step must be a non-negative integer, got {step!r}") from None
    if step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step}")
    return step


def _plain(value: Any) -> Any:
    """JSON-ready copy: numpy / torch scalars become Python numbers, keys become strings."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    if hasattr(value, "item"):
        return value.item()
    raise ValueError(f"metrics value {value!r} ({type(value).__name__}) is not a number, string, list or dict")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _cell(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value if value is not None else "")


def _error_summary(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[-1] if text else type(err).__name__
