"""Fine-tuning jobs on Ray: one Ray Tune trial per seed (services.finetune.trials), the median over seeds,
ensembles, and `albert finetune`.

All the math lives in `albert_core.finetune.finetuning` (its config in `albert_core.finetune.config`); this module only
builds a config per seed, runs them as Tune trials (each on its own CPUs, torch limited to that many threads, run in
parallel as far as the cluster's resources allow), collects the results, and writes the summary:

    <output>/seed_<s>/    metrics.jsonl, result.json, predictions, outputs_<split>.npz   (one run)
    <output>/tune/        Ray Tune's experiment state (what a resume restores)
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

import contextlib
import dataclasses
import functools
import json
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from albert_core.files import atomic_write_json, atomic_write_text
from services.finetune.search import point_label
from services.finetune.trials import TUNE_DIR, run_trials

if TYPE_CHECKING:
    from albert_core.finetune.config import FinetuneConfig
    from albert_core.model.config import AlbertConfig

# torch and ray are imported where they are used: `albert --help` imports this module and stays instant.
# The same names as albert_core.finetune.config.TASKS (a test keeps them equal).
TASKS = (
    *("cola", "stsb", "sst2", "mnli", "qnli", "qqp", "rte", "mrpc", "wnli"),
    *("mnli-m", "mnli-mm", "squad1", "squad2", "race", "polarity", "custom"),
)
BASE_SEED = 12345
GLUE_SEEDS = 5  # GLUE dev results are the median of 5 runs
_RUN_FIELDS = frozenset({"task", "data_dir", "checkpoint", "seed", "overrides", "output_dir"})  # set per seed


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
    run_dir: Path  # the run's directory, or the recipe file (`albert finetune --preset RECIPE`)

    def describe(self, given: dict[str, str] | None = None) -> str:
        """What they set, but for `given` (field -> the option that set it here instead)."""
        given = given or {}
        used = ", ".join(f"{k} {v}" for k, v in self.overrides.items() if k not in given) or "none"
        ledger = "" if self.run_dir.is_file() else " in its ledger.json"
        where = f"{self.run_dir} ([finetune]{ledger})"
        line = f"fine-tuning defaults of the recipe of {where}: {used}"
        return line + (f" ({', '.join(given.values())} given instead)" if given else "")


def _finetune_overrides(config) -> dict[str, Any]:
    f = config.finetune
    return {k: v for k, v in (("lr", f.lr), ("max_steps", f.max_steps), ("pooling", f.pooling)) if v}


def preset_model(name: str, vocab_size: int) -> tuple[AlbertConfig, RecipeDefaults | None]:
    """`albert finetune --preset NAME`, random weights: a model preset (albert-tiny, albert-base, ...), or a
    recipe (a shipped one's name, e.g. tiny, or a .toml file): its [model] and its [finetune] defaults, so that a
    random-init baseline is the same model, fine-tuned alike, as the recipe's pretrained checkpoints."""
    from albert_core.model.config import PRESETS, AlbertConfig
    from services.rundir.config import RunConfig, resolve_config_path

    if name in PRESETS:
        return AlbertConfig.preset(name, vocab_size=vocab_size), None
    try:
        path = resolve_config_path(name)
    except ValueError as error:
        raise ValueError(f"--preset {name}: not a model preset ({', '.join(PRESETS)}) nor a recipe: {error}") from None
    recipe = RunConfig.load(path)
    overrides = _finetune_overrides(recipe)
    return recipe.model_config(vocab_size), RecipeDefaults(overrides, path) if overrides else None


def model_line(checkpoint: str | None, model: AlbertConfig | None, preset: str | None) -> str:
    """Which model an arm fine-tunes: "model: checkpoint DIR (H 64, 2 layers, rotary)" or "model: random init of
    recipe tiny (...)"."""
    from albert_core.model.checkpoint import read_architecture

    config = read_architecture(checkpoint).config if checkpoint is not None else model
    shape = f"H {config.hidden_size}, {config.num_hidden_layers} layers, {config.position_bias or 'absolute'} positions"
    source = f"checkpoint {checkpoint}" if checkpoint is not None else f"random init of --preset {preset}"
    return f"model: {source} ({shape})"


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
    overrides = _finetune_overrides(config)
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


def summarize(
    results: Sequence[dict[str, Any]],
    output_dir: str | Path | None = None,
    ensemble: dict[str, Any] | None = None,
    point: dict[str, Any] | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """median_of_seeds plus the markdown table (and the ensemble's scores); written to output_dir/summary.{json,md}.
    `point`: a sweep's best point (its searched settings), recorded and named in the title; `model`: which model
    the runs fine-tuned (model_line); "settings": the runs' recipe (lr, batch size, steps, ...) and pooling."""
    from albert_core.finetune.finetuning import json_safe, markdown_table, median_of_seeds

    summary = median_of_seeds(results)
    summary["table"] = markdown_table(summary)
    summary["test"] = [r["test"] for r in results] if any(r["test"] for r in results) else []
    if ensemble is not None:
        summary["ensemble"] = ensemble
    if point is not None:
        summary["point"] = point
    if model is not None:
        summary["model"] = model
    summary["settings"] = settings_line(results[0])
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        at = "" if point is None else f", best point {point_label(point)}"
        text = f"# {summary['task']}: dev, {summary['runs']} runs{at}\n\n{summary['table']}\n"
        text += "".join(f"\n{line}\n" for line in (summary.get("model"), summary["settings"]) if line)
        if ensemble is not None:
            text += f"\nensemble of {ensemble['runs']}: {json.dumps(json_safe(ensemble['dev']))}\n"
        atomic_write_text(out / "summary.md", text)
        atomic_write_json(out / "summary.json", json_safe(summary))
    return summary


def settings_line(result: dict[str, Any]) -> str:
    """ "settings: lr 0.001, batch_size 16, 300 steps (warmup 30), max_seq_length 128, adamw, pooling mean"."""
    h = result.get("hyperparams", {})
    if not h:
        return "settings: unknown"
    text = f"settings: lr {h['lr']:g}, batch_size {h['batch_size']}, {h['train_steps']} steps "
    text += f"(warmup {h['warmup_steps']}), max_seq_length {h['max_seq_length']}, {h['optimizer']}"
    return text + (f", pooling {result['pooling']}" if result.get("pooling") else "")


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
    address: str | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """Fine-tune `checkpoint` on `task` once per seed (Tune trials in parallel) and summarize. Run again on the same
    output_dir after a stop, it resumes: the finished seeds are reused ("reused": how many).

    Returns median_of_seeds' summary (task, metric, runs, seeds, median, per_seed) plus "table" (markdown),
    "test" (per-seed test metrics where labels are public), "results" (each run's result), "seconds", "reused"
    and, with ensemble=True (needs output_dir), "ensemble": the seeds' averaged outputs scored like one run.
    Without output_dir the runs write into a temporary folder, removed after.
    """
    from albert_core.finetune.config import canonical_task
    from albert_core.finetune.finetuning import score_ensemble

    task = canonical_task(task)
    if ensemble and output_dir is None:
        raise ValueError("run_downstream: ensemble=True needs output_dir (the runs' outputs are read from there)")
    started = time.time()
    with _folder(output_dir) as folder:
        configs = seed_configs(
            task,
            checkpoint,
            data_dir,
            seeds=default_seeds(task) if seeds is None else seeds,
            overrides=overrides,
            output_dir=folder,
        )
        run = functools.partial(run_trials, num_cpus=num_cpus, num_gpus=num_gpus, progress=progress)
        outcome = run(configs, folder / TUNE_DIR, address=address)
        results = [r for r in outcome.results if r is not None]
        scored = score_ensemble(configs[0], [c.output_dir for c in configs], folder / "ensemble") if ensemble else None
    summary = summarize(results, output_dir, scored, model=model)
    summary["results"] = results
    summary["seconds"] = time.time() - started
    summary["reused"] = outcome.reused
    return summary


@contextlib.contextmanager
def _folder(output_dir: str | Path | None) -> Iterator[Path]:
    """output_dir, or (None) a temporary folder removed after."""
    if output_dir is not None:
        yield Path(output_dir)
        return
    with tempfile.TemporaryDirectory(prefix="albert-finetune-") as tmp:
        yield Path(tmp)


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
