"""The model: sharing structure, heads, dropout control, hidden states, masked-only MLM decoding."""

import pytest
import torch

from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import (
    AlbertForMultipleChoice,
    AlbertForPreTraining,
    AlbertForQuestionAnswering,
    AlbertForSequenceClassification,
    AlbertModel,
)


def small(**changes) -> AlbertConfig:
    base = dict(
        vocab_size=120,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return AlbertConfig(**{**base, **changes})


def batch(config: AlbertConfig, b: int = 2, t: int = 12):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, config.vocab_size, (b, t), generator=g)
    return ids, torch.ones_like(ids), torch.zeros_like(ids)


@pytest.mark.parametrize(
    "sharing,groups,attention_blocks,ffn_blocks",
    [("all", 1, 1, 1), ("all", 3, 3, 3), ("attention", 2, 2, 6), ("ffn", 1, 6, 1), ("none", 1, 6, 6)],
)
def test_sharing_mode_builds_the_right_number_of_distinct_blocks(sharing, groups, attention_blocks, ffn_blocks):
    encoder = AlbertModel(small(sharing=sharing, num_hidden_groups=groups)).encoder
    assert len(encoder.attention_blocks) == attention_blocks
    assert len(encoder.ffn_blocks) == ffn_blocks
    assert encoder.attention_index == sorted(encoder.attention_index)  # groups are contiguous runs of layers


