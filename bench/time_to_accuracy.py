"""Time to accuracy: wall seconds until held-out MLM accuracy reaches a target, for our pipeline and for an
independent reference, on the same shards and the same machine, measured in one run (target: ours >= 2x sooner).

- ours       `albert pretrain --config tiny` as a user runs it (services.train.pretrain: embedded Ray, 2 Ray Train
             workers, the coordinator evaluating every `--eval-every` steps). The clock starts when pretrain is
             called, so Ray's start-up counts; a step's time is when its train line was logged.
- reference  transformers' AlbertForPreTraining of the tiny recipe's shape (post-LN, as transformers' ALBERT is,
             its own initialization), torch AdamW, the recipe's global batch and warmup steps, then linear decay to
             0 at the end of the budget (its step count sized from the first 10 steps' time), plain 15% BERT
             masking (80/10/10 over single pieces), examples shuffled per epoch, in this process with every core;
             one run per learning rate of `--ref-lrs`, each for `--budget` seconds of training (evaluation time is not
             counted). Its best learning rate is the one compared.

Both are scored by the same evaluator (albert_core.evaluation.intrinsic: the held-out documents, n-gram masking, fixed
positions), next to the unigram baseline on those positions. Writes `<out>/time_to_accuracy.json` and `.png`.

    python bench/time_to_accuracy.py [--shards DIR] [--target 0.15] [--budget 600] [--ref-lrs 1e-3,2e-3,5e-3]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from albert_core.evaluation.intrinsic import intrinsic_metrics, read_heldout
from albert_core.evaluation.unigram import UnigramBaseline
from albert_core.examples.shards import HELDOUT_FILE, TRAIN_DIR
from albert_core.text.tokenization import TokenIds
from services.rundir.config import RunConfig
from services.rundir.log import read_metrics
from services.train.plan import resolve_token_ids, unigram_for

DEFAULT_SHARDS = Path(".cache/albert/sample-shards-8000-128")
EVAL_EXAMPLES = 256
TIMED_STEPS = 10


# --- the reference --------------------------------------------------------------------------------------------


class HFAdapter(torch.nn.Module):
    """transformers' AlbertForPreTraining seen through the interface our evaluator calls."""

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model
        self.config = None  # the evaluator checks our config's sizes only when present

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, mlm_labels=None):
        out = self.hf(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        logits = out.prediction_logits[mlm_labels != -100] if mlm_labels is not None else out.prediction_logits
        return type("Out", (), {"mlm_logits": logits, "pair_logits": out.sop_logits})()


def bert_mask(ids: np.ndarray, rng: np.random.Generator, ids_info: TokenIds) -> tuple[np.ndarray, np.ndarray]:
    """Plain BERT masking: 15% of the non-special pieces, 80% [MASK], 10% random, 10% kept."""
    labels = np.full_like(ids, -100)
    candidates = ~np.isin(ids, list(ids_info.special_ids))
    chosen = candidates & (rng.random(ids.shape) < 0.15)
    labels[chosen] = ids[chosen]
    ids = ids.copy()
    roll = rng.random(ids.shape)
    ids[chosen & (roll < 0.8)] = ids_info.mask_id
    random = chosen & (roll >= 0.8) & (roll < 0.9)
    ids[random] = rng.integers(5, ids_info.vocab_size, int(random.sum()))
    return ids, labels


def reference_batches(shards: Path, token_ids: TokenIds, batch: int, seed: int):
    """Shuffled, BERT-masked, padded batches of the shards, forever (a new order each epoch)."""
    files = sorted((shards / TRAIN_DIR).glob("*.parquet"))
    table = pa.concat_tables([pq.read_table(f) for f in files])
    inputs = table.column("input_ids").to_pylist()
    types = table.column("token_type_ids").to_pylist()
    sop = np.asarray(table.column("pair_label").to_pylist())
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(inputs))
        for start in range(0, len(order) - batch + 1, batch):
            rows = order[start : start + batch]
            width = max(len(inputs[r]) for r in rows)
            ids = np.zeros((batch, width), dtype=np.int64)
            tt = np.zeros_like(ids)
            attention = np.zeros_like(ids)
            for i, r in enumerate(rows):
                n = len(inputs[r])
                ids[i, :n], tt[i, :n], attention[i, :n] = inputs[r], types[r], 1
            masked, labels = bert_mask(ids, rng, token_ids)
            labels[attention == 0] = -100
            yield {
                "input_ids": torch.from_numpy(masked),
                "attention_mask": torch.from_numpy(attention),
                "token_type_ids": torch.from_numpy(tt),
                "labels": torch.from_numpy(labels),
                "sentence_order_label": torch.from_numpy(sop[rows]),
            }


