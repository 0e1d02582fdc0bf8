"""Job submission (services/cluster.py) against a real local multi-node Ray cluster with token auth on.

The module's cluster comes from scripts/local_cluster.sh with its own dir, ports and token; the script stops it by
signalling the `ray start --block` processes it started (which kill what they launched), never with `ray stop`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from services import cluster as jobs
from services.jobs import cli as jobs_cli
from services.terminal import EXIT_DATA, EXIT_FAILED
from tests.worker_callbacks import callbacks_command

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, root: Path, token: str, token_file: Path, address: str, start_output: str):
        self.root, self.token, self.token_file, self.address = root, token, token_file, address
        self.start_output = start_output

    def conn(self) -> dict:
        """Connection keywords: this cluster's address and token file, nothing taken from the environment."""
        return {"address": self.address, "token_file": self.token_file, "environ": {}}


@pytest.fixture(scope="module")
def cluster():
    """A two-node cluster (head + one worker, 1 CPU each) started by scripts/local_cluster.sh in its own dir."""
    root = Path(tempfile.mkdtemp(prefix="albert-jobs-", dir="/tmp"))  # short: Ray's socket paths live under it
    token = secrets.token_hex(32)
    token_file = root / "auth_token"  # the script keeps a token file that is already there
    token_file.write_text(token)
    token_file.chmod(0o600)
    dashboard_port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "RAY_API"))}
    env.update(
        ALBERT_VENV=str(Path(sys.executable).parent.parent),
        ALBERT_CLUSTER_DIR=str(root),
        ALBERT_WORKERS="1",
        ALBERT_GCS_PORT=str(_free_port()),
        ALBERT_DASHBOARD_PORT=str(dashboard_port),
        ALBERT_OBJECT_STORE_MB="256",
    )
    script = ["bash", str(REPO / "scripts" / "local_cluster.sh")]
    try:
        started = subprocess.run([*script, "start"], env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stdout + started.stderr
        yield Cluster(root, token, token_file, f"http://127.0.0.1:{dashboard_port}", started.stdout)
    finally:
        subprocess.run([*script, "stop"], env=env, capture_output=True, timeout=120)
        leftovers = _processes_mentioning(str(root))
        for pid in leftovers:  # only processes whose command line names this module's cluster dir
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
        assert not leftovers, f"local_cluster.sh stop left processes behind: {leftovers}"


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.fixture(scope="module")
def model_info_job(cluster) -> str:
    return jobs.submit("model", ["info"], working_dir=REPO, wait=True, timeout_s=120, **cluster.conn())


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="albert")
    jobs_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except jobs.JobsError as err:  # as services.cli.main reports it
        print(f"albert: error: {err}", file=sys.stderr)
        return EXIT_FAILED if isinstance(err, jobs.JobFailedError) else EXIT_DATA


# --- against the cluster -------------------------------------------------------------------------------


def test_local_cluster_script_starts_a_head_and_a_worker_node_and_prints_the_job_address(cluster):
    assert "2 nodes, 2 CPUs" in cluster.start_output
    assert f"RAY_ADDRESS={cluster.address}" in cluster.start_output
    assert cluster.token not in cluster.start_output


def test_job_tasks_run_on_both_nodes(cluster, tmp_path):
    (tmp_path / "spread.py").write_text(
        "import ray, time\n"
        "ray.init()\n"
        "@ray.remote(num_cpus=1)\n"
        "def node():\n"
        "    time.sleep(0.5)\n"
        "    return ray.get_runtime_context().get_node_id()\n"
        "print('NODES', len(set(ray.get([node.remote() for _ in range(4)]))))\n"
    )
    job_id = jobs.submit_entrypoint("python spread.py", working_dir=tmp_path, wait=True, timeout_s=90, **cluster.conn())
    assert "NODES 2" in jobs.job_logs(job_id, **cluster.conn()).splitlines()


def test_submitted_model_info_job_succeeds_and_logs_the_preset_table(cluster, model_info_job):
    assert jobs.job_status(model_info_job, **cluster.conn()).status == "SUCCEEDED"
    logs = jobs.job_logs(model_info_job, **cluster.conn())
    assert "albert-xxlarge" in logs and "222.6M" in logs


