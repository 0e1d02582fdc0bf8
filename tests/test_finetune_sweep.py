"""`albert finetune --search`: the grid read and checked before Ray starts, the results table, a sweep of points x
seeds as Ray Tune trials, a by-hand run of its best point, and the resume after a stop (services.finetune.search,
sweep, trials)."""

# ruff: noqa: F811 (the module fixtures sst2 and tok_dir, imported, are test arguments)
from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from services.cli import main
from services.finetune.cli import register
from services.finetune.search import MAX_TRIALS, parse_search
from services.finetune.sweep import PointScores, best_point, write_table
from services.terminal import EXIT_USAGE, UsageError
from tests.ray_clusters import live_actors
from tests.test_finetune_service import sst2, tok_dir  # noqa: F401 (module fixtures)


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def options() -> dict[str, argparse.Action]:
    root = argparse.ArgumentParser(prog="albert")
    register(root.add_subparsers(dest="command", required=True))
    args = root.parse_args(["finetune", "--task", "sst2"])
    return args.options


def grid_of(*specs: str, **given):
    return parse_search(list(specs), options(), given)


# --- the grid, checked before Ray starts ------------------------------------------------------------------------


def test_search_values_take_the_options_types_and_every_combination_is_a_point():
    grid = grid_of("lr=1e-5,2e-5", "batch-size=16,32")
    assert grid.values == {"lr": [1e-5, 2e-5], "batch_size": [16, 32]}
    assert grid.points[:2] == [{"lr": 1e-5, "batch_size": 16}, {"lr": 1e-5, "batch_size": 32}]
    assert len(grid.points) == 4 and grid.trials(5) == 20


def test_a_search_over_an_option_albert_finetune_lacks_is_refused_naming_it():
    with pytest.raises(UsageError, match=r"--search learning_rate=1e-5: albert finetune has no option --learning-rate"):
        grid_of("learning_rate=1e-5")


def test_a_search_over_an_option_that_is_not_a_setting_of_one_run_is_refused():
    with pytest.raises(UsageError, match=r"--seed is not a setting of one run; --search takes lr, batch-size"):
        grid_of("seed=1,2")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("lr=", "the list of --lr values is empty"),
        ("lr=1e-5,,2e-5", "an empty value in the list"),
        ("lr", r"expected FIELD=V1,V2,\.\.\."),
        ("lr=1e-5,1e-5", "a value is listed twice"),
    ],
)
def test_an_empty_or_malformed_list_is_refused_in_one_line(spec, expected):
    with pytest.raises(UsageError, match=expected):
        grid_of(spec)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("batch_size=16,16.5", r"'16.5' is not an integer \(--batch-size takes an integer\)"),
        ("lr=fast", r"'fast' is not a number"),
        ("optimizer=adamw,sgd", r"'sgd' is not one of adamw, lamb"),
    ],
)
def test_values_of_the_wrong_type_are_refused_naming_the_value(spec, expected):
    with pytest.raises(UsageError, match=expected):
        grid_of(spec)


def test_a_field_both_searched_and_given_on_its_own_is_refused():
    with pytest.raises(UsageError, match="--lr is also given on its own"):
        grid_of("lr=1e-5,2e-5", lr=3e-5)


SHORT = ("--max-steps", "4", "--eval-every", "2")


