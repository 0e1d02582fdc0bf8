"""One consistent command line: one evaluation group, --output everywhere, the checkpoint always a --checkpoint,
--no-progress wherever a bar is drawn, --version, a help written for users, and exit statuses that tell a usage
error from bad data (documented in docs/guide.md)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

import services
from services import cli
from services.eval import cli as eval_cli
from services.terminal import EXIT_CODES, EXIT_DATA, EXIT_USAGE

ROOT = Path(__file__).resolve().parents[1]


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


def subcommands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(command path, its parser) for every command and subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name), sub
                yield from subcommands(sub, (*prefix, name))


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


# --- one evaluation group --------------------------------------------------------------------------------------


def test_eval_run_evaluates_a_checkpoint_given_as_checkpoint(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(eval_cli, "cmd_eval_run", lambda args: calls.append(args) or 0)
    args = parse("eval", "run", "--checkpoint", "ckpt", "--heldout", "h.parquet", "--task", "sst2")
    assert args.func is eval_cli.cmd_eval_run and (args.checkpoint, args.heldout, args.task) == (
        "ckpt",
        "h.parquet",
        ["sst2"],
    )


def test_evaluate_is_a_deprecated_spelling_of_eval_run_with_one_line_saying_so(monkeypatch, capsys):
    seen = []
    import services.eval.evaluate as evaluate

    monkeypatch.setattr(evaluate, "evaluate_checkpoint", lambda *a, **k: seen.append((a, k)) or {"mlm_acc": 0.5})
    assert cli.main(["evaluate", "ckpt", "--heldout", "h.parquet"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "albert: `albert evaluate CHECKPOINT` is deprecated; use `albert eval run --checkpoint ckpt`"
    ]
    assert '"mlm_acc": 0.5' in captured.out and seen[0][0] == ("ckpt", "h.parquet")
    assert cli.main(["eval", "run", "--checkpoint", "ckpt", "--heldout", "h.parquet"]) == 0
    assert capsys.readouterr().err == "" and seen[1][0] == ("ckpt", "h.parquet")


def test_the_top_level_help_does_not_list_the_deprecated_evaluate():
    text = cli.build_parser().format_help()
    assert re.search(r"^\s+eval\s+\S", text, re.M) and not re.search(r"^\s+evaluate\s", text, re.M)


# --- --output, --checkpoint, --no-progress --------------------------------------------------------------------


def test_no_command_takes_out_any_more_except_as_the_deprecated_spelling_of_output():
    for path, parser in subcommands(cli.build_parser()):
        if "--out" in options(parser):
            action = next(a for a in parser._actions if "--out" in a.option_strings)
            assert "--output" in action.option_strings and action.dest == "output", path


@pytest.mark.parametrize(
    "argv",
    [
        ["experiment", "report", "spec.toml"],
        ["analyze", "layers", "ckpt", "--heldout", "h.parquet"],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_output_is_the_output_flag_and_out_still_works_with_a_deprecation_line(argv, capsys):
    assert parse(*argv, "--output", "x").output == "x"
    assert capsys.readouterr().err == ""
    assert parse(*argv, "--out", "x").output == "x"
    assert capsys.readouterr().err.splitlines() == ["albert: --out is deprecated; use --output"]


def test_the_model_to_evaluate_or_fine_tune_is_given_with_checkpoint():
    assert parse("finetune", "--task", "sst2", "--checkpoint", "ckpt").checkpoint == "ckpt"
    assert parse("eval", "run", "--checkpoint", "ckpt", "--heldout", "h").checkpoint == "ckpt"
    with pytest.raises(SystemExit):
        parse("eval", "run", "ckpt", "--heldout", "h")  # no positional checkpoint


@pytest.mark.parametrize(
    "argv",
    [
        ["demo"],
        ["preprocess", "--input", "x", "--output", "y", "--tokenizer", "t"],
        ["pretrain", "--config", "tiny"],
        ["finetune", "--task", "sst2", "--checkpoint", "c"],
        ["experiment", "run", "spec.toml"],
        ["experiment", "report", "spec.toml", "--output", "r.md"],
    ],
    ids=lambda argv: argv[0] if argv[0] != "experiment" else " ".join(argv[:2]),
)
def test_every_command_that_draws_a_progress_bar_takes_no_progress(argv):
    assert parse(*argv, "--no-progress").no_progress is True


# --- --version, help, exit statuses -----------------------------------------------------------------------------


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        parse("--version")
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"albert {services.__version__}"


def test_the_top_level_help_says_what_each_command_is_for_in_one_line_and_the_exit_statuses(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # a terminal of 80 columns
    text = cli.build_parser().format_help()
    assert "albert demo" in text.split("commands:")[0]  # where a new user starts
    listing = text.split("commands:")[1].split("exit status:")[0]
    names = re.findall(r"^    (\S+)\s+\S", listing, re.M)
    assert names[:7] == ["demo", "data", "tokenizer", "preprocess", "pretrain", "config", "status"]
    assert {"eval", "finetune", "model", "convert", "analyze", "experiment", "submit", "jobs"} <= set(names)
    assert not re.search(r"^\s{5,}\S", listing, re.M)  # every line is one line: no wrapped continuation
    assert max(len(line) for line in text.splitlines()) <= 80
    for code, meaning in EXIT_CODES.items():
        assert f"{code:>3}  {meaning}" in text


def test_a_usage_error_exits_2_and_bad_data_or_config_exits_65(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        parse("pretrain", "--config")  # argparse: a missing argument
    assert done.value.code == EXIT_USAGE == 2
    assert cli.main(["finetune", "--task", "sst2", "--data", "d", "--checkpoint", "c", "--preset", "p"]) == EXIT_USAGE
    assert "not both" in capsys.readouterr().err
    assert cli.main(["pretrain", "--config", "tiny", "--set", "lr"]) == EXIT_USAGE  # --set without SECTION.FIELD=
    assert cli.main(["pretrain", "--config", "tiny", "--set", "optim.lr=-1", "--dry-run"]) == EXIT_DATA == 65
    assert "--set optim.lr=-1" in capsys.readouterr().err
    assert cli.main(["config", "show", str(tmp_path / "missing.toml")]) == EXIT_DATA
    assert cli.main(["status", str(tmp_path / "no-run")]) == EXIT_DATA


def test_the_guide_documents_every_exit_status():
    readme = (ROOT / "docs" / "guide.md").read_text()
    section = readme.split("## Exit status", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", section, re.M))
    assert {int(code) for code in rows} == set(EXIT_CODES)


def test_readme_describes_the_training_input_as_it_is():
    """Ray Data writes the shards; each worker reads them with its own seeded Parquet reader, for exact resume."""
    intro = (ROOT / "README.md").read_text().split("## What the main job shows", 1)[0]
    assert "Ray Data streams" not in intro
    for said in ("Parquet shards", "its own Parquet reader", "example order", "resumes on exactly the examples"):
        assert said in intro, said
