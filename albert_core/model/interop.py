"""State-dict adapter between albert and transformers (ALBERT and BERT), by explicit key mapping.

Our state dicts use AlbertForPreTraining's names: "albert.*" for the backbone, "mlm_head.*" and "pair_head.*"
for the pretraining heads. transformers' layouts:
- ALBERT (`AlbertModel` / `AlbertForPreTraining`): one layer per group (inner_group_num 1), the E->H projection
  always present, heads `predictions.*` and `sop_classifier.*`.
- BERT (`BertModel` / `BertForPreTraining`): one layer per layer, no projection, heads `cls.*`.

`from_hf` reads either; `to_hf` writes ALBERT, or BERT for unshared models without a projection.
Neither imports transformers: configs are plain dicts (the contents of config.json).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from albert_core.files import atomic_write_json, disk_full_as
from albert_core.model.config import AlbertConfig

_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "max_position_embeddings",
    "type_vocab_size",
    "initializer_range",
    "layer_norm_eps",
)
_HF_ACT = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}

# (ours, theirs) suffixes shared by both layouts.
_EMBEDDINGS = [
    ("embeddings.word_embeddings.weight", "embeddings.word_embeddings.weight"),
    ("embeddings.position_embeddings.weight", "embeddings.position_embeddings.weight"),
    ("embeddings.token_type_embeddings.weight", "embeddings.token_type_embeddings.weight"),
    ("embeddings.layer_norm.weight", "embeddings.LayerNorm.weight"),
    ("embeddings.layer_norm.bias", "embeddings.LayerNorm.bias"),
]


def _albert_layer(group: int) -> dict[str, str]:
    """Our block parameter -> transformers' ALBERT name, for one layer group."""
    hf = f"encoder.albert_layer_groups.{group}.albert_layers.0."
    a, f = f"encoder.attention_blocks.{group}.", f"encoder.ffn_blocks.{group}."
    return {
        a + "dense.weight": hf + "attention.dense.weight",
        a + "dense.bias": hf + "attention.dense.bias",
        a + "layer_norm.weight": hf + "attention.LayerNorm.weight",
        a + "layer_norm.bias": hf + "attention.LayerNorm.bias",
        f + "up.weight": hf + "ffn.weight",
        f + "up.bias": hf + "ffn.bias",
        f + "down.weight": hf + "ffn_output.weight",
        f + "down.bias": hf + "ffn_output.bias",
        f + "layer_norm.weight": hf + "full_layer_layer_norm.weight",
        f + "layer_norm.bias": hf + "full_layer_layer_norm.bias",
    }, [hf + f"attention.{n}" for n in ("query", "key", "value")]


def _bert_layer(layer: int) -> dict[str, str]:
    hf = f"encoder.layer.{layer}."
    a, f = f"encoder.attention_blocks.{layer}.", f"encoder.ffn_blocks.{layer}."
    return {
        a + "dense.weight": hf + "attention.output.dense.weight",
        a + "dense.bias": hf + "attention.output.dense.bias",
        a + "layer_norm.weight": hf + "attention.output.LayerNorm.weight",
        a + "layer_norm.bias": hf + "attention.output.LayerNorm.bias",
        f + "up.weight": hf + "intermediate.dense.weight",
        f + "up.bias": hf + "intermediate.dense.bias",
        f + "down.weight": hf + "output.dense.weight",
        f + "down.bias": hf + "output.dense.bias",
        f + "layer_norm.weight": hf + "output.LayerNorm.weight",
        f + "layer_norm.bias": hf + "output.LayerNorm.bias",
    }, [hf + f"attention.self.{n}" for n in ("query", "key", "value")]


