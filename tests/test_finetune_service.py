"""services.finetune.seeds: seeds as parallel Ray Tune trials, the median summary, ensembles, `albert finetune`."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from albert_core.finetune.config import FinetuneConfig
from services.finetune.cli import register
from services.finetune.seeds import default_seeds, downstream_evaluator, run_downstream, seed_configs, seed_list
from tests.test_finetuning import keyword_rows, tiny, write_sst2

QUICK = {"lr": 1e-3, "batch_size": 16, "train_steps": 4, "warmup_steps": 1, "max_seq_length": 32}


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def ray_session(request):
    """The shared session fixture `ray_local` of tests/conftest.py; skip (not fail) where it does not exist."""
    try:
        request.getfixturevalue("ray_local")
    except pytest.FixtureLookupError:
        pytest.skip("tests/conftest.py provides no ray_local fixture")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    from albert_core.text.tokenization import TokenizerTrainConfig, train_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    texts = [s for s, _ in keyword_rows(300, 0)] + ["excellent excellent"] * 20
    texts += (Path(__file__).parent / "fixtures" / "tokenizer_corpus.txt").read_text().splitlines()
    train_tokenizer(texts, out, TokenizerTrainConfig(vocab_size=200))
    return out


@pytest.fixture(scope="module")
def sst2(tmp_path_factory) -> Path:
    return write_sst2(tmp_path_factory.mktemp("glue"), n_train=200, n_dev=40)


def overrides_for(tok_dir: Path, **extra) -> dict:
    from albert_core.text.tokenization import Tokenizer

    model = tiny(Tokenizer.load(tok_dir).vocab_size).to_dict()
    return {**QUICK, "tokenizer": str(tok_dir), "model": model, "eval_every": 0, **extra}


# --- module ---------------------------------------------------------------------------------------------


def test_task_names_are_those_of_albert_core():
    from albert_core.finetune.config import TASKS as CORE_TASKS
    from services.finetune.seeds import TASKS

    assert TASKS == CORE_TASKS


def test_building_the_cli_parser_imports_neither_torch_nor_ray():
    code = (
        "import argparse, sys; from services.finetune.cli import register; "
        "register(argparse.ArgumentParser().add_subparsers()); print('torch' in sys.modules, 'ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# --- configs -----------------------------------------------------------------------------------------------


def test_glue_tasks_default_to_five_seeds_and_the_others_to_one():
    assert default_seeds("SST-2") == default_seeds("mnli") == 5
    assert default_seeds("squad2") == default_seeds("race") == 1


def test_a_seed_count_becomes_consecutive_seeds_and_duplicates_are_refused():
    assert seed_list(3) == [12345, 12346, 12347]
    with pytest.raises(ValueError, match="distinct"):
        seed_list([1, 1])


def test_overrides_are_split_into_hyperparameters_and_config_fields(tmp_path, tok_dir):
    configs = seed_configs(
        "sst2", None, str(tmp_path), seeds=[7, 8], overrides=overrides_for(tok_dir, patience=2), output_dir=tmp_path
    )
    assert [c.seed for c in configs] == [7, 8]
    assert configs[0].overrides == QUICK and configs[0].patience == 2
    assert configs[1].output_dir == str(tmp_path / "seed_8")
    assert isinstance(configs[0], FinetuneConfig) and configs[0].model.num_hidden_layers == 2


def test_an_unknown_override_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match="'warmup'"):
        seed_configs("sst2", "ckpt", str(tmp_path), seeds=1, overrides={"warmup": 10})


# --- Ray -------------------------------------------------------------------------------------------------


class FreeCpus:
    """Samples the cluster's free CPUs in a thread while a block runs: `least` is the fewest seen."""

    def __init__(self, every_s: float = 0.005):
        import ray

        self.ray, self.every_s, self.stop = ray, every_s, threading.Event()
        self.before = self.least = ray.available_resources().get("CPU", 0.0)

    def _watch(self) -> None:
        while not self.stop.is_set():
            self.least = min(self.least, self.ray.available_resources().get("CPU", 0.0))
            time.sleep(self.every_s)

    def __enter__(self) -> FreeCpus:
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


@pytest.fixture(scope="module")
def two_seeds(ray_session, tmp_path_factory, tok_dir, sst2):
    out = tmp_path_factory.mktemp("runs")
    overrides = overrides_for(tok_dir, train_steps=150, warmup_steps=15, eval_every=50)
    with FreeCpus() as cpus:
        summary = run_downstream(
            "sst2", None, str(sst2), seeds=[1, 2], overrides=overrides, output_dir=out, ensemble=True
        )
    return summary, out, cpus


def test_two_seeds_run_in_parallel_as_ray_tasks(two_seeds):
    # Each seed is a task of one CPU, and both hold theirs at once: however fast the machine runs them, the
    # cluster's free CPUs drop by two while they run (one at a time would drop them by one).
    _, _, cpus = two_seeds
    assert cpus.before >= 2
    assert cpus.least <= cpus.before - 2


