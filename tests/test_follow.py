"""A run that follows its shard set (data.follow): a corpus appended with `albert preprocess --append-to` while the
run is in epoch 1 is trained on from epoch 2, every checkpoint records the version of each epoch, and a resume
replays the same example ids per step. Real SentencePiece, real `albert preprocess` on Ray Data, real
TorchTrainer runs (2 fits: one stopped by a simulated crash, tests/worker_callbacks.py, then its resume)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from albert_core.examples.shards import ShardsManifest
from albert_core.text.tokenization import TokenizerTrainConfig, train_tokenizer
from services.cli import main
from services.rundir.checkpoints import checkpoint_dir, read_trainer_json
from services.rundir.config import RunConfig
from services.rundir.log import read_metrics
from services.train.callbacks import installed
from tests.runs import run_training
from tests.worker_callbacks import CrashAfterStep, TraceExamples, crash_message

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_local")]

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer_corpus.txt"
TEXTS = FIXTURE.read_text(encoding="utf-8").splitlines()
GLOBAL_BATCH = 16
SMALL = dict(vocab_size=0, embedding_size=16, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
SMALL.update(intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def write_corpus(root: Path, n_files: int, offset: int) -> Path:
    root.mkdir(parents=True)
    for i in range(n_files):
        body = " ".join(TEXTS[(offset + 7 * i + j) % len(TEXTS)] for j in range(12))
        (root / f"doc_{i:03d}.txt").write_text(body + "\n")
    return root


def preprocess(*args: str) -> None:
    common = ["--max-seq-length", "48", "--shard-mb", "0.002", "--heldout-fraction", "0", "--num-cpus", "2"]
    assert main(["preprocess", *args, *common]) == 0


def run_config(root: Path, shards: Path) -> RunConfig:
    return RunConfig.load(
        "tiny",
        overrides={
            "run.name": "follows",
            "run.output_dir": str(root / "runs"),
            "run.seed": 3,
            "data.shards": str(shards),
            "data.max_seq_length": 48,
            "data.follow": True,
            "model.overrides": {**SMALL, "position_bias": "rotary"},
            "optim.total_steps": 12,
            "optim.warmup_steps": 2,
            "optim.decay_steps": 0,
            "train.global_batch_size": GLOBAL_BATCH,
            "train.micro_batch_size": 8,
            "train.num_workers": 2,
            "train.log_every": 1,
            "train.checkpoint_every": 2,
            "train.keep_last": 10,
            "train.max_failures": 0,
            "eval.every_steps": 0,
        },
    )


def fit(config: RunConfig, stop_after: int | None) -> None:
    if stop_after is None:
        run_training(config)
        return
    with installed(CrashAfterStep(stop_after)), pytest.raises(Exception, match=crash_message(stop_after)):
        run_training(config)


@pytest.fixture(scope="module")
def followed(tmp_path_factory):
    """Stopped in epoch 1 (after step 7, the checkpoint at 6 recording epochs 0 and 1), a corpus appended, resumed
    from step 6 to the end: step 7 is redone on the recorded version, epoch 2 is decided when reached."""
    root = tmp_path_factory.mktemp("follow")
    tokenizer = train_tokenizer(TEXTS, root / "tokenizer", TokenizerTrainConfig(vocab_size=300))
    shards = root / "shards"
    preprocess(
        "--input", str(write_corpus(root / "first", 6, 0)), "--tokenizer", str(tokenizer), "--output", str(shards)
    )
    config = run_config(root, shards)
    epoch = ShardsManifest.read(shards).data["examples"]
    # epoch 1 starts before the checkpoint at step 6, epoch 2 after step 7 and before step 10
    assert epoch < 6 * GLOBAL_BATCH and 7 * GLOBAL_BATCH < 2 * epoch < 9 * GLOBAL_BATCH, epoch
    with installed(TraceExamples(root / "trace")):
        fit(config, stop_after=7)
        preprocess("--append-to", str(shards), "--input", str(write_corpus(root / "second", 6, 20)))
        fit(config, stop_after=None)
    return root, shards, config


def traced(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "trace" / "rank0.jsonl").read_text().splitlines()] + [
        json.loads(line) for line in (root / "trace" / "rank1.jsonl").read_text().splitlines()
    ]


def new_part_shards(shards: Path) -> set[int]:
    part = ShardsManifest.read(shards).parts[1]
    return {int(name.rsplit("-", 1)[1].split(".")[0]) for name in part.shards}


def test_the_appended_part_is_trained_on_from_the_next_epoch_and_not_before(followed):
    root, shards, config = followed
    added = new_part_shards(shards)
    epoch = ShardsManifest.read(shards).parts[0].rows
    boundary = 2 * sum(epoch) // GLOBAL_BATCH + 1  # the step in which epoch 2 starts
    by_step: dict[int, set[int]] = {}
    for line in traced(root):
        by_step.setdefault(line["step"], set()).update(i >> 32 for i in line["example_ids"])
    assert sorted(by_step) == list(range(1, config.optim.total_steps + 1))
    assert not any(by_step[step] & added for step in range(1, boundary))
    assert all(by_step[step] & added for step in range(boundary + 1, config.optim.total_steps + 1))


def test_a_redone_step_trains_on_the_same_example_ids(followed):
    root, _, _ = followed
    attempts: dict[tuple[int, int], list[list[int]]] = {}
    for line in traced(root):
        attempts.setdefault((line["rank"], line["step"]), []).append(line["example_ids"])
    redone = {key: ids for key, ids in attempts.items() if len(ids) > 1}
    assert {step for _, step in redone} == {7}  # resumed from the checkpoint at 6
    assert all(all(i == ids[0] for i in ids) for ids in redone.values())


def test_every_checkpoint_records_the_version_of_each_epoch_and_the_run_logs_the_switch(followed):
    root, _, config = followed
    versions = {
        step: read_trainer_json(checkpoint_dir(config.run_dir / "checkpoints", step))["state"]["epoch_versions"]
        for step in (6, 10, 12)
    }
    assert versions == {6: [1, 1], 10: [1, 1, 2], 12: [1, 1, 2]}
    switches = [r for r in read_metrics(config.run_dir / "metrics.jsonl") if r.get("event") == "shards_version"]
    assert switches and switches[-1]["version"] == 2 and switches[-1]["epoch"] == 2
