"""WordPiece tokenizer (BERT's): a model directory's vocab.txt and/or tokenizer.json, read through the fast tokenizer
of the `tokenizers` package, with the interface the rest of albert uses from the SentencePiece `Tokenizer`
(albert_core.text.tokenization; `load_tokenizer` there picks the kind a path holds).

A directory is read as transformers' BertTokenizer reads it, so the ids are its ids: tokenizer.json when present,
else vocab.txt (one token a line, its line number the id) with BERT's normalizer, pre-tokenizer and decoder.
tokenizer_config.json's do_lower_case / strip_accents / tokenize_chinese_chars decide the normalizer (BERT's
defaults: lower-cased, accents stripped when lower-cased, CJK characters split) unless the directory has a
tokenizer.json and its tokenizer_config.json names neither these options nor a BertTokenizer: then tokenizer.json's
own normalizer stands, as transformers' generic fast tokenizer keeps it. The special tokens are the names
tokenizer_config.json (else special_tokens_map.json, else BERT's [PAD] [UNK] [CLS] [SEP] [MASK]) gives, by their
ids in the vocabulary (0/100/101/102/103 in BERT uncased). Padding and truncation a tokenizer.json carries are
switched off: `encode` gives the text's ids, without [CLS]/[SEP]. model_max_length is tokenizer_config.json's.

A word is a piece without the "##" continuation prefix followed by its continuation pieces (`word_start_table`),
which is what whole-word masking reads. The tokenizer's identity (`sha256`) is the sha256 of its vocabulary as
vocab.txt holds it: each token in id order followed by "\\n", BERT's vocab.txt byte for byte and what `save` writes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

VOCAB_FILE = "vocab.txt"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
WORDPIECE_FILES = (TOKENIZER_FILE, VOCAB_FILE)  # either makes a directory a WordPiece tokenizer
BERT_SPECIALS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
CASING_OPTIONS = ("do_lower_case", "strip_accents", "tokenize_chinese_chars")  # tokenizer_config.json's, BERT's
BERT_CLASSES = ("BertTokenizer", "BertTokenizerFast")  # transformers rebuilds their normalizer from the options


def read_vocab(path: str | os.PathLike) -> list[str]:
    """The tokens of a vocab.txt in id order, as transformers' load_vocab reads them (a line is a token)."""
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def vocab_sha256(tokens: Sequence[str]) -> str:
    """The identity of a WordPiece vocabulary: the sha256 of its vocab.txt (each token followed by a newline)."""
    return hashlib.sha256("".join(f"{token}\n" for token in tokens).encode("utf-8")).hexdigest()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_name(value: Any) -> str | None:
    """A special token as tokenizer_config.json / special_tokens_map.json write it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def special_tokens(directory: Path, config: dict[str, Any]) -> dict[str, str]:
    """role (pad, unk, cls, sep, mask) -> token: tokenizer_config.json's, else special_tokens_map.json's, else
    BERT's."""
    mapped = _read_json(directory / SPECIAL_TOKENS_FILE)
    tokens = {}
    for role, default in BERT_SPECIALS.items():
        key = f"{role}_token"
        tokens[role] = _token_name(config.get(key)) or _token_name(mapped.get(key)) or default
    return tokens


def _normalizer_types(state: Any) -> list[str]:
    """The types of a serialized normalizer and of those inside it (a Sequence)."""
    if isinstance(state, dict):
        inner = state.get("normalizers") or []
        return [str(state.get("type")), *(t for n in inner for t in _normalizer_types(n))]
    return []


def _casing(normalizer: Any) -> tuple[bool, bool]:
    """(lower_case, keep_accents) of a serialized normalizer (BERT's: accents stripped when lower-cased, unless
    strip_accents says otherwise)."""
    if isinstance(normalizer, dict) and normalizer.get("type") == "BertNormalizer":
        lower = bool(normalizer.get("lowercase"))
        strip = normalizer.get("strip_accents")
        return lower, not (lower if strip is None else bool(strip))
    types = _normalizer_types(normalizer)
    return "Lowercase" in types, "StripAccents" not in types


