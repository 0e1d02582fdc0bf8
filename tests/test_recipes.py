"""Recipes a user can trust: `--set` and experiment specs change exactly the fields they name (one merger, values
parsed by each field's declared type), errors say where a value came from."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from albert_core.model.config import ConfigError
from services.experiments.spec import ExperimentSpec, cell_config
from services.rundir.config import RunConfig, parse_sets, resolve_config_path

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
    from services.terminal import UsageError

    with pytest.raises(UsageError, match="--set lr: expected SECTION.FIELD=VALUE"):
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


# --- albert config show, albert pretrain --dry-run ------------------------------------------------------------------


def test_config_show_prints_the_resolved_recipe_as_toml_that_loads_back_to_the_same_config(capsys, tmp_path):
    from albert_core.model.config import count_parameters
    from services.cli import main

    sets = ["model.overrides.position_bias=none", "run.name=2024", "data.mixture={a = 1}", "data.follow=true"]
    assert main(["config", "show", "tiny", *[a for s in sets for a in ("--set", s)]]) == 0
    shown = capsys.readouterr().out
    (tmp_path / "shown.toml").write_text(shown)
    expected = load(*sets)
    assert RunConfig.load(tmp_path / "shown.toml").to_dict() == expected.to_dict()
    params = count_parameters(expected.model_config(30000)) / 1e6
    assert f"# model: {params:.2f}M parameters (albert-tiny; vocab_size 30000: assumed" in shown


def test_config_show_counts_the_parameters_with_the_shard_sets_vocabulary(capsys, tmp_path):
    from albert_core.model.config import count_parameters
    from services.cli import main

    (tmp_path / "manifest.json").write_text('{"vocab_size": 96}')
    assert main(["config", "show", "tiny", "--set", f"data.shards={tmp_path}"]) == 0
    params = count_parameters(load(f"data.shards={tmp_path}").model_config(96)) / 1e6
    assert f"{params:.2f}M parameters (albert-tiny; vocab_size 96: data.shards'" in capsys.readouterr().out


def test_config_show_refuses_a_bad_set_in_one_line(capsys):
    from services.cli import main

    assert main(["config", "show", "tiny", "--set", "train.num_worker=2"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--set train.num_worker=2" in err and "num_workers" in err


@pytest.fixture
def shards(tmp_path):
    """Shards and the held-out documents the run's evaluations read (a dry run refuses a set without them)."""
    from tests.test_train import write_heldout, write_shards

    return write_heldout(write_shards(tmp_path / "shards"))


def pretrain_args(tmp_path, shards, *more: str) -> list[str]:
    sets = [f"data.shards={shards}", f"run.output_dir={tmp_path / 'runs'}", "run.name=r", "optim.warmup_steps=10"]
    return ["pretrain", "--config", "tiny", *[a for s in sets for a in ("--set", s)], *more]


def test_dry_run_prints_the_whole_plan_and_starts_or_writes_nothing(capsys, tmp_path, shards, monkeypatch):
    import ray

    from services.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("the dry run started Ray")

    # whether or not an earlier test of this process left Ray running: neither joining nor starting one
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr("services.train.pretrain.connect", refuse)
    before = sorted(p.name for p in shards.rglob("*"))
    assert main(pretrain_args(tmp_path, shards, "--dry-run")) == 0
    out = capsys.readouterr().out
    assert f"run r: {(tmp_path / 'runs' / 'r').resolve()} (a new run)" in out
    assert "model: albert-tiny, 2 layers, H 64, E 64, 2 heads, sharing all, vocab 96:" in out
    assert f"shards: {shards.resolve()}, version 1, 66 examples" in out and "part part-0: 4 files, 66 examples" in out
    assert "workers: 2, each 1 CPU; backend cpu, fp32" in out
    assert "batch: 32 examples a step = micro-batch 16 x 1 accumulated x 2 workers, 128 tokens" in out
    assert "steps: 4000 (4000 to go), adamw lr 0.003, warmup 10, decay over the last 1200" in out
    assert "epochs: 66 examples each (2.1 steps); 1939.39 epochs in all" in out
    assert "checkpoints: every 500 steps and at the end (8 in all), keep the last 2" in out
    assert "held-out evaluation: every 500 steps and at the end" in out
    assert "fine-tuning its checkpoints: lr 0.001, max_steps 300, pooling mean" in out
    assert not (tmp_path / "runs").exists()  # no run directory made
    assert sorted(p.name for p in shards.rglob("*")) == before  # no unigram counts stored


