"""Does pretraining help? Fine-tune a small pretrained ALBERT on sentence polarity vs the same model from random
initialization, with the same budget, and compare accuracy on held-out sentences (issue 5's acceptance experiment).

Data: gensim's pang_lee_polarity.cor (200 movie-review sentences from Pang & Lee, fastText labels), the fixed
split of `albert_core.downstream.glue.polarity_split`: 150 for training, 50 (25 per label) held out. Each run trains
POLARITY_HYPERPARAMS' steps (or --steps) and is scored once, at its last step, on the held-out sentences: no
model selection touches them.

The pretrained checkpoint is `--checkpoint DIR` (any model directory with spiece.model in or above it), or,
until the pretraining service lands, built here from albert_core pieces: a SentencePiece model trained on the
sample corpus (services.sample_data: State of the Union + Moby-Dick + a Wikipedia slice), SOP pairs, n-gram
masking, AlbertForPreTraining (albert-tiny) and LAMB for a few hundred steps. It is cached under --work.

    python bench/finetune_polarity.py [--checkpoint DIR] [--seeds 5] [--pretrain-steps 300] [--steps N]

Prints both accuracies (mean ± std over seeds), their difference and ratio. Keep it under ~15 minutes on
2 CPU cores: the defaults take about that on a loaded machine.

Expect a small gap: 300 steps of 32x64 tokens (~0.6M tokens) leave the MLM near its unigram stage (loss ~6 on 2,000
pieces, SOP at chance), and 50 held-out sentences put one run's standard error near 7 points. A checkpoint from
the pretraining service (`--checkpoint`) is the real test. LAMB's lr matters at this batch size: 5e-3 collapsed
every token's hidden state to the same vector (fine-tuning then predicts one class), 2e-3 does not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

from albert_core.batch import mlm_batch
from albert_core.checkpoint import read_checkpoint, save_model
from albert_core.config import AlbertConfig
from albert_core.corpus import Document, read_documents
from albert_core.downstream.glue import POLARITY_FILE
from albert_core.finetune_config import POLARITY_HYPERPARAMS, FinetuneConfig
from albert_core.finetuning import finetune
from albert_core.model import AlbertForPreTraining
from albert_core.optim import make_optimizer, make_scheduler
from albert_core.pairs import PairConfig, create_pairs
from albert_core.sentences import split_sentences
from albert_core.tokenization import Tokenizer, TokenizerTrainConfig, train_tokenizer

log = logging.getLogger("finetune_polarity")

GENSIM = "gensim==4.4.0"
POLARITY_MEMBER = "gensim/test/test_data/pang_lee_polarity.cor"
POLARITY_SHA256 = "662c1b7c3bd0612eaaaf3f0c694cbd3897e30c0d87d2940b46c9fd0d15ed70c1"


# --- data -------------------------------------------------------------------------------------------------


def fetch_polarity(work: Path) -> Path:
    """pang_lee_polarity.cor from the gensim wheel on PyPI (pip download), checked against its sha256."""
    path = work / POLARITY_FILE
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == POLARITY_SHA256:
        return path
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", tmp]
        cmd += ["--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--implementation", "cp"]
        cmd += ["--abi", "cp311", GENSIM]
        log.info("downloading the %s wheel for %s", GENSIM, POLARITY_FILE)
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
        (wheel,) = Path(tmp).glob("gensim-*.whl")
        data = zipfile.ZipFile(wheel).read(POLARITY_MEMBER)
    digest = hashlib.sha256(data).hexdigest()
    if digest != POLARITY_SHA256:
        raise RuntimeError(f"{POLARITY_MEMBER} in {wheel.name} has sha256 {digest}, expected {POLARITY_SHA256}")
    work.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def corpus_documents(corpus: Path, max_chars: int) -> list[str]:
    """Documents of the sample corpus (every part, interleaved), up to max_chars characters in all."""
    from services.sample_data import PARTS, assemble_sample_corpus

    parts = assemble_sample_corpus(corpus)
    streams = [[r.text for r in read_documents(parts[name]) if isinstance(r, Document)] for name in PARTS]
    documents, total = [], 0
    for group in zip(*streams, strict=False):  # round robin over the parts
        for text in group:
            documents.append(text)
            total += len(text)
        if total >= max_chars:
            break
    return documents


# --- pretraining --------------------------------------------------------------------------------------------


def pretrain(out: Path, args: argparse.Namespace) -> Path:
    """Train a tokenizer and an albert-tiny MLM+SOP model on the sample corpus; save both to `out`."""
    started = time.time()
    documents = corpus_documents(Path(args.corpus), args.corpus_chars)
    log.info("corpus: %d documents, %.1f MB", len(documents), sum(map(len, documents)) / 1e6)
    tokenizer_config = TokenizerTrainConfig(
        vocab_size=args.vocab_size, input_sentence_size=200_000, seed=args.seed, allow_smaller_vocab=True
    )
    train_tokenizer(documents, out, tokenizer_config)
    tokenizer = Tokenizer.load(out)
    encoded = [[tokenizer.encode(s) for s in split_sentences(doc)] for doc in documents]
    pairs = create_pairs(
        encoded,
        config=PairConfig(max_seq_length=args.pretrain_seq_length, objective="sop"),
        rng=np.random.default_rng(args.seed),
        cls_id=tokenizer.cls_id,
        sep_id=tokenizer.sep_id,
    ).examples
    log.info("tokenizer %d pieces; %d SOP pairs (%.0f s)", tokenizer.vocab_size, len(pairs), time.time() - started)

    torch.manual_seed(args.seed)
    dropout = args.pretrain_dropout
    config = AlbertConfig.preset(
        "albert-tiny",
        vocab_size=tokenizer.vocab_size,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        classifier_dropout_prob=dropout,
    )
    model = AlbertForPreTraining(config)
    optimizer = make_optimizer(model, name="lamb", lr=args.pretrain_lr, weight_decay=0.01)
    steps, batch_size = args.pretrain_steps, args.pretrain_batch
    scheduler = make_scheduler(optimizer, warmup_steps=max(1, steps // 10), total_steps=steps)
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(pairs))
    per_epoch = len(order) // batch_size
    if per_epoch == 0:
        raise ValueError(f"{len(pairs)} pretraining pairs do not fill one batch of {batch_size}: use more corpus")
    model.train()
    for step in range(steps):
        epoch, at = divmod(step, per_epoch)
        if at == 0 and step:
            order = rng.permutation(len(pairs))
        index = order[at * batch_size : (at + 1) * batch_size]
        rows = [pairs[i] for i in index]
        batch = mlm_batch(
            [r.input_ids for r in rows],
            [r.token_type_ids for r in rows],
            [r.pair_label for r in rows],
            [tokenizer.word_starts(r.input_ids) for r in rows],
            [int(i) for i in index],
            seed=args.seed,
            epoch=epoch,
            seq_len=None,
            vocab_size=tokenizer.vocab_size,
            special_ids=tokenizer.special_ids,
            mask_id=tokenizer.mask_id,
            pad_id=tokenizer.pad_id,
        )
        out_ = model(**{k: torch.from_numpy(v) for k, v in batch.items()})
        out_.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % max(1, steps // 10) == 0:
            labels = batch["mlm_labels"][batch["mlm_labels"] != -100]
            mlm_acc = float((out_.mlm_logits.argmax(-1).numpy() == labels).mean())
            sop_acc = float((out_.pair_logits.argmax(-1).numpy() == batch["pair_labels"]).mean())
            log.info(
                "pretrain step %d/%d: mlm loss %.3f acc %.3f, sop loss %.3f acc %.2f (%.0f s)",
                step + 1,
                steps,
                out_.mlm_loss.item(),
                mlm_acc,
                out_.pair_loss.item(),
                sop_acc,
                time.time() - started,
            )
    save_model(out, model)
    (out / "pretrain.json").write_text(json.dumps({**vars(args), "seconds": time.time() - started}, indent=2) + "\n")
    return out


# --- the comparison -----------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    work = Path(args.work)
    polarity = Path(args.polarity) if args.polarity else fetch_polarity(work)
    if args.checkpoint:
        checkpoint = Path(args.checkpoint)
    else:
        checkpoint = work / f"pretrained-tiny-{args.pretrain_steps}"
        if not (checkpoint / "model.safetensors").is_file() or args.force:
            pretrain(checkpoint, args)
    architecture, _ = read_checkpoint(checkpoint)
    overrides = {"max_seq_length": args.max_seq_length}
    if args.steps:
        overrides.update(train_steps=args.steps, warmup_steps=args.steps // 10)
    if args.lr:
        overrides["lr"] = args.lr
    tokenizer = FinetuneConfig("polarity", str(polarity), checkpoint=str(checkpoint)).tokenizer_path()
    accuracy: dict[str, list[float]] = {"pretrained": [], "random": []}
    for seed in range(args.seed, args.seed + args.seeds):
        for init in ("pretrained", "random"):
            config = FinetuneConfig(
                "polarity",
                str(polarity),
                checkpoint=str(checkpoint) if init == "pretrained" else None,
                model=architecture if init == "random" else None,
                tokenizer=str(tokenizer),
                seed=seed,
                overrides=overrides,
                eval_every=0,  # scored once, at the end: the held-out sentences select nothing
                eval_batch_size=50,
            )
            result = finetune(config)
            accuracy[init].append(result["dev"]["acc"])
            log.info("seed %d %-10s held-out acc %.3f (%.0f s)", seed, init, result["dev"]["acc"], result["seconds"])
    summary = {
        "checkpoint": str(checkpoint),
        "hyperparams": result["hyperparams"],
        "heldout_sentences": 50,
        "accuracy": accuracy,
        "mean": {k: statistics.mean(v) for k, v in accuracy.items()},
        "std": {k: statistics.stdev(v) if len(v) > 1 else 0.0 for k, v in accuracy.items()},
    }
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a pretrained model directory (default: pretrain one here)")
    parser.add_argument("--polarity", help=f"{POLARITY_FILE} (default: from the gensim wheel on PyPI)")
    parser.add_argument("--work", default=".cache/albert/bench-polarity", help="cache for data and the checkpoint")
    parser.add_argument("--corpus", default=".cache/albert/sample-corpus")
    parser.add_argument("--corpus-chars", type=int, default=3_000_000, help="corpus text used for pretraining")
    parser.add_argument("--vocab-size", type=int, default=2000)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--pretrain-batch", type=int, default=32)
    parser.add_argument("--pretrain-seq-length", type=int, default=64)
    parser.add_argument("--pretrain-lr", type=float, default=2e-3)
    parser.add_argument("--pretrain-dropout", type=float, default=0.0, help="as ALBERT v2 (short runs: no dropout)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, help=f"fine-tuning steps (default {POLARITY_HYPERPARAMS.train_steps})")
    parser.add_argument("--lr", type=float, help=f"fine-tuning lr (default {POLARITY_HYPERPARAMS.lr})")
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the CI machine's cores are shared)")
    parser.add_argument("--force", action="store_true", help="pretrain again even if a cached checkpoint exists")
    parser.add_argument("--output", help="write the summary JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    started = time.time()
    summary = run(args)
    summary["seconds"] = time.time() - started
    mean, std = summary["mean"], summary["std"]
    print(f"\npolarity, {summary['heldout_sentences']} held-out sentences, {args.seeds} seeds, same budget:")
    for init in ("pretrained", "random"):
        runs = ", ".join(f"{a:.2f}" for a in summary["accuracy"][init])
        print(f"  {init:<10} acc {mean[init]:.3f} ± {std[init]:.3f}   ({runs})")
    print(f"  pretrained - random: {mean['pretrained'] - mean['random']:+.3f}")
    print(f"  pretrained / random: {mean['pretrained'] / mean['random']:.3f}x")
    print(f"  ({summary['seconds']:.0f} s in all)")
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
