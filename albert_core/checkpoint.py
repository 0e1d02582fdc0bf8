"""Model checkpoint files: safetensors weights + JSON config. Never pickle: loading cannot run code.

A model directory holds `config.json` (AlbertConfig fields) and `model.safetensors` (our names). A transformers
directory (config.json with "model_type") is converted on load through `albert_core.interop`.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from albert_core.config import AlbertConfig
from albert_core.files import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, atomic_write_bytes
from albert_core.interop import load_hf_checkpoint
from albert_core.model import AlbertForPreTraining, AlbertModel


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
    try:
        save_file(state, tmp, metadata={"format": "albert"})
        os.replace(tmp, directory / WEIGHTS_FILE)
    finally:
        Path(tmp).unlink(missing_ok=True)
    atomic_write_bytes(directory / CONFIG_FILE, (config.to_json() + "\n").encode())
    return directory


def read_checkpoint(directory: str | Path) -> tuple[AlbertConfig, dict[str, Tensor]]:
    """Config and canonical-named weights from an albert or a transformers model directory."""
    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: not found; a model directory holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_path}: not valid JSON ({err})") from None
    if "model_type" in raw:
        return load_hf_checkpoint(directory)
    config = AlbertConfig.load(config_path)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights}: not found")
    try:
        state = load_file(weights)
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{weights}: unreadable safetensors file ({err})") from None
    return config, state


def load_model(directory: str | Path, cls: type[nn.Module] = AlbertForPreTraining, **kwargs) -> nn.Module:
    """Build `cls` from a model directory and load its weights (task heads missing from it stay initialized)."""
    config, state = read_checkpoint(directory)
    model = cls(config, **kwargs)
    load_weights(model, state)
    return model
