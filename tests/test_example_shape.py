"""The example shape (albert_core.examples.shape) is declared once: preprocessing's options, a recipe's [data],
evaluation's options and an experiment's [preprocess] hold its fields with its type, default, meaning and rules."""

from __future__ import annotations

import dataclasses

import pytest

from albert_core.examples.masking import MaskSettings
from albert_core.examples.pairs import PairConfig
from albert_core.examples.shape import FIELDS, ExampleShape, shape_fields
from albert_core.model.config import ConfigError
from services.eval.evaluate import IntrinsicOptions
from services.experiments.spec import ExperimentSpec, PreprocessSpec, cell_config
from services.preprocess.config import PreprocessConfig
from services.rundir.config import RunConfig
from services.rundir.sections import DataSection

# Each holder of the shape and the fields of it it decides (the others are decided elsewhere: a run trains on the
# pair task of its shard set, an experiment's cells take max_seq_length from their recipe).
HOLDERS = {
    PreprocessConfig: {"max_seq_length", "objective", "short_seq_prob"},
    DataSection: {"max_seq_length", "mask_prob", "max_ngram"},
    IntrinsicOptions: {"max_seq_length", "short_seq_prob", "mask_prob", "max_ngram"},
    PreprocessSpec: {"objective", "short_seq_prob"},
    PairConfig: {"max_seq_length", "objective", "short_seq_prob"},
    MaskSettings: {"mask_prob", "max_ngram"},
}


@pytest.mark.parametrize("holder", list(HOLDERS), ids=lambda c: c.__name__)
def test_each_holder_of_the_shape_has_its_fields_with_their_type_default_and_meaning(holder):
    held = {f.name: f for f in dataclasses.fields(holder) if f.name in FIELDS}
    assert set(held) == HOLDERS[holder]
    assert shape_fields(holder) == {name: name for name in held}  # each declared as the shape's own field
    for name, f in held.items():
        declared = FIELDS[name]
        assert (f.type, f.default, f.metadata["help"]) == (declared.type, declared.default, declared.metadata["help"])


def test_the_shapes_defaults_are_the_papers():
    assert dataclasses.asdict(ExampleShape()) == {
        "max_seq_length": 512, "objective": "sop", "short_seq_prob": 0.1, "mask_prob": 0.15, "max_ngram": 3,
    }  # fmt: skip


def test_the_evaluation_command_defaults_to_the_shapes_length():
    import argparse

    from services.eval.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["eval", "run", "--checkpoint", "c", "--heldout", "h"])
    assert args.max_seq_length == ExampleShape.max_seq_length


def test_a_length_too_short_for_a_pair_is_refused_alike_by_the_recipe_preprocessing_and_pairs(tmp_path):
    expected = "expected an integer >= 5 ([CLS] A [SEP] B [SEP]), got 4"
    with pytest.raises(ConfigError, match=r"^--set data.max_seq_length=4: data.max_seq_length: " + _re(expected)):
        RunConfig.load("tiny", {"data.max_seq_length": _set("4")})
    with pytest.raises(ValueError, match=r"^PreprocessConfig.max_seq_length: " + _re(expected)):
        PreprocessConfig(inputs=["a"], tokenizer="t", output="o", max_seq_length=4)
    with pytest.raises(ValueError, match=r"^PairConfig.max_seq_length: " + _re(expected)):
        PairConfig(max_seq_length=4)


def test_a_mask_share_out_of_range_is_refused_naming_the_recipe_field():
    with pytest.raises(ConfigError, match=r"data.mask_prob: expected a share in \(0, 1\), got 1.5"):
        RunConfig.load("tiny", {"data.mask_prob": 1.5})


def test_an_experiment_cell_with_an_unknown_pair_task_is_refused_before_anything_runs():
    table = {"inputs": ["corpus.txt"], "tokenizer": "spiece.model"}
    with pytest.raises(ConfigError, match=r"^spec.toml: cell objective-sopp: preprocess.objective: expected one of"):
        ExperimentSpec.from_dict(
            {
                "experiment": {"name": "t", "recipe": "tiny"},
                "preprocess": table,
                "grid": {"preprocess.objective": ["sopp"]},
            },
            source="spec.toml",
        )
    spec = ExperimentSpec.from_dict(
        {"experiment": {"name": "t", "recipe": "tiny"}, "preprocess": table, "grid": {"preprocess.objective": ["nsp"]}},
        source="spec.toml",
    )
    (cell,) = spec.expand()
    assert cell_config(spec, cell).data.shards.split("/")[-1].startswith("nsp-128-")


def _set(text: str):
    from services.rundir.config import SetText

    return SetText(text)


def _re(text: str) -> str:
    import re

    return re.escape(text)
