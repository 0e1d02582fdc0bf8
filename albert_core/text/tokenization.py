"""SentencePiece tokenizer: training and a picklable wrapper with ALBERT's preprocessing.

The vocabulary layout follows the original ALBERT spiece.model: `<pad>`=0, `<unk>`=1, `[CLS]`=2, `[SEP]`=3,
`[MASK]`=4. `[CLS]`, `[SEP]` and `[MASK]` are SentencePiece *control* symbols, so plain text can never produce
them: a literal "[MASK]" in the input is tokenized as ordinary characters. (transformers' AlbertTokenizer
matches special-token strings in raw text instead; that is the one known difference, see `Tokenizer.encode`.)

Text is preprocessed as transformers' AlbertTokenizer does before the SentencePiece model sees it:
"``" and "''" become '"', accents are removed (NFKD, then every combining mark dropped) unless
`keep_accents`, and the text is lower-cased when `lower_case`. Whitespace is collapsed by the model's own
normalizer (nmt_nfkc, with a dummy "▁" prefix).

`load_tokenizer` is the one way in for a tokenizer a user names: a spiece.model (this module's `Tokenizer`), or a
WordPiece vocabulary (BERT's vocab.txt / tokenizer.json: albert_core.text.wordpiece), with the same interface.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import re
import string
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm

from albert_core.text.sentences import split_sentences
from albert_core.text.wordpiece import (
    SPECIAL_TOKENS_FILE,
    TOKENIZER_FILE,
    WORDPIECE_FILES,
    WordPieceTokenizer,
    load_wordpiece,
)
from albert_core.text.wordpiece import VOCAB_FILE as WORDPIECE_VOCAB_FILE

log = logging.getLogger(__name__)

MODEL_FILE = "spiece.model"
VOCAB_FILE = "spiece.vocab"
CONFIG_FILE = "tokenizer_config.json"

PAD, UNK, CLS, SEP, MASK = "<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_PIECES = (PAD, UNK, CLS, SEP, MASK)  # ids 0..4, in this order
WORD_PREFIX = "▁"  # SentencePiece's whitespace marker (U+2581)

_TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
_TOO_LOW = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")
_ASCII_PUNCTUATION = frozenset(string.punctuation)


@dataclass
class TokenizerTrainConfig:
    vocab_size: int = 30000
    lower_case: bool = True
    keep_accents: bool = False
    model_type: str = "unigram"  # unigram | bpe
    character_coverage: float = 0.99995
    input_sentence_size: int = 2_000_000  # lines sampled for training (0 = all)
    shuffle_input_sentence: bool = True
    seed: int = 12345
    max_sentence_length: int = 16384  # bytes; SentencePiece drops longer lines from training
    num_threads: int = 0  # 0 = os.cpu_count(), capped at 16
    allow_smaller_vocab: bool = False  # if the corpus is too small for vocab_size, train the largest it supports


_NON_ASCII = re.compile(r"[^\x00-\x7f]+")


def _drop_marks(match: re.Match) -> str:
    """Combining marks (accents after NFKD) removed; they only occur in non-ASCII runs."""
    return "".join(c for c in match.group() if not unicodedata.category(c).startswith("M"))


def _strip_accents(line: str) -> str:
    return line if line.isascii() else _NON_ASCII.sub(_drop_marks, unicodedata.normalize("NFKD", line))


def preprocess_text(text: str, *, lower_case: bool = True, keep_accents: bool = False) -> str:
    """The normalization transformers' AlbertTokenizer applies before SentencePiece.

    Accents are stripped line by line, and only on lines that are not plain ASCII (ASCII has nothing to decompose):
    neither NFKD nor the marks' removal ever looks across a newline (a starter, which ends every reordering), so
    this equals doing it on the whole text, where text that is mostly ASCII (most corpora, and the newline-joined
    sentences of preprocess_sentences) skips both for almost all of its length."""
    text = text.replace("``", '"').replace("''", '"')
    if not keep_accents and not text.isascii():
        text = "\n".join(map(_strip_accents, text.split("\n")))
    if lower_case:
        text = text.lower()
    return text


def preprocess_sentences(tokenizer: Tokenizer, sentences: list[str]) -> list[str]:
    """[tokenizer.preprocess(s) for s in sentences] in one call on the newline-joined text. Equal because
    sentences hold no newline (split_sentences collapses whitespace) and every step stops at a newline
    (NFKD reordering, the final-sigma rule of lower())."""
    if not sentences:
        return []
    text = "\n".join(sentences)
    if text.count("\n") != len(sentences) - 1:  # a sentence with a newline: the plain way
        return [tokenizer.preprocess(s) for s in sentences]
    return tokenizer.preprocess(text).split("\n")


def is_word_start_piece(piece: str) -> bool:
    """The whole-word rule of the original ALBERT: a piece starts a word if it starts with "▁", is made of
    punctuation only, or starts with a non-ASCII character (e.g. CJK, which has no spaces between words)."""
    if not piece or piece.startswith(WORD_PREFIX):
        return True
    if all(c in _ASCII_PUNCTUATION or unicodedata.category(c).startswith("P") for c in piece):
        return True
    return not piece[0].isascii()


# ----------------------------------------------------------------------------------------------------------
# training


def _training_lines(texts: Iterable[str], config: TokenizerTrainConfig) -> Iterator[str]:
    """One normalized sentence per line, as SentencePiece expects. Texts may be whole documents (a speech
    on a single line): they are split into sentences, and a sentence SentencePiece would drop for its
    length (> max_sentence_length bytes) is cut at spaces into pieces it keeps."""
    limit = config.max_sentence_length
    for text in texts:
        for sentence in split_sentences(text):
            line = preprocess_text(sentence, lower_case=config.lower_case, keep_accents=config.keep_accents).strip()
            if len(line.encode("utf-8")) <= limit:
                if line:
                    yield line
                continue
            piece: list[str] = []
            size = 0
            for word in line.split():
                n = len(word.encode("utf-8")) + 1
                if piece and size + n > limit:
                    yield " ".join(piece)
                    piece, size = [], 0
                if n <= limit:  # a single "word" longer than the limit is dropped
                    piece.append(word)
                    size += n
            if piece:
                yield " ".join(piece)


def _sample_lines(lines: Iterator[str], config: TokenizerTrainConfig) -> tuple[list[str], int]:
    """At most input_sentence_size of the lines (0: all), a uniform sample drawn as they stream by (reservoir
    sampling, seeded), so that memory holds the sample and not the corpus; and how many lines there were. A corpus
    of no more lines is kept whole and in order, as SentencePiece would have read it."""
    k = config.input_sentence_size
    rng = random.Random(config.seed)
    sample: list[str] = []
    seen = 0
    for line in lines:
        seen += 1
        if k <= 0 or len(sample) < k:
            sample.append(line)
        else:
            j = rng.randrange(seen)
            if j < k:
                sample[j] = line
    return sample, seen


def _train_model_bytes(lines: list[str], config: TokenizerTrainConfig, vocab_size: int) -> bytes:
    spm.set_random_generator_seed(config.seed)
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buffer,
        vocab_size=vocab_size,
        model_type=config.model_type,
        character_coverage=config.character_coverage,
        input_sentence_size=config.input_sentence_size,
        shuffle_input_sentence=config.shuffle_input_sentence,
        max_sentence_length=config.max_sentence_length,
        num_threads=config.num_threads or min(os.cpu_count() or 1, 16),
        pad_id=0,
        pad_piece=PAD,
        unk_id=1,
        unk_piece=UNK,
        bos_id=-1,
        eos_id=-1,
        control_symbols=[CLS, SEP, MASK],
        minloglevel=2,
    )
    return buffer.getvalue()


def train_tokenizer(texts: Iterable[str], out_dir: Path, config: TokenizerTrainConfig | None = None) -> Path:
    """Train a SentencePiece model on `texts` (each split into lines) and write out_dir/spiece.model,
    spiece.vocab and tokenizer_config.json. Returns the path of spiece.model."""
    config = config or TokenizerTrainConfig()
    if config.model_type not in ("unigram", "bpe"):
        raise ValueError(f"TokenizerTrainConfig.model_type must be 'unigram' or 'bpe', got {config.model_type!r}")
    if config.vocab_size <= len(SPECIAL_PIECES):
        raise ValueError(f"TokenizerTrainConfig.vocab_size must be > {len(SPECIAL_PIECES)}, got {config.vocab_size}")
    lines, seen = _sample_lines(_training_lines(texts, config), config)
    if not lines:
        raise ValueError("train_tokenizer: the training texts are empty (no non-blank line)")

    vocab_size = config.vocab_size
    try:
        model = _train_model_bytes(lines, config, vocab_size)
    except RuntimeError as err:
        too_high = _TOO_HIGH.search(str(err))
        too_low = _TOO_LOW.search(str(err))
        if too_low is not None:
            raise ValueError(
                f"vocab_size={vocab_size} is too small: this corpus needs {too_low.group(2)} pieces for its "
                f"characters alone (character_coverage={config.character_coverage}). Raise vocab_size or lower "
                f"character_coverage."
            ) from err
        if too_high is None:
            raise ValueError(f"SentencePiece training failed: {err}") from err
        largest = int(too_high.group(2))
        if not config.allow_smaller_vocab:
            raise ValueError(
                f"vocab_size={vocab_size} is too large for this corpus ({seen} lines): the largest "
                f"vocabulary it supports is {largest}. Use vocab_size <= {largest}, more text, "
                f"or allow_smaller_vocab=True."
            ) from err
        log.warning("vocab_size=%d is too large for this corpus; training with %d instead", vocab_size, largest)
        vocab_size = largest
        model = _train_model_bytes(lines, config, vocab_size)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(model, lower_case=config.lower_case, keep_accents=config.keep_accents)
    tokenizer.save(out_dir)
    return out_dir / MODEL_FILE


# ----------------------------------------------------------------------------------------------------------
# the tokenizer


class Tokenizer:
    """A SentencePiece model plus ALBERT's preprocessing. Picklable: it holds the serialized model and
    rebuilds the SentencePieceProcessor lazily (e.g. after Ray ships it to a worker). `model_max_length`: what the
    tokenizer_config.json beside the model says (None when it says nothing)."""

    kind = "SentencePiece"

    def __init__(
        self,
        model_bytes: bytes,
        *,
        lower_case: bool = True,
        keep_accents: bool = False,
        name: str = "",
        model_max_length: int | None = None,
    ):
        self.model_bytes = bytes(model_bytes)
        self.lower_case = lower_case
        self.keep_accents = keep_accents
        self.name = name or "<in-memory spiece.model>"
        self.model_max_length = model_max_length
        self.sha256 = hashlib.sha256(self.model_bytes).hexdigest()
        self._sp: spm.SentencePieceProcessor | None = None
        self._word_start_table: np.ndarray | None = None
        try:
            self._ids = self._special_ids()
        except (RuntimeError, IndexError) as err:  # sentencepiece's words for a damaged or empty model file
            detail = str(err).strip() or type(err).__name__
            raise ValueError(f"{self.name}: not a SentencePiece model ({detail})") from None

    @classmethod
    def load(cls, path: str | os.PathLike, *, lower_case: bool | None = None) -> Tokenizer:
        """Load spiece.model (or a directory holding it). do_lower_case / keep_accents come from a
        tokenizer_config.json beside the model when present; `lower_case` overrides."""
        path = str(path)
        model_path = path
        if os.path.isdir(path):
            model_path = os.path.join(path, MODEL_FILE)
        if not os.path.isfile(model_path) and "://" not in model_path:
            raise FileNotFoundError(f"Tokenizer.load: no SentencePiece model at {model_path}")
        settings = {"do_lower_case": True, "keep_accents": False}
        config_path = os.path.join(os.path.dirname(model_path), CONFIG_FILE)
        stored = {}
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                stored = json.load(f)
            settings.update({k: bool(stored[k]) for k in settings if k in stored})
        limit = stored.get("model_max_length") if isinstance(stored, dict) else None
        if lower_case is not None:
            settings["do_lower_case"] = lower_case
        if "://" in model_path:
            import fsspec

            with fsspec.open(model_path, "rb") as f:
                model_bytes = f.read()
        else:
            model_bytes = Path(model_path).read_bytes()
        return cls(
            model_bytes,
            lower_case=settings["do_lower_case"],
            keep_accents=settings["keep_accents"],
            name=model_path,
            model_max_length=limit if isinstance(limit, int) and not isinstance(limit, bool) else None,
        )

    def save(self, out_dir: str | os.PathLike, *, model_max_length: int = 512) -> Path:
        """Write spiece.model, spiece.vocab and a tokenizer_config.json transformers' AlbertTokenizer reads (its
        outputs include token_type_ids, as our pair encoding has them)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        files = {
            MODEL_FILE: self.model_bytes,
            VOCAB_FILE: "".join(
                f"{self.sp.id_to_piece(i)}\t{self.sp.get_score(i):g}\n" for i in range(self.vocab_size)
            ).encode("utf-8"),
            CONFIG_FILE: json.dumps(
                {
                    "tokenizer_class": "AlbertTokenizer",
                    "do_lower_case": self.lower_case,
                    "keep_accents": self.keep_accents,
                    "remove_space": True,
                    "model_max_length": model_max_length,
                    "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
                    "pad_token": PAD,
                    "unk_token": UNK,
                    "cls_token": CLS,
                    "sep_token": SEP,
                    "mask_token": MASK,
                    "bos_token": CLS,
                    "eos_token": SEP,
                },
                indent=2,
            ).encode("utf-8"),
        }
        for name, data in files.items():
            tmp = out_dir / f".{name}.tmp"
            tmp.write_bytes(data)
            tmp.replace(out_dir / name)
        return out_dir / MODEL_FILE

    # -- pickling: ship the bytes, not the C++ object
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_sp"] = None
        state["_word_start_table"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @property
    def sp(self) -> spm.SentencePieceProcessor:
        if self._sp is None:
            self._sp = spm.SentencePieceProcessor(model_proto=self.model_bytes)
        return self._sp

    def _special_ids(self) -> dict[str, int]:
        ids = {}
        for piece in SPECIAL_PIECES:
            i = self.sp.piece_to_id(piece)
            if self.sp.id_to_piece(i) != piece:
                raise ValueError(
                    f"{self.name}: SentencePiece model has no {piece!r} piece (ALBERT needs {SPECIAL_PIECES})"
                )
            ids[piece] = i
        return ids

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def pad_id(self) -> int:
        return self._ids[PAD]

    @property
    def unk_id(self) -> int:
        return self._ids[UNK]

    @property
    def cls_id(self) -> int:
        return self._ids[CLS]

    @property
    def sep_id(self) -> int:
        return self._ids[SEP]

    @property
    def mask_id(self) -> int:
        return self._ids[MASK]

    @property
    def special_ids(self) -> frozenset[int]:
        """pad, cls, sep, mask (and unk): ids that are never masked or predicted as words."""
        return frozenset(self._ids.values())

    def preprocess(self, text: str) -> str:
        return preprocess_text(text, lower_case=self.lower_case, keep_accents=self.keep_accents)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without [CLS]/[SEP]. Equal to transformers' AlbertTokenizer(text,
        add_special_tokens=False) except where the text spells a special token ("[MASK]") literally."""
        return self.sp.encode(self.preprocess(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """[self.encode(t) for t in texts], preprocessed and encoded in one call each (on this thread)."""
        return self.encode_preprocessed(preprocess_sentences(self, texts))

    def encode_preprocessed(self, texts: list[str]) -> list[list[int]]:
        """Token ids of texts already through `preprocess` (SentencePiece alone, one call, on this thread)."""
        return self.sp.encode(texts, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self.sp.id_to_piece(int(i))

    def piece_to_id(self, piece: str) -> int:
        return self.sp.piece_to_id(piece)

    @property
    def word_start_table(self) -> np.ndarray:
        """bool[vocab_size]: True where a piece starts a word (special, unknown and user pieces included)."""
        if self._word_start_table is None:
            sp = self.sp
            table = np.zeros(self.vocab_size, dtype=bool)
            for i in range(self.vocab_size):
                special = sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)
                table[i] = special or is_word_start_piece(sp.id_to_piece(i))
            table.setflags(write=False)
            self._word_start_table = table
        return self._word_start_table

    def word_starts(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        return self.word_start_table[np.asarray(ids, dtype=np.int64)]

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name}, vocab_size={self.vocab_size}, lower_case={self.lower_case}, "
            f"sha256={self.sha256[:12]})"
        )


AnyTokenizer = Tokenizer | WordPieceTokenizer  # what load_tokenizer gives: the same interface


def tokenizer_at(path: str | os.PathLike) -> Path | None:
    """What `load_tokenizer` reads at `path`: a spiece.model file (given, or in the directory given), or a
    directory holding a WordPiece vocab.txt / tokenizer.json (given, or the directory of the one given); None when
    there is neither."""
    path = Path(path)
    if path.is_file():
        return path.parent if path.name in WORDPIECE_FILES else path
    if (path / MODEL_FILE).is_file():
        return path / MODEL_FILE
    if any((path / name).is_file() for name in WORDPIECE_FILES):
        return path
    return None


def tokenizer_files(found: Path | None) -> list[Path]:
    """The files that make up the tokenizer `tokenizer_at` found (a spiece.model with the tokenizer_config.json beside
    it; a WordPiece directory's vocabulary, tokenizer.json and configs): what goes with a checkpoint."""
    if found is None:
        return []
    if found.is_dir():  # WordPiece
        folder, names = found, (*WORDPIECE_FILES, CONFIG_FILE, SPECIAL_TOKENS_FILE)
    else:
        folder, names = found.parent, (found.name, CONFIG_FILE)
    return [folder / name for name in names if (folder / name).is_file()]


def load_tokenizer(path: str | os.PathLike) -> AnyTokenizer:
    """The tokenizer at `path`: a spiece.model or a directory holding one (`Tokenizer`, ALBERT), else a directory
    holding a WordPiece vocab.txt and/or tokenizer.json (`WordPieceTokenizer`, BERT; a path to either file means
    its directory). FileNotFoundError in one line saying what it expected when the path holds none of them."""
    if "://" in str(path):
        return Tokenizer.load(path)
    found = tokenizer_at(path)
    if found is None:
        why = "no such file or directory"
        if Path(path).is_dir():
            why = f"a directory without {MODEL_FILE}, {WORDPIECE_VOCAB_FILE} or {TOKENIZER_FILE}"
        raise FileNotFoundError(
            f"no SentencePiece model at {path} ({why}); expected a {MODEL_FILE} (ALBERT), or a model or tokenizer "
            f"directory holding {MODEL_FILE} or a WordPiece {WORDPIECE_VOCAB_FILE} / {TOKENIZER_FILE} (BERT)"
        )
    return load_wordpiece(found) if found.is_dir() else Tokenizer.load(found)


@dataclass(frozen=True)
class TokenIds:
    """The ids training and evaluation need from the tokenizer. Defaults: ALBERT's (pad, unk, cls, sep, mask = 0..4)."""

    vocab_size: int
    pad_id: int = 0
    unk_id: int = 1
    cls_id: int = 2
    sep_id: int = 3
    mask_id: int = 4

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids that are never masked: pad, unk, cls, sep, mask (as `Tokenizer.special_ids`)."""
        return frozenset((self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id))

    @classmethod
    def from_tokenizer(cls, tokenizer: AnyTokenizer) -> TokenIds:
        return cls(
            vocab_size=tokenizer.vocab_size,
            pad_id=tokenizer.pad_id,
            unk_id=tokenizer.unk_id,
            cls_id=tokenizer.cls_id,
            sep_id=tokenizer.sep_id,
            mask_id=tokenizer.mask_id,
        )
