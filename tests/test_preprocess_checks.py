"""`albert preprocess` mistakes are caught early and said clearly: bad arguments and inputs that match nothing exit 2
before Ray is even imported; a run without training examples is an error; skipped files are named on the console;
a small corpus made with the defaults is one a 2-worker pretrain plan takes, and when a shard set is too small
for a recipe, pretrain's refusal gives the exact options that fit."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from albert_core.examples.shards import EXAMPLE_SCHEMA, MANIFEST_FILE, TRAIN_DIR
from albert_core.model.config import ConfigError
from albert_core.text.tokenization import TokenizerTrainConfig, train_tokenizer
from services.cli import main
from services.preprocess.checks import NoExamplesError
from services.preprocess.cli import config_from_args
from services.preprocess.cli import register as add_preprocess_command
from services.preprocess.config import PreprocessConfig
from services.preprocess.layout import PROGRESS_DIR
from services.preprocess.pipeline import run_preprocess
from services.rundir.config import RunConfig
from services.terminal import EXIT_DATA
from services.train.plan import plan_data

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer_corpus.txt"
TEXTS = FIXTURE.read_text(encoding="utf-8").splitlines()
ALBERT = str(Path(sys.executable).with_name("albert"))
BAD_FILES = {  # file -> the reason it is skipped
    "a_binary.txt": (bytes(range(256)) * 8, "binary"),
    "b_empty.txt": (b"", "empty"),
    "c_invalid_utf8.txt": (b"A good start. Then a bad byte \xff here.\n", "invalid_utf8"),
    "d_malformed.jsonl": (b'{"text": "Fine text. And more of it."}\n{not json\n', "malformed_record"),
    "e_no_field.jsonl": (b'{"title": "no text field"}\n', "missing_field"),
    "f_single_token.txt": (b"the\n", "single_token"),
    "g_broken.xml": (b"<mediawiki><page><title>Broken</title><ns>0</n", "malformed_xml"),
}


def document(start: int, n: int) -> str:
    return " ".join(TEXTS[(start + i) % len(TEXTS)] for i in range(n)) + "\n"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return train_tokenizer(TEXTS, tmp_path_factory.mktemp("tokenizer"), TokenizerTrainConfig(vocab_size=400))


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("good")
    for i in range(4):
        (root / f"doc_{i}.txt").write_text(document(5 * i, 12))
    return root


@pytest.fixture
def no_ray(monkeypatch):
    """`import ray` fails from here on (sys.modules[name] = None), so a command that reaches Ray fails loudly."""
    monkeypatch.setitem(sys.modules, "ray", None)


def preprocess_args(inputs: list[str], tokenizer: Path | str, output: Path | str, *more: str) -> list[str]:
    return ["preprocess", "--input", *inputs, "--tokenizer", str(tokenizer), "--output", str(output), *more]


# ----------------------------------------------------------------------------------------------------------
# before Ray: one line, exit 2


def test_a_mistyped_input_exits_65_with_one_line_and_ray_never_imported(tokenizer, good, tmp_path):
    fake = tmp_path / "no-ray" / "ray"  # shadows the real package in the child process
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("this command must not import ray")\n')
    typo, out = f"{good}x", tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(fake.parent)}
    done = subprocess.run(
        [ALBERT, *preprocess_args([typo], tokenizer, out)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == EXIT_DATA, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"albert: error: input {typo}: no such file or directory (expected a corpus file, a directory of them, "
        "a glob or an fsspec URL; --on-error skip goes on without it)"
    ]
    assert not out.exists()


def _notes(tmp_path: Path) -> Path:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.json").write_text("{}")
    return tmp_path / "notes"


def _other_plan(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    (out / PROGRESS_DIR).mkdir(parents=True)
    (out / PROGRESS_DIR / "plan.json").write_text(json.dumps({"fingerprint": "another run"}))
    return out


BAD_ARGUMENTS = {  # name -> (arguments after the three paths | a function of tmp_path, message pattern)
    "heldout_fraction": (
        ["--heldout-fraction", "1.5"],
        r"--heldout-fraction: expected a fraction in \[0, 1\), got 1\.5",
    ),
    "short_seq_prob_nan": (["--short-seq-prob", "nan"], r"--short-seq-prob: expected a probability in \[0, 1\]"),
    "shard_mb_zero": (["--shard-mb", "0"], r"--shard-mb: expected a number of megabytes > 0, got 0.0"),
    "shard_mb_negative": (["--shard-mb", "-1"], r"--shard-mb: expected a number of megabytes > 0"),
    "max_seq_length_small": (["--max-seq-length", "4"], r"--max-seq-length: expected an integer >= 5"),
    "max_seq_length_vs_tokenizer": (["--max-seq-length", "1024"], r"above the tokenizer's model_max_length 512"),
    "num_cpus": (["--num-cpus", "0"], r"--num-cpus: expected an integer >= 1, got 0"),
}


@pytest.mark.parametrize("name", sorted(BAD_ARGUMENTS))
def test_a_bad_number_exits_65_naming_the_option_before_ray(no_ray, tokenizer, good, tmp_path, capsys, name):
    more, message = BAD_ARGUMENTS[name]
    assert main(preprocess_args([str(good)], tokenizer, tmp_path / "out", *more)) == EXIT_DATA
    [line] = capsys.readouterr().err.splitlines()
    assert re.search(message, line), line
    assert not (tmp_path / "out").exists()


BAD_PATHS = {  # name -> (inputs, tokenizer, output) as functions of (good, tokenizer, tmp_path), message pattern
    "glob_matches_nothing": (lambda g, t, p: ([f"{g}/*.txtx"], t, p / "out"), r"\*\.txtx: the pattern matches no file"),
    "no_corpus_files": (lambda g, t, p: ([str(_notes(p))], t, p / "out"), r"notes: no input files found"),
    "all_missing_with_skip": (
        lambda g, t, p: ([f"{g}x", f"{g}y"], t, p / "out", "--on-error", "skip"),
        r"none of the inputs exists",
    ),
    "tokenizer_missing": (lambda g, t, p: ([str(g)], p / "none.model", p / "out"), r"no SentencePiece model at"),
    "tokenizer_not_a_model": (lambda g, t, p: ([str(g)], g / "doc_0.txt", p / "out"), r"not a SentencePiece model"),
    "output_is_a_file": (lambda g, t, p: ([str(g)], t, g / "doc_0.txt"), r"doc_0.txt: exists and is not a directory"),
    "output_under_a_file": (lambda g, t, p: ([str(g)], t, g / "doc_0.txt" / "out"), r"doc_0.txt is not a directory"),
    "output_url": (lambda g, t, p: ([str(g)], t, "gs://bucket/out"), r"expected a local directory"),
    "output_of_another_plan": (
        lambda g, t, p: ([str(g)], t, _other_plan(p)),
        r"holds a preprocess run with other inputs, input sizes, tokenizer or options",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_PATHS))
def test_a_bad_path_exits_65_naming_it_before_ray(no_ray, tokenizer, good, tmp_path, capsys, name):
    make, message = BAD_PATHS[name]
    inputs, tok, out, *more = make(good, tokenizer, tmp_path)
    existed = Path(str(out)).exists()
    assert main(preprocess_args(inputs, tok, out, *more)) == EXIT_DATA
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("albert: error: ") and re.search(message, line), line
    assert Path(str(out)).exists() == existed  # nothing made


def test_on_error_default_refuses_missing_inputs_and_skips_bad_records():
    parser = argparse.ArgumentParser()
    add_preprocess_command(parser.add_subparsers())

    def config(*more: str) -> PreprocessConfig:
        return config_from_args(parser.parse_args(preprocess_args(["c"], "t", "o", *more)))

    assert (config().on_error, config().skip_missing_inputs) == ("skip", False)
    assert (config("--on-error", "skip").on_error, config("--on-error", "skip").skip_missing_inputs) == ("skip", True)
    assert (config("--on-error", "fail").on_error, config("--on-error", "fail").skip_missing_inputs) == ("fail", False)


# ----------------------------------------------------------------------------------------------------------
# runs (real Ray)


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad")
    for name, (data, _) in BAD_FILES.items():
        (root / name).write_bytes(data)
    return root


@pytest.mark.ray
def test_skipped_files_are_named_on_the_console(ray_local, tokenizer, good, bad_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(preprocess_args([str(good), str(bad_dir)], tokenizer, out, "--max-seq-length", "64")) == 0
    printed = capsys.readouterr().out.splitlines()
    start = printed.index(f"skipped {len(BAD_FILES)} documents in {len(BAD_FILES)} files:")
    shown = sorted(BAD_FILES)[:5]
    for line, name in zip(printed[start + 1 : start + 6], shown, strict=True):
        assert line.startswith(f"  {bad_dir / name}: {BAD_FILES[name][1]} 1 (first: "), line
    assert printed[start + 6] == f"  and {len(BAD_FILES) - 5} more; see {out / MANIFEST_FILE}"


@pytest.mark.ray
def test_a_run_without_training_examples_is_an_error_and_writes_no_manifest(
    ray_local, tokenizer, bad_dir, tmp_path, capsys
):
    out = tmp_path / "out"
    inputs = [str(bad_dir / name) for name in ("a_binary.txt", "b_empty.txt", "f_single_token.txt")]
    assert main(preprocess_args(inputs, tokenizer, out)) == EXIT_DATA
    captured = capsys.readouterr()
    [line] = [line for line in captured.err.splitlines() if line.startswith("albert:")]  # besides the progress bar
    assert line == (
        f"albert: error: {out}: no training examples: 3 documents read, 0 used, 0 held out, 3 skipped (binary 1, "
        "empty 1, single_token 1); no manifest.json written; check --input, --format, --text-field"
    )
    assert f"  {bad_dir / 'b_empty.txt'}: empty 1 (first: file: " in captured.out
    assert not (out / MANIFEST_FILE).exists()
    config = PreprocessConfig(inputs=inputs, tokenizer=str(tokenizer), output=str(out), progress=False)
    with pytest.raises(NoExamplesError, match="no training examples"):
        run_preprocess(config)  # the rerun resumes the empty shards and refuses again


@pytest.mark.ray
def test_an_explicit_on_error_skip_makes_a_missing_input_a_counted_skip(ray_local, tokenizer, good, tmp_path):
    out = tmp_path / "out"
    assert main(preprocess_args([str(good), f"{good}x"], tokenizer, out, "--on-error", "skip")) == 0
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["files"][f"{good}x"]["skipped"] == {"missing": 1} and manifest["examples"] > 0


@pytest.mark.ray
def test_a_small_corpus_with_the_defaults_makes_shards_a_two_worker_tiny_plan_takes(ray_local, tokenizer, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"doc_{i:02d}.txt").write_text(document(i, 40))
    assert sum(p.stat().st_size for p in corpus.iterdir()) < 1 << 20
    out = tmp_path / "out"
    assert main(preprocess_args([str(corpus)], tokenizer, out)) == 0  # every option at its default: one shard
    overrides = {"data.shards": str(out), "train.num_workers": 2}
    tiny = RunConfig.load("tiny", overrides=overrides)
    with pytest.raises(ConfigError) as refused:  # tiny trains on shorter rows than the default 512 makes
        plan_data(out, tiny)
    seq = tiny.data.max_seq_length
    assert str(refused.value) == (
        f"data.max_seq_length: {seq}, but {out} was preprocessed with --max-seq-length 512 (its manifest.json); "
        f"preprocess again with --max-seq-length {seq} into a new --output, or train on these with "
        "--set data.max_seq_length=512"
    )
    config = RunConfig.load("tiny", overrides={**overrides, "data.max_seq_length": 512})  # the --set it names
    config.validate()
    rows = plan_data(out, config).rows
    assert len(rows) >= 1 and sum(rows.values()) >= config.train.global_batch_size
    assert sum(rows.values()) == json.loads((out / MANIFEST_FILE).read_text())["examples"]


# ----------------------------------------------------------------------------------------------------------
# pretrain's refusal of a shard set smaller than a batch


def _shards(root: Path, rows: int) -> Path:
    (root / TRAIN_DIR).mkdir(parents=True)
    example = {"input_ids": [2, 10, 3, 11, 3], "token_type_ids": [0, 0, 0, 1, 1], "pair_label": 0}
    table = pa.Table.from_pylist(
        [{**example, "example_id": i, "word_starts": [True] * 5} for i in range(rows)], schema=EXAMPLE_SCHEMA
    )
    pq.write_table(table, root / TRAIN_DIR / "shard-00000.parquet")
    return root


@pytest.mark.parametrize("rows", [20, 1, 0])
def test_too_few_examples_for_a_batch_is_refused_with_the_options_that_fit(tmp_path, rows):
    shards = _shards(tmp_path / "shards", rows)
    overrides = {"data.shards": str(shards), "train.num_workers": 2}
    config = RunConfig.load("tiny", overrides=overrides)
    with pytest.raises(ConfigError) as refused:
        plan_data(shards, config)
    message = str(refused.value)
    assert f"train.global_batch_size: {config.train.global_batch_size} examples per step" in message
    assert "preprocess more text into a new --output" in message
    sets = dict(re.findall(r"--set (train\.\w+)=(\d+)", message))
    if rows < 2:
        assert sets == {}  # not even one example per worker
        return
    assert set(sets) <= {"train.global_batch_size", "train.micro_batch_size"} and sets
    fitted = RunConfig.load("tiny", overrides={**overrides, **{k: int(v) for k, v in sets.items()}})
    fitted.validate()
    assert sum(plan_data(shards, fitted).rows.values()) == rows
    assert rows // 2 < fitted.train.global_batch_size <= rows  # tiny: 20 = 2 workers x micro-batches of 10
