"""`albert`: the one command-line entry point. Each stage registers its own command group (its `cli.py`); this
module builds the root parser from them and holds the two model commands that belong to no stage.

Heavy imports (torch, ray) happen inside the handlers, so `albert --help`, `albert status` and the other offline
commands start without them.
"""

from __future__ import annotations

import argparse
import os
import sys

from albert_core.files import DiskFull
from services import __version__, demo
from services.cluster import JobFailedError
from services.data import cli as data_cli
from services.eval import cli as eval_cli
from services.experiments import cli as experiments_cli
from services.finetune import cli as finetune_cli
from services.jobs import cli as jobs_cli
from services.preprocess import cli as preprocess_cli
from services.rundir import cli as run_cli
from services.terminal import (
    EXIT_CODES,
    EXIT_DATA,
    EXIT_DISK_FULL,
    EXIT_FAILED,
    EXIT_PIPE,
    EXIT_USAGE,
    UsageError,
    interrupted_line,
    interrupted_status,
    printable,
    raise_on_sigterm,
)
from services.train import cli as train_cli

DESCRIPTION = """\
Train ALBERT (A Lite BERT) on your own text and use it: turn corpora into
training examples, pretrain, fine-tune on labelled data and evaluate, on this
machine or on a Ray cluster. New here? `albert demo` runs every step on a sample
corpus in minutes on a laptop's CPUs. A command's options: albert COMMAND --help"""
# Each stage's `register(commands)` adds its commands to the root parser, in the order `albert --help` lists them:
# the order of the work (data -> pretraining -> its runs -> evaluation -> fine-tuning -> models -> experiments ->
# clusters).
STAGES = (demo, data_cli, preprocess_cli, train_cli, run_cli, eval_cli, finetune_cli)
LATER_STAGES = (experiments_cli, jobs_cli)


# --- model -----------------------------------------------------------------------------------------------


def cmd_model_info(args: argparse.Namespace) -> int:
    from albert_core.model.config import PRESETS, AlbertConfig, count_parameters

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
    from albert_core.model.conversion import convert_checkpoint

    done = convert_checkpoint(args.source, args.output, to=args.to, tokenizer=args.tokenizer, force=args.force)
    if done.warning:
        print(f"albert: warning: {done.warning}", file=sys.stderr)
    print(done.summary())
    return 0


def register_model_commands(commands: argparse._SubParsersAction) -> None:
    """`albert model info`, `albert convert`."""
    model = commands.add_parser("model", help="the model presets and their sizes (the paper's Table 1)")
    model = model.add_subparsers(dest="action", required=True)
    info = model.add_parser("info", help="print presets with parameter counts (Table 1)")
    info.add_argument("--preset")
    info.set_defaults(func=cmd_model_info)

    convert = commands.add_parser("convert", help="convert a checkpoint to or from Hugging Face transformers")
    convert.add_argument("source", help="an albert model directory or a transformers checkpoint directory")
    convert.add_argument("output")
    convert.add_argument("--to", choices=["hf", "albert"], help="default: the other format than the source's")
    convert.add_argument(
        "--tokenizer", help="spiece.model or WordPiece directory to carry (default: found in or above the source)"
    )
    convert.add_argument("--force", action="store_true", help="replace the checkpoint in a non-empty output")
    convert.set_defaults(func=cmd_convert)


class TopLevelHelp(argparse.RawDescriptionHelpFormatter):
    """The description and epilog as written; every command's line in one column (argparse counts the indented
    command names two columns short, so the longest, `experiment`, would wrap)."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=18)
        self._action_max_length = 16


def build_parser() -> argparse.ArgumentParser:
    codes = "\n".join(f"  {code:>3}  {meaning}" for code, meaning in EXIT_CODES.items())
    parser = argparse.ArgumentParser(
        prog="albert",
        description=DESCRIPTION,
        epilog=f"exit status:\n{codes}",
        formatter_class=TopLevelHelp,
    )
    parser.add_argument("--version", action="version", version=f"albert {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    for stage in STAGES:
        stage.register(commands)
    register_model_commands(commands)
    for stage in LATER_STAGES:
        stage.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # a usage error exits EXIT_USAGE (argparse's 2) here
    raise_on_sigterm()
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, rather than at exit
        return code
    except BrokenPipeError:  # `albert ... | head` closed the pipe: stop quietly, as other CLI tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush at exit must not fail again
        return EXIT_PIPE
    except UsageError as err:
        print(f"albert: error: {printable(err)}", file=sys.stderr)
        return EXIT_USAGE
    except JobFailedError as err:
        print(f"albert: error: {printable(err)}", file=sys.stderr)
        return EXIT_FAILED
    except DiskFull as err:  # one line: the path, the bytes needed and free, what was kept
        print(f"albert: error: {printable(err)}", file=sys.stderr)
        return EXIT_DISK_FULL
    except (ValueError, FileNotFoundError) as err:  # ConfigError, CorpusError, CheckpointError... are ValueErrors
        print(f"albert: error: {printable(err)}", file=sys.stderr)
        return EXIT_DATA
    except KeyboardInterrupt as err:  # commands that handle Ctrl-C themselves say more before they get here
        status = interrupted_status(err)
        print(f"albert: {interrupted_line(status)}", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
