import hashlib
import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from albert_core.text.tokenization import (
    Tokenizer,
    TokenizerTrainConfig,
    is_word_start_piece,
    preprocess_text,
    train_tokenizer,
)

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer_corpus.txt"
TEXTS = FIXTURE.read_text(encoding="utf-8").splitlines()

VARIED_TEXTS = [
    "Hello World!",
    "THE HARBOUR WAS QUIET, and The Fishermen Were Mending Nets.",
    "Café naïve résumé — Zürich, São Paulo, Kraków, Malmö, Señor Núñez.",
    "``Quoted'' text, with 1,000,000 dollars, 3.14 pi, 12.5% and 1899-12-31 at 23:59.",
    'He said: "Is it (really) true?!" -- she replied; [yes] {no} <maybe> @home #1 $5 & 50/50.',
    "東京は日本の首都です。北京是中国的首都。",
    "Москва — столица России. Αθήνα είναι η πρωτεύουσα. हिन्दी भाषा है।",
    "ﬁnancial ½ cup ① Ⅻ ＡＢＣ ｆｕｌｌｗｉｄｔｈ",
    "  many   spaces\tand\ttabs\nand newlines  ",
    "İstanbul ǅ straße Σίσυφος emoji 😀 zero\u200bwidth no\u00a0break",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(TEXTS, out, TokenizerTrainConfig(vocab_size=400))
    return out


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.load(tok_dir)


def test_special_pieces_have_the_original_albert_ids(tok):
    pieces = [tok.id_to_piece(i) for i in range(5)]
    assert pieces == ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 1, 2, 3, 4)
    assert tok.special_ids == frozenset({0, 1, 2, 3, 4})


def test_trained_vocabulary_has_the_requested_size(tok):
    assert tok.vocab_size == 400


def test_special_pieces_never_come_from_plain_text(tok):
    ids = tok.encode("[CLS] a [SEP] b [MASK] <pad> " + " ".join(TEXTS[:5]))
    assert not set(ids) & {tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id}


def test_encode_matches_transformers_albert_tokenizer(tok, tok_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AlbertTokenizer.from_pretrained(str(tok_dir))
    for text in VARIED_TEXTS + TEXTS:
        assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text


def test_transformers_wraps_with_our_cls_and_sep(tok, tok_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AlbertTokenizer.from_pretrained(str(tok_dir))
    ids = hf("the harbour", "the quay")["input_ids"]
    assert ids == [tok.cls_id, *tok.encode("the harbour"), tok.sep_id, *tok.encode("the quay"), tok.sep_id]
    assert hf.pad_token_id == tok.pad_id and hf.mask_token_id == tok.mask_id and hf.unk_token_id == tok.unk_id


def test_cased_tokenizer_keeps_case_and_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    train_tokenizer(TEXTS, tmp_path, TokenizerTrainConfig(vocab_size=400, lower_case=False))
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["do_lower_case"] is False
    tok = Tokenizer.load(tmp_path)
    assert tok.lower_case is False
    assert tok.encode("The Harbour") != tok.encode("the harbour")
    hf = transformers.AlbertTokenizer.from_pretrained(str(tmp_path))
    for text in VARIED_TEXTS:
        assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text


def test_lower_casing_and_accent_stripping_are_applied(tok):
    assert tok.encode("CAFÉ ZÜRICH") == tok.encode("cafe zurich")
    assert preprocess_text("``Hi''") == '"hi"'


def test_decode_inverts_encode_on_normalized_text(tok):
    text = "the harbour was quiet in the early morning, and the fishermen were mending their nets."
    assert tok.decode(tok.encode(text)) == text


def test_too_large_vocab_raises_with_the_largest_supported_size(tmp_path):
    with pytest.raises(ValueError, match=r"largest vocabulary it supports is \d+") as info:
        train_tokenizer(TEXTS, tmp_path, TokenizerTrainConfig(vocab_size=30000))
    largest = int(re.search(r"supports is (\d+)", str(info.value)).group(1))
    assert 5 < largest < 30000
    assert not (tmp_path / "spiece.model").exists()


def test_allow_smaller_vocab_trains_the_largest_supported_size(tmp_path, caplog):
    with pytest.raises(ValueError) as info:
        train_tokenizer(TEXTS, tmp_path / "a", TokenizerTrainConfig(vocab_size=30000))
    largest = int(re.search(r"supports is (\d+)", str(info.value)).group(1))
    with caplog.at_level("WARNING"):
        path = train_tokenizer(TEXTS, tmp_path / "b", TokenizerTrainConfig(vocab_size=30000, allow_smaller_vocab=True))
    assert Tokenizer.load(path).vocab_size == largest
    assert any("too large" in r.message for r in caplog.records)


def test_too_small_vocab_raises_with_the_size_the_characters_need(tmp_path):
    with pytest.raises(ValueError, match=r"vocab_size=50 is too small: this corpus needs \d+ pieces"):
        train_tokenizer(TEXTS, tmp_path, TokenizerTrainConfig(vocab_size=50))


def test_documents_on_one_long_line_are_used_for_training(tmp_path):
    # one 4 KB "document" per text, longer than max_sentence_length: still learned, sentence by sentence
    config = TokenizerTrainConfig(vocab_size=300, max_sentence_length=200)
    tok = Tokenizer.load(train_tokenizer([" ".join(TEXTS[:20])] * 3, tmp_path, config))
    assert len(tok.encode("the harbour")) < len("the harbour")


def test_empty_training_texts_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        train_tokenizer(["", "   ", "\n\n"], tmp_path)


def test_training_is_deterministic_for_a_seed(tmp_path):
    config = TokenizerTrainConfig(vocab_size=300, seed=7)
    a = Tokenizer.load(train_tokenizer(TEXTS, tmp_path / "a", config))
    b = Tokenizer.load(train_tokenizer(TEXTS, tmp_path / "b", config))
    assert a.sha256 == b.sha256


def test_sha256_is_the_digest_of_the_model_file(tok, tok_dir):
    assert tok.sha256 == hashlib.sha256((tok_dir / "spiece.model").read_bytes()).hexdigest()


def test_load_accepts_the_model_file_or_its_directory(tok_dir):
    assert Tokenizer.load(tok_dir / "spiece.model").sha256 == Tokenizer.load(tok_dir).sha256


def test_load_of_a_missing_model_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "spiece.model")):
        Tokenizer.load(tmp_path)


