"""`albert submit` and `albert jobs list|status|logs|stop`: albert commands run as Ray jobs (services.cluster has the
Jobs API client; services.jobs.checks what a submission checks before its upload).

Piping their output into `head` is quiet: services.cli.main turns a closed pipe into exit 141, no traceback.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

# --- handlers -------------------------------------------------------------------------


def _connection(args: argparse.Namespace) -> dict[str, object]:
    return {"address": args.address, "token_file": args.token_file, "allow_insecure": args.allow_insecure_http}


def _parse_env(pairs: list[str]) -> dict[str, str]:
    from services.cluster import JobsError

    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise JobsError(f"--env {pair!r}: expected KEY=VALUE")
        env[key] = value
    return env


def cmd_submit(args: argparse.Namespace) -> int:
    from services.cluster import job_logs, job_status, split_submit_args, submit
    from services.jobs.checks import prepare_job_args

    own, job_args = split_submit_args(args.args)
    late = _late_submit_options().parse_args(own)
    if "env" in late:
        args.env = [*args.env, *late.env]
    for key, value in vars(late).items():
        if key != "env":
            setattr(args, key, value)
    extra = {"env_vars": _parse_env(args.env)} if args.env else None
    job_args, notes = prepare_job_args(args.kind, job_args, args.working_dir)  # a bad recipe fails here, not there
    for note in notes:
        print(f"albert: {note} (relative to the uploaded directory; the job runs elsewhere)")
    job_id = submit(args.kind, job_args, working_dir=args.working_dir, runtime_env=extra, **_connection(args))
    print(f"submitted {job_id}: albert {shlex.join([args.kind, *job_args])}")
    if not args.wait:
        print(f"follow it with: albert jobs logs {job_id} --follow")
        return 0
    job_logs(job_id, follow=True, **_connection(args))
    record = job_status(job_id, **_connection(args))
    print(f"{job_id} {record.status}" + (f": {record.message}" if record.message else ""))
    return 0 if record.status == "SUCCEEDED" else 1


def _when(seconds: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds)) if seconds else "-"


def cmd_jobs_list(args: argparse.Namespace) -> int:
    from services.cluster import list_jobs

    records = list_jobs(**_connection(args))
    if not records:
        print("no jobs")
        return 0
    width = max(len(r.job_id) for r in records)
    print(f"{'job':<{width}}  {'status':<10} {'started':<19}  entrypoint")
    for r in records:
        print(f"{r.job_id:<{width}}  {r.status:<10} {_when(r.start_time):<19}  {r.entrypoint}")
    return 0


def cmd_jobs_status(args: argparse.Namespace) -> int:
    from services.cluster import job_status

    r = job_status(args.job_id, **_connection(args))
    print(f"{r.job_id} {r.status}")
    print(f"  entrypoint: {r.entrypoint}")
    print(f"  started:    {_when(r.start_time)}")
    print(f"  ended:      {_when(r.end_time)}")
    if r.message:
        print(f"  message:    {r.message}")
    return 0


def cmd_jobs_logs(args: argparse.Namespace) -> int:
    from services.cluster import job_logs

    if args.follow:
        job_logs(args.job_id, follow=True, **_connection(args))
    else:
        sys.stdout.write(job_logs(args.job_id, **_connection(args)))
    return 0


def cmd_jobs_stop(args: argparse.Namespace) -> int:
    from services.cluster import stop_job

    status = stop_job(args.job_id, wait=args.wait, **_connection(args))
    print(f"{args.job_id} {status}")
    return 0


# --- parsers -------------------------------------------------------------------------------------------------


def _connection_options(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    default = argparse.SUPPRESS if suppress else None
    parser.add_argument("--address", default=default, help="job server URL, e.g. http://127.0.0.1:8265 (RAY_ADDRESS)")
    parser.add_argument("--token-file", default=default, help="file holding the cluster's Ray auth token")
    parser.add_argument(
        "--allow-insecure-http",
        action="store_true",
        default=argparse.SUPPRESS if suppress else False,
        help="allow plain http to a host that is not loopback (sends the token in clear text)",
    )


def _late_submit_options() -> argparse.ArgumentParser:
    """`albert submit`'s options given after KIND and its arguments (client.split_submit_args finds them)."""
    parser = argparse.ArgumentParser(prog="albert submit", add_help=False)
    _connection_options(parser, suppress=True)
    parser.add_argument("--wait", action="store_true", default=argparse.SUPPRESS)
    parser.add_argument("--working-dir", default=argparse.SUPPRESS)
    parser.add_argument("--env", action="append", default=argparse.SUPPRESS)
    return parser


def register(commands: argparse._SubParsersAction) -> None:
    """`albert submit ...` and `albert jobs list|status|logs|stop`."""
    from services.cluster import JOB_KINDS

    submit_parser = commands.add_parser(
        "submit",
        help="run an albert command on a Ray cluster",
        description="Submit `albert KIND ARGS...` as a Ray job; the working directory is uploaded with it. "
        "Submit options may come before KIND or after its arguments; arguments after `--` go to the job as they are.",
    )
    _connection_options(submit_parser)
    submit_parser.add_argument("--wait", action="store_true", help="stream the job's logs until it ends")
    submit_parser.add_argument("--working-dir", default=".", help="directory uploaded as the job's working dir")
    submit_parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="job env var")
    submit_parser.add_argument("kind", choices=JOB_KINDS)
    submit_parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of `albert KIND`")
    submit_parser.set_defaults(func=cmd_submit)

    jobs = commands.add_parser("jobs", help="list, follow and stop the cluster's albert jobs").add_subparsers(
        dest="action", required=True
    )
    connection = argparse.ArgumentParser(add_help=False)
    _connection_options(connection)
    jobs.add_parser("list", parents=[connection], help="submitted jobs, oldest first").set_defaults(func=cmd_jobs_list)
    status = jobs.add_parser("status", parents=[connection], help="one job's status")
    status.add_argument("job_id")
    status.set_defaults(func=cmd_jobs_status)
    logs = jobs.add_parser("logs", parents=[connection], help="a job's driver output")
    logs.add_argument("job_id")
    logs.add_argument("--follow", action="store_true", help="stream until the job ends")
    logs.set_defaults(func=cmd_jobs_logs)
    stop = jobs.add_parser("stop", parents=[connection], help="stop a job")
    stop.add_argument("job_id")
    stop.add_argument("--wait", action="store_true", help="wait until it has stopped")
    stop.set_defaults(func=cmd_jobs_stop)
