"""`albert status RUN`: a run's state, read from its directory (no Ray, no torch), from the cluster's job server,
or from the run's live coordinator."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from services.run.ledger import STATE_FILE, read_status


def run_status(run_dir: str | Path, run_name: str) -> dict[str, Any]:
    """The live coordinator's status when it runs on the cluster this process joined, else the saved one."""
    from services.cluster import live_status

    live = live_status(run_name)
    return live if live is not None else {**read_status(run_dir), "live": False}


def cmd_status(args: argparse.Namespace) -> int:
    """From the run directory ("live" while its coordinator's heartbeat is fresh). --address: a job server URL
    (http://host:8265, the one `albert submit` takes) adds the cluster's running jobs; a Ray address
    (host:6379, ray://..., auto) asks the live coordinator itself."""
    run_dir = Path(args.run)
    if args.address and args.address.startswith(("http://", "https://")):
        from services.cluster import list_jobs

        if not (run_dir / STATE_FILE).is_file():
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


def register(commands: argparse._SubParsersAction) -> None:
    """`albert status`."""
    status = commands.add_parser("status", help="a run's state: steps, checkpoints, evaluations, dropout")
    status.add_argument("run", help="the run directory (runs/NAME)")
    status.add_argument(
        "--address", help="a job server URL (http://host:8265: adds the cluster's running jobs) or a Ray address"
    )
    status.set_defaults(func=cmd_status)