def _layout(config: AlbertConfig, kind: str) -> tuple[dict[str, str], dict[str, list[str]], dict[str, str]]:
    """Name maps for one checkpoint kind: backbone 1:1 names, fused-QKV sources, head names."""
    names = dict(_EMBEDDINGS)
    qkv: dict[str, list[str]] = {}
    if kind == "albert":
        names["embeddings.projection.weight"] = "encoder.embedding_hidden_mapping_in.weight"
        names["embeddings.projection.bias"] = "encoder.embedding_hidden_mapping_in.bias"
        layers = [_albert_layer(g) for g in range(config.num_hidden_groups)]
        names.update({"pooler.weight": "pooler.weight", "pooler.bias": "pooler.bias"})
        heads = {
            "mlm_head.dense.weight": "predictions.dense.weight",
            "mlm_head.dense.bias": "predictions.dense.bias",
            "mlm_head.layer_norm.weight": "predictions.LayerNorm.weight",
            "mlm_head.layer_norm.bias": "predictions.LayerNorm.bias",
            "mlm_head.bias": "predictions.bias",
            "pair_head.weight": "sop_classifier.classifier.weight",
            "pair_head.bias": "sop_classifier.classifier.bias",
        }
    else:
        layers = [_bert_layer(layer) for layer in range(config.num_hidden_layers)]
        names.update({"pooler.weight": "pooler.dense.weight", "pooler.bias": "pooler.dense.bias"})
        heads = {
            "mlm_head.dense.weight": "cls.predictions.transform.dense.weight",
            "mlm_head.dense.bias": "cls.predictions.transform.dense.bias",
            "mlm_head.layer_norm.weight": "cls.predictions.transform.LayerNorm.weight",
            "mlm_head.layer_norm.bias": "cls.predictions.transform.LayerNorm.bias",
            "mlm_head.bias": "cls.predictions.bias",
            "pair_head.weight": "cls.seq_relationship.weight",
            "pair_head.bias": "cls.seq_relationship.bias",
        }
    for index, (mapping, sources) in enumerate(layers):
        names.update(mapping)
        qkv[f"encoder.attention_blocks.{index}.qkv"] = sources
    return names, qkv, heads


def config_from_hf(hf_config: dict[str, Any]) -> AlbertConfig:
    kind = hf_config.get("model_type")
    if kind not in ("albert", "bert"):
        raise ValueError(f"model_type: expected 'albert' or 'bert', got {kind!r}")
    position = hf_config.get("position_embedding_type", "absolute")
    if position != "absolute":
        raise ValueError(f"position_embedding_type: only 'absolute' is supported, got {position!r}")
    act = hf_config.get("hidden_act", "gelu_new")
    if act not in _HF_ACT:
        raise ValueError(f"hidden_act: {act!r} is not supported (expected one of {', '.join(_HF_ACT)})")
    fields = {name: hf_config[name] for name in _CONFIG_FIELDS if name in hf_config}
    fields["hidden_act"] = _HF_ACT[act]
    if kind == "albert":
        if hf_config.get("inner_group_num", 1) != 1:
            raise ValueError(f"inner_group_num: only 1 is supported, got {hf_config['inner_group_num']}")
        fields.update(
            embedding_size=hf_config.get("embedding_size", 128),
            sharing="all",
            num_hidden_groups=hf_config.get("num_hidden_groups", 1),
            classifier_dropout_prob=hf_config.get("classifier_dropout_prob", 0.1),
            embedding_projection=True,
        )
    else:
        fields.update(embedding_size=hf_config["hidden_size"], sharing="none", embedding_projection=False)
    return AlbertConfig(**fields)


def config_to_hf(config: AlbertConfig) -> dict[str, Any]:
    kind = _hf_kind(config)
    out: dict[str, Any] = {name: getattr(config, name) for name in _CONFIG_FIELDS}
    out["hidden_act"] = config.hidden_act
    out["position_embedding_type"] = "absolute"
    if kind == "albert":
        out.update(
            model_type="albert",
            architectures=["AlbertForPreTraining"],
            embedding_size=config.embedding_size,
            num_hidden_groups=config.num_attention_blocks,
            inner_group_num=1,
            classifier_dropout_prob=config.classifier_dropout_prob,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=3,
        )
    else:
        out.update(model_type="bert", architectures=["BertForPreTraining"], pad_token_id=0)
    return out


def _hf_kind(config: AlbertConfig) -> str:
    if config.layer_norm_position != "post":
        raise ValueError(
            f"layer_norm_position: {config.layer_norm_position!r} has no transformers equivalent "
            "(transformers' ALBERT and BERT are post-LN)"
        )
    if config.position_bias != "none":
        raise ValueError(
            f"position_bias: {config.position_bias!r} has no transformers equivalent "
            "(transformers' ALBERT and BERT use absolute position embeddings only)"
        )
    if config.pooling != "cls":
        raise ValueError(
            f"pooling: {config.pooling!r} has no transformers equivalent (transformers' pooler reads [CLS])"
        )
    if config.sharing in ("attention", "ffn"):
        raise ValueError(
            f"sharing: {config.sharing!r} sharing has no transformers equivalent "
            "(ALBERT shares whole layers, BERT shares nothing)"
        )
    if config.sharing == "none" and not config.has_embedding_projection:
        return "bert"
    return "albert"  # "none" with a projection is ALBERT with one group per layer


