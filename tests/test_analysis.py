"""Figure 1's layer transitions and the linear probes of albert_core.evaluation.analysis, on tiny real models."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from albert_core.evaluation.analysis import (
    document_pairs,
    fit_linear_probe,
    layer_transitions,
    pad_batches,
    pair_probe,
    probe_accuracy,
)
from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import AlbertForPreTraining, AlbertModel

H = 4


def bert_style(layers: int = 1, **changes) -> AlbertModel:
    """E == H (no projection), nothing shared: the input to layer 1 is the embeddings' LayerNorm output."""
    torch.manual_seed(0)
    config = AlbertConfig(
        vocab_size=16,
        embedding_size=H,
        hidden_size=H,
        num_hidden_layers=layers,
        num_attention_heads=1,
        intermediate_size=8,
        max_position_embeddings=16,
        sharing="none",
        initializer_range=0.5,  # large weights: each layer visibly moves its input
        **changes,
    )
    return AlbertModel(config).eval()


def zero_residual_branches(model: AlbertModel, layer: int) -> None:
    """Attention output dense and FFN down projection of `layer` set to 0: the layer is x -> LN(LN(x))."""
    with torch.no_grad():
        attention = model.encoder.attention_blocks[model.encoder.attention_index[layer]]
        ffn = model.encoder.ffn_blocks[model.encoder.ffn_index[layer]]
        for linear in (attention.dense, ffn.down):
            linear.weight.zero_()
            linear.bias.zero_()


def hand_model() -> AlbertModel:
    """A 1-layer model whose numbers can be worked out on paper.

    Embeddings: position and token type embeddings 0, word 5 = (1,-1,1,-1), word 6 = (1,1,-1,-1), the pad word 0 =
    (10,-10,0,0); LayerNorm with weight 1, bias 0 keeps (±1, ±1, ±1, ±1) vectors (mean 0, variance 1) as they are.
    Layer: the attention branch is zeroed (output LN(x) = x); the FFN LayerNorm has weight 0 and bias c = (2,2,0,0),
    so every token leaves the layer as c.
    """
    model = bert_style()
    zero_residual_branches(model, 0)
    with torch.no_grad():
        emb = model.embeddings
        emb.position_embeddings.weight.zero_()
        emb.token_type_embeddings.weight.zero_()
        emb.word_embeddings.weight[5] = torch.tensor([1.0, -1.0, 1.0, -1.0])
        emb.word_embeddings.weight[6] = torch.tensor([1.0, 1.0, -1.0, -1.0])
        emb.word_embeddings.weight[0] = torch.tensor([10.0, -10.0, 0.0, 0.0])
        ffn_norm = model.encoder.ffn_blocks[0].layer_norm
        ffn_norm.weight.zero_()
        ffn_norm.bias.copy_(torch.tensor([2.0, 2.0, 0.0, 0.0]))
    return model


def test_one_layer_transition_matches_the_values_worked_out_by_hand():
    # word 5: c - x = (1, 3, -1, 1): L2 = sqrt(12); c . x = 0: cosine 0.
    # word 6: c - x = (1, 1, 1, 1): L2 = 2; c . x = 4, |c| = sqrt(8), |x| = 2: cosine 1/sqrt(2).
    # The pad position (word 0) is masked out and must not count.
    batch = {"input_ids": [[5, 6, 6, 0]], "attention_mask": [[1, 1, 1, 0]]}
    (row,) = layer_transitions(hand_model(), [batch])
    assert row["layer"] == 1 and row["tokens"] == 3
    assert row["l2"] == pytest.approx((math.sqrt(12) + 2 + 2) / 3, abs=1e-5)
    assert row["cosine"] == pytest.approx((0 + 2 / math.sqrt(2)) / 3, abs=1e-5)


def test_a_layer_with_zeroed_residual_branches_is_an_identity_l2_0_cosine_1():
    model = bert_style(layers=2)
    zero_residual_branches(model, 1)
    batch = {"input_ids": torch.tensor([[2, 7, 9, 3, 11, 3]]), "attention_mask": torch.ones(1, 6, dtype=torch.long)}
    first, second = layer_transitions(model, [batch])
    assert second["l2"] == pytest.approx(0.0, abs=1e-5)
    assert second["cosine"] == pytest.approx(1.0, abs=1e-6)
    assert first["l2"] > 0.1  # the untouched layer does move its input


def test_padding_does_not_change_the_transitions():
    model = bert_style(layers=2)
    ids = [[2, 7, 9, 3, 11, 3], [2, 5, 3, 8, 3, 0]]
    mask = [[1] * 6, [1] * 5 + [0]]
    wider = {"input_ids": [row + [0, 0, 0] for row in ids], "attention_mask": [row + [0, 0, 0] for row in mask]}
    exact = layer_transitions(model, [{"input_ids": ids, "attention_mask": mask}])
    padded = layer_transitions(model, [wider])
    for a, b in zip(exact, padded, strict=True):
        assert a["l2"] == pytest.approx(b["l2"], rel=1e-6)
        assert a["cosine"] == pytest.approx(b["cosine"], rel=1e-6)


