"""ALBERT: factorized embeddings, a post-LN transformer encoder with cross-layer sharing, and task heads.

One encoder serves every sharing mode. The encoder holds `attention_blocks` and `ffn_blocks`; layer l runs
attention block `config.attention_block_of(l)` and feed-forward block `config.ffn_block_of(l)`. "all" has G of
each, "attention" G attention blocks and L feed-forward blocks, "ffn" the reverse, "none" L of each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from albert_core.examples.masking import IGNORE_INDEX
from albert_core.model.config import AlbertConfig

_ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


# --- outputs -------------------------------------------------------------------------------------------


@dataclass
class EncoderOutput:
    last_hidden_state: Tensor  # (B, T, H)
    pooled_output: Tensor  # (B, H): tanh(dense([CLS])), or of the real tokens' mean with config.pooling "mean"
    # With output_hidden_states: L+1 tensors; layer l reads hidden_states[l] and writes hidden_states[l + 1].
    hidden_states: tuple[Tensor, ...] | None = None


@dataclass
class PreTrainingOutput:
    loss: Tensor | None
    mlm_loss: Tensor | None
    pair_loss: Tensor | None
    # (B, T, V) without mlm_labels; with them, (N, V) for the N predicted positions only (in row-major order).
    mlm_logits: Tensor
    pair_logits: Tensor  # (B, 2): sentence order (SOP) or next sentence (NSP)
    hidden_states: tuple[Tensor, ...] | None = None


@dataclass
class ClassifierOutput:
    loss: Tensor | None
    logits: Tensor  # (B, num_labels); num_labels == 1 is regression


@dataclass
class QuestionAnsweringOutput:
    loss: Tensor | None
    start_logits: Tensor  # (B, T)
    end_logits: Tensor  # (B, T)
    answerable_logits: Tensor  # (B,): > 0 means the window holds an answer (SQuAD v2)


@dataclass
class MultipleChoiceOutput:
    loss: Tensor | None
    logits: Tensor  # (B, C)


# --- encoder -------------------------------------------------------------------------------------------


class Embeddings(nn.Module):
    def __init__(self, config: AlbertConfig):
        super().__init__()
        E = config.embedding_size
        self.word_embeddings = nn.Embedding(config.vocab_size, E)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, E)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, E)
        self.layer_norm = nn.LayerNorm(E, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        # Factorization: V x E lookup, then E -> H.
        self.projection = nn.Linear(E, config.hidden_size) if config.has_embedding_projection else None

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(token_type_ids)
        )
        x = self.dropout(self.layer_norm(x))
        return self.projection(x) if self.projection is not None else x


class Attention(nn.Module):
    """Multi-head self-attention (fused QKV, SDPA), output dense, dropout, residual, LayerNorm (after the residual,
    or before the attention with layer_norm_position "pre")."""

    def __init__(self, config: AlbertConfig):
        super().__init__()
        H = config.hidden_size
        self.pre_norm = config.layer_norm_position == "pre"
        self.num_heads = config.num_attention_heads
        self.qkv = nn.Linear(H, 3 * H)
        self.dense = nn.Linear(H, H)
        self.layer_norm = nn.LayerNorm(H, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.attention_dropout = config.attention_probs_dropout_prob

    def forward(self, x: Tensor, mask: Tensor | None, rotary: tuple[Tensor, Tensor] | None = None) -> Tensor:
        B, T, H = x.shape
        h = self.layer_norm(x) if self.pre_norm else x
        q, k, v = self.qkv(h).view(B, T, 3, self.num_heads, H // self.num_heads).permute(2, 0, 3, 1, 4)
        if rotary is not None:
            q, k = rotate(q, *rotary), rotate(k, *rotary)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)  # an ALiBi bias, in the scores' dtype under autocast
        p = self.attention_dropout if self.training else 0.0
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        out = x + self.dropout(self.dense(context.transpose(1, 2).reshape(B, T, H)))
        return out if self.pre_norm else self.layer_norm(out)


class FeedForward(nn.Module):
    """H -> 4H -> H with GELU, dropout, residual, LayerNorm (post or pre, as Attention)."""

    def __init__(self, config: AlbertConfig):
        super().__init__()
        self.pre_norm = config.layer_norm_position == "pre"
        self.up = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        if self.pre_norm:
            return x + self.dropout(self.down(self.act(self.up(self.layer_norm(x)))))
        return self.layer_norm(x + self.dropout(self.down(self.act(self.up(x)))))


class Encoder(nn.Module):
    def __init__(self, config: AlbertConfig):
        super().__init__()
        self.config = config
        self.attention_blocks = nn.ModuleList(Attention(config) for _ in range(config.num_attention_blocks))
        self.ffn_blocks = nn.ModuleList(FeedForward(config) for _ in range(config.num_ffn_blocks))
        L = config.num_hidden_layers
        self.attention_index = [config.attention_block_of(layer) for layer in range(L)]
        self.ffn_index = [config.ffn_block_of(layer) for layer in range(L)]
        # Pre-LN leaves the residual stream unnormalized: one LayerNorm after the last layer.
        pre = config.layer_norm_position == "pre"
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if pre else None

    def forward(
        self, x: Tensor, mask: Tensor | None, output_hidden_states: bool = False
    ) -> tuple[Tensor, tuple[Tensor, ...] | None]:
        states = [x] if output_hidden_states else None
        rotary = None
        if self.config.position_bias == "rotary":
            rotary = rotary_tables(x.shape[1], self.config.hidden_size // self.config.num_attention_heads, x.device)
        elif self.config.position_bias == "alibi":
            mask = alibi_mask(mask, x.shape[1], self.config.num_attention_heads, x.device)
        for a, f in zip(self.attention_index, self.ffn_index, strict=True):
            x = self.ffn_blocks[f](self.attention_blocks[a](x, mask, rotary))
            if states is not None:
                states.append(x)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        return x, tuple(states) if states is not None else None


def alibi_slopes(heads: int) -> Tensor:
    """ALiBi's per-head slopes 2^(-8h/heads), h = 1..heads (Press et al. 2022)."""
    return torch.pow(2.0, -8.0 * torch.arange(1, heads + 1, dtype=torch.float32) / heads)


