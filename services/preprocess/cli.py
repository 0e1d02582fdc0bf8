"""`albert preprocess` (services.cli builds its parser): the checks before Ray, the run, and what it prints.

`--on-error` has three settings. Unset (the default) is strict about what the command line names and lenient
about what is inside: an --input that matches nothing stops the command before anything runs (exit 65), since that
is nearly always a typo, while a bad file or record found inside the inputs (unreadable, binary, invalid UTF-8, a
malformed JSON line, ...) is skipped, counted in manifest.json and named on the console, since a real corpus
nearly always has a few. `skip` also turns a missing input into a counted skip; `fail` stops at the first bad file
or record, naming it. Whatever the setting, a run that makes no training example is an error (exit 65).

`--append-to SHARDS` (instead of --output) adds the inputs to a finished shard set as its next part
(services.preprocess.append); the options that decide the examples' shape are the set's then, so their defaults
here are None and a plain run fills in PreprocessConfig's.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import Field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from albert_core.text.corpus import ON_ERROR
from services.cluster import connect
from services.preprocess.checks import NoExamplesError, check_arguments
from services.preprocess.config import DEFAULTS, SHAPE_FLAGS, PreprocessConfig
from services.terminal import UsageError, printable

if TYPE_CHECKING:
    from argparse import Namespace

    from services.preprocess.plan import PreprocessJob

ON_ERROR_HELP = (
    "default: an --input matching nothing stops the command before it starts; bad files and records inside the "
    "inputs are skipped, counted in manifest.json and named on the console. skip: missing inputs are skipped too. "
    "fail: the first bad file or record stops the job, naming it"
)
SHOWN_SKIPS = 5  # files with skips named on the console; manifest.json lists them all


def config_from_args(args: Namespace) -> PreprocessConfig:
    """The PreprocessConfig of a plain `albert preprocess` command line (not --append-to), its numbers checked
    naming the option (ValueError)."""
    missing = [flag for flag, value in (("--tokenizer", args.tokenizer), ("--output", args.output)) if value is None]
    if missing:
        raise UsageError(
            f"{' and '.join(missing)}: required (unless --append-to SHARDS adds the inputs to a shard set)"
        )
    if args.part_name is not None:
        raise UsageError(f"--part-name {args.part_name}: only with --append-to SHARDS")
    shape = {name: DEFAULTS[name] if getattr(args, name) is None else getattr(args, name) for name in SHAPE_FLAGS}
    return build_config(args, args.tokenizer, args.output, shape)


def build_config(args: Namespace, tokenizer: str, output: str, shape: dict[str, Any]) -> PreprocessConfig:
    """The PreprocessConfig of the command line with these paths and shape options (the examples' shape: the
    command line's, or a shard set's for an append)."""
    check_arguments(argparse.Namespace(**{**vars(args), **shape}))
    flagged = {f.name: getattr(args, f.name) for f in fields(PreprocessConfig) if _flag(f) and f.name not in shape}
    return PreprocessConfig(
        inputs=args.input,
        tokenizer=tokenizer,
        output=output,
        on_error=args.on_error or "skip",
        skip_missing_inputs=args.on_error == "skip",
        shard_input_bytes=max(1, int(args.shard_mb * MB)),
        progress=not args.no_progress,
        **flagged,
        **shape,
    )


def append_from_args(args: Namespace) -> tuple[PreprocessConfig, PreprocessJob]:
    """The config and job of an `--append-to SHARDS` command line: the set's shape options and tokenizer unless
    given (a given one that differs is refused), everything checked before Ray."""
    from services.preprocess.append import finished_shard_set, plan_append, set_shape, set_tokenizer

    root = args.append_to
    if args.output is not None and Path(args.output).resolve() != Path(root).resolve():
        raise UsageError(f"--output {args.output}: not with --append-to {root} (the part is written into the set)")
    shard_set = finished_shard_set(root)
    shape = set_shape(shard_set, {name: getattr(args, name) for name in SHAPE_FLAGS})
    config = build_config(args, set_tokenizer(shard_set, args.tokenizer), root, shape)
    return config, plan_append(config, shard_set, args.tokenizer, args.part_name)


def plan_from_args(args: Namespace) -> tuple[PreprocessConfig, PreprocessJob]:
    """The command line's config and job, everything checked before Ray (ValueError naming the option or file)."""
    if args.append_to is not None:
        return append_from_args(args)
    from services.preprocess.plan import plan_preprocess

    config = config_from_args(args)
    return config, plan_preprocess(config)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def skip_lines(manifest: dict[str, Any], listed_in: str, shown: int = SHOWN_SKIPS) -> list[str]:
    """The console's account of skips: the first `shown` files that had any, their reasons and first skip."""
    files = [(path, stats) for path, stats in manifest["files"].items() if stats["skipped"]]
    if not files:
        return []
    lines = [f"skipped {_count(manifest['documents']['skipped'], 'document')} in {_count(len(files), 'file')}:"]
    for path, stats in files[:shown]:
        counts = ", ".join(f"{reason} {n}" for reason, n in sorted(stats["skipped"].items()))
        first = stats["skip_examples"][0] if stats["skip_examples"] else None
        detail = first["detail"] if first is None or len(first["detail"]) <= 80 else first["detail"][:77] + "..."
        line = f"  {path}: {counts}" + (f" (first: {first['location']}: {detail})" if first else "")
        lines.append(printable(line))  # file names and details quote the corpus
    if len(files) > shown:
        lines.append(f"  and {len(files) - shown} more; see {listed_in}")
    return lines


