"""AlbertConfig: presets, validation with messages naming the field, JSON round trip, parameter counts."""

import pytest
import torch
import transformers

from albert_core.model.config import PRESETS, AlbertConfig, ConfigError, count_parameters

# Table 1 of the paper, in millions, and the count transformers gives for each released configuration.
PAPER_MILLIONS = {
    "bert-base": 108,
    "bert-large": 334,
    "albert-base": 12,
    "albert-large": 18,
    "albert-xlarge": 60,
    "albert-xxlarge": 235,
}
TRANSFORMERS_MILLIONS = {
    "bert-base": 109.1,
    "bert-large": 334.6,
    "albert-base": 11.7,
    "albert-large": 17.7,
    "albert-xlarge": 58.7,
    "albert-xxlarge": 222.6,
}


def _transformers_count(config: AlbertConfig) -> int:
    """Build transformers' own model on the meta device (no memory) and count its parameters."""
    with torch.device("meta"):
        if config.sharing == "none":
            hf = transformers.BertModel(
                transformers.BertConfig(
                    vocab_size=config.vocab_size,
                    hidden_size=config.hidden_size,
                    num_hidden_layers=config.num_hidden_layers,
                    num_attention_heads=config.num_attention_heads,
                    intermediate_size=config.intermediate_size,
                )
            )
        else:
            hf = transformers.AlbertModel(
                transformers.AlbertConfig(
                    vocab_size=config.vocab_size,
                    embedding_size=config.embedding_size,
                    hidden_size=config.hidden_size,
                    num_hidden_layers=config.num_hidden_layers,
                    num_attention_heads=config.num_attention_heads,
                    intermediate_size=config.intermediate_size,
                    num_hidden_groups=config.num_hidden_groups,
                )
            )
    return sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("name", sorted(PAPER_MILLIONS))
def test_preset_count_equals_transformers_count(name):
    config = AlbertConfig.preset(name)
    assert count_parameters(config) == _transformers_count(config)


@pytest.mark.parametrize("name", sorted(PAPER_MILLIONS))
def test_preset_count_matches_measured_millions(name):
    assert count_parameters(AlbertConfig.preset(name)) / 1e6 == pytest.approx(TRANSFORMERS_MILLIONS[name], abs=0.05)


@pytest.mark.parametrize("name", ["bert-base", "bert-large", "albert-base", "albert-large", "albert-xlarge"])
def test_preset_count_matches_table1_to_the_papers_rounding(name):
    # Table 1 rounds to whole millions; BERT-base's 108M is quoted without the pooler's 0.6M.
    millions = count_parameters(AlbertConfig.preset(name)) / 1e6
    assert abs(millions - PAPER_MILLIONS[name]) <= max(1.5, 0.025 * PAPER_MILLIONS[name])


def test_xxlarge_released_configuration_is_about_5_percent_below_table1():
    millions = count_parameters(AlbertConfig.preset("albert-xxlarge")) / 1e6
    assert 0.93 < millions / PAPER_MILLIONS["albert-xxlarge"] < 0.96


@pytest.mark.parametrize("sharing,groups", [("all", 1), ("all", 3), ("attention", 2), ("ffn", 1), ("none", 1)])
def test_count_equals_built_model(sharing, groups):
    from albert_core.model.modeling import AlbertModel

    config = AlbertConfig(
        vocab_size=500,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        intermediate_size=64,
        sharing=sharing,
        num_hidden_groups=groups,
    )
    assert count_parameters(config) == sum(p.numel() for p in AlbertModel(config).parameters())


def test_sharing_cuts_parameters_as_table4_none_attention_ffn_all():
    # Table 4 (E=768): not-shared 108M > shared-attention 83M > shared-FFN 57M > all-shared 31M.
    counts = [
        count_parameters(AlbertConfig.preset("albert-base", sharing=s)) for s in ("none", "attention", "ffn", "all")
    ]
    assert counts == sorted(counts, reverse=True) and len(set(counts)) == 4


def test_all_presets_validate():
    for name in PRESETS:
        AlbertConfig.preset(name).validate()


def test_json_round_trip_preserves_every_field(tmp_path):
    config = AlbertConfig.preset(
        "albert-large", num_hidden_groups=4, hidden_dropout_prob=0.0, embedding_projection=True
    )
    assert AlbertConfig.from_json(config.to_json()) == config
    config.save(tmp_path / "config.json")
    assert AlbertConfig.load(tmp_path / "config.json") == config


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(hidden_size=100, num_attention_heads=12), "hidden_size"),
        (dict(sharing="layers"), "sharing"),
        (dict(num_hidden_groups=13), "num_hidden_groups"),
        (dict(sharing="none", num_hidden_groups=2), "num_hidden_groups"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(num_hidden_layers=2.5), "num_hidden_layers"),
        (dict(hidden_dropout_prob=1.0), "hidden_dropout_prob"),
        (dict(hidden_act="swish"), "hidden_act"),
        (dict(embedding_projection=False), "embedding_projection"),
    ],
)
def test_invalid_config_message_names_the_field(changes, field):
    with pytest.raises(ConfigError, match=rf"^{field}:"):
        AlbertConfig.preset("albert-base", **changes)


def test_unknown_field_in_json_is_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 768, "hiden_layers": 3}')
    with pytest.raises(ConfigError, match="hiden_layers: unknown AlbertConfig field"):
        AlbertConfig.load(path)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="albert-base"):
        AlbertConfig.preset("albert-huge")


def test_layer_groups_follow_floor_l_times_g_over_l():
    config = AlbertConfig.preset("albert-base", num_hidden_groups=5)
    assert [config.attention_block_of(layer) for layer in range(12)] == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4]