def test_all_shared_layers_really_share_parameters():
    """Perturbing the one shared block changes every layer's output."""
    model = AlbertModel(small(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()
    ids, mask, types = batch(model.config)
    before = model(ids, mask, types, output_hidden_states=True).hidden_states
    with torch.no_grad():
        model.encoder.ffn_blocks[0].down.weight.add_(0.05 * torch.randn_like(model.encoder.ffn_blocks[0].down.weight))
    after = model(ids, mask, types, output_hidden_states=True).hidden_states
    assert torch.equal(before[0], after[0])
    assert all(not torch.allclose(b, a) for b, a in zip(before[1:], after[1:], strict=True))


def test_hidden_states_hold_every_layers_input_and_output():
    model = AlbertModel(small()).eval()
    out = model(*batch(model.config), output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert torch.equal(out.hidden_states[-1], out.last_hidden_state)


def test_embeddings_are_factorized_v_by_e_then_projected_to_h():
    model = AlbertModel(small())
    assert model.embeddings.word_embeddings.weight.shape == (120, 16)
    assert model.embeddings.projection.weight.shape == (32, 16)
    assert AlbertModel(small(embedding_size=32)).embeddings.projection is None  # BERT-style E == H


def test_mlm_head_is_tied_to_word_embeddings():
    model = AlbertForPreTraining(small())
    names = [n for n, _ in model.named_parameters()]
    assert not any("decoder" in n for n in names)
    ids, mask, types = batch(model.config)
    out = model(ids, mask, types)
    out.mlm_logits.sum().backward()
    assert model.albert.embeddings.word_embeddings.weight.grad.abs().sum() > 0


def test_mlm_logits_at_masked_positions_equal_the_full_logits_there():
    model = AlbertForPreTraining(small(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()
    ids, mask, types = batch(model.config)
    labels = torch.full_like(ids, -100)
    labels[0, 3], labels[1, 7], labels[1, 8] = 11, 12, 13
    full = model(ids, mask, types).mlm_logits
    masked = model(ids, mask, types, mlm_labels=labels, pair_labels=torch.tensor([0, 1]))
    assert masked.mlm_logits.shape == (3, 120)
    assert torch.allclose(masked.mlm_logits, full[labels != -100], atol=1e-6)
    expected = torch.nn.functional.cross_entropy(full[labels != -100], labels[labels != -100])
    assert torch.allclose(masked.mlm_loss, expected, atol=1e-6)
    assert torch.allclose(masked.loss, masked.mlm_loss + masked.pair_loss)


def test_pair_labels_all_ignored_gives_no_pair_loss():
    model = AlbertForPreTraining(small())
    ids, mask, types = batch(model.config)
    labels = torch.full_like(ids, -100)
    labels[:, 2] = 7
    out = model(ids, mask, types, mlm_labels=labels, pair_labels=torch.tensor([-100, -100]))
    assert out.pair_loss is None and torch.equal(out.loss, out.mlm_loss)


def test_padding_does_not_change_real_token_outputs():
    model = AlbertModel(small()).eval()
    ids, mask, types = batch(model.config, b=1, t=10)
    padded = torch.cat([ids, torch.zeros(1, 6, dtype=ids.dtype)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(1, 6, dtype=mask.dtype)], dim=1)
    a = model(ids, mask, types).last_hidden_state
    b = model(padded, padded_mask, torch.zeros_like(padded)).last_hidden_state[:, :10]
    assert torch.allclose(a, b, atol=1e-5)


def test_set_dropout_zero_makes_training_mode_deterministic():
    model = AlbertForPreTraining(small(hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3)).train()
    ids, mask, types = batch(model.config)
    assert not torch.equal(model(ids, mask, types).pair_logits, model(ids, mask, types).pair_logits)
    model.set_dropout(0.0)
    assert torch.equal(model(ids, mask, types).pair_logits, model(ids, mask, types).pair_logits)
    assert model.config.hidden_dropout_prob == 0.0 and model.config.attention_probs_dropout_prob == 0.0


def test_sequence_classification_and_regression_losses():
    config = small()
    ids, mask, types = batch(config)
    cls = AlbertForSequenceClassification(config, num_labels=3)
    out = cls(ids, mask, types, labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3) and out.loss > 0
    reg = AlbertForSequenceClassification(config, num_labels=1)
    out = reg(ids, mask, types, labels=torch.tensor([0.5, 4.0]))
    assert out.logits.shape == (2, 1)
    assert torch.allclose(out.loss, ((out.logits.squeeze(-1) - torch.tensor([0.5, 4.0])) ** 2).mean())


def test_mean_pooling_reads_the_mean_of_the_real_tokens_final_states_and_ignores_padding():
    model = AlbertModel(small(pooling="mean")).eval()
    ids, mask, types = batch(model.config, b=1, t=10)
    padded = torch.cat([ids, torch.full((1, 6), 7, dtype=ids.dtype)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(1, 6, dtype=mask.dtype)], dim=1)
    out = model(padded, padded_mask, torch.zeros_like(padded))
    by_hand = torch.tanh(model.pooler(out.last_hidden_state[:, :10].mean(dim=1)))
    assert torch.allclose(out.pooled_output, by_hand, atol=1e-6)
    assert torch.allclose(model(ids, mask, types).pooled_output, by_hand, atol=1e-5)
    cls = AlbertModel(small()).eval()
    cls.load_state_dict(model.state_dict())
    assert not torch.allclose(cls(ids, mask, types).pooled_output, by_hand, atol=1e-3)  # "cls" reads [CLS] only


def test_an_unknown_pooling_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="pooling: expected one of cls, mean, got 'max'"):
        small(pooling="max")


def test_question_answering_never_points_into_padding():
    config = small()
    ids, mask, types = batch(config)
    mask[1, 8:] = 0
    out = AlbertForQuestionAnswering(config)(
        ids,
        mask,
        types,
        start_positions=torch.tensor([1, 2]),
        end_positions=torch.tensor([3, 4]),
        is_impossible=torch.tensor([0, 1]),
    )
    assert out.start_logits.shape == (2, 12) and out.answerable_logits.shape == (2,)
    assert out.start_logits[1, 8:].max() < -1e3 and out.loss > 0


def test_multiple_choice_scores_each_choice():
    config = small()
    ids = torch.randint(5, 120, (2, 4, 10))
    out = AlbertForMultipleChoice(config)(ids, torch.ones_like(ids), torch.zeros_like(ids), labels=torch.tensor([1, 3]))
    assert out.logits.shape == (2, 4) and out.loss > 0


def test_pre_ln_blocks_normalize_before_each_sublayer_and_once_after_the_last_layer():
    torch.manual_seed(0)
    model = AlbertModel(small(layer_norm_position="pre", num_hidden_layers=2)).eval()
    ids, mask, types = batch(model.config)
    x = model.embeddings(ids, types)
    a, f = model.encoder.attention_blocks[0], model.encoder.ffn_blocks[0]
    for _ in range(2):  # by hand: x + attention(LN(x)), then x + ffn(LN(x)), the same shared block twice
        h = a.layer_norm(x)
        q, k, v = a.qkv(h).view(2, 12, 3, 4, 8).permute(2, 0, 3, 1, 4)
        context = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 12, 32)
        x = x + a.dense(context)
        x = x + f.down(f.act(f.up(f.layer_norm(x))))
    expected = model.encoder.final_layer_norm(x)
    torch.testing.assert_close(model(ids, mask, types).last_hidden_state, expected, rtol=1e-5, atol=1e-6)
    assert AlbertModel(small()).encoder.final_layer_norm is None  # post-LN, the paper's, has none


def test_an_unknown_layer_norm_position_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="layer_norm_position: expected post or pre"):
        small(layer_norm_position="sandwich")


def _attention_by_hand(a, x, bias=None, rotate_qk=None):
    """One post-LN attention block with einsum and softmax (not SDPA): scores + bias, optional q/k rotation."""
    B, T, H = x.shape
    heads = a.num_heads
    q, k, v = a.qkv(x).view(B, T, 3, heads, H // heads).permute(2, 0, 3, 1, 4)
    if rotate_qk is not None:
        q, k = rotate_qk(q), rotate_qk(k)
    scores = torch.einsum("bhid,bhjd->bhij", q, k) / (H // heads) ** 0.5
    if bias is not None:
        scores = scores + bias
    context = torch.einsum("bhij,bhjd->bhid", scores.softmax(-1), v).transpose(1, 2).reshape(B, T, H)
    return a.layer_norm(x + a.dense(context))


def test_alibi_adds_minus_slope_times_distance_to_each_heads_scores_and_masks_padding():
    torch.manual_seed(0)
    model = AlbertModel(small(position_bias="alibi", num_hidden_layers=1)).eval()
    ids, mask, types = batch(model.config, t=10)
    mask[1, 7:] = 0
    x = model.embeddings(ids, types)
    slopes = torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8])  # 2^(-8h/4), h = 1..4
    distance = (torch.arange(10)[None, :] - torch.arange(10)[:, None]).abs().float()
    bias = (-slopes[:, None, None] * distance)[None].repeat(2, 1, 1, 1)
    bias[1, :, :, 7:] = float("-inf")
    block = model.encoder.attention_blocks[0]
    expected = model.encoder.ffn_blocks[0](_attention_by_hand(block, x, bias))
    torch.testing.assert_close(model(ids, mask, types).last_hidden_state, expected, rtol=1e-5, atol=1e-5)
    plain = AlbertModel(small(num_hidden_layers=1)).eval()
    plain.load_state_dict(model.state_dict())  # same weights, no bias: the outputs differ
    assert not torch.allclose(plain(ids, mask, types).last_hidden_state, expected, atol=1e-3)


def test_rotary_rotates_each_query_and_key_pair_by_its_position_angle():
    torch.manual_seed(0)
    model = AlbertModel(small(position_bias="rotary", num_hidden_layers=1)).eval()
    ids, mask, types = batch(model.config, t=10)
    x = model.embeddings(ids, types)
    d = 8  # head size 32 / 4
    theta = 10000.0 ** (-torch.arange(0, d, 2).float() / d)  # (d/2,)
    angle = torch.arange(10).float()[:, None] * theta[None, :]  # (T, d/2)

    def rotate_qk(t):  # pairs (i, i + d/2) rotated by angle[pos, i]
        first, second = t[..., : d // 2], t[..., d // 2 :]
        cos, sin = angle.cos(), angle.sin()
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

    block = model.encoder.attention_blocks[0]
    expected = model.encoder.ffn_blocks[0](_attention_by_hand(block, x, rotate_qk=rotate_qk))
    torch.testing.assert_close(model(ids, mask, types).last_hidden_state, expected, rtol=1e-5, atol=1e-5)


def test_rotary_scores_depend_on_the_offset_between_positions_only():
    from albert_core.model.modeling import rotary_tables, rotate

    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)
    cos, sin = rotary_tables(40, 8, q.device)

    def score(i, j):
        return float((rotate(q, cos[i : i + 1], sin[i : i + 1]) * rotate(k, cos[j : j + 1], sin[j : j + 1])).sum())

    assert score(3, 5) == pytest.approx(score(30, 32), abs=1e-5)
    assert score(3, 5) != pytest.approx(score(3, 6), abs=1e-3)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(position_bias="relative"), "position_bias: expected one of none, alibi, rotary"),
        (dict(position_bias="rotary", hidden_size=36, num_attention_heads=4), "rotary needs an even head size"),
    ],
)
def test_a_bad_position_bias_is_refused_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        small(**changes)
