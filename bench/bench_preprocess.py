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

Where a unit's CPU time goes (issue 38): every unit's marker records its CPU seconds by phase
(services.preprocess.unit.PHASES: read, hash, sentences, clean, encode, pairs, arrow, parquet, commit). The bench
sums them over the units of
- in-process: every unit written in this process, one after the other (write_unit, no Ray);
- the pipeline: the units written by the Ray tasks, and what the run cost outside them: the CPU time of this
  process and of every process under it (Ray's: GCS, raylet, workers) during run_preprocess, less the units' own
  (Ray's scheduling and object store, the driver's plan, held-out merge and manifest).
With `--out` it writes the rates, ratios and phases as JSON (reports/preprocess-profile-*.json).

    python bench/bench_preprocess.py [--num-cpus 2] [--shard-mb 1] [--rounds 2] [--out reports/x.json]
    python bench/bench_preprocess.py --inputs .cache/albert/scale/corpus.jsonl --shard-mb 16 --rounds 1  # a big file
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from shard_digests import write_units  # bench/ (the script's folder) is on the path

from albert_core.text.corpus import read_documents
from albert_core.text.records import Document
from albert_core.text.tokenization import MODEL_FILE, Tokenizer, TokenizerTrainConfig, train_tokenizer
from services.cluster import connect
from services.data.sample import assemble_sample_corpus
from services.preprocess.config import PreprocessConfig
from services.preprocess.pipeline import run_preprocess
from services.preprocess.unit import PHASES, phase_totals

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


def tree_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and every live process under it (Linux /proc)."""
    parents, times = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        pid = int(stat.parent.name)
        parents[pid], times[pid] = int(fields[1]), int(fields[11]) + int(fields[12])
    tree, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier += children
    return sum(times.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


def preprocess_config(inputs: list[str], tokenizer: Path, output: Path, num_cpus: int, shard_mb: float):
    return PreprocessConfig(
        inputs=inputs,
        tokenizer=str(tokenizer),
        output=str(output),
        shard_input_bytes=int(shard_mb * (1 << 20)),
        num_cpus=num_cpus,
        progress=False,
    )


def time_pipeline(inputs: list[str], tokenizer: Path, num_cpus: int, shard_mb: float) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds of this process and Ray's during the run, manifest)."""
    out = Path(tempfile.mkdtemp(prefix="bench-preprocess-"))
    try:
        config = preprocess_config(inputs, tokenizer, out / "shards", num_cpus, shard_mb)
        started, cpu_started = time.perf_counter(), tree_cpu_seconds()
        manifest = run_preprocess(config)
        seconds, cpu = time.perf_counter() - started, tree_cpu_seconds() - cpu_started
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return seconds, cpu, manifest


def profile_in_process(inputs: list[str], tokenizer, model: Path, shard_mb: float) -> dict:
    """Every unit written in this process (no Ray): tokens, CPU seconds and their phases, summed over the units, and
    the CPU seconds of cutting the stream files into units (the pipeline's reader tasks)."""
    out = Path(tempfile.mkdtemp(prefix="bench-preprocess-units-"))
    try:
        summaries, reader_s = write_units(preprocess_config(inputs, model, out, 1, shard_mb), tokenizer)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    tokens = sum(f["tokens"] for s in summaries for f in s["files"].values())
    cpu_s = sum(s["cpu_seconds"] for s in summaries) + reader_s
    return {"tokens": tokens, "cpu_s": cpu_s, "phases": phase_totals(summaries), "stream_reader_s": reader_s}


def phase_table(phases: dict[str, float], total: float, outside: tuple[str, float]) -> str:
    rows = [(name, phases[name]) for name in PHASES] + [outside]
    return "\n".join(f"  {name:<36} {sec:>7.2f} CPU-s  {sec / total:>6.1%}" for name, sec in rows)


def time_encode(fn, texts: list[str]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of this process, tokens)."""
    started, cpu_started = time.perf_counter(), time.process_time()
    n = sum(len(ids) for ids in fn(texts))
    return time.perf_counter() - started, time.process_time() - cpu_started, n


def measure(args, inputs: list[str], model: Path, tokenizer, texts: list[str]) -> tuple[dict, dict]:
    """Rounds of: the pipeline on Ray (unless args.no_ray), every unit in-process, raw SentencePiece and
    Tokenizer.encode, interleaved so that drifting load hits every variant. Returns (wall rates, lists of per-round
    measurements)."""
    preprocessed = [tokenizer.preprocess(t) for t in texts]
    sp = tokenizer.sp
    wall = {"pipeline": [], "raw": [], "tokenizer": []}
    runs = {"pipeline": [], "raw": [], "tokenizer": [], "in_process": [], "pipeline_with_ray": []}
    runs.update(profiles=[], ray_phases=[], outside=[])
    for r in range(args.rounds):
        if not args.no_ray:
            seconds, tree_cpu, manifest = time_pipeline(inputs, model, args.num_cpus, args.shard_mb)
            tokens, cpu_s = manifest["tokens"], manifest["timings"]["worker_cpu_s"]
            wall["pipeline"].append(tokens / seconds)
            runs["pipeline"].append(tokens / cpu_s)
            runs["pipeline_with_ray"].append(tokens / tree_cpu)
            runs["ray_phases"].append(manifest["timings"]["worker_cpu_phases"])
            runs["outside"].append(tree_cpu - cpu_s)
            print(
                f"round {r}: pipeline {seconds:.2f}s for {tokens:,} tokens ({len(manifest['shards'])} shards, "
                f"{manifest['examples']:,} examples); CPU time inside the shard tasks {cpu_s:.2f}s, "
                f"outside them (Ray, driver) {tree_cpu - cpu_s:.2f}s",
                flush=True,
            )
        runs["profiles"].append(profile_in_process(inputs, tokenizer, model, args.shard_mb))
        runs["in_process"].append(runs["profiles"][-1]["tokens"] / runs["profiles"][-1]["cpu_s"])
        for name, fn, data in (
            ("raw", lambda ts: sp.encode(ts, num_threads=1), preprocessed),
            ("tokenizer", lambda ts: [tokenizer.encode(t) for t in ts], texts),
        ):
            s, c, n = time_encode(fn, data)
            wall[name].append(n / s)
            runs[name].append(n / c)
    return wall, runs


def print_rates(wall: dict, runs: dict, cores: int) -> None:
    if wall["pipeline"]:
        p, pc = statistics.median(wall["pipeline"]), statistics.median(runs["pipeline"])
        print(f"\npipeline end to end ({cores} CPUs)  {p:>12,.0f} tokens/s wall")
        print(f"pipeline per CPU-second          {pc:>12,.0f} tokens/s (inside the shard tasks)")
        for name, label in (("raw", "raw SentencePiece, 1 process"), ("tokenizer", "Tokenizer.encode, 1 process")):
            b, bc = statistics.median(wall[name]), statistics.median(runs[name])
            print(
                f"{label:<32} {b:>12,.0f} tokens/s wall ({bc:,.0f} per CPU-second): "
                f"end to end {p / b:.2f} = {p / b / cores:.2f} per core; per CPU-second {pc / bc:.2f}"
            )
        print("target: >= 0.60 of the limit (raw SentencePiece) per core")


def summarize(runs: dict) -> dict:
    """Medians over the rounds: rates, ratios to raw SentencePiece, CPU seconds by phase."""
    raw = statistics.median(runs["raw"])
    rates = {
        name: statistics.median(runs[name])
        for name in ("pipeline", "pipeline_with_ray", "raw", "tokenizer", "in_process")
        if runs[name]
    }
    profiles = runs["profiles"]
    result = {
        "tokens_per_cpu_s": {name: round(v) for name, v in rates.items()},
        "vs_raw_per_cpu_s": {name: round(v / raw, 3) for name, v in rates.items()},
        "in_process_phases_cpu_s": {k: round(statistics.median(p["phases"][k] for p in profiles), 3) for k in PHASES},
        "in_process_stream_cutting_cpu_s": round(statistics.median(p["stream_reader_s"] for p in profiles), 3),
        "in_process_cpu_s": round(statistics.median(p["cpu_s"] for p in profiles), 3),
        "tokens": profiles[-1]["tokens"],
        "raw_encode_cpu_s": round(profiles[-1]["tokens"] / raw, 3),
    }
    if runs["ray_phases"]:
        result["pipeline_phases_cpu_s"] = {
            k: round(statistics.median(p[k] for p in runs["ray_phases"]), 3) for k in PHASES
        }
        result["pipeline_outside_units_cpu_s"] = round(statistics.median(runs["outside"]), 3)
    return result


def print_phases(result: dict) -> None:
    ratios = result["vs_raw_per_cpu_s"]
    print(
        f"\nin-process (no Ray): {ratios['in_process']:.2f} of raw SentencePiece per CPU-second; CPU seconds by phase:"
    )
    cutting = ("stream cutting (outside the units)", result["in_process_stream_cutting_cpu_s"])
    print(phase_table(result["in_process_phases_cpu_s"], result["in_process_cpu_s"], cutting))
    print(f"  {'raw SentencePiece on the same text':<36} {result['raw_encode_cpu_s']:>7.2f} CPU-s")
    if "pipeline_phases_cpu_s" in result:
        phases, outside = result["pipeline_phases_cpu_s"], result["pipeline_outside_units_cpu_s"]
        print(
            f"pipeline on Ray: {ratios['pipeline']:.2f} of raw inside the tasks, {ratios['pipeline_with_ray']:.2f} "
            "with what it costs outside them; CPU seconds by phase:"
        )
        print(phase_table(phases, sum(phases.values()) + outside, ("outside the units (Ray, driver)", outside)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=CACHE / "sample-corpus")
    parser.add_argument(
        "--inputs",
        nargs="+",
        help="measure on these files instead (e.g. bench_scale's corpus.jsonl); the tokenizer "
        "is still the sample corpus's",
    )
    parser.add_argument("--tokenizer", type=Path, default=CACHE / "sample-tokenizer")
    parser.add_argument("--num-cpus", type=int, default=2)
    parser.add_argument("--shard-mb", type=float, default=1.0, help="input MB per shard (units of work)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-ray", action="store_true", help="in-process only: no pipeline on Ray")
    parser.add_argument("--out", type=Path, help="write the measurements as JSON here")
    args = parser.parse_args()

    inputs = sample_inputs(args.corpus)
    model = sample_tokenizer(args.tokenizer, inputs)
    inputs = args.inputs or inputs
    tokenizer = Tokenizer.load(model)
    texts = [r.text for r in read_documents(inputs) if isinstance(r, Document)]
    print(f"corpus: {len(texts)} documents, {sum(map(len, texts)) / 1e6:.1f} M characters; tokenizer {tokenizer}")
    if not args.no_ray:
        connect(num_cpus=args.num_cpus, worker_logs=False)
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    wall, runs = measure(args, inputs, model, tokenizer, texts)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if not args.no_ray:
        import ray

        ray.shutdown()
    print_rates(wall, runs, args.num_cpus)
    result = summarize(runs)
    print_phases(result)
    if args.out:
        head = {"inputs": inputs, "corpus": {"documents": len(texts), "characters": sum(map(len, texts))}}
        head["tokenizer"] = str(tokenizer)
        head.update(num_cpus=args.num_cpus, shard_mb=args.shard_mb, rounds=args.rounds)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**head, **result}, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
