"""`albert convert`: the tokenizer travels with the weights, the direction follows from the source, and an output
that already holds files is not mixed into."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from albert_core.finetune.tasks.glue import encode_pair
from albert_core.model.checkpoint import read_checkpoint, save_model
from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import AlbertForPreTraining
from albert_core.text.tokenization import Tokenizer, TokenizerTrainConfig, train_tokenizer
from services.cli import main
from services.terminal import EXIT_DATA

transformers = pytest.importorskip("transformers")

CORPUS = (Path(__file__).parent / "fixtures" / "tokenizer_corpus.txt").read_text(encoding="utf-8").splitlines()
VOCAB = 400
TEXTS = [
    "The harbour was quiet in the early morning.",
    "THE FISHERMEN WERE Mending Their Nets, and The Gulls Cried.",
    "Café naïve résumé — Zürich, São Paulo, Kraków.",
    "``Quoted'' text, with 1,000,000 dollars, 3.14 pi and 12.5% at 23:59.",
    '  many   spaces\tand\ttabs (really) "true"?!  ',
    "東京は日本の首都です。",
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    """Two tokenizers trained on the same text: uncased (ALBERT's default) and `albert tokenizer train --cased`."""
    out = {}
    for name, lower_case in (("uncased", True), ("cased", False)):
        out[name] = tmp_path_factory.mktemp(name)
        train_tokenizer(CORPUS, out[name], TokenizerTrainConfig(vocab_size=VOCAB, lower_case=lower_case))
    return out


def run_checkpoint(root: Path, tokenizer_dir: Path | None, vocab_size: int = VOCAB) -> Path:
    """A pretraining run's layout: the tokenizer in the run directory, the model in checkpoints/step_N."""
    run = root / "run"
    checkpoint = run / "checkpoints" / "step_00000010"
    torch.manual_seed(0)
    config = AlbertConfig(vocab_size=vocab_size, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=64, max_position_embeddings=128)  # fmt: skip
    save_model(checkpoint, AlbertForPreTraining(config))
    if tokenizer_dir is not None:
        for name in (
            "spiece.model",
            "tokenizer_config.json",
        ):  # what services.train.pretrain.keep_tokenizer_with_run copies
            shutil.copy2(tokenizer_dir / name, run / name)
    return checkpoint


def convert(*args: object) -> int:
    return main(["convert", *map(str, args)])


@pytest.mark.parametrize("casing", ["uncased", "cased"])
def test_autotokenizer_of_a_converted_checkpoint_gives_our_ids_for_texts_and_pairs(tmp_path, tokenizers, casing):
    source = run_checkpoint(tmp_path, tokenizers[casing])
    assert convert(source, tmp_path / "hf") == 0
    ours = Tokenizer.load(tokenizers[casing])
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert ours.lower_case is theirs.do_lower_case is (casing == "uncased")
    assert len(theirs) == VOCAB and theirs.model_max_length == 128
    for text in TEXTS:
        ids, types = encode_pair(ours, text, None, 128)
        assert (theirs(text)["input_ids"], theirs(text)["token_type_ids"]) == (ids, types), text
    for a, b in zip(TEXTS, TEXTS[1:], strict=False):
        ids, types = encode_pair(ours, a, b, 128)
        assert (theirs(a, b)["input_ids"], theirs(a, b)["token_type_ids"]) == (ids, types), (a, b)
    specials = (theirs.pad_token_id, theirs.unk_token_id, theirs.cls_token_id, theirs.sep_token_id)
    assert (*specials, theirs.mask_token_id) == (ours.pad_id, ours.unk_id, ours.cls_id, ours.sep_id, ours.mask_id)


def test_a_cased_conversion_keeps_case_in_transformers(tmp_path, tokenizers):
    assert convert(run_checkpoint(tmp_path, tokenizers["cased"]), tmp_path / "hf") == 0
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert theirs("The Harbour")["input_ids"] != theirs("the harbour")["input_ids"]


@pytest.mark.parametrize("casing", ["uncased", "cased"])
def test_a_round_trip_albert_hf_albert_keeps_weights_and_tokenizer(tmp_path, tokenizers, casing):
    source = run_checkpoint(tmp_path, tokenizers[casing])
    assert convert(source, tmp_path / "hf") == 0  # no --to: an albert source converts to transformers
    assert "model_type" in json.loads((tmp_path / "hf" / "config.json").read_text())
    assert convert(tmp_path / "hf", tmp_path / "back") == 0  # and a transformers source back to albert
    assert "model_type" not in json.loads((tmp_path / "back" / "config.json").read_text())
    spiece = (tokenizers[casing] / "spiece.model").read_bytes()
    assert (tmp_path / "back" / "spiece.model").read_bytes() == spiece
    assert Tokenizer.load(tmp_path / "back").lower_case is (casing == "uncased")
    (_, before), (_, after) = read_checkpoint(source), read_checkpoint(tmp_path / "back")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_converting_into_the_sources_own_format_is_refused_with_one_line(tmp_path, tokenizers, capsys):
    source = run_checkpoint(tmp_path, tokenizers["uncased"])
    assert convert(source, tmp_path / "hf") == 0
    capsys.readouterr()
    assert convert(tmp_path / "hf", tmp_path / "hf2", "--to", "hf") == EXIT_DATA
    assert convert(source, tmp_path / "albert2", "--to", "albert") == EXIT_DATA
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert "is already a transformers checkpoint" in lines[0] and "--to albert" in lines[0]
    assert "is already an albert model directory" in lines[1] and "--to hf" in lines[1]
    assert not (tmp_path / "hf2").exists() and not (tmp_path / "albert2").exists()


def _stale_bert_tokenizer(directory: Path) -> None:
    """The tokenizer files of another model (a WordPiece BERT), which transformers would read before spiece.model."""
    directory.mkdir()
    (directory / "notes.txt").write_text("mine\n")
    (directory / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "harbour"]))
    transformers.BertTokenizerFast(vocab_file=str(directory / "vocab.txt")).save_pretrained(str(directory))