class WordPieceTokenizer:
    """A WordPiece vocabulary with its normalizer, as a `tokenizers` fast tokenizer. Picklable: it holds the
    tokenizer serialized (tokenizer.json's text) and rebuilds it lazily (e.g. after Ray ships it to a worker)."""

    kind = "WordPiece"

    def __init__(
        self, serialized: str, *, specials: dict[str, str], model_max_length: int | None = None, name: str = ""
    ):
        self.serialized = serialized
        self.name = name or "<in-memory WordPiece tokenizer>"
        self.model_max_length = model_max_length
        self._tok = None
        self._word_start_table: np.ndarray | None = None
        state = json.loads(serialized)
        model = state.get("model") or {}
        if model.get("type") != "WordPiece":
            raise ValueError(
                f"{self.name}: its tokenizer.json is a {model.get('type')} model; albert reads WordPiece "
                f"(vocab.txt / tokenizer.json, BERT) and SentencePiece (spiece.model, ALBERT)"
            )
        self.prefix = str(model.get("continuing_subword_prefix") or "##")
        self.pieces = self._pieces()
        self.sha256 = vocab_sha256(self.pieces)
        self.lower_case, self.keep_accents = _casing(state.get("normalizer"))
        self.normalizer = state.get("normalizer")
        self.specials = dict(specials)
        self._ids = {}
        for role, token in self.specials.items():
            i = self.tok.token_to_id(token)
            if i is None:
                raise ValueError(
                    f"{self.name}: the vocabulary has no {token!r} (its {role} token); ALBERT and BERT need "
                    f"{', '.join(BERT_SPECIALS.values())} or the tokens tokenizer_config.json names"
                )
            self._ids[role] = i

    def _pieces(self) -> list[str]:
        vocab = self.tok.get_vocab(with_added_tokens=True)
        pieces = [""] * len(vocab)
        for piece, i in vocab.items():
            if not 0 <= i < len(pieces) or pieces[i]:
                raise ValueError(f"{self.name}: the vocabulary's ids are not 0..{len(vocab) - 1}, each once")
            pieces[i] = piece
        return pieces

    # -- pickling: ship the serialized tokenizer, not the Rust object
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_tok"] = None
        state["_word_start_table"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @property
    def tok(self):
        """The `tokenizers.Tokenizer`."""
        if self._tok is None:
            from tokenizers import Tokenizer as FastTokenizer

            self._tok = FastTokenizer.from_str(self.serialized)
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    @property
    def pad_id(self) -> int:
        return self._ids["pad"]

    @property
    def unk_id(self) -> int:
        return self._ids["unk"]

    @property
    def cls_id(self) -> int:
        return self._ids["cls"]

    @property
    def sep_id(self) -> int:
        return self._ids["sep"]

    @property
    def mask_id(self) -> int:
        return self._ids["mask"]

    @property
    def special_ids(self) -> frozenset[int]:
        """pad, unk, cls, sep, mask: ids that are never masked or predicted as words."""
        return frozenset(self._ids.values())

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without [CLS]/[SEP]: transformers' tokenizer(text, add_special_tokens=False)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """[self.encode(t) for t in texts], on this thread (`tokenizers`' encode_batch would start a thread per core
        in every one-CPU preprocess task, and measured no faster on one)."""
        tok = self.tok
        return [tok.encode(text, add_special_tokens=False).ids for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of these ids, special tokens left out (as SentencePiece leaves its control pieces out)."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def id_to_piece(self, i: int) -> str:
        return self.pieces[int(i)]

    def piece_to_id(self, piece: str) -> int:
        """The piece's id; the unknown token's for a piece outside the vocabulary (as SentencePiece answers)."""
        i = self.tok.token_to_id(piece)
        return self.unk_id if i is None else i

    @property
    def word_start_table(self) -> np.ndarray:
        """bool[vocab_size]: True where a piece starts a word, i.e. has no "##" continuation prefix."""
        if self._word_start_table is None:
            table = np.array([not piece.startswith(self.prefix) for piece in self.pieces], dtype=bool)
            table.setflags(write=False)
            self._word_start_table = table
        return self._word_start_table

    def word_starts(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        return self.word_start_table[np.asarray(ids, dtype=np.int64)]

    def save(self, out_dir: str | os.PathLike, *, model_max_length: int | None = None) -> Path:
        """Write vocab.txt, tokenizer.json, tokenizer_config.json and special_tokens_map.json, which this class and
        transformers' AutoTokenizer read back to the same ids. Returns the directory."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        specials = {f"{role}_token": token for role, token in self.specials.items()}
        config: dict[str, Any] = {"tokenizer_class": "TokenizersBackend"}
        if isinstance(self.normalizer, dict) and self.normalizer.get("type") == "BertNormalizer":
            config = {
                "tokenizer_class": "BertTokenizer",
                "do_lower_case": bool(self.normalizer.get("lowercase")),
                "strip_accents": self.normalizer.get("strip_accents"),
                "tokenize_chinese_chars": bool(self.normalizer.get("handle_chinese_chars", True)),
            }
        limit = model_max_length or self.model_max_length
        config.update(
            model_max_length=limit or 512,
            model_input_names=["input_ids", "token_type_ids", "attention_mask"],
            **specials,
        )
        files = {
            VOCAB_FILE: "".join(f"{piece}\n" for piece in self.pieces),
            TOKENIZER_FILE: self.serialized,
            CONFIG_FILE: json.dumps(config, indent=2) + "\n",
            SPECIAL_TOKENS_FILE: json.dumps(specials, indent=2) + "\n",
        }
        for name, text in files.items():
            tmp = out_dir / f".{name}.tmp"
            tmp.write_bytes(text.encode("utf-8"))
            tmp.replace(out_dir / name)
        return out_dir

    def __repr__(self) -> str:
        return (
            f"WordPieceTokenizer({self.name}, vocab_size={self.vocab_size}, lower_case={self.lower_case}, "
            f"sha256={self.sha256[:12]})"
        )


