"""`albert finetune`: its flags and handler. One run in this process (a step progress bar), or seeds as Ray Tune
trials (services.finetune.seeds, services.finetune.trials), or with --search a sweep of points x seeds
(services.finetune.sweep); each seed's line and the summary table (services.finetune.console); after Ctrl-C the
partial summary and exit status 130, and the same command resumes. For `--task custom` the user's tables are read and
checked before Ray starts (albert_core.finetune.tasks.custom_splits), as a --search is (services.finetune.search)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from albert_core.files import atomic_write_json, atomic_write_text
from services.finetune.search import SEARCHABLE, Grid, check_size, parse_search, searchable
from services.finetune.seeds import (
    BASE_SEED,
    TASKS,
    RecipeDefaults,
    default_seeds,
    model_line,
    preset_model,
    recipe_defaults,
    run_downstream,
    seed_configs,
    summarize,
)
from services.finetune.trials import EARLY_STOPS, TUNE_DIR, reused_line
from services.terminal import EXIT_INTERRUPTED, UsageError, interrupted_line, interrupted_status, printable

if TYPE_CHECKING:
    from argparse import Namespace


INTERRUPTED_EXIT = EXIT_INTERRUPTED  # the shell's code for a command ended by SIGINT (128 + 2)


def add_custom_data_arguments(parser) -> None:
    """`albert finetune --task custom`: the user's own table files and their columns (an argument group)."""
    group = parser.add_argument_group(
        "your own data (--task custom)",
        "classification (any number of classes) or regression on single texts or text pairs, from CSV, TSV, "
        "JSONL/JSON or Parquet files with named columns",
    )
    group.add_argument("--train", help="the training table (.csv, .tsv, .jsonl, .json, .parquet)")
    group.add_argument("--dev", help="the dev table (default: --dev-fraction of --train held out)")
    group.add_argument("--test", help="a table to predict (predictions_test.csv); scored if it has the label column")
    group.add_argument("--text-column", default="text", help="the text column (default: text)")
    group.add_argument("--text-pair-column", help="the second text of a pair (default: single texts)")
    group.add_argument("--label-column", default="label", help="the label column (default: label)")
    group.add_argument("--id-column", help="names rows in the prediction files (default: the row's index)")
    group.add_argument("--regression", action="store_true", help="labels are numbers to predict (Pearson/Spearman)")
    group.add_argument("--dev-fraction", type=float, default=0.1, help="held out of --train without --dev (0.1)")
    group.add_argument("--split-seed", type=int, help="seed of that held-out draw (default 12345; not --seed)")
    group.add_argument(
        "--raw-csv",
        action="store_true",
        help="write prediction cells as given (default: a cell a spreadsheet would run as a formula gets a leading ')",
    )


_CUSTOM_FLAGS = ("train", "dev", "test", "text_pair_column", "id_column", "split_seed")


def _task_data(args: Namespace, task: str, overrides: dict[str, Any], output: Path) -> str:
    """The data argument of the configs. For --task custom (--train/--dev/--test, or --data: a folder holding
    train.csv, dev.csv, test.csv in any table format) the files are read and checked here, before Ray starts, the
    split written to output/split.json and the CustomDataConfig put into `overrides`."""
    given = [f"--{k.replace('_', '-')}" for k in _CUSTOM_FLAGS if getattr(args, k, None) is not None]
    given += ["--regression"] if getattr(args, "regression", False) else []
    given += ["--raw-csv"] if getattr(args, "raw_csv", False) else []
    if task != "custom":
        if given:
            raise UsageError(f"albert finetune: {given[0]} is for --task custom; --task {task} reads --data")
        if not args.data:
            raise UsageError(f"albert finetune: --task {task} needs --data (the task's data folder)")
        return args.data
    from albert_core.finetune.tasks.custom_splits import CustomDataConfig, load_custom_splits, split_files

    files = {"train": args.train, "dev": args.dev, "test": args.test}
    if args.data:
        if any(files.values()):
            raise UsageError("albert finetune: --task custom reads --train/--dev/--test or --data (a folder), not both")
        files = split_files(args.data)
    if not files["train"]:
        raise UsageError("albert finetune: --task custom needs --train (a .csv, .tsv, .jsonl, .json or .parquet file)")
    names = ("text_column", "text_pair_column", "label_column", "id_column")
    fields = files | {k: getattr(args, k) for k in names} | {"regression": args.regression, "raw_csv": args.raw_csv}
    fields["dev_fraction"] = args.dev_fraction
    if args.split_seed is not None:
        fields["split_seed"] = args.split_seed
    custom = CustomDataConfig(**fields)
    splits = load_custom_splits(custom)
    print(printable(splits.describe()))
    output.mkdir(parents=True, exist_ok=True)
    atomic_write_json(output / "split.json", splits.record())
    overrides["custom"] = custom
    return custom.train


