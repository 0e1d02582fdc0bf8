"""Reaching a Ray cluster: `connect` is the one place albert starts Ray (it joins a cluster as a driver, or starts
an embedded Ray on this machine that listens on loopback only), and the Jobs API runs albert commands on a cluster:
submit, list, status, logs, stop.

A job is `python -m services.cli KIND ARGS...` run on the cluster's head node, in a copy of the local working
directory that Ray packages and uploads (the runtime_env "working_dir", without venvs, caches, corpora, runs or
.git). `python -m` makes the uploaded code win over any albert installed on the cluster.

Security defaults (deploy.md, "Security"):
- The job server runs arbitrary code for whoever can reach it, so a plain-http address must be loopback
  (127.0.0.0/8, localhost, ::1): reach a remote cluster through an SSH tunnel or `kubectl port-forward`, or use
  https. `allow_insecure=True` (`--allow-insecure-http`) overrides this.
- Ray token auth: the token comes from where Ray itself looks (RAY_AUTH_TOKEN, then the file named by
  RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token) or from `token_file`, and is sent as an Authorization header.
  RAY_AUTH_MODE=disabled sends none; RAY_AUTH_MODE=token without a token is an error. The token is never printed,
  logged, put in an entrypoint or in a runtime_env (which anyone who can list jobs can read). A token file that
  others can read or write is refused (as ssh refuses such a key), and so is one inside the uploaded working dir.
- The upload leaves out files that hold secrets (SECRET_EXCLUDES: .env*, .netrc, .ray/, *.token, keys...).

Ray is imported inside the functions that use it, so the offline commands that import this module stay fast.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import shlex
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

from services import RAY_NAMESPACE

# Commands that make sense as cluster jobs. `model` (e.g. `model info`) is a cheap smoke test of a cluster.
JOB_KINDS = (
    *("preprocess", "pretrain", "finetune", "evaluate", "eval", "experiment", "analyze", "tokenizer", "model"),
    "status",  # a run's state as the cluster sees it, when its run directory is not mounted where you are
)
# Never uploaded either: files that hold secrets (anyone who can list the cluster's jobs can download a job's
# package). The token file in use is also refused outright when it lies inside the working dir (submit_entrypoint).
SECRET_EXCLUDES = [
    *(".env", ".env.*", ".envrc", ".netrc", "_netrc", ".git-credentials", ".pypirc", ".npmrc"),
    *(".ray", ".ssh", ".gnupg", ".aws", ".azure", ".kube", ".docker", ".config/gcloud"),
    *("*.token", "auth_token", "*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.keystore", "kubeconfig", "*.kubeconfig"),
    *("id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*"),
    *("credentials", "*credentials*.json", "service-account*.json", "*.secret"),
]
# Never uploaded with the working dir (gitignore syntax, relative to it): environments, caches, corpora, outputs.
EXCLUDES = [
    ".git",
    ".venv",
    ".venv-*",
    ".cache",
    "/data",  # the corpora folder at the top, not services/data
    "runs",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    "bench/results",
    "*.safetensors",
    *SECRET_EXCLUDES,
]
TERMINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")
AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
# How long Ray's job supervisor waits after the SIGTERM of `albert jobs stop` before it sends SIGKILL (Ray's default:
# 3 s). A pretraining job saves a checkpoint at its next step within train.stop_grace_s (25 s by default) of the
# SIGTERM; this leaves it that and the time to exit. A job's own --env RAY_JOB_STOP_WAIT_TIME_S=N overrides it.
STOP_WAIT_ENV, STOP_WAIT_S = "RAY_JOB_STOP_WAIT_TIME_S", 40
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
ADDRESS_ENVS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")  # the order the `ray job` CLI uses
LOOPBACK = "127.0.0.1"  # where an embedded Ray listens


class JobsError(ValueError):
    """A job request that cannot be made or that the cluster refused (the CLI prints it and exits 65; a job that ran and
    failed, JobFailedError, exits 1)."""


class InsecureAddressError(JobsError):
    pass


class JobFailedError(JobsError):
    def __init__(self, job_id: str, status: str, message: str):
        super().__init__(f"job {job_id} ended {status}: {message}")
        self.job_id, self.status = job_id, status


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    status: str
    entrypoint: str
    start_time: float | None  # seconds since the epoch
    end_time: float | None
    message: str


# --- as a driver ----------------------------------------------------------------------------------------


def connect(address: str | None = None, *, num_cpus: int | None = None, worker_logs: bool = True) -> None:
    """Start Ray for this command: the one place albert calls `ray.init`, for every command, in albert's namespace.

    With `address` ("auto", "HOST:PORT", "ray://HOST:10001"), or RAY_ADDRESS (inside a Ray job it names the
    cluster), join that cluster; else start an embedded Ray on this machine with `num_cpus` CPUs (all of them by
    default) and no dashboard, whose node, GCS, raylet, object manager and agents listen on 127.0.0.1 only
    (`keep_loopback`). Ray's own token auth applies as Ray sets it (RAY_AUTH_MODE; a new local Ray turns it on
    unless RAY_AUTH_MODE=disabled). `worker_logs=False` keeps an embedded Ray's worker output out of the terminal
    (where a live view draws; Ray's session logs keep it). Then a SIGTERM raises Terminated again (`ray.init`
    installs Ray's handler, which exits at once, skipping the command's own clean-up). Nothing when Ray is already
    started in this process."""
    import ray

    from services.terminal import raise_on_sigterm

    if ray.is_initialized():
        return
    joins = address or os.environ.get("RAY_ADDRESS")
    if not joins or is_loopback(address_host(joins)):
        keep_loopback()
    if joins:
        ray.init(address=address, namespace=RAY_NAMESPACE)
    else:
        ray.init(
            num_cpus=num_cpus,
            namespace=RAY_NAMESPACE,
            include_dashboard=False,
            log_to_driver=worker_logs,
            _node_ip_address=LOOPBACK,
            dashboard_host=LOOPBACK,
        )
    raise_on_sigterm()


def keep_loopback() -> None:
    """Make this process keep 127.0.0.1 as the address of a Ray node and of its GCS. Ray 2.60 replaces a loopback
    address by the machine's routable one (ray._private.services.resolve_ip_for_localhost), so that a node given
    127.0.0.1 would still listen on every interface, except where Ray runs on one machine only (its setting for
    macOS and Windows, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0): that setting, for this process. A node whose address
    stays 127.0.0.1 binds its GCS, raylet, object manager, agents and workers to loopback only."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def address_host(address: str) -> str:
    """The host of a Ray address: "HOST:PORT", "ray://HOST:PORT", "http://HOST:PORT" ("auto" stays "auto")."""
    return urlsplit(address if "://" in address else f"//{address}").hostname or address


