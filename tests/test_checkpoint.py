"""Checkpoint files: safetensors + JSON, round trip, clear errors, no code execution on load."""

import pickle

import pytest
import torch

from albert_core.model.checkpoint import CheckpointError, load_model, save_model
from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import AlbertForPreTraining, AlbertForSequenceClassification


@pytest.fixture()
def model():
    torch.manual_seed(0)
    return AlbertForPreTraining(AlbertConfig.preset("albert-tiny", vocab_size=200, num_hidden_layers=2))


def test_save_then_load_gives_identical_weights_and_config(tmp_path, model):
    save_model(tmp_path, model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_model(tmp_path)
    assert loaded.config == model.config
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_pretrained_backbone_loads_under_a_new_task_head(tmp_path, model):
    save_model(tmp_path, model)
    classifier = load_model(tmp_path, AlbertForSequenceClassification, num_labels=2)
    assert torch.equal(
        classifier.albert.embeddings.word_embeddings.weight, model.albert.embeddings.word_embeddings.weight
    )


def test_truncated_weights_file_is_a_clear_error(tmp_path, model):
    save_model(tmp_path, model)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tmp_path)


def test_pickle_payload_is_never_executed(tmp_path, model):
    """A hostile 'checkpoint' that is a pickle with a code payload is rejected without running it."""
    save_model(tmp_path, model)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / "model.safetensors").write_bytes(pickle.dumps({"w": Payload()}))
    with pytest.raises(CheckpointError):
        load_model(tmp_path)
    assert not marker.exists()


def test_missing_directory_names_the_expected_files(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path / "nowhere")


def test_mismatched_shapes_name_the_tensor(tmp_path, model):
    save_model(tmp_path, model)
    config = AlbertConfig.load(tmp_path / "config.json").replace(hidden_size=128, num_attention_heads=2)
    config.save(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="albert\\."):
        load_model(tmp_path)
