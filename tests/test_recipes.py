"""Recipes a user can trust: `--set` and experiment specs change exactly the fields they name (one merger, values
parsed by each field's declared type), errors say where a value came from."""

from __future__ import annotations

import tomllib

import pytest

from albert_core.config import ConfigError
from services.experiments.spec import ExperimentSpec, cell_config
from services.run.config import RunConfig, parse_sets, resolve_config_path

TINY = tomllib.loads(resolve_config_path("tiny").read_text())


def load(*sets: str) -> RunConfig:
    return RunConfig.load("tiny", parse_sets(list(sets)))


# --- --set: one field overridden means one field changed --------------------------------------------------------


def test_set_model_overrides_field_changes_that_field_and_keeps_the_recipes_other_overrides():
    config = load("model.overrides.position_bias=none")
    assert config.model.overrides == {**TINY["model"]["overrides"], "position_bias": "none"}
    assert config.model_config(8000).hidden_size == 64  # the recipe's, not the preset's 256


def test_setting_the_overrides_table_changes_only_the_fields_it_names():
    config = load('model.overrides={position_bias="none", num_hidden_layers=4}')
    expected = {**TINY["model"]["overrides"], "position_bias": "none", "num_hidden_layers": 4}
    assert config.model.overrides == expected
    assert config.model_config(8000).hidden_size == 64


def test_every_other_field_is_left_as_the_recipe_has_it():
    base, changed = RunConfig.load("tiny").to_dict(), load("optim.lr=0.001").to_dict()
    assert changed["optim"].pop("lr") == 0.001
    base["optim"].pop("lr")
    assert changed == base


def test_a_string_field_takes_any_text():
    assert load("run.name=2024").run.name == "2024"
    assert load("data.shards=/data/my shards").data.shards == "/data/my shards"
    assert load('data.shards="quoted"').data.shards == "quoted"  # TOML quoting still works
    assert load("model.overrides.position_bias=none").model.overrides["position_bias"] == "none"


def test_values_are_parsed_by_the_fields_declared_type():
    config = load(
        "run.seed=7",
        "optim.lr=3e-4",
        "train.compile=true",
        "optim.name=lamb",
        "optim.trust_clip=[0.0, 10.0]",
        "data.mixture={news = 2, '*' = 1}",
        'eval.tasks=["sst2"]',
        "eval.task_data={sst2 = 'glue/SST-2'}",
    )
    assert (config.run.seed, config.optim.lr, config.train.compile) == (7, 3e-4, True)
    assert config.optim.trust_clip == [0.0, 10.0]
    assert config.data.mixture == {"news": 2, "*": 1}
    assert config.eval.tasks == ["sst2"] and config.eval.task_data == {"sst2": "glue/SST-2"}


@pytest.mark.parametrize(
    "pair, expected",
    [
        ("run.seed=abc", "expected an integer"),
        ("train.compile=yes", "expected true or false"),
        ("optim.lr=fast", "expected a number"),
        ("eval.tasks=sst2", "expected a list"),
        ("model.overrides.num_hidden_layers=two", "expected an integer"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_set_flag_and_the_type(pair, expected):
    with pytest.raises(ConfigError) as err:
        load(pair)
    assert str(err.value).startswith(f"--set {pair}: ") and expected in str(err.value)
    assert "tiny.toml" not in str(err.value)


def test_an_unknown_field_names_the_valid_ones_and_says_it_came_from_set():
    with pytest.raises(ConfigError) as err:
        load("train.num_worker=2")
    message = str(err.value)
    assert message.startswith("--set train.num_worker=2: ") and "tiny.toml" not in message
    assert "num_workers" in message and "global_batch_size" in message


def test_an_unknown_model_override_names_the_model_fields():
    with pytest.raises(ConfigError) as err:
        load("model.overrides.hidden=128")
    message = str(err.value)
    assert message.startswith("--set model.overrides.hidden=128: ") and "hidden_size" in message


def test_an_unknown_section_names_the_sections():
    with pytest.raises(ConfigError) as err:
        load("training.lr=1")
    assert "--set training.lr=1" in str(err.value) and "optim" in str(err.value)


def test_a_set_value_that_fails_the_recipe_checks_names_the_set_flag():
    with pytest.raises(ConfigError) as err:
        load("train.global_batch_size=100")
    assert "--set train.global_batch_size=100" in str(err.value)
    assert "is not a multiple of micro_batch_size" in str(err.value)


def test_a_recipe_error_without_set_still_names_the_recipe(tmp_path):
    recipe = tmp_path / "bad.toml"
    recipe.write_text("[train]\nnum_worker = 2\n")
    with pytest.raises(ConfigError) as err:
        RunConfig.load(recipe)
    assert str(err.value).startswith(str(recipe)) and "num_workers" in str(err.value)


def test_a_malformed_set_is_refused():
    with pytest.raises(ConfigError, match="--set lr: expected SECTION.FIELD=VALUE"):
        parse_sets(["lr"])


# --- experiment specs: the same merger ----------------------------------------------------------------------------


def spec(**tables) -> ExperimentSpec:
    return ExperimentSpec.from_dict({"experiment": {"name": "t", "recipe": "tiny"}, **tables}, source="spec.toml")


def test_a_spec_cell_changes_one_model_field_as_set_does():
    s = spec(grid={"model.overrides.sharing": ["none"]})
    (cell,) = s.expand()
    assert cell_config(s, cell).model.overrides == {**TINY["model"]["overrides"], "sharing": "none"}


def test_a_spec_setting_the_overrides_table_changes_only_its_fields():
    s = spec(set={"model.overrides": {"sharing": "none"}})
    (cell,) = s.expand()
    assert cell_config(s, cell).model.overrides == {**TINY["model"]["overrides"], "sharing": "none"}


def test_a_spec_with_an_unknown_field_names_the_valid_ones_and_the_spec():
    with pytest.raises(ConfigError) as err:
        spec(set={"model.overrides.shraing": "none"})
    message = str(err.value)
    assert message.startswith("spec.toml: cell base: model.overrides.shraing") and "sharing" in message
