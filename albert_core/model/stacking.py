"""Progressive stacking (Gong et al., 2019): start a deeper model from a shallower trained one by copying its layers.

`stack_layers(shallow_state, shallow_config, deep_config)` returns the deep model's state dict (canonical names,
as `albert_core.model.checkpoint.state_dict_of`). Everything outside the encoder's blocks (embeddings, E->H projection,
pooler, MLM and pair heads) is copied as it is. The encoder's blocks (`encoder.attention_blocks.i`,
`encoder.ffn_blocks.i`, see `albert_core.model.modeling.Encoder`) are mapped by these rules, separately for the
attention and the feed-forward blocks:

- per-layer blocks (the unshared part: both kinds under sharing "none", the FFN under "attention", the attention
  under "ffn"): deep layer l <- shallow layer l mod L_shallow. A 2-layer BERT stacked into 4 layers runs the
  shallow layers in the order 0, 1, 0, 1, so the deep model's first L_shallow layers compute exactly what the
  shallow model computes.
- shared blocks (G groups; all-shared ALBERT has one): with the same number of groups, group g <- group g. The
  weights do not change at all: an all-shared model gets its depth for free, running the one trained block more
  times. With a different number of groups, deep group g takes the shallow group of its layers'
  sources (layer l <- layer l mod L_shallow), which is one group only when the deep model repeats the shallow
  model's grouping (G_deep / L_deep == G_shallow / L_shallow, e.g. 4 layers in 2 groups -> 8 layers in 4
  groups); otherwise the mapping is ambiguous and refused, naming num_hidden_groups.

Stacking copies tensors, so every width must match: vocab_size, embedding_size, hidden_size, intermediate_size,
num_attention_heads, max_position_embeddings, type_vocab_size and the embedding projection. The sharing mode must
match too (a shared block has no single per-layer source to split into, and the reverse would average weights).
Each error is a ConfigError naming the field. The deep model may also be shallower (its layers then take the first
L_deep of the source's) or equally deep (a plain copy). Dropout, activation and LayerNorm epsilon are the deep
configuration's own.

`check_init_source(directory, config)` checks a checkpoint before a run starts (a RunConfig's `model.init_from`,
services/train.py). `load_stacked(model, directory)` reads a checkpoint (ours or transformers',
`albert_core.model.checkpoint.read_checkpoint`), stacks it onto the model's configuration and loads it; heads the
checkpoint lacks keep their initialization.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor, nn

from albert_core.model.config import AlbertConfig, ConfigError

# Fields that decide a tensor's shape: they must be equal in the shallow and the deep configuration.
WIDTH_FIELDS = (
    "vocab_size",
    "embedding_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "max_position_embeddings",
    "type_vocab_size",
)
_BLOCK_KEY = re.compile(
    r"^(?P<prefix>(?:.*\.)?encoder\.)(?P<kind>attention_blocks|ffn_blocks)\.(?P<index>\d+)\.(?P<rest>.+)$"
)


def check_stackable(shallow: AlbertConfig, deep: AlbertConfig) -> None:
    """Raise ConfigError naming the first field that makes `shallow`'s weights unusable for `deep`."""
    for name in WIDTH_FIELDS:
        have, want = getattr(shallow, name), getattr(deep, name)
        if have != want:
            raise ConfigError(
                f"{name}: the source checkpoint has {have}, the model being initialized {want}; stacking copies "
                "weights, so every width must match"
            )
    if shallow.has_embedding_projection != deep.has_embedding_projection:
        raise ConfigError(
            f"embedding_projection: the source checkpoint {'has' if shallow.has_embedding_projection else 'lacks'} "
            "the E->H projection and the model being initialized does not match it"
        )
    if shallow.sharing != deep.sharing:
        raise ConfigError(
            f"sharing: the source checkpoint shares {shallow.sharing!r}, the model being initialized "
            f"{deep.sharing!r}; stacking maps blocks of one sharing mode only"
        )
    for kind in ("attention", "ffn"):
        block_map(shallow, deep, kind)


def block_map(shallow: AlbertConfig, deep: AlbertConfig, kind: str) -> list[int]:
    """For each of the deep model's `kind` ("attention" or "ffn") blocks, the shallow block it is copied from."""
    deep_blocks = deep.num_attention_blocks if kind == "attention" else deep.num_ffn_blocks
    shared = deep.sharing in ("all", kind)  # check_stackable made the sharing modes equal
    if shared and deep.num_hidden_groups == shallow.num_hidden_groups:
        return list(range(deep_blocks))  # the same groups, run by more (or fewer) layers
    deep_of = deep.attention_block_of if kind == "attention" else deep.ffn_block_of
    shallow_of = shallow.attention_block_of if kind == "attention" else shallow.ffn_block_of
    sources: dict[int, set[int]] = {}
    for layer in range(deep.num_hidden_layers):
        sources.setdefault(deep_of(layer), set()).add(shallow_of(layer % shallow.num_hidden_layers))
    ambiguous = sorted(b for b, s in sources.items() if len(s) > 1)
    if ambiguous:
        b = ambiguous[0]
        raise ConfigError(
            f"num_hidden_groups: the model being initialized ({deep.num_hidden_layers} layers in "
            f"{deep.num_hidden_groups} groups) puts layers from {len(sources[b])} different groups of the source "
            f"({shallow.num_hidden_layers} layers in {shallow.num_hidden_groups} groups) into its {kind} group {b}; "
            "use the source's number of groups, or the same layers per group"
        )
    return [min(sources[b]) for b in range(deep_blocks)]


