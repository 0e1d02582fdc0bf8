"""The pretraining loop: the step function alone, then real runs on a local Ray (3 TorchTrainer.fit calls in all)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from albert_core.examples.pairs import order_draws, reorder_pair
from albert_core.examples.shards import HELDOUT_FILE, HELDOUT_SCHEMA
from albert_core.model.config import AlbertConfig, ConfigError
from albert_core.model.modeling import AlbertForPreTraining, compile_backbone
from albert_core.optim import make_optimizer, make_scheduler
from albert_core.text.tokenization import TokenIds, Tokenizer, TokenizerTrainConfig, train_tokenizer
from services.rundir.checkpoints import latest_good, list_checkpoints, verify
from services.rundir.config import RunConfig
from services.rundir.log import read_metrics
from services.train.callbacks import installed
from services.train.plan import plan_data, resolve_token_ids
from services.train.step import accumulate_gradients, make_micro_batch, train_step
from tests.runs import run_training
from tests.synthetic import write_random_shards
from tests.worker_callbacks import CrashAfterStep, crash_message

VOCAB = 96
SEQ = 32
MODEL = dict(  # albert-tiny shrunk: 2 layers, H=64, E=32
    embedding_size=32,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    max_position_embeddings=64,
)
FILE_ROWS = (16, 16, 16, 18)  # 2 workers: 32 and 34 rows; 8 rows per worker-step -> 4 steps per epoch


def write_shards(root, file_rows=FILE_ROWS, *, seed: int = 0, manifest: dict | None = None):
    """Real Parquet shards in the EXAMPLE_SCHEMA: [CLS] A [SEP] B [SEP] rows of random word pieces."""
    rng = np.random.default_rng(seed)
    write_random_shards(root / "train", file_rows, vocab_size=VOCAB, rng=rng)
    (root / "manifest.json").write_text(json.dumps(manifest if manifest is not None else {"vocab_size": VOCAB}))
    return root


def write_heldout(root, *, docs: int = 8, sentence_length: int = 6, seed: int = 2):
    """<root>/heldout/documents.parquet: `docs` documents of 4 random-piece sentences (what evaluation reads)."""
    rng = np.random.default_rng(seed)
    rows = [
        {
            "doc_id": doc,
            "sentences": [rng.integers(5, VOCAB, sentence_length).tolist() for _ in range(4)],
            "word_starts": [[True] * sentence_length for _ in range(4)],
        }
        for doc in range(docs)
    ]
    (root / HELDOUT_FILE).parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=HELDOUT_SCHEMA), root / HELDOUT_FILE)
    return root


def run_config(tmp_path, shards, name: str, **train) -> RunConfig:
    return RunConfig.from_dict(
        {
            "run": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 7},
            "model": {"preset": "albert-tiny", "overrides": {"vocab_size": 0, **MODEL}},
            "data": {"shards": str(shards), "max_seq_length": SEQ},
            "optim": {"lr": 0.01, "warmup_steps": 2, "total_steps": 8},
            "train": {
                "global_batch_size": 16,
                "micro_batch_size": 4,
                "num_workers": 2,
                "log_every": 1,
                "checkpoint_every": 3,
                "keep_last": 2,
                "dropout_removal_step": 6,
                "max_failures": 0,
                **train,
            },
        }
    )


# --------------------------------------------------------------------------------------------------
# the step, in one process


def read_rows(path) -> dict[str, np.ndarray]:
    table = pq.read_table(path)
    return {name: np.asarray(table[name].to_numpy(zero_copy_only=False)) for name in table.column_names}


def slice_rows(rows, start, stop):
    return {k: v[start:stop] for k, v in rows.items()}


@pytest.fixture
def rows(tmp_path):
    write_shards(tmp_path, (8,))
    return read_rows(tmp_path / "train" / "shard-00000.parquet")


def fresh_model(dropout: float = 0.0) -> AlbertForPreTraining:
    torch.manual_seed(0)
    model = AlbertForPreTraining(AlbertConfig.preset("albert-tiny", vocab_size=VOCAB, **MODEL))
    model.set_dropout(dropout)
    return model


def micro_batches(rows, size: int):
    data = RunConfig().data
    data.max_seq_length = SEQ
    ids = TokenIds(vocab_size=VOCAB)
    return [
        make_micro_batch(slice_rows(rows, i, i + size), seed=3, epoch=0, ids=ids, data=data) for i in range(0, 8, size)
    ]


def test_accumulating_two_micro_batches_of_4_gives_the_gradients_of_one_batch_of_8(rows):
    grads = {}
    for size in (8, 4):
        model = fresh_model(dropout=0.0)
        accumulate_gradients(model, micro_batches(rows, size))
        grads[size] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, grad in grads[8].items():
        torch.testing.assert_close(grads[4][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert any(g.abs().sum() > 0 for g in grads[8].values())


def test_step_statistics_do_not_depend_on_the_split(rows):
    stats = {}
    for size in (8, 2):
        stats[size] = accumulate_gradients(fresh_model(dropout=0.0), micro_batches(rows, size))
    for field in ("loss", "mlm_loss", "pair_loss", "mlm_acc", "pair_acc"):
        torch.testing.assert_close(getattr(stats[2], field), getattr(stats[8], field), rtol=1e-5, atol=1e-6)
    assert stats[2].tokens == stats[8].tokens == sum(len(r) for r in rows["input_ids"])


def test_a_summing_reduce_over_two_identical_workers_doubles_the_global_batch(rows):
    """reduce_sum stands in for the all-reduce: two workers holding the same 8 rows = one worker holding 16."""
    model = fresh_model()
    accumulate_gradients(model, micro_batches(rows, 8), reduce_sum=lambda t: t.mul_(2))
    doubled = {n: p.grad.clone() for n, p in model.named_parameters()}
    model = fresh_model()
    accumulate_gradients(model, micro_batches(rows, 8) * 2)
    for name, p in model.named_parameters():
        torch.testing.assert_close(doubled[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_train_step_gives_the_same_update_for_either_split_and_clips_the_global_norm(rows):
    params = {}
    for size in (8, 4):
        model = fresh_model()
        opt = make_optimizer(model, lr=0.01)
        sched = make_scheduler(opt, warmup_steps=0, total_steps=10)
        stats = train_step(model, opt, sched, micro_batches(rows, size), grad_clip=1e-3)
        assert stats.grad_norm > 1e-3  # the clip was active
        assert stats.lr == pytest.approx(0.01)
        params[size] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, p in params[8].items():
        torch.testing.assert_close(params[4][name], p, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_autocast_step_stays_close_to_fp32(rows):
    fp32 = accumulate_gradients(fresh_model(), micro_batches(rows, 4))
    bf16 = accumulate_gradients(fresh_model(), micro_batches(rows, 4), autocast_dtype=torch.bfloat16)
    assert torch.isfinite(bf16.loss)
    assert bf16.loss.item() != fp32.loss.item()  # autocast really ran in bf16
    assert bf16.loss.item() == pytest.approx(fp32.loss.item(), rel=2e-2)


def test_compiled_backbone_trains_like_eager_and_keeps_parameter_names(rows):
    """train.compile: two steps with the torch.compiled backbone give the eager run's losses and weights."""
    runs = {}
    for compiled in (False, True):
        model = fresh_model()
        if compiled:
            compile_backbone(model)
        opt = make_optimizer(model, lr=0.01)
        sched = make_scheduler(opt, warmup_steps=0, total_steps=10)
        losses = [train_step(model, opt, sched, micro_batches(rows, 4), grad_clip=1.0).loss.item() for _ in range(2)]
        runs[compiled] = losses, model.state_dict()
    (eager_losses, eager_state), (compiled_losses, compiled_state) = runs[False], runs[True]
    assert list(compiled_state) == list(eager_state)  # checkpoints stay interchangeable
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5)
    assert compiled_losses[1] != compiled_losses[0]  # the second step saw updated weights
    for name, tensor in eager_state.items():
        torch.testing.assert_close(compiled_state[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_dropout_removal_reaches_a_compiled_backbone(rows):
    model = fresh_model(dropout=0.3)
    compile_backbone(model)
    model.train()
    batch = micro_batches(rows, 8)[0]
    inputs = (batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    assert not torch.equal(model.albert(*inputs).last_hidden_state, model.albert(*inputs).last_hidden_state)
    model.set_dropout(0.0)
    torch.testing.assert_close(model.albert(*inputs).last_hidden_state, model.albert(*inputs).last_hidden_state)


def test_sop_order_epoch_draws_each_pair_order_per_epoch_and_keeps_the_tokens(rows):
    data = RunConfig().data
    data.max_seq_length, data.sop_order = SEQ, "epoch"
    ids = TokenIds(vocab_size=VOCAB)
    for epoch in (0, 1):
        batch = make_micro_batch(rows, seed=5, epoch=epoch, ids=ids, data=data)
        assert batch["pair_labels"].tolist() == order_draws(5, epoch, rows["example_id"]).tolist()
        for i, label in enumerate(batch["pair_labels"].tolist()):  # the stored row, its segments swapped or not
            stored = [rows[name][i] for name in ("input_ids", "token_type_ids", "word_starts")]
            want = reorder_pair(*stored, int(rows["pair_label"][i]), label)
            n = len(want[0])
            assert batch["token_type_ids"][i, :n].tolist() == want[1].tolist()
            assert _unmasked(batch, i, n) == want[0].tolist()
    stored = RunConfig().data
    stored.max_seq_length = SEQ
    labels = make_micro_batch(rows, seed=5, epoch=0, ids=ids, data=stored)["pair_labels"].tolist()
    assert labels == [int(v) for v in rows["pair_label"]]


def _unmasked(batch, i: int, n: int) -> list[int]:
    """Row i's first n tokens with every masked position restored from its label."""
    tokens = batch["input_ids"][i, :n].clone()
    labelled = batch["mlm_labels"][i, :n] != -100
    tokens[labelled] = batch["mlm_labels"][i, :n][labelled]
    return tokens.tolist()


def test_sop_order_epoch_is_refused_on_a_shard_set_that_is_not_sop(tmp_path):
    shards = write_shards(tmp_path / "nsp", (16,), manifest={"vocab_size": VOCAB, "config": {"objective": "nsp"}})
    config = run_config(tmp_path, shards, "n")
    config.data.sop_order = "epoch"
    with pytest.raises(ConfigError, match=r'data.sop_order: "epoch" redraws the order of SOP pairs, but .*'
                                          r"manifest.json records the objective 'nsp'"):  # fmt: skip
        plan_data(shards, config)
    config.data.sop_order = "random"
    with pytest.raises(ConfigError, match="data.sop_order: expected stored or epoch, got 'random'"):
        config.validate()


def test_train_compile_with_the_xla_backend_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match="train.compile: backend 'xla'"):
        run_config(tmp_path, tmp_path, "c", backend="xla", compile=True)


def test_micro_batch_rejects_a_token_outside_the_vocabulary(rows):
    rows["input_ids"][3] = np.array([2, 5, VOCAB + 1, 3, 3])
    data = RunConfig().data
    with pytest.raises(ValueError, match=r"example 3 \(shard 0, row 3\).*outside the vocabulary of 96"):
        make_micro_batch(slice_rows(rows, 0, 4), seed=1, epoch=0, ids=TokenIds(vocab_size=VOCAB), data=data)


def test_micro_batch_rejects_a_row_longer_than_max_seq_length(rows):
    data = RunConfig().data
    data.max_seq_length = 8
    with pytest.raises(ValueError, match="more than data.max_seq_length=8"):
        make_micro_batch(slice_rows(rows, 0, 4), seed=1, epoch=0, ids=TokenIds(vocab_size=VOCAB), data=data)


# --------------------------------------------------------------------------------------------------
# the driver's checks (fail before any worker starts)


def test_vocab_size_comes_from_the_manifest(tmp_path):
    shards = write_shards(tmp_path / "s", (4,))
    assert resolve_token_ids(shards, run_config(tmp_path, shards, "v")).vocab_size == VOCAB


def test_token_ids_come_from_the_tokenizer_the_manifest_names(tmp_path):
    corpus = (Path(__file__).parent / "fixtures" / "tokenizer_corpus.txt").read_text().splitlines()
    model = train_tokenizer(corpus, tmp_path / "tok", TokenizerTrainConfig(vocab_size=200))
    manifest = {"tokenizer": {"path": str(model), "vocab_size": 999}}
    shards = write_shards(tmp_path / "s", (4,), manifest=manifest)
    ids = resolve_token_ids(shards, run_config(tmp_path, shards, "v"))
    tokenizer = Tokenizer.load(model)
    assert ids == TokenIds.from_tokenizer(tokenizer)
    assert ids.vocab_size == 200 and ids.mask_id == tokenizer.mask_id


def test_no_vocab_source_is_an_error_naming_data_shards(tmp_path):
    shards = write_shards(tmp_path / "s", (4,), manifest={})
    with pytest.raises(ConfigError, match="data.shards: cannot tell the vocabulary size"):
        resolve_token_ids(shards, run_config(tmp_path, shards, "v"))


def test_the_plan_lists_every_shard_file_with_its_rows_and_one_file_serves_two_workers(tmp_path):
    shards = write_shards(tmp_path / "s", (40,))
    rows = plan_data(shards, run_config(tmp_path, shards, "p")).rows
    assert [(path.rsplit("/", 1)[1], n) for path, n in rows.items()] == [("shard-00000.parquet", 40)]


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ("missing", "does not exist"),
        ("no_train", "has no train/ directory"),
        ("empty", "holds no .parquet files"),
        ("too_small", "train.global_batch_size: 16 examples per step, but .* holds only 6"),
        ("bad_column", "shard-00001.parquet: lacks column 'token_type_ids'"),
    ],
)
def test_bad_shards_fail_before_any_worker_starts(tmp_path, layout, message):
    shards = tmp_path / "s"
    if layout == "no_train":
        shards.mkdir()
    elif layout == "empty":
        (shards / "train").mkdir(parents=True)
    elif layout == "too_small":
        write_shards(shards, (3, 3))
    elif layout == "bad_column":
        write_shards(shards, (12, 12))
        pq.write_table(pa.table({"example_id": [1], "input_ids": [[2, 3]]}), shards / "train" / "shard-00001.parquet")
    with pytest.raises(ConfigError, match=message):
        run_training(run_config(tmp_path, shards, "bad"))


