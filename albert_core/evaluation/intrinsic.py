"""Intrinsic evaluation on held-out documents: the paper's MLM / NSP / SOP accuracy columns (Table 5) plus MLM loss.

Every evaluation of a run sees the same examples: pairs are built from the held-out documents with
`albert_core.examples.pairs.create_pairs` under generators derived from `seed`, a fixed subset of at most `max_examples`
is drawn, and each example is masked with `albert_core.examples.batch.mlm_batch` under (seed, epoch 0, example index).

- SOP pairs (consecutive segments, swapped with p=0.5) give `sop_acc` and the MLM numbers (`mlm_acc`, `mlm_loss`
  over all predicted tokens of all examples, not averaged per batch).
- NSP pairs (B from a random other document with p=0.5) give `nsp_acc`.
Inputs are masked for the pair objectives as well: the model is scored on the inputs it was trained on.

Word starts (the masking unit) travel with the tokens: each token id is packed with its word-start flag before
pairs are built, so the flags of every token that lands in an example are the ones stored for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from torch import nn

from albert_core.evaluation.unigram import UnigramBaseline
from albert_core.examples.batch import mlm_batch
from albert_core.examples.masking import IGNORE_INDEX
from albert_core.examples.pairs import PairConfig, PairExample, create_pairs
from albert_core.text.tokenization import TokenIds

HELDOUT_COLUMNS = ("doc_id", "sentences", "word_starts")

# Streams of the evaluation seed: one generator per purpose, so changing one never shifts another.
_SOP_PAIRS, _NSP_PAIRS, _SOP_SUBSET, _NSP_SUBSET = range(4)
# Placeholders for [CLS]/[SEP] while token ids are packed with their word-start flags (packed values are >= 0).
_CLS_SLOT, _SEP_SLOT = -1, -2


@dataclass(frozen=True)
class HeldoutDocument:
    doc_id: int
    sentences: list[list[int]]  # token ids per sentence
    word_starts: list[list[bool]]  # one flag per token: does it start a word


def read_heldout(path: str) -> list[HeldoutDocument]:
    """Held-out documents from a Parquet file in `albert_core.examples.shards.HELDOUT_SCHEMA` (pyarrow only)."""
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as err:
        raise ValueError(f"{path}: cannot read held-out documents as Parquet ({err})") from None
    missing = [name for name in HELDOUT_COLUMNS if name not in schema.names]
    if missing:
        raise ValueError(
            f"{path}: held-out file lacks column {missing[0]!r} (expected {', '.join(HELDOUT_COLUMNS)}; "
            f"found {', '.join(schema.names)})"
        )
    table = pq.read_table(path, columns=list(HELDOUT_COLUMNS))
    documents = []
    for row, (doc_id, sentences, starts) in enumerate(
        zip(*(table.column(name).to_pylist() for name in HELDOUT_COLUMNS), strict=True)
    ):
        where = f"{path}: row {row} (doc_id {doc_id})"
        if doc_id is None or sentences is None or starts is None:
            raise ValueError(f"{where}: null doc_id, sentences or word_starts")
        if len(starts) != len(sentences):
            raise ValueError(f"{where}: {len(sentences)} sentences but {len(starts)} word_starts lists")
        for index, (sentence, flags) in enumerate(zip(sentences, starts, strict=True)):
            if sentence is None or flags is None or len(sentence) != len(flags):
                n_tokens = "null" if sentence is None else len(sentence)
                n_flags = "null" if flags is None else len(flags)
                raise ValueError(f"{where}: sentence {index} has {n_tokens} tokens but {n_flags} word_starts")
        documents.append(HeldoutDocument(int(doc_id), sentences, starts))
    return documents


def pairable_heldout(path: str) -> tuple[int, bool]:
    """(the held-out documents of a file in HELDOUT_SCHEMA, whether one of them has the two tokens a SOP or NSP pair
    needs: create_pairs skips a document of fewer), read only up to the first such document."""
    heldout = pq.ParquetFile(path)
    for batch in heldout.iter_batches(columns=["sentences"], batch_size=64):
        if any(sum(len(s) for s in sentences or ()) >= 2 for sentences in batch.column(0).to_pylist()):
            return heldout.metadata.num_rows, True
    return heldout.metadata.num_rows, False


def intrinsic_metrics(
    model: nn.Module,
    documents: Sequence[HeldoutDocument],
    *,
    token_ids: TokenIds,
    max_seq_length: int,
    seed: int,
    batch_size: int = 32,
    max_examples: int = 1024,
    mask_prob: float = 0.15,
    max_ngram: int = 3,
    short_seq_prob: float = 0.1,
    unigram: UnigramBaseline | None = None,
) -> dict[str, float | int]:
    """MLM accuracy and loss, SOP and NSP accuracy of an `AlbertForPreTraining` on held-out documents.

    Returns mlm_acc, mlm_loss, sop_acc, nsp_acc and the counts they rest on: mlm_tokens, sop_examples,
    nsp_examples. With `unigram`, also the floor on the same masked positions (`unigram_acc`, `unigram_loss`:
    predicting each piece from training frequencies alone) and the model's margin over it (`mlm_margin`).
    Deterministic for a given (documents, seed, max_seq_length, max_examples).
    """
    if batch_size < 1 or max_examples < 1:
        raise ValueError(f"batch_size and max_examples must be positive, got {batch_size} and {max_examples}")
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    config = getattr(model, "config", None)
    if config is not None and max_seq_length > config.max_position_embeddings:
        raise ValueError(
            f"max_seq_length {max_seq_length} exceeds the model's max_position_embeddings "
            f"({config.max_position_embeddings})"
        )
    if config is not None and config.vocab_size != token_ids.vocab_size:
        raise ValueError(f"token_ids.vocab_size {token_ids.vocab_size} != the model's vocab_size {config.vocab_size}")
    if unigram is not None and unigram.vocab_size != token_ids.vocab_size:
        raise ValueError(f"unigram baseline has {unigram.vocab_size} pieces, the vocabulary {token_ids.vocab_size}")
    packed = _pack_documents(documents, token_ids.vocab_size)

    def examples_for(objective: str, pairs_stream: int, subset_stream: int) -> list[PairExample]:
        pair_config = PairConfig(max_seq_length=max_seq_length, short_seq_prob=short_seq_prob, objective=objective)
        rng = np.random.default_rng([seed, pairs_stream])
        result = create_pairs(packed, config=pair_config, rng=rng, cls_id=_CLS_SLOT, sep_id=_SEP_SLOT)
        examples = result.examples
        if not examples:
            raise ValueError(
                f"held-out documents yield no {objective} pairs ({len(documents)} documents, "
                f"skipped: {result.skipped_documents}); each document needs at least two tokens"
            )
        if len(examples) > max_examples:
            chosen = np.random.default_rng([seed, subset_stream]).choice(len(examples), max_examples, replace=False)
            examples = [examples[i] for i in np.sort(chosen)]
        return examples

    def score(examples: list[PairExample]) -> dict[str, float]:
        return _score(model, examples, token_ids, seed, batch_size, mask_prob, max_ngram, unigram)

    sop = score(examples_for("sop", _SOP_PAIRS, _SOP_SUBSET))
    nsp = score(examples_for("nsp", _NSP_PAIRS, _NSP_SUBSET))
    n_masked = max(sop["mlm_tokens"], 1)
    metrics = {
        "mlm_acc": sop["mlm_correct"] / n_masked,
        "mlm_loss": sop["mlm_loss_sum"] / n_masked,
        "sop_acc": sop["pair_correct"] / sop["examples"],
        "nsp_acc": nsp["pair_correct"] / nsp["examples"],
        "mlm_tokens": int(sop["mlm_tokens"]),
        "sop_examples": int(sop["examples"]),
        "nsp_examples": int(nsp["examples"]),
    }
    if unigram is not None:
        metrics["unigram_acc"] = sop["unigram_correct"] / n_masked
        metrics["unigram_loss"] = sop["unigram_loss_sum"] / n_masked
        metrics["mlm_margin"] = metrics["mlm_acc"] - metrics["unigram_acc"]
    return metrics


# ----------------------------------------------------------------------------------------------------------------
# internals


def _pack_documents(documents: Sequence[HeldoutDocument], vocab_size: int) -> list[list[np.ndarray]]:
    """Each token as id * 2 + word-start flag, so the flag follows the token through pair creation."""
    packed = []
    for document in documents:
        sentences = []
        for ids, flags in zip(document.sentences, document.word_starts, strict=True):
            ids = np.asarray(ids, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
                raise ValueError(
                    f"held-out doc_id {document.doc_id}: token id {bad} outside the vocabulary [0, {vocab_size})"
                )
            sentences.append(ids * 2 + np.asarray(flags, dtype=np.int64))
        packed.append(sentences)
    return packed


def _unpack(example: PairExample, token_ids: TokenIds) -> tuple[list[int], list[bool]]:
    values = np.asarray(example.input_ids, dtype=np.int64)
    ids = values >> 1
    starts = (values & 1).astype(bool)
    ids[values == _CLS_SLOT] = token_ids.cls_id
    ids[values == _SEP_SLOT] = token_ids.sep_id
    starts[values < 0] = False
    return ids.tolist(), starts.tolist()


@torch.no_grad()
def _score(model, examples, token_ids, seed, batch_size, mask_prob, max_ngram, unigram) -> dict[str, float]:
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    keys = (
        "mlm_correct",
        "mlm_tokens",
        "mlm_loss_sum",
        "pair_correct",
        "examples",
        "unigram_correct",
        "unigram_loss_sum",
    )
    totals = dict.fromkeys(keys, 0.0)
    try:
        for first in range(0, len(examples), batch_size):
            chunk = examples[first : first + batch_size]
            unpacked = [_unpack(example, token_ids) for example in chunk]
            batch = mlm_batch(
                [ids for ids, _ in unpacked],
                [example.token_type_ids for example in chunk],
                [example.pair_label for example in chunk],
                [starts for _, starts in unpacked],
                list(range(first, first + len(chunk))),
                seed=seed,
                epoch=0,
                seq_len=None,
                vocab_size=token_ids.vocab_size,
                special_ids=token_ids.special_ids,
                mask_id=token_ids.mask_id,
                pad_id=token_ids.pad_id,
                mask_prob=mask_prob,
                max_ngram=max_ngram,
            )
            tensors = {name: torch.from_numpy(array).to(device) for name, array in batch.items()}
            labels = tensors["mlm_labels"]
            out = model(
                tensors["input_ids"],
                attention_mask=tensors["attention_mask"],
                token_type_ids=tensors["token_type_ids"],
                mlm_labels=labels,
            )
            targets = labels[labels != IGNORE_INDEX]  # row-major, as the model's mlm_logits
            logits = out.mlm_logits.float()
            totals["mlm_correct"] += int((logits.argmax(-1) == targets).sum())
            totals["mlm_tokens"] += targets.numel()
            totals["mlm_loss_sum"] += (
                float(F.cross_entropy(logits, targets, reduction="sum")) if targets.numel() else 0.0
            )
            if unigram is not None:
                correct, loss_sum = unigram.score(targets.cpu().numpy())
                totals["unigram_correct"] += correct
                totals["unigram_loss_sum"] += loss_sum
            totals["pair_correct"] += int((out.pair_logits.argmax(-1) == tensors["pair_labels"]).sum())
            totals["examples"] += len(chunk)
    finally:
        model.train(was_training)
    return totals
