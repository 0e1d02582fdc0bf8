"""Fine-tuning jobs on Ray: one Ray task per seed, the median over seeds, ensembles, and `albert finetune`.

All the math lives in `albert_core.finetune.finetuning` (its config in `albert_core.finetune.config`); this module only
fans seeds out as Ray tasks (each on its own CPUs, torch limited to that many threads, run in parallel as far as the
cluster's resources allow), collects the results, and writes the summary:

    <output>/seed_<s>/    metrics.jsonl, result.json, predictions, outputs_<split>.npz   (one run)
    <output>/ensemble/    the ensemble's prediction files                                (with ensemble=True)
    <output>/summary.json median per metric, per-seed rows, ensemble metrics
    <output>/summary.md   the markdown table
    <output>/split.json   task "custom": the files, rows per split, how dev was chosen, the classes

`albert finetune` (services.finetune.cli) runs one seed in its own process, or several through `run_downstream`.

`run_downstream` is what evaluation calls for `eval.tasks`; `downstream_evaluator(task)` wraps it in the
(checkpoint_dir, data_dir) -> metrics form of `services.eval.evaluate.DOWNSTREAM_TASKS`.

A checkpoint of a pretraining run is fine-tuned with its recipe's defaults ([finetune]: lr, max_steps, pooling;
`recipe_defaults`) where the command does not give them, and the task's own recipe for the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from albert_core.files import atomic_write_json, atomic_write_text
from services.cluster import connect

if TYPE_CHECKING:
    from albert_core.finetune.config import FinetuneConfig

# torch and ray are imported where they are used: `albert --help` imports this module and stays instant.
# The same names as albert_core.finetune.config.TASKS (a test keeps them equal).
TASKS = (
    *("cola", "stsb", "sst2", "mnli", "qnli", "qqp", "rte", "mrpc", "wnli"),
    *("mnli-m", "mnli-mm", "squad1", "squad2", "race", "polarity", "custom"),
)
BASE_SEED = 12345
GLUE_SEEDS = 5  # GLUE dev results are the median of 5 runs
_RUN_FIELDS = frozenset({"task", "data_dir", "checkpoint", "seed", "overrides", "output_dir"})  # set per seed


class SeedsInterrupted(KeyboardInterrupt):
    """Ctrl-C while seeds run as Ray tasks; `results` are the runs that had finished (in config order)."""

    def __init__(self, results: list[dict[str, Any]]):
        super().__init__(f"{len(results)} run(s) had finished")
        self.results = results


def default_seeds(task: str) -> int:
    """5 runs for GLUE tasks (the paper's median), 1 for the others."""
    from albert_core.finetune.config import GLUE_FINETUNE_TASKS, canonical_task

    task = canonical_task(task)
    return GLUE_SEEDS if task in GLUE_FINETUNE_TASKS or task.startswith("mnli") else 1


def seed_list(seeds: int | Sequence[int]) -> list[int]:
    if isinstance(seeds, int):
        if seeds < 1:
            raise ValueError(f"seeds: expected a positive count or a list of seeds, got {seeds}")
        return [BASE_SEED + i for i in range(seeds)]
    seeds = [int(s) for s in seeds]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds: expected distinct seeds, got {seeds}")
    return seeds


@dataclass(frozen=True)
class RecipeDefaults:
    """The fine-tuning defaults of the recipe a checkpoint was pretrained with (its run's [finetune]), as
    seed_configs overrides (lr, max_steps, pooling), and the run directory whose config holds them."""

    overrides: dict[str, Any]
    run_dir: Path

    def describe(self, given: dict[str, str] | None = None) -> str:
        """What they set, but for `given` (field -> the option that set it here instead)."""
        given = given or {}
        used = ", ".join(f"{k} {v}" for k, v in self.overrides.items() if k not in given) or "none"
        line = f"fine-tuning defaults of the recipe of {self.run_dir} ([finetune] in its ledger.json): {used}"
        return line + (f" ({', '.join(given.values())} given instead)" if given else "")


def recipe_defaults(
    checkpoint: str | Path | None = None, *, run_dir: str | Path | None = None
) -> RecipeDefaults | None:
    """The fine-tuning defaults for a checkpoint of a pretraining run (runs/NAME/checkpoints/step_N), or for the
    checkpoints of `run_dir`: its recipe's [finetune] fields that are set; None when it names none or the checkpoint
    belongs to no run (a model directory elsewhere: the task's recipe)."""
    from services.rundir.resume import recorded_run_config, run_dir_of_checkpoint

    if run_dir is None:
        run_dir = run_dir_of_checkpoint(checkpoint) if checkpoint is not None else None
    config = recorded_run_config(run_dir) if run_dir is not None else None
    if config is None:
        return None
    f = config.finetune
    overrides = {k: v for k, v in (("lr", f.lr), ("max_steps", f.max_steps), ("pooling", f.pooling)) if v}
    return RecipeDefaults(overrides, Path(run_dir)) if overrides else None


def seed_configs(
    task: str,
    checkpoint: str | None,
    data_dir: str,
    *,
    seeds: int | Sequence[int],
    overrides: dict[str, Any] | None = None,
    output_dir: str | Path | None = None,
) -> list[FinetuneConfig]:
    """One FinetuneConfig per seed. `overrides` mixes TaskHyperparams fields (lr, batch_size, ...) and
    FinetuneConfig fields (max_steps, eval_every, patience, tokenizer, model, device, ...)."""
    from albert_core.finetune.config import FinetuneConfig, TaskHyperparams, canonical_task
    from albert_core.finetune.tasks.custom_splits import CustomDataConfig, split_files
    from albert_core.model.config import AlbertConfig

    hyper_fields = {f.name for f in dataclasses.fields(TaskHyperparams)}
    config_fields = {f.name for f in dataclasses.fields(FinetuneConfig)} - _RUN_FIELDS
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - hyper_fields - config_fields)
    if unknown:
        raise ValueError(
            f"overrides: unknown key {unknown[0]!r}; expected a hyperparameter "
            f"({', '.join(sorted(hyper_fields))}) or a FinetuneConfig field ({', '.join(sorted(config_fields))})"
        )
    hyper = {k: v for k, v in overrides.items() if k in hyper_fields}
    fields = {k: v for k, v in overrides.items() if k in config_fields}
    if isinstance(fields.get("model"), dict):
        fields["model"] = AlbertConfig.from_dict(fields["model"])
    if isinstance(fields.get("custom"), dict):
        fields["custom"] = CustomDataConfig(**fields["custom"])
    if canonical_task(task) == "custom" and fields.get("custom") is None:  # data_dir: train.csv, dev.csv, ...
        fields["custom"] = CustomDataConfig(**split_files(data_dir))
    return [
        FinetuneConfig(
            task=task,
            data_dir=str(data_dir),
            checkpoint=checkpoint,
            seed=seed,
            overrides=dict(hyper),
            output_dir=None if output_dir is None else str(Path(output_dir) / f"seed_{seed}"),
            **fields,
        )
        for seed in seed_list(seeds)
    ]


