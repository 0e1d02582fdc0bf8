"""Representation analysis: the paper's Figure 1 (layer transitions) and linear probes of the pair head's input.

Figure 1. Layer k (1..L) reads hidden_states[k-1] and writes hidden_states[k] (`AlbertModel` with
output_hidden_states=True). For every real (non-pad) token we take the L2 distance ||h_k - h_{k-1}|| and the
cosine similarity cos(h_{k-1}, h_k), and average each over all real tokens of all batches (a token-weighted mean,
so how the tokens are cut into batches does not matter). The paper reports ALBERT-large's transitions as smoother
than BERT-large's and not converging to 0 (no fixed point, unlike deep equilibrium models).

Probes. A pretraining run trains its pair head on one objective (SOP, NSP, or none). To ask whether the encoder's
pooled [CLS] vector carries a task's signal regardless of what the head was trained on, `pair_probe` fits a fresh
logistic regression (2 classes, L2-regularized, full-batch L-BFGS, features standardized with the train split's
mean and std) on frozen pooled outputs of pairs from one half of the held-out documents, and measures it on
pairs from the other half. Inputs are unmasked `[CLS] A [SEP] B [SEP]` pairs made by `albert_core.examples.pairs`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from albert_core.examples.pairs import PairConfig, PairExample, create_pairs
from albert_core.model.modeling import AlbertModel


def backbone_of(model: nn.Module) -> AlbertModel:
    """The encoder of any albert model: the model itself, or its `.albert` (pretraining and task models)."""
    backbone = model if isinstance(model, AlbertModel) else getattr(model, "albert", None)
    if not isinstance(backbone, AlbertModel):
        raise TypeError(f"expected an AlbertModel or a model with an .albert backbone, got {type(model).__name__}")
    return backbone


@torch.no_grad()
def layer_transitions(model: nn.Module, batches: Iterable[Mapping[str, Any]]) -> list[dict[str, float]]:
    """Per layer: mean L2 distance and mean cosine similarity between its input and output, over real tokens.

    `batches` yields mappings with "input_ids" and "attention_mask" (1 = real token) and optionally
    "token_type_ids" (tensors, numpy arrays or nested lists, shape (B, T)). Returns one dict per layer,
    {"layer": k (1..L), "l2", "cosine", "tokens"}, in layer order. The model runs in eval mode (no dropout)
    and is put back in its previous mode afterwards.
    """
    backbone = backbone_of(model)
    device = next(backbone.parameters()).device
    layers = backbone.config.num_hidden_layers
    l2_sum = torch.zeros(layers, dtype=torch.float64)
    cos_sum = torch.zeros(layers, dtype=torch.float64)
    tokens = 0
    was_training = backbone.training
    backbone.eval()
    try:
        for index, batch in enumerate(batches):
            input_ids, attention_mask, token_type_ids = _batch_tensors(batch, index, device)
            out = backbone(input_ids, attention_mask, token_type_ids, output_hidden_states=True)
            real = attention_mask.bool()
            for layer in range(layers):
                before = out.hidden_states[layer][real].double()
                after = out.hidden_states[layer + 1][real].double()
                l2_sum[layer] += (after - before).norm(dim=-1).sum().cpu()
                cos_sum[layer] += F.cosine_similarity(before, after, dim=-1).sum().cpu()
            tokens += int(real.sum())
    finally:
        backbone.train(was_training)
    if tokens == 0:
        raise ValueError("layer_transitions: the batches hold no real tokens (attention_mask is all 0 or empty)")
    return [
        {
            "layer": layer + 1,
            "l2": float(l2_sum[layer] / tokens),
            "cosine": float(cos_sum[layer] / tokens),
            "tokens": tokens,
        }
        for layer in range(layers)
    ]


def transition_roughness(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """How much the layer transitions of layer_transitions' rows oscillate (the paper's Figure 1: smooth for
    ALBERT, oscillating for BERT): the mean absolute change between consecutive layers' L2 distance, relative to
    the mean L2 distance ("l2_roughness"), and the mean absolute change of the cosine similarity
    ("cosine_roughness"). 0 for a constant transition; needs at least two layers."""
    if len(rows) < 2:
        raise ValueError(f"transition_roughness: needs at least two layers, got {len(rows)}")
    l2 = [float(r["l2"]) for r in rows]
    cosine = [float(r["cosine"]) for r in rows]
    steps = len(rows) - 1
    l2_change = sum(abs(b - a) for a, b in zip(l2[:-1], l2[1:], strict=True)) / steps
    cosine_change = sum(abs(b - a) for a, b in zip(cosine[:-1], cosine[1:], strict=True)) / steps
    return {"l2_roughness": l2_change / max(sum(l2) / len(l2), 1e-12), "cosine_roughness": cosine_change}


def pad_batches(
    sequences: Sequence[Sequence[int]],
    *,
    pad_id: int,
    batch_size: int,
    token_type_ids: Sequence[Sequence[int]] | None = None,
) -> Iterator[dict[str, Tensor]]:
    """Token-id sequences → padded batches {"input_ids", "attention_mask", "token_type_ids"} (right padding)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if token_type_ids is not None and len(token_type_ids) != len(sequences):
        raise ValueError(f"{len(sequences)} sequences but {len(token_type_ids)} token_type_ids lists")
    for first in range(0, len(sequences), batch_size):
        chunk = sequences[first : first + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        types = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, sequence in enumerate(chunk):
            n = len(sequence)
            ids[row, :n] = torch.as_tensor(list(sequence), dtype=torch.long)
            mask[row, :n] = 1
            if token_type_ids is not None:
                row_types = token_type_ids[first + row]
                if len(row_types) != n:
                    raise ValueError(f"sequence {first + row}: {n} tokens but {len(row_types)} token_type_ids")
                types[row, :n] = torch.as_tensor(list(row_types), dtype=torch.long)
        yield {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def document_pairs(
    documents: Sequence[Sequence[Sequence[int]]],
    *,
    objective: str,
    max_seq_length: int,
    seed: int,
    cls_id: int,
    sep_id: int,
    max_examples: int | None = None,
) -> list[PairExample]:
    """Unmasked `[CLS] A [SEP] B [SEP]` pairs from documents (sentences of token ids), a seeded subset at most
    `max_examples` long. objective "none" gives consecutive A, B without labels; "sop"/"nsp" label them."""
    config = PairConfig(max_seq_length=max_seq_length, short_seq_prob=0.0, objective=objective)
    result = create_pairs(documents, config=config, rng=np.random.default_rng([seed, 0]), cls_id=cls_id, sep_id=sep_id)
    examples = result.examples
    if max_examples is not None and len(examples) > max_examples:
        chosen = np.random.default_rng([seed, 1]).choice(len(examples), max_examples, replace=False)
        examples = [examples[i] for i in np.sort(chosen)]
    return examples


@torch.no_grad()
def pooled_features(model: nn.Module, examples: Sequence[PairExample], *, pad_id: int, batch_size: int = 32) -> Tensor:
    """The pooled [CLS] vectors (the pair head's input) of pair examples, float32 on CPU, shape (N, H)."""
    backbone = backbone_of(model)
    device = next(backbone.parameters()).device
    was_training = backbone.training
    backbone.eval()
    try:
        chunks = [
            backbone(
                batch["input_ids"].to(device),
                batch["attention_mask"].to(device),
                batch["token_type_ids"].to(device),
            )
            .pooled_output.float()
            .cpu()
            for batch in pad_batches(
                [e.input_ids for e in examples],
                pad_id=pad_id,
                batch_size=batch_size,
                token_type_ids=[e.token_type_ids for e in examples],
            )
        ]
    finally:
        backbone.train(was_training)
    return torch.cat(chunks) if chunks else torch.zeros(0, backbone.config.hidden_size)


def fit_linear_probe(
    features: Tensor, labels: Tensor, *, l2: float = 1e-3, max_iter: int = 200
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Logistic regression (2 classes) on standardized features: returns (weight (H, 2), bias (2,), mean, std)."""
    if features.ndim != 2 or len(features) != len(labels) or len(labels) == 0:
        raise ValueError(
            f"expected (N, H) features and N labels with N > 0, got {tuple(features.shape)} and {len(labels)}"
        )
    features = features.double()
    mean, std = features.mean(0), features.std(0, unbiased=False).clamp_min(1e-6)
    x = (features - mean) / std
    y = labels.long()
    weight = torch.zeros(x.shape[1], 2, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(x @ weight + bias, y) + l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return weight.detach(), bias.detach(), mean, std


def probe_accuracy(features: Tensor, labels: Tensor, probe: tuple[Tensor, Tensor, Tensor, Tensor]) -> float:
    weight, bias, mean, std = probe
    logits = ((features.double() - mean) / std) @ weight + bias
    return float((logits.argmax(-1) == labels.long()).double().mean())


def pair_probe(
    model: nn.Module,
    documents: Sequence[Sequence[Sequence[int]]],
    *,
    objective: str,
    max_seq_length: int,
    seed: int,
    cls_id: int,
    sep_id: int,
    pad_id: int,
    max_examples: int = 512,
    batch_size: int = 32,
    l2: float = 1e-3,
) -> dict[str, float | int]:
    """Linear-probe accuracy of a frozen encoder on the SOP or NSP task (see the module docstring).

    The documents are shuffled under `seed` and split in two halves by document (the train half gets the extra
    one); pairs of each half are built separately, so NSP's random B segments never cross halves. Returns
    {"acc": test accuracy, "train_acc", "train_examples", "test_examples", "test_positive": share of label 1}.
    """
    if objective not in ("sop", "nsp"):
        raise ValueError(f"pair_probe: objective must be 'sop' or 'nsp', got {objective!r}")
    usable = [doc for doc in documents if sum(len(s) for s in doc) >= 2]
    if len(usable) < 2:
        raise ValueError(
            f"pair_probe: need at least 2 held-out documents with 2+ tokens to split into probe train/test, "
            f"got {len(usable)} of {len(documents)}"
        )
    order = np.random.default_rng([seed, 2]).permutation(len(usable))
    cut = (len(usable) + 1) // 2
    halves = ([usable[i] for i in order[:cut]], [usable[i] for i in order[cut:]])
    split = []
    for part, docs in enumerate(halves):
        examples = document_pairs(
            docs,
            objective=objective,
            max_seq_length=max_seq_length,
            seed=seed + 1000 * (part + 1),
            cls_id=cls_id,
            sep_id=sep_id,
            max_examples=max_examples,
        )
        if not examples:
            raise ValueError(f"pair_probe: the {'train' if part == 0 else 'test'} half yields no {objective} pairs")
        features = pooled_features(model, examples, pad_id=pad_id, batch_size=batch_size)
        labels = torch.tensor([e.pair_label for e in examples], dtype=torch.long)
        split.append((features, labels))
    (train_x, train_y), (test_x, test_y) = split
    if len(set(train_y.tolist())) < 2:
        raise ValueError(f"pair_probe: the train half has only label {int(train_y[0])}; use more held-out documents")
    probe = fit_linear_probe(train_x, train_y, l2=l2)
    return {
        "acc": probe_accuracy(test_x, test_y, probe),
        "train_acc": probe_accuracy(train_x, train_y, probe),
        "train_examples": len(train_y),
        "test_examples": len(test_y),
        "test_positive": float(test_y.double().mean()),
    }


def _batch_tensors(batch: Mapping[str, Any], index: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    missing = [key for key in ("input_ids", "attention_mask") if key not in batch]
    if missing:
        raise ValueError(f"batch {index}: lacks {missing[0]!r} (expected input_ids, attention_mask[, token_type_ids])")
    input_ids = _long_tensor(batch["input_ids"], device)
    attention_mask = _long_tensor(batch["attention_mask"], device)
    if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"batch {index}: input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
            "must be the same (B, T) shape"
        )
    types = batch.get("token_type_ids")
    token_type_ids = torch.zeros_like(input_ids) if types is None else _long_tensor(types, device)
    if token_type_ids.shape != input_ids.shape:
        raise ValueError(
            f"batch {index}: token_type_ids {tuple(token_type_ids.shape)} != input_ids {tuple(input_ids.shape)}"
        )
    return input_ids, attention_mask, token_type_ids


def _long_tensor(value: Any, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.long)
    return torch.as_tensor(np.asarray(value), dtype=torch.long, device=device)