def test_means_are_over_tokens_so_splitting_into_batches_changes_nothing():
    model = bert_style(layers=3)
    sequences = [[2, 7, 9, 3, 11, 3], [2, 5, 3], [2, 8, 8, 8, 3, 4, 3], [2, 6, 3, 6, 3]]
    whole = layer_transitions(model, pad_batches(sequences, pad_id=0, batch_size=4))
    split = layer_transitions(model, pad_batches(sequences, pad_id=0, batch_size=3))
    assert whole[0]["tokens"] == sum(len(s) for s in sequences)
    for a, b in zip(whole, split, strict=True):
        assert a["l2"] == pytest.approx(b["l2"], rel=1e-6)
        assert a["cosine"] == pytest.approx(b["cosine"], rel=1e-6)


def test_an_all_shared_pretraining_model_gives_one_row_per_layer_and_keeps_its_training_mode():
    torch.manual_seed(0)
    config = AlbertConfig.preset(
        "albert-tiny", vocab_size=32, embedding_size=8, hidden_size=16, num_attention_heads=2, intermediate_size=32
    )
    model = AlbertForPreTraining(config).train()
    rows = layer_transitions(model, pad_batches([[2, 7, 9, 3, 11, 3]], pad_id=0, batch_size=1))
    assert [r["layer"] for r in rows] == [1, 2, 3, 4]
    assert model.training  # put back in training mode after the eval-mode pass
    assert len({round(r["l2"], 6) for r in rows}) == 4  # the same weights, yet each layer moves a different input


def test_batches_without_real_tokens_are_an_error():
    with pytest.raises(ValueError, match="no real tokens"):
        layer_transitions(bert_style(), [{"input_ids": [[5, 6]], "attention_mask": [[0, 0]]}])


def test_a_batch_without_attention_mask_is_an_error_naming_the_batch_and_key():
    with pytest.raises(ValueError, match="batch 0: lacks 'attention_mask'"):
        layer_transitions(bert_style(), [{"input_ids": [[5, 6]]}])


def test_pad_batches_pads_on_the_right_and_masks_the_padding():
    (batch,) = pad_batches([[2, 5, 3], [2, 3]], pad_id=0, batch_size=2, token_type_ids=[[0, 0, 1], [0, 1]])
    assert batch["input_ids"].tolist() == [[2, 5, 3], [2, 3, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["token_type_ids"].tolist() == [[0, 0, 1], [0, 1, 0]]


# --- probes ------------------------------------------------------------------------------------------------


def test_a_linear_probe_separates_linearly_separable_features():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(600, 8, generator=generator)
    y = (x[:, 3] - 0.5 * x[:, 5] > 0).long()
    probe = fit_linear_probe(x[:400], y[:400])
    assert probe_accuracy(x[400:], y[400:], probe) > 0.95


def test_a_linear_probe_on_labels_unrelated_to_the_features_stays_near_chance_on_new_data():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(400, 8, generator=generator)
    y = torch.randint(0, 2, (400,), generator=generator)
    probe = fit_linear_probe(x[:200], y[:200])
    assert 0.35 < probe_accuracy(x[200:], y[200:], probe) < 0.65


def documents(n: int, seed: int = 0) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(5, 16, rng.integers(3, 8)).tolist() for _ in range(12)] for _ in range(n)]


def test_document_pairs_of_objective_none_are_consecutive_segments_without_labels():
    examples = document_pairs(documents(3), objective="none", max_seq_length=16, seed=1, cls_id=2, sep_id=3)
    assert examples and all(e.pair_label == -100 for e in examples)
    assert all(e.input_ids[0] == 2 and e.input_ids[-1] == 3 and len(e.input_ids) <= 16 for e in examples)


def test_pair_probe_is_deterministic_and_reports_both_halves():
    model = bert_style(layers=1)
    kwargs = dict(objective="sop", max_seq_length=16, seed=4, cls_id=2, sep_id=3, pad_id=0, max_examples=64)
    first = pair_probe(model, documents(6), **kwargs)
    again = pair_probe(model, documents(6), **kwargs)
    assert first == again
    assert 0 < first["train_examples"] <= 64 and 0 < first["test_examples"] <= 64
    assert 0.0 <= first["acc"] <= 1.0 and 0.2 < first["test_positive"] < 0.8


def test_pair_probe_needs_two_documents_to_split():
    with pytest.raises(ValueError, match="at least 2 held-out documents"):
        pair_probe(bert_style(), documents(1), objective="nsp", max_seq_length=16, seed=0, cls_id=2, sep_id=3, pad_id=0)
