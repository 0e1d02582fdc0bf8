"""The paper's experiments: `albert analyze layers` (Figure 1) and `albert experiment run` (ablation grids).

analyze layers: for each checkpoint (ours or transformers', ALBERT or BERT-style), the mean L2 distance and cosine
similarity between every layer's input and output over the real tokens of held-out inputs
(`albert_core.analysis.layer_transitions`), written as layers.csv and layers.png (one line per checkpoint).
The inputs are either a held-out Parquet file from `albert preprocess` (`<shards>/heldout/documents.parquet`:
unmasked `[CLS] A [SEP] B [SEP]` pairs of consecutive segments, token ids of the shards' tokenizer, which every
checkpoint must share) or a plain text file (paragraphs separated by blank lines, each checkpoint reading it with
its own tokenizer: spiece.model / tokenizer.json / vocab.txt in the checkpoint directory, else `--tokenizer`).

experiment run: a grid of pretraining runs described by a TOML spec (configs/experiments/*.toml):

    [experiment]
    name = "table5-small"            # everything goes to <output_dir>/<name>/
    recipe = "tiny"                  # the base RunConfig: a shipped recipe name or a TOML path
    output_dir = "runs/experiments"
    [set]                            # dotted fields set in every cell
    "optim.total_steps" = 150
    [grid]                           # axes; every combination is one cell, the first axis varying slowest
    "preprocess.objective" = ["none", "nsp", "sop"]
    "model.overrides.sharing" = ["all", "none"]
    [[cells]]                        # optional explicit cells (instead of, or after, the grid's)
    name = "e768"                    # optional; else named after its values
    "model.overrides.embedding_size" = 768
    [preprocess]                     # optional: the shards are built here, once per distinct preprocess option set
    inputs = ["data/corpus"]
    tokenizer = ".cache/albert/tokenizer-8000/spiece.model"
    [probe]                          # linear probes of the pooled [CLS] (see below)
    examples = 512

Dotted fields: `section.field` of RunConfig (run, model, data, optim, train, eval), `model.overrides.FIELD` for any
AlbertConfig field (embedding_size, sharing, num_hidden_groups, num_hidden_layers, hidden_size, ...), and
`preprocess.FIELD` (objective, short_seq_prob, heldout_fraction, ...): the pretraining objective is a property of
the shards (`albert preprocess --objective sop|nsp|none`), so each distinct preprocess option set gets its own
shards directory `<cache>/<objective>-<max_seq_length>-<hash>`, built once and reused (a directory with a
manifest.json is complete). Every cell's RunConfig is built and validated before anything runs.

`"model.init_from" = "cell:NAME"` starts a cell from the final checkpoint of an earlier cell NAME of the same spec
(progressive stacking onto the cell's depth, `albert_core.stacking`; configs/experiments/stacking-small.toml). The
cell's RunConfig then names that checkpoint's path, its fingerprint includes NAME's, and it runs after NAME.

Each cell: `services.pipeline.pretrain` (coordinator, checkpoints, resume from the newest good checkpoint), then the
final checkpoint is measured on the shards' held-out documents:
- mlm_acc / mlm_loss / sop_acc / nsp_acc: `services.eval.evaluate_model` with the run's IntrinsicOptions, i.e. the
  pretrained pair head applied as it is, on SOP pairs and on NSP pairs (the paper's Table 5 protocol; a model
  pretrained without a pair objective has an untrained head and scores chance). This is exactly what the run's
  coordinator already does with the final checkpoint (it always evaluates a run's last checkpoint, on
  `<shards>/heldout` with the run's IntrinsicOptions), so the cell takes that evaluation from the run's
  metrics.jsonl instead of repeating it (`coordinator_evaluation`; the result says "heldout_eval": "coordinator").
  Reusing it was simpler than switching the coordinator's final evaluation off for cells, which would need a
  coordinator option and leave plain `albert pretrain` runs and cells evaluated by different code. The runner
  evaluates the checkpoint itself ("heldout_eval": "runner") only when that evaluation is missing (it failed, or
  was still running when pretrain stopped waiting) or could differ: the coordinator was started with other
  evaluation options or shards (coordinator.json), or the shards' tokenizer has special ids other than ALBERT's
  layout (the coordinator's evaluator assumes that layout).
- sop_probe / nsp_probe: the pair head re-fitted for the task with the encoder frozen: a fresh logistic
  regression on the pooled [CLS] vector (the pair head's input), trained on unmasked pairs from one half of the
  held-out documents and scored on pairs from the other half (`albert_core.analysis.pair_probe`). This is what
  "briefly fine-tune the pair head" means here, and it is done for every model and task alike, so an NSP model
  probed on SOP and an objective-none model are measured the same way as the rest.
- params: `albert_core.config.count_parameters` of the cell's model (embeddings + encoder + pooler).
A finished cell leaves `<exp>/cells/<cell>.json` (its values, a fingerprint of everything that decides its
result, and the results), written last; a rerun skips it. RunConfig fields added after the first marker version
(model.init_from, train.compile, ...) enter the fingerprint only when set, so adding a field does not orphan the
cells that finished before it existed. A marker whose fingerprint no longer matches the spec is
refused, not silently reused. The results table (results.csv, results.md) is rewritten after every cell.

Cluster: `--address` runs each cell's Ray Train workers on that cluster (the driver stays here); the shards, cache
and output directories must then be paths every node can read (a shared filesystem).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import io
import itertools
import json
import re
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from albert_core.config import AlbertConfig, ConfigError, count_parameters
from albert_core.files import atomic_write_bytes
from services.run_config import RunConfig, resolve_config_path

CELLS_DIR = "cells"
RUNS_DIR = "runs"
RESULTS_CSV = "results.csv"
RESULTS_MD = "results.md"
MARKER_VERSION = 1
LAYERS_CSV = "layers.csv"
LAYERS_PNG = "layers.png"
RUN_SECTIONS = ("run", "model", "data", "optim", "train", "eval")
METRIC_COLUMNS = ("mlm_acc", "mlm_loss", "sop_acc", "nsp_acc", "sop_probe", "nsp_probe")


# ============================================================================================================
# analyze layers (Figure 1)


def checkpoint_label(path: str | Path) -> str:
    """A short name for a checkpoint: the run name for `<run>/checkpoints/step_N`, else the directory name."""
    path = Path(path).resolve()
    if path.name.startswith("step_") and path.parent.name == "checkpoints":
        return f"{path.parent.parent.name}@{int(path.name.removeprefix('step_'))}"
    return path.name


def _read_paragraphs(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    paragraphs = [" ".join(block.split()) for block in re.split(r"\n\s*\n", text)]
    paragraphs = [p for p in paragraphs if p]
    if not paragraphs:
        raise ValueError(f"{path}: no text (expected paragraphs separated by blank lines)")
    return paragraphs


def _text_sequences(
    paragraphs: list[str], checkpoint: Path, tokenizer: str | None, max_seq_length: int
) -> tuple[list[list[int]], int]:
    """[CLS] paragraph [SEP] token ids and the pad id, with the checkpoint's own tokenizer (spiece.model,
    tokenizer.json or vocab.txt in its directory), else with `tokenizer` (a spiece.model)."""
    from albert_core.tokenization import MODEL_FILE, Tokenizer

    if (checkpoint / "tokenizer.json").is_file() or (checkpoint / "vocab.txt").is_file():
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
        encoded = hf(paragraphs, truncation=True, max_length=max_seq_length)["input_ids"]
        return [list(ids) for ids in encoded], int(hf.pad_token_id or 0)
    spiece = checkpoint / MODEL_FILE if (checkpoint / MODEL_FILE).is_file() else tokenizer
    if spiece is None:
        raise ValueError(
            f"{checkpoint}: no tokenizer for the text input: put spiece.model, tokenizer.json or vocab.txt in the "
            "checkpoint directory, or pass --tokenizer spiece.model"
        )
    tok = Tokenizer.load(spiece)
    body = max_seq_length - 2
    return [[tok.cls_id, *tok.encode(p)[:body], tok.sep_id] for p in paragraphs], tok.pad_id


def _heldout_sequences(
    heldout: Path, tokenizer: str | None, max_seq_length: int, max_examples: int, seed: int
) -> tuple[list[list[int]], list[list[int]], int, int]:
    """Unmasked consecutive-segment pairs from held-out documents: (ids, token types, pad id, vocab size)."""
    from albert_core.analysis import document_pairs
    from albert_core.evaluation import read_heldout
    from albert_core.tokenization import TokenIds, Tokenizer
    from services.train import resolve_token_ids

    if tokenizer:
        ids = TokenIds.from_tokenizer(Tokenizer.load(tokenizer))
    else:
        shards = heldout.parent.parent  # <shards>/heldout/documents.parquet
        try:
            ids = resolve_token_ids(shards, RunConfig())
        except ConfigError as err:
            raise ValueError(f"{heldout}: cannot tell its tokenizer ({err}); pass --tokenizer") from None
    documents = read_heldout(str(heldout))
    examples = document_pairs(
        [d.sentences for d in documents],
        objective="none",
        max_seq_length=max_seq_length,
        seed=seed,
        cls_id=ids.cls_id,
        sep_id=ids.sep_id,
        max_examples=max_examples,
    )
    if not examples:
        raise ValueError(f"{heldout}: the held-out documents yield no pairs")
    return [e.input_ids for e in examples], [e.token_type_ids for e in examples], ids.pad_id, ids.vocab_size


def analyze_layers(
    checkpoints: list[str | Path],
    heldout: str | Path,
    out_dir: str | Path,
    *,
    labels: list[str] | None = None,
    tokenizer: str | None = None,
    max_seq_length: int = 128,
    max_examples: int = 256,
    batch_size: int = 16,
    seed: int = 12345,
) -> dict[str, Any]:
    """Figure 1 for each checkpoint: writes out_dir/layers.csv and layers.png; returns {"csv", "png", "rows"}."""
    from albert_core.analysis import layer_transitions, pad_batches
    from albert_core.checkpoint import load_model
    from albert_core.model import AlbertModel

    if not checkpoints:
        raise ValueError("analyze layers: give at least one checkpoint directory")
    if labels is not None and len(labels) != len(checkpoints):
        raise ValueError(f"--label: {len(labels)} labels for {len(checkpoints)} checkpoints")
    heldout = Path(heldout)
    if not heldout.is_file():
        raise FileNotFoundError(f"{heldout}: no such held-out file (a .parquet from albert preprocess, or text)")
    labels = labels or [checkpoint_label(c) for c in checkpoints]
    if len(set(labels)) != len(labels):
        raise ValueError(f"checkpoint labels must differ, got {labels}; pass --label for each checkpoint")
    is_parquet = heldout.suffix == ".parquet"
    shared = _heldout_sequences(heldout, tokenizer, max_seq_length, max_examples, seed) if is_parquet else None
    paragraphs = None if is_parquet else _read_paragraphs(heldout)[:max_examples]

    rows: list[dict[str, Any]] = []
    for checkpoint, label in zip(checkpoints, labels, strict=True):
        checkpoint = Path(checkpoint)
        model = load_model(checkpoint, AlbertModel)
        config = model.config
        if shared is not None:
            sequences, types, pad_id, vocab = shared
            if vocab != config.vocab_size:
                raise ValueError(
                    f"{checkpoint}: its vocabulary has {config.vocab_size} entries but {heldout} was tokenized with "
                    f"{vocab}; give a text file as --heldout so each checkpoint uses its own tokenizer"
                )
        else:
            sequences, pad_id = _text_sequences(paragraphs, checkpoint, tokenizer, max_seq_length)
            types = None
            too_big = max(max(s) for s in sequences)
            if too_big >= config.vocab_size:
                raise ValueError(
                    f"{checkpoint}: the tokenizer gives id {too_big}, outside its {config.vocab_size} entries"
                )
        longest = max(len(s) for s in sequences)
        if longest > config.max_position_embeddings:
            raise ValueError(f"{checkpoint}: inputs of {longest} tokens exceed max_position_embeddings")
        batches = pad_batches(sequences, pad_id=pad_id, batch_size=batch_size, token_type_ids=types)
        for row in layer_transitions(model, batches):
            rows.append(
                {
                    "label": label,
                    "checkpoint": str(checkpoint),
                    "sharing": config.sharing,
                    "layers": config.num_hidden_layers,
                    **row,
                }
            )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / LAYERS_CSV
    atomic_write_bytes(
        csv_path, _csv_bytes(rows, ["label", "checkpoint", "sharing", "layers", "layer", "l2", "cosine", "tokens"])
    )
    png_path = out_dir / LAYERS_PNG
    plot_layer_transitions(rows, png_path, title=f"layer transitions on {heldout.name}")
    return {"csv": csv_path, "png": png_path, "rows": rows}


def plot_layer_transitions(rows: list[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Two panels as the paper's Figure 1: L2 distance and cosine similarity per layer, one line per checkpoint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = [r for r in rows if r["label"] == label]
        layers = [r["layer"] for r in mine]
        left.plot(layers, [r["l2"] for r in mine], marker="o", label=label)
        right.plot(layers, [r["cosine"] for r in mine], marker="o", label=label)
    left.set_ylabel("L2 distance (input, output)")
    right.set_ylabel("cosine similarity (input, output)")
    for ax in (left, right):
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


# ============================================================================================================
# experiment specs


@dataclass
class PreprocessSpec:
    """How the shards of every cell are built (services.preprocess.PreprocessConfig fields)."""

    inputs: list[str]
    tokenizer: str
    cache: str = ".cache/albert/experiments"
    objective: str = "sop"
    short_seq_prob: float = 0.1
    seed: int = 12345
    heldout_fraction: float = 0.02
    shard_mb: float = 1.0
    split: str = "file"
    fmt: str = "auto"
    text_field: str = "text"


@dataclass
class ProbeSpec:
    examples: int = 512  # pairs per half (train / test) at most
    tasks: list[str] = field(default_factory=lambda: ["sop", "nsp"])
    l2: float = 1e-3


@dataclass(frozen=True)
class Cell:
    name: str
    values: dict[str, Any]  # dotted field -> value


@dataclass
class ExperimentSpec:
    name: str
    recipe: str
    output_dir: str = "runs/experiments"
    description: str = ""
    set: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    cells: list[dict[str, Any]] = field(default_factory=list)
    preprocess: PreprocessSpec | None = None
    probe: ProbeSpec = field(default_factory=ProbeSpec)
    source: str = "experiment"

    @property
    def directory(self) -> Path:
        return Path(self.output_dir) / self.name

    @classmethod
    def load(cls, path: str | Path) -> ExperimentSpec:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such experiment spec")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML ({err})") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "experiment") -> ExperimentSpec:
        known = {"experiment", "set", "grid", "cells", "preprocess", "probe"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: [{unknown[0]}]: unknown table (expected {', '.join(sorted(known))})")
        head = dict(data.get("experiment", {}))
        for required in ("name", "recipe"):
            if not isinstance(head.get(required), str) or not head[required]:
                raise ConfigError(f"{source}: experiment.{required}: expected a non-empty string")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", head["name"]):
            raise ConfigError(f"{source}: experiment.name: use letters, digits, '.', '_' and '-', got {head['name']!r}")
        extra = sorted(set(head) - {"name", "recipe", "output_dir", "description"})
        if extra:
            raise ConfigError(f"{source}: experiment.{extra[0]}: unknown field")
        grid = data.get("grid", {})
        for key, values in grid.items():
            if not isinstance(values, list) or not values:
                raise ConfigError(f"{source}: grid.{key}: expected a non-empty list of values, got {values!r}")
        cells = data.get("cells", [])
        if not isinstance(cells, list) or not all(isinstance(c, dict) for c in cells):
            raise ConfigError(f"{source}: cells: expected an array of tables ([[cells]])")
        preprocess = None
        if "preprocess" in data:
            preprocess = _dataclass_from(PreprocessSpec, data["preprocess"], f"{source}: preprocess")
        probe = _dataclass_from(ProbeSpec, data.get("probe", {}), f"{source}: probe")
        bad = [t for t in probe.tasks if t not in ("sop", "nsp")]
        if bad:
            raise ConfigError(f"{source}: probe.tasks: expected 'sop' and/or 'nsp', got {bad[0]!r}")
        spec = cls(
            name=head["name"],
            recipe=head["recipe"],
            output_dir=head.get("output_dir", "runs/experiments"),
            description=head.get("description", ""),
            set=dict(data.get("set", {})),
            grid=dict(grid),
            cells=list(cells),
            preprocess=preprocess,
            probe=probe,
            source=source,
        )
        spec.validate()
        return spec

    def expand(self) -> list[Cell]:
        """The grid's combinations (first axis slowest), then the explicit cells; names must be unique."""
        combos = [dict(zip(self.grid, values, strict=True)) for values in itertools.product(*self.grid.values())]
        if not self.grid:
            combos = []
        cells = [Cell(cell_name(values), values) for values in combos]
        for explicit in self.cells:
            values = {k: v for k, v in explicit.items() if k != "name"}
            name = explicit.get("name", cell_name(values))
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._=-]+", name):
                raise ConfigError(
                    f"{self.source}: cells: name: use letters, digits, '.', '_', '=' and '-', got {name!r}"
                )
            cells.append(Cell(name, values))
        if not cells:
            cells = [Cell(cell_name({}), {})]  # no axes: one cell, the recipe with [set]
        seen: dict[str, dict] = {}
        for cell in cells:
            if cell.name in seen:
                raise ConfigError(f"{self.source}: two cells are both named {cell.name!r} ({seen[cell.name]})")
            seen[cell.name] = cell.values
        return cells

    def validate(self) -> None:
        """Build every cell's RunConfig (and preprocess options): all errors surface before any run starts."""
        for cell in self.expand():
            cell_config(self, cell)
            if self.preprocess is None and any(k.startswith("preprocess.") for k in self.fields_of(cell)):
                raise ConfigError(
                    f"{self.source}: cell {cell.name}: preprocess.* fields need a [preprocess] table "
                    "(inputs, tokenizer) to build the shards from"
                )

    def fields_of(self, cell: Cell) -> dict[str, Any]:
        return {**self.set, **cell.values}


