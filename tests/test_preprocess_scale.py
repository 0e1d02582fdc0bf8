"""`albert preprocess` on big files, at small scale: a file cut into many units (a tiny shard size) gives the same
documents, held-out choice and SOP examples as the same text in one unit or in many files; a single compressed
stream is fanned out to the workers; a job killed half way resumes without redoing, losing or repeating a unit.

bench/bench_scale.py measures the same at GB scale (rates, 1 vs 2 CPUs, peak memory, a kill and resume).
"""

from __future__ import annotations

import bz2
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from albert_core.examples.shards import HELDOUT_FILE, MANIFEST_FILE
from albert_core.text.tokenization import TokenizerTrainConfig, train_tokenizer
from services.preprocess.config import PreprocessConfig
from services.preprocess.layout import PROGRESS_DIR
from services.preprocess.pipeline import run_preprocess
from services.preprocess.unit import UnitTransform
from tests.synthetic import distinct_documents, write_jsonl, write_multistream_dump

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer_corpus.txt"
PARAGRAPHS = [line for line in FIXTURE.read_text(encoding="utf-8").splitlines() if len(line) > 40]
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    return train_tokenizer(iter(PARAGRAPHS), out, TokenizerTrainConfig(vocab_size=400, allow_smaller_vocab=True))


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return list(distinct_documents(PARAGRAPHS, total_bytes=600_000, seed=7))


@pytest.fixture(scope="module")
def shapes(tmp_path_factory, docs) -> dict[str, list[str]]:
    """The same documents as one JSONL file, many JSONL files, one .jsonl.gz stream, one .jsonl.zst stream."""
    root = tmp_path_factory.mktemp("shapes")
    many = root / "many"
    many.mkdir()
    for i in range(0, len(docs), 40):
        write_jsonl(iter(docs[i : i + 40]), many / f"part-{i:05d}.jsonl")
    return {
        "one file": [str(write_jsonl(iter(docs), root / "one.jsonl"))],
        "many files": [str(many)],
        "gzip stream": [str(write_jsonl(iter(docs), root / "one.jsonl.gz"))],
        "zstd stream": [str(write_jsonl(iter(docs), root / "one.jsonl.zst"))],
    }


def preprocess(inputs: list[str], tokenizer: Path, output: Path, shard_bytes: int, **options) -> dict:
    config = PreprocessConfig(
        inputs=inputs,
        tokenizer=str(tokenizer),
        output=str(output),
        max_seq_length=64,
        heldout_fraction=0.05,
        shard_input_bytes=shard_bytes,
        progress=False,
        **options,
    )
    return run_preprocess(config)


def outcome(output: Path, manifest: dict) -> tuple[list[int], Counter, dict]:
    """(held-out document ids, the multiset of examples as (tokens, label), document counts)."""
    heldout = sorted(pq.read_table(output / HELDOUT_FILE, columns=["doc_id"]).column(0).to_pylist())
    examples: Counter = Counter()
    for shard in manifest["shards"]:
        table = pq.read_table(output / shard["name"], columns=["input_ids", "pair_label"])
        examples.update(zip(map(tuple, table.column(0).to_pylist()), table.column(1).to_pylist(), strict=True))
    return heldout, examples, manifest["documents"]


@pytest.fixture(scope="module")
def reference(ray_local, shapes, tokenizer, tmp_path_factory):
    """The one-file JSONL in a single unit."""
    output = tmp_path_factory.mktemp("reference") / "out"
    manifest = preprocess(shapes["one file"], tokenizer, output, 64 << 20)
    assert len(manifest["shards"]) == 1
    return outcome(output, manifest)


@pytest.mark.parametrize("shape", ["one file", "many files", "gzip stream", "zstd stream"])
def test_documents_held_out_documents_and_sop_examples_do_not_depend_on_how_the_input_is_cut(
    ray_local, shapes, tokenizer, reference, tmp_path, shape
):
    manifest = preprocess(shapes[shape], tokenizer, tmp_path / "out", 8 << 10)  # 8 KB units: dozens of them
    assert len(manifest["shards"]) > 10
    heldout, examples, documents = outcome(tmp_path / "out", manifest)
    assert documents == reference[2] and documents["heldout"] > 0
    assert heldout == reference[0]
    assert examples == reference[1]


def test_a_multistream_dump_in_regions_gives_what_the_dump_read_whole_gives(ray_local, docs, tokenizer, tmp_path):
    dump, _ = write_multistream_dump(iter(docs), tmp_path / "wiki-multistream.xml.bz2")
    single = tmp_path / "single" / "wiki.xml.bz2"  # the same export as one bzip2 stream: no index, a stream read
    single.parent.mkdir()
    single.write_bytes(bz2.compress(bz2.decompress(dump.read_bytes())))
    whole = preprocess([str(dump)], tokenizer, tmp_path / "whole", 64 << 20)
    cut = preprocess([str(dump)], tokenizer, tmp_path / "cut", 4 << 10)
    streamed = preprocess([str(single)], tokenizer, tmp_path / "streamed", 4 << 10)
    assert len(whole["shards"]) == 1 and len(cut["shards"]) > 3 and len(streamed["shards"]) > 3
    assert {s["region"]["how"] for s in cut["shards"]} == {"bz2_streams"}
    assert {s["region"]["how"] for s in streamed["shards"]} == {"chunk"}
    expected = outcome(tmp_path / "whole", whole)
    assert outcome(tmp_path / "cut", cut) == expected == outcome(tmp_path / "streamed", streamed)
    assert whole["documents"]["read"] == len(docs)