def test_model_without_albert_special_pieces_is_rejected(tmp_path):
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS), model_prefix=str(tmp_path / "spiece"), vocab_size=300, minloglevel=2
    )
    with pytest.raises(ValueError, match=r"no '<pad>' piece"):
        Tokenizer.load(tmp_path / "spiece.model")


def test_pickled_tokenizer_encodes_the_same_and_rebuilds_lazily(tok):
    tok.encode("warm up")  # the processor exists before pickling
    data = pickle.dumps(tok)
    clone = pickle.loads(data)
    assert clone._sp is None
    assert clone.sha256 == tok.sha256
    for text in VARIED_TEXTS:
        assert clone.encode(text) == tok.encode(text)
    assert np.array_equal(clone.word_start_table, tok.word_start_table)


def test_word_start_rule_on_pieces():
    assert is_word_start_piece("▁the")
    assert is_word_start_piece("▁")
    assert is_word_start_piece(",")
    assert is_word_start_piece("?!")
    assert is_word_start_piece("東")
    assert not is_word_start_piece("ing")
    assert not is_word_start_piece(",000")


def test_word_start_table_marks_word_initial_pieces(tok):
    table = tok.word_start_table
    assert table.shape == (tok.vocab_size,) and table.dtype == bool
    assert all(table[i] for i in tok.special_ids)
    for i in range(tok.vocab_size):
        assert table[i] == (i in tok.special_ids or is_word_start_piece(tok.id_to_piece(i)))
    assert table.any() and not table.all()


def test_word_starts_looks_up_each_id(tok):
    text = "The fishermen, unexpectedly, were mending nets in Zürich."
    ids = tok.encode(text)
    pieces = tok.sp.encode(tok.preprocess(text), out_type=str)  # SentencePiece's own pieces of those ids
    starts = tok.word_starts(ids)
    assert starts.tolist() == [is_word_start_piece(p) for p in pieces]
    assert starts[0]  # a text always begins with a word
    assert not starts.all()  # some words split into several pieces
