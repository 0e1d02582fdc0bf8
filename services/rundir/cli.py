"""`albert status RUN`: a run's state, read from its directory (no Ray, no torch), from the cluster's job server,
or from the run's live coordinator. `albert config show RECIPE`: a recipe resolved with its `--set`s, as TOML."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from services.rundir.ledger import ledger_path
from services.rundir.status import read_status


def run_status(run_dir: str | Path, run_name: str) -> dict[str, Any]:
    """The live coordinator's status when it runs on the cluster this process joined, else the saved one."""
    from services.cluster import live_status

    live = live_status(run_name)
    return live if live is not None else {**read_status(run_dir), "live": False}


def cmd_status(args: argparse.Namespace) -> int:
    """From the run directory ("live" while its coordinator's process runs). --address: a job server URL
    (http://host:8265, the one `albert submit` takes) adds the cluster's running jobs; a Ray address
    (host:6379, ray://..., auto) asks the live coordinator itself."""
    run_dir = Path(args.run)
    if args.address and args.address.startswith(("http://", "https://")):
        from services.cluster import list_jobs

        if not ledger_path(run_dir).is_file():
            raise FileNotFoundError(
                f"{run_dir}: no run directory here; if it is only on the cluster, ask there: "
                f"albert submit status {args.run} --wait"
            )
        status = read_status(run_dir)
        running = [r for r in list_jobs(address=args.address) if r.status in ("PENDING", "RUNNING")]
        status["cluster_jobs"] = [{"job_id": r.job_id, "status": r.status, "entrypoint": r.entrypoint} for r in running]
    elif args.address:
        from services.cluster import connect

        connect(args.address)
        status = run_status(run_dir, run_dir.name)
    else:
        status = read_status(run_dir)
    print(json.dumps(status, indent=2, default=str))
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    """The recipe with its overrides merged and every field checked, as TOML that `--config` reads back; the
    model's parameter count in a comment at the top."""
    from albert_core.model.config import count_parameters
    from services.rundir.config import RunConfig, parse_sets, resolve_config_path
    from services.rundir.fields import to_toml

    config = RunConfig.load(args.recipe, parse_sets(args.set))
    vocab, source = vocab_of(config)
    params = count_parameters(config.model_config(vocab))
    sets = "".join(f" --set {pair}" for pair in args.set)
    print(f"# {resolve_config_path(args.recipe)}{sets}, resolved")
    print(f"# model: {params / 1e6:.2f}M parameters ({config.model.preset}; vocab_size {vocab}: {source})")
    print(to_toml(config.to_dict()), end="")
    return 0


def vocab_of(config) -> tuple[int, str]:
    """The vocabulary size a run of `config` would have, and where it comes from (the one pretraining takes:
    model.overrides.vocab_size, else the tokenizer of data.shards), or 30000 assumed when neither is there."""
    from albert_core.examples.shards import ManifestError, ShardsManifest
    from albert_core.text.tokenization import load_tokenizer

    if config.model.overrides.get("vocab_size"):
        return int(config.model.overrides["vocab_size"]), "model.overrides.vocab_size"
    try:
        manifest = ShardsManifest.read(config.data.shards) if config.data.shards else None
        model = manifest.tokenizer_model() if manifest is not None else None
        if model is not None:
            return load_tokenizer(model).vocab_size, f"the tokenizer of data.shards, {model}"
        if manifest is not None and manifest.vocab_size:
            return manifest.vocab_size, f"data.shards' {manifest.directory / 'manifest.json'}"
    except (ManifestError, OSError, ValueError):
        pass
    return 30000, "assumed; the tokenizer of data.shards sets it, and there is none yet"


def register(commands: argparse._SubParsersAction) -> None:
    """`albert status`, `albert config show`."""
    config = commands.add_parser("config", help="see a recipe resolved with your --set changes").add_subparsers(
        dest="action", required=True
    )
    show = config.add_parser("show", help="print a recipe with its --set overrides merged, as TOML (+ parameters)")
    show.add_argument("recipe", help="a shipped recipe (tiny, albert-base, ...) or a TOML file")
    show.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a field")
    show.set_defaults(func=cmd_config_show)

    status = commands.add_parser("status", help="where a pretraining run is: steps, checkpoints, scores")
    status.add_argument("run", help="the run directory (runs/NAME)")
    status.add_argument(
        "--address", help="a job server URL (http://host:8265: adds the cluster's running jobs) or a Ray address"
    )
    status.set_defaults(func=cmd_status)