def test_xla_backend_without_torch_xla_is_refused_naming_the_field(tmp_path):
    shards = write_shards(tmp_path / "s")
    with pytest.raises(ConfigError, match="train.backend: 'xla' needs torch_xla"):
        run_training(run_config(tmp_path, shards, "x", backend="xla"))


def test_empty_data_shards_is_an_error_naming_the_field(tmp_path):
    config = run_config(tmp_path, "", "e")
    config.data.shards = ""
    with pytest.raises(ConfigError, match="data.shards: empty"):
        run_training(config)


# --------------------------------------------------------------------------------------------------
# real runs: 2 workers on a local Ray


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("shards"))


@pytest.fixture(scope="module")
def uninterrupted(ray_local, shards, tmp_path_factory):
    config = run_config(tmp_path_factory.mktemp("a"), shards, "straight")
    result = run_training(config, resume=False)
    return config, result


@pytest.fixture(scope="module")
def crashed_then_resumed(ray_local, shards, tmp_path_factory):
    """Stopped after step 5 (checkpoint at 3: steps 4-5 are lost), then resumed mid-epoch from step 3.

    The resumed run continues at data position 48 of 66 examples per epoch, crosses into epoch 1 inside step 5 and
    removes dropout at step 6, so every part of the data position and the dropout state is exercised.
    """
    config = run_config(tmp_path_factory.mktemp("b"), shards, "crashy")
    with installed(CrashAfterStep(5)), pytest.raises(Exception, match=crash_message(5)):
        run_training(config, resume=False)
    before = train_lines(config.run_dir / "metrics.jsonl")
    latest_before = latest_good(config.run_dir / "checkpoints")
    result = run_training(config, resume=True)
    return config, result, before, latest_before


