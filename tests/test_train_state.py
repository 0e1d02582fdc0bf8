"""Training checkpoints: exact continuation, damage detection, fallback to the newest good one."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from albert_core.examples.masking import MASK_SCHEME
from albert_core.files import CHECKSUM_FILE, LEGACY_CHECKSUM_FILE, TRAINER_FILE
from albert_core.model.config import AlbertConfig, ConfigError
from albert_core.model.modeling import AlbertForPreTraining
from albert_core.optim import make_optimizer, make_scheduler
from services.rundir.checkpoints import OPTIMIZER_FILE, checkpoint_dir, latest_good, read_trainer_json, verify
from services.train.plan import check_mask_scheme
from services.train.state import CorruptCheckpoint, TrainerState, load_train_state, save_train_state

VOCAB = 64


def tiny_config(**overrides) -> AlbertConfig:
    values = dict(
        vocab_size=VOCAB,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    values.update(overrides)
    return AlbertConfig.preset("albert-tiny", **values)


def build(optimizer: str = "lamb", seed: int = 0):
    torch.manual_seed(seed)
    model = AlbertForPreTraining(tiny_config())
    opt = make_optimizer(model, name=optimizer, lr=1e-2)
    sched = make_scheduler(opt, warmup_steps=2, total_steps=20)
    return model, opt, sched


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(5, VOCAB, (4, 16), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, 3:6] = ids[:, 3:6]
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        token_type_ids=(torch.arange(16) >= 8).long().expand(4, 16),
        mlm_labels=labels,
        pair_labels=torch.randint(0, 2, (4,), generator=g),
    )


def train(model, opt, sched, steps: range) -> list[float]:
    """Steps with dropout on: the losses depend on the global torch RNG, which the checkpoint must restore."""
    model.train()
    losses = []
    for step in steps:
        loss = model(**batch(step)).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def save(root, model, opt, sched, step: int):
    return save_train_state(checkpoint_dir(root, step), model, opt, sched, TrainerState(step=step, dropout=0.1))


@pytest.mark.parametrize("optimizer", ["lamb", "adamw"])
def test_resumed_training_continues_identically(tmp_path, optimizer):
    model, opt, sched = build(optimizer)
    head = train(model, opt, sched, range(3))
    path = save(tmp_path, model, opt, sched, 3)
    tail = train(model, opt, sched, range(3, 6))
    final = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(999)  # a fresh process: different RNG, different initial weights
    model2, opt2, sched2 = build(optimizer, seed=7)
    state = load_train_state(path, model2, opt2, sched2)
    resumed = train(model2, opt2, sched2, range(3, 6))

    assert state.step == 3 and len(head) == 3
    assert resumed == tail
    for name, tensor in model2.state_dict().items():
        assert torch.equal(tensor, final[name]), name
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_checkpoint_holds_loop_state_and_manifest_of_every_file(tmp_path):
    model, opt, sched = build()
    state = TrainerState(step=5, epoch=2, examples_seen=7, dropout=0.0, config_hash="abc", world_size=2)
    path = save_train_state(tmp_path / "step_00000005", model, opt, sched, state)
    manifest = verify(path)
    trainer = read_trainer_json(path)
    assert sorted(manifest["files"]) == sorted(["config.json", "model.safetensors", OPTIMIZER_FILE, TRAINER_FILE])
    assert trainer["state"]["examples_seen"] == 7 and trainer["state"]["epoch"] == 2
    assert set(trainer["rng"]) >= {"torch", "numpy", "python"}
    assert trainer["step"] == 5  # top-level copy for readers that want only the step
    assert not list(tmp_path.glob(".*")), "no temporary directory is left behind"


def test_load_restores_saved_dropout(tmp_path):
    model, opt, sched = build()
    model.set_dropout(0.0)
    path = save_train_state(tmp_path / "step_1", model, opt, sched, TrainerState(step=1, dropout=0.0))
    model2, opt2, sched2 = build()
    assert model2.albert.config.hidden_dropout_prob > 0
    load_train_state(path, model2, opt2, sched2)
    assert all(m.p == 0.0 for m in model2.modules() if isinstance(m, torch.nn.Dropout))


def test_load_keeps_the_configured_dropouts_when_none_was_removed(tmp_path):
    """A recipe with hidden dropout 0 but a pair-head dropout of 0.1 resumes with both as they were."""
    torch.manual_seed(0)
    config = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.1)
    model = AlbertForPreTraining(config)
    opt, sched = make_optimizer(model, name="adamw", lr=1e-3), None
    path = save_train_state(tmp_path / "step_1", model, opt, sched, TrainerState(step=1, dropout=0.0))
    fresh = AlbertForPreTraining(tiny_config(**{k: getattr(config, k) for k in ("hidden_dropout_prob",
                                 "attention_probs_dropout_prob", "classifier_dropout_prob")}))  # fmt: skip
    before = sorted(m.p for m in fresh.modules() if isinstance(m, torch.nn.Dropout))
    assert 0.1 in before
    load_train_state(path, fresh, make_optimizer(fresh, name="adamw", lr=1e-3), None)
    assert sorted(m.p for m in fresh.modules() if isinstance(m, torch.nn.Dropout)) == before


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _bit_flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _remove(path):
    path.unlink()


@pytest.mark.parametrize(
    ("damage", "victim", "message"),
    [
        (_truncate, "model.safetensors", "truncated"),
        (_bit_flip, OPTIMIZER_FILE, "checksum mismatch"),
        (_bit_flip, TRAINER_FILE, "checksum mismatch"),
        (_remove, "config.json", "missing"),
        (_remove, CHECKSUM_FILE, "missing"),
    ],
)
def test_damaged_checkpoint_is_detected_and_the_previous_good_one_chosen(tmp_path, caplog, damage, victim, message):
    model, opt, sched = build()
    good = save(tmp_path, model, opt, sched, 2)
    train(model, opt, sched, range(1))
    bad = save(tmp_path, model, opt, sched, 4)
    damage(bad / victim)

    with pytest.raises(CorruptCheckpoint, match=message) as err:
        verify(bad)
    assert victim in str(err.value)
    with caplog.at_level(logging.WARNING, logger="services.train.state"):
        assert latest_good(tmp_path) == good
    assert bad.name in caplog.text


def test_loading_a_damaged_checkpoint_raises_before_touching_the_model(tmp_path):
    model, opt, sched = build()
    path = save(tmp_path, model, opt, sched, 1)
    _bit_flip(path / "model.safetensors")
    model2, opt2, sched2 = build(seed=3)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(CorruptCheckpoint, match="model.safetensors"):
        load_train_state(path, model2, opt2, sched2)
    assert all(torch.equal(v, before[k]) for k, v in model2.state_dict().items())


def test_a_checkpoint_written_before_its_checksums_were_renamed_still_verifies_and_resumes(tmp_path):
    """Checkpoints written before issue 35 hold their checksums in MANIFEST.json (the same content): they are read."""
    model, opt, sched = build()
    train(model, opt, sched, range(2))
    path = save(tmp_path, model, opt, sched, 2)
    assert (path / CHECKSUM_FILE).is_file() and not (path / LEGACY_CHECKSUM_FILE).exists()
    os.replace(path / CHECKSUM_FILE, path / LEGACY_CHECKSUM_FILE)  # as the save wrote it before
    assert set(verify(path)["files"]) == {"config.json", "model.safetensors", OPTIMIZER_FILE, TRAINER_FILE}
    assert latest_good(tmp_path) == path
    model2, opt2, sched2 = build(seed=7)
    assert load_train_state(path, model2, opt2, sched2).step == 2
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in model2.state_dict().items())
    _bit_flip(path / OPTIMIZER_FILE)
    with pytest.raises(CorruptCheckpoint, match=rf"{OPTIMIZER_FILE}: checksum mismatch .*{LEGACY_CHECKSUM_FILE} says"):
        verify(path)


def test_latest_good_ignores_temporaries_and_other_entries(tmp_path):
    model, opt, sched = build()
    good = save(tmp_path, model, opt, sched, 3)
    (tmp_path / ".step_00000009.tmp-1234").mkdir()  # an interrupted save
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "step_00000010").mkdir()  # partial: no manifest
    assert latest_good(tmp_path) == good


def test_latest_good_of_missing_or_empty_root_is_none(tmp_path):
    assert latest_good(tmp_path / "absent") is None
    assert latest_good(tmp_path) is None


def test_saving_over_an_existing_checkpoint_replaces_it_whole(tmp_path):
    model, opt, sched = build()
    path = save(tmp_path, model, opt, sched, 2)
    _truncate(path / "model.safetensors")
    train(model, opt, sched, range(1))
    save(tmp_path, model, opt, sched, 2)
    verify(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]


def test_optimizer_state_of_another_model_is_refused(tmp_path):
    model, opt, sched = build()
    path = save(tmp_path, model, opt, sched, 1)
    other = AlbertForPreTraining(tiny_config())
    other_opt = make_optimizer(other, name="adamw", lr=1e-2)
    with pytest.raises(Exception, match="Lamb state"):
        load_train_state(path, other, other_opt, None)


def test_trainer_json_is_plain_json(tmp_path):
    model, opt, sched = build()
    path = save(tmp_path, model, opt, sched, 1)
    data = json.loads((path / TRAINER_FILE).read_text())
    assert data["optimizer"]["class"] == "Lamb"
    assert data["scheduler"]["last_epoch"] == 0


def test_a_checkpoint_records_its_mask_scheme_and_one_without_it_reads_as_scheme_1(tmp_path):
    model, opt, sched = build()
    path = save(tmp_path, model, opt, sched, 1)
    assert read_trainer_json(path)["state"]["mask_scheme"] == MASK_SCHEME
    state = dict(read_trainer_json(path)["state"])
    del state["mask_scheme"]  # as every checkpoint written before the scheme was recorded
    assert TrainerState.from_dict(state, source="old").mask_scheme == 1


def test_resuming_a_checkpoint_of_another_mask_scheme_is_refused_in_one_line(tmp_path):
    """Scheme 1's masks (numpy's PCG64 per row) are not made any more: its run is refused, naming both schemes and
    how to keep its weights; a checkpoint of this scheme resumes."""
    model, opt, sched = build()
    path = save(tmp_path, model, opt, sched, 1)
    check_mask_scheme(path)
    trainer = read_trainer_json(path)
    del trainer["state"]["mask_scheme"]
    (path / TRAINER_FILE).write_text(json.dumps(trainer))
    with pytest.raises(ConfigError) as refusal:
        check_mask_scheme(path)
    message = str(refusal.value)
    assert "\n" not in message
    assert f"mask scheme 1, this albert masks with scheme {MASK_SCHEME}" in message
    assert f"--init-from {path}" in message
