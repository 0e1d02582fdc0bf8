"""Bytes a preprocess run writes per byte of input, by input format: the ratios `albert preprocess` uses to say, before
Ray starts, how much of its output's filesystem it will take (services/preprocess/space.py).

Inputs are made from the sample corpus (.cache/albert/sample-corpus: SOTU addresses and Moby-Dick as text, a
Wikipedia slice as MediaWiki .xml.bz2): the text files as they are, the same documents as one JSONL file, that file
gzip-compressed, and as Parquet (pyarrow's default snappy), then each preprocessed by the real pipeline (Ray, one
CPU) with each tokenizer and max_seq_length given. The bytes written are everything under --output (shards,
held-out documents, unigram counts, progress markers, manifest.json); the input bytes are those on disk.

    python bench/shard_bytes.py [--tokenizer .cache/albert/tokenizer-8000] [--max-seq-length 128 512]
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from albert_core.text.corpus import read_documents
from albert_core.text.records import Document
from services.cluster import connect
from services.preprocess.config import PreprocessConfig
from services.preprocess.pipeline import run_preprocess
from services.preprocess.plan import plan_preprocess

CORPUS = Path(".cache/albert/sample-corpus")


def inputs(work: Path) -> dict[str, list[str]]:
    """name -> the input paths of one variant."""
    texts = [str(CORPUS / "sotu"), str(CORPUS / "moby-dick")]
    documents = [r.text for r in read_documents(texts) if isinstance(r, Document)]
    jsonl = work / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in documents))
    with open(jsonl, "rb") as f, gzip.open(_mkdir(work / "gz") / "docs.jsonl.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    pq.write_table(pa.table({"text": documents}), _mkdir(work / "parquet") / "docs.parquet")
    return {
        "text (.txt)": texts,
        "jsonl": [str(jsonl)],
        "jsonl.gz": [str(work / "gz" / "docs.jsonl.gz")],
        "parquet": [str(work / "parquet" / "docs.parquet")],
        "mediawiki .xml.bz2": [str(CORPUS / "wiki")],
    }


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def written(output: Path) -> int:
    return sum(p.stat().st_size for p in output.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", nargs="+", default=[".cache/albert/tokenizer-8000"])
    parser.add_argument("--max-seq-length", type=int, nargs="+", default=[128, 512])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="shard-bytes-"))
    try:
        variants = inputs(work)
        connect(num_cpus=1, worker_logs=False)
        print(f"{'input':<20}{'tokenizer':<36}{'seq':>5}{'input MB':>10}{'written MB':>12}{'ratio':>8}")
        for tokenizer in args.tokenizer:
            for seq in args.max_seq_length:
                for name, paths in variants.items():
                    out = work / "out"
                    config = PreprocessConfig(
                        inputs=paths, tokenizer=tokenizer, output=str(out), max_seq_length=seq, progress=False
                    )
                    job = plan_preprocess(config)
                    read = job.plan.input_bytes
                    run_preprocess(config, job)
                    wrote = written(out)
                    shutil.rmtree(out)
                    print(f"{name:<20}{tokenizer[-35:]:<36}{seq:>5}{read / 1e6:>10.2f}{wrote / 1e6:>12.2f}"
                          f"{wrote / read:>8.3f}", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