def alibi_mask(mask: Tensor | None, T: int, heads: int, device: torch.device) -> Tensor:
    """A float32 (B or 1, heads, T, T) attention bias: -slope * |i - j|, -inf where `mask` (B, 1, 1, T) is False."""
    positions = torch.arange(T, device=device)
    distance = (positions[None, :] - positions[:, None]).abs().float()
    bias = (-alibi_slopes(heads).to(device)[:, None, None] * distance)[None]  # (1, heads, T, T)
    if mask is not None:
        bias = bias.masked_fill(~mask, float("-inf"))
    return bias


def rotary_tables(T: int, head_size: int, device: torch.device, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """RoPE's float32 (T, head_size) cos and sin tables, each frequency repeated for the two halves (Su et al.
    2021); `rotate` casts them to the queries' dtype."""
    inverse = 1.0 / base ** (torch.arange(0, head_size, 2, dtype=torch.float32, device=device) / head_size)
    angles = torch.arange(T, dtype=torch.float32, device=device)[:, None] * inverse[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on (B, heads, T, head_size): x * cos + rotate_half(x) * sin."""
    first, second = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-second, first], dim=-1) * sin.to(x.dtype)


def init_weights(module: nn.Module, std: float) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def sinusoidal_(weight: Tensor, std: float) -> None:
    """Fill a (positions, dim) table with the Transformer's sinusoids, scaled to standard deviation `std`."""
    positions, dim = weight.shape
    position = torch.arange(positions, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(positions, dim)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency[: dim // 2])
    with torch.no_grad():
        weight.copy_(table * (std / table.std()))


def set_dropout(model: nn.Module, p: float) -> None:
    """Set every dropout of a live model to p: hidden, attention and head (the paper removes dropout mid-run)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = p
        if isinstance(module, Attention):
            module.attention_dropout = p
        if isinstance(getattr(module, "config", None), AlbertConfig):
            module.config.hidden_dropout_prob = module.config.attention_probs_dropout_prob = p
            module.config.classifier_dropout_prob = p


def compile_backbone(model: nn.Module, **options) -> None:
    """torch.compile a model's backbone (embeddings, encoder, pooler) in place; parameter names do not change.

    The backbone is nearly all of the work and has no data-dependent shapes, so it compiles without graph breaks;
    the heads stay eager (the pretraining MLM head decodes a data-dependent number of masked positions). Sequence
    lengths that vary between batches make the first recompile dynamic, not one graph per length; changing dropout
    (set_dropout) recompiles once. `options` go to torch.compile.
    """
    backbone = model.albert if isinstance(getattr(model, "albert", None), AlbertModel) else model
    backbone.compile(**options)


class _Albert(nn.Module):
    """What every ALBERT model offers besides forward."""

    config: AlbertConfig

    def set_dropout(self, p: float) -> None:
        set_dropout(self, p)


class AlbertModel(_Albert):
    """Embeddings + encoder + pooler: the backbone shared by every task head."""

    def __init__(self, config: AlbertConfig):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
        self.apply(lambda module: init_weights(module, config.initializer_range))
        if config.position_embedding_init == "sinusoidal":
            sinusoidal_(self.embeddings.position_embeddings.weight, config.initializer_range)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> EncoderOutput:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)
        # A boolean (B, 1, 1, T) mask: True where a key may be attended to.
        mask = attention_mask[:, None, None, :].bool() if attention_mask is not None else None
        x, states = self.encoder(x, mask, output_hidden_states)
        pooled = torch.tanh(self.pooler(pool(x, attention_mask, self.config.pooling)))
        return EncoderOutput(x, pooled, states)


def pool(x: Tensor, attention_mask: Tensor | None, pooling: str) -> Tensor:
    """(B, T, H) -> (B, H): the [CLS] state ("cls"), or the mean over the positions attention_mask keeps ("mean")."""
    if pooling == "cls":
        return x[:, 0]
    if attention_mask is None:
        return x.mean(dim=1)
    keep = attention_mask.to(x.dtype).unsqueeze(-1)
    return (x * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)


# --- heads ---------------------------------------------------------------------------------------------


class MaskedLMHead(nn.Module):
    """dense H -> E, GELU, LayerNorm, then E -> V tied to the word embeddings (+ bias)."""

    def __init__(self, config: AlbertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.embedding_size)
        self.layer_norm = nn.LayerNorm(config.embedding_size, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: Tensor, word_embeddings: Tensor) -> Tensor:
        x = self.layer_norm(self.act(self.dense(x)))
        return F.linear(x, word_embeddings, self.bias)


class AlbertForPreTraining(_Albert):
    """MLM + sentence-pair (SOP or NSP) pretraining."""

    def __init__(self, config: AlbertConfig):
        super().__init__()
        self.config = config
        self.albert = AlbertModel(config)
        self.mlm_head = MaskedLMHead(config)
        self.pair_head = nn.Linear(config.hidden_size, 2)
        self.classifier_dropout = nn.Dropout(config.classifier_dropout_prob)
        self.mlm_head.apply(lambda m: init_weights(m, config.initializer_range))
        init_weights(self.pair_head, config.initializer_range)

    def init_mlm_bias(self, log_frequencies: Tensor) -> None:
        """Start the MLM decoder's bias at the pieces' log frequencies (albert_core.evaluation.unigram): the model then
        predicts the unigram distribution from its first step, and training goes to context at once instead of
        first moving the bias there, which takes Adam-type optimizers thousands of steps at small learning rates."""
        if log_frequencies.shape != self.mlm_head.bias.shape:
            raise ValueError(
                f"init_mlm_bias: {tuple(log_frequencies.shape)} values for {self.config.vocab_size} pieces"
            )
        with torch.no_grad():
            self.mlm_head.bias.copy_(log_frequencies - log_frequencies.mean())

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        mlm_labels: Tensor | None = None,
        pair_labels: Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> PreTrainingOutput:
        out = self.albert(input_ids, attention_mask, token_type_ids, output_hidden_states)
        pair_logits = self.pair_head(self.classifier_dropout(out.pooled_output))
        mlm_loss = pair_loss = loss = None
        tied = self.albert.embeddings.word_embeddings.weight
        if mlm_labels is None:
            mlm_logits = self.mlm_head(out.last_hidden_state, tied)
        else:
            # Decode only the predicted positions: ~15% of tokens, so ~7x less work in the V-sized matmul.
            predicted = mlm_labels != IGNORE_INDEX
            mlm_logits = self.mlm_head(out.last_hidden_state[predicted], tied)
            mlm_loss = F.cross_entropy(mlm_logits.float(), mlm_labels[predicted])
            loss = mlm_loss
        if pair_labels is not None and bool((pair_labels != IGNORE_INDEX).any()):
            pair_loss = F.cross_entropy(pair_logits.float(), pair_labels, ignore_index=IGNORE_INDEX)
            loss = pair_loss if loss is None else loss + pair_loss
        return PreTrainingOutput(loss, mlm_loss, pair_loss, mlm_logits, pair_logits, out.hidden_states)


class AlbertForSequenceClassification(_Albert):
    """Sentence(-pair) classification on the pooled [CLS]; num_labels == 1 is regression (STS-B)."""

    def __init__(self, config: AlbertConfig, num_labels: int):
        super().__init__()
        self.config = config
        self.num_labels = num_labels
        self.albert = AlbertModel(config)
        self.classifier_dropout = nn.Dropout(config.classifier_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, num_labels)
        init_weights(self.classifier, config.initializer_range)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None) -> ClassifierOutput:
        pooled = self.albert(input_ids, attention_mask, token_type_ids).pooled_output
        logits = self.classifier(self.classifier_dropout(pooled))
        loss = None
        if labels is not None:
            if self.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1).float(), labels.float())
            else:
                loss = F.cross_entropy(logits.float(), labels)
        return ClassifierOutput(loss, logits)


class AlbertForQuestionAnswering(_Albert):
    """SQuAD: start/end logits per token and an answerability logit from [CLS] (v2.0)."""

    def __init__(self, config: AlbertConfig):
        super().__init__()
        self.config = config
        self.albert = AlbertModel(config)
        self.span = nn.Linear(config.hidden_size, 2)
        self.classifier_dropout = nn.Dropout(config.classifier_dropout_prob)
        self.answerable = nn.Linear(config.hidden_size, 1)
        init_weights(self.span, config.initializer_range)
        init_weights(self.answerable, config.initializer_range)

    def forward(
        self,
        input_ids,
        attention_mask=None,
        token_type_ids=None,
        start_positions=None,
        end_positions=None,
        is_impossible=None,
    ) -> QuestionAnsweringOutput:
        out = self.albert(input_ids, attention_mask, token_type_ids)
        start_logits, end_logits = self.span(out.last_hidden_state).float().unbind(-1)
        if attention_mask is not None:  # padding never answers
            pad = attention_mask == 0
            start_logits = start_logits.masked_fill(pad, -1e4)
            end_logits = end_logits.masked_fill(pad, -1e4)
        answerable_logits = self.answerable(self.classifier_dropout(out.pooled_output)).squeeze(-1).float()
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = (F.cross_entropy(start_logits, start_positions) + F.cross_entropy(end_logits, end_positions)) / 2
            if is_impossible is not None:
                loss = loss + F.binary_cross_entropy_with_logits(answerable_logits, 1.0 - is_impossible.float())
        return QuestionAnsweringOutput(loss, start_logits, end_logits, answerable_logits)


class AlbertForMultipleChoice(_Albert):
    """RACE: inputs (B, C, T); one score per choice from the pooled [CLS]."""

    def __init__(self, config: AlbertConfig):
        super().__init__()
        self.config = config
        self.albert = AlbertModel(config)
        self.classifier_dropout = nn.Dropout(config.classifier_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, 1)
        init_weights(self.classifier, config.initializer_range)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None) -> MultipleChoiceOutput:
        B, C, T = input_ids.shape

        def flat(t):
            return t.reshape(B * C, T) if t is not None else None

        pooled = self.albert(flat(input_ids), flat(attention_mask), flat(token_type_ids)).pooled_output
        logits = self.classifier(self.classifier_dropout(pooled)).view(B, C)
        loss = F.cross_entropy(logits.float(), labels) if labels is not None else None
        return MultipleChoiceOutput(loss, logits)


def estimate_flops_per_token(config: AlbertConfig, seq_len: int, *, mlm_fraction: float = 1.0) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), for MFU.

    Sharing cuts parameters, not FLOPs: every layer does its full matmuls.
    """
    H, F_, E, L, V = (
        config.hidden_size,
        config.intermediate_size,
        config.embedding_size,
        config.num_hidden_layers,
        config.vocab_size,
    )
    per_layer = 2 * (4 * H * H + 2 * H * F_) + 2 * 2 * seq_len * H  # matmuls + attention scores/context
    projection = 2 * E * H if config.has_embedding_projection else 0
    mlm = mlm_fraction * (2 * H * E + 2 * E * V)
    return 3.0 * (L * per_layer + projection + mlm)