def coordinator_name(run_name: str) -> str:
    """The name of a run's coordinator actor in albert's namespace (services.train.coordinator)."""
    return f"albert-coordinator:{run_name}"


def live_status(run_name: str, *, timeout: float = 30.0) -> dict[str, Any] | None:
    """The status the run's live coordinator reports, or None when it has none on this cluster (or it died)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        actor = ray.get_actor(coordinator_name(run_name), namespace=RAY_NAMESPACE)
        return ray.get(actor.status.remote(), timeout=timeout)
    except (ValueError, RayActorError, GetTimeoutError):  # no such actor, or it died: the run is not live here
        return None


# --- address and token ---------------------------------------------------------------------------------


def default_address(environ: Mapping[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    for name in ADDRESS_ENVS:
        if environ.get(name):
            return environ[name]
    raise JobsError(
        "no job server address: pass --address http://127.0.0.1:8265 (the Ray dashboard port, e.g. through an SSH "
        "tunnel) or set RAY_ADDRESS"
    )


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a DNS name: never trusted to be local
        return False


def check_address(address: str, *, allow_insecure: bool = False) -> str:
    """The job server URL without a trailing slash; refuses plain http to a host that is not loopback."""
    parts = urlsplit(address)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise JobsError(
            f"job server address {address!r}: expected http://HOST:PORT or https://HOST:PORT (the dashboard port, "
            "8265 by default), not a GCS address (HOST:6379) or ray://"
        )
    if parts.scheme == "http" and not is_loopback(parts.hostname) and not allow_insecure:
        raise InsecureAddressError(
            f"refusing plain http to {parts.hostname}: anyone on the path could read the cluster token and submit "
            "code that runs on the cluster. Reach the job server through an SSH tunnel (ray dashboard CLUSTER.yaml, "
            "or ssh -L 8265:localhost:8265 HEAD) or kubectl port-forward and use http://127.0.0.1:8265, or put it "
            "behind https. --allow-insecure-http overrides this on a network you trust."
        )
    return address.rstrip("/")


def _read_token_file(path: Path, origin: str) -> str:
    path = path.expanduser()
    try:
        mode = path.stat().st_mode
        token = path.read_text().strip()
    except OSError as err:
        raise JobsError(f"{origin}: cannot read token file {path}: {err.strerror}") from None
    if mode & 0o077:  # as ssh refuses a private key others can read
        raise JobsError(
            f"{origin}: token file {path} is accessible by others (mode {mode & 0o777:o}): chmod 600 {path}"
        )
    if not token:
        raise JobsError(f"{origin}: token file {path} is empty")
    return token


def _auth_mode(environ: Mapping[str, str]) -> str:
    mode = environ.get(AUTH_MODE_ENV, "").strip().lower()
    if mode not in ("", "token", "disabled"):
        raise JobsError(f"{AUTH_MODE_ENV}: expected 'token' or 'disabled', got {environ[AUTH_MODE_ENV]!r}")
    return mode


def token_file_in_use(
    token_file: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None
) -> tuple[Path, str] | None:
    """The token file a request reads and what named it, looked up as Ray looks it up; None when the token comes
    from RAY_AUTH_TOKEN, auth is disabled or there is no file."""
    environ = os.environ if environ is None else environ
    if token_file is not None:
        return Path(token_file).expanduser(), "--token-file"
    if _auth_mode(environ) == "disabled" or environ.get(TOKEN_ENV, "").strip():
        return None
    if environ.get(TOKEN_PATH_ENV):
        return Path(environ[TOKEN_PATH_ENV]).expanduser(), TOKEN_PATH_ENV
    default = Path.home() / ".ray" / "auth_token"
    return (default, "default token file") if default.is_file() else None


def resolve_token(token_file: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The Ray auth token to send, looked up as Ray looks it up; None when there is none (or auth is disabled).
    A token file that others can read or write is refused, as ssh refuses such a private key."""
    environ = os.environ if environ is None else environ
    found = token_file_in_use(token_file, environ)
    if found is not None:
        return _read_token_file(*found)
    mode = _auth_mode(environ)
    if mode == "disabled":
        return None
    if environ.get(TOKEN_ENV, "").strip():
        return environ[TOKEN_ENV].strip()
    if mode == "token":
        raise JobsError(
            f"{AUTH_MODE_ENV}=token but no token found: set {TOKEN_PATH_ENV} to the cluster's token file, set "
            f"{TOKEN_ENV}, write it to ~/.ray/auth_token, or pass --token-file"
        )
    return None


