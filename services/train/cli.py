"""`albert pretrain`: its flags and handler (the job itself: services.train.pretrain)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.terminal import EXIT_STOPPED, stopped_status


def cmd_pretrain(args: argparse.Namespace) -> int:
    from services.rundir.config import RunConfig, parse_sets
    from services.train.interrupt import StoppedAtOnce

    overrides = parse_sets(args.set)
    if args.resume:
        run_dir = Path(args.resume)
        overrides.update({"run.name": run_dir.name, "run.output_dir": str(run_dir.parent)})
    if args.init_from:  # model.init_from, which a recipe made for --init-from (preset "checkpoint") needs
        overrides["model.init_from"] = args.init_from
    config = RunConfig.load(args.config, overrides)
    if args.init_from:
        from services.rundir.init_from import adopt_checkpoint_model, replaced_line

        config, replaced = adopt_checkpoint_model(config, args.init_from, overrides)
        print(f"albert: {replaced_line(args.init_from, replaced)}", file=sys.stderr)
    if args.verify_shards:
        print(verify_shard_set(config))
    if args.dry_run:
        from services.train.dry_run import dry_run

        for line in dry_run(config, resume=not args.fresh, allow_config_change=args.allow_config_change):
            print(line)
        return 0
    from services.train.pretrain import pretrain

    try:
        result = pretrain(
            config,
            address=args.address,
            resume=not args.fresh,
            progress=not args.no_progress,
            allow_config_change=args.allow_config_change,
        )
    except StoppedAtOnce as stop:
        from services.rundir.checkpoints import CHECKPOINTS_DIR, latest_good

        newest = latest_good(config.run_dir / CHECKPOINTS_DIR)
        resumes = f"a resume starts from {newest}" if newest else "no checkpoint yet: a resume starts from step 0"
        print(f"albert: {stop}; {resumes}", file=sys.stderr)
        return stop.exit_status
    if result.stopped:
        print(f"albert: stopped at step {result.step}: {result.stopped}", file=sys.stderr)
        if result.interrupted:
            return stopped_status(result.signal)
        return EXIT_STOPPED
    print(f"finished at step {result.step}; checkpoint {result.checkpoint}; metrics {result.metrics_file}")
    return 0


def verify_shard_set(config) -> str:
    """--verify-shards: every shard's sha256 against manifest.json, before Ray starts (DamagedShard: exit 65)."""
    import time

    from services.train.data import verify_shards
    from services.train.plan import read_shard_set

    started = time.perf_counter()
    shards = read_shard_set(Path(config.data.shards).resolve())
    hashed = verify_shards(shards.files, shards.sha256)
    checked = sum(1 for digest in shards.sha256 if digest)
    unlisted = f"; {len(shards.files) - checked} without one in manifest.json" if checked < len(shards.files) else ""
    return (
        f"verified {checked} shards ({hashed / 1e6:,.1f} MB) against their sha256 in manifest.json in "
        f"{time.perf_counter() - started:.1f} s{unlisted}"
    )


def register(commands: argparse._SubParsersAction) -> None:
    """`albert pretrain`."""
    pre = commands.add_parser(
        "pretrain",
        help="pretrain a model from a recipe (tiny, albert-base, ...)",
        description="Pretrain with a run recipe (a shipped name: albert config show NAME, or a TOML file).",
    )
    pre.add_argument("--config", required=True, help="tiny, albert-base, ... or a TOML file")
    pre.add_argument("--address", help="Ray cluster address (auto, ray://host:10001); default: embedded local Ray")
    pre.add_argument("--resume", metavar="RUN_DIR", help="continue this run directory from its newest good checkpoint")
    pre.add_argument(
        "--init-from",
        metavar="DIR",
        help="continue pretraining this checkpoint (a transformers ALBERT or BERT directory, or ours): the model is "
        "the checkpoint's, every tensor it has is loaded, and the recipe's [model] gives way",
    )
    pre.add_argument("--fresh", action="store_true", help="refuse to reuse a run directory that has checkpoints")
    pre.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a field")
    pre.add_argument(
        "--allow-config-change",
        nargs="+",
        action="extend",
        default=[],
        metavar="FIELD",
        help="resume although the recipe changes these fields (SECTION.FIELD, model.overrides.FIELD or SECTION) "
        "from the run's; the schedule, step budget, evaluation, checkpointing and worker layout may change without",
    )
    pre.add_argument(
        "--dry-run", action="store_true", help="make the whole plan (every check) and print it; start nothing"
    )
    pre.add_argument(
        "--verify-shards",
        action="store_true",
        help="hash every shard against manifest.json before starting (reads the whole set once; without it, each row "
        "group's page checksums are checked as it is read)",
    )
    pre.add_argument("--no-progress", action="store_true", help="no progress bar")
    pre.set_defaults(func=cmd_pretrain)