def cell_name(values: dict[str, Any]) -> str:
    """`objective-sop_sharing-all` from {"preprocess.objective": "sop", "model.overrides.sharing": "all"}."""
    if not values:
        return "base"
    parts = []
    for key, value in values.items():
        short = key.rsplit(".", 1)[-1]
        text = json.dumps(value) if not isinstance(value, str) else value
        parts.append(f"{short}-{text}")
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", "_".join(parts)).strip("-")


def _dataclass_from(cls, values: Any, where: str):
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a table, got {values!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown field (expected one of {', '.join(sorted(known))})")
    try:
        return cls(**values)
    except TypeError as err:
        raise ConfigError(f"{where}: {err}") from None


def _assign(data: dict[str, Any], dotted: str, value: Any, where: str) -> None:
    parts = dotted.split(".")
    if parts[0] not in RUN_SECTIONS or len(parts) < 2:
        raise ConfigError(
            f"{where}: {dotted!r}: expected section.field with section one of {', '.join(RUN_SECTIONS)} "
            "(or model.overrides.FIELD, preprocess.FIELD)"
        )
    if (len(parts) > 2 and parts[:2] != ["model", "overrides"]) or len(parts) > 3:
        raise ConfigError(f"{where}: {dotted!r}: only model.overrides.FIELD may go deeper than section.field")
    if parts[:2] == ["model", "overrides"] and len(parts) == 3:
        known = {f.name for f in dataclasses.fields(AlbertConfig)}
        if parts[2] not in known:
            raise ConfigError(f"{where}: {dotted!r}: {parts[2]} is not an AlbertConfig field")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{where}: {dotted!r}: {part} is not a table in the recipe")
    node[parts[-1]] = value


def cell_preprocess(spec: ExperimentSpec, cell: Cell, max_seq_length: int) -> dict[str, Any] | None:
    """The preprocess options of a cell (the [preprocess] table with its preprocess.* fields), or None."""
    if spec.preprocess is None:
        return None
    options = dataclasses.asdict(spec.preprocess)
    for key, value in spec.fields_of(cell).items():
        if key.startswith("preprocess."):
            name = key.removeprefix("preprocess.")
            if name not in options or name == "cache":
                raise ConfigError(f"{spec.source}: cell {cell.name}: {key}: not a preprocess option of a cell")
            options[name] = value
    options["max_seq_length"] = max_seq_length
    return options


def shards_dir(options: dict[str, Any]) -> Path:
    """`<cache>/<objective>-<max_seq_length>-<hash of every option>`: one directory per distinct option set."""
    key = {k: v for k, v in options.items() if k != "cache"}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return Path(options["cache"]) / f"{options['objective']}-{options['max_seq_length']}-{digest}"


def cell_config(spec: ExperimentSpec, cell: Cell) -> RunConfig:
    """The cell's RunConfig: the recipe, then [set], then the cell's values; its own run name and directory.
    `model.init_from = "cell:NAME"` becomes the path of cell NAME's final checkpoint."""
    where = f"{spec.source}: cell {cell.name}"
    recipe = resolve_config_path(spec.recipe)
    data = tomllib.loads(recipe.read_text())
    for dotted, value in spec.fields_of(cell).items():
        if not dotted.startswith("preprocess."):
            _assign(data, dotted, value, where)
    data.setdefault("run", {}).update(name=f"{spec.name}-{cell.name}", output_dir=str(spec.directory / RUNS_DIR))
    if spec.preprocess is not None:
        seq = data.get("data", {}).get("max_seq_length", RunConfig().data.max_seq_length)
        data.setdefault("data", {})["shards"] = str(shards_dir(cell_preprocess(spec, cell, seq)))
    source = init_source(spec, cell)
    if source is not None:
        data["model"]["init_from"] = str(final_checkpoint(cell_config(spec, source)))
    return RunConfig.from_dict(data, source=where)


def init_source(spec: ExperimentSpec, cell: Cell) -> Cell | None:
    """The earlier cell whose final checkpoint `model.init_from = "cell:NAME"` names, or None."""
    value = spec.fields_of(cell).get("model.init_from")
    if not isinstance(value, str) or not value.startswith("cell:"):
        return None
    name = value.removeprefix("cell:")
    cells = spec.expand()
    earlier = cells[: [c.name for c in cells].index(cell.name)]
    source = next((c for c in earlier if c.name == name), None)
    if source is None:
        names = ", ".join(c.name for c in earlier) or "none"
        raise ConfigError(
            f"{spec.source}: cell {cell.name}: model.init_from: {value!r} names no earlier cell of the spec "
            f"(earlier cells: {names})"
        )
    return source


def final_checkpoint(config: RunConfig) -> Path:
    """`<run_dir>/checkpoints/step_<total_steps>`: where a finished run's last checkpoint is (services.train_state)."""
    from services.train.state import checkpoint_dir

    return checkpoint_dir(config.run_dir / "checkpoints", config.optim.total_steps)


# The RunConfig fields markers of version 1 were fingerprinted with. Fields added since count only when they differ
# from their default, so a new field leaves the fingerprints of finished cells as they were.
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
    """config.to_dict() without the fields added after version 1 that are at their default."""
    defaults = RunConfig().to_dict()
    return {
        section: {
            name: value
            for name, value in values.items()
            if name in V1_FIELDS.get(section, ()) or value != defaults[section][name]
        }
        for section, values in config.to_dict().items()
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
    return spec.directory / CELLS_DIR / f"{cell.name}.json"


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


def pending_cells(spec: ExperimentSpec) -> list[Cell]:
    return [cell for cell in spec.expand() if finished_result(spec, cell) is None]


# ============================================================================================================
# running


def ensure_shards(options: dict[str, Any], *, progress: bool = False) -> Path:
    """Preprocess into shards_dir(options) unless a finished one (manifest.json) is there; returns the directory."""
    from albert_core.shards import MANIFEST_FILE
    from services.pipeline import connect
    from services.preprocess import PreprocessConfig, run_preprocess

    directory = shards_dir(options)
    if (directory / MANIFEST_FILE).is_file():
        return directory
    connect()
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
    report), coordinator.json shows the coordinator was started with the same shards and IntrinsicOptions, and the
    shards' tokenizer uses ALBERT's special ids (the coordinator's evaluator assumes them). Else None.
    """
    from albert_core.tokenization import TokenIds
    from services.coordinator import STATE_FILE
    from services.eval import IntrinsicOptions
    from services.report import read_metrics
    from services.train import resolve_token_ids

    run_dir = config.run_dir
    state_path = run_dir / STATE_FILE
    if not state_path.is_file():
        return None
    started_with = RunConfig.from_dict(json.loads(state_path.read_text())["config"], source=str(state_path))
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
    from albert_core.analysis import pair_probe
    from albert_core.checkpoint import load_model
    from albert_core.evaluation import read_heldout
    from albert_core.shards import HELDOUT_FILE
    from services.eval import IntrinsicOptions, evaluate_model
    from services.train import resolve_token_ids

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
    result["params"] = count_parameters(model.config)
    return result


def run_cell(spec: ExperimentSpec, cell: Cell, *, address: str | None = None, progress: bool = False) -> dict[str, Any]:
    """Pretrain one cell (resuming its run), evaluate its final checkpoint, write its marker; returns the result."""
    from services.pipeline import pretrain

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
    }
    marker = {"version": MARKER_VERSION, "fingerprint": cell_fingerprint(spec, cell), "result": record}
    atomic_write_bytes(marker_path(spec, cell), (json.dumps(marker, indent=2, default=str) + "\n").encode())
    return record


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
    columns, rows = table_rows(spec, collect_results(spec))
    csv_path = spec.directory / RESULTS_CSV
    md_path = spec.directory / RESULTS_MD
    atomic_write_bytes(csv_path, _csv_bytes(rows, columns))
    atomic_write_bytes(md_path, markdown_table(spec, columns, rows).encode())
    return csv_path, md_path


def markdown_table(spec: ExperimentSpec, columns: list[str], rows: list[dict[str, Any]]) -> str:
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
        "(albert_core.config.count_parameters). train_s: wall seconds of the pretraining run.",
        "",
    ]
    return "\n".join(lines)


def _csv_bytes(rows: list[dict[str, Any]], columns: list[str]) -> bytes:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({c: row.get(c, "") for c in columns})
    return buffer.getvalue().encode()


# ============================================================================================================
# CLI


def cmd_analyze_layers(args: argparse.Namespace) -> int:
    out = analyze_layers(
        args.checkpoints,
        args.heldout,
        args.out,
        labels=args.label or None,
        tokenizer=args.tokenizer,
        max_seq_length=args.max_seq_length,
        max_examples=args.max_examples,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    print(f"{'checkpoint':<32}{'layer':>6}{'L2':>10}{'cosine':>9}")
    for row in out["rows"]:
        print(f"{row['label']:<32}{row['layer']:>6}{row['l2']:>10.4f}{row['cosine']:>9.4f}")
    print(f"wrote {out['csv']} and {out['png']}")
    return 0


def cmd_experiment_run(args: argparse.Namespace) -> int:
    spec = ExperimentSpec.load(args.spec)
    if args.dry_run:
        return _print_plan(spec)
    run_experiment(spec, address=args.address, only=args.only or None, progress=not args.no_progress)
    _, md = write_tables(spec)
    print(md.read_text())
    print(f"wrote {md} and {spec.directory / RESULTS_CSV}")
    return 0


def cmd_experiment_table(args: argparse.Namespace) -> int:
    spec = ExperimentSpec.load(args.spec)
    _, md = write_tables(spec)
    print(md.read_text())
    return 0


def _print_plan(spec: ExperimentSpec) -> int:
    vocab = 30000  # when neither the recipe nor a tokenizer says
    if spec.preprocess is not None and Path(spec.preprocess.tokenizer).exists():
        from albert_core.tokenization import Tokenizer

        vocab = Tokenizer.load(spec.preprocess.tokenizer).vocab_size
    for cell in spec.expand():
        config = cell_config(spec, cell)
        params = count_parameters(config.model_config(config.model.overrides.get("vocab_size") or vocab))
        state = "finished" if finished_result(spec, cell) is not None else "pending"
        print(f"{cell.name:<48} {params / 1e6:>8.2f}M  {config.optim.total_steps:>7} steps  {state}")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add `albert analyze layers` and `albert experiment run|table` to the CLI's subcommands."""
    analyze = commands.add_parser("analyze", help="representation analysis").add_subparsers(
        dest="action", required=True
    )
    layers = analyze.add_parser("layers", help="Figure 1: L2 / cosine between each layer's input and output")
    layers.add_argument("checkpoints", nargs="+", metavar="CKPT", help="model directories (ours or transformers')")
    layers.add_argument(
        "--heldout", required=True, help="<shards>/heldout/documents.parquet, or a text file (blank-line paragraphs)"
    )
    layers.add_argument("--out", required=True, help="directory for layers.csv and layers.png")
    layers.add_argument("--label", action="append", default=[], help="a name per checkpoint, in order")
    layers.add_argument(
        "--tokenizer", help="spiece.model of a .parquet input, or for checkpoints without their own tokenizer files"
    )
    layers.add_argument("--max-seq-length", type=int, default=128)
    layers.add_argument("--max-examples", type=int, default=256)
    layers.add_argument("--batch-size", type=int, default=16)
    layers.add_argument("--seed", type=int, default=12345)
    layers.set_defaults(func=cmd_analyze_layers)

    experiment = commands.add_parser("experiment", help="ablation grids of pretraining runs").add_subparsers(
        dest="action", required=True
    )
    run = experiment.add_parser("run", help="run every unfinished cell of an experiment spec, then its table")
    run.add_argument("spec", help="configs/experiments/NAME.toml")
    run.add_argument("--address", help="Ray cluster address for the training workers; default: embedded local Ray")
    run.add_argument("--only", action="append", default=[], metavar="CELL", help="run only this cell (repeatable)")
    run.add_argument("--dry-run", action="store_true", help="list the cells, parameter counts and status; run nothing")
    run.add_argument("--no-progress", action="store_true")
    run.set_defaults(func=cmd_experiment_run)
    table = experiment.add_parser("table", help="rewrite results.csv / results.md from the finished cells")
    table.add_argument("spec")
    table.set_defaults(func=cmd_experiment_table)
