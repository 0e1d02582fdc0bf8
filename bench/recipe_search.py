"""Search the CPU pretraining recipe: one cell = one run config trained for a fixed budget, held-out MLM scored
against the unigram floor on the same masked positions at regular points of the budget.

    python bench/recipe_search.py --shards .cache/albert/sample-shards-8000-128 --name lr3e-3 \\
        --set optim.lr=0.003 --model hidden_size=128 --budget 1200 --out reports/recipe-search/cells.jsonl

The step is the training service's own (`services.train` make_micro_batch / train_step / optimizer_for), in one
process with `--threads` intra-op threads and the data held in memory, shuffled per epoch by (seed, epoch): what a
recipe does to learning, without Ray's start-up per cell. The budget is CPU seconds of this process (`--budget`,
2 threads x 600 s = 1200 for "10 minutes on 2 cores"), so cells compare fairly while other work shares the
machine; wall seconds are recorded too. Evaluation time is not counted. Each cell appends one JSON line to `--out`
with its config, its curve and the final numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from albert_core.evaluation.intrinsic import read_heldout  # noqa: E402
from albert_core.evaluation.unigram import load_or_count  # noqa: E402
from albert_core.examples.shards import TRAIN_DIR  # noqa: E402
from albert_core.model.modeling import AlbertForPreTraining  # noqa: E402
from services.eval.evaluate import IntrinsicOptions, evaluate_model  # noqa: E402
from services.rundir.config import RunConfig  # noqa: E402
from services.train.plan import resolve_token_ids  # noqa: E402
from services.train.step import initial_model, make_micro_batch, optimizer_for, step_seed, train_step  # noqa: E402

COLUMNS = ("example_id", "input_ids", "token_type_ids", "word_starts", "pair_label")


def parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text in ("true", "false"):
        return text == "true"
    if text == "null":
        return None
    return text


def load_rows(shards: Path) -> dict[str, np.ndarray]:
    files = sorted((shards / TRAIN_DIR).glob("*.parquet"))
    tables = [pq.read_table(f, columns=list(COLUMNS)) for f in files]
    rows = {name: [] for name in COLUMNS}
    for table in tables:
        for name in COLUMNS:
            values = table.column(name).to_numpy(zero_copy_only=False)
            rows[name].extend(values)
    return {
        name: np.array(values, dtype=object) if name != "example_id" and name != "pair_label" else np.asarray(values)
        for name, values in rows.items()
    }


def batches(config: RunConfig, ids, rows, epoch: int, order: np.ndarray, start: int, count: int) -> list:
    micro = min(config.train.micro_batch_size, config.train.global_batch_size)
    out = []
    for i in range(count):
        take = order[start + i * micro : start + (i + 1) * micro]
        chunk = {name: values[take] for name, values in rows.items()}
        out.append(make_micro_batch(chunk, seed=config.run.seed, epoch=epoch, ids=ids, data=config.data))
    return out


def time_steps(config: RunConfig, ids, rows, steps: int = 4) -> float:
    """CPU seconds per optimizer step of this config (median of `steps` after one warm-up), on a throwaway model."""
    model = AlbertForPreTraining(config.model_config(ids.vocab_size))
    optimizer, scheduler = optimizer_for(model, config.optim)
    t = config.train
    micro = min(t.micro_batch_size, t.global_batch_size)
    accumulation = t.global_batch_size // micro
    order = np.random.default_rng(0).permutation(len(rows["example_id"]))
    times = []
    for i in range(steps + 1):
        c0 = time.process_time()
        micro_batches = batches(config, ids, rows, 0, order, i * accumulation * micro, accumulation)
        train_step(model, optimizer, scheduler, micro_batches, grad_clip=config.optim.grad_clip)
        times.append(time.process_time() - c0)
    return float(np.median(times[1:]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--set", action="append", default=[], help="section.field=value (RunConfig)")
    parser.add_argument("--model", action="append", default=[], help="AlbertConfig field=value (model.overrides)")
    parser.add_argument("--budget", type=float, default=1200.0, help="CPU seconds of training")
    parser.add_argument("--evals", type=int, default=6, help="evaluations spread over the budget")
    parser.add_argument("--eval-examples", type=int, default=512)
    parser.add_argument(
        "--eval-max-ngram", type=int, default=3, help="n-gram masking of the held-out evaluation (the paper's 3)"
    )
    parser.add_argument("--eval-mask-prob", type=float, default=0.15, help="masking rate of the held-out evaluation")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--fit-schedule",
        type=float,
        default=0.0,
        help="> 0: time a few steps first and set optim.total_steps so the schedule ends with the budget; "
        "warmup = this fraction of it",
    )
    parser.add_argument(
        "--decay-fraction", type=float, default=0.0, help="with --fit-schedule: optim.decay_steps as a fraction"
    )
    parser.add_argument("--out", required=True)
    return parser


def cell_config(args: argparse.Namespace, shards: Path) -> tuple[RunConfig, dict, dict]:
    """The cell's RunConfig from --recipe, --set and --model, and those overrides (--set's, --model's)."""
    overrides = {"train.num_workers": 1, **{k: parse_value(v) for k, v in (s.split("=", 1) for s in args.set)}}
    model_overrides = {k: parse_value(v) for k, v in (s.split("=", 1) for s in args.model)}
    base = RunConfig.load(args.recipe, overrides={"data.shards": str(shards), **overrides})
    config = RunConfig.load(
        args.recipe,
        overrides={
            "data.shards": str(shards),
            **overrides,
            "model.overrides": {**base.model.overrides, **model_overrides},
        },
    )
    return config, overrides, model_overrides


