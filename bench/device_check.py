"""The GPU check: one command that runs the training code on a CUDA device it has never run on, and says how it went.

Sections, each recorded as pass / fail / skip with its numbers; an error in one does not stop the others:

a. environment: GPU name, driver and CUDA versions, capability, memory; torch, transformers and python versions.
b. the pytest tests marked `cuda` (tests/test_cuda.py), in a subprocess: their counts.
c. numerics: the `tiny` recipe's model (configs/tiny.toml, vocabulary 8000, its optimizer and schedule, dropout
   off) trains 50 steps (10 with --quick on the CPU) on the device in fp32 and in bf16 (autocast), through
   services.train.backends.EagerBackend as the workers run it, from the same initial weights and synthetic batches
   (make_micro_batch) as a CPU fp32 run. The per-step losses must stay within 1e-3 (fp32) and 5e-2 (bf16) of the
   CPU's. Also counted: the host syncs one step makes, by file:line (CUDA's sync debug mode; informational).
d. checkpoints: a state saved on the device (services.train.state) loads on the CPU with the same weights and
   optimizer state (difference 0), and a run resumed from it on the device repeats the uninterrupted run's next
   three losses (the first within 1e-6, all within 1e-4; on the CPU, exactly); once with dropout off, once with
   the recipe's own dropouts (none but the pair head's 0.1).
e. throughput: our training step at the albert-base and albert-large shapes, batch 32 x 512 (the tiny recipe's
   model at 8 x 128 with --quick or on the CPU), in fp32, bf16 and bf16 + compile_backbone, against transformers'
   AlbertForPreTraining on the same device and batch (fp32, and bf16 autocast). Reported: tokens/s, ours /
   transformers, and MFU against a bf16 GEMM peak measured in the same run (bench/bench_train.py's functions;
   steps interleaved, synchronized). The goal: bf16 MFU >= 50% for albert-large (a missed goal is a failed check).
f. input: the training input alone on this host (bench/bench_input.py --input-only's measurements, no model):
   masker rows/s per core (bench_masking.py's plain per-row 15% masker against the batch masker, same rows, same
   run) and a worker's input rows/s in the thread and in 1, 2 and 4 input processes (1 and 2 with --quick), at 128
   and 512 tokens; then the
   headroom over what an H200 consumes at 50% of its bf16 peak: the goal is >= 2x for every preset at 512 tokens
   and albert-base at 128 (a missed goal is a failed check). And what input in the thread costs a launch-bound loop
   (bench_input.py --launch-bound: ~35 ms of tiny torch ops a step, a worker's 256 rows x 128 tokens a step) against
   input in 1 and 2 processes (informational: it decides train.input_workers). Runs on the CPU as well: the input
   never uses the GPU.

It prints one summary table at the end and writes the same as JSON to DIR/device_check.json, rewritten after every
section so that a run cut short keeps what it did; pytest's output goes to DIR/pytest_cuda.txt. Exit status 1 when
a check failed. Without a GPU (and without --device cpu) it says so and exits 0.

    python bench/device_check.py --out DIR [--device cuda|cpu] [--quick] [--no-compile] [--only LETTERS]

Through the device tool: `python bench/device_check.py --out $OUT` (estimated at 4-6 minutes on one H200, not yet
timed). On a CPU: `python bench/device_check.py --out /tmp/dc --device cpu --quick` runs every section at tiny
shapes, 1 thread, in about a minute (the compiled variant is left out there).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a plain checkout: no `pip install -e .`

import numpy as np
import torch
from bench_train import VOCAB, build_hf, build_ours, gemm_peak, interleaved, make_batch

from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import estimate_flops_per_token
from albert_core.text.tokenization import TokenIds
from services.rundir.config import RunConfig
from services.train.backends import EagerBackend
from services.train.state import TrainerState, load_train_state
from services.train.step import initial_model, make_micro_batch, optimizer_for, step_seed

ROOT = Path(__file__).resolve().parent.parent
TINY_VOCAB = 8000
TINY_STEPS = 50
FP32_TOL, BF16_TOL = 1e-3, 5e-2  # max |loss - CPU fp32 loss| over the steps
RESUME_FIRST_TOL, RESUME_TOL = 1e-6, 1e-4  # resumed vs uninterrupted losses on the GPU (the CPU: exact)
SHAPES = (("albert-base", 32, 512), ("albert-large", 32, 512))
TINY_SHAPES = (("tiny", 8, 128),)
MFU_GOAL = 0.5


@dataclass
class Check:
    item: str
    status: str  # pass | fail | skip
    numbers: dict[str, Any] = field(default_factory=dict)
    note: str = ""


@dataclass
class Section:
    name: str
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""

    @property
    def status(self) -> str:
        statuses = {c.status for c in self.checks}
        if self.error or "fail" in statuses:
            return "fail"
        return "pass" if "pass" in statuses else "skip"


# --- a. environment ------------------------------------------------------------------------------------------


def check_environment(device: torch.device) -> list[Check]:
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": _version("transformers"),
        "numpy": np.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    checks = [Check("versions", "pass", versions)]
    if device.type != "cuda":
        return [*checks, Check("gpu", "skip", note="running on the CPU")]
    props = torch.cuda.get_device_properties(device)
    gpu = {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "count": torch.cuda.device_count(),
        "driver": _nvidia_smi("driver_version"),
        "cudnn": torch.backends.cudnn.version(),
        "bf16": torch.cuda.is_bf16_supported(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }
    ok = bool(gpu["bf16"])
    return [*checks, Check("gpu", "pass" if ok else "fail", gpu, "" if ok else "no bf16: train.precision bf16 fails")]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _nvidia_smi(query: str) -> str:
    try:
        cmd = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


# --- b. the cuda tests ---------------------------------------------------------------------------------------


def check_cuda_tests(out: Path, device: torch.device) -> list[Check]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if device.type == "cpu" else dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp}/t"]
        proc = subprocess.run(
            [*cmd, "tests/test_cuda.py"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
        )
    (out / "pytest_cuda.txt").write_text(proc.stdout + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    summary = lines[-1].strip("= ") if lines else "no output"
    found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)
    counts: dict[str, Any] = {word.rstrip("s") if word.startswith("error") else word: int(n) for n, word in found}
    counts["exit_code"] = proc.returncode
    if proc.returncode != 0 or counts.get("failed") or counts.get("error"):
        status = "fail"
    else:
        status = "pass" if counts.get("passed") else "skip"
    return [Check("pytest -m cuda tests/test_cuda.py", status, counts, summary)]


# --- c, d. the tiny recipe on the device ---------------------------------------------------------------------

Trained = tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]
Batches = list[list[dict[str, torch.Tensor]]]


def synthetic_rows(first: int, n: int, *, max_len: int, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """n shard rows as the preprocessor writes them: [CLS] A [SEP] B [SEP] of Zipf-distributed pieces, whole-word
    starts, sentence-order labels; from a quarter of max_len to all of it, so that batches have padding."""
    columns: dict[str, list[Any]] = {k: [] for k in ("example_id", "input_ids", "token_type_ids", "word_starts")}
    for row in range(first, first + n):
        length = int(rng.integers(max_len // 4, max_len + 1))
        n_a = int(rng.integers(1, length - 3))
        pieces = (rng.zipf(1.3, length - 3) - 1) % (vocab - 5) + 5
        starts = rng.random(length) < 0.7
        starts[[0, n_a + 1, length - 1]] = True
        columns["example_id"].append(row)
        columns["input_ids"].append(np.concatenate([[2], pieces[:n_a], [3], pieces[n_a:], [3]]).astype(np.int32))
        columns["token_type_ids"].append(np.array([0] * (n_a + 2) + [1] * (length - n_a - 2), dtype=np.int8))
        columns["word_starts"].append(starts)
    rows = {name: np.empty(n, dtype=object) for name in ("input_ids", "token_type_ids", "word_starts")}
    for name, array in rows.items():
        for i, value in enumerate(columns[name]):
            array[i] = value
    return {**rows, "example_id": np.array(columns["example_id"]), "pair_label": rng.integers(0, 2, n)}


def tiny_batches(config: RunConfig, steps: int) -> Batches:
    """`steps` global batches of the tiny recipe, split into its micro-batches, masked as the workers mask them."""
    t, rng, ids = config.train, np.random.default_rng(0), TokenIds(vocab_size=TINY_VOCAB)
    per_step = t.global_batch_size // t.micro_batch_size
    batches = []
    for step in range(steps):
        micro = []
        for k in range(per_step):
            first = (step * per_step + k) * t.micro_batch_size
            rows = synthetic_rows(
                first, t.micro_batch_size, max_len=config.data.max_seq_length, vocab=TINY_VOCAB, rng=rng
            )
            micro.append(make_micro_batch(rows, seed=config.run.seed, epoch=0, ids=ids, data=config.data))
        batches.append(micro)
    return batches


def tiny_setup(
    config: RunConfig, backend: EagerBackend, seed: int | None = None, dropout: float | None = 0.0
) -> Trained:
    """A new run's model on the backend's device, with the recipe's optimizer and schedule (as worker.build).

    `dropout` (None: the recipe's) is set on every dropout. The recipe has none but the pair head's (0.1), whose
    masks the CPU's and the GPU's generators draw differently, so comparisons across devices turn it off.
    """
    model = initial_model(config.model_config(TINY_VOCAB), config.run.seed if seed is None else seed)
    if dropout is not None:
        model.set_dropout(dropout)
    backend.place(model)
    optimizer, scheduler = optimizer_for(model, config.optim)
    return model, optimizer, scheduler


def tiny_losses(config: RunConfig, backend: EagerBackend, trained: Trained, batches: Batches, first: int = 1):
    """Train one step per global batch (steps first, first + 1, ...); the losses, read once at the end."""
    model, optimizer, scheduler = trained
    losses = []
    for step, micro in enumerate(batches, first):
        seed = step_seed(config.run.seed, 0, step)
        stats = backend.train_step(model, optimizer, scheduler, micro, grad_clip=config.optim.grad_clip, seed=seed)
        losses.append(stats.loss.detach())
    return torch.stack(losses).cpu().tolist()


def eager(device: torch.device | str, precision: str = "fp32") -> EagerBackend:
    return EagerBackend(torch.device(device), precision=precision, compile=False, reduce_sum=None)


def check_tiny_training(device: torch.device, steps: int = TINY_STEPS) -> list[Check]:
    config = RunConfig.load("tiny")
    batches = tiny_batches(config, steps)
    reference = tiny_losses(config, eager("cpu"), tiny_setup(config, eager("cpu")), batches)
    trains = all(map(math.isfinite, reference)) and reference[-1] < reference[0]
    numbers = {
        "steps": len(batches),
        "micro_batches": len(batches[0]),
        "loss_first": reference[0],
        "loss_last": reference[-1],
    }
    checks = [Check("cpu fp32 reference", "pass" if trains else "fail", numbers, "the loss falls")]
    for precision, tolerance in (("fp32", FP32_TOL), ("bf16", BF16_TOL)):
        backend = eager(device, precision)
        losses = tiny_losses(config, backend, tiny_setup(config, backend), batches)
        diffs = np.abs(np.subtract(losses, reference))
        ok = bool(np.isfinite(losses).all() and diffs.max() <= tolerance)
        numbers = {"max_abs_diff": float(diffs.max()), "at_step": int(diffs.argmax()) + 1, "tolerance": tolerance}
        note = "the same device twice: determinism" if device.type == "cpu" and precision == "fp32" else ""
        checks.append(Check(f"{device.type} {precision} vs cpu fp32", "pass" if ok else "fail", numbers, note))
    return [*checks, check_host_syncs(config, device, batches[0])]


def check_host_syncs(config: RunConfig, device: torch.device, micro: list[dict[str, torch.Tensor]]) -> Check:
    """Where one bf16 training step waits for the GPU (torch.cuda.set_sync_debug_mode), by file:line."""
    if device.type != "cuda":
        return Check("host syncs in one step", "skip", note="CUDA only")
    backend = eager(device, "bf16")
    model, optimizer, scheduler = trained = tiny_setup(config, backend)
    tiny_losses(config, backend, trained, [micro])  # first-call allocations and kernel selection
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            backend.train_step(model, optimizer, scheduler, micro, grad_clip=config.optim.grad_clip, seed=2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    numbers = {"syncs": sum(sites.values()), "micro_batches": len(micro), "sites": dict(sites.most_common(8))}
    return Check("host syncs in one bf16 step", "pass", numbers, "informational: each one waits for the GPU")


def check_checkpoint(device: torch.device) -> list[Check]:
    config = RunConfig.load("tiny")
    batches = tiny_batches(config, 8)
    weights, optimizer, cpu_step, resumed = round_trip(config, device, batches, dropout=0.0)
    ok = weights == optimizer == 0 and cpu_step == 5
    numbers = {"weights_max_diff": weights, "optimizer_max_diff": optimizer, "step": cpu_step}
    checks = [Check(f"save on {device.type}, load on cpu", "pass" if ok else "fail", numbers)]
    first_tol, tol = (0.0, 0.0) if device.type == "cpu" else (RESUME_FIRST_TOL, RESUME_TOL)
    for dropout, item in ((0.0, f"resume on {device.type}"), (None, "resume keeps the recipe's dropouts")):
        diffs = resumed if dropout == 0.0 else round_trip(config, device, batches, dropout=dropout)[3]
        ok = bool(diffs[0] <= first_tol and diffs.max() <= tol)
        numbers = {"first_step_diff": float(diffs[0]), "max_diff_3_steps": float(diffs.max())}
        note = (
            "dropout off; vs the uninterrupted run"
            if dropout == 0.0
            else "hidden 0, pair head 0.1, as configs/tiny.toml"
        )
        checks.append(Check(item, "pass" if ok else "fail", {**numbers, "tolerances": [first_tol, tol]}, note))
    return checks


def round_trip(config: RunConfig, device: torch.device, batches: Batches, *, dropout: float | None):
    """Train 5 steps on the device, save there as the worker does, then (a) load on the CPU and (b) resume on the
    device and train the last steps again. Returns the CPU copy's weight and optimizer differences from the saved
    state, its step, and |resumed - uninterrupted| for each step after the save."""
    backend = eager(device)
    trained = tiny_setup(config, backend, dropout=dropout)
    tiny_losses(config, backend, trained, batches[:5])
    t = config.train
    state = TrainerState(step=5, examples_seen=5 * t.global_batch_size, micro_batch_size=t.micro_batch_size)
    state.dropout = trained[0].config.hidden_dropout_prob  # as worker.resume starts its state
    with tempfile.TemporaryDirectory() as tmp:
        path = backend.save(Path(tmp) / "step_00000005", *trained, state)
        saved = _tensors(trained)
        uninterrupted = tiny_losses(config, backend, trained, batches[5:], first=6)
        other_seed = config.run.seed + 1  # other initial weights: the load must replace them all
        on_cpu = tiny_setup(config, eager("cpu"), seed=other_seed, dropout=dropout)
        cpu_step = load_train_state(path, *on_cpu, restore_rng=False).step
        resumed = tiny_setup(config, backend, seed=other_seed, dropout=dropout)
        first = backend.load(str(path), *resumed).step + 1
        again = tiny_losses(config, backend, resumed, batches[5:], first=first)
    loaded = _tensors(on_cpu)
    weights = _max_diff(saved, loaded, "model.")
    optimizer = _max_diff(saved, loaded, "optim.")
    return weights, optimizer, cpu_step, np.abs(np.subtract(again, uninterrupted))


def _tensors(trained: Trained) -> dict[str, torch.Tensor]:
    """CPU copies of the model's weights ("model.<name>") and the optimizer's state ("optim.<index>.<key>")."""
    model, optimizer, _ = trained
    out = {f"model.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        out.update({f"optim.{index}.{k}": torch.as_tensor(v).cpu().clone() for k, v in state.items()})
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str) -> float:
    a, b = ({k: v for k, v in d.items() if k.startswith(prefix)} for d in (a, b))
    if a.keys() != b.keys() or not a:
        return math.inf
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# --- e. throughput -------------------------------------------------------------------------------------------


def check_throughput(device: torch.device, *, tiny: bool, steps: int, warmup: int, compile: bool) -> list[Check]:
    n = 8192 if device.type == "cuda" else 512
    peaks = {dtype: gemm_peak(n, 10, device=device, dtype=dtype) for dtype in (torch.bfloat16, torch.float32)}
    checks, timed = [], {}
    for name, batch_size, seq in TINY_SHAPES if tiny else SHAPES:
        try:  # a shape that fails (out of memory, say) leaves the others measured
            timed[name], failed = time_shape(name, batch_size, seq, device, steps=steps, warmup=warmup, compile=compile)
        except Exception as err:
            traceback.print_exc()
            timed[name], failed = {}, {"": f"{type(err).__name__}: {err}"[:300]}
        checks += [Check(f"{name} {variant}".strip(), "fail", note=error) for variant, error in failed.items()]
    peaks = {dtype: max(peak, gemm_peak(n, 10, device=device, dtype=dtype)) for dtype, peak in peaks.items()}
    peak = peaks[torch.bfloat16]
    numbers = {"bf16_tflops": peak / 1e12, "fp32_tflops": peaks[torch.float32] / 1e12, "n": n, "best_of": "2 x 10"}
    note = "MFU is against the bf16 peak" + ("" if device.type == "cuda" else "; a CPU without bf16 units: no meaning")
    checks.insert(0, Check("GEMM peaks", "pass", numbers, note))
    if not compile:
        why = "left out (--no-compile)" if device.type == "cuda" else "CPU: compiling takes minutes at 1 thread"
        checks.append(Check("ours bf16+compile", "skip", note=why))
    for name, timings in timed.items():
        for variant, t in timings.items():
            numbers = {"ms_median": t["median_s"] * 1e3, "ms_best": t["best_s"] * 1e3}
            numbers.update(tokens_per_s=round(t["tokens"] / t["median_s"]), mfu=t["flops"] / t["median_s"] / peak)
            if "fp32" in variant:
                numbers["mfu_of_fp32_peak"] = t["flops"] / t["median_s"] / peaks[torch.float32]
            hf = timings.get("hf fp32" if "fp32" in variant else "hf bf16")
            if variant.startswith("ours") and hf:
                numbers["x_transformers"] = hf["median_s"] / t["median_s"]
            if "compile" in variant:
                numbers["warmup_s"] = t["warmup_s"]
            checks.append(Check(f"{name} {variant}", "pass", numbers, f"batch {t['batch']}, median step"))
    if device.type == "cuda":
        memory = {"gib": torch.cuda.max_memory_allocated(device) / 2**30}
        checks.append(Check("peak memory of the process", "pass", memory))
    return [*checks, goal_check(timed, peak)]


def time_shape(name: str, batch_size: int, seq: int, device: torch.device, *, steps: int, warmup: int, compile: bool):
    """Timings of each variant (interleaved, one step at a time) and the variants that failed, with their error."""
    config = (
        RunConfig.load("tiny").model_config(VOCAB) if name == "tiny" else AlbertConfig.preset(name, vocab_size=VOCAB)
    )
    batch = make_batch(batch=batch_size, seq=seq, vocab=config.vocab_size)
    tokens = batch_size * seq
    masked = float((batch["mlm_labels"] != -100).float().mean())
    flops = {"ours": estimate_flops_per_token(config, seq, mlm_fraction=masked) * tokens}
    flops["hf"] = estimate_flops_per_token(config, seq) * tokens  # transformers decodes every position
    bf16 = torch.bfloat16
    builders: dict[str, Callable[[], Callable]] = {
        "ours fp32": lambda: build_ours(config, device=device)[1],
        "hf fp32": lambda: build_hf(build_ours(config, device=device)[0])[1],
        "ours bf16": lambda: build_ours(config, device=device, autocast_dtype=bf16)[1],
        "hf bf16": lambda: build_hf(build_ours(config, device=device)[0], autocast_dtype=bf16)[1],
    }
    if compile:
        builders["ours bf16+compile"] = lambda: build_ours(config, True, device=device, autocast_dtype=bf16)[1]
    ready, warmup_s, failed = {}, {}, {}
    for variant, build in builders.items():
        print(f"  {name} {variant}: building, {warmup} warm-up steps", flush=True)
        start = time.perf_counter()
        try:
            ready[variant] = _synced(build(), device)
            for _ in range(warmup):
                ready[variant](batch)
        except Exception as err:  # e.g. no compiler for torch.compile: the other variants still run
            ready.pop(variant, None)
            failed[variant] = f"{type(err).__name__}: {err}"[:300]
        warmup_s[variant] = time.perf_counter() - start
    wall, _ = interleaved(ready, batch, steps)
    timings = {}
    for variant, seconds in wall.items():
        timings[variant] = {"median_s": statistics.median(seconds), "best_s": min(seconds), "tokens": tokens}
        timings[variant].update(warmup_s=warmup_s[variant], batch=f"{batch_size} x {seq}")
        timings[variant]["flops"] = flops["hf" if variant.startswith("hf") else "ours"]
    return timings, failed


def _synced(step: Callable, device: torch.device) -> Callable:
    if device.type != "cuda":
        return step

    def synced(batch: dict[str, torch.Tensor]) -> None:
        step(batch)
        torch.cuda.synchronize()

    return synced


def goal_check(timed: dict[str, dict[str, dict[str, Any]]], peak: float) -> Check:
    item = f"goal: albert-large bf16 MFU >= {MFU_GOAL:.0%}"
    large = timed.get("albert-large", {})
    mfus = {v: t["flops"] / t["median_s"] / peak for v, t in large.items() if v.startswith("ours bf16")}
    if not mfus:
        return Check(item, "skip", note="albert-large not measured (tiny shapes)")
    best = max(mfus, key=mfus.__getitem__)
    met = mfus[best] >= MFU_GOAL
    return Check(item, "pass" if met else "fail", {"mfu": mfus[best], "variant": best}, "" if met else "goal missed")


# --- f. the input alone --------------------------------------------------------------------------------------


def check_input(quick: bool) -> list[Check]:
    """Masker and input rows/s at 128 and 512 tokens, and the headroom over an H200's demand (bench_input)."""
    from bench_input import PRESETS, demand, input_rates, launch_bound_steps, masker_rates, write_shards

    from services.train.input import keep_freed_memory

    keep_freed_memory()  # as input processes run (the last section: nothing after it allocates much)
    rows, step_rows, steps, rounds = (1024, 256, 16, 1) if quick else (4096, 512, 64, 3)
    workers = [0, 1, 2] if quick else [0, 1, 2, 4]
    checks, best = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for length in (128, 512):
            masker = masker_rates(length, rows, step_rows, rounds)
            shards = write_shards(Path(tmp) / str(length), length=length, rows_per_file=step_rows * 8, files=4,
                                  vocab=30_000)  # fmt: skip
            rates = input_rates(shards, length, step_rows, steps, workers, rounds)
            best[length] = max(rate for rate, _ in rates.values())
            before, now = round(masker["plain"]), round(masker["batch"])
            numbers = {"masker_plain": before, "masker_batch": now, "masker_x": round(now / before, 2)}
            numbers.update({("thread" if n == 0 else f"processes_{n}"): round(rate) for n, (rate, _) in rates.items()})
            checks.append(Check(f"input rows/s at {length} tokens", "pass", numbers, f"steps of {step_rows} rows"))
    steps = launch_bound_steps(256, 128, 35.0, 20 if quick else 40, rounds)
    keys = {"none": "made_before", "thread": "thread", "1 process": "processes_1", "2 processes": "processes_2"}
    medians = {keys[name]: statistics.median(values) for name, values in steps.items()}
    numbers = {f"{key}_ms": round(value * 1e3, 1) for key, value in medians.items()}
    numbers.update({f"{key}_vs_made_before": f"{100 * (value / medians['made_before'] - 1):+.1f}%"
                    for key, value in medians.items() if key != "made_before"})  # fmt: skip
    checks.append(Check("launch-bound loop: step with input in the thread / processes", "pass", numbers))
    for preset in PRESETS:
        for length in (128, 512):
            _, consumed = demand(preset, length, "H200")
            headroom = best[length] / consumed
            goal = length == 512 or preset == "albert-base"
            status = "skip" if not goal else "pass" if headroom >= 2 else "fail"
            numbers = {"h200_rows_per_s": round(consumed), "input_rows_per_s": round(best[length]),
                       "headroom": round(headroom, 1)}  # fmt: skip
            checks.append(Check(f"{preset} at {length} on an H200", status, numbers, "goal >= 2x" if goal else ""))
    return checks


# --- the run -------------------------------------------------------------------------------------------------


def run_section(name: str, fn: Callable[[], list[Check]], device: torch.device) -> Section:
    print(f"--- {name}", flush=True)
    start, section = time.perf_counter(), Section(name)
    try:
        section.checks = fn()
    except Exception as err:  # recorded; the other sections still run
        traceback.print_exc()
        section.error = f"{type(err).__name__}: {err}"[:500]
        section.checks.append(Check("error", "fail", note=section.error))
    section.seconds = round(time.perf_counter() - start, 1)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"    {section.status} in {section.seconds} s", flush=True)
    return section