def test_seeds_are_summarized_by_the_median_of_their_dev_metrics(two_seeds):
    summary, _, _ = two_seeds
    accs = [r["dev"]["acc"] for r in summary["results"]]
    assert [r["seed"] for r in summary["results"]] == [1, 2]
    assert summary["median"]["acc"] == pytest.approx(float(np.median(accs)))
    assert summary["table"].splitlines()[-1] == f"| **median** | **{100 * np.median(accs):.2f}** |"


def test_each_seed_writes_its_own_run_folder_and_the_summary_is_written(two_seeds):
    summary, out, _ = two_seeds
    for seed in (1, 2):
        records = [json.loads(line) for line in (out / f"seed_{seed}" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [50, 100, 150]
    written = json.loads((out / "summary.json").read_text())
    assert written["median"] == summary["median"]
    assert "| **median** |" in (out / "summary.md").read_text()


def test_the_ensemble_of_the_seeds_is_scored_and_its_predictions_written(two_seeds):
    summary, out, _ = two_seeds
    ensemble = summary["ensemble"]
    assert ensemble["runs"] == 2 and 0.0 <= ensemble["dev"]["acc"] <= 1.0
    assert (out / "ensemble" / "SST-2.tsv").read_text().startswith("index\tprediction\n")
    assert json.loads((out / "summary.json").read_text())["ensemble"]["dev"] == ensemble["dev"]


def test_downstream_evaluator_returns_the_median_metrics_for_the_eval_registry(ray_session, tok_dir, sst2):
    evaluate = downstream_evaluator("sst2", seeds=1, overrides=overrides_for(tok_dir))
    metrics = evaluate(None, str(sst2))  # no checkpoint: the overrides' random-init model
    assert set(metrics) == {"acc", "runs"} and metrics["runs"] == 1
    assert evaluate.__name__ == "finetune_sst2"


# --- CLI ---------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="albert")
    register(root.add_subparsers(dest="command", required=True))
    return root


def test_cli_single_seed_runs_in_process_writes_the_summary_and_prints_its_dev_metrics(tmp_path, tok_dir, sst2, capsys):
    args = parser().parse_args(
        ["finetune", "--task", "sst2", "--data", str(sst2), "--preset", "albert-tiny", "--tokenizer", str(tok_dir)]
        + ["--seeds", "1", "--max-steps", "2", "--max-seq-length", "32", "--batch-size", "4", "--eval-every", "0"]
        + ["--output", str(tmp_path / "cli"), "--seed", "3"]
    )
    assert args.func(args) == 0
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["seeds"] == [3] and summary["runs"] == 1
    assert json.loads((tmp_path / "cli" / "seed_3" / "result.json").read_text())["steps"] == 2
    assert "| **median** |" in (tmp_path / "cli" / "summary.md").read_text()
    printed = capsys.readouterr().out
    assert f"step 2/2  dev acc {summary['median']['acc']:.4f}" in printed  # each dev evaluation, as it happens
    table = printed[printed.index("sst2: dev metrics (x100), 1 run (primary: acc)") :].splitlines()
    assert table[2].split()[:2] == ["3", f"{100 * summary['median']['acc']:.2f}"]
    assert table[3].split() == ["median", f"{100 * summary['median']['acc']:.2f}"]


def test_cli_refuses_to_run_without_a_checkpoint_or_preset(tmp_path, sst2):
    args = parser().parse_args(["finetune", "--task", "sst2", "--data", str(sst2)])
    with pytest.raises(ValueError, match="--checkpoint"):
        args.func(args)


def test_a_preset_naming_a_recipe_is_its_model_with_random_weights_and_its_finetune_defaults():
    from services.finetune.seeds import preset_model
    from services.rundir.config import RunConfig, resolve_config_path

    recipe = RunConfig.load(resolve_config_path("tiny"))
    model, defaults = preset_model("tiny", vocab_size=200)
    assert model == recipe.model_config(200)
    assert (model.hidden_size, model.num_hidden_layers, model.position_bias) == (64, 2, "rotary")
    assert defaults.overrides == {"lr": recipe.finetune.lr, "max_steps": 300, "pooling": "mean"}


def test_the_summary_says_which_model_and_settings_the_random_init_arm_used(tmp_path, tok_dir, sst2, capsys):
    args = parser().parse_args(
        ["finetune", "--task", "sst2", "--data", str(sst2), "--preset", "tiny", "--tokenizer", str(tok_dir)]
        + ["--seeds", "1", "--max-steps", "2", "--max-seq-length", "32", "--batch-size", "4", "--eval-every", "0"]
        + ["--output", str(tmp_path / "cli"), "--no-progress"]
    )
    assert args.func(args) == 0
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["model"] == "model: random init of --preset tiny (H 64, 2 layers, rotary positions)"
    assert summary["settings"].startswith("settings: lr 0.001, batch_size 4, 2 steps")
    assert summary["settings"].endswith("pooling mean")
    printed = capsys.readouterr().out
    assert "fine-tuning defaults of the recipe of" in printed and summary["settings"] in printed
