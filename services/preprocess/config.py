"""What one `albert preprocess` run is asked to do (PreprocessConfig), and the plan's units of work.

The options a user sets on the command line are declared here once: each such field carries its flag and help in
its metadata, and services.preprocess.cli derives the flags from them (with the field's default). The fields marked
`shape` decide what an example is; an appended part takes its shard set's values of those. Those of them that are the
example shape's (max_seq_length, the pair task, short_seq_prob) take their default, help and allowed values from
albert_core.examples.shape.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from albert_core.examples.pairs import PairConfig
from albert_core.examples.shape import OBJECTIVES, shape_field, shape_fields, shape_problem
from albert_core.text.corpus import FORMATS, MAX_DOCUMENT_CHARS, ON_ERROR, SPLITS, Region


def option(default: Any, flag: str | None, help: str, *, shape: bool = False, **argparse_kwargs: Any):
    """A config field with its command-line flag (None: no flag) and help; `shape`: it decides the examples."""
    return field(default=default, metadata={"flag": flag, "help": help, "shape": shape, "argparse": argparse_kwargs})


def example_option(name: str, flag: str, **argparse_kwargs: Any):
    """An option that is the example shape's field `name` (its default and help are ExampleShape's); it decides the
    examples, so an appended part takes its shard set's."""
    return shape_field(name, flag=flag, shape=True, argparse=argparse_kwargs)


