"""The Ray Data preprocess service end to end: shards, held-out documents, manifest accounting, bad input, resume."""

from __future__ import annotations

import argparse
import bz2
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from albert_core.evaluation.intrinsic import read_heldout
from albert_core.examples.pairs import IGNORE_LABEL
from albert_core.examples.shards import EXAMPLE_SCHEMA, HELDOUT_FILE, MANIFEST_FILE, TRAIN_DIR, document_hash
from albert_core.text.corpus import read_documents
from albert_core.text.records import CorpusError, Document
from albert_core.text.sentences import split_sentences
from albert_core.text.tokenization import Tokenizer, TokenizerTrainConfig, preprocess_sentences, train_tokenizer
from services.preprocess.cli import register
from services.preprocess.config import PreprocessConfig
from services.preprocess.layout import PROGRESS_DIR
from services.preprocess.pipeline import run_preprocess
from services.preprocess.plan import list_input_files
from services.preprocess.unit import PHASES

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer_corpus.txt"
TEXTS = FIXTURE.read_text(encoding="utf-8").splitlines()
HELDOUT_FRACTION = 0.2
uses_ray = [pytest.mark.ray, pytest.mark.usefixtures("ray_local")]


def sentences(start: int, n: int) -> str:
    return " ".join(TEXTS[(start + i) % len(TEXTS)] for i in range(n))


def wiki_page(page_id: int, title: str, text: str) -> str:
    return (
        f"<page><title>{title}</title><ns>0</ns><id>{page_id}</id>"
        f'<revision><text xml:space="preserve">{text}</text></revision></page>'
    )


WIKI_HEAD = '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">'


def write_good(root: Path) -> None:
    """Documents every reader turns into Documents: 10 text files, JSONL records and wiki pages."""
    root.mkdir(parents=True)
    for i in range(10):
        (root / f"doc_{i:02d}.txt").write_text(sentences(3 * i, 4 + i % 5) + "\n")
    records = [json.dumps({"text": sentences(5 * i + 1, 6), "id": i}) for i in range(6)]
    (root / "records.jsonl").write_text("\n".join(records) + "\n")
    pages = [wiki_page(10 + i, f"Page {i}", sentences(7 * i + 2, 5)) for i in range(3)]
    (root / "pages.xml.bz2").write_bytes(bz2.compress((WIKI_HEAD + "".join(pages) + "</mediawiki>").encode()))


# file name -> (bytes, the skips it must show: reason -> count)
BAD_FILES: dict[str, tuple[bytes, dict[str, int]]] = {
    "invalid_utf8.txt": (b"A good start. Then a bad byte \xff here.\n", {"invalid_utf8": 1}),
    "binary.txt": (bytes(range(256)) * 8, {"binary": 1}),
    "empty.txt": (b"", {"empty": 1}),
    "blank_record.jsonl": (
        (json.dumps({"text": "   "}) + "\n" + json.dumps({"text": sentences(11, 4)}) + "\n").encode(),
        {"empty": 1},
    ),
    "malformed.jsonl": (
        (
            json.dumps({"text": sentences(1, 4)}) + "\n{not json\n" + json.dumps({"text": sentences(9, 4)}) + "\n"
        ).encode(),
        {"malformed_record": 1},
    ),
    "long_line.txt": (b"word " * 1_000_000 + b"\n", {"too_long": 1}),  # a 5 MB line, > max_document_chars
    "malformed.xml": (
        (WIKI_HEAD + wiki_page(1, "Kept", sentences(4, 5)) + "<page><title>Broken</title><ns>0</n").encode(),
        {"malformed_xml": 1},
    ),
    "single_token.txt": (b"the\n", {"single_token": 1}),
    "one_sentence.txt": (TEXTS[0].encode() + b"\n", {}),  # a one-sentence document still makes a pair
}
MISSING = "missing.txt"
GOOD_DOCUMENTS = {"blank_record.jsonl": 1, "malformed.jsonl": 2, "malformed.xml": 1, "one_sentence.txt": 1}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(TEXTS, out, TokenizerTrainConfig(vocab_size=400))
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer.load(tokenizer_dir)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_good(root / "good")
    (root / "bad").mkdir()
    for name, (data, _) in BAD_FILES.items():
        (root / "bad" / name).write_bytes(data)
    return root


