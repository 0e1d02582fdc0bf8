"""AlbertConfig: one typed description of an ALBERT (or BERT-style) encoder, its presets and its JSON form."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

SHARING_MODES = ("all", "attention", "ffn", "none")
ACTIVATIONS = ("gelu_new", "gelu", "relu")
POSITION_BIASES = ("none", "alibi", "rotary")
POOLINGS = ("cls", "mean")


# Sizes a config may ask for, checked before anything is built: a config.json read from a checkpoint is input.
# The parameter cap is 20B (100x xxlarge's 223M), raised by setting ALBERT_MAX_PARAMETERS (e.g. 50e9).
MAX_PARAMETERS = 20_000_000_000
MAX_PARAMETERS_ENV = "ALBERT_MAX_PARAMETERS"
MAX_LAYERS = 1024  # layers are Python modules (and loop iterations): a few dozen in every known model


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what was expected."""


@dataclass
class AlbertConfig:
    vocab_size: int = 30000
    embedding_size: int = 128
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    # Cross-layer sharing: "all" (ALBERT), "attention" only, "ffn" only, "none" (BERT). The shared parts are
    # split into num_hidden_groups groups; layer l uses group floor(l * G / L).
    sharing: str = "all"
    num_hidden_groups: int = 1
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    classifier_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu_new"  # the tanh approximation of GELU, as the original
    # The E->H projection after the embeddings. None: present iff E != H. True keeps it when E == H
    # (transformers' ALBERT checkpoints always have it).
    embedding_projection: bool | None = None
    # Where each block's LayerNorm sits: "post" (BERT and ALBERT: x = LN(x + f(x))) or "pre" (x = x + f(LN(x)),
    # then one LayerNorm after the last layer). Pre-LN is a departure from the paper, for small-scale recipes: it
    # trains stably at larger learning rates without a long warmup. transformers' ALBERT cannot load it.
    layer_norm_position: str = "post"
    # How the (learned) position embeddings start: "normal" (N(0, initializer_range), as the paper) or
    # "sinusoidal" (the Transformer's sinusoids scaled to that std): every position is told apart from the first
    # step, which shortens early training at small scale. Only the initial values differ; checkpoints are alike.
    position_embedding_init: str = "normal"
    # Relative position information inside attention, on top of the absolute position embeddings: "none" (the
    # paper), "alibi" (each head's scores get -slope * |i - j|, symmetric as in MosaicBERT; slopes 2^(-8h/heads))
    # or "rotary" (RoPE on queries and keys). A departure from the paper for small-scale recipes: attention can
    # look at a masked piece's neighbours from the first step. transformers' ALBERT cannot load either.
    position_bias: str = "none"
    # What the pooler (dense + tanh) reads, for the pair head and every task head: "cls" (the paper: the [CLS]
    # token's final state) or "mean" (the mean of the final states of the real tokens, padding left out). A
    # departure for fine-tuning small checkpoints whose [CLS] learned little in pretraining (docs/learning.md).
    pooling: str = "cls"

    def __post_init__(self) -> None:
        self.validate()

    @property
    def has_embedding_projection(self) -> bool:
        if self.embedding_projection is None:
            return self.embedding_size != self.hidden_size
        return self.embedding_projection

    @property
    def num_attention_blocks(self) -> int:
        """Distinct attention parameter sets in the encoder."""
        return self.num_hidden_groups if self.sharing in ("all", "attention") else self.num_hidden_layers

    @property
    def num_ffn_blocks(self) -> int:
        """Distinct feed-forward parameter sets in the encoder."""
        return self.num_hidden_groups if self.sharing in ("all", "ffn") else self.num_hidden_layers

    def attention_block_of(self, layer: int) -> int:
        return _block_of(layer, self.num_attention_blocks, self.num_hidden_layers)

    def ffn_block_of(self, layer: int) -> int:
        return _block_of(layer, self.num_ffn_blocks, self.num_hidden_layers)

    def validate(self) -> None:
        for name in (
            "vocab_size",
            "embedding_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "num_hidden_groups",
            "max_position_embeddings",
            "type_vocab_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}: expected a positive integer, got {value!r}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout_prob"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ConfigError(f"{name}: expected a probability in [0, 1), got {value!r}")
        for name in ("initializer_range", "layer_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"{name}: expected a finite number > 0, got {value!r}")
        if self.num_hidden_layers > MAX_LAYERS:
            raise ConfigError(f"num_hidden_layers: {self.num_hidden_layers} is above the limit of {MAX_LAYERS}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size: {self.hidden_size} is not divisible by num_attention_heads ({self.num_attention_heads})"
            )
        if self.sharing not in SHARING_MODES:
            raise ConfigError(f"sharing: expected one of {', '.join(SHARING_MODES)}, got {self.sharing!r}")
        if self.num_hidden_groups > self.num_hidden_layers:
            raise ConfigError(
                f"num_hidden_groups: {self.num_hidden_groups} groups exceed num_hidden_layers "
                f"({self.num_hidden_layers})"
            )
        if self.sharing == "none" and self.num_hidden_groups != 1:
            raise ConfigError("num_hidden_groups: must be 1 when sharing is 'none' (nothing is shared)")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act: expected one of {', '.join(ACTIVATIONS)}, got {self.hidden_act!r}")
        if self.position_embedding_init not in ("normal", "sinusoidal"):
            raise ConfigError(
                f"position_embedding_init: expected normal or sinusoidal, got {self.position_embedding_init!r}"
            )
        if self.position_bias not in POSITION_BIASES:
            raise ConfigError(
                f"position_bias: expected one of {', '.join(POSITION_BIASES)}, got {self.position_bias!r}"
            )
        if self.position_bias == "rotary" and (self.hidden_size // self.num_attention_heads) % 2:
            raise ConfigError(
                f"position_bias: rotary needs an even head size, got hidden_size {self.hidden_size} / "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.pooling not in POOLINGS:
            raise ConfigError(f"pooling: expected one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.layer_norm_position not in ("post", "pre"):
            raise ConfigError(f"layer_norm_position: expected post or pre, got {self.layer_norm_position!r}")
        if self.embedding_projection is not None and not isinstance(self.embedding_projection, bool):
            raise ConfigError(f"embedding_projection: expected true, false or null, got {self.embedding_projection!r}")
        if self.embedding_projection is False and self.embedding_size != self.hidden_size:
            raise ConfigError(
                f"embedding_projection: False needs embedding_size == hidden_size, got "
                f"{self.embedding_size} != {self.hidden_size}"
            )
        _check_parameter_count(self)

    # --- presets and serialization -------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> AlbertConfig:
        if name not in PRESETS:
            raise ConfigError(f"preset: unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})

    def replace(self, **changes: Any) -> AlbertConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AlbertConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"expected an object of AlbertConfig fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown AlbertConfig field (known: {', '.join(sorted(known))})")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AlbertConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"not valid JSON ({err})") from None
        except RecursionError:
            raise ConfigError("not valid JSON (nested too deeply)") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> AlbertConfig:
        try:
            return cls.from_json(Path(path).read_text(encoding="utf-8"))
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}: not UTF-8 text ({err})") from None


def _block_of(layer: int, blocks: int, layers: int) -> int:
    return layer * blocks // layers


_BERT = dict(sharing="none", num_hidden_groups=1)
_ALBERT = dict(sharing="all", num_hidden_groups=1, embedding_size=128)

# Table 1 of the paper; xlarge uses 16 heads as its released configuration.
PRESETS: dict[str, dict[str, Any]] = {
    "bert-base": dict(
        _BERT,
        hidden_size=768,
        embedding_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
    ),
    "bert-large": dict(
        _BERT,
        hidden_size=1024,
        embedding_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
    ),
    "albert-base": dict(_ALBERT, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "albert-large": dict(
        _ALBERT, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096
    ),
    "albert-xlarge": dict(
        _ALBERT, hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, intermediate_size=8192
    ),
    "albert-xxlarge": dict(
        _ALBERT, hidden_size=4096, num_hidden_layers=12, num_attention_heads=64, intermediate_size=16384
    ),
    # A CPU-sized model for demos and tests: ALBERT's shape (factorized, all-shared), minutes to train.
    "albert-tiny": dict(
        _ALBERT,
        embedding_size=64,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
    ),
}


def max_parameters() -> int:
    """The parameter cap: MAX_PARAMETERS, or ALBERT_MAX_PARAMETERS when set."""
    raw = os.environ.get(MAX_PARAMETERS_ENV, "").strip()
    if not raw:
        return MAX_PARAMETERS
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ConfigError(f"{MAX_PARAMETERS_ENV}: expected a positive number, got {raw!r}")
    return int(value)


def _check_parameter_count(config: AlbertConfig) -> None:
    """Refuse a config above the parameter cap, naming the field whose tensors weigh most."""
    total, limit = count_parameters(config), max_parameters()
    if total <= limit:
        return
    V, E, H, F = config.vocab_size, config.embedding_size, config.hidden_size, config.intermediate_size
    weights = {
        "vocab_size": V * E,
        "max_position_embeddings": config.max_position_embeddings * E,
        "type_vocab_size": config.type_vocab_size * E,
        "embedding_size": E * H,
        "hidden_size": config.num_attention_blocks * 4 * H * H,
        "intermediate_size": config.num_ffn_blocks * 2 * H * F,
    }
    field = max(weights, key=weights.__getitem__)
    raise ConfigError(
        f"{field}: {getattr(config, field)} gives {total / 1e9:.1f}B parameters, above the limit of {limit / 1e9:g}B "
        f"(set {MAX_PARAMETERS_ENV} to allow more)"
    )


def count_parameters(config: AlbertConfig, *, pooler: bool = True) -> int:
    """Parameters of the encoder (embeddings + layers + pooler), counted without building the model.

    Matches transformers' AlbertModel / BertModel for the same configuration.
    """
    V, E, H, F = config.vocab_size, config.embedding_size, config.hidden_size, config.intermediate_size
    embeddings = (V + config.max_position_embeddings + config.type_vocab_size) * E + 2 * E
    projection = (E * H + H) if config.has_embedding_projection else 0
    attention = 4 * (H * H + H) + 2 * H  # q, k, v, output dense + LayerNorm
    ffn = (H * F + F) + (F * H + H) + 2 * H  # up, down + LayerNorm
    encoder = config.num_attention_blocks * attention + config.num_ffn_blocks * ffn
    return embeddings + projection + encoder + ((H * H + H) if pooler else 0)