def test_list_jobs_shows_the_submitted_job_with_its_entrypoint(cluster, model_info_job):
    records = {r.job_id: r for r in jobs.list_jobs(**cluster.conn())}
    assert records[model_info_job].entrypoint == "python -m services.cli model info"
    assert records[model_info_job].status == "SUCCEEDED"


def test_following_logs_of_a_finished_job_returns_its_whole_output(cluster, model_info_job, capsys):
    streamed = jobs.job_logs(model_info_job, follow=True, **cluster.conn())
    assert "albert-tiny" in streamed
    assert "albert-tiny" in capsys.readouterr().out


def test_stopping_a_long_running_job_ends_it_stopped(cluster):
    job_id = jobs.submit_entrypoint(
        'python -c "import time; time.sleep(60)"', working_dir=REPO / "configs", **cluster.conn()
    )
    deadline = time.monotonic() + 60
    while jobs.job_status(job_id, **cluster.conn()).status == "PENDING":
        assert time.monotonic() < deadline, "job never started"
        time.sleep(0.5)
    started = time.monotonic()
    assert jobs.stop_job(job_id, wait=True, timeout_s=30, **cluster.conn()) == "STOPPED"
    assert time.monotonic() - started < 30  # stopped, not run to the end of its 60 s


def test_failing_job_with_wait_raises_naming_job_and_status(cluster):
    with pytest.raises(jobs.JobFailedError, match=r"raysubmit_\w+ ended FAILED"):
        jobs.submit("model", ["info", "--no-such-flag"], working_dir=REPO, wait=True, **cluster.conn())


def test_working_dir_upload_leaves_out_venvs_caches_corpora_and_runs(cluster, tmp_path):
    for name in (".venv/bin", ".cache/albert", "data/corpus", "runs/tiny", ".git/objects"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "f").write_text("x")
    (tmp_path / "train.py").write_text("print('hi')\n")
    job_id = jobs.submit_entrypoint(
        "python -c \"import os; print('LISTING', sorted(os.listdir('.')))\"",
        working_dir=tmp_path,
        wait=True,
        timeout_s=60,
        **cluster.conn(),
    )
    listing = next(line for line in jobs.job_logs(job_id, **cluster.conn()).splitlines() if line.startswith("LISTING"))
    assert listing == "LISTING ['train.py']"