def test_a_non_empty_output_is_refused_and_force_replaces_the_checkpoint_there(tmp_path, tokenizers, capsys):
    source = run_checkpoint(tmp_path, tokenizers["uncased"])
    _stale_bert_tokenizer(tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert convert(source, tmp_path / "out") == EXIT_DATA
    err = capsys.readouterr().err.strip()
    assert "not empty" in err and "--force" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out" / "model.safetensors").exists()

    assert convert(source, tmp_path / "out", "--force") == 0
    assert not (tmp_path / "out" / "tokenizer.json").exists() and not (tmp_path / "out" / "vocab.txt").exists()
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine\n"  # not a checkpoint file: left alone
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    ours = Tokenizer.load(tokenizers["uncased"])
    assert theirs(TEXTS[0])["input_ids"] == encode_pair(ours, TEXTS[0], None, 128)[0]


def test_without_a_tokenizer_it_converts_and_warns_once_how_to_add_one(tmp_path, tokenizers, capsys):
    source = run_checkpoint(tmp_path, None)
    assert convert(source, tmp_path / "hf") == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("albert: warning:")
    assert "no tokenizer" in err[0] and "--tokenizer" in err[0]
    assert not (tmp_path / "hf" / "spiece.model").exists()

    assert convert(source, tmp_path / "hf", "--tokenizer", tokenizers["uncased"] / "spiece.model", "--force") == 0
    assert capsys.readouterr().err == ""
    assert len(transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))) == VOCAB


def test_a_tokenizer_of_another_vocabulary_size_is_refused_before_anything_is_written(tmp_path, tokenizers, capsys):
    source = run_checkpoint(tmp_path, None, vocab_size=VOCAB + 50)
    assert convert(source, tmp_path / "hf", "--tokenizer", tokenizers["uncased"]) == EXIT_DATA
    err = capsys.readouterr().err
    assert f"vocab_size {VOCAB + 50}" in err and f"{VOCAB} pieces" in err
    assert not (tmp_path / "hf").exists()