def check_token_outside(working_dir: str, token_file: str | os.PathLike | None, environ: Mapping[str, str]) -> None:
    """Refuse a token file that lies inside the working directory about to be uploaded (the upload's denylist
    would likely leave it out, but a token has no business in a job package's source tree)."""
    found = token_file_in_use(token_file, environ)
    if found is None or "://" in working_dir:
        return
    path, origin = found
    if path.resolve().is_relative_to(Path(working_dir).resolve()):
        raise JobsError(
            f"{origin}: token file {path} lies inside the working directory {working_dir} that is uploaded: "
            "keep it outside (e.g. ~/.ray/, mode 600) and point RAY_AUTH_TOKEN_PATH or --token-file at it"
        )


def job_server(
    address: str | None = None,
    *,
    token_file: str | os.PathLike | None = None,
    allow_insecure: bool = False,
    environ: Mapping[str, str] | None = None,
):
    """A `ray.job_submission.JobSubmissionClient` for the job server, with the token header when there is one."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    address = check_address(address or default_address(environ), allow_insecure=allow_insecure)
    token = resolve_token(token_file, environ)
    if token and address.startswith("http://") and not is_loopback(urlsplit(address).hostname or ""):
        print("albert: warning: sending the cluster token over plain http (--allow-insecure-http)", file=sys.stderr)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        return JobSubmissionClient(address, headers=headers)
    except AuthenticationError:
        raise JobsError(_auth_refused(address, token is not None)) from None
    except (ConnectionError, RuntimeError) as err:
        raise JobsError(f"cannot reach the Ray job server at {address}: {_first_line(err)}") from None


def _auth_refused(address: str, sent_token: bool) -> str:
    what = "rejected the token sent" if sent_token else "requires a token and none was found"
    return (
        f"the job server at {address} {what}: put the cluster's token in a file and set {TOKEN_PATH_ENV}=FILE "
        "(or pass --token-file FILE); on the head node `ray get-auth-token` prints it"
    )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _call(client, method: str, *args: Any, **kwargs: Any):
    """client.method(...), with Ray's errors turned into one-line JobsErrors."""
    from ray.exceptions import AuthenticationError

    try:
        return getattr(client, method)(*args, **kwargs)
    except AuthenticationError:
        raise JobsError("the job server refused the request: missing or wrong cluster token") from None
    except (ConnectionError, RuntimeError) as err:
        raise JobsError(f"{method.replace('_', ' ')} failed: {_first_line(err)}") from None