def write_report(out: Path, header: dict[str, Any], sections: list[Section]) -> None:
    overall = "fail" if any(s.status == "fail" for s in sections) else "pass" if sections else "skip"
    data = {**header, "overall": overall, "sections": []}
    for s in sections:
        checks = [asdict(c) for c in s.checks]
        data["sections"].append(
            {"name": s.name, "status": s.status, "seconds": s.seconds, "error": s.error, "checks": checks}
        )
    (out / "device_check.json").write_text(json.dumps(data, indent=1, default=str) + "\n")


def print_table(sections: list[Section]) -> None:
    rows = [(s.name, c.item, c.status, _numbers(c)) for s in sections for c in s.checks]
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for r in rows:
            print("  ".join(r[i].ljust(widths[i]) for i in range(3)), r[3])
        return
    table = Table(title="device check")
    for column in ("section", "check", "status", "numbers"):
        table.add_column(column)
    colours = {"pass": "green", "fail": "bold red", "skip": "yellow"}
    for section, item, status, numbers in rows:
        table.add_row(Text(section), Text(item), Text(status, style=colours[status]), Text(numbers))
    Console(width=200).print(table)


def _numbers(check: Check) -> str:
    def show(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return json.dumps(value, separators=(",", ":")) if isinstance(value, (dict, list)) else str(value)

    text = ", ".join(f"{k}={show(v)}" for k, v in check.numbers.items())
    return f"{text} ({check.note})" if text and check.note else text or check.note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for device_check.json and pytest_cuda.txt")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny throughput shapes, fewer timed steps")
    parser.add_argument("--no-compile", action="store_true", help="leave out the bf16 + compile_backbone variant")
    parser.add_argument("--only", default="", help="run only these sections, by letter (e.g. f: the input alone)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = {"command": " ".join(sys.argv), "device": args.device, "quick": args.quick, "started": time.ctime()}
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here (torch.cuda.is_available() is False): nothing checked; --device cpu runs it on the CPU")
        write_report(out, {**header, "note": "no CUDA GPU"}, [])
        return 0
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    if cpu:
        torch.set_num_threads(1)
    tiny, compile = args.quick or cpu, not args.no_compile and not cpu  # compile on the CPU: tests/test_train.py
    steps, warmup = (3, 1) if args.quick else (10, 3)
    tiny_steps = 10 if args.quick and cpu else TINY_STEPS
    plan: list[tuple[str, Callable[[], list[Check]]]] = [
        ("a. environment", lambda: check_environment(device)),
        ("b. cuda tests", lambda: check_cuda_tests(out, device)),
        ("c. tiny recipe: device vs cpu", lambda: check_tiny_training(device, tiny_steps)),
        ("d. checkpoint and resume", lambda: check_checkpoint(device)),
        (
            "e. throughput",
            lambda: check_throughput(device, tiny=tiny, steps=steps, warmup=warmup, compile=compile),
        ),
        ("f. input", lambda: check_input(args.quick)),
    ]
    sections: list[Section] = []
    for name, fn in plan:
        if args.only and name[0] not in args.only:
            continue
        sections.append(run_section(name, fn, device))
        write_report(out, header, sections)
    print_table(sections)
    failed = [s.name for s in sections if s.status == "fail"]
    print(
        f"{'FAILED: ' + ', '.join(failed) if failed else 'all checks passed or skipped'}; {out / 'device_check.json'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