def fit_schedule(args: argparse.Namespace, config: RunConfig, ids, rows) -> None:
    """--fit-schedule: optim.total_steps (and warmup, decay) so that the schedule ends with the budget."""
    per_step = time_steps(config, ids, rows)
    total = max(10, int(args.budget / per_step))
    config.optim.total_steps = total
    config.optim.warmup_steps = max(1, int(total * args.fit_schedule))
    config.optim.decay_steps = int(total * args.decay_fraction)
    print(f"{args.name}: {per_step:.2f} CPU-s per step -> total_steps {total}, warmup {config.optim.warmup_steps}")


def micro_batch_stream(config: RunConfig, ids, rows, micro: int):
    """Micro-batches of `micro` rows without end, in a shuffled order per (seed, epoch); yields (epoch, batch)."""
    n = len(rows["example_id"])
    epoch, position = 0, 0
    order = np.random.default_rng([config.run.seed, epoch]).permutation(n)
    while True:
        if position + micro > n:
            epoch, position = epoch + 1, 0
            order = np.random.default_rng([config.run.seed, epoch]).permutation(n)
        take = order[position : position + micro]
        position += micro
        chunk = {name: values[take] for name, values in rows.items()}
        yield epoch, make_micro_batch(chunk, seed=config.run.seed, epoch=epoch, ids=ids, data=config.data)


def held_out_scorer(args: argparse.Namespace, config: RunConfig, shards: Path, ids, unigram):
    """model -> its held-out MLM metrics against the unigram floor (services.eval.evaluate.evaluate_model)."""
    documents = read_heldout(str(shards / "heldout" / "documents.parquet"))
    options = IntrinsicOptions(
        max_seq_length=config.data.max_seq_length,
        seed=config.run.seed,
        max_examples=args.eval_examples,
        mask_prob=args.eval_mask_prob,
        max_ngram=args.eval_max_ngram,
    )
    return lambda model: evaluate_model(model, documents, options, ids, unigram=unigram)


def save_cell(out: Path, record: dict) -> None:
    """Append the cell's record to --out and print its final line."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")
    final = record["final"]
    print(
        f"{record['name']}: mlm_acc {final['mlm_acc']:.4f} (unigram {final['unigram_acc']:.4f}, margin "
        f"{final['mlm_margin']:+.4f}) after {record['steps']} steps, {record['epochs']} epochs",
        flush=True,
    )


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)

    shards = Path(args.shards).resolve()
    config, overrides, model_overrides = cell_config(args, shards)
    ids = resolve_token_ids(shards, config)
    rows = load_rows(shards)
    unigram = load_or_count(shards, sorted((shards / TRAIN_DIR).glob("*.parquet")), ids.vocab_size, ids.special_ids)
    score = held_out_scorer(args, config, shards, ids, unigram)
    if args.fit_schedule > 0:
        fit_schedule(args, config, ids, rows)

    model = initial_model(
        config.model_config(ids.vocab_size),
        config.run.seed,
        unigram if config.model.mlm_bias_init == "unigram" else None,
    )
    o, t = config.optim, config.train
    optimizer, scheduler = optimizer_for(model, o)
    batch = t.global_batch_size
    micro = min(t.micro_batch_size, batch)
    accumulation = batch // micro
    n = len(rows["example_id"])

    curve = []
    eval_points = [args.budget * (i + 1) / args.evals for i in range(args.evals)]

    def evaluate(step: int, cpu: float, wall: float, train_loss: float) -> None:
        metrics = score(model)
        point = {"step": step, "cpu_s": round(cpu, 1), "wall_s": round(wall, 1), "train_loss": train_loss, **metrics}
        curve.append(point)
        print(json.dumps({"name": args.name, **point}), flush=True)

    evaluate(0, 0.0, 0.0, float("nan"))
    cpu_used = wall_used = 0.0
    step, stream, losses = 0, micro_batch_stream(config, ids, rows, micro), []
    while step < o.total_steps and cpu_used < args.budget:
        c0, w0 = time.process_time(), time.perf_counter()
        micro_batches = [next(stream)[1] for _ in range(accumulation)]
        step += 1
        if t.dropout_removal_step and step == t.dropout_removal_step:
            model.set_dropout(0.0)
        model.train()
        torch.manual_seed(step_seed(config.run.seed, 0, step))
        stats = train_step(model, optimizer, scheduler, micro_batches, grad_clip=o.grad_clip)
        losses.append(float(stats.loss))
        cpu_used += time.process_time() - c0
        wall_used += time.perf_counter() - w0
        if not math.isfinite(losses[-1]):
            print(json.dumps({"name": args.name, "diverged_at": step}), flush=True)
            break
        while eval_points and cpu_used >= eval_points[0]:
            eval_points.pop(0)
            evaluate(step, cpu_used, wall_used, float(np.mean(losses[-20:])))
    if not curve or curve[-1]["step"] != step:
        evaluate(step, cpu_used, wall_used, float(np.mean(losses[-20:])) if losses else float("nan"))
    final = curve[-1]
    record = {
        "name": args.name,
        "recipe": args.recipe,
        "set": overrides,
        "model": model_overrides,
        "budget_cpu_s": args.budget,
        "threads": args.threads,
        "steps": step,
        "epochs": round(step * batch / n, 3),
        "examples_per_cpu_s": round(step * batch / max(cpu_used, 1e-9), 2),
        "cpu_per_wall": round(cpu_used / max(wall_used, 1e-9), 3),
        "params": sum(p.numel() for p in model.parameters()),
        "final": {k: final[k] for k in ("mlm_acc", "mlm_loss", "unigram_acc", "unigram_loss", "mlm_margin", "sop_acc")},
        "curve": curve,
        "time": time.time(),
    }
    save_cell(Path(args.out), record)


if __name__ == "__main__":
    main()
