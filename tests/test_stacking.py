"""Progressive stacking (albert_core.model.stacking): which source layer each deep layer gets, what the stacked model
computes, the errors, and a real pretraining run that starts from stacked weights (model.init_from)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from albert_core.model.checkpoint import save_model, state_dict_of
from albert_core.model.config import AlbertConfig, ConfigError
from albert_core.model.modeling import AlbertForPreTraining
from albert_core.model.stacking import block_map, check_init_source, load_stacked, stack_layers
from services.rundir.config import RunConfig
from tests.synthetic import write_random_shards

WIDTHS = dict(
    vocab_size=120,
    embedding_size=16,
    hidden_size=32,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def config(layers: int, sharing: str = "none", groups: int = 1) -> AlbertConfig:
    return AlbertConfig(**{**WIDTHS, "num_hidden_layers": layers, "sharing": sharing, "num_hidden_groups": groups})


def trained_like(cfg: AlbertConfig, seed: int = 0) -> AlbertForPreTraining:
    """A model whose every tensor is distinct (LayerNorms and biases too), so a wrong copy cannot go unnoticed."""
    torch.manual_seed(seed)
    model = AlbertForPreTraining(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def stacked_model(shallow: AlbertForPreTraining, deep_cfg: AlbertConfig) -> AlbertForPreTraining:
    deep = AlbertForPreTraining(deep_cfg)
    deep.load_state_dict(stack_layers(state_dict_of(shallow), shallow.config, deep_cfg), strict=True)
    return deep.eval()


def inputs(cfg: AlbertConfig):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, cfg.vocab_size, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 7:] = 0
    types = torch.zeros_like(ids)
    types[:, 5:] = 1
    return ids, mask, types


# --- which source block each deep block gets -------------------------------------------------------------


def test_an_unshared_model_stacked_from_2_to_4_layers_copies_layers_0_1_0_1():
    shallow = trained_like(config(2))
    state = stack_layers(state_dict_of(shallow), shallow.config, config(4))
    source = state_dict_of(shallow)
    for deep_layer, shallow_layer in enumerate([0, 1, 0, 1]):
        for kind in ("attention_blocks", "ffn_blocks"):
            prefix = f"albert.encoder.{kind}."
            own = f"{prefix}{shallow_layer}."
            names = [k.removeprefix(own) for k in source if k.startswith(own)]
            assert names
            for name in names:
                assert torch.equal(state[f"{prefix}{deep_layer}.{name}"], source[f"{prefix}{shallow_layer}.{name}"])
    outside = [k for k in source if ".encoder." not in k]
    assert outside and all(torch.equal(state[k], source[k]) for k in outside)  # embeddings, pooler, both heads


def test_stacked_tensors_do_not_share_storage_with_the_source_or_each_other():
    shallow = trained_like(config(2))
    state = stack_layers(state_dict_of(shallow), shallow.config, config(4))
    first = state["albert.encoder.ffn_blocks.0.up.weight"]
    third = state["albert.encoder.ffn_blocks.2.up.weight"]
    first.add_(1.0)
    assert not torch.equal(first, third)
    assert not torch.equal(first, shallow.albert.encoder.ffn_blocks[0].up.weight)


def test_an_all_shared_model_keeps_its_one_block_so_its_weights_are_unchanged():
    shallow = trained_like(config(2, "all"))
    source = state_dict_of(shallow)
    state = stack_layers(source, shallow.config, config(6, "all"))
    assert state.keys() == source.keys()
    assert all(torch.equal(state[k], source[k]) for k in source)


@pytest.mark.parametrize(
    "shallow_cfg,deep_cfg,attention,ffn",
    [
        (config(2, "attention"), config(4, "attention"), [0], [0, 1, 0, 1]),
        (config(2, "ffn"), config(4, "ffn"), [0, 1, 0, 1], [0]),
        (config(4, "all", 2), config(8, "all", 4), [0, 1, 0, 1], [0, 1, 0, 1]),  # the grouping repeated
        (config(4, "all", 2), config(8, "all", 2), [0, 1], [0, 1]),  # the same groups, each run by 4 layers
        (config(4, "none"), config(2, "none"), [0, 1], [0, 1]),  # shallower: the first layers
    ],
)
def test_block_maps_for_partial_sharing_groups_and_shrinking(shallow_cfg, deep_cfg, attention, ffn):
    assert block_map(shallow_cfg, deep_cfg, "attention") == attention
    assert block_map(shallow_cfg, deep_cfg, "ffn") == ffn


# --- what the stacked model computes ------------------------------------------------------------------------


@pytest.mark.parametrize("sharing", ["none", "all", "attention", "ffn"])
def test_the_stacked_model_runs_the_shallow_encoder_twice(sharing):
    """Deep layers 1-2 compute what the shallow model's layers 1-2 do, and layers 3-4 apply the shallow encoder
    again to that output: for all-shared ALBERT, depth grows for free by running the same block more times."""
    shallow = trained_like(config(2, sharing))
    deep = stacked_model(shallow, config(4, sharing))
    ids, mask, types = inputs(shallow.config)
    with torch.no_grad():
        once = shallow.albert(ids, mask, types, output_hidden_states=True)
        twice, _ = shallow.albert.encoder(once.last_hidden_state, mask[:, None, None, :].bool())
        stacked = deep.albert(ids, mask, types, output_hidden_states=True)
    torch.testing.assert_close(stacked.hidden_states[2], once.last_hidden_state, rtol=0, atol=0)
    torch.testing.assert_close(stacked.last_hidden_state, twice, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(stacked.last_hidden_state, once.last_hidden_state, atol=1e-3)  # it did run more layers


def test_a_stack_of_equal_depth_is_the_same_model():
    shallow = trained_like(config(3, "none"))
    deep = stacked_model(shallow, config(3, "none"))
    ids, mask, types = inputs(shallow.config)
    with torch.no_grad():
        a, b = shallow(ids, mask, types), deep(ids, mask, types)
    assert torch.equal(a.mlm_logits, b.mlm_logits) and torch.equal(a.pair_logits, b.pair_logits)


# --- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value", [("hidden_size", 64), ("embedding_size", 8), ("intermediate_size", 32), ("vocab_size", 100)]
)
def test_a_width_mismatch_is_an_error_naming_the_field(field, value):
    shallow = trained_like(config(2))
    with pytest.raises(ConfigError, match=rf"^{field}: the source checkpoint has"):
        stack_layers(state_dict_of(shallow), shallow.config, config(4).replace(**{field: value}))


def test_a_sharing_mismatch_is_an_error_naming_sharing():
    shallow = trained_like(config(2, "none"))
    with pytest.raises(ConfigError, match=r"^sharing: the source checkpoint shares 'none'.*'all'"):
        stack_layers(state_dict_of(shallow), shallow.config, config(4, "all"))


def test_groups_that_mix_the_source_groups_are_an_error_naming_num_hidden_groups():
    shallow = trained_like(config(4, "all", 2))
    with pytest.raises(ConfigError, match=r"^num_hidden_groups: .*8 layers in 3 groups"):
        stack_layers(state_dict_of(shallow), shallow.config, config(8, "all", 3))


def test_a_checkpoint_missing_a_block_is_an_error_naming_it():
    shallow = trained_like(config(2))
    state = {k: v for k, v in state_dict_of(shallow).items() if not k.startswith("albert.encoder.ffn_blocks.1.")}
    with pytest.raises(ConfigError, match=r"no albert\.encoder\.ffn_blocks\.1\.\* tensors"):
        stack_layers(state, shallow.config, config(4))


def test_check_init_source_names_model_init_from_and_the_directory(tmp_path):
    save_model(tmp_path / "shallow", trained_like(config(2)))
    check_init_source(tmp_path / "shallow", config(4))  # fine
    with pytest.raises(ConfigError, match=r"^model\.init_from: .*shallow: hidden_size: the source checkpoint has 32"):
        check_init_source(tmp_path / "shallow", config(4).replace(hidden_size=64, num_attention_heads=4))
    with pytest.raises(ConfigError, match=r"^model\.init_from: .*nowhere.*config\.json: not found"):
        check_init_source(tmp_path / "nowhere", config(4))


def test_load_stacked_reads_a_saved_checkpoint_into_a_deeper_model(tmp_path):
    shallow = trained_like(config(2))
    save_model(tmp_path / "shallow", shallow)
    deep = AlbertForPreTraining(config(4)).eval()
    assert load_stacked(deep, tmp_path / "shallow") == []  # every tensor came from the checkpoint
    expected = stacked_model(shallow, config(4))
    for name, tensor in expected.state_dict().items():
        assert torch.equal(deep.state_dict()[name], tensor), name


# --- a real run that starts from a checkpoint (model.init_from) ---------------------------------------------

VOCAB = 96


def run_config(tmp_path, shards, init_from: str, **model) -> RunConfig:
    widths = {**WIDTHS, "vocab_size": 0, "num_hidden_layers": 4, "sharing": "none", **model}
    return RunConfig.from_dict(
        {
            "run": {"name": "stacked", "output_dir": str(tmp_path / "runs"), "seed": 7},
            "model": {"preset": "albert-tiny", "overrides": widths, "init_from": init_from},
            "data": {"shards": str(shards), "max_seq_length": 32},
            # A learning rate of 1e-9: one LAMB step moves each tensor by ~1e-9 of its norm, so the first
            # checkpoint still holds the initial weights to 1e-6, while fresh initialization differs by ~0.02.
            "optim": {"lr": 1e-9, "warmup_steps": 0, "total_steps": 1},
            "train": {
                "global_batch_size": 8,
                "micro_batch_size": 8,
                "num_workers": 1,
                "log_every": 1,
                "checkpoint_every": 1,
                "keep_last": 1,
                "max_failures": 0,
            },
        }
    )


@pytest.fixture
def shards(tmp_path):
    write_random_shards(tmp_path / "shards" / "train", (16,), vocab_size=VOCAB, rng=np.random.default_rng(0))
    (tmp_path / "shards" / "manifest.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return tmp_path / "shards"


def test_a_run_with_a_width_mismatched_init_from_fails_before_any_worker_starts(tmp_path, shards):
    from tests.runs import run_training

    save_model(tmp_path / "shallow", trained_like(config(2).replace(vocab_size=VOCAB)))
    bad = run_config(tmp_path, shards, str(tmp_path / "shallow"), intermediate_size=128)
    with pytest.raises(ConfigError, match=r"^model\.init_from: .*intermediate_size: the source checkpoint has 64"):
        run_training(bad, resume=False)
    assert not (tmp_path / "runs" / "stacked" / "checkpoints").exists()


@pytest.mark.ray
def test_a_run_with_init_from_starts_at_the_stacked_weights(ray_local, tmp_path, shards):
    from tests.runs import run_training

    shallow = trained_like(config(2).replace(vocab_size=VOCAB))
    save_model(tmp_path / "shallow", shallow)
    run = run_config(tmp_path, shards, str(tmp_path / "shallow"))
    result = run_training(run, resume=False)
    assert result.step == 1
    trained = load_file(result.checkpoint / "model.safetensors")
    stacked = stack_layers(state_dict_of(shallow), shallow.config, run.model_config(VOCAB))
    torch.manual_seed(run.run.seed)
    fresh = state_dict_of(AlbertForPreTraining(run.model_config(VOCAB)))
    for name in ("albert.encoder.attention_blocks.3.qkv.weight", "albert.encoder.ffn_blocks.2.up.weight"):
        torch.testing.assert_close(trained[name], stacked[name], rtol=0, atol=1e-6)
        assert (trained[name] - fresh[name]).abs().max() > 1e-2  # not the seed's random initialization
    assert set(trained) == set(stacked)
    for name, tensor in stacked.items():
        torch.testing.assert_close(trained[name], tensor, rtol=0, atol=1e-6, msg=name)


# --- data.continue_from_init: a stacked stage reads on where its source run stopped ---------------------------


def training_checkpoint(directory, model: AlbertForPreTraining, *, examples_seen: int, micro_batch_size: int = 8):
    """A training checkpoint as a run of 1 worker writes it, stopped after `examples_seen` examples of epoch 0."""
    from albert_core.optim import make_optimizer, make_scheduler
    from services.train.state import TrainerState, save_train_state

    optimizer = make_optimizer(model, lr=0.01)
    scheduler = make_scheduler(optimizer, warmup_steps=0, total_steps=10)
    state = TrainerState(step=1, examples_seen=examples_seen, world_size=1, micro_batch_size=micro_batch_size)
    return save_train_state(directory, model, optimizer, scheduler, state)


def with_continue(config: RunConfig) -> RunConfig:
    data = config.to_dict()
    data["data"]["continue_from_init"] = True
    return RunConfig.from_dict(data)


def test_continue_from_init_needs_a_training_checkpoint(tmp_path, shards):
    """The data position is a count of examples of the run's stream, so any worker layout carries it over."""
    from tests.runs import run_training

    shallow = trained_like(config(2).replace(vocab_size=VOCAB))
    save_model(tmp_path / "weights-only", shallow)
    run = with_continue(run_config(tmp_path, shards, str(tmp_path / "weights-only")))
    with pytest.raises(ConfigError, match=r"^data\.continue_from_init: .*weights-only has no readable training state"):
        run_training(run, resume=False)
    with pytest.raises(ConfigError, match="data.continue_from_init: needs model.init_from"):
        with_continue(run_config(tmp_path, shards, ""))


@pytest.mark.ray
def test_continue_from_init_reads_on_where_the_source_run_stopped(ray_local, tmp_path, shards):
    """16 rows, 8 per step. The source stopped after 8 examples; the stacked run's one step reads the other 8 and so
    ends the epoch, where a run without the option would still be in epoch 0."""
    from services.rundir.checkpoints import read_trainer_json
    from tests.runs import run_training

    shallow = trained_like(config(2).replace(vocab_size=VOCAB))
    source = training_checkpoint(tmp_path / "source", shallow, examples_seen=8)
    result = run_training(with_continue(run_config(tmp_path, shards, str(source))), resume=False)
    state = read_trainer_json(result.checkpoint)["state"]
    assert (result.step, state["epoch"], state["examples_seen"]) == (1, 1, 16)
