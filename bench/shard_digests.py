"""The sha256 of every file a preprocess run's units write (shard, held-out part, piece counts), for a few
configurations of the sample corpus, so a change to preprocessing can be checked byte for byte against another
checkout's.

Each unit is written in this process (services.preprocess.unit.write_unit, no Ray): the files are the ones Ray's
tasks write. Configurations: the sample corpus with bench_preprocess's 30,000-piece tokenizer (SOP, 512 tokens, 1 MB
units), with the demo's 8,000-piece tokenizer (NSP, 128 tokens), and a JSONL file and a multistream .xml.bz2 dump
made from its paragraphs (tests/synthetic.py; cut into regions, objective none).

    python bench/shard_digests.py --out /tmp/digests-main.json             # e.g. run with PYTHONPATH=<main checkout>
    python bench/shard_digests.py --compare /tmp/digests-main.json         # exit status 1 on any difference
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from albert_core.text.regions import STREAM_EXPANSION, stream_chunks  # noqa: E402
from albert_core.text.tokenization import load_tokenizer  # noqa: E402
from services.data.sample import DEFAULT_CACHE, assemble_sample_corpus  # noqa: E402
from services.preprocess.config import PreprocessConfig  # noqa: E402
from services.preprocess.layout import Layout  # noqa: E402
from services.preprocess.plan import list_input_files, plan_units  # noqa: E402
from services.preprocess.unit import MARKER_SHA256, StreamData, write_unit  # noqa: E402
from tests.synthetic import distinct_documents, source_paragraphs, write_jsonl, write_multistream_dump  # noqa: E402


def write_units(config: PreprocessConfig, tokenizer) -> tuple[list[dict], float]:
    """Every unit of the run written in this process, one after the other, as the Ray tasks write them (a stream
    file cut into chunks as pipeline._stream_units cuts it); returns their markers' summaries, in unit order, and
    the CPU seconds spent cutting streams (outside the units, as in the pipeline's reader tasks)."""
    layout = Layout(config.output)
    plan = plan_units(list_input_files(config), config)
    work = [(unit, None) for unit in plan.units]
    reader_s = 0.0
    for stream in plan.streams:
        started, read_to = time.process_time(), 0
        for chunk in stream_chunks(stream.file.path, STREAM_EXPANSION * config.shard_input_bytes, fmt=config.fmt):
            unit = stream.unit(chunk.index, chunk.region(), chunk.compressed_end - read_to)
            read_to = chunk.compressed_end
            work.append((unit, StreamData(chunk.data, chunk.error)))
        reader_s += time.process_time() - started
    summaries = []
    for unit, data in sorted(work, key=lambda pair: pair[0].index):
        for path in [*layout.unit_files(unit), layout.marker(unit)]:
            path.parent.mkdir(parents=True, exist_ok=True)
            layout.partial(path).parent.mkdir(parents=True, exist_ok=True)
        summaries.append(write_unit(unit, tokenizer, config, "in-process", layout, data))
    return summaries, reader_s


def unit_digests(config: PreprocessConfig) -> list[list[str]]:
    """[shard, held-out part, piece counts] sha256 of each unit, in unit order."""
    summaries, _ = write_units(config, load_tokenizer(config.tokenizer))
    return [[s[key] for key in MARKER_SHA256] for s in summaries]


def configurations(work: Path) -> dict[str, PreprocessConfig]:
    parts = assemble_sample_corpus(DEFAULT_CACHE / "sample-corpus")
    sample = [str(parts[name]) for name in ("sotu", "moby-dick", "wiki")]
    docs = list(distinct_documents(source_paragraphs(sample), total_bytes=3_000_000, seed=7))
    jsonl = write_jsonl(iter(docs), work / "corpus.jsonl")
    (work / "wiki").mkdir()
    dump, _ = write_multistream_dump(iter(docs), work / "wiki" / "corpus-multistream.xml.bz2")
    big, small = DEFAULT_CACHE / "sample-tokenizer", DEFAULT_CACHE / "tokenizer-8000"
    mb = 1 << 20
    return {
        "sample, 30k pieces, sop 512": PreprocessConfig(sample, str(big), "", shard_input_bytes=mb),
        "sample, 8k pieces, nsp 128": PreprocessConfig(
            sample, str(small), "", objective="nsp", max_seq_length=128, shard_input_bytes=mb
        ),
        "jsonl, 8k pieces, none 128": PreprocessConfig(
            [str(jsonl)], str(small), "", objective="none", max_seq_length=128, shard_input_bytes=mb
        ),
        "multistream bz2, 8k pieces, sop 128": PreprocessConfig(
            [str(dump)], str(small), "", max_seq_length=128, shard_input_bytes=mb // 4
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compare", type=Path)
    args = parser.parse_args()
    result = {}
    with tempfile.TemporaryDirectory(prefix="shard-digests-") as tmp:
        for name, config in configurations(Path(tmp)).items():
            config.output, config.progress = str(Path(tmp) / name.replace(" ", "")), False
            started = time.process_time()
            result[name] = unit_digests(config)
            print(f"{name}: {len(result[name])} units, {time.process_time() - started:.1f} CPU-s", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.compare:
        expected = json.loads(args.compare.read_text())
        differ = [name for name in expected if expected[name] != result.get(name)]
        for name in differ:
            units = [i for i, (a, b) in enumerate(zip(expected[name], result.get(name, []), strict=False)) if a != b]
            print(f"DIFFERENT: {name}: units {units[:10]} (of {len(expected[name])})")
        print("all units' files byte for byte the same" if not differ else f"{len(differ)} configurations differ")
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
