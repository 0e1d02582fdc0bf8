"""`albert preprocess --append-to SHARDS`: a corpus added to a shard set as its next part. The part continues the
set's shard numbering, leaves part 0 byte for byte as it was, is listed in manifest.json only once all of it is
written (an interrupted append resumes by rerunning the command), and a rerun of the original preprocess keeps it.
Mistakes are refused before Ray, in one line naming the option or file."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import re
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from albert_core.examples.shards import HELDOUT_FILE, MANIFEST_FILE, ShardsManifest
from albert_core.text.tokenization import TokenizerTrainConfig, train_tokenizer
from services.cli import build_parser, main
from services.cluster import build_entrypoint, split_submit_args
from services.jobs.checks import prepare_job_args
from services.preprocess.cli import plan_from_args
from services.preprocess.cli import register as add_preprocess_command
from services.preprocess.layout import PROGRESS_DIR
from services.preprocess.manifest import part_checksum, stored_parts
from services.preprocess.pipeline import run_preprocess
from services.preprocess.unit import write_unit
from services.terminal import EXIT_DATA, EXIT_USAGE

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer_corpus.txt"
TEXTS = FIXTURE.read_text(encoding="utf-8").splitlines()
SHAPE = ["--max-seq-length", "64", "--heldout-fraction", "0.2", "--shard-mb", "0.002"]  # 2 KB: a few shards each


def document(start: int, n: int) -> str:
    return " ".join(TEXTS[(start + i) % len(TEXTS)] for i in range(n)) + "\n"


def corpus(root: Path, n_files: int, offset: int) -> Path:
    root.mkdir(parents=True)
    for i in range(n_files):
        (root / f"doc_{i}.txt").write_text(document(offset + 5 * i, 12))
    return root


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest(root: Path) -> dict:
    return json.loads((root / MANIFEST_FILE).read_text())


def append_args(shards: Path, inputs: list[Path], *more: str) -> list[str]:
    return ["preprocess", "--append-to", str(shards), "--input", *map(str, inputs), *more]


def without_times(m: dict) -> dict:
    """A manifest less what differs between two equal runs: timings and when each part was added."""
    return {**{k: v for k, v in m.items() if k != "timings"}, "parts": [{**p, "added": None} for p in m["parts"]]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return train_tokenizer(TEXTS, tmp_path_factory.mktemp("tokenizer"), TokenizerTrainConfig(vocab_size=400))


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corpora")
    return {"base": corpus(root / "base", 6, 0), "news": corpus(root / "news", 5, 3)}


@pytest.fixture(scope="module")
def base(ray_local, tokenizer, corpora, tmp_path_factory) -> Path:
    """A finished shard set of one part (a plain `albert preprocess`)."""
    out = tmp_path_factory.mktemp("base") / "shards"
    args = ["preprocess", "--input", str(corpora["base"]), "--tokenizer", str(tokenizer), "--output", str(out)]
    assert main([*args, *SHAPE]) == 0
    return out


@pytest.fixture(scope="module")
def appended(base, corpora, tmp_path_factory) -> tuple[Path, str]:
    """A copy of `base` with the news corpus appended as part 1 "news"; what the command printed."""
    shards = tmp_path_factory.mktemp("appended") / "shards"
    shutil.copytree(base, shards)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(append_args(shards, [corpora["news"]], "--part-name", "news", "--shard-mb", "0.002")) == 0
    return shards, printed.getvalue()


# ----------------------------------------------------------------------------------------------------------
# an append


@pytest.mark.ray
def test_the_appended_part_is_listed_after_part_0_and_the_set_is_version_2(appended, corpora):
    shards, printed = appended
    m = manifest(shards)
    assert m["version"] == 3 and [p["name"] for p in m["parts"]] == ["part-0", "news"]
    parts = ShardsManifest.read(shards).parts
    assert [p.name for p in parts] == ["part-0", "news"] and ShardsManifest.read(shards).version == 2
    assert [list(p.shards) for p in parts] == [[s["name"] for s in part["shards"]] for part in m["parts"]]
    news = m["parts"][1]
    assert news["inputs"] == [str(corpora["news"])]
    assert (
        f'appended part 1 "news" to {shards}: {news["examples"]} examples in {len(news["shards"])} shards; '
        f"the set is now version 2 ({m['examples']} examples)"
    ) in printed.splitlines()


@pytest.mark.ray
def test_the_new_shards_continue_the_numbering_with_new_example_ids(appended):
    shards, _ = appended
    part0, news = manifest(shards)["parts"]
    n0 = len(part0["shards"])
    assert len(news["shards"]) >= 2
    assert [s["name"] for s in news["shards"]] == [
        f"train/shard-{i:05d}.parquet" for i in range(n0, n0 + len(news["shards"]))
    ]
    ids = {k: set() for k in (0, 1)}
    for k, part in enumerate((part0, news)):
        for s in part["shards"]:
            example_ids = pq.read_table(shards / s["name"]).column("example_id").to_pylist()
            assert {i >> 32 for i in example_ids} <= {int(s["name"][-13:-8])}  # a shard may have none
            ids[k].update(example_ids)
    assert ids[1] and not ids[0] & ids[1]


@pytest.mark.ray
def test_part_0_is_unchanged_byte_for_byte(base, appended):
    shards, _ = appended
    before, after = manifest(base), manifest(shards)
    assert after["parts"][0] == before["parts"][0]
    for s in before["parts"][0]["shards"]:
        assert sha256(shards / s["name"]) == s["sha256"]
    assert sha256(shards / HELDOUT_FILE) == sha256(base / HELDOUT_FILE) == after["heldout"]["sha256"]
    assert after["config"] == before["config"] and after["tokenizer"] == before["tokenizer"]


@pytest.mark.ray
def test_totals_add_up_and_each_part_checksum_matches_its_shards(appended):
    shards, _ = appended
    m = manifest(shards)
    for name in ("examples", "tokens", "sentences", "example_tokens"):
        assert m[name] == sum(p[name] for p in m["parts"])
    for name in ("read", "used", "heldout", "skipped"):
        assert m["documents"][name] == sum(p["documents"][name] for p in m["parts"])
    assert [s["name"] for s in m["shards"]] == [s["name"] for p in m["parts"] for s in p["shards"]]
    assert [s["part"] for s in m["shards"]] == [k for k, p in enumerate(m["parts"]) for _ in p["shards"]]
    for part in m["parts"]:
        assert all(sha256(shards / s["name"]) == s["sha256"] for s in part["shards"])
        assert part["sha256"] == hashlib.sha256("".join(s["sha256"] for s in part["shards"]).encode()).hexdigest()
        assert sha256(shards / part["heldout"]["file"]) == part["heldout"]["sha256"]
        assert pq.read_table(shards / part["heldout"]["file"]).num_rows == part["heldout"]["documents"]
    assert m["parts"][1]["heldout"]["file"] == "heldout/part-1.parquet"
    assert sha256(shards / m["unigram"]["file"]) == m["unigram"]["sha256"]


# ----------------------------------------------------------------------------------------------------------
# resume, concurrency, a rerun of the original command


@pytest.mark.ray
def test_an_interrupted_append_is_invisible_and_resumes_to_the_same_manifest(base, appended, corpora, tmp_path):
    shards = tmp_path / "shards"
    shutil.copytree(base, shards)
    args = append_args(shards, [corpora["news"]], "--part-name", "news", "--shard-mb", "0.002")
    config, job = plan_from_args(_parser().parse_args(args))
    write_unit(job.plan.units[0], job.tokenizer, config, job.fingerprint, job.layout(config.output))  # then "killed"
    job.release()  # (a killed run's lock goes with its process)
    assert (shards / MANIFEST_FILE).read_bytes() == (base / MANIFEST_FILE).read_bytes()
    assert ShardsManifest.read(shards).version == 1 and (shards / PROGRESS_DIR / "part-1" / "plan.json").is_file()

    assert main(args) == 0
    resumed = manifest(shards)
    assert resumed["timings"]["shards_resumed"] == 1
    assert without_times(resumed) == without_times(manifest(appended[0]))

    # the second of two appends that ran at once: the set has moved on, its commit is refused
    with pytest.raises(ValueError, match=r"part-1: the shard set now has 2 parts, so this run can no longer add"):
        run_preprocess(config, job)


@pytest.mark.ray
def test_a_rerun_of_the_original_preprocess_keeps_the_appended_part(appended, corpora, tokenizer, tmp_path):
    shards = tmp_path / "shards"
    shutil.copytree(appended[0], shards)
    before = manifest(shards)
    args = ["preprocess", "--input", str(corpora["base"]), "--tokenizer", str(tokenizer), "--output", str(shards)]
    assert main([*args, *SHAPE]) == 0
    after = manifest(shards)
    assert after["parts"] == before["parts"] and after["shards"] == before["shards"]
    assert {k: after[k] for k in ("examples", "documents", "files")} == {
        k: before[k] for k in ("examples", "documents", "files")
    }


def test_a_manifest_written_before_parts_reads_as_one_part(base):
    m = manifest(base)
    legacy = {k: v for k, v in m.items() if k != "parts"}
    legacy["shards"] = [{k: v for k, v in s.items() if k != "part"} for s in m["shards"]]
    new_in_v3 = ("document_ids", "unigram")  # what a manifest before parts could not record
    assert stored_parts(legacy) == [{k: v for k, v in {**m["parts"][0], "added": None}.items() if k not in new_in_v3}]
    assert part_checksum(legacy["shards"]) == m["parts"][0]["sha256"]


# ----------------------------------------------------------------------------------------------------------
# refusals: exit 2, one line, before Ray, nothing written


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="albert")
    add_preprocess_command(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> Path:
    return train_tokenizer(TEXTS, tmp_path_factory.mktemp("other"), TokenizerTrainConfig(vocab_size=300))


def cased_copy(tokenizer: Path, where: Path) -> Path:
    """The same spiece.model (same sha256) with a tokenizer_config.json that keeps case."""
    where.mkdir(parents=True, exist_ok=True)
    shutil.copy2(tokenizer, where / "spiece.model")
    (where / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False, "keep_accents": False}))
    return where / "spiece.model"


REFUSALS = {  # name -> (arguments as a function of (set, corpora, other tokenizer, tmp_path), message pattern)
    "same_model_other_casing": (
        lambda s, c, t, p: append_args(
            s, [c["news"]], "--tokenizer", str(cased_copy(ShardsManifest.read(s).tokenizer_model(), p / "cased"))
        ),
        r"--tokenizer .*: lower_case False, but the shard set .* was tokenized with lower_case True",
    ),
    "other_tokenizer": (
        lambda s, c, t, p: append_args(s, [c["news"]], "--tokenizer", str(t)),
        r"--tokenizer .*: sha256 [0-9a-f]{64}, but the shard set .* was tokenized with sha256 [0-9a-f]{64}",
    ),
    "max_seq_length": (
        lambda s, c, t, p: append_args(s, [c["news"]], "--max-seq-length", "128"),
        r"--max-seq-length 128: the shard set .* was made with --max-seq-length 64",
    ),
    "objective": (
        lambda s, c, t, p: append_args(s, [c["news"]], "--objective", "nsp"),
        r"--objective nsp: the shard set .* was made with --objective sop",
    ),
    "no_manifest": (
        lambda s, c, t, p: append_args(p, [c["news"]]),
        r"--append-to .*: no manifest.json, so not a finished shard set",
    ),
    "input_in_part_0": (
        lambda s, c, t, p: append_args(s, [c["news"], c["base"] / "doc_2.txt"]),
        r'input file .*base/doc_2.txt: already in part 0 "part-0" of the shard set',
    ),
    "duplicate_part_name": (
        lambda s, c, t, p: append_args(s, [c["news"]], "--part-name", "part-0"),
        r'--part-name part-0: the shard set .* already has a part "part-0" \(part 0\)',
    ),
    "other_output": (
        lambda s, c, t, p: [*append_args(s, [c["news"]]), "--output", str(p / "elsewhere")],
        r"--output .*elsewhere: not with --append-to",
    ),
}


@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails: a refusal must come before it


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_a_mistaken_append_exits_with_one_line_before_ray(
    base, corpora, other_tokenizer, tmp_path, no_ray, capsys, name
):
    make, message = REFUSALS[name]
    before = (base / MANIFEST_FILE).read_bytes()
    expected = EXIT_USAGE if name == "other_output" else EXIT_DATA  # two options that conflict; a bad value
    assert main(make(base, corpora, other_tokenizer, tmp_path)) == expected
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("albert: error: ") and re.search(message, line), line
    assert (base / MANIFEST_FILE).read_bytes() == before and not (base / PROGRESS_DIR / "part-1").exists()


def test_an_unfinished_append_of_other_inputs_is_refused_naming_its_folder(base, corpora, tmp_path, no_ray, capsys):
    shards = tmp_path / "shards"
    shutil.copytree(base, shards)
    plan_from_args(_parser().parse_args(append_args(shards, [corpora["news"]])))  # claimed, then abandoned
    assert main(append_args(shards, [corpora["news"] / "doc_0.txt"])) == EXIT_DATA
    [line] = capsys.readouterr().err.splitlines()
    assert line == (
        f"albert: error: {shards / PROGRESS_DIR / 'part-1'}: holds an unfinished append of part 1 with other inputs, "
        "input sizes or options; rerun the same command or delete it"
    )


def test_albert_submit_forwards_an_append_to_the_job_as_it_is():
    own, job_args = split_submit_args(["--append-to", "/mnt/shards", "--input", "/mnt/news", "--wait"])
    assert own == ["--wait"] and job_args == ["--append-to", "/mnt/shards", "--input", "/mnt/news"]
    assert prepare_job_args("preprocess", job_args, ".") == (job_args, [])
    assert build_entrypoint("preprocess", job_args).endswith("preprocess --append-to /mnt/shards --input /mnt/news")
    assert build_parser().parse_args(["preprocess", *job_args]).append_to == "/mnt/shards"  # the job's albert
