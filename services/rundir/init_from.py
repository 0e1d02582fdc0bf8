"""A new run that continues a published or earlier checkpoint (`albert pretrain --init-from DIR`): the model is the
checkpoint's, not the recipe's.

`adopt_checkpoint_model(config, directory, sets)` reads the checkpoint's architecture (config.json and the
safetensors header: ours, or a transformers ALBERT or BERT) and returns the run config with `model.preset =
"checkpoint"`, `model.overrides` = every field of the checkpoint's config and `model.init_from` = the directory, plus
one line per field of the recipe's model it replaced. The run config of record is then self-contained: a resume
builds the same model from it. A `--set model.overrides.FIELD` that contradicts the checkpoint is an error naming both
values, except the dropout probabilities, which are training choices, not the checkpoint's weights.

At the start of the run every tensor the checkpoint has is loaded (services.train.worker, through
albert_core.model.stacking: with equal configs, stacking is a copy), after anything the recipe initializes (the
unigram MLM bias, sinusoidal positions), so nothing overwrites a loaded tensor; heads the checkpoint lacks keep their
initialization and are named (albert_core.model.stacking.InitSummary).

`model.init_from` set in a recipe with a model of its own is progressive stacking (albert_core.model.stacking): the
recipe's deeper model takes the checkpoint's layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from albert_core.files import CheckpointError
from albert_core.model.checkpoint import read_architecture
from albert_core.model.config import ConfigError
from services.rundir.config import RunConfig, merge_fields
from services.rundir.sections import CHECKPOINT_PRESET

# Fields a --set may change from the checkpoint's config: training choices, not what its weights compute.
TRAINING_FIELDS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout_prob")


def adopt_checkpoint_model(
    config: RunConfig, directory: str | Path, sets: Mapping[str, Any] | None = None
) -> tuple[RunConfig, list[str]]:
    """The run config whose model is the checkpoint's at `directory`, and the recipe's model fields it replaced
    ("hidden_size 256 -> 384"). `sets`: the `--set` overrides the config was loaded with (to tell a contradicting
    --set from a recipe's value, which simply gives way). ConfigError naming --init-from or the --set otherwise."""
    directory = Path(directory).resolve()
    try:
        theirs = read_architecture(directory).config.to_dict()
    except (CheckpointError, ConfigError, OSError) as err:
        raise ConfigError(f"--init-from {directory}: {err}") from None
    set_by = merge_fields({}, {k: v for k, v in (sets or {}).items() if k.startswith("model.")}, origin="--set")
    if set_by.get("model.preset") and config.model.preset != CHECKPOINT_PRESET:
        raise ConfigError(
            f"{set_by['model.preset']}: contradicts --init-from {directory} (the model is the checkpoint's); "
            "to put the checkpoint's layers into the recipe's model instead (progressive stacking), set "
            "model.init_from without --init-from"
        )
    kept = {}
    for dotted, where in set_by.items():
        name = dotted.removeprefix("model.")
        if name not in theirs:
            continue
        value = config.model.overrides[name]
        if name in TRAINING_FIELDS:
            kept[name] = value
        elif value != theirs[name]:
            raise ConfigError(
                f"{where}: contradicts the checkpoint {directory}, whose {name} is {theirs[name]!r}; --init-from "
                "trains the checkpoint's model as it is"
            )
    model = {**theirs, **kept}
    if config.model.preset == CHECKPOINT_PRESET:  # a recipe made for --init-from: only what it names gives way
        recipe = {name: value for name, value in config.model.overrides.items() if name != "vocab_size"}
        replaced = []
    else:
        recipe = config.model_config(vocab_size=theirs["vocab_size"]).to_dict()
        replaced = [f"preset {config.model.preset!r}"]
    replaced += [
        f"{name} {recipe[name]!r} -> {model[name]!r}" for name in model if recipe.get(name, model[name]) != model[name]
    ]
    data = config.to_dict()
    data["model"].update(preset=CHECKPOINT_PRESET, overrides=model, init_from=str(directory))
    return RunConfig.from_dict(data, source="--init-from"), replaced


def replaced_line(directory: str | Path, replaced: list[str]) -> str:
    """The console's line about what --init-from took from the recipe."""
    line = f"--init-from {directory}: the model is the checkpoint's"
    return f"{line}; it replaces the recipe's {', '.join(replaced)}" if replaced else line