def test_dry_run_refuses_what_the_run_would_refuse(capsys, tmp_path, shards):
    from services.cli import main

    assert main(pretrain_args(tmp_path, shards, "--set", "data.sop_order=epoch", "--dry-run")) != 0
    assert 'data.sop_order: "epoch" redraws the order of SOP pairs' in capsys.readouterr().err
    assert main(pretrain_args(tmp_path, shards, "--set", "train.global_batch_size=128", "--dry-run")) != 0
    assert "train.global_batch_size: 128 examples per step" in capsys.readouterr().err


# --- a resume under a changed recipe ------------------------------------------------------------------------------


@pytest.fixture
def started_run(tmp_path, shards):
    """A run directory as a started run leaves it: ledger.json (the ledger's, with the config of record) and a
    checkpoint directory."""
    from services.rundir.ledger import RunLedger

    config = RunConfig.load(
        "tiny",
        {"data.shards": str(shards), "run.output_dir": str(tmp_path / "runs"), "run.name": "r",
         "optim.warmup_steps": 10},
    )  # fmt: skip
    RunLedger(config.run_dir, "r", config.to_dict())
    (config.run_dir / "checkpoints" / "step_00000500").mkdir(parents=True)
    return config


def test_a_resume_that_changes_the_model_or_the_optimizer_is_refused_naming_each_field_with_both_values(started_run):
    from services.rundir.resume import check_resume_changes

    changed = RunConfig.load(
        "tiny",
        {**{f"run.{k}": v for k, v in (("output_dir", started_run.run.output_dir), ("name", "r"))},
         "data.shards": started_run.data.shards, "optim.warmup_steps": 10,
         "optim.lr": 0.001, "model.overrides.hidden_size": 128},
    )  # fmt: skip
    with pytest.raises(ConfigError) as err:
        check_resume_changes(started_run.run_dir, changed)
    message = str(err.value)
    assert "model.overrides.hidden_size: 64 -> 128" in message and "optim.lr: 0.003 -> 0.001" in message
    assert "--allow-config-change model.overrides.hidden_size optim.lr" in message
    allowed = check_resume_changes(started_run.run_dir, changed, ["optim.lr", "model.overrides.hidden_size"])
    assert allowed == {"model.overrides.hidden_size": [64, 128], "optim.lr": [0.003, 0.001]}
    assert check_resume_changes(started_run.run_dir, changed, ["optim", "model.overrides"]) == allowed


def test_the_schedule_step_budget_evaluation_and_worker_layout_may_change_without_asking(started_run):
    from services.rundir.resume import check_resume_changes

    safe = {
        "optim.total_steps": 8000, "optim.warmup_steps": 20, "optim.decay_steps": 2000, "eval.every_steps": 250,
        "eval.heldout_batches": 4, "train.checkpoint_every": 250, "train.num_workers": 1,
        "train.micro_batch_size": 32, "data.follow": True,
    }  # fmt: skip
    base = {"data.shards": started_run.data.shards, "run.output_dir": started_run.run.output_dir, "run.name": "r"}
    changes = check_resume_changes(started_run.run_dir, RunConfig.load("tiny", {**base, **safe}))
    assert set(changes) == set(safe) and changes["optim.total_steps"] == [4000, 8000]


def test_the_same_shard_set_written_another_way_or_moved_is_no_change(started_run, tmp_path, monkeypatch):
    import shutil

    from services.rundir.resume import check_resume_changes

    shards = Path(started_run.data.shards)
    base = {"run.output_dir": started_run.run.output_dir, "run.name": "r", "optim.warmup_steps": 10}
    monkeypatch.chdir(shards.parent)
    assert check_resume_changes(started_run.run_dir, RunConfig.load("tiny", {**base, "data.shards": "shards"})) == {}
    shutil.copytree(shards, tmp_path / "moved")
    moved = RunConfig.load("tiny", {**base, "data.shards": str(tmp_path / "moved")})
    assert check_resume_changes(started_run.run_dir, moved) == {}
    (tmp_path / "moved" / "manifest.json").write_text('{"vocab_size": 97}')  # another shard set
    with pytest.raises(ConfigError, match="data.shards: .* -> .*moved"):
        check_resume_changes(started_run.run_dir, moved)