def finetune_argv(tok: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """A few steps of albert-tiny on the module's SST-2 data (`extra`: what the test searches or sets)."""
    return [
        *("finetune", "--task", "sst2", "--data", str(data), "--preset", "albert-tiny", "--tokenizer", str(tok)),
        *("--max-seq-length", "32", "--batch-size", "8", "--no-progress", "--output", str(out), *extra),
    ]


def test_more_trials_than_the_cap_are_refused_saying_how_many(tmp_path, capsys):
    values = ",".join(str(n) for n in range(1, 102))
    status = main(["finetune", "--task", "sst2", "--search", f"max-steps={values}", "--seeds", "5"])
    assert status == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"101 max_steps values x 5 seeds = 505 trials, more than the cap of {MAX_TRIALS}" in err


def test_an_out_of_range_value_is_refused_naming_its_point_before_ray_starts(tmp_path, tok_dir, sst2, capsys):  # noqa: F811
    out = tmp_path / "out"
    status = main(finetune_argv(tok_dir, sst2, out, "--search", "lr=1e-3,0", *SHORT))
    assert status == EXIT_USAGE
    assert "--search point lr=0.0: TaskHyperparams.lr: expected > 0" in capsys.readouterr().err
    assert not (out / "tune").exists()


# --- the table --------------------------------------------------------------------------------------------------


def rows() -> list[PointScores]:
    return [
        PointScores(0, {"lr": 1e-5}, [1, 2, 3], [0.60, 0.70, 0.65]),
        PointScores(1, {"lr": 2e-5}, [1, 2, 3], [0.50, 0.90, 0.72]),
        PointScores(2, {"lr": 3e-5}, [1, 2, 3], [0.95, None, 0.95]),  # a seed stopped early
    ]


def test_the_best_point_has_the_highest_median_over_the_seeds_that_finished():
    table = rows()
    assert table[1].median == pytest.approx(0.72) and table[1].iqr == pytest.approx(0.20)
    assert table[2].median == pytest.approx(0.95) and table[2].iqr == 0.0  # over its 2 finished seeds
    assert best_point(table) is table[2]
    assert best_point(table[:2]) is table[1]
    stopped = PointScores(3, {"lr": 1e-5}, [1, 2, 3], [None, None, None])
    assert stopped.median is None and best_point([stopped, table[0]]) is table[0]
    with pytest.raises(RuntimeError, match="no run finished"):
        best_point([stopped])


def test_the_table_gives_each_points_median_iqr_and_seeds_and_marks_the_best(tmp_path):
    table = rows()
    write_table(table, table[1], "sst2", "acc", tmp_path)
    with open(tmp_path / "results.csv") as f:
        written = list(csv.DictReader(f))
    assert [r["best"] for r in written] == ["", "best", ""]
    assert float(written[1]["median_acc"]) == pytest.approx(0.72)
    assert float(written[1]["iqr_acc"]) == pytest.approx(0.20)
    assert [written[0][f"seed_{s}"] for s in (1, 2, 3)] == ["0.6", "0.7", "0.65"]
    assert written[2]["seed_2"] == "" and float(written[2]["median_acc"]) == pytest.approx(0.95)
    markdown = (tmp_path / "results.md").read_text()
    assert "| **1** (best) | **2e-05** | **72.00** | **20.00** | **50.00** | **90.00** | **72.00** |" in markdown
    assert "| 2 | 3e-05 | 95.00 (2 of 3) | 0.00 | 95.00 | stopped | 95.00 |" in markdown


# --- a sweep on Ray Tune ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep(ray_local, tmp_path_factory, tok_dir, sst2):  # noqa: F811
    out = tmp_path_factory.mktemp("sweep") / "out"
    status = main(finetune_argv(tok_dir, sst2, out, "--search", "lr=1e-3,3e-3", "--seeds", "2", "--ensemble", *SHORT))
    assert status == 0
    with open(out / "results.csv") as f:
        return out, list(csv.DictReader(f))


def test_a_sweep_writes_a_row_per_point_with_every_seed_and_marks_the_best(sweep):
    out, table = sweep
    assert [(r["point"], r["lr"]) for r in table] == [("0", "0.001"), ("1", "0.003")]
    best = max(table, key=lambda r: (float(r["median_acc"]), -int(r["point"])))
    assert [r["best"] for r in table] == ["best" if r is best else "" for r in table]
    for row in table:
        for seed in (12345, 12346):
            result = json.loads(
                (out / "points" / f"point_0{row['point']}" / f"seed_{seed}" / "result.json").read_text()
            )
            assert float(row[f"seed_{seed}"]) == result["dev"]["acc"] and result["hyperparams"]["lr"] == float(
                row["lr"]
            )


def test_the_best_points_summary_and_ensemble_are_written_as_albert_finetune_writes_them(sweep):
    out, table = sweep
    (best,) = [r for r in table if r["best"]]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["point"] == {"lr": float(best["lr"])} and summary["seeds"] == [12345, 12346]
    assert summary["median"]["acc"] == pytest.approx(float(best["median_acc"]))
    assert summary["ensemble"]["runs"] == 2 and (out / "ensemble" / "SST-2.tsv").is_file()


def test_a_by_hand_run_of_the_best_point_gives_the_sweeps_scores(sweep, tmp_path, tok_dir, sst2):  # noqa: F811
    _, table = sweep
    (best,) = [r for r in table if r["best"]]
    by_hand = tmp_path / "by-hand"
    assert main(finetune_argv(tok_dir, sst2, by_hand, "--lr", best["lr"], "--seeds", "2", *SHORT)) == 0
    summary = json.loads((by_hand / "summary.json").read_text())
    assert [row["acc"] for row in summary["per_seed"]] == [float(best["seed_12345"]), float(best["seed_12346"])]


def test_a_stopped_sweep_resumes_finishing_only_its_unfinished_runs(ray_local, tmp_path, tok_dir, sst2, capsys):  # noqa: F811
    out = tmp_path / "out"
    argv = finetune_argv(tok_dir, sst2, out, "--search", "max-steps=2,200", "--eval-every", "20", "--seeds", "1")
    quick = out / "points" / "point_00" / "seed_12345" / "result.json"
    slow_log = out / "points" / "point_01" / "seed_12345" / "metrics.jsonl"

    def interrupt_when_the_quick_point_is_done_and_the_slow_one_half_way():
        deadline = time.time() + 120
        while not (quick.is_file() and slow_log.is_file() and slow_log.read_text()) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # Tune records the quick trial as finished
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_when_the_quick_point_is_done_and_the_slow_one_half_way, daemon=True).start()
        assert main(argv) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "1 of 2 runs finished" in capsys.readouterr().out
    started = json.loads(quick.read_text())["started"]
    assert main(argv) == 0
    assert "resumed: 1 of 2 runs reused from the earlier start, 1 run now" in capsys.readouterr().out
    assert json.loads(quick.read_text())["started"] == started  # not run again
    with open(out / "results.csv") as f:
        assert all(r["seed_12345"] for r in csv.DictReader(f))


