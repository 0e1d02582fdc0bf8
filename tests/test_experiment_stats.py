"""Seeds, statistics, claims and the report of experiment specs (services.experiments.stats, experiment_report),
checked against scipy's t-tests and hand-computed values, on markers written as run_cell writes them."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from albert_core.evaluation.analysis import transition_roughness
from albert_core.files import atomic_write_bytes
from albert_core.model.config import ConfigError
from services.experiments.cells import cell_fingerprint, collect_results, marker_path
from services.experiments.report import write_report
from services.experiments.spec import ExperimentSpec, cell_config
from services.experiments.stats import (
    REPRODUCED,
    REVERSED,
    TOO_FEW,
    UNRESOLVED,
    Estimate,
    difference,
    group_results,
    judge,
    summary_markdown,
)
from tests.test_experiment import RECIPE

SHARING = {"model.overrides.sharing": ["all", "none"]}
CLAIMS = [
    {"text": "not-shared beats all-shared", "paper": "82.3 vs 79.8", "metric": "mlm_acc",
     "higher": "sharing-none", "lower": "sharing-all"},
    {"text": "all-shared above chance", "metric": "sop_acc", "higher": "sharing-all", "lower": 0.5},
]  # fmt: skip


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "recipe.toml"
    path.write_text(RECIPE)
    return path


def spec_of(recipe, tmp_path, seeds=(1, 2, 3), **tables) -> ExperimentSpec:
    head = {"name": "exp", "recipe": str(recipe), "output_dir": str(tmp_path / "out"), "seeds": list(seeds)}
    return ExperimentSpec.from_dict({"experiment": head, "grid": SHARING, **tables}, source="spec.toml")


def finish(spec, cell, **result) -> None:
    curve = [[step, 0.1 + step / 1000, 0.5] for step in range(10, 110, 10)]
    record = {"cell": cell.name, "values": cell.values, "train_s": 100.0, "eval_s": 20.0, "curve": curve, **result}
    marker = {"version": 1, "fingerprint": cell_fingerprint(spec, cell), "result": record}
    atomic_write_bytes(marker_path(spec, cell), json.dumps(marker).encode())


# --- seeds --------------------------------------------------------------------------------------------------


def test_each_group_runs_once_per_seed_seed_slowest_with_run_seed_set(recipe, tmp_path):
    spec = spec_of(recipe, tmp_path, seeds=(7, 8))
    cells = spec.expand()
    assert [c.name for c in cells] == ["sharing-all_seed-7", "sharing-none_seed-7", "sharing-all_seed-8",
                                       "sharing-none_seed-8"]  # fmt: skip
    assert [c.group for c in cells] == ["sharing-all", "sharing-none"] * 2
    assert [cell_config(spec, c).run.seed for c in cells] == [7, 7, 8, 8]
    assert cell_config(spec, cells[3]).run.name == "exp-sharing-none_seed-8"


def test_without_seeds_the_cells_are_the_groups_and_keep_the_recipes_seed(recipe, tmp_path):
    spec = spec_of(recipe, tmp_path, seeds=())
    assert [(c.name, c.group) for c in spec.expand()] == [
        ("sharing-all", "sharing-all"),
        ("sharing-none", "sharing-none"),
    ]
    assert cell_config(spec, spec.expand()[0]).run.seed == 7  # the recipe's


def test_a_stacked_cell_starts_from_its_own_seeds_source(recipe, tmp_path):
    cells = [
        {"name": "shallow", "model.overrides.num_hidden_layers": 1},
        {"name": "deep", "model.init_from": "cell:shallow"},
    ]
    head = {"name": "exp", "recipe": str(recipe), "output_dir": str(tmp_path / "out"), "seeds": [1, 2]}
    spec = ExperimentSpec.from_dict({"experiment": head, "cells": cells}, source="spec.toml")
    deep_2 = next(c for c in spec.expand() if c.name == "deep_seed-2")
    assert "exp-shallow_seed-2" in cell_config(spec, deep_2).model.init_from


@pytest.mark.parametrize(
    "head, tables, message",
    [
        ({"seeds": [1, 1]}, {}, r"experiment\.seeds: the seeds must differ"),
        ({"seeds": ["1"]}, {}, r"experiment\.seeds: expected a list of integers"),
        ({"reference": "sharing-ffn"}, {}, r"experiment\.reference: no cell named 'sharing-ffn'"),
        ({}, {"claims": [{**CLAIMS[0], "lower": "sharing-x"}]}, r"claims\[0\]: no cell named 'sharing-x'"),
        ({}, {"claims": [{**CLAIMS[0], "metric": "glue"}]}, r"claims\[0\]\.metric: expected one of mlm_acc"),
        ({}, {"claims": [{**CLAIMS[0], "side": 1}]}, r"claims\[0\]\.side: unknown field"),
    ],
)
def test_bad_seeds_references_and_claims_are_refused_naming_the_field(recipe, tmp_path, head, tables, message):
    data = {"experiment": {"name": "exp", "recipe": str(recipe), **head}, "grid": SHARING, **tables}
    with pytest.raises(ConfigError, match=message):
        ExperimentSpec.from_dict(data, source="spec.toml")


# --- statistics, against scipy -----------------------------------------------------------------------------


def test_an_estimate_is_the_mean_and_the_standard_error_of_the_seeds():
    values = [0.25, 0.27, 0.22, 0.26]
    est = Estimate.of(values)
    assert est.n == 4 and est.mean == pytest.approx(np.mean(values))
    assert est.se == pytest.approx(stats.sem(values))
    assert Estimate.of([0.3]).se is None


def test_the_difference_of_two_groups_is_welchs_interval():
    a, b = [0.25, 0.27, 0.22, 0.26], [0.20, 0.24, 0.21]
    diff = difference(Estimate.of(a), Estimate.of(b))
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert diff.delta == pytest.approx(np.mean(a) - np.mean(b))
    assert (diff.low, diff.high) == (pytest.approx(ci.low), pytest.approx(ci.high))


def test_the_difference_to_a_number_is_the_one_sample_interval():
    a = [0.55, 0.61, 0.58]
    diff = difference(Estimate.of(a), 0.5)
    ci = stats.ttest_1samp(a, 0.5).confidence_interval(0.95)  # an interval for the mean itself
    assert (diff.low + 0.5, diff.high + 0.5) == (pytest.approx(ci.low), pytest.approx(ci.high))


@pytest.mark.parametrize(
    "a, b, verdict",
    [
        ([0.30, 0.31, 0.32], [0.20, 0.21, 0.22], REPRODUCED),
        ([0.20, 0.21, 0.22], [0.30, 0.31, 0.32], REVERSED),
        ([0.20, 0.30, 0.25], [0.22, 0.28, 0.24], UNRESOLVED),
        ([0.30], [0.20, 0.21, 0.22], TOO_FEW),
    ],
)
def test_the_verdict_follows_the_side_of_zero_the_interval_lies_on(a, b, verdict):
    assert difference(Estimate.of(a), Estimate.of(b)).verdict == verdict


# --- Figure 1 roughness -------------------------------------------------------------------------------------


def test_roughness_is_the_mean_change_between_consecutive_layers():
    rows = [{"l2": 2.0, "cosine": 0.9}, {"l2": 4.0, "cosine": 0.5}, {"l2": 3.0, "cosine": 0.8}]
    out = transition_roughness(rows)
    assert out["l2_roughness"] == pytest.approx(((2 + 1) / 2) / 3.0)  # mean |change| 1.5 over mean L2 3
    assert out["cosine_roughness"] == pytest.approx((0.4 + 0.3) / 2)
    assert transition_roughness([{"l2": 1.0, "cosine": 0.5}] * 4) == {"l2_roughness": 0.0, "cosine_roughness": 0.0}
    with pytest.raises(ValueError, match="at least two layers"):
        transition_roughness(rows[:1])


# --- tables, claims and the report --------------------------------------------------------------------------


def spec_with_reference(recipe, tmp_path):
    head = {"name": "exp", "recipe": str(recipe), "output_dir": str(tmp_path / "out"), "seeds": [1, 2, 3],
            "reference": "sharing-all", "description": "two groups"}  # fmt: skip
    return ExperimentSpec.from_dict({"experiment": head, "grid": SHARING, "claims": CLAIMS}, source="spec.toml")


def test_results_are_grouped_by_cell_without_seed_in_spec_order(recipe, tmp_path):
    spec = spec_with_reference(recipe, tmp_path)
    for cell in spec.expand()[:-1]:
        finish(spec, cell, mlm_acc=0.1)
    groups = group_results(spec, [json.loads(marker_path(spec, c).read_text())["result"] for c in spec.expand()[:-1]])
    assert {g: len(rs) for g, rs in groups.items()} == {"sharing-all": 3, "sharing-none": 2}


def test_the_report_decides_each_claim_on_the_finished_seeds(recipe, tmp_path):
    spec = spec_with_reference(recipe, tmp_path)
    acc = {"sharing-all": [0.20, 0.21, 0.22], "sharing-none": [0.30, 0.31, 0.32]}
    for cell in spec.expand()[:-1]:  # the last seed of sharing-none has not finished
        finish(spec, cell, mlm_acc=acc[cell.group][cell.values["run.seed"] - 1], sop_acc=0.5)
    results = [json.loads(marker_path(spec, c).read_text())["result"] for c in spec.expand()[:-1]]
    first, second = judge(spec, group_results(spec, results))
    expected = stats.ttest_ind([0.30, 0.31], [0.20, 0.21, 0.22], equal_var=False).confidence_interval(0.95)
    assert first.text == REPRODUCED and first.difference.low == pytest.approx(expected.low)
    assert second.text == UNRESOLVED and second.difference.low == second.difference.high == 0.0  # no spread at 0.5
    table = summary_markdown(spec, results, ("mlm_acc", "sop_acc"))
    assert "| sharing-all | 3 | 21.0 ± 0.6 | 50.0 ± 0.0 |  |  |" in table
    assert "| sharing-none | 2 | 30.5 ± 0.5 | 50.0 ± 0.0 | +9.5 [" in table

    out = write_report([spec], tmp_path / "reports" / "small.md", title="Small", command="albert experiment report")
    text = out.read_text()
    assert "(5 of 6)" in text and "| exp | 5 of 6 | 0.17 | 0.20 |" in text  # 5 cells x 120 s, 6 planned
    assert "| exp | not-shared beats all-shared (82.3 vs 79.8) | mlm_acc +9.5 [" in text
    assert f"| {REPRODUCED} |" in text and "no cell has finished" not in text
    rows = list(csv.DictReader((tmp_path / "reports" / "small" / "exp.csv").open()))
    assert len(rows) == 5 and math.isclose(float(rows[0]["mlm_acc"]), 0.20)
    assert "![training curves of exp](small/exp-curves.png)" in text
    assert (tmp_path / "reports" / "small" / "exp-curves.png").stat().st_size > 1000
    assert "layer transitions" not in text  # no cell measured them


def test_the_summary_shows_the_steps_trained_only_when_cells_differ_in_them(recipe, tmp_path):
    spec = spec_with_reference(recipe, tmp_path)
    cells = spec.expand()
    steps = {"sharing-all": [500, 510, 520], "sharing-none": [1000, 1000, 1000]}  # e.g. a wall-clock budget
    results = [
        {"cell": c.name, "values": c.values, "mlm_acc": 0.2, "steps": steps[c.group][c.values["run.seed"] - 1]}
        for c in cells
    ]
    table = summary_markdown(spec, results, ("mlm_acc",))
    assert table.splitlines()[0].startswith("| group | seeds | steps | mlm_acc |")
    assert "| sharing-all | 3 | 510 ± 6 | 20.0 ± 0.0 |" in table and "| sharing-none | 3 | 1000 ± 0 |" in table
    same = [{**r, "steps": 1000} for r in results]
    assert "steps" not in summary_markdown(spec, same, ("mlm_acc",))


def test_markers_go_to_cells_dir_when_the_spec_names_one(recipe, tmp_path):
    head = {"name": "exp", "recipe": str(recipe), "output_dir": str(tmp_path / "out")}
    head["cells_dir"] = str(tmp_path / "kept")
    spec = ExperimentSpec.from_dict({"experiment": head, "grid": SHARING}, source="spec.toml")
    assert marker_path(spec, spec.expand()[0]) == tmp_path / "kept" / "sharing-all.json"
    assert cell_config(spec, spec.expand()[0]).run_dir.is_relative_to(tmp_path / "out")  # the runs stay there


def test_the_time_of_a_spec_with_no_finished_cell_is_estimated_per_step_and_layer(recipe, tmp_path):
    from services.experiments.report import time_rows

    done = spec_with_reference(recipe, tmp_path)  # 3 steps x 2 layers a cell
    for cell in done.expand():
        finish(done, cell, mlm_acc=0.1)  # 120 s each
    head = {"name": "deep", "recipe": str(recipe), "output_dir": str(tmp_path / "out"), "seeds": [1]}
    deep = ExperimentSpec.from_dict(
        {"experiment": head, "set": {"optim.total_steps": 6, "model.overrides.num_hidden_layers": 4}, "grid": SHARING},
        source="deep.toml",
    )
    rows = time_rows([done, deep], {spec.name: collect_results(spec) for spec in (done, deep)})
    assert "| exp | 6 of 6 | 0.20 | 0.20 |" in rows
    assert "| deep | 0 of 2 | 0.00 | 0.27 (estimated) |" in rows  # 4x the work of a cell: 2 x 480 s
    assert rows[-1] == "| all | | 0.20 | 0.47 |"


def test_a_claim_whose_cells_have_not_finished_is_pending(recipe, tmp_path):
    spec = spec_with_reference(recipe, tmp_path)
    (verdict, _) = judge(spec, {})
    assert verdict.text == "pending (cells not finished)"


# --- the shipped specs ----------------------------------------------------------------------------------------

SPECS = sorted((Path(__file__).resolve().parents[1] / "configs" / "experiments").glob("*.toml"))


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_every_shipped_spec_builds_a_valid_run_for_each_cell_and_its_committed_cells_are_current(path, monkeypatch):
    monkeypatch.chdir(path.parents[2])  # specs name recipes and cells_dir relative to the repository
    spec = ExperimentSpec.load(path)
    spec.validate()
    cells = spec.expand()
    for cell in cells:
        cell_config(spec, cell).validate()
    fingerprints = {cell_fingerprint(spec, cell): cell.name for cell in cells}
    for marker in sorted(spec.markers.glob("*.json")) if spec.cells_dir else []:  # what reports/ was made from
        saved = json.loads(marker.read_text())
        assert fingerprints.get(saved["fingerprint"]) == marker.stem, f"{marker}: made by another version of the spec"