def _cli_overrides(args: Namespace) -> tuple[dict[str, Any], RecipeDefaults | None]:
    """The command's run settings, and the [finetune] defaults of a --preset that names a recipe."""
    flags = (*SEARCHABLE, "tokenizer", "device")  # a run's settings, and where it reads and runs
    overrides: dict[str, Any] = {k: getattr(args, k) for k in flags if getattr(args, k) is not None}
    if args.save_model:
        overrides["save_model"] = True
    if not args.preset:
        if not args.checkpoint:
            raise UsageError("albert finetune: --checkpoint (a pretrained model directory) or --preset is required")
        return overrides, recipe_defaults(args.checkpoint)
    if args.checkpoint:
        raise UsageError("albert finetune: give --checkpoint (pretrained) or --preset (random init), not both")
    if not args.tokenizer:
        raise UsageError("albert finetune: --preset (random init) needs --tokenizer")
    from albert_core.text.tokenization import load_tokenizer

    overrides["model"], defaults = preset_model(args.preset, load_tokenizer(args.tokenizer).vocab_size)
    return overrides, defaults


_DEFAULT_FLAGS = {"lr": "--lr", "max_steps": "--max-steps", "pooling": "--pooling"}


def _apply_recipe_defaults(
    defaults: RecipeDefaults | None, overrides: dict[str, Any], searched: Sequence[str] = ()
) -> None:
    """The fine-tuning defaults of the checkpoint's recipe (services.finetune.seeds.recipe_defaults), or of the
    recipe --preset names, for what the command line does not give (a --search gives its fields); says which."""
    if defaults is None:
        return
    given = {key: flag for key, flag in _DEFAULT_FLAGS.items() if key in defaults.overrides and key in overrides}
    given |= {key: f"--search {key}" for key in searched if key in defaults.overrides}
    for key, value in defaults.overrides.items():
        overrides.setdefault(key, value)
    print(printable(defaults.describe(given)))


def cmd_finetune(args: Namespace) -> int:
    """`albert finetune`: one run in this process (a step progress bar), seeds as Tune trials, or a --search sweep;
    the summary table, or after Ctrl-C the partial summary and exit status INTERRUPTED_EXIT."""
    from albert_core.finetune.config import canonical_task
    from services.finetune.console import print_summary

    task = canonical_task(args.task)
    seeds = args.seeds if args.seeds is not None else default_seeds(task)
    if seeds < 1:
        raise UsageError(f"albert finetune: --seeds {seeds}: expected at least 1")
    seed_values = [args.seed + i for i in range(seeds)]
    output = Path(args.output or Path("runs") / "finetune" / task)
    grid = _grid(args, seeds)
    try:
        if grid is not None:
            summary = _sweep_from_cli(args, task, grid, seed_values, output)
        else:
            summary = _finetune_from_cli(args, task, seed_values, output)
    except KeyboardInterrupt as interrupted:
        if grid is not None:
            return _sweep_interrupted(interrupted, grid.trials(seeds), output)
        return report_interrupted(interrupted, task, seed_values, output)
    print_summary(summary, output)
    return 0


def _grid(args: Namespace, seeds: int) -> Grid | None:
    """The --search grid, checked (fields, values, the trial cap), or None; --early-stop needs one."""
    if not args.search:
        if args.early_stop:
            raise UsageError("albert finetune: --early-stop stops points of a sweep; it needs --search")
        return None
    options = {dest: action for dest, action in args.options.items() if dest != "help"}
    grid = parse_search(args.search, options, {k: getattr(args, k, None) for k in SEARCHABLE})
    check_size(grid, seeds)
    return grid


def _settings(
    args: Namespace, task: str, output: Path, searched: Sequence[str] = ()
) -> tuple[dict[str, Any], str, str]:
    """What every run of the command shares, said as it is settled: the run settings (the command line's, then the
    recipe's [finetune] defaults for the rest), the task's data (a custom table read and checked), the model line."""
    overrides, defaults = _cli_overrides(args)
    _apply_recipe_defaults(defaults, overrides, searched)
    data = _task_data(args, task, overrides, output)
    model = model_line(args.checkpoint, overrides.get("model"), args.preset)
    print(printable(model))
    return overrides, data, model