def test_a_plain_run_again_reuses_its_runs_and_with_other_settings_starts_afresh(ray_local, tmp_path, tok_dir, sst2,  # noqa: F811
                                                                                  capsys):  # fmt: skip
    out = tmp_path / "out"
    results = [out / f"seed_{seed}" / "result.json" for seed in (12345, 12346)]

    def run(lr: str) -> list[dict]:
        assert main(finetune_argv(tok_dir, sst2, out, "--lr", lr, "--seeds", "2", *SHORT)) == 0
        return [json.loads(path.read_text()) for path in results]

    first = run("1e-3")
    capsys.readouterr()
    again = run("1e-3")
    assert "resumed: 2 of 2 runs reused from the earlier start, 0 run now" in capsys.readouterr().out
    assert [r["started"] for r in again] == [r["started"] for r in first]
    other = run("3e-3")
    assert "resumed:" not in capsys.readouterr().out
    assert all(
        o["started"] > f["started"] and o["hyperparams"]["lr"] == 3e-3 for o, f in zip(other, first, strict=True)
    )
    summary = json.loads((out / "summary.json").read_text())
    assert [row["acc"] for row in summary["per_seed"]] == [r["dev"]["acc"] for r in other]


def test_a_run_whose_process_dies_runs_again_from_its_start_in_the_same_command(ray_local, tmp_path, tok_dir, sst2):
    """As when the node running it is lost: the trial processes are SIGKILLed while a run is half way; Tune runs the
    runs in flight again (its FailureConfig), and the command ends with every run's result."""
    out = tmp_path / "out"
    argv = finetune_argv(tok_dir, sst2, out, "--search", "max-steps=60,61", "--eval-every", "10", "--seeds", "1")
    runs = [out / "points" / f"point_0{i}" / "seed_12345" for i in (0, 1)]
    killed: list[tuple[float, list[int], list[int]]] = []

    def in_flight() -> list[int]:  # the runs that have logged an evaluation and not finished
        def going(run: Path) -> bool:
            log = run / "metrics.jsonl"
            return log.is_file() and bool(log.read_text()) and not (run / "result.json").is_file()

        return [i for i, run in enumerate(runs) if going(run)]

    def kill_the_trials_half_way():
        deadline = time.time() + 120
        while not in_flight() and time.time() < deadline:
            time.sleep(0.02)
        going, pids = in_flight(), [a["Pid"] for a in live_actors("ImplicitFunc")]  # Tune's trials
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        killed.append((time.time(), pids, going))

    threading.Thread(target=kill_the_trials_half_way, daemon=True).start()
    assert main(argv) == 0
    ((when, pids, going),) = killed
    assert pids and going, "no run was in flight to kill"
    for point, run in enumerate(runs):
        result = json.loads((run / "result.json").read_text())
        assert result["steps"] == 60 + point  # every run to its end
        if point in going:
            assert result["started"] > when  # run again, from its start