def train_lines(path):
    return [r for r in read_metrics(path) if r["kind"] == "train"]


def losses(records):
    return [(r["step"], r["loss"], r["mlm_loss"], r["pair_loss"], r["grad_norm"], r["lr"]) for r in records]


def test_two_worker_run_completes_and_keeps_the_last_checkpoints(uninterrupted):
    config, result = uninterrupted
    assert result.step == 8 and result.finished
    kept = list_checkpoints(config.run_dir / "checkpoints")
    assert [step for step, _ in kept] == [8, 6]  # keep_last = 2
    for _, path in kept:
        verify(path)
    assert result.checkpoint == kept[0][1]
    assert result.metrics["step"] == 8


def test_metrics_have_one_line_per_step_with_every_field(uninterrupted):
    config, result = uninterrupted
    records = train_lines(result.metrics_file)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["epoch"] for r in records] == [0] * 5 + [1] * 3  # 66 examples per epoch: step 5 starts at 64
    expected = {"loss", "mlm_loss", "pair_loss", "mlm_acc", "pair_acc", "lr", "grad_norm", "tokens_per_s", "dropout"}
    for record in records:
        assert expected <= set(record)
        assert record["tokens_per_s"] > 0 and np.isfinite(record["loss"])
    assert records[0]["lr"] == 0.0 and records[2]["lr"] == pytest.approx(0.01)  # warmup of 2 steps


