"""Sentence-pair examples for pretraining: ``[CLS] A [SEP] B [SEP]`` with an SOP, NSP or no pair label.

The algorithm follows BERT/ALBERT's create_pretraining_data, per document:

- accumulate sentences into a chunk until it reaches a target length (``max_seq_length - 3``, or with probability
  ``short_seq_prob`` a random length in [2, max_seq_length - 3], drawn afresh for every chunk);
- split the chunk at a random sentence boundary into A and B;
- SOP: with p=0.5 swap A and B (label 1 = swapped). NSP: with p=0.5 replace B by sentences from a random other
  document (label 1 = random) and put the unused sentences back. none: label IGNORE_LABEL (-100);
- truncate the longer side, one token at a time from a random end, until the pair fits.

Where the original takes B from a random document because a chunk holds one sentence (which leaks NSP into SOP),
the sentence's tokens are split at a random point into A and B instead (under NSP a random B follows the whole
sentence, as in the original; nothing leaks there). Sentences longer than
``max_seq_length - 3`` are first cut into even consecutive pieces so their tokens are not thrown away.
Documents with fewer than two tokens cannot form a pair: they are counted in ``PairResult.skipped_documents``
so the preprocess manifest can account for every document.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from albert_core.examples import draws
from albert_core.examples.shape import shape_field, shape_fields, shape_problem

IGNORE_LABEL = -100


@dataclass(frozen=True)
class PairConfig:
    """The pair side of the example shape (albert_core.examples.shape), as create_pairs takes it."""

    max_seq_length: int = shape_field("max_seq_length")
    short_seq_prob: float = shape_field("short_seq_prob")
    objective: str = shape_field("objective")  # sop | nsp | none

    def __post_init__(self) -> None:
        for name in shape_fields(PairConfig):
            problem = shape_problem(name, getattr(self, name))
            if problem:
                raise ValueError(f"PairConfig.{name}: {problem}")

    @property
    def max_pair_tokens(self) -> int:
        """Room for A and B together: the sequence less [CLS] and two [SEP]."""
        return self.max_seq_length - 3


@dataclass(frozen=True)
class PairExample:
    input_ids: list[int]  # [CLS] A [SEP] B [SEP]
    token_type_ids: list[int]  # 0 for [CLS] A [SEP], 1 for B [SEP]
    pair_label: int  # SOP: 1 = swapped; NSP: 1 = B is random; none: IGNORE_LABEL
    doc_index: int  # position of the source document in the ``documents`` argument


@dataclass
class PairResult:
    """Examples plus the accounting: documents_used + sum(skipped_documents.values()) == len(documents)."""

    examples: list[PairExample]
    documents_used: int
    # reason -> documents that produced no example: "no_tokens" (empty), "single_token" (one token in all)
    skipped_documents: dict[str, int] = field(default_factory=dict)
    # "one_token_chunks_dropped": a document's last chunk of one token (that token is not used);
    # "long_sentences_split": sentences cut into pieces of at most max_seq_length - 3 tokens;
    # "nsp_no_other_document": NSP draws that wanted a random B but no other document had tokens (kept label 0)
    counts: dict[str, int] = field(default_factory=dict)


def create_pairs(
    documents: Sequence[Sequence[Sequence[int]]],
    *,
    config: PairConfig,
    rng: np.random.Generator | Sequence[np.random.Generator],
    cls_id: int,
    sep_id: int,
) -> PairResult:
    """Pair examples from documents (documents -> sentences -> token ids), deterministic for a given ``rng`` state.

    ``rng`` is one generator for all documents, or one per document: then a document's examples depend only on
    its own generator (and, under NSP, on the other documents a random B is drawn from)."""
    rngs = [rng] * len(documents) if isinstance(rng, np.random.Generator) else list(rng)
    if len(rngs) != len(documents):
        raise ValueError(f"create_pairs: {len(rngs)} generators for {len(documents)} documents")
    prepared = [_prepare_document(doc, config.max_pair_tokens, index) for index, doc in enumerate(documents)]
    counts = {
        "one_token_chunks_dropped": 0,
        "long_sentences_split": sum(n_split for _, n_split in prepared),
        "nsp_no_other_document": 0,
    }
    sentences_of = [sentences for sentences, _ in prepared]
    non_empty = np.flatnonzero([len(sentences) > 0 for sentences in sentences_of])

    examples: list[PairExample] = []
    skipped = {"no_tokens": 0, "single_token": 0}
    documents_used = 0
    for doc_index, sentences in enumerate(sentences_of):
        n_tokens = sum(len(s) for s in sentences)
        if n_tokens < 2:
            skipped["no_tokens" if n_tokens == 0 else "single_token"] += 1
            continue
        documents_used += 1
        builder = _PairBuilder(config, rngs[doc_index], cls_id, sep_id, sentences_of, non_empty, doc_index, counts)
        examples.extend(builder.run())
    return PairResult(examples=examples, documents_used=documents_used, skipped_documents=skipped, counts=counts)


# ----------------------------------------------------------------------------------------------------------------
# internals


def _prepare_document(document: Sequence[Sequence[int]], max_pair_tokens: int, index: int) -> tuple[list, int]:
    """Non-empty sentences as int lists, long ones cut into even pieces; returns (sentences, number cut). A sentence
    that is a list already (a tokenizer's output) is used as it is, never copied or changed."""
    if isinstance(document, (str, bytes)):
        raise ValueError(f"document {index}: expected a sequence of sentences (token id lists), got {type(document)}")
    sentences: list[list[int]] = []
    n_split = 0
    for s_index, sentence in enumerate(document):
        if type(sentence) is list:  # noqa: E721 (ids as a tokenizer returns them: used as they are, not copied)
            tokens = sentence
        elif isinstance(sentence, np.ndarray):
            tokens = sentence.tolist()
        elif isinstance(sentence, (str, bytes)) or not hasattr(sentence, "__len__"):
            raise ValueError(
                f"document {index}, sentence {s_index}: expected a sequence of token ids, got {type(sentence).__name__}"
            )
        else:
            tokens = [int(t) for t in sentence]
        if not tokens:
            continue
        if len(tokens) <= max_pair_tokens:
            sentences.append(tokens)
            continue
        n_split += 1
        n_pieces = -(-len(tokens) // max_pair_tokens)
        bounds = np.linspace(0, len(tokens), n_pieces + 1).round().astype(int)
        sentences.extend(tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    return sentences, n_split


def _truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: np.random.Generator) -> tuple[list, list]:
    """The original's loop in closed form: remove from the longer side (B on ties), each token from a random end."""
    excess = len(a) + len(b) - max_tokens
    if excess <= 0:
        return a, b
    # The longer side loses tokens until the two are equal, then removals alternate starting with B.
    gap = min(excess, abs(len(a) - len(b)))
    rest = excess - gap
    cut_a = rest // 2 + (gap if len(a) > len(b) else 0)
    cut_b = rest - rest // 2 + (gap if len(b) > len(a) else 0)
    front_a = int(rng.binomial(cut_a, 0.5))
    front_b = int(rng.binomial(cut_b, 0.5))
    return a[front_a : len(a) - (cut_a - front_a)], b[front_b : len(b) - (cut_b - front_b)]


class _PairBuilder:
    """Turns one document into pair examples (the state of the chunk loop)."""

    def __init__(self, config, rng, cls_id, sep_id, sentences_of, non_empty, doc_index, counts):
        self.config, self.rng, self.cls_id, self.sep_id = config, rng, cls_id, sep_id
        self.sentences_of, self.non_empty, self.doc_index, self.counts = sentences_of, non_empty, doc_index, counts

    def target_length(self) -> int:
        if self.rng.random() < self.config.short_seq_prob:
            return int(self.rng.integers(2, self.config.max_pair_tokens + 1))
        return self.config.max_pair_tokens

    def run(self) -> list[PairExample]:
        sentences = self.sentences_of[self.doc_index]
        examples: list[PairExample] = []
        chunk: list[list[int]] = []
        length = 0
        target = self.target_length()
        i = 0
        while i < len(sentences):
            chunk.append(sentences[i])
            length += len(sentences[i])
            if i == len(sentences) - 1 or length >= target:
                example, unused = self.make_example(chunk, target)
                if example is not None:
                    examples.append(example)
                i -= unused
                chunk, length, target = [], 0, self.target_length()
            i += 1
        return examples

    def make_example(self, chunk: list[list[int]], target: int) -> tuple[PairExample | None, int]:
        """One example from a chunk; also returns how many of its sentences to put back (NSP random B)."""
        rng = self.rng
        if len(chunk) == 1 and len(chunk[0]) < 2:
            self.counts["one_token_chunks_dropped"] += 1
            return None, 0
        objective = self.config.objective
        if objective == "nsp" and rng.random() < 0.5:
            a_end = int(rng.integers(1, len(chunk))) if len(chunk) >= 2 else 1
            a = list(chain.from_iterable(chunk[:a_end]))
            b = self.random_b(max(1, target - len(a)))
            if b is not None:
                a, b = _truncate_pair(a, b, self.config.max_pair_tokens, rng)
                return self.example(a, b, label=1), len(chunk) - a_end
            self.counts["nsp_no_other_document"] += 1

        if len(chunk) >= 2:
            a_end = int(rng.integers(1, len(chunk)))
            a = list(chain.from_iterable(chunk[:a_end]))
            b = list(chain.from_iterable(chunk[a_end:]))
        else:  # one sentence: its two halves, never B from another document (that would leak NSP into SOP)
            cut = int(rng.integers(1, len(chunk[0])))
            a, b = chunk[0][:cut], chunk[0][cut:]
        if objective == "sop":
            label = int(rng.random() < 0.5)
            if label:
                a, b = b, a
        elif objective == "nsp":
            label = 0
        else:
            label = IGNORE_LABEL
        a, b = _truncate_pair(a, b, self.config.max_pair_tokens, rng)
        return self.example(a, b, label=label), 0

    def example(self, a: list[int], b: list[int], *, label: int) -> PairExample:
        input_ids = [self.cls_id, *a, self.sep_id, *b, self.sep_id]
        token_type_ids = [0] * (len(a) + 2) + [1] * (len(b) + 1)
        return PairExample(input_ids, token_type_ids, label, self.doc_index)

    def random_b(self, target_b_length: int) -> list[int] | None:
        """Consecutive sentences from a random start in a uniformly random other non-empty document."""
        others = self.non_empty.size - 1
        if others < 1:
            return None
        pick = int(self.rng.integers(others))
        self_position = int(np.searchsorted(self.non_empty, self.doc_index))
        other = int(self.non_empty[pick + (pick >= self_position)])
        sentences = self.sentences_of[other]
        b: list[int] = []
        for sentence in sentences[int(self.rng.integers(len(sentences))) :]:
            b.extend(sentence)
            if len(b) >= target_b_length:
                break
        return b


# --------------------------------------------------------------------------------------------------
# SOP with the order drawn anew each epoch

ORDER_STREAM = 4  # the order draw's stream under each example's key (albert_core.examples.draws); masks use 1-3


def order_draws(seed: int, epochs: np.ndarray | int, example_ids: np.ndarray) -> np.ndarray:
    """1 (swapped) or 0 for each SOP example in its epoch (int64, one per example id): the top bit of draw 0 of its
    own stream under the example's key, so independent of batch, worker, order and of the masks' draws, and the
    same under any numpy (part of mask scheme 2: albert_core.examples.masking.MASK_SCHEME)."""
    keys = draws.example_keys(seed, np.asarray(epochs), np.asarray(example_ids))
    return (draws.draws(keys, ORDER_STREAM, np.zeros_like(keys)) >> np.uint64(63)).astype(np.int64)


def reorder_pair(
    input_ids: np.ndarray, token_type_ids: np.ndarray, word_starts: np.ndarray, pair_label: int, swapped: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """An SOP example ``[CLS] X [SEP] Y [SEP]`` stored with `pair_label` (1: X and Y are swapped), presented in the
    order `swapped` asks for: the segments trade places (their [SEP]s stay at the ends of the segments, each token
    keeps its word start) when it differs from the stored one. Returns ids, token types, word starts and label."""
    if pair_label not in (0, 1) or swapped not in (0, 1):
        raise ValueError(f"reorder_pair: an SOP label is 0 or 1, got stored {pair_label} and wanted {swapped}")
    if swapped == pair_label:
        return input_ids, token_type_ids, word_starts, pair_label
    first = int(np.argmax(np.asarray(token_type_ids) == 1))  # where Y starts: after [CLS] X [SEP]
    if first < 3 or first > len(input_ids) - 2 or np.any(token_type_ids[:first]) or not np.all(token_type_ids[first:]):
        raise ValueError(
            f"reorder_pair: expected [CLS] X [SEP] Y [SEP] with token types 0...0 1...1, got {list(token_type_ids)}"
        )
    order = np.r_[0, first : len(input_ids) - 1, first - 1, 1 : first - 1, len(input_ids) - 1]
    types = np.r_[np.zeros(len(input_ids) - first + 1, dtype=token_type_ids.dtype),
                  np.ones(first - 1, dtype=token_type_ids.dtype)]  # fmt: skip
    return input_ids[order], types, word_starts[order], swapped