@dataclass
class PreprocessConfig:
    inputs: list[str]
    tokenizer: str  # spiece.model or a directory holding it
    output: str
    objective: str = example_option("objective", "--objective", choices=OBJECTIVES)
    max_seq_length: int = example_option("max_seq_length", "--max-seq-length")
    short_seq_prob: float = example_option("short_seq_prob", "--short-seq-prob")
    seed: int = option(12345, "--seed", "seed of pair creation (NSP draws, short targets)", shape=True)
    # A bad file or record in the inputs: skip: a counted skip; fail: the job stops naming file and line/record
    # (the command line's --on-error sets this and skip_missing_inputs).
    on_error: str = "skip"
    skip_missing_inputs: bool = False  # an input matching nothing: False: an error before anything runs; True: a
    # `missing` skip (the CLI's explicit --on-error skip)
    # Documents reserved for intrinsic evaluation, chosen by the sha256 of their text: stable across runs, seeds and
    # however the input is cut (albert_core.examples.shards.document_hash).
    heldout_fraction: float = option(0.01, "--heldout-fraction", "share of documents held out", shape=True)
    # The input of one unit of work (and one shard): consecutive files are grouped up to this many bytes on disk,
    # and a bigger file is cut into regions of about this size (albert_core.text.regions); a single-stream compressed
    # file into chunks of 4x this many decompressed bytes as it is read. The command line gives megabytes (--shard-mb).
    shard_input_bytes: int = 16 << 20
    # Documents per create_pairs call: NSP takes its random B from another document of the same group.
    docs_per_group: int = option(256, None, "", shape=True)
    fmt: str = option("auto", "--format", "corpus format", choices=FORMATS)
    text_field: str = option("text", "--text-field", "JSONL / Parquet field holding the text")
    split: str = option(
        "file",
        "--split",
        "plain text: a document per file, or per blank-line block (big files are cut)",
        choices=SPLITS,
    )
    max_document_chars: int = option(MAX_DOCUMENT_CHARS, None, "", shape=True)
    num_cpus: int | None = option(None, "--num-cpus", "workers (default: all CPUs)", type=int)
    progress: bool = True  # a progress bar on the driver

    def __post_init__(self) -> None:
        if isinstance(self.inputs, str | os.PathLike):
            self.inputs = [self.inputs]
        self.inputs = [str(p) for p in self.inputs]
        self.tokenizer, self.output = str(self.tokenizer), str(self.output)
        if not self.inputs:
            raise ValueError("PreprocessConfig.inputs: expected at least one input path")
        for name in shape_fields(PreprocessConfig):
            problem = shape_problem(name, getattr(self, name))
            if problem:
                raise ValueError(f"PreprocessConfig.{name}: {problem}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"PreprocessConfig.on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.fmt not in FORMATS:
            raise ValueError(f"PreprocessConfig.fmt must be one of {FORMATS}, got {self.fmt!r}")
        if self.split not in SPLITS:
            raise ValueError(f"PreprocessConfig.split must be one of {SPLITS}, got {self.split!r}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"PreprocessConfig.heldout_fraction must be in [0, 1), got {self.heldout_fraction!r}")
        for name in ("shard_input_bytes", "docs_per_group", "max_document_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PreprocessConfig.{name} must be an int >= 1, got {value!r}")
        if self.num_cpus is not None and (not isinstance(self.num_cpus, int) or self.num_cpus < 1):
            raise ValueError(f"PreprocessConfig.num_cpus must be None or an int >= 1, got {self.num_cpus!r}")

    def pair_config(self) -> PairConfig:
        return PairConfig(
            max_seq_length=self.max_seq_length, short_seq_prob=self.short_seq_prob, objective=self.objective
        )

    def output_options(self) -> dict[str, Any]:
        """The options that decide the shards' bytes (not where they go, how fast, or what failure does)."""
        skip = {"inputs", "tokenizer", "output", "on_error", "skip_missing_inputs", "num_cpus", "progress"}
        return {k: v for k, v in asdict(self).items() if k not in skip}


@dataclass(frozen=True)
class InputFile:
    path: str  # as list_inputs gives it (what the reader opens, and the manifest's key)
    size: int  # bytes on disk; 0 for a path that does not exist (the reader reports it as missing)


@dataclass(frozen=True)
class Unit:
    """One task's work and one shard: consecutive whole files, or one region of a big file (text.regions)."""

    index: int
    files: tuple[InputFile, ...]
    region: Region | None = None  # with one file: the part of it this unit reads
    size: int = 0  # bytes on disk it reads (its share of a file's for a region): what progress counts

    @property
    def shard_name(self) -> str:
        return f"shard-{self.index:05d}.parquet"

    def to_json(self) -> str:
        region = None if self.region is None else asdict(self.region)
        files = [asdict(f) for f in self.files]
        return json.dumps({"index": self.index, "files": files, "region": region, "size": self.size})

    @classmethod
    def from_json(cls, text: str) -> Unit:
        data = json.loads(text)
        region = None if data.get("region") is None else Region(**data["region"])
        return cls(data["index"], tuple(InputFile(**f) for f in data["files"]), region, data["size"])


@dataclass(frozen=True)
class StreamInput:
    """A single-stream compressed file too big for one unit: read once as a stream and cut into chunks as it is
    read (albert_core.text.regions.stream_chunks); chunk k is unit `first + k`, so its units are not known before."""

    file: InputFile
    first: int

    def unit(self, chunk_index: int, region: Region, size: int) -> Unit:
        if chunk_index >= STREAM_UNITS:
            raise ValueError(f"{self.file.path}: more than {STREAM_UNITS} chunks; raise --shard-mb")
        return Unit(self.first + chunk_index, (self.file,), region, size)


# Unit numbers a stream's chunks may take: 2**16 chunks of 4 x --shard-mb decompressed megabytes (4 TB at 16 MB).
STREAM_UNITS = 1 << 16


# The options that decide the examples' shape (an appended part takes its set's), and those of them with a flag.
SHAPE = tuple(f.name for f in fields(PreprocessConfig) if f.metadata.get("shape"))
SHAPE_FLAGS = {f.name: f.metadata["flag"] for f in fields(PreprocessConfig) if f.name in SHAPE and f.metadata["flag"]}
DEFAULTS = {f.name: f.default for f in fields(PreprocessConfig)}