def test_dropout_is_on_before_the_removal_step_and_off_from_it(uninterrupted):
    _, result = uninterrupted
    dropout = {r["step"]: r["dropout"] for r in train_lines(result.metrics_file)}
    assert [dropout[s] for s in range(1, 6)] == [0.1] * 5
    assert [dropout[s] for s in range(6, 9)] == [0.0] * 3


def test_the_crash_left_steps_1_to_5_and_a_checkpoint_at_3(crashed_then_resumed):
    _, _, before, latest_before = crashed_then_resumed
    assert [r["step"] for r in before] == [1, 2, 3, 4, 5]
    assert latest_before.name == "step_00000003"


def test_killed_and_resumed_run_reproduces_every_step_loss_exactly(uninterrupted, crashed_then_resumed):
    _, straight = uninterrupted
    config, resumed, _, _ = crashed_then_resumed
    assert losses(train_lines(resumed.metrics_file)) == losses(train_lines(straight.metrics_file))


def test_resumed_run_writes_no_duplicated_steps(crashed_then_resumed):
    _, resumed, _, _ = crashed_then_resumed
    assert [r["step"] for r in train_lines(resumed.metrics_file)] == list(range(1, 9))


def test_resumed_run_ends_with_the_same_weights(uninterrupted, crashed_then_resumed):
    _, straight = uninterrupted
    _, resumed, _, _ = crashed_then_resumed
    a = load_file(straight.checkpoint / "model.safetensors")
    b = load_file(resumed.checkpoint / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_spent_wall_clock_budget_ends_every_worker_at_the_same_step_and_a_rerun_trains_no_more(
    ray_local, shards, tmp_path
):
    config = run_config(tmp_path, shards, "budget", max_seconds=1e-3)  # the first step spends it
    result = run_training(config, resume=False)
    assert (result.step, result.finished) == (1, True)
    assert [step for step, _ in list_checkpoints(config.run_dir / "checkpoints")] == [1]
    records = train_lines(config.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1]
    assert records[0]["train_seconds"] >= 1e-3
    everything = read_metrics(config.run_dir / "metrics.jsonl")
    again = run_training(config, resume=True)
    assert (again.step, again.finished) == (1, True)
    assert read_metrics(config.run_dir / "metrics.jsonl") == everything


def test_a_time_clock_runs_the_schedule_over_the_budget_on_every_worker(ray_local, shards, tmp_path):
    # Linear decay over the whole budget: the rate each step applies follows rank 0's training time at the step
    # before (position = total_steps x seconds / max_seconds), not the step count, and is near 0 when the budget ends.
    config = run_config(tmp_path, shards, "clock", max_seconds=4.0, checkpoint_every=1000, dropout_removal_step=0)
    config.optim.total_steps, config.optim.warmup_steps, config.optim.clock = 1000, 0, "time"
    result = run_training(config, resume=False)
    assert result.finished and 1 < result.step < 1000
    records = train_lines(config.run_dir / "metrics.jsonl")
    assert records[0]["lr"] == pytest.approx(config.optim.lr)  # position 0
    for before, record in zip(records, records[1:], strict=False):
        expected = 1 - min(1.0, before["train_seconds"] / config.train.max_seconds)
        assert record["lr"] / config.optim.lr == pytest.approx(expected, abs=0.003)  # seconds are logged rounded
    # The run ends at the first step that spends the budget, however long steps take on this machine: the rate of
    # a next step would be the schedule's end (0), so the schedule ran over the whole budget.
    assert records[-1]["train_seconds"] >= config.train.max_seconds > records[-2]["train_seconds"]


def test_a_time_clock_without_a_budget_is_refused(tmp_path):
    config = run_config(tmp_path, tmp_path, "n")
    config.optim.clock = "time"
    with pytest.raises(ConfigError, match='optim.clock: "time" runs the schedule over the wall-clock budget'):
        config.validate()
    config.optim.clock = "hours"
    with pytest.raises(ConfigError, match="optim.clock: expected steps or time, got 'hours'"):
        config.validate()


def test_a_negative_budget_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match="train.max_seconds: expected seconds >= 0"):
        run_config(tmp_path, tmp_path, "n", max_seconds=-1)