def from_hf(hf_state: dict[str, Tensor], hf_config: dict[str, Any]) -> tuple[AlbertConfig, dict[str, Tensor]]:
    """transformers ALBERT/BERT weights -> (our config, our AlbertForPreTraining state dict).

    Heads are converted when present; a backbone-only checkpoint gives backbone keys only.
    """
    config = config_from_hf(hf_config)
    kind = hf_config["model_type"]
    prefix = _detect_prefix(hf_state, kind)
    names, qkv, heads = _layout(config, kind)
    out: dict[str, Tensor] = {}
    missing = []
    for ours, theirs in names.items():
        if prefix + theirs in hf_state:
            out["albert." + ours] = hf_state[prefix + theirs]
        else:
            missing.append(prefix + theirs)
    for ours, sources in qkv.items():
        for suffix in ("weight", "bias"):
            parts = [prefix + f"{s}.{suffix}" for s in sources]
            if all(p in hf_state for p in parts):
                out[f"albert.{ours}.{suffix}"] = torch.cat([hf_state[p] for p in parts])
            else:
                missing += [p for p in parts if p not in hf_state]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} backbone tensors, e.g. {missing[:3]}")
    for ours, theirs in heads.items():
        if theirs in hf_state:
            out[ours] = hf_state[theirs]
    return config, out


def to_hf(state: dict[str, Tensor], config: AlbertConfig) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Our AlbertForPreTraining (or backbone "albert.*") state dict -> transformers' (state dict, config dict)."""
    kind = _hf_kind(config)
    hf_config = config_to_hf(config)
    layout_config = config.replace(sharing="all", num_hidden_groups=hf_config.get("num_hidden_groups", 1))
    names, qkv, heads = _layout(layout_config, kind)
    prefix = "albert." if kind == "albert" else "bert."
    out: dict[str, Tensor] = {}
    for ours, theirs in names.items():
        key = "albert." + ours
        if key in state:
            out[prefix + theirs] = state[key]
        elif ours.startswith("embeddings.projection."):  # E == H without projection: export the identity
            H = config.hidden_size
            out[prefix + theirs] = torch.eye(H) if ours.endswith("weight") else torch.zeros(H)
        else:
            raise KeyError(f"state dict has no {key!r}")
    for ours, sources in qkv.items():
        for suffix in ("weight", "bias"):
            for source, chunk in zip(sources, state[f"albert.{ours}.{suffix}"].chunk(3), strict=True):
                out[prefix + f"{source}.{suffix}"] = chunk.clone()
    for ours, theirs in heads.items():
        if ours in state:
            out[theirs] = state[ours]
    if "mlm_head.bias" in state:  # the tied decoder, as transformers stores it
        decoder = "predictions.decoder" if kind == "albert" else "cls.predictions.decoder"
        out[decoder + ".weight"] = state["albert.embeddings.word_embeddings.weight"]
        out[decoder + ".bias"] = state["mlm_head.bias"]
    return out, hf_config


def _detect_prefix(hf_state: dict[str, Tensor], kind: str) -> str:
    prefix = kind + "."
    return prefix if any(k.startswith(prefix + "embeddings.") for k in hf_state) else ""


def save_hf_checkpoint(directory: str | Path, state: dict[str, Tensor], config: AlbertConfig) -> Path:
    """Write our weights as a transformers checkpoint directory that `from_pretrained` loads."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf_state, hf_config = to_hf(state, config)
    # safetensors refuses aliased tensors; transformers re-ties the decoder on load.
    unique = {k: v.detach().contiguous().clone() for k, v in hf_state.items()}
    weights, partial = directory / "model.safetensors", directory / ".model.safetensors.partial"
    with disk_full_as(weights, sum(t.numel() * t.element_size() for t in unique.values()), "no converted weights"):
        try:
            save_file(unique, partial, metadata={"format": "pt"})
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        os.replace(partial, weights)
    atomic_write_json(directory / "config.json", hf_config, sort_keys=True)
    return directory