# --- submission ----------------------------------------------------------------------------------------


def build_entrypoint(kind: str, args: list[str]) -> str:
    if kind not in JOB_KINDS:
        raise JobsError(f"job kind {kind!r}: expected one of {', '.join(JOB_KINDS)}")
    return shlex.join(["python", "-m", "services.cli", kind, *args])


def build_runtime_env(working_dir: str | os.PathLike = ".", extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """runtime_env with the working dir packaged (EXCLUDES left out); `extra` adds env_vars, pip, excludes..."""
    extra = dict(extra or {})
    working_dir = str(extra.pop("working_dir", working_dir))
    if "://" not in working_dir and not Path(working_dir).is_dir():
        raise JobsError(f"working_dir {working_dir!r}: not a directory")
    env = {"working_dir": working_dir, "excludes": [*EXCLUDES, *extra.pop("excludes", [])]}
    env_vars = extra.get("env_vars", {})
    if not (isinstance(env_vars, dict) and all(isinstance(v, str) for v in env_vars.values())):
        raise JobsError(f"runtime_env.env_vars: expected a mapping of names to strings, got {env_vars!r}")
    if TOKEN_ENV in env_vars:
        raise JobsError(f"runtime_env.env_vars.{TOKEN_ENV}: refused; the cluster's nodes hold the token already")
    env.update(extra)
    env["env_vars"] = {STOP_WAIT_ENV: str(STOP_WAIT_S), **env_vars}
    return env


def submit_entrypoint(
    entrypoint: str,
    *,
    address: str | None = None,
    working_dir: str | os.PathLike = ".",
    runtime_env: Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
    token_file: str | os.PathLike | None = None,
    allow_insecure: bool = False,
    wait: bool = False,
    timeout_s: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> str:
    """Submit a shell command as a Ray job; returns the job id. `wait` blocks until it ends, and raises
    JobFailedError unless it SUCCEEDED."""
    env = build_runtime_env(working_dir, runtime_env)
    environ = os.environ if environ is None else environ
    check_token_outside(env["working_dir"], token_file, environ)
    token = resolve_token(token_file, environ)
    if token and (token in entrypoint or token in json.dumps(env)):
        raise JobsError("refusing to submit: the cluster token would be stored in the job's entrypoint/runtime_env")
    client = job_server(address, token_file=token_file, allow_insecure=allow_insecure, environ=environ)
    job_id = _call(client, "submit_job", entrypoint=entrypoint, runtime_env=env, metadata=dict(metadata or {}))
    if wait:
        status = _wait(client, job_id, timeout_s)
        if status != "SUCCEEDED":
            raise JobFailedError(job_id, status, _call(client, "get_job_info", job_id).message or "")
    return job_id


def submit(
    kind: str,
    args: list[str],
    *,
    address: str | None = None,
    working_dir: str | os.PathLike = ".",
    runtime_env: Mapping[str, Any] | None = None,
    token_file: str | os.PathLike | None = None,
    allow_insecure: bool = False,
    wait: bool = False,
    timeout_s: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> str:
    """Submit `albert KIND ARGS...` (e.g. submit("pretrain", ["--config", "configs/tiny.toml"])); returns the id."""
    return submit_entrypoint(
        build_entrypoint(kind, list(args)),
        address=address,
        working_dir=working_dir,
        runtime_env=runtime_env,
        metadata={"albert_kind": kind},
        token_file=token_file,
        allow_insecure=allow_insecure,
        wait=wait,
        timeout_s=timeout_s,
        environ=environ,
    )


def _wait(client, job_id: str, timeout_s: float | None, poll_s: float = 0.5) -> str:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        status = str(_call(client, "get_job_status", job_id).value)
        if status in TERMINAL_STATUSES:
            return status
        if deadline is not None and time.monotonic() > deadline:
            raise JobsError(f"job {job_id} still {status} after {timeout_s:g}s")
        time.sleep(poll_s)


# --- inspection ----------------------------------------------------------------------------------------


def list_jobs(
    *,
    address: str | None = None,
    token_file: str | os.PathLike | None = None,
    allow_insecure: bool = False,
    environ: Mapping[str, str] | None = None,
) -> list[JobRecord]:
    """Submitted jobs, oldest first."""
    client = job_server(address, token_file=token_file, allow_insecure=allow_insecure, environ=environ)
    records = [_record(info) for info in _call(client, "list_jobs") if info.submission_id]
    return sorted(records, key=lambda r: r.start_time or 0.0)


def job_status(
    job_id: str,
    *,
    address: str | None = None,
    token_file: str | os.PathLike | None = None,
    allow_insecure: bool = False,
    environ: Mapping[str, str] | None = None,
) -> JobRecord:
    client = job_server(address, token_file=token_file, allow_insecure=allow_insecure, environ=environ)
    return _record(_call(client, "get_job_info", job_id))


def job_logs(
    job_id: str,
    *,
    follow: bool = False,
    out: TextIO | None = None,
    address: str | None = None,
    token_file: str | os.PathLike | None = None,
    allow_insecure: bool = False,
    environ: Mapping[str, str] | None = None,
) -> str:
    """The job's driver output so far; with `follow`, stream it to `out` (stdout) until the job ends."""
    client = job_server(address, token_file=token_file, allow_insecure=allow_insecure, environ=environ)
    if not follow:
        return _call(client, "get_job_logs", job_id)
    out = sys.stdout if out is None else out
    chunks: list[str] = []

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            chunks.append(chunk)
            out.write(chunk)
            out.flush()

    try:
        asyncio.run(tail())
    except Exception as err:  # aiohttp's errors: the connection dropped or the server refused the websocket
        raise JobsError(f"following the logs of {job_id} failed: {_first_line(err)}") from None
    return "".join(chunks)


def stop_job(
    job_id: str,
    *,
    wait: bool = False,
    timeout_s: float | None = 60.0,
    address: str | None = None,
    token_file: str | os.PathLike | None = None,
    allow_insecure: bool = False,
    environ: Mapping[str, str] | None = None,
) -> str:
    """Ask the job to stop (SIGTERM, then SIGKILL after the job's RAY_JOB_STOP_WAIT_TIME_S, STOP_WAIT_S unless it set
    another; a pretraining job checkpoints at its next step and exits 143 in between); returns its status (after it
    ended, with `wait`)."""
    client = job_server(address, token_file=token_file, allow_insecure=allow_insecure, environ=environ)
    _call(client, "stop_job", job_id)
    if wait:
        return _wait(client, job_id, timeout_s)
    return str(_call(client, "get_job_status", job_id).value)


def _record(info) -> JobRecord:
    ms = lambda t: t / 1000.0 if t else None
    return JobRecord(
        job_id=info.submission_id or info.job_id or "",
        status=str(info.status.value),
        entrypoint=info.entrypoint or "",
        start_time=ms(info.start_time),
        end_time=ms(info.end_time),
        message=info.message or "",
    )


# --- `albert submit`'s command line (services.cli parses it) ---------------------------------------------

# Submit options that may also follow KIND and its arguments (`albert submit pretrain --config c.toml --address
# URL --wait`); everything after a `--` goes to the job untouched.
_VALUE_OPTIONS = ("--address", "--token-file", "--working-dir", "--env")
_FLAG_OPTIONS = ("--wait", "--allow-insecure-http")


def split_submit_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(submit's own options, the job's arguments) from what follows KIND on the command line."""
    own: list[str] = []
    job: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if arg == "--":
            job.extend(args[i + 1 :])
            break
        if arg in _FLAG_OPTIONS:
            own.append(arg)
        elif name in _VALUE_OPTIONS and "=" in arg:
            own.append(arg)
        elif arg in _VALUE_OPTIONS:
            if i + 1 >= len(args):
                raise JobsError(f"{arg}: expected a value")
            own.extend(args[i : i + 2])
            i += 1
        else:
            job.append(arg)
        i += 1
    return own, job