def _finetune_from_cli(args: Namespace, task: str, seed_values: list[int], output: Path) -> dict[str, Any]:
    from albert_core.finetune.finetuning import finetune

    overrides, data, model = _settings(args, task, output)
    configs = seed_configs(task, args.checkpoint, data, seeds=seed_values, overrides=overrides, output_dir=output)
    configs[0].tokenizer_path()  # a missing or mismatched tokenizer is an error now, not in every run
    if len(configs) == 1 and not args.ensemble:  # one run: in this process, with a step progress bar
        configs[0].progress = not args.no_progress
        result = finetune(configs[0])
        return summarize([result], output, model=model) | {"results": [result]}
    summary = run_downstream(
        task,
        args.checkpoint,
        data,
        seeds=seed_values,
        overrides=overrides,
        output_dir=output,
        ensemble=args.ensemble,
        num_cpus=args.cpus_per_run,
        num_gpus=args.gpus_per_run,
        progress=not args.no_progress,
        address=args.address,
        model=model,
    )
    if summary["reused"]:
        print(reused_line(summary["reused"], len(seed_values)))
    return summary


def _sweep_from_cli(args: Namespace, task: str, grid: Grid, seed_values: list[int], output: Path) -> dict[str, Any]:
    """Every point x seed as a Tune trial; results.csv / results.md; the best point's summary (and ensemble)."""
    from albert_core.finetune.finetuning import score_ensemble
    from services.finetune import sweep

    overrides, data, model = _settings(args, task, output, searched=list(grid.values))

    def make(point: dict[str, Any], point_output: Path):
        merged = overrides | point
        return seed_configs(task, args.checkpoint, data, seeds=seed_values, overrides=merged, output_dir=point_output)

    configs, where = sweep.sweep_configs(grid, make, seed_values, output)
    configs[0].tokenizer_path()  # a missing or mismatched tokenizer is an error now, not in every run
    sweep.check_sweep_file(output, sweep.sweep_record(task, grid, seed_values, configs))
    print(f"sweep: {len(grid.points)} points x {len(seed_values)} seeds = {len(configs)} runs as Ray Tune trials")
    rows, finished, reused = sweep.run_sweep(
        grid,
        configs,
        where,
        output,
        num_cpus=args.cpus_per_run,
        num_gpus=args.gpus_per_run,
        progress=not args.no_progress,
        early_stop=args.early_stop,
        address=args.address,
    )
    best = sweep.best_point(rows)
    results = finished[best.index]
    table = sweep.write_table(rows, best, task, results[0]["metric"], output)
    sweep.print_table(table, best, reused, len(configs), output)
    scored = None
    if args.ensemble:
        done = {r["seed"] for r in results}  # the best point's seeds that finished (--early-stop may stop some)
        best_dirs = [
            c.output_dir for c, (i, seed) in zip(configs, where, strict=True) if i == best.index and seed in done
        ]
        scored = score_ensemble(configs[best.index * len(seed_values)], best_dirs, output / "ensemble")
    return summarize(results, output, scored, point=best.point, model=model) | {"results": results}


def _sweep_interrupted(interrupted: KeyboardInterrupt, total: int, output: Path) -> int:
    """After Ctrl-C or SIGTERM in a sweep: how many runs finished, and that the same command resumes the rest."""
    finished = len(getattr(interrupted, "results", []))
    status = interrupted_status(interrupted)
    print(f"\n{interrupted_line(status)}: {finished} of {total} runs finished")
    print(f"Ray Tune's state is in {output / TUNE_DIR}: the same command resumes the {total - finished} unfinished")
    return status


