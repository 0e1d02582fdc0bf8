"""train.backend = "xla" end to end: real Ray Train runs (PJRT CPU) of the pretraining loop.

The same tiny run on backend cpu and backend xla takes the same steps (dropout 0: the two RNGs differ), on 1 worker
and on 2 workers (each worker one PJRT replica: gradients summed over the gloo group through host copies); its
checkpoints load with plain torch, and a crashed xla run resumed from its checkpoint (read on the CPU, copied to the
device) repeats the uninterrupted run's steps, through dropout removal. XLA:CPU has no cross-device collectives, so
the in-graph all-reduce over PJRT replicas (xm.all_reduce) is not exercised here.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip(
    "torch_xla", reason="torch_xla is not installed: run the XLA tier with scripts/test_xla.sh (its own venv)"
)
pytest.importorskip("ray", reason="the XLA venv lacks ray: rebuild it with scripts/xla_venv.sh")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from albert_core.examples.shards import EXAMPLE_SCHEMA, example_id  # noqa: E402
from albert_core.model.checkpoint import load_model  # noqa: E402
from albert_core.model.config import ConfigError  # noqa: E402
from services.cluster import connect  # noqa: E402
from services.rundir.checkpoints import latest_good, list_checkpoints, verify
from services.rundir.config import RunConfig  # noqa: E402
from services.rundir.log import read_metrics as read_log  # noqa: E402
from services.rundir.sections import TrainSection  # noqa: E402
from services.train.callbacks import installed  # noqa: E402
from services.train.plan import pjrt_device_for
from tests.runs import run_training
from tests.worker_callbacks import CrashAfterStep, TraceExamples, crash_message  # noqa: E402


def read_metrics(path) -> list[dict]:
    """The train lines of a run's metrics log (which also holds the run's events)."""
    return [r for r in read_log(path) if r.get("kind") == "train"]


VOCAB = 96
SEQ = 136  # buckets (128, 136): rows of 8..136 tokens make steps of both widths
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)
MODEL = dict(
    embedding_size=32,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    max_position_embeddings=160,
)
# Absolute, on losses of ~5 and weights of ~0.1 (float32 sums in another order; measured ~1e-6).
LOSS_TOLERANCE = 1e-4
WEIGHT_TOLERANCE = 1e-4


def write_shards(root: Path, file_rows=(16, 16), seed: int = 0) -> Path:
    """Real Parquet shards in EXAMPLE_SCHEMA: [CLS] A [SEP] B [SEP] rows of 8 to SEQ random word pieces."""
    rng = np.random.default_rng(seed)
    (root / "train").mkdir(parents=True)
    for shard, n_rows in enumerate(file_rows):
        rows = {name: [] for name in EXAMPLE_SCHEMA.names}
        for row in range(n_rows):
            length = int(rng.integers(8, SEQ + 1))
            n_a = int(rng.integers(1, length - 4))
            n_b = length - n_a - 3
            ids = [2, *rng.integers(5, VOCAB, n_a), 3, *rng.integers(5, VOCAB, n_b), 3]
            starts = rng.random(length) < 0.7
            starts[[0, 1, n_a + 1, n_a + 2, length - 1]] = True
            rows["example_id"].append(example_id(shard, row))
            rows["input_ids"].append(ids)
            rows["token_type_ids"].append([0] * (n_a + 2) + [1] * (n_b + 1))
            rows["word_starts"].append(starts.tolist())
            rows["pair_label"].append(int(rng.integers(0, 2)))
        pq.write_table(pa.table(rows, schema=EXAMPLE_SCHEMA), root / "train" / f"shard-{shard:05d}.parquet")
    (root / "manifest.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return root


def run_config(
    output: Path, shards: Path, name: str, *, backend: str, dropout: bool = False, workers: int = 1, steps: int = 6
) -> RunConfig:
    """workers x micro-batch 4 x accumulation 2. 1 worker: 32 rows = 4 steps per epoch; 6 steps cross into epoch 1.
    2 workers: one 16-row shard each, 2 steps per epoch."""
    return RunConfig.from_dict(
        {
            "run": {"name": name, "output_dir": str(output), "seed": 11},
            "model": {"preset": "albert-tiny", "overrides": {**MODEL, **({} if dropout else NO_DROPOUT)}},
            "data": {"shards": str(shards), "max_seq_length": SEQ},
            "optim": {"lr": 0.01, "warmup_steps": 2, "total_steps": steps},
            "train": {
                "backend": backend,
                "global_batch_size": 8 * workers,
                "micro_batch_size": 4,
                "num_workers": workers,
                "log_every": 1,
                "checkpoint_every": 3,
                "keep_last": 3,
                "dropout_removal_step": 5 if dropout else 0,
                "max_failures": 0,
            },
        }
    )


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback-only test cluster
    assert os.environ.get("PJRT_DEVICE") == "CPU"  # tests/xla/conftest.py: the driver asks for PJRT CPU
    started = not ray.is_initialized()
    if started:
        connect(num_cpus=2)  # as tests/conftest.py's ray_local
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("shards"))


@pytest.fixture(scope="module")
def cpu_and_xla(ray_cluster, shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    return {
        backend: run_training(run_config(out, shards, backend, backend=backend), resume=False)
        for backend in ("cpu", "xla")
    }


@pytest.fixture(scope="module")
def two_workers_cpu_and_xla(ray_cluster, shards, tmp_path_factory):
    """The same 4 steps on 2 workers, backend cpu then xla, each with its example trace (one file per rank)."""
    out = tmp_path_factory.mktemp("two_workers")
    runs = {}
    for backend in ("cpu", "xla"):
        trace = out / f"trace-{backend}"
        config = run_config(out, shards, f"two-{backend}", backend=backend, workers=2, steps=4)
        with installed(TraceExamples(trace)):
            runs[backend] = (run_training(config, resume=False), trace)
    return runs


@pytest.fixture(scope="module")
def xla_crashed_then_resumed(ray_cluster, shards, tmp_path_factory):
    """Dropout 0.1 until step 5; stopped after step 5 (checkpoint at 3: steps 4-5 lost), then resumed to step 6.

    The crashed run's own steps 1-5 are the reference for the resumed run's steps 4-5 (one Ray run less than an
    uninterrupted run would cost): resuming mid-epoch 1 redoes them from the checkpoint, and removes dropout at 5.
    """
    config = run_config(tmp_path_factory.mktemp("resume"), shards, "crashy", backend="xla", dropout=True)
    with installed(CrashAfterStep(5)), pytest.raises(Exception, match=crash_message(5)):
        run_training(config, resume=False)
    crashed = read_metrics(config.run_dir / "metrics.jsonl")
    resumed = run_training(config, resume=True)
    return crashed, resumed


def step_table(records, keys=("loss", "mlm_loss", "pair_loss", "grad_norm", "mlm_acc", "pair_acc")) -> np.ndarray:
    return np.array([[r[k] for k in keys] for r in records])


# --- driver-side choices (no Ray) ----------------------------------------------------------------------


def test_tpu_resources_choose_the_tpu_runtime_whatever_the_driver_env_says():
    train = TrainSection(backend="xla", resources_per_worker={"TPU": 4})
    assert pjrt_device_for(train, {"PJRT_DEVICE": "CPU"}) == "TPU"  # the TPU cluster's head sets CPU


def test_gpu_resources_choose_the_cuda_runtime():
    assert pjrt_device_for(TrainSection(backend="xla", resources_per_worker={"GPU": 1}), {}) == "CUDA"


def test_the_cpu_runtime_is_used_only_when_pjrt_device_asks_for_it():
    train = TrainSection(backend="xla")
    assert pjrt_device_for(train, {"PJRT_DEVICE": "cpu"}) == "CPU"
    with pytest.raises(ConfigError, match="train.resources_per_worker: .* set PJRT_DEVICE=CPU"):
        pjrt_device_for(train, {})


def test_pjrt_device_tpu_without_tpu_resources_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="train.resources_per_worker: PJRT_DEVICE=TPU .* hold no TPU"):
        pjrt_device_for(TrainSection(backend="xla"), {"PJRT_DEVICE": "TPU"})


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({"CPU": 2}, "train.resources_per_worker: CPU is set by train.cpus_per_worker"),
        ({"TPU": 0}, "train.resources_per_worker: expected a resource name and a positive amount, got 'TPU' = 0"),
        ({"TPU": "4"}, "got 'TPU' = '4'"),
    ],
)
def test_bad_resources_per_worker_are_rejected_naming_the_field(resources, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_dict({"train": {"backend": "xla", "resources_per_worker": resources}})


def test_xla_workers_sum_in_graph_over_pjrt_replicas_through_the_host_over_ray_workers_or_refuse():
    from services.train.backends import all_reduce_sum as _all_reduce_sum
    from services.train.backends import xla_host_reduce as _xla_host_reduce
    from services.train.xla import XlaWorker

    def worker(replicas: int) -> XlaWorker:
        return XlaWorker(device=torch.device("cpu"), runtime="TPU", rank=0, world_size=replicas)

    assert _xla_host_reduce(worker(1), 1, None) is None  # one worker: nothing to sum
    assert _xla_host_reduce(worker(4), 4, _all_reduce_sum) is None  # the replicas are the workers: xm.all_reduce
    assert _xla_host_reduce(worker(1), 2, _all_reduce_sum) is _all_reduce_sum  # one replica each: gloo, on the host
    with pytest.raises(RuntimeError, match="train.num_workers: Ray started 2 xla workers without a torch.distributed"):
        _xla_host_reduce(worker(1), 2, None)
    with pytest.raises(RuntimeError, match="train.num_workers: Ray started 16 workers .* TPU runtime has 4 replicas"):
        _xla_host_reduce(worker(4), 16, _all_reduce_sum)


# --- the device loader the loop reads through (no Ray) ---------------------------------------------------


def cpu_batches(n: int, fail_at: int | None = None):
    for i in range(n):
        if i == fail_at:
            raise ValueError(f"example {i}: damaged row")
        yield {"input_ids": torch.full((2, 4), i, dtype=torch.int64)}


def test_device_loader_raises_the_error_of_its_source_after_the_batches_before_it():
    from services.train.xla import device_loader, setup_xla_worker

    device = setup_xla_worker().device
    got = []
    with device_loader(cpu_batches(5, fail_at=3), device) as loader:
        with pytest.raises(ValueError, match="example 3: damaged row"):
            for batch in loader:
                got.append(int(batch["input_ids"][0, 0].item()))
    assert got == [0, 1, 2]


def test_device_loader_closed_early_stops_reading_its_source():
    from services.train.xla import device_loader, setup_xla_worker

    device = setup_xla_worker().device
    read = []

    def source():
        for batch in cpu_batches(1000):
            read.append(batch)
            yield batch

    loader = device_loader(source(), device)
    next(loader)
    loader.close()
    after_close = len(read)
    time.sleep(0.3)
    assert len(read) == after_close  # the reading thread has ended: nothing more is read
    assert after_close < 100  # it had read ahead only its bounded prefetch (16 + 8 batches by default)


# --- real runs -----------------------------------------------------------------------------------------


def test_xla_run_takes_the_same_steps_as_the_cpu_run(cpu_and_xla):
    cpu = read_metrics(cpu_and_xla["cpu"].metrics_file)
    xla = read_metrics(cpu_and_xla["xla"].metrics_file)
    assert [r["step"] for r in xla] == [r["step"] for r in cpu] == list(range(1, 7))
    assert [r["epoch"] for r in xla] == [0] * 4 + [1] * 2
    assert [r["lr"] for r in xla] == [r["lr"] for r in cpu]
    a, b = step_table(cpu), step_table(xla)
    diff = np.abs(a - b).max(axis=0)
    print(f"\ncpu loss {a[:, 0].round(6).tolist()}\nxla loss {b[:, 0].round(6).tolist()}")
    print(f"max |diff| loss {diff[0]:.2e} mlm {diff[1]:.2e} pair {diff[2]:.2e} grad norm {diff[3]:.2e} acc {diff[4]}")
    assert np.ptp(a[:, 0]) > 100 * LOSS_TOLERANCE  # steps differ far more than the tolerance: matching is not trivial
    assert diff[:3].max() <= LOSS_TOLERANCE
    assert diff[3] <= LOSS_TOLERANCE * a[:, 3].max()
    assert diff[4:].max() <= 1 / 50  # accuracies: at most one argmax of ~60 masked tokens may flip


def test_xla_run_compiles_a_bounded_number_of_graphs(cpu_and_xla):
    compiles = [r["xla_compiles"] for r in read_metrics(cpu_and_xla["xla"].metrics_file)]
    print(f"\ngraphs compiled after each step: {compiles}")
    # first step (creates the optimizer state) + one per pair of micro-batch buckets (128|136 x 128|136)
    assert compiles[-1] <= 1 + 4
    assert compiles == sorted(compiles)


def test_xla_checkpoints_load_with_plain_torch_and_match_the_cpu_run(cpu_and_xla):
    cpu, xla = cpu_and_xla["cpu"], cpu_and_xla["xla"]
    assert xla.step == 6 and [s for s, _ in list_checkpoints(xla.run_dir / "checkpoints")] == [6, 3]
    verify(xla.checkpoint)
    weights = load_file(str(xla.checkpoint / "model.safetensors"))  # plain safetensors -> CPU torch tensors
    reference = load_file(str(cpu.checkpoint / "model.safetensors"))
    assert weights.keys() == reference.keys()
    assert all(t.device.type == "cpu" for t in weights.values())
    worst = max((weights[k] - reference[k]).abs().max().item() for k in reference)
    at_3 = load_file(str(xla.run_dir / "checkpoints" / "step_00000003" / "model.safetensors"))
    moved = max((weights[k] - at_3[k]).abs().max().item() for k in at_3)
    print(f"\nmax |weight diff| xla vs cpu after 6 steps: {worst:.2e}; max change from step 3 to 6: {moved:.2e}")
    assert moved > 100 * WEIGHT_TOLERANCE  # the weights really move: matching is not trivial
    assert worst <= WEIGHT_TOLERANCE
    optimizer = load_file(str(xla.checkpoint / "optimizer.safetensors"))
    assert optimizer.keys() == load_file(str(cpu.checkpoint / "optimizer.safetensors")).keys()
    model = load_model(xla.checkpoint)  # albert_core, on the CPU
    assert all(torch.equal(model.state_dict()[k], weights[k]) for k in weights if k in model.state_dict())


def read_trace(trace: Path) -> dict[int, list[dict]]:
    return {
        int(path.stem.removeprefix("rank")): [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(trace.glob("rank*.jsonl"))
    }


def test_two_xla_workers_sum_their_gradients_through_the_host_and_match_two_cpu_workers(two_workers_cpu_and_xla):
    (cpu, cpu_trace), (xla, xla_trace) = two_workers_cpu_and_xla["cpu"], two_workers_cpu_and_xla["xla"]
    cpu_records, xla_records = read_metrics(cpu.metrics_file), read_metrics(xla.metrics_file)
    assert [r["step"] for r in xla_records] == [r["step"] for r in cpu_records] == [1, 2, 3, 4]
    assert [r["epoch"] for r in xla_records] == [0, 0, 1, 1]
    # Both runs really had 2 workers, in 2 processes, each training its own half of every global batch.
    ranks = read_trace(xla_trace)
    assert sorted(ranks) == [0, 1]
    assert len({line["pid"] for lines in ranks.values() for line in lines}) == 2
    for step in range(4):
        ids = [set(ranks[r][step]["example_ids"]) for r in (0, 1)]
        assert len(ids[0]) == len(ids[1]) == 8 and not ids[0] & ids[1]  # micro 4 x accumulation 2, disjoint

    def examples(trace: dict[int, list[dict]]) -> list[tuple]:
        return [(r, line["step"], line["epoch"], line["example_ids"]) for r, lines in trace.items() for line in lines]

    assert examples(ranks) == examples(read_trace(cpu_trace))  # the cpu run's example ids, per rank and step
    a, b = step_table(cpu_records), step_table(xla_records)
    relative = np.abs(a - b) / np.abs(a).clip(min=1e-12)
    print(f"\n2 workers: cpu loss {a[:, 0].round(6).tolist()}\n           xla loss {b[:, 0].round(6).tolist()}")
    print(f"max relative diff: loss {relative[:, 0].max():.2e}, grad norm {relative[:, 3].max():.2e}")
    assert np.ptp(a[:, 0]) > 1e-3 * a[:, 0].max()  # the steps differ far more than the tolerance
    assert relative[:, :4].max() <= 1e-5  # loss, mlm loss, pair loss, grad norm
    assert np.abs(a[:, 4:] - b[:, 4:]).max() <= 1 / 50  # accuracies: at most one argmax flip of ~120 masked tokens
    compiles = [r["xla_compiles"] for r in xla_records]
    print(f"graphs compiled after each step (rank 0): {compiles}")
    # per pair of micro-batch buckets (128|136 x 128|136): counts + forward/backward; update: first step + steady
    assert compiles == sorted(compiles) and compiles[-1] <= 2 * 4 + 2
    weights, reference = (load_file(str(r.checkpoint / "model.safetensors")) for r in (xla, cpu))
    assert max((weights[k] - reference[k]).abs().max().item() for k in reference) <= WEIGHT_TOLERANCE


def test_crashed_xla_run_resumes_from_its_checkpoint_and_repeats_the_lost_steps(xla_crashed_then_resumed):
    crashed, resumed = xla_crashed_then_resumed
    assert [r["step"] for r in crashed] == [1, 2, 3, 4, 5]
    records = read_metrics(resumed.metrics_file)
    assert [r["step"] for r in records] == list(range(1, 7))  # 4 and 5 replaced, not duplicated
    assert [r["dropout"] for r in records] == [0.1] * 4 + [0.0] * 2  # removed at step 5, after the resume at 3
    before, after = step_table(crashed[3:5]), step_table(records[3:5])
    print(f"\nsteps 4-5 loss before the crash {before[:, 0].tolist()}, after the resume {after[:, 0].tolist()}")
    assert np.abs(before - after).max() <= LOSS_TOLERANCE
    assert resumed.step == 6 and latest_good(resumed.run_dir / "checkpoints") == resumed.checkpoint
    assert np.isfinite(records[-1]["loss"])