def make_config(corpus: Path, tokenizer_dir: Path, output: Path, **overrides) -> PreprocessConfig:
    options = dict(
        inputs=[str(corpus / "good"), str(corpus / "bad"), str(corpus / MISSING)],
        tokenizer=str(tokenizer_dir),
        output=str(output),
        max_seq_length=64,
        heldout_fraction=HELDOUT_FRACTION,
        shard_input_bytes=600,  # several shards from this small corpus
        docs_per_group=4,
        skip_missing_inputs=True,  # MISSING is a counted skip (the CLI's explicit --on-error skip)
        progress=False,
    )
    options.update(overrides)
    return PreprocessConfig(**options)


@pytest.fixture(scope="module")
def skip_run(ray_local, corpus, tokenizer_dir, tmp_path_factory) -> tuple[PreprocessConfig, dict]:
    config = make_config(corpus, tokenizer_dir, tmp_path_factory.mktemp("skip") / "out")
    return config, run_preprocess(config)


def shard_paths(config: PreprocessConfig, manifest: dict) -> list[Path]:
    return [Path(config.output) / s["name"] for s in manifest["shards"]]


def read_shards(config: PreprocessConfig, manifest: dict) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in shard_paths(config, manifest)])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------------------------------------
# accounting and bad input (on_error="skip")


@pytest.mark.ray
def test_every_document_read_is_used_held_out_or_skipped(skip_run, corpus):
    config, manifest = skip_run
    docs = manifest["documents"]
    assert docs["read"] == docs["used"] + docs["heldout"] + docs["skipped"]
    expected_read = sum(1 for _ in read_documents([*config.inputs[:2], config.inputs[2]]))
    assert docs["read"] == expected_read
    for path, stats in manifest["files"].items():
        assert stats["documents"] == stats["used"] + stats["heldout"] + sum(stats["skipped"].values()), path


@pytest.mark.ray
@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_input_is_a_counted_skip_with_its_reason_and_good_documents_are_kept(skip_run, corpus, name):
    _, manifest = skip_run
    stats = manifest["files"][str(corpus / "bad" / name)]
    assert stats["skipped"] == BAD_FILES[name][1]
    assert stats["used"] + stats["heldout"] == GOOD_DOCUMENTS.get(name, 0)


@pytest.mark.ray
def test_a_missing_input_path_is_a_counted_skip(skip_run, corpus):
    _, manifest = skip_run
    assert manifest["files"][str(corpus / MISSING)]["skipped"] == {"missing": 1}


@pytest.mark.ray
def test_skip_details_name_the_record(skip_run, corpus):
    _, manifest = skip_run
    [example] = manifest["files"][str(corpus / "bad" / "malformed.jsonl")]["skip_examples"]
    assert example["location"] == "line 2" and example["reason"] == "malformed_record"


@pytest.mark.ray
def test_pair_skips_name_the_document_and_its_token_count(skip_run, corpus):
    _, manifest = skip_run
    [example] = manifest["files"][str(corpus / "bad" / "single_token.txt")]["skip_examples"]
    assert example == {"location": "file", "reason": "single_token", "detail": "1 tokens: a pair needs at least 2"}


@pytest.mark.ray
def test_good_files_have_no_skips(skip_run, corpus):
    _, manifest = skip_run
    good = {p: s for p, s in manifest["files"].items() if p.startswith(str(corpus / "good"))}
    assert len(good) == 12
    assert all(s["skipped"] == {} and s["used"] + s["heldout"] == s["documents"] for s in good.values())
    assert sum(s["documents"] for s in good.values()) == 10 + 6 + 3


@pytest.mark.ray
def test_manifest_totals_skips_by_reason(skip_run):
    _, manifest = skip_run
    expected: dict[str, int] = {"missing": 1}
    for _, reasons in BAD_FILES.values():
        for reason, n in reasons.items():
            expected[reason] = expected.get(reason, 0) + n
    assert manifest["documents"]["skipped_by_reason"] == dict(sorted(expected.items()))


