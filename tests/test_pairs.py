"""Sentence-pair creation (SOP / NSP / none), following create_pretraining_data with DESIGN.md §3's rules."""

from __future__ import annotations

import numpy as np
import pytest

from albert_core.examples.pairs import (
    IGNORE_LABEL,
    ORDER_STREAM,
    PairConfig,
    PairExample,
    _truncate_pair,
    create_pairs,
    order_draws,
    reorder_pair,
)
from tests.test_masking import splitmix64

CLS, SEP = 2, 3
DOC_STRIDE = 1_000_000  # token id = 10 + doc * DOC_STRIDE + position in the document: the id says where it came from


def make_documents(
    n_docs: int, sentences: tuple[int, int], sentence_len: tuple[int, int], seed: int = 0
) -> list[list[list[int]]]:
    """Documents whose token ids encode (document, position): consecutive text has consecutive ids."""
    rng = np.random.default_rng(seed)
    documents = []
    for d in range(n_docs):
        lengths = rng.integers(sentence_len[0], sentence_len[1] + 1, size=rng.integers(sentences[0], sentences[1] + 1))
        bounds = np.concatenate(([0], np.cumsum(lengths)))
        base = 10 + d * DOC_STRIDE
        documents.append([list(range(base + a, base + b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    return documents


def split(example: PairExample) -> tuple[np.ndarray, np.ndarray]:
    """Segments A and B of ``[CLS] A [SEP] B [SEP]``."""
    ids = np.asarray(example.input_ids)
    first_sep = example.token_type_ids.index(1) - 1
    return ids[1:first_sep], ids[first_sep + 1 : -1]


def doc_of(tokens: np.ndarray) -> np.ndarray:
    return (tokens - 10) // DOC_STRIDE


def is_contiguous(tokens: np.ndarray) -> bool:
    return bool((np.diff(tokens) == 1).all())


def pairs(documents, seed: int = 0, **config):
    return create_pairs(documents, config=PairConfig(**config), rng=np.random.default_rng(seed), cls_id=CLS, sep_id=SEP)


@pytest.fixture(scope="module")
def sop_result():
    return pairs(make_documents(300, (5, 40), (3, 30)), max_seq_length=128)


def test_examples_are_cls_a_sep_b_sep_with_token_types(sop_result):
    for example in sop_result.examples:
        ids, types = example.input_ids, example.token_type_ids
        first_sep = types.index(1) - 1
        assert ids[0] == CLS and ids[first_sep] == SEP and ids[-1] == SEP
        assert CLS not in ids[1:] and ids.count(SEP) == 2
        assert types == [0] * (first_sep + 1) + [1] * (len(ids) - first_sep - 1)
        a, b = split(example)
        assert a.size >= 1 and b.size >= 1


def test_every_example_fits_max_seq_length(sop_result):
    assert max(len(e.input_ids) for e in sop_result.examples) <= 128


def test_sop_segments_come_from_their_own_document(sop_result):
    for example in sop_result.examples:
        a, b = split(example)
        assert (doc_of(a) == example.doc_index).all() and (doc_of(b) == example.doc_index).all()


def test_sop_segments_are_contiguous_text_in_the_labelled_order(sop_result):
    for example in sop_result.examples:
        a, b = split(example)
        assert is_contiguous(a) and is_contiguous(b)
        if example.pair_label == 0:
            assert a[-1] < b[0]
        else:
            assert b[-1] < a[0]


def test_sop_untruncated_b_directly_follows_a():
    result = pairs(make_documents(30, (4, 12), (2, 8)), max_seq_length=512)
    for example in result.examples:
        a, b = split(example)
        first, second = (a, b) if example.pair_label == 0 else (b, a)
        assert second[0] == first[-1] + 1


def test_sop_labels_are_balanced(sop_result):
    labels = np.array([e.pair_label for e in sop_result.examples])
    assert set(labels.tolist()) == {0, 1}
    assert len(labels) > 500
    assert abs(labels.mean() - 0.5) < 0.05


def test_sop_never_takes_b_from_another_document_for_single_sentence_chunks():
    # every sentence alone exceeds the target, so every chunk holds one sentence; one document has one sentence
    documents = make_documents(20, (1, 6), (70, 120)) + [[list(range(10 + 20 * DOC_STRIDE, 10 + 20 * DOC_STRIDE + 9))]]
    result = pairs(documents, max_seq_length=64)
    assert len(result.examples) >= sum(len(d) for d in documents)
    for example in result.examples:
        a, b = split(example)
        assert (doc_of(np.concatenate([a, b])) == example.doc_index).all()
        assert is_contiguous(a) and is_contiguous(b)


def test_nsp_random_b_comes_from_another_document_and_real_b_follows_a():
    result = pairs(make_documents(40, (5, 30), (3, 20)), max_seq_length=128, objective="nsp")
    labels = np.array([e.pair_label for e in result.examples])
    assert abs(labels.mean() - 0.5) < 0.06
    for example in result.examples:
        a, b = split(example)
        assert (doc_of(a) == example.doc_index).all()
        if example.pair_label == 1:
            assert (doc_of(b) != example.doc_index).all()
            assert len(set(doc_of(b).tolist())) == 1
        else:
            assert (doc_of(b) == example.doc_index).all() and a[-1] < b[0]


def test_nsp_puts_unused_sentences_back_so_no_text_is_lost():
    documents = make_documents(30, (6, 20), (3, 10))
    result = pairs(documents, max_seq_length=512, objective="nsp")
    assert any(e.pair_label == 1 for e in result.examples)
    for d, document in enumerate(documents):
        used = set()
        for example in result.examples:
            if example.doc_index == d:
                for segment in split(example):
                    used.update(segment[doc_of(segment) == d].tolist())
        assert used == {t for sentence in document for t in sentence}


def test_nsp_with_no_other_document_keeps_the_real_next_segment_and_counts_it():
    result = pairs(make_documents(1, (30, 30), (5, 10)), max_seq_length=64, objective="nsp")
    assert all(e.pair_label == 0 for e in result.examples)
    assert result.counts["nsp_no_other_document"] > 0


def test_none_objective_labels_every_pair_ignored():
    result = pairs(make_documents(10, (5, 20), (3, 20)), max_seq_length=128, objective="none")
    assert result.examples and all(e.pair_label == IGNORE_LABEL for e in result.examples)


def test_without_short_targets_every_chunk_but_a_documents_last_fills_the_sequence():
    result = pairs(make_documents(20, (40, 60), (5, 15)), max_seq_length=64, short_seq_prob=0.0)
    lengths = np.array([len(e.input_ids) for e in result.examples])
    last_of_doc = np.r_[np.diff([e.doc_index for e in result.examples]) != 0, True]
    assert (lengths[~last_of_doc] == 64).all()


def test_short_seq_prob_shortens_that_share_of_sequences():
    documents = make_documents(30, (150, 200), (5, 15))
    lengths = {}
    for prob in (0.0, 0.1, 1.0):
        result = pairs(documents, max_seq_length=128, short_seq_prob=prob)
        last_of_doc = np.r_[np.diff([e.doc_index for e in result.examples]) != 0, True]
        lengths[prob] = np.array([len(e.input_ids) for e in result.examples])[~last_of_doc]
    short_share = {prob: (values < 128).mean() for prob, values in lengths.items()}
    assert short_share[0.0] == 0.0
    assert short_share[1.0] > 0.9
    assert 0.05 < short_share[0.1] < 0.15
    assert lengths[1.0].min() < 20


def test_same_seed_gives_the_same_examples_and_another_seed_does_not():
    documents = make_documents(20, (5, 20), (3, 20))
    first = pairs(documents, seed=5, max_seq_length=128).examples
    assert pairs(documents, seed=5, max_seq_length=128).examples == first
    assert pairs(documents, seed=6, max_seq_length=128).examples != first


def test_every_document_is_used_or_counted_as_skipped():
    documents = make_documents(5, (2, 5), (3, 8)) + [[], [[], []], [[42]], [[], [43], []], [[44, 45]]]
    result = pairs(documents, max_seq_length=32)
    assert result.skipped_documents == {"no_tokens": 2, "single_token": 2}
    assert result.documents_used == 6
    assert result.documents_used + sum(result.skipped_documents.values()) == len(documents)
    assert {e.doc_index for e in result.examples} == {0, 1, 2, 3, 4, 9}


def test_a_documents_trailing_one_token_chunk_is_counted():
    # target 3 at max_seq_length 6: the 3-token sentence fills a chunk and [99] is left alone
    result = pairs([[[10, 11, 12], [99]]], max_seq_length=6, short_seq_prob=0.0)
    assert len(result.examples) == 1
    assert result.counts["one_token_chunks_dropped"] == 1


def test_long_sentence_is_cut_into_pieces_instead_of_losing_its_tokens():
    sentence = list(range(10, 10 + 5000))
    result = pairs([[sentence]], max_seq_length=128)
    assert result.counts["long_sentences_split"] == 1
    assert len(result.examples) >= 5000 // 125
    used = np.concatenate([np.concatenate(split(e)) for e in result.examples])
    assert np.unique(used).size > 0.9 * len(sentence)


def test_numpy_sentences_are_accepted():
    documents = [[np.arange(10, 20), np.arange(20, 25)], [np.arange(100, 130)]]
    result = pairs(documents, max_seq_length=64)
    assert all(type(t) is int for e in result.examples for t in e.input_ids)
    assert result.documents_used == 2


def test_a_string_in_place_of_token_ids_is_rejected_with_its_location():
    with pytest.raises(ValueError, match="document 1, sentence 0"):
        pairs([[[10, 11]], ["not tokens"]], max_seq_length=64)


def reference_truncation_lengths(len_a: int, len_b: int, max_tokens: int) -> tuple[int, int]:
    """The original's loop: drop one token from the longer side (B on ties) until the pair fits."""
    while len_a + len_b > max_tokens:
        if len_a > len_b:
            len_a -= 1
        else:
            len_b -= 1
    return len_a, len_b


def test_truncation_keeps_the_lengths_of_the_token_by_token_loop():
    rng = np.random.default_rng(0)
    for _ in range(500):
        len_a, len_b = (int(n) for n in rng.integers(1, 300, size=2))
        max_tokens = int(rng.integers(2, 400))
        a, b = _truncate_pair(list(range(len_a)), list(range(1000, 1000 + len_b)), max_tokens, rng)
        assert (len(a), len(b)) == reference_truncation_lengths(len_a, len_b, max_tokens)
        assert a == list(range(a[0], a[0] + len(a))) and b == list(range(b[0], b[0] + len(b)))


def test_truncation_takes_tokens_from_both_ends():
    rng = np.random.default_rng(1)
    fronts = [_truncate_pair(list(range(100)), [1000], 51, rng)[0][0] for _ in range(200)]
    assert 15 < np.mean(fronts) < 35  # 50 removals, each from the front with p=0.5


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_seq_length", 4),
        ("max_seq_length", 12.5),
        ("short_seq_prob", -0.1),
        ("short_seq_prob", 1.5),
        ("objective", "mlm"),
    ],
)
def test_bad_config_is_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"PairConfig.{field}"):
        PairConfig(**{field: value})


# --- SOP with the order drawn anew each epoch (data.sop_order = "epoch") -------------------------------------


def sop_row(a: list[int], b: list[int], label: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """[CLS]=2 first [SEP]=3 second [SEP], as create_pairs writes it; word starts mark every token of a segment
    but its second, so that a moved flag would show."""
    first, second = (b, a) if label else (a, b)
    ids = np.array([2, *first, 3, *second, 3])
    types = np.array([0] * (len(first) + 2) + [1] * (len(second) + 1))
    starts = np.array([True, *[i != 1 for i in range(len(first))], False, *[i != 1 for i in range(len(second))], False])
    return ids, types, starts, label


@pytest.mark.parametrize("stored", [0, 1])
def test_reorder_pair_presents_the_pair_in_the_order_asked_for(stored):
    a, b = [10, 11, 12], [20, 21]
    for wanted in (0, 1):
        ids, types, starts, label = reorder_pair(*sop_row(a, b, stored), wanted)
        want = sop_row(a, b, wanted)
        assert label == wanted
        assert ids.tolist() == want[0].tolist() and types.tolist() == want[1].tolist()
        assert starts.tolist() == want[2].tolist()


def test_reorder_pair_refuses_what_is_not_an_sop_pair():
    ids, types, starts, _ = sop_row([10, 11], [20], 0)
    with pytest.raises(ValueError, match="an SOP label is 0 or 1"):
        reorder_pair(ids, types, starts, IGNORE_LABEL, 1)
    with pytest.raises(ValueError, match="token types 0...0 1...1"):
        reorder_pair(ids, np.zeros_like(types), starts, 0, 1)


def test_the_order_draw_is_a_fair_coin_per_example_and_epoch():
    examples = np.arange(2000) + (7 << 32)  # shard 7's rows
    draws = np.stack([order_draws(7, epoch, examples) for epoch in range(2)])
    assert set(np.unique(draws)) == {0, 1}
    assert 0.45 < draws.mean() < 0.55
    assert 0.45 < (draws[0] != draws[1]).mean() < 0.55  # a new order each epoch, not the stored one again
    assert order_draws(7, 0, examples[::-1][:50]).tolist() == draws[0, ::-1][:50].tolist()  # per example, any order
    assert 0.45 < (order_draws(8, 0, examples) != draws[0]).mean() < 0.55  # another seed, other orders
    assert order_draws(7, 3, examples[:64]).tolist() == [order_bit(7, 3, int(e)) for e in examples[:64]]


def order_bit(seed: int, epoch: int, example: int) -> int:
    """The order draw in Python integers: the top bit of SplitMix64 at the example's key + (stream 4, counter 0)."""
    g, m = 0x9E3779B97F4A7C15, 2**64 - 1
    key = splitmix64(0xA1BE127A5C0FFEE1 ^ seed)
    key = splitmix64(((key + g) & m) ^ epoch)
    key = splitmix64(((key + g) & m) ^ example)
    return splitmix64((key + ((ORDER_STREAM << 32) + 1) * g) & m) >> 63