def test_resuming_into_a_folder_of_another_sweep_is_refused(sweep, tok_dir, sst2, capsys):  # noqa: F811
    out, _ = sweep
    status = main(finetune_argv(tok_dir, sst2, out, "--search", "lr=1e-3,2e-3", "--seeds", "2", "--ensemble", *SHORT))
    assert status == EXIT_USAGE
    assert "holds another sweep" in capsys.readouterr().err


def test_early_stop_asha_stops_on_the_dev_metric_at_the_evaluation_steps(tmp_path, tok_dir):  # noqa: F811
    from ray.tune.schedulers import ASHAScheduler

    from services.finetune.seeds import seed_configs
    from services.finetune.trials import SCORE, _scheduler, asha_steps
    from tests.test_finetune_service import overrides_for

    quick = overrides_for(tok_dir, train_steps=10, warmup_steps=1, eval_every=3)  # evaluations at 3, 6, 9, 10
    configs = seed_configs("sst2", None, str(tmp_path), seeds=[1], overrides=quick)
    configs += seed_configs("sst2", None, str(tmp_path), seeds=[1], overrides=overrides_for(tok_dir, max_steps=20))
    assert asha_steps(configs) == (3, 20)  # the first evaluation of any run; the longest run's last step
    asha = _scheduler("asha", configs)
    assert isinstance(asha, ASHAScheduler) and (asha._time_attr, asha._metric) == ("step", SCORE)
    assert _scheduler(None, configs) is None


def test_early_stop_without_a_search_is_refused(capsys):
    assert main(["finetune", "--task", "sst2", "--early-stop", "asha"]) == EXIT_USAGE
    assert "--early-stop stops points of a sweep; it needs --search" in capsys.readouterr().err


def test_a_sweep_with_asha_stops_runs_and_takes_the_best_median_over_the_seeds_that_finished(  # noqa: F811
    ray_local,
    tmp_path,
    tok_dir,
    sst2,
    capsys,  # noqa: F811
):
    """ASHA stops runs, not points, so the medians are over the seeds that finished; and the runs it lets go on
    finish with their results (it used to stop every run at its last evaluation, before the run wrote its result:
    "no point finished all its seeds"). Whether it stops any run here depends on ties at chance level; the
    scheduler's decisions are checked above."""
    out = tmp_path / "out"
    argv = finetune_argv(tok_dir, sst2, out, "--search", "lr=1e-4,1e-3,3e-3,1e-2", "--early-stop", "asha")
    assert main([*argv, "--seeds", "2", "--ensemble", "--max-steps", "12", "--eval-every", "3"]) == 0
    with open(out / "results.csv") as f:
        table = list(csv.DictReader(f))
    cells = {(int(r["point"]), seed): r[f"seed_{seed}"] for r in table for seed in (12345, 12346)}
    stopped = {key for key, cell in cells.items() if not cell}
    assert len(stopped) < len(cells), cells  # runs finished
    for (point, seed), cell in cells.items():
        result = out / "points" / f"point_{point:02d}" / f"seed_{seed}" / "result.json"
        assert result.is_file() == bool(cell)
    for row in table:
        finished = [float(row[f"seed_{s}"]) for s in (12345, 12346) if row[f"seed_{s}"]]
        assert row["median_acc"] == ("" if not finished else repr(float(np.median(finished))))
    (best,) = [r for r in table if r["best"]]
    assert float(best["median_acc"]) == max(float(r["median_acc"]) for r in table if r["median_acc"])
    summary = json.loads((out / "summary.json").read_text())
    finished_seeds = [s for s in (12345, 12346) if best[f"seed_{s}"]]
    assert summary["seeds"] == finished_seeds and summary["ensemble"]["runs"] == len(finished_seeds)
    if len(finished_seeds) < 2:
        assert "--early-stop stopped 1 of its 2 seeds" in capsys.readouterr().out
