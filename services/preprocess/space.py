"""The disk a preprocess run will take under its output, checked before Ray starts (albert_core.files): the bytes of
its input on disk times what the run writes per input byte, measured by bench/shard_bytes.py on the sample corpus
(everything under --output: shards, held-out documents, unigram counts, progress markers, manifest.json), the
largest ratio seen for each kind of input, for max_seq_length 128 and 512 and a SentencePiece (8,000 pieces) or
WordPiece (30,522) tokenizer:

    text, JSONL, XML (uncompressed)     0.31-0.40   -> 0.40
    Parquet (snappy)                    0.55-0.68   -> 0.70
    .gz, .bz2, .xz, .zst                0.73-1.11   -> 1.15   (JSONL gzip-compressed 3:1, a MediaWiki .xml.bz2)

A corpus that compresses better than these (xz, zstd at high levels) writes more per input byte. Below one unit's
shard the run is refused; below the whole estimate, warned (finished units are kept when the disk fills: a rerun
resumes them)."""

from __future__ import annotations

from albert_core.files import SpaceNeed, check_space, free_bytes, size
from albert_core.text.corpus import compression_of
from services.preprocess.config import PreprocessConfig, Unit
from services.preprocess.plan import PreprocessJob

BYTES_PER_INPUT_BYTE = {"text": 0.40, "parquet": 0.70, "compressed": 1.15}
STREAM_CHUNK_INPUT = 4  # a compressed stream's chunk holds 4 x shard_input_bytes of decompressed text


def written_per_byte(path: str) -> float:
    if compression_of(path) is not None:
        return BYTES_PER_INPUT_BYTE["compressed"]
    return BYTES_PER_INPUT_BYTE["parquet" if path.lower().endswith(".parquet") else "text"]


def unit_bytes(unit: Unit) -> int:
    """What one unit writes: its input bytes (a region's share of its file's) times its files' ratios."""
    if unit.region is not None:
        return int(unit.size * written_per_byte(unit.files[0].path))
    return int(sum(f.size * written_per_byte(f.path) for f in unit.files))


def preprocess_space_need(config: PreprocessConfig, job: PreprocessJob) -> SpaceNeed:
    """What the run will add under config.output: every unit and stream, less the shards of units already there."""
    layout = job.layout(config.output)
    units = [unit_bytes(u) for u in job.plan.units]
    streams = [int(s.file.size * written_per_byte(s.file.path)) for s in job.plan.streams]
    done = sum(layout.shard(u).stat().st_size for u in job.plan.units if layout.shard(u).is_file())
    chunk = int(STREAM_CHUNK_INPUT * config.shard_input_bytes * BYTES_PER_INPUT_BYTE["text"])
    least = max([*units, *(min(chunk, s) for s in streams)], default=0)
    total = max(0, sum(units) + sum(streams) - done)
    read = sum(u.size for u in job.plan.units) + sum(s.file.size for s in job.plan.streams)
    what = f"the shards of {size(read)} of input (at the ratios bench/shard_bytes.py measured"
    what += f"; {size(done)} already written)" if done else ")"
    return SpaceNeed("--output", str(layout.root), total, min(least, total), "shard", what)


def check_preprocess_space(config: PreprocessConfig, job: PreprocessJob, free: int | None = None) -> str | None:
    """The warning line, None, or NotEnoughSpace, for the output's filesystem (`free`: its free bytes, measured when
    not given)."""
    need = preprocess_space_need(config, job)
    return check_space(need, free_bytes(need.path) if free is None else free)