def test_a_finished_run_is_not_planned_again_and_its_dry_run_says_what_the_run_says(uninterrupted):
    from services.train.driver import prepare_run
    from services.train.dry_run import dry_run

    config, result = uninterrupted
    prepared = prepare_run(config, resume=True)
    assert prepared.plan is None and prepared.finished == result
    assert prepared.finished_line().startswith(f"run straight already finished at step 8 ({result.checkpoint})")
    assert dry_run(config, resume=True) == [prepared.finished_line(), "dry run: nothing was started or written"]


def test_resume_false_refuses_a_run_directory_with_checkpoints(uninterrupted):
    config, _ = uninterrupted
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        run_training(config, resume=False)


# --------------------------------------------------------------------------------------------------
# data.mixture, checked before any worker starts


@pytest.mark.parametrize(
    ("mixture", "follow", "message"),
    [
        ({"news": 1.0}, False, "data.mixture: 'news' is not a part of"),
        ({"part-0": 0.0}, False, "data.mixture: gives no part of"),
        ({"part-0": -1.0}, False, "data.mixture: 'part-0': expected a weight >= 0, got -1.0"),
    ],
)
def test_a_bad_mixture_is_refused_naming_the_field(tmp_path, mixture, follow, message):
    shards = write_shards(tmp_path / "s", (40,))
    config = run_config(tmp_path, shards, "m")
    config.data.mixture, config.data.follow = mixture, follow
    with pytest.raises(ConfigError, match=message):
        config.validate()
        plan_data(shards, config)