def report_interrupted(interrupted: KeyboardInterrupt, task: str, seeds: Sequence[int], output: Path) -> int:
    """After Ctrl-C: summarize the runs that finished, a line per run that did not (its best dev evaluation so
    far), summary.json marked interrupted; returns INTERRUPTED_EXIT (EXIT_TERMINATED after a SIGTERM)."""
    from albert_core.finetune.finetuning import json_safe
    from services.finetune.console import print_interrupted, run_log, unfinished_line

    finished = list(getattr(interrupted, "results", []))  # SeedsInterrupted: the Ray runs that finished
    partial = getattr(interrupted, "result", None)  # FinetuneInterrupted: the in-process run so far
    metric = (partial or (finished[0] if finished else {})).get("metric")
    done = {r["seed"] for r in finished}
    unfinished = []
    for seed in (s for s in seeds if s not in done):
        if partial is not None and partial["seed"] == seed:
            line = unfinished_line(seed, partial["history"], metric, partial["hyperparams"]["train_steps"])
        else:
            line = unfinished_line(seed, run_log(output / f"seed_{seed}"), metric, None)
        unfinished.append(line)
    summary = summarize(finished, output) | {"results": finished} if finished else None
    record = dict(summary or {"task": task, "runs": 0})
    record.pop("results", None)
    record.update(interrupted=True, planned_seeds=list(seeds), unfinished=unfinished)
    wrote = output.is_dir()
    if wrote:
        atomic_write_json(output / "summary.json", json_safe(record))
        if summary is None:
            atomic_write_text(output / "summary.md", f"# {task}: interrupted before any run finished\n")
    status = interrupted_status(interrupted)
    print_interrupted(summary, unfinished, len(seeds), output, wrote, interrupted_line(status))
    if (output / TUNE_DIR).is_dir():
        print(f"Ray Tune's state is in {output / TUNE_DIR}: the same command resumes the unfinished runs")
    return status


def register(commands: argparse._SubParsersAction) -> None:
    """`albert finetune`."""
    parser = commands.add_parser(
        "finetune",
        help="fine-tune a checkpoint on GLUE, SQuAD, RACE or your own data",
        description="Fine-tune with the paper's recipe for the task; several seeds (and --search sweeps) run as "
        "parallel Ray Tune trials and the dev metrics are summarized by their median.",
    )
    parser.add_argument("--task", required=True, help=", ".join(TASKS))
    parser.add_argument("--data", help="the task's data folder (official layout; custom: train.csv, dev.csv, ...)")
    parser.add_argument("--checkpoint", help="pretrained model directory (ours or transformers')")
    parser.add_argument(
        "--preset",
        help="instead of --checkpoint, random weights (a baseline): a model preset (albert-tiny, ...) or a recipe "
        "(tiny, or a .toml: its model and its [finetune] defaults, the same model as its checkpoints)",
    )
    parser.add_argument(
        "--tokenizer", help="spiece.model or a tokenizer directory (default: the one in or above the checkpoint)"
    )
    parser.add_argument("--seeds", type=int, help="number of runs (default: 5 for GLUE, else 1)")
    parser.add_argument("--seed", type=int, default=BASE_SEED, help="first seed; runs use seed, seed+1, ...")
    parser.add_argument("--max-steps", type=int, help="shorter run: train steps (warmup scaled alike)")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--max-seq-length", type=int)
    parser.add_argument("--optimizer", choices=["adamw", "lamb"])
    parser.add_argument("--eval-every", type=int, help="steps between dev evaluations (0: only at the end)")
    parser.add_argument("--patience", type=int, help="early stopping: evaluations without improvement")
    parser.add_argument("--micro-batch-size", type=int, help="gradient accumulation in micro batches of this size")
    parser.add_argument("--device", help="auto | cpu | cuda")
    parser.add_argument("--precision", choices=["fp32", "bf16"])
    parser.add_argument("--pooling", choices=["cls", "mean"], help="what the task head reads (default: the model's)")
    parser.add_argument("--ensemble", action="store_true", help="also score the average of the runs' outputs")
    parser.add_argument("--save-model", action="store_true", help="keep each run's best model")
    parser.add_argument("--output", help="output folder (default runs/finetune/<task>)")
    parser.add_argument("--cpus-per-run", type=float, default=1)
    parser.add_argument("--gpus-per-run", type=float, default=0)
    parser.add_argument("--address", help="Ray cluster address (default: a local Ray started here)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (a line per evaluation and run)")
    parser.add_argument(
        "--search",
        action="append",
        metavar="FIELD=V1,V2,...",
        help="a sweep: every combination of the searched values x --seeds runs as Ray Tune trials, the best point "
        "by the median dev score (results.csv, results.md); repeatable; FIELD: " + searchable(),
    )
    parser.add_argument(
        "--early-stop", choices=EARLY_STOPS, help="with --search: stop weak runs at the dev evaluations (ASHA)"
    )
    add_custom_data_arguments(parser)
    parser.set_defaults(func=cmd_finetune, options={a.dest: a for a in parser._actions})
