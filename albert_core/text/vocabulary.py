"""Which tokenizer belongs to a checkpoint, and refusing a checkpoint whose vocabulary is not the tokenizer's.

A model's embedding rows are indexed by one tokenizer's ids. Fed another tokenizer's ids it runs and reports
nonsense (mlm_acc 0.0 after minutes), so `albert evaluate`, `albert finetune` and `albert convert` compare, before
anything slow starts: the checkpoint's `vocab_size` (config.json) with the tokenizer's piece count, and the
tokenizer files the checkpoint directory carries itself (spiece.model, or a WordPiece vocab.txt) with the tokenizer:
the same kind (SentencePiece or WordPiece) and the same sha256 (of the spiece.model, or of the vocab.txt). Reading
only config.json and the tokenizer files, the checks take milliseconds (a tenth of a second for a tokenizer.json).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from albert_core.examples.shards import MANIFEST_FILE, ShardsManifest
from albert_core.files import CheckpointError
from albert_core.text.tokenization import MODEL_FILE, AnyTokenizer, Tokenizer, load_tokenizer, tokenizer_at
from albert_core.text.wordpiece import VOCAB_FILE, WordPieceTokenizer, read_vocab, vocab_sha256

WORDPIECE_FILE = VOCAB_FILE  # BERT's WordPiece vocabulary, one token per line
SENTENCEPIECE, WORDPIECE = Tokenizer.kind, WordPieceTokenizer.kind


class VocabularyMismatch(CheckpointError):
    """The checkpoint was trained with another vocabulary than the tokenizer it is used with."""


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer as far as a checkpoint cares: its kind, where it is, its size and (SentencePiece) model hash."""

    kind: str  # SENTENCEPIECE | WORDPIECE
    source: str  # a path, for messages
    size: int | None
    sha256: str | None = None

    @classmethod
    def of(cls, tokenizer: AnyTokenizer) -> Vocabulary:
        return cls(tokenizer.kind, tokenizer.name, tokenizer.vocab_size, tokenizer.sha256)

    def describe(self, *, with_hash: bool = False) -> str:
        unit = "pieces" if self.kind == SENTENCEPIECE else "tokens"
        size = f"{self.size} {unit}" if self.size is not None else "unknown size"
        digest = f", sha256 {self.sha256[:12]}" if with_hash and self.sha256 else ""
        return f"{self.kind} {self.source} ({size}{digest})"


def tokenizer_candidates(checkpoint: str | Path) -> list[Path]:
    """The directories that may hold a checkpoint's tokenizer (a spiece.model or a WordPiece vocabulary): its own
    or up to two levels above (a pretraining run keeps it in the run directory, its checkpoints in
    run_dir/checkpoints/step_N)."""
    directory = Path(checkpoint)
    return [directory, directory.parent, directory.parent.parent]


def find_tokenizer(checkpoint: str | Path) -> Path | None:
    """The first tokenizer `tokenizer_candidates` hold, as `load_tokenizer` reads it (a spiece.model, or a
    directory holding a WordPiece vocabulary), or None."""
    return next((found for d in tokenizer_candidates(checkpoint) if (found := tokenizer_at(d)) is not None), None)