def test_an_unknown_field_in_allow_config_change_names_the_sections(started_run):
    from services.rundir.resume import check_resume_changes

    with pytest.raises(ConfigError, match="--allow-config-change optim.learning_rate: not a field"):
        check_resume_changes(started_run.run_dir, started_run, ["optim.learning_rate"])


def test_pretrain_refuses_a_changed_resume_before_ray_starts(started_run, capsys, monkeypatch):
    from services.cli import main
    from services.train import pretrain

    monkeypatch.setattr(pretrain, "connect", lambda *a: pytest.fail("Ray was started"))
    argv = ["pretrain", "--config", "tiny", "--resume", str(started_run.run_dir),
            "--set", f"data.shards={started_run.data.shards}", "--set", "optim.warmup_steps=10"]  # fmt: skip
    assert main([*argv, "--set", "optim.lr=0.001"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "optim.lr: 0.003 -> 0.001" in err
    assert main([*argv, "--set", "optim.lr=0.001", "--dry-run"]) != 0  # the dry run refuses it alike
    assert "optim.lr: 0.003 -> 0.001" in capsys.readouterr().err
    assert main([*argv, "--set", "optim.lr=0.001", "--allow-config-change", "optim.lr", "--dry-run"]) == 0
    assert "optim.lr: 0.003 -> 0.001" in capsys.readouterr().out


def test_one_dry_run_of_a_resume_checks_its_recipe_once(started_run, capsys, monkeypatch):
    """RunConfig.validate runs in one place, when the config is built (RunConfig.from_dict): the path from the
    command to the plan (services.train.driver.prepare_run, its resume check reading the recorded config) adds none."""
    from services.cli import main

    checked, validate = [], RunConfig.validate

    def counted(config: RunConfig) -> None:
        checked.append(config.run.name)
        validate(config)

    monkeypatch.setattr(RunConfig, "validate", counted)
    argv = ["pretrain", "--config", "tiny", "--resume", str(started_run.run_dir),
            "--set", f"data.shards={started_run.data.shards}", "--set", "optim.warmup_steps=10",
            "--set", "optim.lr=0.001", "--allow-config-change", "optim.lr", "--dry-run"]  # fmt: skip
    assert main(argv) == 0
    assert "optim.lr: 0.003 -> 0.001" in capsys.readouterr().out  # the resume check compared the two configs
    assert checked == ["r"]


def test_a_resume_under_another_config_warns_on_the_console_through_the_runs_events(tmp_path):
    """The worker's warning becomes a `warning` event, which the driver's live view prints (a local Ray does not
    pass worker logs to the console)."""
    from types import SimpleNamespace

    from albert_core.text.tokenization import TokenIds
    from services.rundir.report import event_lines
    from services.train import worker as loop
    from services.train.plan import ShardSet, WorkerPlan
    from services.train.state import TrainerState

    events = []
    record = SimpleNamespace(
        latest_good_checkpoint=lambda: "/runs/r/checkpoints/step_00000004",
        event=lambda step, event, **fields: events.append({"step": step, "event": event, **fields}),
    )
    backend = SimpleNamespace(load=lambda *a: TrainerState(step=4, config_hash="another", micro_batch_size=16))
    shards = ShardSet("/shards", ("/shards/train/a.parquet",), (100,), (1,), ("part-0",), ("",))
    config = RunConfig.load("tiny", {"data.shards": "/shards", "run.output_dir": str(tmp_path)})
    plan = WorkerPlan(config=config, run_dir=str(tmp_path / "r"), token_ids=TokenIds(vocab_size=64), shards=shards)
    worker = loop.Worker(plan, rank=0, world=2, distributed=False, backend=backend, record=record, shards=shards)
    model = SimpleNamespace(config=SimpleNamespace(hidden_dropout_prob=0.0))
    loop.resume(worker, model, None, None)
    warnings = [e for e in events if e["event"] == "warning"]
    (warning,) = [w for w in warnings if "written under a different run config" in w["message"]]
    assert event_lines(warning) == [f"warning @ step 4: {warning['message']}"]
    changed = {"event": "config_changed", "step": 4, "changed": {"optim.lr": [0.003, 0.001]}}
    assert event_lines(changed) == ["config changed @ step 4: optim.lr: 0.003 -> 0.001"]
    assert any("resumed by 2 x 16" in w["message"] for w in warnings)  # another worker count, said alike


# --- a recipe's own fine-tuning defaults ----------------------------------------------------------------------------


def test_the_tiny_recipe_carries_its_fine_tuning_defaults_and_the_papers_recipes_none():
    tiny = RunConfig.load("tiny").finetune
    assert (tiny.lr, tiny.max_steps, tiny.pooling) == (0.001, 300, "mean")
    base = RunConfig.load("albert-base").finetune
    assert (base.lr, base.max_steps, base.pooling) == (0.0, 0, "")  # the task's own recipe
    with pytest.raises(ConfigError, match="finetune.pooling: expected cls, mean"):
        load("finetune.pooling=max")


def test_the_fine_tuning_defaults_are_not_part_of_a_pretraining_cells_fingerprint():
    from services.experiments.cells import cell_fingerprint

    one, other = spec(), spec(set={"finetune.lr": 0.01})
    (cell,) = one.expand()
    assert cell_fingerprint(one, cell) == cell_fingerprint(other, cell)


@pytest.fixture
def run_checkpoint(started_run):
    return started_run.run_dir / "checkpoints" / "step_00000500"


def test_finetune_takes_the_recipe_defaults_of_the_checkpoints_run_where_the_command_gives_none(
    run_checkpoint, tmp_path, capsys, monkeypatch
):
    from services.cli import main
    from services.finetune import cli as finetune_cli

    seen = []

    def seed_configs(task, checkpoint, data, *, overrides, **kwargs):
        seen.append(dict(overrides))
        raise ValueError("stop here")

    monkeypatch.setattr(finetune_cli, "seed_configs", seed_configs)
    monkeypatch.setattr(finetune_cli, "model_line", lambda *args: "model: (this test's checkpoint has no weights)")
    argv = ["finetune", "--task", "sst2", "--data", str(tmp_path), "--checkpoint", str(run_checkpoint)]
    main([*argv, "--output", str(tmp_path / "out")])
    assert seen[-1] == {"lr": 0.001, "max_steps": 300, "pooling": "mean"}
    out = capsys.readouterr().out
    assert f"fine-tuning defaults of the recipe of {run_checkpoint.parent.parent}" in out
    assert "lr 0.001, max_steps 300, pooling mean" in out
    main([*argv, "--output", str(tmp_path / "out"), "--lr", "5e-4", "--pooling", "cls"])
    assert seen[-1] == {"lr": 5e-4, "max_steps": 300, "pooling": "cls"}
    assert "max_steps 300 (--lr, --pooling given instead)" in capsys.readouterr().out


def test_a_model_outside_a_pretraining_run_fine_tunes_with_the_tasks_recipe(tmp_path, monkeypatch):
    from services.finetune.seeds import recipe_defaults

    (tmp_path / "model").mkdir()
    assert recipe_defaults(tmp_path / "model") is None


def test_evaluations_of_a_runs_checkpoints_fine_tune_with_its_recipe_defaults(run_checkpoint, tmp_path, monkeypatch):
    """albert eval run --task, evaluation schedules and the run's own eval.tasks all go through downstream_metrics."""
    from services.eval import evaluate
    from services.finetune import seeds as finetune_run

    seen = []

    def downstream_evaluator(task, *, seeds=None, overrides=None):
        return lambda checkpoint, data: seen.append((seeds, overrides)) or {"acc": 0.5}

    monkeypatch.setattr(finetune_run, "downstream_evaluator", downstream_evaluator)
    evaluate.downstream_metrics("sst2", run_checkpoint, str(tmp_path))
    evaluate.downstream_metrics("sst2", run_checkpoint, str(tmp_path), seeds=3, max_steps=50)
    assert seen == [
        (None, {"lr": 0.001, "max_steps": 300, "pooling": "mean"}),
        (3, {"lr": 0.001, "max_steps": 50, "pooling": "mean"}),  # --task-max-steps / eval.task_max_steps win
    ]


def test_a_run_started_before_recipes_had_fine_tuning_defaults_resumes_without_asking(started_run):
    import json

    from services.rundir.ledger import LEDGER_FILE
    from services.rundir.resume import check_resume_changes

    state = started_run.run_dir / LEDGER_FILE
    recorded = json.loads(state.read_text())
    del recorded["config"]["finetune"]
    state.write_text(json.dumps(recorded))
    changes = check_resume_changes(started_run.run_dir, started_run)  # not refused: read as the defaults, now set
    assert changes == {"finetune.lr": [0.0, 0.001], "finetune.max_steps": [0, 300], "finetune.pooling": ["", "mean"]}
