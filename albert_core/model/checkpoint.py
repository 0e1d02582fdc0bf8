"""Model checkpoint files: safetensors weights + JSON config. Never pickle: loading cannot run code.

A model directory holds `config.json` (AlbertConfig fields) and `model.safetensors` (our names). A transformers
directory (config.json with "model_type") is converted on load through `albert_core.model.interop`.

A checkpoint is input: its config.json is checked (sizes capped, albert_core.model.config.MAX_PARAMETERS) and the
tensor shapes in the safetensors header are compared with the shapes that config gives (a model built on the
meta device, which allocates nothing) before any tensor is read or any model is built.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from albert_core.files import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, atomic_write_bytes, replacing
from albert_core.model.config import AlbertConfig, ConfigError
from albert_core.model.interop import from_hf
from albert_core.model.modeling import AlbertForPreTraining, AlbertModel


def state_dict_of(model: nn.Module) -> dict[str, Tensor]:
    """The model's weights under our canonical names ("albert.*" for the backbone)."""
    state = model.state_dict()
    if isinstance(model, AlbertModel):
        state = {"albert." + k: v for k, v in state.items()}
    return state


def load_weights(model: nn.Module, state: dict[str, Tensor]) -> list[str]:
    """Load canonical-named weights into any albert model.

    The backbone must match exactly; head weights the checkpoint lacks stay at their initialization and are
    returned by name (e.g. a classifier on top of a pretrained backbone); heads the model lacks are ignored.
    """
    if isinstance(model, AlbertModel):
        state = {k.removeprefix("albert."): v for k, v in state.items() if k.startswith("albert.")}
    own = model.state_dict()
    backbone = {k for k in own if k.startswith("albert.")} if not isinstance(model, AlbertModel) else set(own)
    missing_backbone = sorted(backbone - set(state))
    if missing_backbone:
        raise CheckpointError(f"checkpoint lacks {len(missing_backbone)} backbone tensors, e.g. {missing_backbone[:3]}")
    for name, tensor in state.items():
        if name in own and own[name].shape != tensor.shape:
            expected = tuple(own[name].shape)
            raise CheckpointError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {expected}")
    result = model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    return sorted(result.missing_keys)


def save_model(directory: str | Path, model: nn.Module) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config: AlbertConfig = model.config
    state = {k: v.detach().cpu().contiguous() for k, v in state_dict_of(model).items()}
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".model.", suffix=".tmp")
    os.close(fd)
    weights = directory / WEIGHTS_FILE
    kept = "the previous weights, unchanged" if weights.exists() else "no weights (the file was not created)"
    with replacing(weights, tmp, sum(t.numel() * t.element_size() for t in state.values()), kept):
        save_file(state, tmp, metadata={"format": "albert"})
    atomic_write_bytes(directory / CONFIG_FILE, (config.to_json() + "\n").encode())
    return directory


def read_checkpoint(directory: str | Path) -> tuple[AlbertConfig, dict[str, Tensor]]:
    """Config and canonical-named weights from an albert or a transformers model directory; the config is checked
    against the weights' shapes (read from the safetensors header) before any tensor is read."""
    found = read_architecture(directory)
    weights = Path(directory) / WEIGHTS_FILE
    try:
        state = load_file(weights)
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{weights}: unreadable safetensors file ({err})") from None
    return from_hf(state, found.hf_config) if found.hf_config is not None else (found.config, state)


@dataclass(frozen=True)
class Architecture:
    """What a model directory holds, read from its config.json and its safetensors header only (no tensor read)."""

    config: AlbertConfig
    tensors: dict[str, Tensor]  # canonical names -> meta tensors of the stored shapes
    hf_config: dict[str, Any] | None  # transformers' config.json (None: an albert model directory)

    @property
    def kind(self) -> str:
        """ "albert" (ours), or transformers' "albert" / "bert", as a phrase."""
        return f"transformers {self.hf_config['model_type']}" if self.hf_config is not None else "albert"


def read_architecture(directory: str | Path) -> Architecture:
    """The model a directory holds (ours or transformers'), its config checked against the weights' shapes."""
    directory = Path(directory)
    config_path, weights = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: not found; a model directory holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_path}: not valid JSON ({err})") from None
    except RecursionError:
        raise CheckpointError(f"{config_path}: not valid JSON (nested too deeply)") from None
    if not weights.is_file():
        raise CheckpointError(f"{weights}: not found")
    header = header_tensors(weights)
    hf = isinstance(raw, dict) and "model_type" in raw
    try:
        config, named = from_hf(header, raw) if hf else (AlbertConfig.from_dict(raw), header)
    except ConfigError as err:  # a field out of range, a size above the cap
        raise ConfigError(f"{config_path}: {err}") from None
    except ValueError as err:  # transformers weights that lack backbone tensors
        raise CheckpointError(f"{directory}: {err}") from None
    check_shapes(weights, config, named)
    return Architecture(config, named, raw if hf else None)


def header_tensors(weights: Path) -> dict[str, Tensor]:
    """The tensors a safetensors file holds, as meta tensors of their shapes: nothing is read or allocated."""
    try:
        with safe_open(weights, framework="pt") as handle:
            shapes = {name: handle.get_slice(name).get_shape() for name in handle.keys()}
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{weights}: unreadable safetensors file ({err})") from None
    return {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}


def expected_shapes(config: AlbertConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of AlbertForPreTraining(config) under our names, from a model on the meta device."""
    with torch.device("meta"):
        model = AlbertForPreTraining(config)
    return {name: tuple(tensor.shape) for name, tensor in state_dict_of(model).items()}


def check_shapes(weights: Path, config: AlbertConfig, named: dict[str, Tensor]) -> None:
    """Refuse weights whose shapes are not those `config` gives, naming the first tensor that differs."""
    expected = expected_shapes(config)
    for name, tensor in named.items():
        shape = tuple(tensor.shape)
        if name in expected and shape != expected[name]:
            raise CheckpointError(
                f"{weights}: {name} has shape {shape} but {CONFIG_FILE} makes it {expected[name]}: "
                "the config does not describe these weights"
            )


def load_model(directory: str | Path, cls: type[nn.Module] = AlbertForPreTraining, **kwargs) -> nn.Module:
    """Build `cls` from a model directory and load its weights (task heads missing from it stay initialized)."""
    config, state = read_checkpoint(directory)
    model = cls(config, **kwargs)
    load_weights(model, state)
    return model
