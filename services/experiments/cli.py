"""`albert experiment run|table|report` and `albert analyze layers`: their flags and handlers."""

from __future__ import annotations

import argparse
from argparse import Namespace
from pathlib import Path
from typing import TYPE_CHECKING

from services.terminal import add_output_option

if TYPE_CHECKING:
    from services.experiments.spec import ExperimentSpec


def cmd_experiment_run(args: Namespace) -> int:
    from services.experiments.cells import RESULTS_CSV, run_experiment, write_tables
    from services.experiments.spec import ExperimentSpec

    spec = ExperimentSpec.load(args.spec)
    if args.dry_run:
        return _print_plan(spec)
    run_experiment(spec, address=args.address, only=args.only or None, progress=not args.no_progress)
    _, md = write_tables(spec)
    print(md.read_text())
    print(f"wrote {md} and {spec.directory / RESULTS_CSV}")
    return 0


def cmd_experiment_table(args: Namespace) -> int:
    from services.experiments.cells import write_tables
    from services.experiments.spec import ExperimentSpec

    spec = ExperimentSpec.load(args.spec)
    _, md = write_tables(spec)
    print(md.read_text())
    return 0


def _print_plan(spec: ExperimentSpec) -> int:
    from albert_core.model.config import count_parameters
    from services.experiments.cells import finished_result
    from services.experiments.spec import cell_config

    vocab = 30000  # when neither the recipe nor a tokenizer says
    if spec.preprocess is not None and Path(spec.preprocess.tokenizer).exists():
        from albert_core.text.tokenization import load_tokenizer

        vocab = load_tokenizer(spec.preprocess.tokenizer).vocab_size
    for cell in spec.expand():
        config = cell_config(spec, cell)
        params = count_parameters(config.model_config(config.model.overrides.get("vocab_size") or vocab))
        state = "finished" if finished_result(spec, cell) is not None else "pending"
        print(f"{cell.name:<48} {params / 1e6:>8.2f}M  {config.optim.total_steps:>7} steps  {state}")
    return 0


def cmd_experiment_report(args: Namespace) -> int:
    from services.experiments.cells import run_experiment
    from services.experiments.report import write_report
    from services.experiments.spec import ExperimentSpec

    specs = [ExperimentSpec.load(path) for path in args.specs]  # every spec validated before anything runs
    if args.run:
        for spec in specs:
            print(f"== {spec.name}: {len(spec.expand())} cells")
            run_experiment(spec, address=args.address, progress=not args.no_progress)
    command = " ".join(["albert experiment report", *args.specs, "--output", args.output])
    out = write_report(specs, Path(args.output), title=args.title, command=command)
    print(f"wrote {out} and {out.with_suffix('')}/")
    return 0


def cmd_analyze_layers(args: Namespace) -> int:
    from services.experiments.analyze import analyze_layers

    out = analyze_layers(
        args.checkpoints,
        args.heldout,
        args.output,
        labels=args.label or None,
        tokenizer=args.tokenizer,
        max_seq_length=args.max_seq_length,
        max_examples=args.max_examples,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    print(f"{'checkpoint':<32}{'layer':>6}{'L2':>10}{'cosine':>9}")
    for row in out["rows"]:
        print(f"{row['label']:<32}{row['layer']:>6}{row['l2']:>10.4f}{row['cosine']:>9.4f}")
    print(f"wrote {out['csv']} and {out['png']}")
    return 0


def _register_analyze(commands: argparse._SubParsersAction) -> None:
    """`albert analyze layers`."""
    analyze = commands.add_parser("analyze", help="compare what each layer does (the paper's Figure 1)").add_subparsers(
        dest="action", required=True
    )
    layers = analyze.add_parser("layers", help="Figure 1: L2 / cosine between each layer's input and output")
    layers.add_argument("checkpoints", nargs="+", metavar="CKPT", help="model directories (ours or transformers')")
    layers.add_argument(
        "--heldout", required=True, help="<shards>/heldout/documents.parquet, or a text file (blank-line paragraphs)"
    )
    add_output_option(layers, required=True, help="directory for layers.csv and layers.png")
    layers.add_argument("--label", action="append", default=[], help="a name per checkpoint, in order")
    layers.add_argument(
        "--tokenizer", help="spiece.model of a .parquet input, or for checkpoints without their own tokenizer files"
    )
    layers.add_argument("--max-seq-length", type=int, default=128)
    layers.add_argument("--max-examples", type=int, default=256)
    layers.add_argument("--batch-size", type=int, default=16)
    layers.add_argument("--seed", type=int, default=12345)
    layers.set_defaults(func=cmd_analyze_layers)


def register(commands: argparse._SubParsersAction) -> None:
    """`albert experiment run|table|report`, `albert analyze layers`."""
    _register_analyze(commands)
    experiment = commands.add_parser(
        "experiment", help="run the paper's ablations as grids of pretraining runs"
    ).add_subparsers(dest="action", required=True)
    run = experiment.add_parser("run", help="run every unfinished cell of an experiment spec, then its table")
    run.add_argument("spec", help="configs/experiments/NAME.toml")
    run.add_argument("--address", help="Ray cluster address for the training workers; default: embedded local Ray")
    run.add_argument("--only", action="append", default=[], metavar="CELL", help="run only this cell (repeatable)")
    run.add_argument("--dry-run", action="store_true", help="list the cells, parameter counts and status; run nothing")
    run.add_argument("--no-progress", action="store_true")
    run.set_defaults(func=cmd_experiment_run)
    table = experiment.add_parser("table", help="rewrite results.csv / results.md from the finished cells")
    table.add_argument("spec")
    table.set_defaults(func=cmd_experiment_table)
    report = experiment.add_parser(
        "report", help="one markdown report (tables over seeds, verdicts, PNGs) over several specs' finished cells"
    )
    report.add_argument("specs", nargs="+", metavar="SPEC", help="configs/experiments/NAME.toml (in report order)")
    add_output_option(report, required=True, help="the markdown file; PNGs and CSVs go to its stem's directory")
    report.add_argument("--run", action="store_true", help="run the specs' unfinished cells first (finished: skipped)")
    report.add_argument("--title", default="Experiments")
    report.add_argument("--address", help="Ray cluster address for the training workers; default: embedded local Ray")
    report.add_argument("--no-progress", action="store_true")
    report.set_defaults(func=cmd_experiment_report)