def cmd_preprocess(args: Namespace) -> int:
    """`albert preprocess`: everything checked before Ray starts (a mistake exits within a second or so: 2 for
    options that conflict, 65 for a bad value, path or file)."""
    from albert_core.examples.shards import MANIFEST_FILE
    from services.preprocess.manifest import part_view
    from services.preprocess.pipeline import run_preprocess
    from services.preprocess.space import check_preprocess_space

    config, job = plan_from_args(args)
    try:
        warning = check_preprocess_space(config, job)  # NotEnoughSpace: refused before Ray starts
    except ValueError:
        job.release()
        raise
    if warning:
        print(f"albert: warning: {warning}", file=sys.stderr)
    connect(num_cpus=args.num_cpus)  # a SIGTERM unwinds, its run lock released
    manifest_path = Path(config.output) / MANIFEST_FILE
    try:
        m = run_preprocess(config, job)
    except NoExamplesError as err:
        for line in skip_lines(err.manifest, str(job.layout(config.output).progress / "shard-*.json")):
            print(line)
        raise
    for line in report_lines(part_view(m, job.part), m["timings"], str(manifest_path)):
        print(line)
    if job.part:
        part = m["parts"][job.part]
        print(
            f'appended part {job.part} "{part["name"]}" to {config.output}: {part["examples"]} examples in '
            f"{_count(len(part['shards']), 'shard')}; the set is now version {len(m['parts'])} ({m['examples']} "
            "examples)"
        )
    print(f"wrote {manifest_path}")
    return 0


def report_lines(part: dict[str, Any], timings: dict[str, Any], manifest_path: str) -> list[str]:
    """What the console says of the part a run wrote (part_view: its counts and its files' skips)."""
    d, t = part["documents"], timings
    reasons = ", ".join(f"{k} {v}" for k, v in d["skipped_by_reason"].items()) or "none"
    speed = f"{t['tokens_per_s']:,.0f} tokens/s" if t["tokens_per_s"] else "nothing to redo"
    return [
        f"documents: {d['read']} read, {d['used']} used, {d['heldout']} held out, {d['skipped']} skipped ({reasons})",
        *skip_lines(part, manifest_path),
        f"sentences: {part['sentences']}  tokens: {part['tokens']}  examples: {part['examples']}  "
        f"shards: {len(part['shards'])}",
        f"time: {t['total_s']:.1f}s ({speed}; {t['shards_resumed']} shards resumed)",
    ]


MB = 1 << 20


def _flag(f: Field) -> str | None:
    return f.metadata.get("flag")


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for each PreprocessConfig field that has one, with the field's default and help. A shape option
    defaults to None on the command line: with --append-to the shard set's value is taken (another is refused)."""
    for f in fields(PreprocessConfig):
        if not _flag(f):
            continue
        kwargs = dict(f.metadata["argparse"], dest=f.name)
        kwargs.setdefault("type", type(f.default) if f.default is not None else str)
        if f.metadata["shape"]:
            help = f"{f.metadata['help']} (default: {f.default}; with --append-to: the shard set's, another is refused)"
            parser.add_argument(_flag(f), default=None, help=help, **kwargs)
        else:
            parser.add_argument(_flag(f), default=f.default, help=f.metadata["help"], **kwargs)


def register(commands: argparse._SubParsersAction) -> None:
    """`albert preprocess`."""
    p = commands.add_parser(
        "preprocess",
        help="turn text into training examples (Parquet shards)",
        description="Corpora -> Parquet shards of SOP/NSP pair examples + manifest.json.",
    )
    p.add_argument("--input", nargs="+", required=True, help="files, directories, globs or fsspec URLs")
    p.add_argument(
        "--tokenizer",
        help="spiece.model, or a model or tokenizer directory holding spiece.model (ALBERT) or a WordPiece vocab.txt / "
        "tokenizer.json (BERT); with --append-to: the set's, another sha256 is refused",
    )
    p.add_argument("--output", help="output directory (rerun into it to resume); required unless --append-to")
    p.add_argument(
        "--append-to",
        metavar="SHARDS",
        help="add the inputs to this finished shard set as its next part (instead of --output; rerun to resume)",
    )
    p.add_argument("--part-name", help="with --append-to: the new part's name (default: part-<k>)")
    p.add_argument("--on-error", choices=ON_ERROR, default=None, help=ON_ERROR_HELP)
    p.add_argument(
        "--shard-mb",
        type=float,
        default=DEFAULTS["shard_input_bytes"] / MB,
        help="input megabytes per unit of work and shard: small files are grouped, a bigger file is cut into units "
        "of this size (a compressed stream into chunks of 4x this, decompressed); default 16",
    )
    _add_config_flags(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_preprocess)
