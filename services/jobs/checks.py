"""What `albert submit pretrain` (and `albert submit eval`) checks on the submitting machine, before anything is
uploaded.

A job runs in a copy of the working directory unpacked on the head node, without `.cache`, `data` or `runs`
(services.cluster.EXCLUDES). Two things a user meets there are fixed here instead of on the cluster:
- the recipe is loaded and validated with its `--set` overrides, so a config error costs one line and no upload;
- every relative path of the run (data.shards, run.output_dir, model.init_from, eval.task_data, --resume) is made
  absolute against the working directory, where the user meant it, and passed on with `--set`. On a real cluster
  that directory is a shared mount every node sees at the same path (deploy.md, "Storage").
`albert submit eval ...` gets the same for its paths (the run directory or --checkpoint, --heldout, --task-data): they
are parsed and made absolute in place.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from albert_core.model.config import ConfigError

PATH_FIELDS = ("data.shards", "run.output_dir", "model.init_from")


def prepare_job_args(kind: str, args: list[str], working_dir: str | Path) -> tuple[list[str], list[str]]:
    """(the job's arguments to submit, one note per path made absolute); `pretrain` and `eval` jobs are rewritten."""
    if kind not in ("pretrain", "eval") or "://" in str(working_dir):
        return list(args), []
    if kind == "eval":
        return prepare_eval_args(args, Path(working_dir).resolve())
    return prepare_pretrain_args(args, Path(working_dir).resolve())


def parse_command(register: Callable[[argparse._SubParsersAction], None], argv: list[str]) -> argparse.Namespace:
    """`albert ARGV` parsed by the parser of the stage whose `register` adds that command (exit 2 on a usage error,
    as `albert` itself does)."""
    parser = argparse.ArgumentParser(prog="albert")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def prepare_eval_args(args: list[str], root: Path) -> tuple[list[str], list[str]]:
    """`eval run|schedule|list|cancel ...`: the run directory (or --checkpoint), --heldout and --task-data made absolute
    under root."""
    from services.eval.cli import register

    options = parse_command(register, ["eval", *args])  # a usage error stops here, before the upload
    task_data = getattr(options, "task_data", [])
    if options.action == "run":  # TASK=DIR pairs
        task_data = [pair.partition("=")[2] for pair in task_data]
    paths = [getattr(options, "run", None), getattr(options, "checkpoint", None), getattr(options, "heldout", None)]
    absolute = {path: _absolute(path, root) for path in [*paths, *task_data] if path}
    out, notes = [], []
    for arg in args:
        flag, sep, value = arg.partition("=") if arg.startswith("--") and "=" in arg else ("", "", arg)
        task, pair, directory = value.partition("=") if options.action == "run" else ("", "", value)
        new = f"{task}={absolute.get(directory, directory)}" if pair else absolute.get(value, value)
        out.append(f"{flag}{sep}{new}" if sep else new)
        if new != value:
            notes.append(f"{value} -> {new}")
    if options.action == "schedule" and not options.heldout:
        heldout = _default_heldout(Path(absolute[options.run]), root)
        if heldout is not None:  # the run's data.shards is relative to where it was trained: here
            out.append(f"--heldout={heldout}")
            notes.append(f"--heldout: the run's held-out set, {heldout}")
    return out, notes


def _default_heldout(run_dir: Path, root: Path) -> str | None:
    """The run's <data.shards>/heldout/documents.parquet made absolute under root, when data.shards is relative and
    the run directory is readable here; None otherwise (the job reads the run's config itself)."""
    from albert_core.examples.shards import HELDOUT_FILE
    from services.eval.schedule import run_config_of

    try:
        shards = run_config_of(run_dir).data.shards
    except (FileNotFoundError, ValueError):
        return None
    return None if _absolute(shards, root) == shards else str(Path(_absolute(shards, root)) / HELDOUT_FILE)


def prepare_pretrain_args(args: list[str], root: Path) -> tuple[list[str], list[str]]:
    from services.rundir.config import RunConfig, parse_sets
    from services.train.cli import register

    options = parse_command(register, ["pretrain", *args])
    config_path = _recipe_in(root, options.config)
    overrides = parse_sets(options.set)
    resume = options.resume
    if resume and not Path(resume).is_absolute():
        resume = str((root / resume).resolve())
    if resume:
        overrides.update({"run.name": Path(resume).name, "run.output_dir": str(Path(resume).parent)})
    config = RunConfig.load(config_path, overrides)  # raises ConfigError: one line, nothing uploaded
    extra, notes = [], []
    for dotted in PATH_FIELDS:
        section, key = dotted.split(".")
        value = getattr(getattr(config, section), key)
        absolute = _absolute(value, root)
        if absolute != value:
            extra += ["--set", f"{dotted}={json.dumps(absolute)}"]
            notes.append(f"{dotted}: {value} -> {absolute}")
    task_data = {task: _absolute(directory, root) for task, directory in config.eval.task_data.items()}
    if task_data != config.eval.task_data:
        inline = ", ".join(f"{json.dumps(task)} = {json.dumps(path)}" for task, path in task_data.items())
        extra += ["--set", f"eval.task_data={{{inline}}}"]
        notes.append(f"eval.task_data: made absolute under {root}")
    if resume != options.resume:
        args = [resume if arg == options.resume else arg for arg in args]
        notes.append(f"--resume: {options.resume} -> {resume}")
    return [*args, *extra], notes


def _recipe_in(root: Path, name: str) -> Path:
    """The recipe file as the job will find it: a shipped name (the job finds its own copy, services/rundir/recipes), an
    absolute path (on a mount the cluster shares), or a relative path inside the uploaded directory; a relative path
    outside it would not exist there."""
    from services.rundir.config import recipes_dir, resolve_config_path

    if Path(name).is_absolute():
        return resolve_config_path(name)
    inside = root / name
    path = inside if inside.is_file() else resolve_config_path(name)
    if not inside.is_file() and path.resolve().is_relative_to(recipes_dir().resolve()):
        return path
    try:
        path.resolve().relative_to(root)
    except ValueError:
        raise ConfigError(
            f"--config {name}: {path.resolve()} is outside the working directory {root}, which is all the job gets; "
            "put the recipe under it, give an absolute path on a mount the cluster shares, or pass --working-dir"
        ) from None
    return path


def _absolute(value: str, root: Path) -> str:
    if not value or "://" in value or Path(value).is_absolute():
        return value
    return str((root / value).resolve())
