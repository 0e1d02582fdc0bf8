"""`albert preprocess` (services.cli builds its parser): the checks before Ray, the run, and what it prints.

`--on-error` has three settings. Unset (the default) is strict about what the command line names and lenient
about what is inside: an --input that matches nothing stops the command before anything runs (exit 2), since that
is nearly always a typo, while a bad file or record found inside the inputs (unreadable, binary, invalid UTF-8, a
malformed JSON line, ...) is skipped, counted in manifest.json and named on the console, since a real corpus
nearly always has a few. `skip` also turns a missing input into a counted skip; `fail` stops at the first bad file
or record, naming it. Whatever the setting, a run that makes no training example is an error (exit 2).

`--append-to SHARDS` (instead of --output) adds the inputs to a finished shard set as its next part
(services.preprocess.append); the options that decide the examples' shape are the set's then, so their defaults
here are None and a plain run fills in PreprocessConfig's.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.preprocess.checks import NoExamplesError, check_arguments

if TYPE_CHECKING:
    from argparse import Namespace

    from services.preprocess.run import PreprocessConfig, PreprocessJob

ON_ERROR_HELP = (
    "default: an --input matching nothing stops the command before it starts; bad files and records inside the "
    "inputs are skipped, counted in manifest.json and named on the console. skip: missing inputs are skipped too. "
    "fail: the first bad file or record stops the job, naming it"
)
SHOWN_SKIPS = 5  # files with skips named on the console; manifest.json lists them all


SHAPE_FLAGS = {  # the options on the command line that decide the examples' shape
    "objective": "--objective",
    "max_seq_length": "--max-seq-length",
    "short_seq_prob": "--short-seq-prob",
    "seed": "--seed",
    "heldout_fraction": "--heldout-fraction",
}


def config_from_args(args: Namespace) -> PreprocessConfig:
    """The PreprocessConfig of a plain `albert preprocess` command line (not --append-to: services.
    preprocess_append), its numbers checked naming the option (ValueError)."""
    from services.preprocess.run import PreprocessConfig

    missing = [flag for flag, value in (("--tokenizer", args.tokenizer), ("--output", args.output)) if value is None]
    if missing:
        raise ValueError(
            f"{' and '.join(missing)}: required (unless --append-to SHARDS adds the inputs to a shard set)"
        )
    if args.part_name is not None:
        raise ValueError(f"--part-name {args.part_name}: only with --append-to SHARDS")
    defaults = {f.name: f.default for f in fields(PreprocessConfig)}
    shape = {name: defaults[name] if getattr(args, name) is None else getattr(args, name) for name in SHAPE_FLAGS}
    return build_config(args, args.tokenizer, args.output, shape)


def build_config(args: Namespace, tokenizer: str, output: str, shape: dict[str, Any]) -> PreprocessConfig:
    """The PreprocessConfig of the command line with these paths and shape options (the examples' shape: the
    command line's, or a shard set's for an append)."""
    from services.preprocess.run import PreprocessConfig

    check_arguments(argparse.Namespace(**{**vars(args), **shape}))
    return PreprocessConfig(
        inputs=args.input,
        tokenizer=tokenizer,
        output=output,
        on_error=args.on_error or "skip",
        skip_missing_inputs=args.on_error == "skip",
        shard_input_bytes=max(1, int(args.shard_mb * (1 << 20))),
        fmt=args.format,
        text_field=args.text_field,
        split=args.split,
        num_cpus=args.num_cpus,
        **shape,
    )


def plan_from_args(args: Namespace) -> tuple[PreprocessConfig, PreprocessJob]:
    """The command line's config and job, everything checked before Ray (ValueError naming the option or file)."""
    if args.append_to is not None:
        from services.preprocess.append import plan_append

        return plan_append(args)
    from services.preprocess.run import plan_preprocess

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
        lines.append(f"  {path}: {counts}" + (f" (first: {first['location']}: {detail})" if first else ""))
    if len(files) > shown:
        lines.append(f"  and {len(files) - shown} more; see {listed_in}")
    return lines


def cmd_preprocess(args: Namespace) -> int:
    """`albert preprocess`: everything checked before Ray starts (a mistake exits 2 within a second or so)."""
    from albert_core.shards import MANIFEST_FILE
    from services.preprocess.manifest import part_view
    from services.preprocess.run import run_preprocess

    config, job = plan_from_args(args)
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=args.num_cpus, include_dashboard=False)
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
