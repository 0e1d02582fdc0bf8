"""End-to-end preprocess throughput (tokens/s) of run_preprocess on the sample corpus vs SentencePiece in one process.

The corpus is assembled into .cache/albert/sample-corpus (npm sotu + moby-dick, the gensim Wikipedia slice) and a
30,000-piece tokenizer trained into .cache/albert/sample-tokenizer if none is there. Measured in the same run:

- pipeline     run_preprocess on `--num-cpus` Ray CPUs, fresh output each round: read, split, encode, pairs, shards,
               manifest; wall time from the call to its return (Ray itself already started), tokens = the manifest's
- raw          SentencePiece encode (C++, one thread) of every document, already read and preprocessed: the limit
- tokenizer    Tokenizer.encode of every document (ALBERT's Python preprocessing + SentencePiece), one process

Ratios are pipeline / baseline, end to end per core (divided by the CPUs the pipeline used), and per task-second
(tokens / seconds spent inside the shard tasks: one core's throughput without Ray's start-up); the target is
>= 0.6 of the limit per core. Other processes sharing the CPUs lower the pipeline's numbers more than the
one-process baselines'.

    python bench/bench_preprocess.py [--num-cpus 2] [--shard-mb 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from albert_core.corpus import Document, read_documents
from albert_core.tokenization import MODEL_FILE, Tokenizer, TokenizerTrainConfig, train_tokenizer
from services.preprocess import PreprocessConfig, run_preprocess
from services.sample_data import assemble_sample_corpus

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


def time_encode(fn, texts: list[str]) -> tuple[float, int]:
    started = time.perf_counter()
    n = sum(len(ids) for ids in fn(texts))
    return time.perf_counter() - started, n


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

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    pipeline, per_worker, raw, plain = [], [], [], []
    for r in range(args.rounds):  # interleaved, so drifting load hits every variant
        seconds, tokens, manifest = time_pipeline(inputs, model, args.num_cpus, args.shard_mb)
        worker_s = manifest["timings"]["worker_s"]
        pipeline.append(tokens / seconds)
        per_worker.append(tokens / worker_s)
        print(
            f"round {r}: pipeline {seconds:.2f}s for {tokens:,} tokens ({len(manifest['shards'])} shards, "
            f"{manifest['examples']:,} examples); time inside the shard tasks {worker_s:.2f}s",
            flush=True,
        )
        s, n = time_encode(lambda ts: sp.encode(ts, num_threads=1), preprocessed)
        raw.append(n / s)
        s, n = time_encode(lambda ts: [tokenizer.encode(t) for t in ts], texts)
        plain.append(n / s)
    ray.shutdown()

    p, w = statistics.median(pipeline), statistics.median(per_worker)
    cores = args.num_cpus
    print(f"\npipeline, end to end, {cores} CPUs   {p:>12,.0f} tokens/s")
    print(f"pipeline, per task-second       {w:>12,.0f} tokens/s   (one core's work, start-up excluded)")
    for name, values in (("raw SentencePiece, 1 process", raw), ("Tokenizer.encode, 1 process", plain)):
        b = statistics.median(values)
        print(
            f"{name:<31} {b:>12,.0f} tokens/s   end to end {p / b:.2f} ({p / b / cores:.2f} per core), "
            f"per task-second {w / b:.2f}"
        )
    print("target: >= 0.60 of the limit (raw SentencePiece) per core")


if __name__ == "__main__":
    main()
