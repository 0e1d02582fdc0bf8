"""`albert analyze layers` (Figure 1): how much each layer changes its input, per checkpoint.

For each checkpoint (ours or transformers', ALBERT or BERT-style), the mean L2 distance and cosine similarity
between every layer's input and output over the real tokens of held-out inputs
(`albert_core.evaluation.analysis.layer_transitions`), written as layers.csv and layers.png (one line per checkpoint).
The inputs are either a held-out Parquet file from `albert preprocess` (`<shards>/heldout/documents.parquet`:
unmasked `[CLS] A [SEP] B [SEP]` pairs of consecutive segments, token ids of the shards' tokenizer, which every
checkpoint must share) or a plain text file (paragraphs separated by blank lines, each checkpoint reading it with
its own tokenizer: spiece.model / tokenizer.json / vocab.txt in the checkpoint directory, else `--tokenizer`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from albert_core.files import atomic_write_csv
from albert_core.model.config import ConfigError
from services.rundir.checkpoints import CHECKPOINTS_DIR
from services.rundir.config import RunConfig

if TYPE_CHECKING:
    from torch import nn

    from albert_core.text.tokenization import TokenIds

LAYERS_CSV = "layers.csv"
LAYERS_PNG = "layers.png"


def checkpoint_label(path: str | Path) -> str:
    """A short name for a checkpoint: the run name for `<run>/checkpoints/step_N`, else the directory name."""
    path = Path(path).resolve()
    if path.name.startswith("step_") and path.parent.name == CHECKPOINTS_DIR:
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
    from albert_core.text.tokenization import MODEL_FILE, load_tokenizer

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
    tok = load_tokenizer(spiece)
    body = max_seq_length - 2
    return [[tok.cls_id, *tok.encode(p)[:body], tok.sep_id] for p in paragraphs], tok.pad_id


def _heldout_sequences(
    heldout: Path, tokenizer: str | None, max_seq_length: int, max_examples: int, seed: int
) -> tuple[list[list[int]], list[list[int]], int, int]:
    """Unmasked consecutive-segment pairs from held-out documents: (ids, token types, pad id, vocab size)."""
    from albert_core.evaluation.intrinsic import read_heldout
    from albert_core.text.tokenization import TokenIds, load_tokenizer
    from services.train.plan import resolve_token_ids

    if tokenizer:
        ids = TokenIds.from_tokenizer(load_tokenizer(tokenizer))
    else:
        shards = heldout.parent.parent  # <shards>/heldout/documents.parquet
        try:
            ids = resolve_token_ids(shards, RunConfig())
        except ConfigError as err:
            raise ValueError(f"{heldout}: cannot tell its tokenizer ({err}); pass --tokenizer") from None
    documents = read_heldout(str(heldout))
    sequences, types = _pair_sequences([d.sentences for d in documents], ids, max_seq_length, max_examples, seed)
    if not sequences:
        raise ValueError(f"{heldout}: the held-out documents yield no pairs")
    return sequences, types, ids.pad_id, ids.vocab_size


def _pair_sequences(
    documents: list, ids: TokenIds, max_seq_length: int, max_examples: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Unmasked consecutive-segment pairs of documents (sentences of token ids): (ids, token types)."""
    from albert_core.evaluation.analysis import document_pairs

    examples = document_pairs(documents, objective="none", max_seq_length=max_seq_length, seed=seed,
                              cls_id=ids.cls_id, sep_id=ids.sep_id, max_examples=max_examples)  # fmt: skip
    return [e.input_ids for e in examples], [e.token_type_ids for e in examples]


def heldout_transitions(
    model: nn.Module,
    documents: list,
    ids: TokenIds,
    *,
    max_seq_length: int,
    max_examples: int = 256,
    batch_size: int = 16,
    seed: int = 12345,
) -> list[dict[str, float]]:
    """layer_transitions of `model` over unmasked pairs of held-out documents (sentences of token ids, `ids` their
    tokenizer's special ids), as `analyze layers` measures a shard set's held-out file."""
    from albert_core.evaluation.analysis import layer_transitions, pad_batches

    sequences, types = _pair_sequences(documents, ids, max_seq_length, max_examples, seed)
    if not sequences:
        raise ValueError("heldout_transitions: the held-out documents yield no pairs")
    batches = pad_batches(sequences, pad_id=ids.pad_id, batch_size=batch_size, token_type_ids=types)
    return layer_transitions(model, batches)


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
    from albert_core.evaluation.analysis import layer_transitions, pad_batches
    from albert_core.model.checkpoint import load_model
    from albert_core.model.modeling import AlbertModel

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
    atomic_write_csv(csv_path, rows, ["label", "checkpoint", "sharing", "layers", "layer", "l2", "cosine", "tokens"])
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