def _finetune_in_worker(config: FinetuneConfig, num_threads: int) -> dict[str, Any]:
    import torch

    from albert_core.finetune.finetuning import finetune

    torch.set_num_threads(max(1, num_threads))
    return finetune(config)


@functools.cache
def _finetune_task():
    import ray

    return ray.remote(_finetune_in_worker)


def run_seeds(
    configs: Sequence[FinetuneConfig],
    *,
    num_cpus: float = 1,
    num_gpus: float = 0,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Run each config as a Ray task of num_cpus CPUs (and num_gpus GPUs); results in config order.

    With progress, a bar over the runs and a line per finished run. Ctrl-C cancels the runs still going and raises
    SeedsInterrupted with the finished ones.
    """
    import ray

    from services.finetune.console import seed_line

    connect()
    task = _finetune_task().options(num_cpus=num_cpus, num_gpus=num_gpus)
    pending = {task.remote(config, int(max(1, num_cpus))): i for i, config in enumerate(configs)}
    results: list[dict[str, Any] | None] = [None] * len(configs)
    bar = _bar(len(configs), progress)
    waiting = list(pending)
    try:
        while waiting:
            done, waiting = ray.wait(waiting, num_returns=1)
            for ref in done:
                result = ray.get(ref)
                results[pending[ref]] = result
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix({result["metric"]: f"{result['dev'][result['metric']]:.4f}"})
                    bar.write(seed_line(result, sum(r is not None for r in results), len(configs)))
    except KeyboardInterrupt:
        for ref in waiting:
            _cancel(ray, ref)
        raise SeedsInterrupted([r for r in results if r is not None]) from None
    finally:
        if bar is not None:
            bar.close()
    return results  # type: ignore[return-value]


def _cancel(ray, ref) -> None:
    """Stop an unfinished seed now (force: its worker process goes, and with it the CPU it holds); what it had
    evaluated so far is in its metrics.jsonl."""
    try:
        ray.cancel(ref, force=True)
    except Exception:  # already finished, or the cluster is going away: nothing left to stop
        pass


def _bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="seeds", unit="run")


def summarize(
    results: Sequence[dict[str, Any]],
    output_dir: str | Path | None = None,
    ensemble: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """median_of_seeds plus the markdown table (and the ensemble's scores); written to output_dir/summary.{json,md}."""
    from albert_core.finetune.finetuning import json_safe, markdown_table, median_of_seeds

    summary = median_of_seeds(results)
    summary["table"] = markdown_table(summary)
    summary["test"] = [r["test"] for r in results] if any(r["test"] for r in results) else []
    if ensemble is not None:
        summary["ensemble"] = ensemble
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        text = f"# {summary['task']}: dev, {summary['runs']} runs\n\n{summary['table']}\n"
        if ensemble is not None:
            text += f"\nensemble of {ensemble['runs']}: {json.dumps(json_safe(ensemble['dev']))}\n"
        atomic_write_text(out / "summary.md", text)
        atomic_write_json(out / "summary.json", json_safe(summary))
    return summary


def run_downstream(
    task: str,
    checkpoint: str | None,
    data_dir: str,
    *,
    seeds: int | Sequence[int] | None = None,
    overrides: dict[str, Any] | None = None,
    output_dir: str | Path | None = None,
    ensemble: bool = False,
    num_cpus: float = 1,
    num_gpus: float = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """Fine-tune `checkpoint` on `task` once per seed (Ray tasks in parallel) and summarize.

    Returns median_of_seeds' summary (task, metric, runs, seeds, median, per_seed) plus "table" (markdown),
    "test" (per-seed test metrics where labels are public), "results" (each run's result), "seconds" and, with
    ensemble=True (needs output_dir), "ensemble": the seeds' averaged outputs scored like one run.
    """
    from albert_core.finetune.config import canonical_task
    from albert_core.finetune.finetuning import score_ensemble

    task = canonical_task(task)
    if ensemble and output_dir is None:
        raise ValueError("run_downstream: ensemble=True needs output_dir (the runs' outputs are read from there)")
    configs = seed_configs(
        task,
        checkpoint,
        data_dir,
        seeds=default_seeds(task) if seeds is None else seeds,
        overrides=overrides,
        output_dir=output_dir,
    )
    started = time.time()
    results = run_seeds(configs, num_cpus=num_cpus, num_gpus=num_gpus, progress=progress)
    scored = None
    if ensemble:
        run_dirs = [c.output_dir for c in configs]
        scored = score_ensemble(configs[0], run_dirs, Path(output_dir) / "ensemble")
    summary = summarize(results, output_dir, scored)
    summary["results"] = results
    summary["seconds"] = time.time() - started
    return summary


def downstream_evaluator(
    task: str, *, seeds: int | Sequence[int] | None = None, overrides: dict[str, Any] | None = None, **kwargs: Any
) -> Callable[[str, str], dict[str, Any]]:
    """(checkpoint_dir, data_dir) -> {median metrics..., "runs": n}: the form services.eval.evaluate's registry takes
    (register_finetune_tasks puts one there per task). kwargs go to run_downstream."""

    def evaluate(checkpoint_dir: str, data_dir: str) -> dict[str, Any]:
        summary = run_downstream(task, checkpoint_dir, data_dir, seeds=seeds, overrides=overrides, **kwargs)
        return {**summary["median"], "runs": summary["runs"]}

    evaluate.__name__ = f"finetune_{task.strip().lower().replace('-', '_')}"
    return evaluate


# --- CLI handler (services.cli builds the parser; the options of --task custom are added here) ----------------