def checkpoint_vocab_size(checkpoint: str | Path) -> int | None:
    """vocab_size from the checkpoint's config.json (ours or transformers'); None when it cannot be read."""
    try:
        size = json.loads((Path(checkpoint) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def own_vocabulary(checkpoint: str | Path) -> Vocabulary | None:
    """The tokenizer files the checkpoint directory itself holds: spiece.model, else a WordPiece vocab.txt."""
    directory = Path(checkpoint)
    spiece, wordpiece = directory / MODEL_FILE, directory / WORDPIECE_FILE
    if spiece.is_file():
        data = spiece.read_bytes()
        try:
            size = spm.SentencePieceProcessor(model_proto=data).get_piece_size()
        except RuntimeError:
            size = None
        return Vocabulary(SENTENCEPIECE, str(spiece), size, hashlib.sha256(data).hexdigest())
    if wordpiece.is_file():
        tokens = read_vocab(wordpiece)
        return Vocabulary(WORDPIECE, str(wordpiece), len(tokens), vocab_sha256(tokens))
    return None


def checkpoint_vocabulary(checkpoint: str | Path) -> Vocabulary | None:
    """The checkpoint's tokenizer: the files it holds itself (every checkpoint a pretraining run writes carries
    them), else those `find_tokenizer` finds above it (a checkpoint written before that, in its run directory)."""
    own = own_vocabulary(checkpoint)
    if own is not None:
        return own
    found = find_tokenizer(checkpoint)  # a spiece.model, or a WordPiece directory
    if found is None:
        return None
    return own_vocabulary(found.parent if found.is_file() else found)


def check_vocabulary(checkpoint: str | Path, tokenizer: Vocabulary, role: str = "the tokenizer is") -> None:
    """Raise VocabularyMismatch (one line naming both) unless `tokenizer` can be the checkpoint's vocabulary.

    `role` introduces the tokenizer in the message ("the tokenizer is", "the held-out data was tokenized with")."""
    own = checkpoint_vocabulary(checkpoint)
    if own is not None and own.kind != tokenizer.kind:
        raise VocabularyMismatch(
            f"checkpoint {checkpoint} was made with {own.describe()}, but {role} {tokenizer.describe()}"
        )
    if own is not None and own.sha256 and tokenizer.sha256 and own.sha256 != tokenizer.sha256:
        raise VocabularyMismatch(
            f"checkpoint {checkpoint} was made with {own.describe(with_hash=True)}, but {role} another model: "
            f"{tokenizer.describe(with_hash=True)}"
        )
    size = checkpoint_vocab_size(checkpoint)
    if size is not None and tokenizer.size is not None and size != tokenizer.size:
        raise VocabularyMismatch(
            f"checkpoint {checkpoint} has vocab_size {size} (config.json), but {role} {tokenizer.describe()}"
        )


def check_tokenizer_fits(checkpoint: str | Path, tokenizer: str | Path | None = None) -> None:
    """For fine-tuning: the tokenizer given (spiece.model, or a directory holding it or a WordPiece vocabulary), else
    the one `find_tokenizer` finds, must be the checkpoint's vocabulary. Without either there is nothing to compare
    (the loader reports that)."""
    path = Path(tokenizer) if tokenizer is not None else find_tokenizer(checkpoint)
    if path is not None and tokenizer_at(path) is not None:
        check_vocabulary(checkpoint, Vocabulary.of(load_tokenizer(path)))


def shards_vocabulary(shards: str | Path) -> Vocabulary | None:
    """The tokenizer a shard set was made with, from its manifest (or the tokenizer beside it); None when the shard
    set does not say."""
    shards = Path(shards)
    manifest = ShardsManifest.read(shards)
    model = manifest.tokenizer_model()
    if model is not None:
        return Vocabulary.of(load_tokenizer(model))
    if manifest.vocab_size is not None:
        where = str(shards / MANIFEST_FILE)
        return Vocabulary(manifest.tokenizer_kind, where, manifest.vocab_size, manifest.tokenizer_sha256)
    return None


def heldout_vocabulary(heldout_path: str | Path) -> Vocabulary | None:
    """The tokenizer a held-out file (<shards>/heldout/documents.parquet) was made with: its shard set's."""
    return shards_vocabulary(Path(heldout_path).parent.parent)


def check_heldout_fits(checkpoint: str | Path, heldout_path: str | Path) -> None:
    """For evaluation: the held-out data's tokenizer must be the checkpoint's vocabulary."""
    vocabulary = heldout_vocabulary(heldout_path)
    if vocabulary is not None:
        check_vocabulary(checkpoint, vocabulary, role="the held-out data was tokenized with")
