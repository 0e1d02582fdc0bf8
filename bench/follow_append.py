"""A corpus appended to the shard set of a live run (issue 15, item 2), through the CLI as a user would run it.

1. `albert preprocess` of a base corpus (Moby-Dick's chapters from the embedded sample corpus) with the demo's
   tokenizer (`bash scripts/main.sh` makes both).
2. `albert pretrain --config tiny --set data.follow=true` on it, in the background, with the tests' step callbacks
   (tests/worker_callbacks.py): every step's example ids traced, and a crash near the end.
3. Once the trace shows epoch 1: `albert preprocess --append-to SHARDS` of a second corpus (State of the Union
   addresses), in its own process and embedded Ray, while the run trains.
4. The crashed run resumed with `albert pretrain --resume`.

Measured: when the append committed (manifest.json's mtime) against the run's epoch boundaries (the steps at which
each epoch's version was decided), the first step whose examples include the new part, the `shards_version`
event, each checkpoint's epoch_versions, whether every step redone after the resume trained on the same example ids as
its first attempt, and the final held-out MLM accuracy against the unigram baseline (5% of the base chapters).
Results: reports/follow-append.json.

    python bench/follow_append.py [--work DIR] [--steps 400]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from albert_core.examples.shards import ShardsManifest  # noqa: E402
from services.rundir.checkpoints import CHECKPOINTS_DIR, list_checkpoints, read_trainer_json  # noqa: E402
from services.rundir.log import read_metrics  # noqa: E402
from tests.worker_callbacks import callbacks_command  # noqa: E402

ALBERT = [sys.executable, "-m", "services.cli"]
CACHE = REPO / ".cache" / "albert"
TOKENIZER = CACHE / "tokenizer-8000" / "spiece.model"
BASE = CACHE / "sample-corpus" / "moby-dick"
APPENDED = CACHE / "sample-corpus" / "sotu" / "18[0-4]*.txt"
GLOBAL_BATCH = 32  # the tiny recipe's


def albert(*args: str, log: Path, wait: bool = True, **callbacks):
    """`albert ARGS`; with `callbacks` (trace=DIR, crash_after=STEP), the tests' step callbacks installed."""
    command = callbacks_command(args, **callbacks) if callbacks else [*ALBERT, *args]
    handle = open(log, "a")
    proc = subprocess.Popen(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT)
    if wait and proc.wait() != 0:
        raise SystemExit(f"albert {' '.join(args[:3])} failed; see {log}")
    return proc


def traced(trace: Path) -> list[dict]:
    lines = []
    for path in sorted(trace.glob("rank*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", type=Path, default=REPO / "reports" / "follow-append.json")
    args = parser.parse_args()
    if not TOKENIZER.is_file() or not BASE.is_dir():
        raise SystemExit(f"{TOKENIZER} or {BASE} missing: run `bash scripts/main.sh` once first")
    work = args.work or Path(tempfile.mkdtemp(prefix="albert-follow-"))
    work.mkdir(parents=True, exist_ok=True)
    shards, trace, log = work / "shards", work / "trace", work / "bench.log"
    common = ["--max-seq-length", "128", "--num-cpus", "1"]
    base = ["--input", str(BASE), "--tokenizer", str(TOKENIZER), "--output", str(shards), "--heldout-fraction", "0.05"]
    albert("preprocess", *base, *common, log=log)  # held out: 5% of the chapters, for the final evaluation
    epoch = ShardsManifest.read(shards).data["examples"]
    sets = {
        "run.name": "follows", "run.output_dir": str(work / "runs"), "data.shards": str(shards),
        "data.follow": "true", "optim.total_steps": args.steps, "optim.warmup_steps": args.steps // 10,
        "optim.decay_steps": args.steps // 5, "train.checkpoint_every": 25, "train.keep_last": 100,
        "eval.every_steps": 0,
    }  # fmt: skip
    pretrain = [
        "pretrain",
        "--config",
        "tiny",
        "--no-progress",
        *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")],
    ]
    stop = args.steps - 10
    run = albert(*pretrain, log=log, wait=False, trace=trace, crash_after=stop)
    while not (trace.is_dir() and any(line["epoch"] >= 1 for line in traced(trace))):
        if run.poll() is not None:
            raise SystemExit(f"the run ended before epoch 1; see {log}")
        time.sleep(0.5)
    appended_at = time.time()
    albert("preprocess", "--append-to", str(shards), "--input", str(APPENDED), "--part-name", "sotu", *common, log=log)
    committed = (shards / "manifest.json").stat().st_mtime
    run.wait()
    resume = ["--resume", str(work / "runs" / "follows")]
    albert(*pretrain, *resume, log=log, trace=trace)
    times = {"epoch": epoch, "appended_at": appended_at, "committed": committed, "stop": stop}
    (work / "times.json").write_text(json.dumps(times))
    report(work, args.out)


def report(work: Path, out: Path) -> None:
    times = json.loads((work / "times.json").read_text())
    result = measure(work, work / "shards", work / "trace", **times)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def measure(work: Path, shards: Path, trace: Path, epoch: int, appended_at: float, committed: float, stop: int) -> dict:
    run_dir = work / "runs" / "follows"
    part = ShardsManifest.read(shards).parts[1]
    added = {int(name.rsplit("-", 1)[1].split(".")[0]) for name in part.shards}
    attempts: dict[tuple[int, int], list[dict]] = {}
    for line in traced(trace):
        attempts.setdefault((line["rank"], line["step"]), []).append(line)
    first = {key: lines[0] for key, lines in attempts.items()}  # the live run's attempt of each step
    started = {step: line["time"] for (rank, step), line in first.items() if rank == 0}
    with_new = [step for (_, step), line in first.items() if {i >> 32 for i in line["example_ids"]} & added]
    boundaries = {e: e * epoch // GLOBAL_BATCH + 1 for e in range(1, 1 + max(started) * GLOBAL_BATCH // epoch)}
    records = read_metrics(run_dir)
    switch = [r for r in records if r.get("event") == "shards_version"]
    final = next((r for r in reversed(records) if r.get("kind") == "eval" and "mlm_acc" in r), None)
    redone = [lines for lines in attempts.values() if len(lines) > 1]
    checkpoints = list_checkpoints(run_dir / CHECKPOINTS_DIR)  # newest first
    return {
        "base_examples_per_epoch": epoch,
        "appended_part": {"name": part.name, "examples": sum(part.rows), "shards": len(part.shards)},
        "append_started_during_step": max(s for s, t in started.items() if t <= appended_at),
        "append_committed_during_step": max(s for s, t in started.items() if t <= committed),
        "epoch_start_steps_before_the_new_part": boundaries,
        "first_epoch_start_after_commit": min(
            (e for e, s in boundaries.items() if started.get(s, 0) > committed), default=None
        ),
        "picked_up_at_epoch": switch[0]["epoch"] if switch else None,
        "picked_up_in_step": switch[0]["step"] + 1 if switch else None,
        "first_step_with_new_part_examples": min(with_new) if with_new else None,
        "checkpoint_epoch_versions": {
            step: read_trainer_json(path)["state"]["epoch_versions"] for step, path in checkpoints[:3]
        },
        "final_heldout": {k: final[k] for k in ("step", "mlm_acc", "unigram_acc", "mlm_margin")} if final else None,
        "crash_after_step": stop,
        "redone_steps": sorted({lines[0]["step"] for lines in redone}),
        "redone_steps_same_example_ids": all(
            all(line["example_ids"] == lines[0]["example_ids"] for line in lines) for lines in redone
        ),
    }


if __name__ == "__main__":
    main()