@pytest.mark.ray
def test_manifest_counts_the_sentences_and_tokens_of_every_encoded_document(skip_run, corpus, tokenizer):
    config, manifest = skip_run
    path = corpus / "good" / "records.jsonl"
    docs = [r for r in read_documents(path) if isinstance(r, Document)]
    sents = [s for d in docs for s in split_sentences(d.text)]
    stats = manifest["files"][str(path)]
    assert stats["sentences"] == len(sents)
    assert stats["tokens"] == sum(len(tokenizer.encode(s)) for s in sents)
    assert manifest["tokens"] == sum(s["tokens"] for s in manifest["files"].values())


# ----------------------------------------------------------------------------------------------------------
# shards


@pytest.mark.ray
def test_shards_read_with_pyarrow_alone_in_the_exact_schema(skip_run):
    config, manifest = skip_run
    assert len(manifest["shards"]) > 3
    for path in shard_paths(config, manifest):
        assert pq.read_schema(path).equals(EXAMPLE_SCHEMA)
        assert pq.read_table(path).schema.equals(EXAMPLE_SCHEMA)


@pytest.mark.ray
def test_manifest_lists_each_shard_with_its_rows_and_sha256(skip_run):
    config, manifest = skip_run
    assert sorted(p.name for p in (Path(config.output) / TRAIN_DIR).iterdir()) == [
        Path(s["name"]).name for s in manifest["shards"]
    ]
    for shard, path in zip(manifest["shards"], shard_paths(config, manifest), strict=True):
        assert shard["rows"] == pq.read_metadata(path).num_rows
        assert shard["sha256"] == sha256(path)
    assert manifest["examples"] == sum(s["rows"] for s in manifest["shards"]) > 0


@pytest.mark.ray
def test_each_unit_records_its_cpu_time_by_phase_and_the_manifest_sums_them(skip_run):
    config, manifest = skip_run
    markers = [json.loads(p.read_text()) for p in (Path(config.output) / PROGRESS_DIR).glob("shard-*.json")]
    assert len(markers) == len(manifest["shards"])
    for marker in markers:
        phases = marker["cpu_phases"]
        assert list(phases) == list(PHASES) and min(phases.values()) >= 0
        assert sum(phases.values()) == pytest.approx(marker["cpu_seconds"], abs=0.01)  # every lap charged once
    sums = {phase: sum(m["cpu_phases"][phase] for m in markers) for phase in PHASES}
    assert sums["read"] > 0 and sums["encode"] > 0  # (a unit of bad files alone encodes nothing)
    assert manifest["timings"]["worker_cpu_phases"] == pytest.approx(sums, abs=0.001)


@pytest.mark.ray
def test_rows_are_cls_a_sep_b_sep_with_matching_types_and_word_starts(skip_run, tokenizer):
    config, manifest = skip_run
    rows = read_shards(config, manifest).to_pylist()
    for row in rows:
        ids, types = row["input_ids"], row["token_type_ids"]
        assert len(ids) <= config.max_seq_length
        assert ids[0] == tokenizer.cls_id and ids[-1] == tokenizer.sep_id
        first_sep = types.index(1) - 1
        assert ids[first_sep] == tokenizer.sep_id and first_sep >= 2 and len(ids) - first_sep >= 3
        assert types == [0] * (first_sep + 1) + [1] * (len(ids) - first_sep - 1)
        assert row["word_starts"] == tokenizer.word_starts(ids).tolist()
        assert row["pair_label"] in (0, 1)
    assert manifest["example_tokens"] == sum(len(r["input_ids"]) for r in rows)


@pytest.mark.ray
def test_example_ids_are_shard_and_row(skip_run):
    config, manifest = skip_run
    for index, path in enumerate(shard_paths(config, manifest)):
        ids = pq.read_table(path, columns=["example_id"]).column(0).to_numpy()
        assert (ids == (int(path.stem.split("-")[1]) << 32) + np.arange(len(ids))).all(), index


