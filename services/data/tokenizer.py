"""`albert tokenizer train`: a SentencePiece unigram model trained on the documents of corpus inputs."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from albert_core.text.corpus import list_inputs, read_documents
from albert_core.text.records import Document
from albert_core.text.tokenization import TokenizerTrainConfig, train_tokenizer


def corpus_texts(inputs: Sequence[str]) -> Iterator[str]:
    """The text of every document the corpus reader finds in these files, directories or globs (skips left out)."""
    for source in list_inputs(list(inputs)):
        for record in read_documents(source):
            if isinstance(record, Document):
                yield record.text


def train_on_corpus(inputs: Sequence[str], output: Path, config: TokenizerTrainConfig) -> Path:
    """spiece.model (and tokenizer_config.json) in `output`, trained on the documents of `inputs`."""
    return train_tokenizer(corpus_texts(inputs), Path(output), config)