def _bert_normalizer(config: dict[str, Any]):
    from tokenizers import normalizers

    return normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=bool(config.get("tokenize_chinese_chars", True)),
        strip_accents=config.get("strip_accents"),
        lowercase=bool(config.get("do_lower_case", True)),
    )


def _from_vocab(path: Path, specials: dict[str, str]):
    """BERT's fast tokenizer over vocab.txt, as transformers' BertTokenizer builds it."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, pre_tokenizers
    from tokenizers.models import WordPiece

    tokens = read_vocab(path)
    ids: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if ids.setdefault(token, i) != i:
            raise ValueError(f"{path}: line {i + 1} repeats the token {token!r} of line {ids[token] + 1}")
    if specials["unk"] not in ids:
        raise ValueError(f"{path}: the vocabulary has no {specials['unk']!r} (its unk token)")
    fast = FastTokenizer(WordPiece(ids, unk_token=specials["unk"]))
    fast.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    fast.decoder = decoders.WordPiece(prefix="##")
    fast.add_special_tokens([token for token in specials.values() if token in ids])
    return fast


def load_wordpiece(directory: str | os.PathLike) -> WordPieceTokenizer:
    """The WordPiece tokenizer of a directory holding tokenizer.json and/or vocab.txt (see the module's docstring)."""
    from tokenizers import Tokenizer as FastTokenizer

    directory = Path(directory)
    config = _read_json(directory / CONFIG_FILE)
    specials = special_tokens(directory, config)
    if (directory / TOKENIZER_FILE).is_file():
        try:
            fast = FastTokenizer.from_file(str(directory / TOKENIZER_FILE))
        except Exception as err:  # the Rust side's errors are plain Exceptions
            raise ValueError(f"{directory / TOKENIZER_FILE}: not a tokenizers tokenizer.json ({err})") from None
        rebuild = any(k in config for k in CASING_OPTIONS) or config.get("tokenizer_class") in BERT_CLASSES
    else:
        fast = _from_vocab(directory / VOCAB_FILE, specials)
        rebuild = True
    if rebuild:
        fast.normalizer = _bert_normalizer(config)
    fast.no_padding()
    fast.no_truncation()
    limit = config.get("model_max_length")
    limit = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
    return WordPieceTokenizer(fast.to_str(), specials=specials, model_max_length=limit, name=str(directory))