def stack_layers(
    shallow_state: dict[str, Tensor], shallow_config: AlbertConfig, deep_config: AlbertConfig
) -> dict[str, Tensor]:
    """The deep model's state dict from the shallow one's (canonical names); new tensors, never shared storage."""
    check_stackable(shallow_config, deep_config)
    maps = {
        "attention_blocks": block_map(shallow_config, deep_config, "attention"),
        "ffn_blocks": block_map(shallow_config, deep_config, "ffn"),
    }
    blocks: dict[tuple[str, str, int], dict[str, Tensor]] = {}  # (prefix, kind, shallow index) -> {rest: tensor}
    deep_state: dict[str, Tensor] = {}
    for key, tensor in shallow_state.items():
        match = _BLOCK_KEY.match(key)
        if match is None:
            deep_state[key] = tensor.detach().clone()
            continue
        where = (match["prefix"], match["kind"], int(match["index"]))
        blocks.setdefault(where, {})[match["rest"]] = tensor
    prefixes = sorted({prefix for prefix, _, _ in blocks})
    for prefix in prefixes:
        for kind, sources in maps.items():
            for deep_index, shallow_index in enumerate(sources):
                block = blocks.get((prefix, kind, shallow_index))
                if block is None:
                    raise ConfigError(
                        f"the source checkpoint has no {prefix}{kind}.{shallow_index}.* tensors, though its "
                        f"configuration ({shallow_config.sharing} sharing, {shallow_config.num_hidden_layers} layers, "
                        f"{shallow_config.num_hidden_groups} groups) implies them"
                    )
                for rest, tensor in block.items():
                    deep_state[f"{prefix}{kind}.{deep_index}.{rest}"] = tensor.detach().clone()
    return deep_state


@dataclass(frozen=True)
class InitSummary:
    """What starting a model from a checkpoint does: the tensors it loads and those that keep their initialization
    (heads the checkpoint lacks), by our names."""

    source: Path
    kind: str  # "albert", "transformers albert", "transformers bert"
    loaded: list[str]
    initialized: list[str]

    def line(self) -> str:
        """One line for the console and the dry run."""
        parts = f"loaded all {len(self.loaded)} tensors"
        if self.initialized:
            heads = ", ".join(module_names(self.initialized))
            parts = f"loaded {len(self.loaded)} tensors; initialized {len(self.initialized)} it lacks: {heads}"
        return f"initialized from {self.source} ({self.kind}): {parts}"


def module_names(names: list[str]) -> list[str]:
    """Tensor names shortened to their modules (mlm_head.dense.weight -> mlm_head.dense), in order, once each; a
    lone parameter (mlm_head.bias, the decoder's bias) keeps its name."""
    given = set(names)
    modules = []
    for name in names:
        module, _, leaf = name.rpartition(".")
        modules.append(module if leaf in ("weight", "bias") and f"{module}.weight" in given else name)
    return list(dict.fromkeys(modules))


def check_init_source(directory: str | Path, deep_config: AlbertConfig) -> InitSummary:
    """What initializing a `deep_config` model from the checkpoint in `directory` loads and leaves initialized, read
    from the checkpoint's config and safetensors header only; ConfigError naming model.init_from when it is no
    checkpoint that stacks onto `deep_config`."""
    from albert_core.files import CheckpointError
    from albert_core.model.checkpoint import expected_shapes, read_architecture

    try:
        found = read_architecture(directory)
        stacked = stack_layers(found.tensors, found.config, deep_config)
    except (CheckpointError, ConfigError) as err:
        raise ConfigError(f"model.init_from: {directory}: {err}") from None
    expected = list(expected_shapes(deep_config))
    loaded = [name for name in expected if name in stacked]
    initialized = [name for name in expected if name not in stacked]
    return InitSummary(Path(directory), found.kind, loaded, initialized)


def load_stacked(model: nn.Module, directory: str | Path) -> list[str]:
    """Initialize `model` from the checkpoint in `directory`, stacked onto `model.config`; returns the names of head
    tensors the checkpoint lacks (they keep their initialization). Errors name the directory and the field."""
    from albert_core.model.checkpoint import load_weights, read_checkpoint

    directory = Path(directory)
    shallow_config, state = read_checkpoint(directory)
    try:
        stacked = stack_layers(state, shallow_config, model.config)
    except ConfigError as err:
        raise ConfigError(f"{directory}: {err}") from None
    return load_weights(model, stacked)