@pytest.mark.ray
def test_sop_labels_are_both_present(skip_run):
    config, manifest = skip_run
    labels = read_shards(config, manifest).column("pair_label").to_numpy()
    assert set(labels.tolist()) == {0, 1}


# ----------------------------------------------------------------------------------------------------------
# held-out documents


@pytest.mark.ray
def test_held_out_documents_are_the_ones_the_hash_of_their_text_picks(skip_run, corpus):
    config, manifest = skip_run
    expected = []
    for root in config.inputs:
        for record in read_documents(root):
            if isinstance(record, Document):
                h = document_hash(record.text)
                if h < HELDOUT_FRACTION * 2**64:
                    expected.append(h >> 1)
    documents = read_heldout(str(Path(config.output) / HELDOUT_FILE))
    assert expected and sorted(d.doc_id for d in documents) == sorted(expected)
    assert manifest["heldout"]["documents"] == manifest["documents"]["heldout"] == len(expected)


@pytest.mark.ray
def test_held_out_documents_keep_sentences_and_word_starts(skip_run, tokenizer):
    config, _ = skip_run
    documents = read_heldout(str(Path(config.output) / HELDOUT_FILE))
    assert all(d.sentences for d in documents)
    for d in documents:
        assert [tokenizer.word_starts(s).tolist() for s in d.sentences] == d.word_starts


# ----------------------------------------------------------------------------------------------------------
# determinism, resume, streaming


@pytest.fixture(scope="module")
def second_run(skip_run, corpus, tokenizer_dir, tmp_path_factory) -> tuple[PreprocessConfig, dict, dict]:
    """The same job into another directory; also returns the shard hashes as first written."""
    config = make_config(corpus, tokenizer_dir, tmp_path_factory.mktemp("second") / "out")
    manifest = run_preprocess(config)
    return config, manifest, {p.name: sha256(p) for p in shard_paths(config, manifest)}


@pytest.mark.ray
def test_the_same_inputs_and_seed_give_byte_identical_shards(skip_run, second_run):
    config, manifest = skip_run
    _, _, second_hashes = second_run
    assert {p.name: sha256(p) for p in shard_paths(config, manifest)} == second_hashes
    assert sha256(Path(config.output) / HELDOUT_FILE) == sha256(Path(second_run[0].output) / HELDOUT_FILE)


@pytest.mark.ray
def test_resume_redoes_only_a_deleted_shard(second_run):
    config, manifest, hashes = second_run
    paths = shard_paths(config, manifest)
    victim = paths[1]
    victim.unlink()
    (Path(config.output) / PROGRESS_DIR / f"{victim.stem}.json").unlink()
    before = {p.name: p.stat().st_mtime_ns for p in paths if p != victim}
    resumed = run_preprocess(config)
    assert {p.name: p.stat().st_mtime_ns for p in paths if p != victim} == before
    assert sha256(victim) == hashes[victim.name]
    assert resumed["timings"]["shards_written"] == 1
    assert resumed["documents"] == manifest["documents"] and resumed["shards"] == manifest["shards"]


@pytest.mark.ray
def test_resume_redoes_a_shard_whose_bytes_no_longer_match_its_marker(second_run):
    config, manifest, hashes = second_run
    victim = shard_paths(config, manifest)[0]
    victim.write_bytes(victim.read_bytes()[:-10])  # truncated behind the marker's back
    resumed = run_preprocess(config)
    assert sha256(victim) == hashes[victim.name]
    assert resumed["timings"]["shards_written"] == 1


@pytest.mark.ray
def test_rerun_of_a_complete_output_writes_nothing(second_run):
    config, manifest, _ = second_run
    again = run_preprocess(config)
    assert again["timings"]["shards_written"] == 0 and again["shards"] == manifest["shards"]


@pytest.mark.ray
def test_a_different_job_into_an_existing_output_is_refused(second_run):
    config, _, _ = second_run
    other = PreprocessConfig(**{**config.__dict__, "seed": config.seed + 1})
    with pytest.raises(ValueError, match="other inputs, input sizes, tokenizer or options"):
        run_preprocess(other)


# ----------------------------------------------------------------------------------------------------------
# objectives