def write_parts(root, part_rows: dict[str, int]):
    """A shard set of one file per part (manifest.json lists the parts, as `albert preprocess --append-to` does)."""
    write_shards(root, tuple(part_rows.values()))
    parts = [
        {"name": name, "shards": [{"name": f"train/shard-{i:05d}.parquet", "rows": rows}]}
        for i, (name, rows) in enumerate(part_rows.items())
    ]
    (root / "manifest.json").write_text(json.dumps({"vocab_size": VOCAB, "parts": parts}))
    return root


def test_plan_data_counts_only_the_rows_the_mixture_draws_in_the_run(tmp_path):
    # news is 16 blocks of 128 rows but owed 0.017 blocks an epoch: the run's 128 examples (under one epoch of the
    # 10-row part-0 drawn 17 times) never reach it, so the run trains 10 distinct rows, fewer than a global batch
    shards = write_parts(tmp_path / "s", {"part-0": 10, "news": 2000})
    config = run_config(tmp_path, shards, "m")
    config.data.mixture = {"part-0": 1.0, "news": 0.001}
    config.validate()
    with pytest.raises(ConfigError, match=r"holds only 10 .*\(counting only the rows data.mixture draws"):
        plan_data(shards, config)
    config.data.mixture = {"part-0": 1.0, "news": 1.0}
    assert plan_data(shards, config).version == 2


def test_a_following_run_may_weigh_a_part_still_to_come(tmp_path):
    shards = write_shards(tmp_path / "s", (40,))
    config = run_config(tmp_path, shards, "m")
    config.data.mixture, config.data.follow = {"part-0": 1.0, "news": 3.0}, True
    config.validate()
    planned = plan_data(shards, config)
    assert planned.version == 1 and planned.order(1, 7, config.data.mixture).weights == (1.0,)
