"""`albert preprocess` (services.cli builds its parser): the checks before Ray, the run, and what it prints.

`--on-error` has three settings. Unset (the default) is strict about what the command line names and lenient
about what is inside: an --input that matches nothing stops the command before anything runs (exit 2), since that
is nearly always a typo, while a bad file or record found inside the inputs (unreadable, binary, invalid UTF-8, a
malformed JSON line, ...) is skipped, counted in manifest.json and named on the console, since a real corpus
nearly always has a few. `skip` also turns a missing input into a counted skip; `fail` stops at the first bad file
or record, naming it. Whatever the setting, a run that makes no training example is an error (exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.preprocess_checks import NoExamplesError, check_arguments

if TYPE_CHECKING:
    from argparse import Namespace

    from services.preprocess import PreprocessConfig

ON_ERROR_HELP = (
    "default: an --input matching nothing stops the command before it starts; bad files and records inside the "
    "inputs are skipped, counted in manifest.json and named on the console. skip: missing inputs are skipped too. "
    "fail: the first bad file or record stops the job, naming it"
)
SHOWN_SKIPS = 5  # files with skips named on the console; manifest.json lists them all


def config_from_args(args: Namespace) -> PreprocessConfig:
    """The PreprocessConfig of the command line, its numbers checked naming the option (ValueError)."""
    from services.preprocess import PreprocessConfig

    check_arguments(args)
    return PreprocessConfig(
        inputs=args.input,
        tokenizer=args.tokenizer,
        output=args.output,
        objective=args.objective,
        max_seq_length=args.max_seq_length,
        short_seq_prob=args.short_seq_prob,
        seed=args.seed,
        on_error=args.on_error or "skip",
        skip_missing_inputs=args.on_error == "skip",
        heldout_fraction=args.heldout_fraction,
        shard_input_bytes=max(1, int(args.shard_mb * (1 << 20))),
        fmt=args.format,
        text_field=args.text_field,
        split=args.split,
        num_cpus=args.num_cpus,
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def skip_lines(manifest: dict[str, Any], listed_in: str, shown: int = SHOWN_SKIPS) -> list[str]:
    """The console's account of skips: the first `shown` files that had any, their reasons and first skip."""
    files = [(path, stats) for path, stats in manifest["files"].items() if stats["skipped"]]
    if not files:
        return []
    lines = [f"skipped {_count(manifest['documents']['skipped'], 'document')} in {_count(len(files), 'file')}:"]
    for path, stats in files[:shown]:
        counts = ", ".join(f"{reason} {n}" for reason, n in sorted(stats["skipped"].items()))
        first = stats["skip_examples"][0] if stats["skip_examples"] else None
        detail = first["detail"] if first is None or len(first["detail"]) <= 80 else first["detail"][:77] + "..."
        lines.append(f"  {path}: {counts}" + (f" (first: {first['location']}: {detail})" if first else ""))
    if len(files) > shown:
        lines.append(f"  and {len(files) - shown} more; see {listed_in}")
    return lines


def cmd_preprocess(args: Namespace) -> int:
    """`albert preprocess`: everything checked before Ray starts (a mistake exits 2 within a second or so)."""
    from albert_core.shards import MANIFEST_FILE
    from services.preprocess import PROGRESS_DIR, plan_preprocess, run_preprocess

    config = config_from_args(args)
    job = plan_preprocess(config)
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=args.num_cpus, include_dashboard=False)
    manifest_path = Path(config.output) / MANIFEST_FILE
    try:
        m = run_preprocess(config, job)
    except NoExamplesError as err:
        for line in skip_lines(err.manifest, str(Path(config.output) / PROGRESS_DIR / "shard-*.json")):
            print(line)
        raise
    d, t = m["documents"], m["timings"]
    reasons = ", ".join(f"{k} {v}" for k, v in d["skipped_by_reason"].items()) or "none"
    print(f"documents: {d['read']} read, {d['used']} used, {d['heldout']} held out, {d['skipped']} skipped ({reasons})")
    for line in skip_lines(m, str(manifest_path)):
        print(line)
    print(f"sentences: {m['sentences']}  tokens: {m['tokens']}  examples: {m['examples']}  shards: {len(m['shards'])}")
    speed = f"{t['tokens_per_s']:,.0f} tokens/s" if t["tokens_per_s"] else "nothing to redo"
    print(f"time: {t['total_s']:.1f}s ({speed}; {t['shards_resumed']} shards resumed)")
    print(f"wrote {manifest_path}")
    return 0
