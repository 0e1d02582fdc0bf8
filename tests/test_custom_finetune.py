"""Fine-tuning on the user's own data (`albert finetune --task custom`): classification with 3 classes from CSV,
text pairs from JSONL, regression from Parquet, the test predictions, the console summary, one-line errors before
Ray starts, and Ctrl-C (a partial summary and exit code 130, in-process and with seeds on Ray).

A 2-layer ALBERT (H=64) checkpoint over a SentencePiece model trained here; torch single-threaded.
"""

import csv
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from albert_core.finetune.config import FinetuneConfig
from albert_core.finetune.finetuning import finetune, load_task_data
from albert_core.finetune.tasks.custom_splits import CustomDataConfig
from albert_core.model.checkpoint import save_model
from albert_core.model.modeling import AlbertForPreTraining
from albert_core.text.tokenization import Tokenizer, TokenizerTrainConfig, train_tokenizer
from services.cli import main
from services.terminal import EXIT_DATA, EXIT_USAGE
from tests.conftest import default_sigint
from tests.test_finetuning import tiny

ROOT = Path(__file__).resolve().parent.parent
FILLER = "the a day team city report people new old said will year week found plan".split()
KEYWORDS = {"sports": "goal", "science": "atom", "business": "market"}
QUICK = ["--lr", "1e-3", "--batch-size", "16", "--max-seq-length", "32"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def sentence(rng: random.Random, keyword: str) -> str:
    words = [rng.choice(FILLER) for _ in range(rng.randint(4, 9))]
    words.insert(rng.randrange(len(words) + 1), keyword)
    return " ".join(words)


def topic_rows(n: int, seed: int) -> list[dict]:
    """Filler sentences; the topic is the class whose keyword the sentence holds."""
    rng = random.Random(seed)
    topics = list(KEYWORDS)
    return [{"text": sentence(rng, KEYWORDS[topics[i % 3]]), "topic": topics[i % 3]} for i in range(n)]


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random-init tiny ALBERT saved as a checkpoint directory with its spiece.model beside it."""
    texts = [r["text"] for r in topic_rows(300, 0)] + list(KEYWORDS.values()) * 10
    texts += (ROOT / "tests" / "fixtures" / "tokenizer_corpus.txt").read_text().splitlines()
    out = tmp_path_factory.mktemp("checkpoint")
    train_tokenizer(texts, out, TokenizerTrainConfig(vocab_size=200))
    torch.manual_seed(0)
    save_model(out, AlbertForPreTraining(tiny(Tokenizer.load(out).vocab_size)))
    return out


@pytest.fixture(scope="module")
def topics(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("topics")
    rows = topic_rows(300, 1)
    write_csv(folder / "train.csv", rows[:240])
    write_csv(folder / "dev.csv", rows[240:])
    write_csv(folder / "test.csv", [{"text": r["text"]} for r in topic_rows(20, 9)])
    return folder


def finetune_args(checkpoint: Path, out: Path, *extra: str) -> list[str]:
    return ["finetune", "--task", "custom", "--checkpoint", str(checkpoint), "--output", str(out), *QUICK, *extra]


# --- classification, pairs, regression ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_classes(tmp_path_factory, checkpoint, topics):
    out = tmp_path_factory.mktemp("three-classes")
    files = ["--train", str(topics / "train.csv"), "--dev", str(topics / "dev.csv"), "--test", str(topics / "test.csv")]
    argv = finetune_args(checkpoint, out, *files, "--label-column", "topic", "--max-steps", "60", "--eval-every", "20")
    return out, argv


def test_three_class_csv_learns_and_prints_dev_metrics_per_evaluation_and_the_summary_table(three_classes, capsys):
    out, argv = three_classes
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "custom data: 3 classes (business, science, sports); 240 train / 60 dev / 20 test rows" in printed
    assert [line.split("  dev ")[0] for line in printed.splitlines() if line.startswith("step ")] == [
        "step 20/60",
        "step 40/60",
        "step 60/60",
    ]
    table = printed[printed.index("custom: dev metrics (x100), 1 run (primary: acc)") :].splitlines()
    assert table[1].split() == ["seed", "acc", "macro_f1", "mcc", "best", "step"]
    assert table[2].split()[0] == "12345" and table[3].split()[0] == "median"
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["median"]) == {"acc", "macro_f1", "mcc"}
    assert summary["median"]["acc"] > 0.6  # chance is 1/3
    assert table[3].split()[1] == f"{100 * summary['median']['acc']:.2f}"


def test_three_class_test_predictions_name_each_test_row_and_its_class(three_classes):
    out, _ = three_classes
    with open(out / "seed_12345" / "predictions_test.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][:2] == ["index", "topic"]
    assert [r[0] for r in rows[1:]] == [str(i) for i in range(20)]
    assert {r[1] for r in rows[1:]} <= set(KEYWORDS)


def test_test_predictions_carry_each_class_probability(three_classes):
    out, _ = three_classes
    with open(out / "seed_12345" / "predictions_test.csv", newline="") as f:
        header, *rows = list(csv.reader(f))
    classes = [name.removeprefix("p_") for name in header[2:]]  # the test table has no labels: no gold column
    assert sorted(classes) == sorted(KEYWORDS) and len(rows) == 20
    for row in rows:
        probabilities = [float(p) for p in row[2:]]
        assert sum(probabilities) == pytest.approx(1.0, abs=1e-5)
        assert classes[probabilities.index(max(probabilities))] == row[1]  # the predicted class is the likeliest


def test_predictions_of_a_labelled_split_carry_its_gold_label(three_classes, topics):
    out, _ = three_classes
    with open(out / "seed_12345" / "predictions_dev.csv", newline="") as f:
        header, *rows = list(csv.reader(f))
    with open(topics / "dev.csv", newline="") as f:
        gold = [row["topic"] for row in csv.DictReader(f)]
    assert header[:3] == ["index", "topic", "gold_topic"]
    assert [row[2] for row in rows] == gold


def pair_rows(n: int, seed: int) -> list[dict]:
    """Two sentences; label 1 when they hold the same keyword. Integer labels, an id column."""
    rng = random.Random(seed)
    words = list(KEYWORDS.values())
    rows = []
    for i in range(n):
        a, b = words[i % 3], words[(i + i % 2) % 3]
        rows.append({"pid": f"p{i}", "first": sentence(rng, a), "second": sentence(rng, b), "same": int(a == b)})
    return rows


def test_a_text_pair_task_from_jsonl_encodes_both_texts_and_names_predictions_by_the_id_column(tmp_path, checkpoint):
    for name, rows in (("train", pair_rows(60, 2)), ("dev", pair_rows(12, 3))):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    custom = CustomDataConfig(
        str(tmp_path / "train.jsonl"),
        dev=str(tmp_path / "dev.jsonl"),
        text_column="first",
        text_pair_column="second",
        label_column="same",
        id_column="pid",
    )
    overrides = {"lr": 1e-3, "batch_size": 8, "train_steps": 4, "warmup_steps": 1, "max_seq_length": 48}
    config = FinetuneConfig("custom", custom.train, checkpoint=str(checkpoint), custom=custom, overrides=overrides)
    config.output_dir = str(tmp_path / "out")
    data = load_task_data(config, Tokenizer.load(checkpoint))
    assert data.labels == ("0", "1")
    assert int(data.train_batch([0])["token_type_ids"].sum()) > 0  # the second text is segment B
    result = finetune(config)
    assert set(result["dev"]) == {"acc", "macro_f1", "mcc"}
    with open(tmp_path / "out" / "predictions_dev.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["pid", "same", "gold_same", "p_0", "p_1"]
    assert [r[0] for r in rows[1:]] == [f"p{i}" for i in range(12)] and {r[1] for r in rows[1:]} <= {"0", "1"}


def test_regression_from_parquet_holds_out_dev_records_the_split_and_predicts_in_the_targets_units(
    tmp_path, checkpoint, capsys
):
    rng = random.Random(5)
    rows = []
    for i in range(80):
        count = i % 3
        text = " ".join([rng.choice(FILLER) for _ in range(5)] + ["goal"] * count)
        rows.append({"text": text, "score": 100.0 + 50.0 * count})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "scores.parquet")
    out = tmp_path / "out"
    argv = finetune_args(checkpoint, out, "--train", str(tmp_path / "scores.parquet"), "--label-column", "score")
    assert main([*argv, "--regression", "--dev-fraction", "0.25", "--max-steps", "8", "--eval-every", "0"]) == 0
    assert "custom: dev metrics (x100), 1 run (primary: pearson)" in capsys.readouterr().out
    split = json.loads((out / "split.json").read_text())
    assert split["kind"] == "regression" and split["train"]["rows"] == 60
    assert split["dev"]["rows"] == 20 and split["dev"]["seed"] == 12345
    assert set(json.loads((out / "summary.json").read_text())["median"]) == {"pearson", "spearman"}
    with open(out / "seed_12345" / "predictions_dev.csv", newline="") as f:
        predicted = list(csv.reader(f))
    assert predicted[0] == ["index", "score", "gold_score"]  # regression: no class probabilities
    assert [int(r[0]) for r in predicted[1:]] == split["dev"]["train_rows"]  # dev rows named by their train row
    values = [float(r[1]) for r in predicted[1:]]
    assert 50.0 < sum(values) / len(values) < 250.0  # standardized targets come back in the targets' units


def test_a_folder_of_train_dev_test_tables_is_found_by_name_for_the_cli_and_the_eval_registry(
    tmp_path, checkpoint, topics, capsys
):
    from services.finetune.seeds import seed_configs

    folder = tmp_path / "news"
    folder.mkdir()
    (folder / "train.csv").write_bytes((topics / "train.csv").read_bytes())
    (folder / "dev.csv").write_bytes((topics / "dev.csv").read_bytes())
    argv = finetune_args(checkpoint, tmp_path / "out", "--data", str(folder), "--label-column", "topic")
    assert main([*argv, "--max-steps", "2", "--eval-every", "0"]) == 0
    assert "240 train / 60 dev rows" in capsys.readouterr().out
    (config,) = seed_configs("custom", str(checkpoint), str(folder), seeds=1)  # how eval.tasks calls it
    assert (config.custom.train, config.custom.dev, config.custom.test) == (
        str(folder / "train.csv"),
        str(folder / "dev.csv"),
        None,
    )


# --- bad input ---------------------------------------------------------------------------------------------


def bad_inputs(folder: Path) -> dict[str, tuple[list[str], str]]:
    write_csv(folder / "ok.csv", topic_rows(12, 3))
    write_csv(folder / "one.csv", [{"text": "x", "topic": "sports"}] * 4)
    (folder / "empty.csv").write_text("")
    (folder / "data.xlsx").write_text("x")
    write_csv(folder / "scores.csv", [{"text": "a", "topic": "1.5"}, {"text": "b", "topic": "n/a"}])
    ok = str(folder / "ok.csv")
    return {
        "missing column": (
            ["--train", ok],
            "ok.csv: no column 'label' (--label-column); the columns are 'text', 'topic'",
        ),
        "unknown format": (["--train", str(folder / "data.xlsx")], "unknown table format '.xlsx'; expected one of"),
        "empty file": (["--train", str(folder / "empty.csv")], "empty.csv: the file is empty"),
        "single class": (["--train", str(folder / "one.csv"), "--label-column", "topic"], "single value 'sports'"),
        "not for this task": (
            ["--train", ok, "--task", "sst2"],
            "--train is for --task custom; --task sst2 reads --data",
        ),
        "not numeric": (
            ["--train", str(folder / "scores.csv"), "--label-column", "topic", "--regression"],
            "scores.csv: row 1 (line 3): regression label 'topic' must be a finite number, found 'n/a'",
        ),
    }


@pytest.mark.parametrize(
    "case", ["missing column", "unknown format", "empty file", "single class", "not numeric", "not for this task"]
)
def test_bad_input_is_one_line_naming_the_file_and_what_was_expected(tmp_path, checkpoint, capsys, case):
    flags, expected = bad_inputs(tmp_path)[case]
    expected_status = EXIT_USAGE if case == "not for this task" else EXIT_DATA  # options that conflict; bad data
    assert main(finetune_args(checkpoint, tmp_path / "out", *flags)) == expected_status
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("albert: error: ") and expected in err


def test_bad_input_is_reported_before_ray_starts(tmp_path, checkpoint):
    flags, expected = bad_inputs(tmp_path)["missing column"]
    argv = finetune_args(checkpoint, tmp_path / "out", *flags, "--seeds", "3")
    done = subprocess.run([sys.executable, "-m", "services.cli", *argv], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == EXIT_DATA and expected in done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Ray" not in done.stdout + done.stderr


# --- Ctrl-C ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("signum", "status", "how"), [(signal.SIGINT, 130, "interrupted (Ctrl-C)"),
                                                       (signal.SIGTERM, 143, "terminated (SIGTERM)")])  # fmt: skip
def test_ctrl_c_or_sigterm_after_a_dev_evaluation_prints_the_partial_summary_and_exits_130_or_143(
    signum, status, how, tmp_path, checkpoint, topics
):
    """Ctrl-C, or SIGTERM (exit 143), alike."""
    argv = finetune_args(checkpoint, tmp_path / "out", "--train", str(topics / "train.csv"), "--label-column", "topic")
    argv += ["--max-steps", "5000", "--eval-every", "5"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    # a terminal's Ctrl-C: SIGINT to the command's whole process group
    run = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
        start_new_session=True,
        preexec_fn=default_sigint,
    )
    printed = []
    for line in run.stdout:
        printed.append(line)
        if line.startswith("step 5/5000"):
            os.killpg(run.pid, signum)
            break
    try:
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    out = "".join(printed) + out
    assert run.returncode == status
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert f"{how}: 0 of 1 run finished" in out
    assert "seed 12345: interrupted; best dev evaluation so far at step 5 of 5000: acc " in out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["runs"] == 0


@pytest.mark.ray
def test_sigterm_while_seeds_run_on_the_local_ray_exits_143_with_its_own_line(tmp_path, checkpoint, topics):
    """`albert finetune --seeds 2` on the Ray it starts itself, SIGTERM to the command alone (`kill PID`): the same
    partial summary as Ctrl-C, worded for SIGTERM, and exit 143 (Ray's wait raises a plain KeyboardInterrupt for
    the handler's Terminated, which used to read as Ctrl-C and 130)."""
    out = tmp_path / "out"
    argv = finetune_args(checkpoint, out, "--train", str(topics / "train.csv"), "--label-column", "topic")
    argv += ["--seeds", "2", "--max-steps", "5000", "--eval-every", "5", "--no-progress"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    run = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 240
        logs = [out / f"seed_{seed}" / "metrics.jsonl" for seed in (12345, 12346)]
        while not any(log.is_file() and log.read_text().strip() for log in logs):  # a seed has logged an evaluation
            assert run.poll() is None and time.time() < deadline, run.communicate(timeout=30)
            time.sleep(0.2)
        run.send_signal(signal.SIGTERM)
        out_text, err = run.communicate(timeout=90)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert run.returncode == 143, out_text[-2000:] + err[-2000:]
    assert "terminated (SIGTERM): 0 of 2 runs finished" in out_text
    # The command's own lines; a trial process that the stop cancels may print its interpreter's shutdown noise,
    # which Ray forwards with its "(_trial pid=N)" tag (seen under load; see the closing note of issue 40)
    own = "\n".join(line for line in err.splitlines() if "(_trial pid=" not in line)
    assert "interrupted (Ctrl-C)" not in out_text + own and "Traceback" not in own
    assert json.loads((out / "summary.json").read_text())["interrupted"] is True


@pytest.mark.ray
def test_ctrl_c_while_seeds_run_on_ray_summarizes_the_finished_seed(ray_local, tmp_path, checkpoint, topics, capsys):
    from services.finetune.cli import report_interrupted
    from services.finetune.seeds import seed_configs
    from services.finetune.trials import SeedsInterrupted, run_trials

    custom = CustomDataConfig(str(topics / "train.csv"), dev=str(topics / "dev.csv"), label_column="topic")
    overrides = {"custom": custom, "lr": 1e-3, "batch_size": 8, "max_seq_length": 32, "eval_every": 0}
    out = tmp_path / "out"
    short, long = (
        seed_configs("custom", str(checkpoint), custom.train, seeds=[seed], overrides=overrides, output_dir=out)[0]
        for seed in (1, 2)
    )
    short.max_steps, long.max_steps = 2, 100_000

    def interrupt_when_seed_1_is_done():
        deadline = time.time() + 300
        while not (out / "seed_1" / "result.json").is_file() and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # the driver receives the result
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own Ctrl-C handler, even where this process was started with SIGINT ignored (a background job of a
    # non-interactive shell is): the test is about what the handler leads to.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_when_seed_1_is_done, daemon=True).start()
        with pytest.raises(SeedsInterrupted) as interrupted:
            run_trials([short, long], out / "tune", num_cpus=1, progress=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert [r["seed"] for r in interrupted.value.results] == [1]
    assert report_interrupted(interrupted.value, "custom", [1, 2], out) == 130
    printed = capsys.readouterr().out
    assert "interrupted (Ctrl-C): 1 of 2 runs finished" in printed
    assert "seed 2: interrupted" in printed and printed.count("median") == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["seeds"] == [1] and summary["planned_seeds"] == [1, 2]
    deadline = time.time() + 30  # the unfinished run was cancelled: its CPU is free again
    while ray_local.available_resources().get("CPU", 0) < ray_local.cluster_resources()["CPU"]:
        assert time.time() < deadline, "the interrupted seed's Ray task is still running"
        time.sleep(0.2)
