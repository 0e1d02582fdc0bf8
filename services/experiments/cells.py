"""`albert experiment run|table`: the paper's ablation grids, one pretraining run per cell of a spec.

Each cell (`services.experiments.spec`) is pretrained with `services.train.pretrain` (resuming its run), then its
final checkpoint is measured on the shards' held-out documents: the intrinsic metrics with the pair head as
pretrained (taken from the coordinator's final evaluation when it measured the same thing), linear probes of the
pooled [CLS] (`albert_core.evaluation.analysis.pair_probe`) and the parameter count. A finished cell leaves
`<exp>/cells/<cell>.json` (its values, a fingerprint of everything that decides its result, and the results),
written last; a rerun skips it, and a marker whose fingerprint no longer matches the spec is refused. The results
table (results.csv, results.md) is rewritten after every cell. docs/experiments.md has the details.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from albert_core.files import atomic_write_bytes, atomic_write_csv
from albert_core.model.config import ConfigError, count_parameters
from services.experiments.spec import (
    RESULT_METRICS,
    RUNS_DIR,
    Cell,
    ExperimentSpec,
    ProbeSpec,
    cell_config,
    cell_preprocess,
    init_source,
    shards_dir,
)
from services.experiments.stats import claims_markdown, summary_markdown
from services.rundir.config import RunConfig

if TYPE_CHECKING:
    pass  # services.cli builds the parsers

RESULTS_CSV = "results.csv"
RESULTS_MD = "results.md"
MARKER_VERSION = 1
METRIC_COLUMNS = RESULT_METRICS


# ============================================================================================================
# markers of finished cells


# The RunConfig fields markers of version 1 were fingerprinted with. Fields added since count only when they differ
# from their default, so a new field leaves the fingerprints of finished cells as they were.
NOT_FINGERPRINTED = ("finetune",)
V1_FIELDS = {
    "run": {"name", "output_dir", "seed"},
    "model": {"preset", "overrides"},
    "data": {"shards", "max_seq_length", "mask_prob", "max_ngram", "static_shapes"},
    "optim": {
        "name", "lr", "warmup_steps", "total_steps", "weight_decay", "beta1", "beta2", "eps", "bias_correction",
        "trust_clip", "grad_clip",
    },
    "train": {
        "global_batch_size", "micro_batch_size", "num_workers", "backend", "precision", "cpus_per_worker",
        "resources_per_worker", "log_every", "checkpoint_every", "keep_last", "dropout_removal_step", "max_failures",
    },
    "eval": {"every_steps", "heldout_batches", "batch_size", "tasks", "task_data", "task_seeds", "task_max_steps"},
}  # fmt: skip


def fingerprint_fields(config: RunConfig) -> dict[str, dict[str, Any]]:
    """config.to_dict() without the fields added after version 1 that are at their default, and without the
    recipe's fine-tuning defaults ([finetune]: for fine-tuning its checkpoints later, not part of a cell's result)."""
    defaults = RunConfig().to_dict()
    return {
        section: {
            name: value
            for name, value in values.items()
            if name in V1_FIELDS.get(section, ()) or value != defaults[section][name]
        }
        for section, values in config.to_dict().items()
        if section not in NOT_FINGERPRINTED
    }


def cell_fingerprint(spec: ExperimentSpec, cell: Cell) -> str:
    """A hash of everything that decides a cell's result: its RunConfig, preprocess options and probe settings,
    and the fingerprint of the cell it starts from (model.init_from = "cell:NAME")."""
    config = cell_config(spec, cell)
    payload = {
        "version": MARKER_VERSION,
        "run_config": fingerprint_fields(config),
        "preprocess": cell_preprocess(spec, cell, config.data.max_seq_length),
        "probe": dataclasses.asdict(spec.probe),
    }
    source = init_source(spec, cell)
    if source is not None:
        payload["init_from_cell"] = cell_fingerprint(spec, source)
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def marker_path(spec: ExperimentSpec, cell: Cell) -> Path:
    return spec.markers / f"{cell.name}.json"


def finished_result(spec: ExperimentSpec, cell: Cell) -> dict[str, Any] | None:
    """The cell's recorded result, or None if it has not finished. A marker from another configuration is an error."""
    path = marker_path(spec, cell)
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err}); delete it to rerun cell {cell.name}") from None
    if not isinstance(marker, dict) or "result" not in marker or "fingerprint" not in marker:
        raise ConfigError(f"{path}: expected an object with 'fingerprint' and 'result'; delete it to rerun the cell")
    if marker["fingerprint"] != cell_fingerprint(spec, cell):
        raise ConfigError(
            f"{path}: cell {cell.name} finished under a different configuration than {spec.source} now gives; "
            f"delete {path} (and {spec.directory / RUNS_DIR / (spec.name + '-' + cell.name)}) to rerun it, "
            "or give the experiment another name"
        )
    return marker["result"]


