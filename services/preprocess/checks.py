"""What `albert preprocess` checks before Ray starts, so that a mistake costs a second, not Ray's start-up: the
command line's numbers, each input (one that matches nothing is an error unless missing inputs are skipped),
the tokenizer (it loads, SentencePiece or WordPiece; --max-seq-length within its model_max_length) and the output
directory. And, after the run, that it made training examples at all: a run without any is an error, never an
empty shard set.

Pure Python: no Ray, and nothing here writes.
"""

from __future__ import annotations

import math
import os
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec

from albert_core.examples.shape import shape_fields, shape_problem
from services.preprocess.config import PreprocessConfig

if TYPE_CHECKING:
    from argparse import Namespace

    from albert_core.text.tokenization import AnyTokenizer
    from services.preprocess.config import PreprocessConfig

EXPECTED_INPUT = "expected a corpus file, a directory of them, a glob or an fsspec URL"
MISSING_HINT = f"{EXPECTED_INPUT}; --on-error skip goes on without it"


def check_arguments(args: Namespace) -> None:
    """The numbers on the `albert preprocess` command line, each error naming its option (the example shape's by its
    rules, albert_core.examples.shape)."""
    checks = [
        ("--heldout-fraction", args.heldout_fraction, lambda v: 0 <= v < 1, "a fraction in [0, 1)"),
        ("--shard-mb", args.shard_mb, lambda v: 0 < v < math.inf, "a number of megabytes > 0"),
        ("--num-cpus", args.num_cpus, lambda v: v is None or v >= 1, "an integer >= 1"),
    ]
    for option, value, ok, expected in checks:
        if not ok(value):
            raise ValueError(f"{option}: expected {expected}, got {value}")
    flags = {f.name: f.metadata.get("flag") for f in fields(PreprocessConfig)}
    for name, shape_name in shape_fields(PreprocessConfig).items():
        problem = shape_problem(shape_name, getattr(args, name))
        if problem:
            raise ValueError(f"{flags[name]}: {problem}")


def missing_input(root: str, paths: list[str]) -> str | None:
    """Why the input `root` matches nothing, or None when it does. list_inputs keeps such an input as given (the
    reader then reports it as a `missing` skip), so only `paths == [root]` can be one."""
    if paths != [root]:
        return None
    fs, stripped = fsspec.core.url_to_fs(root)
    if fs.exists(stripped):
        return None
    return "the pattern matches no file" if any(c in stripped for c in "*?[") else "no such file or directory"


DEFAULT_MAX_POSITIONS = 512  # ALBERT's position embeddings: the limit when the tokenizer's config names none
MAX_POSITIONS = 1 << 16  # a model_max_length above this is "no limit" (transformers writes int(1e30))


def check_tokenizer(config: PreprocessConfig) -> AnyTokenizer:
    """The tokenizer (a spiece.model, or a model directory's SentencePiece or WordPiece vocabulary), loaded
    (FileNotFoundError / ValueError naming the file), with max_seq_length at most the model_max_length its
    tokenizer_config.json records (512 for ours: ALBERT's position embeddings), or 512 when there is no such file
    or it names no usable limit."""
    from albert_core.text.tokenization import load_tokenizer

    try:
        tokenizer = load_tokenizer(config.tokenizer)
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"tokenizer {config.tokenizer}: cannot be read ({err})") from None
    limit = tokenizer.model_max_length
    if limit is not None and 0 < limit <= MAX_POSITIONS:
        if config.max_seq_length > limit:
            raise ValueError(
                f"max_seq_length {config.max_seq_length}: above the tokenizer's model_max_length {limit} "
                f"({tokenizer.name}); the models take at most {limit} positions, use --max-seq-length {limit} or less"
            )
    elif config.max_seq_length > DEFAULT_MAX_POSITIONS:
        raise ValueError(
            f"max_seq_length {config.max_seq_length}: above {DEFAULT_MAX_POSITIONS} positions, ALBERT's, and "
            f"the tokenizer {tokenizer.name} names no model_max_length (tokenizer_config.json) to allow more; "
            f"use --max-seq-length {DEFAULT_MAX_POSITIONS} or less"
        )
    return tokenizer


def check_output(output: str) -> None:
    """The output is a local directory, or one that can be made: not a file, not under a file, writable."""
    if "://" in output:
        raise ValueError(f"output {output}: expected a local directory (a bucket mounted as one works)")
    path = Path(output)
    if path.exists() and not path.is_dir():
        raise ValueError(f"output {output}: exists and is not a directory")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"output {output}: cannot be made, {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"output {output}: cannot be written, {existing} is not writable by this user")


class NoExamplesError(ValueError):
    """The run made no training example. `manifest` is what it would have written (the console names the skips)."""

    def __init__(self, message: str, manifest: dict[str, Any]):
        super().__init__(message)
        self.manifest = manifest


def check_examples(manifest: dict[str, Any], output: str) -> None:
    """NoExamplesError unless the run made at least one example (manifest.json is not written then)."""
    if manifest["examples"]:
        return
    d = manifest["documents"]
    reasons = ", ".join(f"{k} {v}" for k, v in d["skipped_by_reason"].items()) or "none"
    hint = "lower --heldout-fraction" if d["heldout"] and not d["skipped"] else "check --input, --format, --text-field"
    raise NoExamplesError(
        f"{output}: no training examples: {d['read']} documents read, {d['used']} used, {d['heldout']} held out, "
        f"{d['skipped']} skipped ({reasons}); no manifest.json written; {hint}",
        manifest,
    )