def run_reference(args, config: RunConfig, token_ids: TokenIds, lr: float, documents, unigram) -> list[dict]:
    from transformers import AlbertConfig as HFConfig
    from transformers import AlbertForPreTraining as HFModel

    m = config.model_config(token_ids.vocab_size)
    torch.manual_seed(config.run.seed)
    hf = HFModel(
        HFConfig(
            vocab_size=m.vocab_size,
            embedding_size=m.embedding_size,
            hidden_size=m.hidden_size,
            num_hidden_layers=m.num_hidden_layers,
            num_attention_heads=m.num_attention_heads,
            intermediate_size=m.intermediate_size,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            max_position_embeddings=m.max_position_embeddings,
        )
    )
    optimizer = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.01)
    planned = {"steps": 10**9}  # sized from the first TIMED_STEPS steps' time: the decay ends with the budget
    warmup = config.optim.warmup_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (planned["steps"] - s) / max(1, planned["steps"] - warmup)))
    )
    model = HFAdapter(hf)
    curve, seconds, step = [], 0.0, 0
    next_eval = 0.0
    for batch in reference_batches(args.shards, token_ids, config.train.global_batch_size, config.run.seed):
        if step == TIMED_STEPS:
            planned["steps"] = max(warmup + 1, int(args.budget / (seconds / TIMED_STEPS)))
        if seconds >= next_eval:
            curve.append({"step": step, "seconds": seconds, **evaluate(model, documents, token_ids, config, unigram)})
            print(f"reference lr {lr}: {curve[-1]['seconds']:.0f} s, step {step}, mlm_acc {curve[-1]['mlm_acc']:.4f}")
            next_eval += args.budget / 10
        if seconds >= args.budget:
            break
        start = time.perf_counter()
        hf.train()
        loss = hf(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        seconds += time.perf_counter() - start
        step += 1
    return curve


def evaluate(model, documents, token_ids: TokenIds, config: RunConfig, unigram: UnigramBaseline) -> dict:
    metrics = intrinsic_metrics(
        model,
        documents,
        token_ids=token_ids,
        max_seq_length=config.data.max_seq_length,
        seed=config.run.seed,
        max_examples=EVAL_EXAMPLES,
        unigram=unigram,
    )
    return {k: metrics[k] for k in ("mlm_acc", "mlm_loss", "unigram_acc", "sop_acc")}


# --- ours -----------------------------------------------------------------------------------------------------


def run_ours(args, out: Path) -> list[dict]:
    from services.train.pretrain import pretrain

    config = RunConfig.load(
        args.recipe,
        overrides={
            "data.shards": str(args.shards),
            "run.name": f"tta-{time.strftime('%Y%m%d-%H%M%S')}",
            "run.output_dir": str(out / "runs"),
            "eval.every_steps": args.eval_every,
            "eval.heldout_batches": EVAL_EXAMPLES // 32,
            "eval.batch_size": 32,
            "train.checkpoint_every": args.eval_every,
            "train.keep_last": 1000,
        },
    )
    started = time.time()
    pretrain(config, resume=False, progress=False)
    records = read_metrics(config.run_dir)
    when = {r["step"]: r["time"] - started for r in records if r["kind"] == "train"}
    curve = [{"step": 0, "seconds": 0.0}]
    for r in sorted((r for r in records if r["kind"] == "eval"), key=lambda r: r["step"]):
        keys = ("mlm_acc", "mlm_loss", "unigram_acc", "sop_acc")
        curve.append({"step": r["step"], "seconds": when.get(r["step"]), **{k: r.get(k) for k in keys}})
    return curve


# --- comparison -----------------------------------------------------------------------------------------------


def time_to(curve: list[dict], target: float) -> float | None:
    return next((p["seconds"] for p in curve if p.get("mlm_acc") is not None and p["mlm_acc"] >= target), None)


def plot(path: Path, ours: list[dict], references: dict[float, list[dict]], target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    points = [(p["seconds"], p["mlm_acc"]) for p in ours if p.get("mlm_acc") is not None]
    ax.plot(*zip(*points, strict=True), marker="o", label="albert (tiny recipe, Ray, 2 workers)")
    for lr, curve in references.items():
        seconds, accuracy = [p["seconds"] for p in curve], [p["mlm_acc"] for p in curve]
        ax.plot(seconds, accuracy, marker=".", label=f"transformers, lr {lr}")
    floor = next((p["unigram_acc"] for p in ours if p.get("unigram_acc") is not None), None)
    if floor is not None:
        ax.axhline(floor, color="black", linestyle=":", label="unigram baseline")
    ax.axhline(target, color="grey", linestyle="--", label=f"target {target}")
    ax.set_xlabel("wall seconds")
    ax.set_ylabel("held-out MLM accuracy")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=Path, default=DEFAULT_SHARDS)
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--target", type=float, default=0.15)
    parser.add_argument("--budget", type=float, default=600.0, help="training seconds per reference run")
    parser.add_argument("--ref-lrs", default="1e-3,2e-3,5e-3")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    args.shards = args.shards.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    config = RunConfig.load(args.recipe, overrides={"data.shards": str(args.shards)})
    token_ids = resolve_token_ids(args.shards, config)
    unigram = unigram_for(args.shards, config)
    documents = read_heldout(str(args.shards / HELDOUT_FILE))

    ours = run_ours(args, args.out)
    lrs = [float(lr) for lr in args.ref_lrs.split(",")]
    references = {lr: run_reference(args, config, token_ids, lr, documents, unigram) for lr in lrs}
    ours_s = time_to(ours, args.target)
    ref_s = {lr: time_to(curve, args.target) for lr, curve in references.items()}
    reached = [s for s in ref_s.values() if s is not None]
    best_ref = min(reached) if reached else None
    result = {
        "target": args.target,
        "ours_seconds": ours_s,
        "reference_seconds": ref_s,
        "reference_best_seconds": best_ref,
        "ratio": (best_ref / ours_s) if best_ref and ours_s else None,
        "reference_budget_s": args.budget,
        "ours": ours,
        "references": {str(k): v for k, v in references.items()},
    }
    (args.out / "time_to_accuracy.json").write_text(json.dumps(result, indent=1))
    plot(args.out / "time_to_accuracy.png", ours, references, args.target)
    if best_ref is None:
        bound = f"the reference did not reach it in {args.budget:.0f} s of training at any lr"
        ratio = f">= {args.budget / ours_s:.1f}x" if ours_s else "n/a"
    else:
        bound, ratio = f"reference (best lr) {best_ref:.0f} s", f"{best_ref / ours_s:.2f}x" if ours_s else "n/a"
    print(f"time to held-out MLM accuracy {args.target}: ours {ours_s} s; {bound}; ours faster by {ratio}")


if __name__ == "__main__":
    main()