def test_cluster_rejects_a_client_without_the_token(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token to fall back on
    with pytest.raises(jobs.JobsError, match="requires a token and none was found"):
        jobs.list_jobs(address=cluster.address, environ={})


def test_cluster_rejects_a_wrong_token(cluster, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_text(secrets.token_hex(32))
    wrong.chmod(0o600)
    with pytest.raises(jobs.JobsError, match="rejected the token"):
        jobs.list_jobs(address=cluster.address, token_file=wrong, environ={})


def test_token_read_from_ray_auth_token_path_env_is_accepted(cluster):
    environ = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(cluster.token_file)}
    assert isinstance(jobs.list_jobs(address=cluster.address, environ=environ), list)


def test_token_never_appears_in_cli_output_logs_or_job_records(cluster, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    conn = ["--address", cluster.address, "--token-file", str(cluster.token_file)]
    assert cli(["submit", "model", "info", "--preset", "albert-base", *conn, "--wait"]) == 0
    submitted = capsys.readouterr().out
    job_id = submitted.split()[1].rstrip(":")
    assert "11.7M" in submitted  # the job's own output was streamed
    assert cli(["jobs", "list", *conn]) == 0
    assert cli(["jobs", "status", job_id, *conn]) == 0
    assert cli(["jobs", "logs", job_id, *conn]) == 0
    out = capsys.readouterr()
    assert job_id in out.out and "SUCCEEDED" in out.out
    everything = submitted + out.out + out.err + caplog.text + repr(jobs.list_jobs(**cluster.conn()))
    assert cluster.token not in everything


def test_cli_reports_an_unknown_job_id_as_an_error(cluster, capsys):
    code = cli(["jobs", "status", "raysubmit_doesnotexist", "--address", cluster.address, "--token-file",
                str(cluster.token_file)])  # fmt: skip
    assert code == EXIT_DATA
    assert "raysubmit_doesnotexist" in capsys.readouterr().err


# --- without a cluster ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address", ["http://10.1.2.3:8265", "http://head.example.com:8265", "http://localhost.example.com:8265"]
)
def test_plain_http_to_a_host_that_is_not_loopback_is_refused_with_the_reason(address, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token of this machine's own (Ray writes one 0644)
    with pytest.raises(jobs.InsecureAddressError, match="SSH tunnel"):
        jobs.submit("model", ["info"], address=address, working_dir=REPO, environ={})


def test_cli_refuses_plain_http_to_a_remote_host_before_connecting(capsys):
    assert cli(["submit", "model", "info", "--address", "http://192.0.2.10:8265"]) == EXIT_DATA
    err = capsys.readouterr().err
    assert "refusing plain http to 192.0.2.10" in err and "--allow-insecure-http" in err


@pytest.mark.parametrize(
    "address", ["http://127.0.0.1:8265", "http://127.8.9.10:8265", "http://localhost:8265", "http://[::1]:8265"]
)
def test_plain_http_to_loopback_is_accepted(address):
    assert jobs.check_address(address + "/") == address


def test_https_and_allow_insecure_accept_remote_hosts():
    assert jobs.check_address("https://head.example.com:8265") == "https://head.example.com:8265"
    assert jobs.check_address("http://10.1.2.3:8265", allow_insecure=True) == "http://10.1.2.3:8265"


@pytest.mark.parametrize("address", ["10.1.2.3:6379", "ray://10.1.2.3:10001", "auto"])
def test_addresses_that_are_not_job_server_urls_are_refused(address):
    with pytest.raises(jobs.JobsError, match="expected http://HOST:PORT"):
        jobs.check_address(address)


def test_address_defaults_to_ray_address_env():
    assert jobs.default_address({"RAY_ADDRESS": "http://127.0.0.1:9999"}) == "http://127.0.0.1:9999"
    with pytest.raises(jobs.JobsError, match="--address"):
        jobs.default_address({})


def test_token_lookup_follows_rays_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("from-home\n")
    path = tmp_path / "tok"
    path.write_text("from-path\n")
    for private in (path, tmp_path / ".ray" / "auth_token"):
        private.chmod(0o600)
    assert jobs.resolve_token(environ={}) == "from-home"
    assert jobs.resolve_token(environ={"RAY_AUTH_TOKEN_PATH": str(path)}) == "from-path"
    assert jobs.resolve_token(environ={"RAY_AUTH_TOKEN_PATH": str(path), "RAY_AUTH_TOKEN": "from-env"}) == "from-env"
    assert jobs.resolve_token(environ={"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "from-env"}) is None


def test_token_mode_without_a_token_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(jobs.JobsError, match="RAY_AUTH_MODE=token but no token"):
        jobs.resolve_token(environ={"RAY_AUTH_MODE": "token"})


def test_unreadable_token_path_is_an_error_naming_the_file(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(jobs.JobsError, match=f"RAY_AUTH_TOKEN_PATH: cannot read token file {missing}"):
        jobs.resolve_token(environ={"RAY_AUTH_TOKEN_PATH": str(missing)})


def test_submit_refuses_to_store_the_token_in_the_runtime_env(tmp_path):
    token = tmp_path / "tok"
    token.write_text("s3cr3t-token-value")
    token.chmod(0o600)
    with pytest.raises(jobs.JobsError, match="token would be stored"):
        jobs.submit(
            "model",
            ["info"],
            address="http://127.0.0.1:1",
            working_dir=REPO,
            runtime_env={"env_vars": {"MY_TOKEN": "s3cr3t-token-value"}},
            token_file=token,
        )


def test_entrypoint_runs_the_uploaded_cli_with_quoted_arguments():
    entrypoint = jobs.build_entrypoint("pretrain", ["--config", "configs/my run.toml"])
    assert entrypoint == "python -m services.cli pretrain --config 'configs/my run.toml'"


def test_unknown_job_kind_is_refused():
    with pytest.raises(jobs.JobsError, match="job kind 'shell'"):
        jobs.build_entrypoint("shell", ["rm", "-rf", "/"])


def test_missing_working_dir_is_refused_naming_it(tmp_path):
    with pytest.raises(jobs.JobsError, match="not a directory"):
        jobs.build_runtime_env(tmp_path / "absent")


def test_submit_options_after_the_job_arguments_are_taken_by_submit():
    own, job = jobs.split_submit_args(["--config", "c.toml", "--address", "http://127.0.0.1:8265", "--wait"])
    assert own == ["--address", "http://127.0.0.1:8265", "--wait"]
    assert job == ["--config", "c.toml"]


def test_arguments_after_a_double_dash_go_to_the_job_untouched():
    own, job = jobs.split_submit_args(["--config", "c.toml", "--", "--wait", "--address=x"])
    assert own == [] and job == ["--config", "c.toml", "--wait", "--address=x"]


# --- cluster/ deployment files -------------------------------------------------------------------------

CLUSTER = REPO / "cluster"
LAUNCHER_FILES = sorted(CLUSTER.glob("gcp-*.yaml"))
KUBERAY_FILES = sorted((CLUSTER / "kuberay").glob("*.yaml"))
TOKEN_SECRET = {"name": "albert-ray-token", "key": "auth_token"}


def _yaml_docs(path: Path) -> list[dict]:
    import yaml

    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _launcher(path: Path) -> dict:
    (config,) = _yaml_docs(path)
    return config


def _kuberay_objects() -> list[dict]:
    return [doc for path in KUBERAY_FILES for doc in _yaml_docs(path)]


def _ray_cluster_specs() -> list[dict]:
    specs = []
    for obj in _kuberay_objects():
        if obj["kind"] == "RayCluster":
            specs.append(obj["spec"])
        elif obj["kind"] == "RayJob":
            specs.append(obj["spec"]["rayClusterSpec"])
    return specs


def _pod_specs() -> list[dict]:
    """Every pod template of every Ray cluster (head, each worker group) and every RayJob submitter."""
    pods = []
    for spec in _ray_cluster_specs():
        pods.append(spec["headGroupSpec"]["template"])
        pods.extend(group["template"] for group in spec["workerGroupSpecs"])
    pods.extend(o["spec"]["submitterPodTemplate"] for o in _kuberay_objects() if o["kind"] == "RayJob")
    return pods


def test_every_ray_pod_gives_a_sigterm_time_to_checkpoint_before_sigkill():
    """A pod deleted (scale-down, node drain, a rollout) gets SIGTERM, then SIGKILL after its grace period: longer
    than train.stop_grace_s, in which a SIGTERM'd run saves a checkpoint at its next step."""
    from services.rundir.sections import TrainSection

    ray_pods = [pod for spec in _ray_cluster_specs() for pod in
                [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]]  # fmt: skip
    assert len(ray_pods) == 4
    for pod in ray_pods:
        assert pod["spec"]["terminationGracePeriodSeconds"] >= TrainSection().stop_grace_s + 10


def test_cluster_directory_holds_the_launcher_and_kuberay_files():
    assert {p.name for p in LAUNCHER_FILES} == {"gcp-tpu-v4.yaml", "gcp-tpu-v5e.yaml", "gcp-gpu.yaml"}
    assert {p.name for p in KUBERAY_FILES} == {"shared.yaml", "raycluster.yaml", "rayjob.yaml"}


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=lambda p: p.name)
def test_launcher_config_passes_rays_own_schema_and_node_type_checks(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _launcher(path)
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type"):
        assert key in config, f"{path.name}: no {key}"
    validate_config(prepare_config(config))  # Ray's schema, head_node_type among the types, worker bounds


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=lambda p: p.name)
def test_launcher_starts_ray_with_token_auth_the_venv_first_and_a_loopback_dashboard(path):
    config = _launcher(path)
    (head_start,) = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    (worker_start,) = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    assert "--dashboard-host=127.0.0.1" in head_start
    for command in (head_start, worker_start):
        assert "RAY_AUTH_MODE=token" in command
        assert command.index("PATH=$HOME/venv/bin:$PATH") < command.index("ray start")
    assert config["file_mounts"]["~/.ray/auth_token"].startswith("~/.ray/")  # the token reaches every node
    assert {".venv", "data", "runs", ".cache", ".git"} <= set(config["rsync_exclude"])


@pytest.mark.parametrize("path", [p for p in LAUNCHER_FILES if "tpu" in p.name], ids=lambda p: p.name)
def test_tpu_launcher_describes_a_multi_host_slice_with_one_ray_worker_per_host(path):
    from ray._private.accelerators import TPUAcceleratorManager, tpu

    config = _launcher(path)
    tpu_types = [t for t in config["available_node_types"].values() if "acceleratorType" in t["node_config"]]
    assert len(tpu_types) == 1
    node = tpu_types[0]
    accelerator = node["node_config"]["acceleratorType"]
    assert TPUAcceleratorManager.is_valid_tpu_accelerator_type(accelerator)
    chips_per_host = tpu.get_num_tpu_visible_chips_per_host(accelerator)
    chips = int(accelerator.rsplit("-", 1)[1]) // tpu.get_tpu_cores_per_chip(accelerator)
    assert chips // chips_per_host > 1  # a pod slice: several hosts
    assert node["resources"] == {"TPU": chips_per_host}
    assert node["node_config"]["runtimeVersion"]
    assert "PJRT_DEVICE=TPU" in " ".join(config["worker_start_ray_commands"])
    assert "torch_xla[tpu]==2.9.0" in " ".join(config["setup_commands"])


def test_gpu_launcher_node_types_declare_their_gpus_and_stop_on_host_maintenance():
    import re

    config = _launcher(CLUSTER / "gcp-gpu.yaml")
    gpu_types = {n: t for n, t in config["available_node_types"].items() if "GPU" in t["resources"]}
    assert len(gpu_types) >= 2
    for name, node in gpu_types.items():
        gpus = int(re.search(r"-(\d+)g$", node["node_config"]["machineType"]).group(1))
        assert node["resources"]["GPU"] == gpus, name
        assert node["node_config"]["scheduling"]["onHostMaintenance"] == "TERMINATE", name
    assert "NCCL_DEBUG" in " ".join(config["worker_start_ray_commands"])


def test_kuberay_objects_have_the_fields_kubernetes_and_kuberay_need():
    objects = _kuberay_objects()
    assert {o["kind"] for o in objects} >= {"RayCluster", "RayJob", "NetworkPolicy"}
    for obj in objects:
        assert obj["apiVersion"] and obj["metadata"]["name"] and ("spec" in obj or "data" in obj), obj["kind"]
        if obj["kind"] in ("RayCluster", "RayJob"):
            assert obj["apiVersion"] == "ray.io/v1"
    for spec in _ray_cluster_specs():
        assert spec["headGroupSpec"]["template"]["spec"]["containers"]
        assert all(group["groupName"] and group["template"]["spec"]["containers"] for group in spec["workerGroupSpecs"])


def test_kuberay_ray_version_and_image_base_match_the_installed_ray():
    import ray

    assert {spec["rayVersion"] for spec in _ray_cluster_specs()} == {ray.__version__}
    assert f"FROM rayproject/ray:{ray.__version__}-py311" in (CLUSTER / "Dockerfile").read_text()


def test_every_kuberay_ray_container_gets_token_auth_from_the_secret():
    for pod in _pod_specs():
        for container in pod["spec"]["containers"]:
            env = {e["name"]: e for e in container["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token", container["name"]
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == TOKEN_SECRET, container["name"]
            assert "value" not in env["RAY_AUTH_TOKEN"]  # never a literal token in a manifest


def test_kuberay_dashboard_stays_inside_the_cluster_and_the_network_policy_covers_every_pod():
    objects = _kuberay_objects()
    assert not [o for o in objects if o["kind"] in ("Ingress", "Service")]
    assert {spec["headGroupSpec"]["serviceType"] for spec in _ray_cluster_specs()} == {"ClusterIP"}
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": selector}}]}]
    for pod in _pod_specs():
        assert selector.items() <= pod["metadata"]["labels"].items()


def test_rayjob_recipe_is_a_valid_run_config_on_the_shared_volume():
    import shlex
    import tomllib

    from services.rundir.config import RunConfig

    objects = _kuberay_objects()
    (job,) = [o for o in objects if o["kind"] == "RayJob"]
    config_path = Path(shlex.split(job["spec"]["entrypoint"])[-1])
    assert shlex.split(job["spec"]["entrypoint"])[:4] == ["python", "-m", "services.cli", "pretrain"]
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
    recipe = RunConfig.from_dict(tomllib.loads(config_map["data"][config_path.name]), source="rayjob.yaml")
    spec = job["spec"]["rayClusterSpec"]
    for pod in [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]:
        mounts = {m["mountPath"]: m["name"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes[mounts[str(config_path.parent)]]["configMap"]["name"] == config_map["metadata"]["name"]
        shared = next(path for path, name in mounts.items() if "persistentVolumeClaim" in volumes[name])
        assert Path(recipe.run.output_dir).is_relative_to(shared) and Path(recipe.data.shards).is_relative_to(shared)
    gpus = sum(g["replicas"] * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
               for g in spec["workerGroupSpecs"])  # fmt: skip
    assert recipe.train.backend == "cuda" and recipe.train.num_workers == gpus


def test_unreachable_job_server_is_reported_with_its_address():
    address = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(jobs.JobsError, match=f"cannot reach the Ray job server at {address}"):
        jobs.list_jobs(address=address, environ={"RAY_AUTH_MODE": "disabled"})


def test_runtime_env_extras_add_env_vars_and_excludes_to_the_defaults():
    env = jobs.build_runtime_env(REPO, {"env_vars": {"ALBERT_X": "1"}, "excludes": ["big/"]})
    assert env["env_vars"] == {"ALBERT_X": "1", "RAY_JOB_STOP_WAIT_TIME_S": str(jobs.STOP_WAIT_S)}
    # `albert jobs stop` leaves a pretraining job its train.stop_grace_s (25 s) before SIGKILL, not Ray's 3 s
    assert jobs.STOP_WAIT_S > 25
    own = jobs.build_runtime_env(REPO, {"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "90"}})
    assert own["env_vars"] == {"RAY_JOB_STOP_WAIT_TIME_S": "90"}
    assert env["excludes"] == [*jobs.EXCLUDES, "big/"]
    assert env["working_dir"] == str(REPO)


def test_runtime_env_refuses_the_token_variable():
    with pytest.raises(jobs.JobsError, match="RAY_AUTH_TOKEN: refused"):
        jobs.build_runtime_env(REPO, {"env_vars": {"RAY_AUTH_TOKEN": "x"}})


def test_a_submitted_tiny_pretraining_runs_to_completion_and_is_visible_through_albert_jobs(cluster, tmp_path, capsys):
    """`albert submit pretrain` on the loopback cluster: real shards, Ray Train, the coordinator, a final eval."""
    from services.rundir.ledger import LEDGER_FILE
    from services.rundir.status import read_status

    config = tiny_job_recipe(tmp_path, "job-run", total_steps=3, checkpoint_every=3, eval_options="")
    job_id = jobs.submit("pretrain", ["--config", str(config), "--no-progress"], working_dir=REPO, **cluster.conn())
    run_dir = tmp_path / "runs" / "job-run"
    seen_live = False
    deadline = time.monotonic() + 400
    while jobs.job_status(job_id, **cluster.conn()).status not in jobs.TERMINAL_STATUSES:
        assert time.monotonic() < deadline, "the job did not end within 400 s"
        if (run_dir / LEDGER_FILE).is_file():  # albert status, from the run directory alone, while the job runs
            seen_live = seen_live or read_status(run_dir)["live"]
        time.sleep(0.5)
    assert seen_live
    assert jobs.job_status(job_id, **cluster.conn()).status == "SUCCEEDED"
    logs = jobs.job_logs(job_id, **cluster.conn())
    assert "finished at step 3" in logs
    lines = [json.loads(line) for line in (tmp_path / "runs" / "job-run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if line["kind"] == "train"] == [1, 2, 3]
    assert any(line["kind"] == "eval" and "mlm_acc" in line for line in lines)
    assert cli(["jobs", "status", job_id, "--address", cluster.address, "--token-file", str(cluster.token_file)]) == 0
    assert "SUCCEEDED" in capsys.readouterr().out


NO_EVAL_BESIDE = "every_steps = 0\ncpus = 0\n"  # [eval] lines: no evaluation beside training, none holding a CPU


def tiny_job_recipe(
    tmp_path: Path, name: str, total_steps: int, checkpoint_every: int, eval_options: str = NO_EVAL_BESIDE
) -> Path:
    """A tiny pretraining recipe on fresh shards with held-out documents, for a job on the loopback cluster;
    `eval_options`: further [eval] lines."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from albert_core.examples.shards import HELDOUT_FILE, HELDOUT_SCHEMA
    from tests.test_train import MODEL, write_shards

    shards = write_shards(tmp_path / "shards", (24,))
    heldout = shards / HELDOUT_FILE
    heldout.parent.mkdir(parents=True)
    docs = [
        {"doc_id": i, "sentences": [[7, 8, 9], [10, 11]], "word_starts": [[True] * 3, [True] * 2]} for i in range(8)
    ]
    pq.write_table(pa.Table.from_pylist(docs, schema=HELDOUT_SCHEMA), heldout)
    model = ", ".join(f"{k} = {v}" for k, v in MODEL.items())
    recipe = tmp_path / f"{name}.toml"
    recipe.write_text(
        f"""
[run]
name = "{name}"
output_dir = "{tmp_path / "runs"}"
[model]
preset = "albert-tiny"
overrides = {{ vocab_size = 0, {model} }}
[data]
shards = "{shards}"
max_seq_length = 32
[optim]
lr = 0.01
warmup_steps = 1
total_steps = {total_steps}
[train]
global_batch_size = 8
micro_batch_size = 8
num_workers = 1
log_every = 1
checkpoint_every = {checkpoint_every}
[eval]
batch_size = 4
heldout_batches = 2
{eval_options}"""
    )
    return recipe


def train_lines(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines[:-1] if '"kind": "train"' in line]  # the last may be half written


@pytest.mark.skipif(
    os.environ.get("ALBERT_CLUSTER_SOAK") != "1",
    reason="two pretraining jobs on the loopback cluster (about 2 minutes): ALBERT_CLUSTER_SOAK=1 runs it",
)
@pytest.mark.slow
def test_albert_jobs_stop_checkpoints_the_pretraining_job_at_its_next_step_and_the_resubmitted_job_redoes_none(
    cluster, tmp_path
):
    recipe = tiny_job_recipe(tmp_path, "stopped-job", total_steps=5000, checkpoint_every=1000)
    run_dir, trace = tmp_path / "runs" / "stopped-job", tmp_path / "trace"
    args = ["--config", str(recipe), "--no-progress"]

    def traced(args: list[str]) -> str:  # `albert pretrain ARGS` with the example trace (tests/worker_callbacks.py)
        return shlex.join(callbacks_command(["pretrain", *args], trace=trace, python="python"))

    job_id = jobs.submit_entrypoint(traced(args), working_dir=REPO, **cluster.conn())
    deadline = time.monotonic() + 300
    while max((line["step"] for line in train_lines(run_dir)), default=0) < 10:
        assert time.monotonic() < deadline, jobs.job_logs(job_id, **cluster.conn())[-3000:]
        time.sleep(0.3)
    stopping = time.monotonic()
    assert jobs.stop_job(job_id, wait=True, timeout_s=120, **cluster.conn()) == "STOPPED"
    took = time.monotonic() - stopping
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (stopped,) = [line for line in lines if line.get("event") == "stopped"]
    assert stopped["signal"] == "SIGTERM" and stopped["checkpoint_step"] == stopped["step"] >= 10
    assert (run_dir / "checkpoints" / f"step_{stopped['step']:08d}").is_dir()
    assert f"stopped at step {stopped['step']}" in jobs.job_logs(job_id, **cluster.conn())

    again = ["--config", str(recipe), "--no-progress", "--set", f"optim.total_steps={stopped['step'] + 2}"]
    jobs.submit_entrypoint(traced(again), working_dir=REPO, wait=True, timeout_s=300, **cluster.conn())
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if line.get("event") == "resumed"] == [stopped["step"]]
    traced = [
        (r["rank"], r["step"]) for p in trace.glob("rank*.jsonl") for r in map(json.loads, p.read_text().splitlines())
    ]
    redone = len(traced) - len(set(traced))
    print(f"\njobs stop at step {stopped['step']}: STOPPED after {took:.1f} s, steps redone by the resume {redone}")
    assert redone == 0