@pytest.mark.ray
@pytest.mark.parametrize(("objective", "labels"), [("nsp", {0, 1}), ("none", {IGNORE_LABEL})])
def test_nsp_and_none_objectives_label_pairs(ray_local, corpus, tokenizer_dir, tmp_path, objective, labels):
    # units of several documents: NSP draws its random B from another document of the same unit's group
    good = [str(corpus / "good")]
    config = make_config(
        corpus, tokenizer_dir, tmp_path / "out", inputs=good, objective=objective, shard_input_bytes=1 << 20
    )
    manifest = run_preprocess(config)
    assert set(read_shards(config, manifest).column("pair_label").to_pylist()) == labels
    assert manifest["config"]["objective"] == objective


# ----------------------------------------------------------------------------------------------------------
# on_error="fail"

FAIL_MESSAGES = {
    "invalid_utf8.txt": r"invalid_utf8.txt: file: invalid_utf8: byte 0xff at line 1",
    "binary.txt": r"binary.txt: file: binary: NUL byte",
    "empty.txt": r"empty.txt: file: empty:",
    "blank_record.jsonl": r"blank_record.jsonl: line 1: empty:",
    "malformed.jsonl": r"malformed.jsonl: line 2: malformed_record: expected a JSON object",
    "long_line.txt": r"long_line.txt: file: too_long:",
    "malformed.xml": r"malformed.xml: line 1, column \d+: malformed_xml:",
}


@pytest.mark.ray
@pytest.mark.parametrize("name", sorted(FAIL_MESSAGES))
def test_on_error_fail_stops_naming_the_file_and_line_or_record(ray_local, corpus, tokenizer_dir, tmp_path, name):
    path = corpus / "bad" / name
    config = make_config(corpus, tokenizer_dir, tmp_path / "out", inputs=[str(path)], on_error="fail")
    with pytest.raises(CorpusError, match=FAIL_MESSAGES[name]):
        run_preprocess(config)
    assert not (Path(config.output) / MANIFEST_FILE).exists()
    # only units that committed keep a shard (a region of the file before the bad record may have): none half-made
    committed = {json.loads(m.read_text())["shard"] for m in (Path(config.output) / PROGRESS_DIR).glob("shard-*.json")}
    assert {p.name for p in (Path(config.output) / TRAIN_DIR).iterdir()} == committed
    assert not list((Path(config.output) / PROGRESS_DIR).glob("*.partial"))


@pytest.mark.parametrize("on_error", ["skip", "fail"])
def test_a_missing_input_stops_the_run_before_anything_is_written(corpus, tokenizer_dir, tmp_path, on_error):
    inputs = [str(corpus / "good"), str(corpus / MISSING)]
    config = make_config(
        corpus, tokenizer_dir, tmp_path / "out", inputs=inputs, on_error=on_error, skip_missing_inputs=False
    )
    with pytest.raises(ValueError, match=rf"^input {corpus / MISSING}: no such file or directory \(expected"):
        run_preprocess(config)
    assert not (tmp_path / "out").exists()


@pytest.mark.ray
def test_after_a_failure_completed_shards_stay_valid_and_a_skip_rerun_keeps_them(
    ray_local, corpus, tokenizer_dir, tmp_path
):
    inputs = [str(corpus / "good"), str(corpus / "bad" / "malformed.jsonl")]
    config = make_config(corpus, tokenizer_dir, tmp_path / "out", inputs=inputs, on_error="fail")
    with pytest.raises(CorpusError, match="malformed.jsonl: line 2"):
        run_preprocess(config)
    markers = sorted((Path(config.output) / PROGRESS_DIR).glob("shard-*.json"))
    assert markers  # the good files' shards were committed before the bad one
    written = {}
    for marker in markers:
        summary = json.loads(marker.read_text())
        shard = Path(config.output) / TRAIN_DIR / summary["shard"]
        assert sha256(shard) == summary["sha256"]
        pq.read_table(shard)  # complete and readable
        written[shard] = shard.stat().st_mtime_ns
    manifest = run_preprocess(PreprocessConfig(**{**config.__dict__, "on_error": "skip"}))
    assert {p: p.stat().st_mtime_ns for p in written} == written
    assert manifest["timings"]["shards_resumed"] == len(markers)
    assert manifest["documents"]["skipped_by_reason"] == {"malformed_record": 1}