# ============================================================================================================
# running


def ensure_shards(options: dict[str, Any], *, progress: bool = False) -> Path:
    """Preprocess into shards_dir(options) unless a finished one (manifest.json) is there; returns the directory."""
    from albert_core.examples.shards import MANIFEST_FILE
    from services.cluster import connect
    from services.preprocess.config import PreprocessConfig
    from services.preprocess.pipeline import run_preprocess

    directory = shards_dir(options)
    if (directory / MANIFEST_FILE).is_file():
        return directory
    connect(worker_logs=False)
    run_preprocess(
        PreprocessConfig(
            inputs=list(options["inputs"]),
            tokenizer=options["tokenizer"],
            output=str(directory),
            objective=options["objective"],
            max_seq_length=options["max_seq_length"],
            short_seq_prob=options["short_seq_prob"],
            seed=options["seed"],
            heldout_fraction=options["heldout_fraction"],
            shard_input_bytes=max(1, int(options["shard_mb"] * (1 << 20))),
            split=options["split"],
            fmt=options["fmt"],
            text_field=options["text_field"],
            progress=progress,
        )
    )
    return directory


def coordinator_evaluation(config: RunConfig, checkpoint: str | Path) -> dict[str, Any] | None:
    """The run's coordinator's held-out evaluation of `checkpoint` when it measured what evaluate_model would here.

    That is: metrics.jsonl has an "eval" line for the checkpoint's step and path (the last one wins, as in the run
    report), the run's ledger shows the coordinator was started with the same shards and IntrinsicOptions, and the
    shards' tokenizer uses ALBERT's special ids (the coordinator's evaluator assumes them). Else None.
    """
    from albert_core.text.tokenization import TokenIds
    from services.eval.evaluate import IntrinsicOptions
    from services.rundir.ledger import ledger_path
    from services.rundir.log import read_metrics
    from services.train.plan import resolve_token_ids

    run_dir = config.run_dir
    state_path = ledger_path(run_dir)
    if not state_path.is_file():
        return None
    started_with = RunConfig.parse(json.loads(state_path.read_text())["config"], source=str(state_path))
    same_options = IntrinsicOptions.from_run_config(started_with) == IntrinsicOptions.from_run_config(config)
    same_shards = Path(started_with.data.shards).resolve() == Path(config.data.shards).resolve()
    token_ids = resolve_token_ids(Path(config.data.shards), config)
    if not (same_options and same_shards and token_ids == TokenIds(vocab_size=token_ids.vocab_size)):
        return None
    path = str(Path(checkpoint).resolve())
    evals = [r for r in read_metrics(run_dir) if r.get("kind") == "eval" and r.get("checkpoint") == path]
    if not evals:
        return None
    return {k: v for k, v in evals[-1].items() if k not in ("step", "time", "kind", "checkpoint", "seconds")}


