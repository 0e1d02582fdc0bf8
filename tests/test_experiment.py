"""services/experiment: grid specs, cell configs, resume markers, results tables, `analyze layers`, and one real cell
(tiny corpus → tokenizer → preprocess → pretrain on Ray → held-out eval + probes) run end to end."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from albert_core.evaluation.analysis import transition_roughness
from albert_core.files import atomic_write_bytes
from albert_core.model.config import AlbertConfig, ConfigError, count_parameters
from albert_core.text.tokenization import MODEL_FILE, TokenizerTrainConfig, train_tokenizer
from services.experiments.analyze import analyze_layers
from services.experiments.cells import (
    RESULTS_CSV,
    RESULTS_MD,
    cell_fingerprint,
    coordinator_evaluation,
    fingerprint_fields,
    finished_result,
    marker_path,
    run_experiment,
    write_tables,
)
from services.experiments.spec import Cell, ExperimentSpec, cell_config, cell_name, final_checkpoint
from services.rundir.config import RunConfig
from services.rundir.ledger import LEDGER_FILE
from services.rundir.log import read_metrics

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer_corpus.txt"
TEXTS = FIXTURE.read_text(encoding="utf-8").splitlines()

# A recipe small enough for a few CPU seconds per step.
RECIPE = """
[run]
name = "x"
seed = 7
[model]
preset = "albert-tiny"
[model.overrides]
vocab_size = 0
embedding_size = 16
hidden_size = 32
num_hidden_layers = 2
num_attention_heads = 2
intermediate_size = 64
max_position_embeddings = 64
[data]
shards = "unused"
max_seq_length = 64
[optim]
lr = 0.01
warmup_steps = 1
total_steps = 3
[train]
global_batch_size = 8
micro_batch_size = 8
num_workers = 1
log_every = 1
checkpoint_every = 3
keep_last = 1
max_failures = 0
[eval]
heldout_batches = 2
batch_size = 8
"""


@pytest.fixture
def recipe(tmp_path) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(RECIPE)
    return path


def spec_of(recipe: Path, tmp_path: Path, **tables) -> ExperimentSpec:
    data = {"experiment": {"name": "exp", "recipe": str(recipe), "output_dir": str(tmp_path / "out")}}
    data.update(tables)
    return ExperimentSpec.from_dict(data, source="spec.toml")


PREPROCESS = {"inputs": ["corpus"], "tokenizer": "spiece.model", "cache": "cache"}


# --- grids and cells ---------------------------------------------------------------------------------------


def test_the_grid_expands_to_every_combination_first_axis_slowest(recipe, tmp_path):
    spec = spec_of(
        recipe,
        tmp_path,
        grid={"model.overrides.sharing": ["all", "none"], "model.overrides.embedding_size": [8, 16, 32]},
    )
    cells = spec.expand()
    assert [c.values for c in cells] == [
        {"model.overrides.sharing": s, "model.overrides.embedding_size": e}
        for s in ("all", "none")
        for e in (8, 16, 32)
    ]
    assert cells[0].name == "sharing-all_embedding_size-8"
    assert len({c.name for c in cells}) == 6


def test_explicit_cells_follow_the_grid_cells(recipe, tmp_path):
    spec = spec_of(
        recipe,
        tmp_path,
        grid={"model.overrides.sharing": ["all"]},
        cells=[{"model.overrides.sharing": "none", "model.overrides.num_hidden_layers": 1}],
    )
    assert [c.name for c in spec.expand()] == ["sharing-all", "sharing-none_num_hidden_layers-1"]


def test_a_cell_config_applies_the_recipe_then_set_then_the_cell_values(recipe, tmp_path):
    spec = spec_of(
        recipe,
        tmp_path,
        set={"optim.total_steps": 5, "train.dropout_removal_step": 4},
        grid={"model.overrides.sharing": ["none"], "model.overrides.num_hidden_layers": [3]},
    )
    config = cell_config(spec, spec.expand()[0])
    model = config.model_config(vocab_size=100)
    assert (model.sharing, model.num_hidden_layers, model.hidden_size) == ("none", 3, 32)
    assert (config.optim.total_steps, config.train.dropout_removal_step) == (5, 4)
    assert config.run.name == "exp-sharing-none_num_hidden_layers-3"
    assert config.run_dir == tmp_path / "out" / "exp" / "runs" / "exp-sharing-none_num_hidden_layers-3"


def test_each_objective_gets_its_own_shards_and_equal_options_share_one(recipe, tmp_path):
    spec = spec_of(
        recipe,
        tmp_path,
        preprocess=PREPROCESS,
        grid={"preprocess.objective": ["sop", "nsp"], "model.overrides.sharing": ["all", "none"]},
    )
    shards = {c.name: cell_config(spec, c).data.shards for c in spec.expand()}
    assert shards["objective-sop_sharing-all"] == shards["objective-sop_sharing-none"]
    assert shards["objective-sop_sharing-all"] != shards["objective-nsp_sharing-all"]
    assert Path(shards["objective-nsp_sharing-all"]).name.startswith("nsp-64-")


def test_an_unknown_field_is_an_error_naming_the_cell_and_field(recipe, tmp_path):
    with pytest.raises(ConfigError, match=r"cell sharing2-all: model.overrides.sharing2: .* not a model field"):
        spec_of(recipe, tmp_path, grid={"model.overrides.sharing2": ["all"]})


def test_a_bad_value_is_refused_before_anything_runs_naming_the_field(recipe, tmp_path):
    with pytest.raises(ConfigError, match=r"cell sharing-most: model\.sharing: expected one of"):
        spec_of(recipe, tmp_path, grid={"model.overrides.sharing": ["all", "most"]})


def test_a_preprocess_axis_without_a_preprocess_table_is_an_error(recipe, tmp_path):
    with pytest.raises(ConfigError, match=r"preprocess\.\* fields need a \[preprocess\] table"):
        spec_of(recipe, tmp_path, grid={"preprocess.objective": ["sop", "nsp"]})


def test_cell_names_carry_the_last_part_of_each_field_and_its_value():
    assert cell_name({"preprocess.objective": "none", "train.dropout_removal_step": 100}) == (
        "objective-none_dropout_removal_step-100"
    )
    assert cell_name({}) == "base"


def test_an_explicit_cell_may_be_named(recipe, tmp_path):
    spec = spec_of(recipe, tmp_path, cells=[{"name": "deep", "model.overrides.num_hidden_layers": 4}])
    (cell,) = spec.expand()
    assert (cell.name, cell.values) == ("deep", {"model.overrides.num_hidden_layers": 4})
    assert cell_config(spec, cell).run.name == "exp-deep"
    with pytest.raises(ConfigError, match=r"cells: name: use letters"):
        spec_of(recipe, tmp_path, cells=[{"name": "a b", "optim.total_steps": 4}])


STACKING = [
    {"name": "shallow", "model.overrides.num_hidden_layers": 1},
    {"name": "stacked", "model.init_from": "cell:shallow"},
]


def test_init_from_an_earlier_cell_names_that_cells_final_checkpoint(recipe, tmp_path):
    spec = spec_of(recipe, tmp_path, set={"optim.total_steps": 4, "train.checkpoint_every": 2}, cells=STACKING)
    shallow, stacked = spec.expand()
    expected = cell_config(spec, shallow).run_dir / "checkpoints" / "step_00000004"
    assert final_checkpoint(cell_config(spec, shallow)) == expected
    assert cell_config(spec, stacked).model.init_from == str(expected)
    assert cell_config(spec, shallow).model.init_from == ""


def test_init_from_a_later_or_unknown_cell_is_an_error_naming_the_field(recipe, tmp_path):
    with pytest.raises(ConfigError, match=r"cell stacked: model\.init_from: 'cell:shallow' names no earlier cell"):
        spec_of(recipe, tmp_path, cells=STACKING[::-1])
    with pytest.raises(ConfigError, match=r"'cell:nope' names no earlier cell of the spec \(earlier cells: shallow\)"):
        spec_of(recipe, tmp_path, cells=[STACKING[0], {"name": "stacked", "model.init_from": "cell:nope"}])


def test_a_stacked_cells_fingerprint_follows_its_source_cell(recipe, tmp_path):
    spec = spec_of(recipe, tmp_path, cells=STACKING)
    changed = spec_of(recipe, tmp_path, cells=[{**STACKING[0], "optim.lr": 0.02}, STACKING[1]])
    stacked = spec.expand()[1]
    assert cell_config(spec, stacked).to_dict() == cell_config(changed, stacked).to_dict()  # same RunConfig...
    assert cell_fingerprint(spec, stacked) != cell_fingerprint(changed, stacked)  # ...but another source


def test_fields_added_to_runconfig_after_the_first_markers_count_only_when_set():
    """Markers of version 1 hashed exactly these fields: a new field at its default must leave them valid."""
    default = fingerprint_fields(RunConfig())
    assert {section: set(values) for section, values in default.items()} == {
        "run": {"name", "output_dir", "seed"},
        "model": {"preset", "overrides"},
        "data": {"shards", "max_seq_length", "mask_prob", "max_ngram", "static_shapes"},
        "optim": {
            "name", "lr", "warmup_steps", "total_steps", "weight_decay", "beta1", "beta2", "eps", "bias_correction",
            "trust_clip", "grad_clip",
        },
        "train": {
            "global_batch_size", "micro_batch_size", "num_workers", "backend", "precision", "cpus_per_worker",
            "resources_per_worker", "log_every", "checkpoint_every", "keep_last", "dropout_removal_step",
            "max_failures",
        },
        "eval": {"every_steps", "heldout_batches", "batch_size", "tasks", "task_data", "task_seeds", "task_max_steps"},
    }  # fmt: skip
    stacked = RunConfig()
    stacked.model.init_from = "somewhere"
    assert fingerprint_fields(stacked)["model"]["init_from"] == "somewhere"


def test_shipped_experiment_specs_load_and_validate(monkeypatch):
    root = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(root)  # recipes and caches are relative to the repository
    specs = sorted((root / "configs" / "experiments").glob("*.toml"))
    assert len(specs) >= 6
    for path in specs:
        spec = ExperimentSpec.load(path)
        assert 2 <= len(spec.groups()) <= 16 and len(spec.expand()) <= 24, path


# --- markers, resume and tables ----------------------------------------------------------------------------


def finish(spec: ExperimentSpec, cell: Cell, **result) -> None:
    """A marker as run_cell writes it, for a cell that finished with these results."""
    record = {"cell": cell.name, "values": cell.values, **result}
    marker = {"version": 1, "fingerprint": cell_fingerprint(spec, cell), "result": record}
    atomic_write_bytes(marker_path(spec, cell), json.dumps(marker).encode())


def test_a_cell_with_a_marker_is_not_pending(recipe, tmp_path):
    spec = spec_of(recipe, tmp_path, grid={"model.overrides.sharing": ["all", "none"]})
    done, todo = spec.expand()
    finish(spec, done, mlm_acc=0.5)
    assert [c.name for c in spec.expand() if finished_result(spec, c) is None] == [todo.name]
    assert finished_result(spec, done)["mlm_acc"] == 0.5


def test_a_marker_written_under_another_configuration_is_refused(recipe, tmp_path):
    spec = spec_of(recipe, tmp_path, grid={"model.overrides.sharing": ["all"]})
    finish(spec, spec.expand()[0], mlm_acc=0.5)
    changed = spec_of(recipe, tmp_path, set={"optim.total_steps": 9}, grid={"model.overrides.sharing": ["all"]})
    with pytest.raises(ConfigError, match="finished under a different configuration"):
        finished_result(changed, changed.expand()[0])


def test_a_stacked_cell_does_not_run_before_its_source_cell_reached_its_last_step(recipe, tmp_path):
    spec = spec_of(recipe, tmp_path, cells=STACKING)
    shallow, stacked = spec.expand()
    with pytest.raises(ConfigError, match="names cell shallow, which has not finished; run it first"):
        run_experiment(spec, only=["stacked"])
    early = final_checkpoint(cell_config(spec, shallow)).parent / "step_00000002"
    finish(spec, shallow, checkpoint=str(early))  # a run stopped by train.max_seconds before total_steps
    with pytest.raises(ConfigError, match=r"but that cell finished at .*step_00000002"):
        run_experiment(spec, only=["stacked"])
    assert not cell_config(spec, stacked).run_dir.exists()  # nothing ran


def test_the_results_table_lists_finished_cells_with_parameters_and_accuracies(recipe, tmp_path):
    spec = spec_of(recipe, tmp_path, grid={"model.overrides.sharing": ["all", "none"]})
    shared, unshared = spec.expand()
    finish(spec, unshared, params=1_234_567, steps=3, mlm_acc=0.25, sop_acc=0.5, nsp_acc=0.75, sop_probe=0.625)
    finish(spec, shared, params=234_567, steps=3, mlm_acc=0.125, sop_acc=0.5, nsp_acc=0.5, sop_probe=0.5)
    csv_path, md_path = write_tables(spec)
    rows = list(csv.DictReader(csv_path.open()))
    assert [r["cell"] for r in rows] == ["sharing-all", "sharing-none"]  # spec order, not finishing order
    assert rows[1]["sharing"] == "none" and int(rows[1]["params"]) == 1_234_567 and float(rows[1]["nsp_acc"]) == 0.75
    md = md_path.read_text()
    assert "| sharing-none | none | 1.23M | 3 | 25.0 | " in md
    assert md.count("\n| sharing-") == 2


# --- the coordinator's final evaluation is the cell's --------------------------------------------------------


def coordinator_run(recipe: Path, tmp_path: Path, eval_line: dict, **started_with) -> tuple[RunConfig, Path]:
    """A run directory as pretrain leaves it: ledger.json (the config it was started with), metrics.jsonl."""
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "manifest.json").write_text(json.dumps({"vocab_size": 50}))
    spec = spec_of(recipe, tmp_path, set={"data.shards": str(shards)})
    config = cell_config(spec, spec.expand()[0])
    checkpoint = (final_checkpoint(config)).resolve()
    data = config.to_dict()
    for dotted, value in started_with.items():
        section, name = dotted.split(".")
        data[section][name] = value
    config.run_dir.mkdir(parents=True)
    (config.run_dir / LEDGER_FILE).write_text(json.dumps({"config": data}))
    lines = [
        {"step": 3, "time": 1.0, "kind": "train", "loss": 7.0},
        {"step": 3, "time": 2.0, "kind": "eval", "checkpoint": str(checkpoint), **eval_line, "seconds": 1.5},
    ]
    (config.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return config, checkpoint


def test_the_coordinators_evaluation_of_the_final_checkpoint_is_reused(recipe, tmp_path):
    config, checkpoint = coordinator_run(recipe, tmp_path, {"mlm_acc": 0.25, "sop_acc": 0.5, "mlm_tokens": 9})
    assert coordinator_evaluation(config, checkpoint) == {"mlm_acc": 0.25, "sop_acc": 0.5, "mlm_tokens": 9}


def test_an_evaluation_of_another_checkpoint_is_not_reused(recipe, tmp_path):
    config, checkpoint = coordinator_run(recipe, tmp_path, {"mlm_acc": 0.25})
    assert coordinator_evaluation(config, checkpoint.parent / "step_00000002") is None


@pytest.mark.parametrize("changed", [{"eval.heldout_batches": 3}, {"run.seed": 8}, {"data.max_seq_length": 32}])
def test_an_evaluation_under_other_options_is_not_reused(recipe, tmp_path, changed):
    config, checkpoint = coordinator_run(recipe, tmp_path, {"mlm_acc": 0.25}, **changed)
    assert coordinator_evaluation(config, checkpoint) is None


# --- analyze layers ----------------------------------------------------------------------------------------

WORDS = "the a harbour was quiet in early morning and fishermen were mending their nets on stone quay".split()


def layer_means(states: tuple[torch.Tensor, ...], mask: torch.Tensor) -> list[tuple[float, float]]:
    real = mask.bool()
    out = []
    for before, after in zip(states[:-1], states[1:], strict=True):
        x, y = before[real].double(), after[real].double()
        out.append((float((y - x).norm(dim=-1).mean()), float(torch.nn.functional.cosine_similarity(x, y).mean())))
    return out


def test_analyze_layers_on_a_transformers_bert_checkpoint_matches_its_own_hidden_states(tmp_path):
    from transformers import AutoTokenizer, BertConfig, BertModel

    checkpoint = tmp_path / "bert"
    checkpoint.mkdir()
    (checkpoint / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, ".", ","]))
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(WORDS) + 7,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
    )
    bert = BertModel(config).eval()
    bert.save_pretrained(checkpoint)
    text = tmp_path / "text.txt"
    text.write_text("The harbour was quiet in the early morning.\n\nThe fishermen were mending their nets.\n")

    out = analyze_layers([checkpoint], text, tmp_path / "fig", batch_size=1)

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    batch = tokenizer(
        ["The harbour was quiet in the early morning.", "The fishermen were mending their nets."],
        padding=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        states = bert(**batch, output_hidden_states=True).hidden_states
    expected = layer_means(states, batch["attention_mask"])
    assert [r["layer"] for r in out["rows"]] == [1, 2, 3]
    for row, (l2, cosine) in zip(out["rows"], expected, strict=True):
        assert row["sharing"] == "none"
        assert row["l2"] == pytest.approx(l2, rel=1e-4)
        assert row["cosine"] == pytest.approx(cosine, rel=1e-4)
    assert out["png"].stat().st_size > 1000
    assert len(list(csv.DictReader(out["csv"].open()))) == 3


@pytest.mark.ray
def test_analyze_layers_refuses_a_checkpoint_whose_vocabulary_differs_from_the_heldout_file(tmp_path, run_outputs):
    from albert_core.model.checkpoint import save_model
    from albert_core.model.modeling import AlbertForPreTraining

    other = AlbertForPreTraining(AlbertConfig.preset("albert-tiny", vocab_size=50, max_position_embeddings=64))
    save_model(tmp_path / "other", other)
    heldout = Path(run_outputs["record"]["shards"]) / "heldout" / "documents.parquet"
    with pytest.raises(ValueError, match="vocabulary has 50 entries"):
        analyze_layers([tmp_path / "other"], heldout, tmp_path / "fig")


# --- one real cell, end to end -----------------------------------------------------------------------------


def write_corpus(root: Path, n_docs: int = 24) -> None:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for doc in range(n_docs):
        lines = rng.choice(len(TEXTS), size=10, replace=False)
        (root / f"doc_{doc:02d}.txt").write_text(" ".join(TEXTS[i] for i in lines) + "\n")


@pytest.fixture(scope="module")
def run_outputs(ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("experiment")
    write_corpus(root / "corpus")
    train_tokenizer(TEXTS, root / "tok", TokenizerTrainConfig(vocab_size=300, allow_smaller_vocab=True))
    (root / "recipe.toml").write_text(RECIPE)
    data = {
        "experiment": {"name": "e2e", "recipe": str(root / "recipe.toml"), "output_dir": str(root / "out")},
        "preprocess": {
            "inputs": [str(root / "corpus")],
            "tokenizer": str(root / "tok" / MODEL_FILE),
            "cache": str(root / "cache"),
            "heldout_fraction": 0.25,
        },
        "grid": {"preprocess.objective": ["nsp"]},
        "probe": {"examples": 32},
    }
    spec = ExperimentSpec.from_dict(data, source="e2e.toml")
    runner_evaluations = []  # held-out evaluations in this process (the coordinator's evaluator is another one)
    with pytest.MonkeyPatch.context() as patch:
        import services.eval.evaluate

        real = services.eval.evaluate.evaluate_model
        patch.setattr(
            services.eval.evaluate, "evaluate_model", lambda *a, **k: runner_evaluations.append(1) or real(*a, **k)
        )
        first = run_experiment(spec)
    (cell,) = spec.expand()
    run_dir = cell_config(spec, cell).run_dir
    snapshot = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    second = run_experiment(spec)
    return {
        "spec": spec,
        "first": first,
        "second": second,
        "run_dir": run_dir,
        "snapshot": snapshot,
        "record": first[0],
        "runner_evaluations": len(runner_evaluations),
    }


@pytest.mark.ray
def test_a_real_cell_pretrains_to_its_last_step_and_records_heldout_accuracies(run_outputs):
    record = run_outputs["record"]
    assert record["status"] == "ran" and record["steps"] == 3
    for key in ("mlm_acc", "sop_acc", "nsp_acc", "sop_probe", "nsp_probe"):
        assert 0.0 <= record[key] <= 1.0, key
    assert record["sop_examples"] > 0 and record["nsp_probe_detail"]["test_examples"] > 0
    assert math.isfinite(record["mlm_loss"]) and math.isfinite(record["final_loss"])
    # Figure 1 of the cell: both layers' transitions, and how much they change from one to the next
    assert [row["layer"] for row in record["layers"]] == [1, 2] and record["layers"][0]["l2"] > 0
    assert record["l2_roughness"] == pytest.approx(transition_roughness(record["layers"])["l2_roughness"])
    # the training curve, one point per logged step, as the run's metrics.jsonl has it
    train = [r for r in read_metrics(run_outputs["run_dir"]) if r.get("kind") == "train"]
    assert [point[0] for point in record["curve"]] == [1, 2, 3] == [r["step"] for r in train]
    assert record["curve"][-1][1] == pytest.approx(train[-1]["mlm_acc"], abs=1e-5)
    # and the held-out evaluations: here only the final one, the cell's own numbers
    assert record["evals"] == [[3, *(pytest.approx(record[k], abs=1e-5) for k in ("mlm_acc", "sop_acc", "nsp_acc"))]]


@pytest.mark.ray
def test_a_cell_runs_exactly_one_heldout_evaluation_and_its_table_shows_that_one(run_outputs):
    evals = [r for r in read_metrics(run_outputs["run_dir"]) if r["kind"] == "eval"]
    assert len(evals) == 1 and evals[0]["step"] == 3  # the coordinator's, of the final checkpoint
    assert run_outputs["runner_evaluations"] == 0  # the runner did not evaluate it again
    record = run_outputs["record"]
    assert record["heldout_eval"] == "coordinator" and evals[0]["checkpoint"] == record["checkpoint"]
    (row,) = csv.DictReader((run_outputs["spec"].directory / RESULTS_CSV).open())
    for key in ("mlm_acc", "mlm_loss", "sop_acc", "nsp_acc", "mlm_tokens", "sop_examples", "nsp_examples"):
        assert record[key] == evals[0][key], key
    for key in ("mlm_acc", "mlm_loss", "sop_acc", "nsp_acc"):
        assert float(row[key]) == evals[0][key], key


@pytest.mark.ray
def test_the_cell_trains_on_shards_preprocessed_with_its_objective(run_outputs):
    manifest = json.loads((Path(run_outputs["record"]["shards"]) / "manifest.json").read_text())
    assert manifest["config"]["objective"] == "nsp"
    assert Path(run_outputs["record"]["shards"]).name.startswith("nsp-64-")


@pytest.mark.ray
def test_the_recorded_parameter_count_is_the_cells_model(run_outputs):
    spec = run_outputs["spec"]
    config = cell_config(spec, spec.expand()[0])
    vocab = json.loads((Path(config.data.shards) / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    assert run_outputs["record"]["params"] == count_parameters(config.model_config(vocab))


@pytest.mark.ray
def test_a_finished_cell_is_not_rerun(run_outputs):
    assert [r["status"] for r in run_outputs["second"]] == ["cached"]
    after = {p: p.stat().st_mtime_ns for p in run_outputs["run_dir"].rglob("*") if p.is_file()}
    assert after == run_outputs["snapshot"]  # no file of the run was written or added
    assert run_outputs["second"][0]["mlm_acc"] == run_outputs["record"]["mlm_acc"]


@pytest.mark.ray
def test_the_run_writes_the_results_table(run_outputs):
    directory = run_outputs["spec"].directory
    rows = list(csv.DictReader((directory / RESULTS_CSV).open()))
    assert [r["cell"] for r in rows] == ["objective-nsp"]
    assert float(rows[0]["mlm_acc"]) == pytest.approx(run_outputs["record"]["mlm_acc"])
    assert "objective-nsp" in (directory / RESULTS_MD).read_text()


@pytest.mark.ray
def test_the_report_of_a_real_cell_has_its_table_curves_and_layer_transitions(run_outputs, tmp_path):
    from services.experiments.report import write_report

    out = write_report([run_outputs["spec"]], tmp_path / "r.md", title="E2E", command="albert experiment report")
    text = out.read_text()
    assert "| objective-nsp | 1 | " in text  # one group, one run (the spec has no seeds)
    for png in ("e2e-curves.png", "e2e-layers.png"):
        assert f"(r/{png})" in text and (tmp_path / "r" / png).stat().st_size > 1000


@pytest.mark.ray
def test_analyze_layers_reads_our_checkpoint_on_its_heldout_documents(run_outputs, tmp_path):
    record = run_outputs["record"]
    heldout = Path(record["shards"]) / "heldout" / "documents.parquet"
    out = analyze_layers([record["checkpoint"]], heldout, tmp_path / "fig", max_seq_length=64)
    assert [r["layer"] for r in out["rows"]] == [1, 2]
    assert out["rows"][0]["label"] == "e2e-objective-nsp@3"
    assert all(r["l2"] > 0 and -1 <= r["cosine"] <= 1 for r in out["rows"])


# --- CLI -----------------------------------------------------------------------------------------------------


def test_register_adds_analyze_layers_and_experiment_run_to_a_parser():
    import argparse

    from services.experiments import cli as experiment

    parser = argparse.ArgumentParser(prog="albert")
    experiment.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["analyze", "layers", "a", "b", "--heldout", "h.parquet", "--output", "fig", "--label", "x"]
    )
    assert (args.func, args.checkpoints, args.label) == (experiment.cmd_analyze_layers, ["a", "b"], ["x"])
    args = parser.parse_args(["experiment", "run", "spec.toml", "--only", "objective-sop", "--dry-run"])
    assert (args.func, args.only, args.dry_run) == (experiment.cmd_experiment_run, ["objective-sop"], True)


@pytest.mark.ray
def test_analyze_layers_reads_text_with_the_given_spiece_model_for_a_checkpoint_without_one(run_outputs, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(TEXTS[:6]) + "\n")
    record = run_outputs["record"]
    bare = tmp_path / "bare"  # the model files only: a checkpoint that carries no tokenizer (a run's checkpoints do)
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(Path(record["checkpoint"]) / name, bare / name)
    with pytest.raises(ValueError, match="no tokenizer for the text input"):
        analyze_layers([str(bare)], text, tmp_path / "fig")
    tokenizer = run_outputs["spec"].preprocess.tokenizer
    out = analyze_layers([str(bare)], text, tmp_path / "fig", tokenizer=tokenizer, max_seq_length=64)
    assert [r["layer"] for r in out["rows"]] == [1, 2]
    assert out["rows"][0]["tokens"] > 6 * 2  # six paragraphs of several pieces each, plus [CLS] and [SEP]