# ----------------------------------------------------------------------------------------------------------
# CLI and configuration


@pytest.mark.ray
def test_cli_preprocess_runs_and_prints_the_counts(ray_local, corpus, tokenizer_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="albert")
    register(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "cli"
    args = parser.parse_args(
        ["preprocess", "--input", str(corpus / "good"), "--tokenizer", str(tokenizer_dir / "spiece.model")]
        + ["--output", str(out), "--objective", "nsp", "--max-seq-length", "64", "--on-error", "fail"]
    )
    assert args.func(args) == 0
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    printed = capsys.readouterr().out
    d = manifest["documents"]
    assert f"{d['read']} read, {d['used']} used, {d['heldout']} held out, {d['skipped']} skipped" in printed
    assert f"examples: {manifest['examples']}" in printed and "tokens/s" in printed
    assert manifest["config"]["objective"] == "nsp" and manifest["config"]["max_seq_length"] == 64


def test_a_document_is_known_by_its_text_not_by_where_it_is_found():
    assert document_hash("the same text") == document_hash("the same text")
    assert document_hash("the same text") != document_hash("the same text.")
    assert 0 <= document_hash("x") < 2**64


def test_an_input_directory_without_corpus_files_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.json").write_text("{}")
    with pytest.raises(ValueError, match=r"empty: no input files found"):
        list_input_files(PreprocessConfig(inputs=[str(tmp_path / "empty")], tokenizer="t", output="o"))


def test_a_missing_tokenizer_fails_before_anything_is_written(corpus, tmp_path):
    config = PreprocessConfig(
        inputs=[str(corpus / "good")], tokenizer=str(tmp_path / "none"), output=str(tmp_path / "o")
    )
    with pytest.raises(FileNotFoundError, match="no SentencePiece model"):
        run_preprocess(config)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("field", "value"),
    [("objective", "mlm"), ("on_error", "ignore"), ("heldout_fraction", 1.0), ("docs_per_group", 0), ("inputs", [])],
)
def test_invalid_config_values_are_rejected_naming_the_field(field, value):
    options = {"inputs": ["x"], "tokenizer": "t", "output": "o", field: value}
    with pytest.raises(ValueError, match=f"PreprocessConfig.{field}"):
        PreprocessConfig(**options)


def test_max_seq_length_is_checked_by_the_pair_config():
    with pytest.raises(ValueError, match="max_seq_length"):
        PreprocessConfig(inputs=["x"], tokenizer="t", output="o", max_seq_length=4)


# ----------------------------------------------------------------------------------------------------------
# the fast preprocessing equals the tokenizer's


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet=st.characters(blacklist_characters="\n"), max_size=30), max_size=6))
def test_preprocess_sentences_equals_the_tokenizer_preprocessing(tokenizer, texts):
    assert preprocess_sentences(tokenizer, texts) == [tokenizer.preprocess(t) for t in texts]


@pytest.mark.parametrize(
    "texts",
    [
        ["ΟΔΟΣ", "Σίσυφος ΣΑΣ"],  # final sigma at the end of one sentence, capital sigma starting the next
        ["Café naïve", "résumé ``quoted''", "a`", "`b"],
        ["ﬁnancial ½ Ⅻ ＡＢＣ", "e\u0301\u0327 combining marks"],
        ["line\nbreak", "plain"],  # a newline inside a sentence takes the plain path
    ],
)
def test_preprocess_sentences_matches_on_edge_cases(tokenizer, texts):
    assert preprocess_sentences(tokenizer, texts) == [tokenizer.preprocess(t) for t in texts]


def test_config_paths_are_strings_and_survive_a_json_round_trip():
    config = PreprocessConfig(inputs="corpus", tokenizer=Path("t"), output=Path("o"))
    assert config.inputs == ["corpus"] and config.tokenizer == "t" and config.output == "o"
    assert PreprocessConfig(**json.loads(json.dumps(config.__dict__))) == config