def evaluate_cell(
    checkpoint: str | Path, config: RunConfig, probe: ProbeSpec, heldout: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Held-out intrinsic metrics (pair head as pretrained) plus linear probes, for one finished cell.

    `heldout`: the intrinsic metrics when they were measured already (the coordinator's evaluation); else they are
    measured here. "heldout_eval" says which.
    """
    from albert_core.evaluation.analysis import pair_probe, transition_roughness
    from albert_core.evaluation.intrinsic import read_heldout
    from albert_core.examples.shards import HELDOUT_FILE
    from albert_core.model.checkpoint import load_model
    from services.eval.evaluate import IntrinsicOptions, evaluate_model
    from services.experiments.analyze import heldout_transitions
    from services.train.plan import resolve_token_ids

    shards = Path(config.data.shards)
    token_ids = resolve_token_ids(shards, config)
    documents = read_heldout(str(shards / HELDOUT_FILE))
    model = load_model(checkpoint)
    if heldout is None:
        result = dict(evaluate_model(model, documents, IntrinsicOptions.from_run_config(config), token_ids))
        result["heldout_eval"] = "runner"
    else:
        result = {**heldout, "heldout_eval": "coordinator"}
    sentences = [d.sentences for d in documents]
    for task in probe.tasks:
        measured = pair_probe(
            model,
            sentences,
            objective=task,
            max_seq_length=config.data.max_seq_length,
            seed=config.run.seed,
            cls_id=token_ids.cls_id,
            sep_id=token_ids.sep_id,
            pad_id=token_ids.pad_id,
            max_examples=probe.examples,
            batch_size=config.eval.batch_size,
            l2=probe.l2,
        )
        result[f"{task}_probe"] = measured["acc"]
        result[f"{task}_probe_detail"] = measured
    if model.config.num_hidden_layers >= 2:  # Figure 1: how much the layer transitions oscillate
        layers = heldout_transitions(
            model, sentences, token_ids, max_seq_length=config.data.max_seq_length, seed=config.run.seed
        )
        result.update(transition_roughness(layers), layers=layers)
    result["params"] = count_parameters(model.config)
    return result


def run_cell(spec: ExperimentSpec, cell: Cell, *, address: str | None = None, progress: bool = False) -> dict[str, Any]:
    """Pretrain one cell (resuming its run), evaluate its final checkpoint, write its marker; returns the result."""
    from services.train.pretrain import pretrain

    config = cell_config(spec, cell)
    source = init_source(spec, cell)
    if source is not None:
        done = finished_result(spec, source)
        if done is None:
            raise ConfigError(
                f"cell {cell.name}: model.init_from names cell {source.name}, which has not finished; run it first"
            )
        if Path(done["checkpoint"]).resolve() != Path(config.model.init_from).resolve():
            raise ConfigError(
                f"cell {cell.name}: model.init_from names cell {source.name}'s checkpoint at optim.total_steps, "
                f"but that cell finished at {done['checkpoint']} (stopped by train.max_seconds?)"
            )
    options = cell_preprocess(spec, cell, config.data.max_seq_length)
    started = time.time()
    if options is not None:
        ensure_shards(options, progress=progress)
    preprocess_s = time.time() - started
    result = pretrain(config, address=address, resume=True, progress=progress)
    train_s = time.time() - started - preprocess_s
    if result.checkpoint is None or not result.finished:  # finished: total_steps reached or train.max_seconds spent
        raise RuntimeError(
            f"cell {cell.name}: the run stopped at step {result.step} of {config.optim.total_steps} "
            f"({config.run_dir}); rerun the experiment to resume it"
        )
    metrics = evaluate_cell(result.checkpoint, config, spec.probe, coordinator_evaluation(config, result.checkpoint))
    record = {
        "cell": cell.name,
        "values": cell.values,
        "steps": result.step,
        "final_loss": result.metrics.get("loss"),
        "train_s": round(train_s, 1),
        "preprocess_s": round(preprocess_s, 1),
        "eval_s": round(time.time() - started - preprocess_s - train_s, 1),
        "checkpoint": str(result.checkpoint),
        "shards": config.data.shards,
        **metrics,
        **run_curves(config.run_dir),
    }
    marker = {"version": MARKER_VERSION, "fingerprint": cell_fingerprint(spec, cell), "result": record}
    atomic_write_bytes(marker_path(spec, cell), (json.dumps(marker, indent=2, default=str) + "\n").encode())
    return record


def run_curves(run_dir: str | Path) -> dict[str, list[list[float]]]:
    """What the report plots of a run, kept in the cell's marker so that the report needs no run directory:
    "curve", [step, mlm_acc, pair_acc] of each training log line, and "evals", [step, mlm_acc, sop_acc, nsp_acc] of
    each held-out evaluation (the last line of a step wins, as after a resume)."""
    from services.rundir.log import last_per_step, read_metrics

    records = read_metrics(run_dir)
    train = last_per_step([r for r in records if r.get("kind") == "train" and "mlm_acc" in r])
    evals = last_per_step([r for r in records if r.get("kind") == "eval" and "mlm_acc" in r])
    return {
        "curve": [[int(r["step"]), round(r["mlm_acc"], 5), round(r["pair_acc"], 5)] for r in train],
        "evals": [
            [int(r["step"]), *(round(float(r.get(k, math.nan)), 5) for k in ("mlm_acc", "sop_acc", "nsp_acc"))]
            for r in evals
        ],
    }


def run_experiment(
    spec: ExperimentSpec,
    *,
    address: str | None = None,
    only: list[str] | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Run every unfinished cell in order (or those named in `only`), rewriting the results table after each.

    Returns one record per finished cell, with "status": "ran" or "cached".
    """
    cells = spec.expand()
    if only:
        names = {c.name for c in cells}
        missing = [n for n in only if n not in names]
        if missing:
            raise ConfigError(f"--only: no cell named {missing[0]!r} (cells: {', '.join(sorted(names))})")
        cells = [c for c in cells if c.name in only]
    spec.directory.mkdir(parents=True, exist_ok=True)
    records = []
    for index, cell in enumerate(cells, 1):
        done = finished_result(spec, cell)
        if done is not None:
            print(f"[{index}/{len(cells)}] {cell.name}: finished before, skipped")
            records.append({**done, "status": "cached"})
            continue
        print(f"[{index}/{len(cells)}] {cell.name}: {cell.values}")
        records.append({**run_cell(spec, cell, address=address, progress=progress), "status": "ran"})
        write_tables(spec)
    write_tables(spec)
    return records


# ============================================================================================================
# results tables


def collect_results(spec: ExperimentSpec) -> list[dict[str, Any]]:
    """The finished cells' results in spec order."""
    return [r for cell in spec.expand() if (r := finished_result(spec, cell)) is not None]


def table_rows(spec: ExperimentSpec, results: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    axes = list(dict.fromkeys(k for r in results for k in r["values"]))
    short = {k: k.rsplit(".", 1)[-1] for k in axes}
    if len(set(short.values())) < len(short):
        short = {k: k for k in axes}
    columns = ["cell", *short.values(), "params", "steps", *METRIC_COLUMNS, "final_loss", "train_s"]
    rows = []
    for r in results:
        row = {"cell": r["cell"], **{short[k]: r["values"].get(k, "") for k in axes}}
        row.update({c: r.get(c) for c in ("params", "steps", *METRIC_COLUMNS, "final_loss", "train_s")})
        rows.append(row)
    return columns, rows


def write_tables(spec: ExperimentSpec) -> tuple[Path, Path]:
    """results.csv (full precision) and results.md (the paper-style table with its notes)."""
    results = collect_results(spec)
    columns, rows = table_rows(spec, results)
    csv_path = spec.directory / RESULTS_CSV
    md_path = spec.directory / RESULTS_MD
    atomic_write_csv(csv_path, rows, columns)
    atomic_write_bytes(md_path, markdown_table(spec, columns, rows, results).encode())
    return csv_path, md_path


def markdown_table(
    spec: ExperimentSpec, columns: list[str], rows: list[dict[str, Any]], results: list[dict[str, Any]]
) -> str:
    def cell(column: str, value: Any) -> str:
        if value is None or value == "":
            return ""
        if column == "params":
            return f"{value / 1e6:.2f}M"
        if column in METRIC_COLUMNS:
            return f"{100 * value:.1f}" if column != "mlm_loss" else f"{value:.3f}"
        if isinstance(value, float):
            return f"{value:.3f}" if column != "train_s" else f"{value:.0f}"
        return str(value)

    lines = [f"# {spec.name}", ""]
    if spec.description:
        lines += [spec.description, ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(c, r.get(c)) for c in columns) + " |" for r in rows]
    lines += [
        "",
        "Accuracies in %, on the held-out documents of each cell's shards. sop_acc / nsp_acc: the pair head as "
        "pretrained, on SOP and NSP pairs (a model pretrained without a pair objective has an untrained head). "
        "sop_probe / nsp_probe: a logistic regression fitted on the frozen pooled [CLS] of pairs from half of the "
        "held-out documents, scored on the other half. params: embeddings + encoder + pooler "
        "(albert_core.model.config.count_parameters). l2_roughness / cosine_roughness: how much the layer "
        "transitions oscillate (Figure 1; albert_core.evaluation.analysis.transition_roughness). train_s: wall "
        "seconds of the pretraining run.",
        "",
    ]
    if spec.seeds:
        lines += ["## Over seeds", "", summary_markdown(spec, results, METRIC_COLUMNS)]
        lines += [
            "Mean ± standard error over the seeds (run.seed: initialization, data order and masks); Δ: the "
            "difference of the means to the reference group with a 95% interval (Welch).",
            "",
        ]
    if spec.claims:
        lines += ["## Claims", "", claims_markdown(spec, results)]
    return "\n".join(lines)