def test_one_compressed_file_is_fanned_out_to_every_worker(ray_local, shapes, tokenizer, tmp_path):
    # 2 KB of the file per unit (8 KB decompressed chunks): dozens of chunks, read far ahead of the two workers
    manifest = preprocess(shapes["gzip stream"], tokenizer, tmp_path / "out", 2 << 10, num_cpus=2)
    markers = [json.loads(p.read_text()) for p in (tmp_path / "out" / PROGRESS_DIR).glob("shard-*.json")]
    assert len(markers) == len(manifest["shards"]) > 20
    assert len({m["worker"] for m in markers}) >= 2  # more than one worker took chunks of the one file
    assert all(s["files"] == shapes["gzip stream"] for s in manifest["shards"])
    assert manifest["files"][shapes["gzip stream"][0]]["documents"] == manifest["documents"]["read"]


def test_held_out_documents_are_written_in_batches_as_they_come(tokenizer, docs, tmp_path, monkeypatch):
    """A unit holds at most a group of documents and a batch of held-out ones, whatever its size."""
    from albert_core.text.tokenization import Tokenizer
    from services.preprocess import unit as unit_module
    from services.preprocess.config import InputFile, Unit

    batch = 32
    monkeypatch.setattr(unit_module, "HELDOUT_BATCH", batch)
    path = write_jsonl(iter(docs), tmp_path / "c.jsonl")
    config = PreprocessConfig(
        inputs=[str(path)], tokenizer=str(tokenizer), output="o", heldout_fraction=0.5, docs_per_group=16
    )
    events: list[str] = []
    unit = Unit(0, (InputFile(str(path), path.stat().st_size),))
    transform = UnitTransform(unit, Tokenizer.load(tokenizer), config, heldout=lambda t: events.append(t.num_rows))
    for _ in transform.tables():
        events.append("table")
    assert events.count("table") > 1 and len([e for e in events if e != "table"]) > 1
    assert events.index("table") < len(events) - 1 and max(e for e in events if e != "table") <= batch
    assert sum(e for e in events if e != "table") == transform.heldout_documents > batch


def albert_preprocess(inputs: str, tokenizer: Path, output: Path) -> subprocess.Popen:
    args = ["--input", inputs, "--tokenizer", str(tokenizer), "--output", str(output), "--max-seq-length", "64"]
    args += ["--heldout-fraction", "0.05", "--shard-mb", "0.004", "--num-cpus", "1", "--no-progress"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "preprocess", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the kill takes its Ray with it, as a lost node would
    )


def test_a_job_killed_half_way_resumes_without_redoing_losing_or_repeating_a_unit(shapes, tokenizer, tmp_path):
    inputs = shapes["one file"][0]
    whole = albert_preprocess(inputs, tokenizer, tmp_path / "whole")
    assert whole.wait(timeout=600) == 0, whole.stdout.read().decode()[-2000:]
    expected = json.loads((tmp_path / "whole" / MANIFEST_FILE).read_text())
    units = len(expected["shards"])
    assert units > 20

    killed = albert_preprocess(inputs, tokenizer, tmp_path / "out")
    progress = tmp_path / "out" / PROGRESS_DIR
    deadline = time.monotonic() + 600
    while len(list(progress.glob("shard-*.json"))) < units // 2:
        assert killed.poll() is None and time.monotonic() < deadline, "the run ended before half its units"
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    done_before = {p.name for p in progress.glob("shard-*.json")}
    assert 0 < len(done_before) < units and not (tmp_path / "out" / MANIFEST_FILE).exists()

    resumed = albert_preprocess(inputs, tokenizer, tmp_path / "out")
    assert resumed.wait(timeout=600) == 0, resumed.stdout.read().decode()[-2000:]
    manifest = json.loads((tmp_path / "out" / MANIFEST_FILE).read_text())
    timings = manifest["timings"]  # (a unit in flight at the kill may have committed as its process went down)
    assert timings["shards_resumed"] >= len(done_before) and timings["shards_written"] > 0
    assert timings["shards_resumed"] + timings["shards_written"] == units
    assert manifest["documents"] == expected["documents"] and manifest["examples"] == expected["examples"]
    assert [s["sha256"] for s in manifest["shards"]] == [s["sha256"] for s in expected["shards"]]
    ids = [pq.read_table(tmp_path / "out" / s["name"], columns=["example_id"]).column(0) for s in manifest["shards"]]
    all_ids = [i for column in ids for i in column.to_pylist()]
    assert len(all_ids) == len(set(all_ids)) == expected["examples"]


def test_a_second_copy_of_a_running_preprocess_is_refused_and_leaves_the_first_alone(shapes, tokenizer, tmp_path):
    from services.preprocess.plan import plan_preprocess

    config = PreprocessConfig(
        inputs=shapes["one file"], tokenizer=str(tokenizer), output=str(tmp_path / "out"), progress=False
    )
    first = plan_preprocess(config)
    in_flight = tmp_path / "out" / PROGRESS_DIR / "shard-00000.parquet.partial"  # a unit the first is writing
    in_flight.write_bytes(b"PAR1")
    with pytest.raises(ValueError, match=r"another albert preprocess is writing into .*out right now"):
        plan_preprocess(config)  # a resubmitted job: same plan, same output
    assert in_flight.exists()
    first.release()
    plan_preprocess(config).release()  # once the first has ended, the same command resumes
    assert not in_flight.exists()  # (and clears what an interrupted run left)
