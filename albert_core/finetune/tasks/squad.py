"""SQuAD v1.1 / v2.0: reading the official JSON, sliding-window features, span decoding, prediction files, and
SquadData (the fine-tuning loop's adapter).

Follows the original BERT/ALBERT run_squad pipeline:
- the context is split into words on whitespace (" ", "\\t", "\\r", "\\n", U+202F); every character maps to the
  word it belongs to (whitespace to the word before it);
- each word is encoded on its own and the pieces are concatenated, so every token belongs to one word (a
  SentencePiece model never lets a piece cross whitespace, so this equals encoding the whole context); the
  gold span is then narrowed to the tokens whose characters overlap the answer (with piece-level offsets, see
  below), and to the tokens that encode the answer text exactly, when they exist;
- windows `[CLS] question [SEP] context-window [SEP]` (segment 0, then 1) slide over the context tokens with
  `doc_stride`; a token's "max context" window is the one where min(left, right) context + 0.01·length is
  largest; the answer positions are those of the window, or 0/0 ([CLS]) when the window does not hold the whole
  answer or the question has none;
- decoding takes the n-best start and end logits of each window, keeps spans inside the context, starting at a
  max-context token, not reversed and at most max_answer_length tokens long, and answers with the best-scoring
  one; v2.0 answers "" when the null score ([CLS] start + end, smallest over the windows) minus the best span's
  score exceeds the threshold.

The tokenizer is two callables: `encode(text) -> list[int]` and optionally `id_to_piece(id) -> str` (e.g. a
SentencePieceProcessor's `encode` and `id_to_piece`). With pieces, a token's characters are located inside its
word (pieces without "▁" must spell the word, up to case and accent folding: same length), so an answer can
start or end inside a word ("1895" from "(1895),"); without them, or when they do not spell the word, every
token covers its whole word. The predicted text is always a substring of the context.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from albert_core.evaluation.metrics import best_null_threshold, squad_scores, squad_v2_scores
from albert_core.examples.batch import padded_length
from albert_core.files import atomic_write_json
from albert_core.finetune.config import SQUAD_TASKS, FinetuneConfig, TaskHyperparams
from albert_core.finetune.tasks import DataFormatError
from albert_core.finetune.tasks.batching import by_length, to_device
from albert_core.finetune.tasks.outputs import TaskOutputs
from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import AlbertForQuestionAnswering
from albert_core.text.tokenization import Tokenizer

log = logging.getLogger(__name__)

Encode = Callable[[str], list[int]]
IdToPiece = Callable[[int], str]

_WHITESPACE = frozenset(" \t\r\n\u202f")


def whitespace_words(context: str) -> tuple[list[str], list[int], list[tuple[int, int]]]:
    """(words, word index of each character, (start, end) character span of each word) as the original splits.

    A whitespace character belongs to the word before it (-1 before the first word).
    """
    words: list[str] = []
    char_to_word: list[int] = []
    spans: list[tuple[int, int]] = []
    previous_is_space = True
    for i, ch in enumerate(context):
        if ch in _WHITESPACE:
            previous_is_space = True
        else:
            if previous_is_space:
                words.append(ch)
                spans.append((i, i + 1))
            else:
                words[-1] += ch
                spans[-1] = (spans[-1][0], i + 1)
            previous_is_space = False
        char_to_word.append(len(words) - 1)
    return words, char_to_word, spans


@dataclass
class SquadExample:
    qid: str
    question: str
    context: str
    answers: list[str]  # gold answer texts (several in dev files); [] for an unanswerable question
    answer_starts: list[int]  # character offset of each answer in the context
    is_impossible: bool = False
    plausible_answers: list[str] = field(default_factory=list)  # v2.0: a plausible but wrong span, if given
    title: str = ""
    words: list[str] = field(init=False, repr=False)
    char_to_word: list[int] = field(init=False, repr=False)
    word_spans: list[tuple[int, int]] = field(init=False, repr=False)

    def __post_init__(self):
        self.words, self.char_to_word, self.word_spans = whitespace_words(self.context)

    def answer_word_span(self) -> tuple[int, int] | None:
        """(first word, last word) of the first answer, or None: unanswerable, or the answer text is not at its
        offset (compared word by word, as the original does before skipping such a training example)."""
        if self.is_impossible or not self.answers or not self.answers[0].strip():
            return None
        text, start = self.answers[0], self.answer_starts[0]
        first = max(self.char_to_word[start], 0)
        last = self.char_to_word[start + len(text) - 1]
        if last < first or " ".join(text.split()) not in " ".join(self.words[first : last + 1]):
            return None
        return first, last


def _fail(path: Path, where: str, expected: str) -> DataFormatError:
    return DataFormatError(path, where, expected)


def _get(record: object, key: str, kind: type, path: Path, where: str):
    if not isinstance(record, dict):
        raise _fail(path, where, f"expected a JSON object, found {type(record).__name__}")
    if key not in record:
        raise _fail(path, where, f"expected a {key!r} field")
    value = record[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _fail(path, where, f"expected {key!r} to be a {kind.__name__}, found {type(value).__name__}")
    return value


def _read_answers(qa: dict, key: str, context: str, path: Path, where: str) -> tuple[list[str], list[int]]:
    texts, starts = [], []
    for k, answer in enumerate(_get(qa, key, list, path, where) if key in qa else []):
        at = f"{where}.{key}[{k}]"
        text = _get(answer, "text", str, path, at)
        start = _get(answer, "answer_start", int, path, at)
        if start < 0 or start + len(text) > len(context) or not text:
            raise _fail(
                path,
                at,
                f"expected a non-empty answer inside the context ({len(context)} characters), "
                f"found answer_start {start} and {len(text)} characters",
            )
        texts.append(text)
        starts.append(start)
    return texts, starts


def read_squad(path: str | Path) -> list[SquadExample]:
    """All questions of a SQuAD v1.1 or v2.0 JSON file, in file order."""
    path = Path(path)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise _fail(path, f"line {e.lineno}", f"expected JSON ({e.msg})") from None
    except RecursionError:
        raise _fail(path, "top level", "expected JSON (nested too deeply)") from None
    examples = []
    for i, article in enumerate(_get(document, "data", list, path, "top level")):
        title = article.get("title", "") if isinstance(article, dict) else ""
        for j, paragraph in enumerate(_get(article, "paragraphs", list, path, f"data[{i}]")):
            where = f"data[{i}].paragraphs[{j}]"
            context = _get(paragraph, "context", str, path, where)
            for k, qa in enumerate(_get(paragraph, "qas", list, path, where)):
                at = f"{where}.qas[{k}]"
                qid = _get(qa, "id", str, path, at)
                at = f"{at} (id {qid})"
                question = _get(qa, "question", str, path, at)
                is_impossible = _get(qa, "is_impossible", bool, path, at) if "is_impossible" in qa else False
                if "answers" not in qa:
                    raise _fail(path, at, "expected an 'answers' field")
                answers, starts = _read_answers(qa, "answers", context, path, at)
                if not answers and not is_impossible:
                    raise _fail(path, at, "expected at least one answer (or is_impossible: true)")
                if is_impossible and answers:
                    raise _fail(path, at, f"expected no answers for an impossible question, found {len(answers)}")
                plausible, _ = _read_answers(qa, "plausible_answers", context, path, at)
                examples.append(
                    SquadExample(qid, question, context, answers, starts, is_impossible, plausible, title=title)
                )
    return examples


@dataclass
class SquadFeature:
    """One window of one example. Window positions p with context_offset <= p < context_offset +
    len(token_to_word) hold context tokens; the lists below are indexed by p - context_offset."""

    example_index: int
    qid: str
    window_index: int
    input_ids: list[int]  # padded to max_seq_length
    token_type_ids: list[int]
    attention_mask: list[int]
    context_offset: int  # position of the first context token (len(question tokens) + 2)
    token_to_word: list[int]  # original word index of each context token
    token_is_max_context: list[bool]
    token_char_spans: list[tuple[int, int]]  # (start, end) characters of the context each token covers
    start_position: int  # answer start in the window, 0 ([CLS]) when absent
    end_position: int

    @property
    def num_context_tokens(self) -> int:
        return len(self.token_to_word)


def _piece_spans(word: str, start: int, ids: list[int], id_to_piece: IdToPiece | None) -> list[tuple[int, int]]:
    whole = [(start, start + len(word))] * len(ids)
    if id_to_piece is None:
        return whole
    lengths = [len(id_to_piece(i).replace("\u2581", "")) for i in ids]
    if sum(lengths) != len(word):
        return whole
    spans, at = [], start
    for n in lengths:
        spans.append((at, at + n))
        at += n
    return spans


@dataclass
class _EncodedContext:
    ids: list[int]
    token_to_word: list[int]
    char_spans: list[tuple[int, int]]
    word_to_first_token: list[int]


def _encode_context(example: SquadExample, encode: Encode, id_to_piece: IdToPiece | None) -> _EncodedContext:
    ids, token_to_word, spans, first = [], [], [], []
    for w, (word, (start, _)) in enumerate(zip(example.words, example.word_spans, strict=True)):
        first.append(len(ids))
        word_ids = list(encode(word))
        ids.extend(word_ids)
        token_to_word.extend([w] * len(word_ids))
        spans.extend(_piece_spans(word, start, word_ids, id_to_piece))
    return _EncodedContext(ids, token_to_word, spans, first)


def _encode_words(text: str, encode: Encode) -> list[int]:
    return [i for word in text.split() for i in encode(word)]


def _overlaps(span: tuple[int, int], start: int, end: int) -> bool:
    return span[1] > span[0] and span[0] < end and span[1] > start


def _answer_token_span(example: SquadExample, context: _EncodedContext, encode: Encode) -> tuple[int, int] | None:
    word_span = example.answer_word_span()
    if word_span is None:
        return None
    first_word, last_word = word_span
    start = context.word_to_first_token[first_word]
    last_word_end = (
        context.word_to_first_token[last_word + 1] if last_word + 1 < len(example.words) else len(context.ids)
    )
    end = last_word_end - 1
    if end < start:
        return None
    # The answer may be part of a word ("1895" in "(1895),"). Narrow to the tokens whose characters overlap it
    # (this needs piece-level character spans), then, as the original, to tokens that encode it exactly.
    answer_start = example.answer_starts[0]
    answer_end = answer_start + len(example.answers[0])
    overlapping = [t for t in range(start, end + 1) if _overlaps(context.char_spans[t], answer_start, answer_end)]
    if overlapping:
        start, end = overlapping[0], overlapping[-1]
    answer_ids = _encode_words(example.answers[0], encode)
    for new_start in range(start, end + 1):
        for new_end in range(end, new_start - 1, -1):
            if context.ids[new_start : new_end + 1] == answer_ids:
                return new_start, new_end
    return start, end


def _windows(num_tokens: int, max_tokens: int, doc_stride: int) -> list[tuple[int, int]]:
    """(start, length) of each window; at least one (empty) window."""
    windows, start = [], 0
    while start < num_tokens:
        length = min(num_tokens - start, max_tokens)
        windows.append((start, length))
        if start + length == num_tokens:
            break
        start += min(length, doc_stride)
    return windows or [(0, 0)]


def _is_max_context(windows: list[tuple[int, int]], window_index: int, token: int) -> bool:
    best_score, best_window = -math.inf, None
    for w, (start, length) in enumerate(windows):
        end = start + length - 1
        if start <= token <= end:
            score = min(token - start, end - token) + 0.01 * length
            if score > best_score:
                best_score, best_window = score, w
    return best_window == window_index


def make_features(
    examples: Sequence[SquadExample],
    encode: Encode,
    *,
    cls_id: int,
    sep_id: int,
    pad_id: int,
    id_to_piece: IdToPiece | None = None,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = 64,
    is_training: bool = False,
) -> list[SquadFeature]:
    """Sliding-window features of each example, in example order.

    With is_training=True an answerable example whose answer text is not at its answer_start is skipped (logged),
    as the original does; otherwise every example gets at least one feature.
    """
    if doc_stride <= 0:
        raise ValueError(f"doc_stride must be positive, got {doc_stride}")
    features: list[SquadFeature] = []
    skipped = 0
    encoded_contexts: dict[str, _EncodedContext] = {}  # a paragraph is shared by ~5 questions: encode it once
    for example_index, example in enumerate(examples):
        query = list(encode(example.question))[:max_query_length]
        max_context_tokens = max_seq_length - len(query) - 3
        if max_context_tokens <= 0:
            raise ValueError(
                f"max_seq_length {max_seq_length} leaves no room for the context after a {len(query)}-token "
                f"question (qid {example.qid}); lower max_query_length"
            )
        context = encoded_contexts.get(example.context)
        if context is None:
            context = encoded_contexts[example.context] = _encode_context(example, encode, id_to_piece)
        answer = _answer_token_span(example, context, encode)
        if is_training and answer is None and not example.is_impossible:
            skipped += 1
            continue
        windows = _windows(len(context.ids), max_context_tokens, doc_stride)
        offset = len(query) + 2
        for window_index, (start, length) in enumerate(windows):
            tokens = [cls_id, *query, sep_id, *context.ids[start : start + length], sep_id]
            type_ids = [0] * offset + [1] * (length + 1)
            padding = max_seq_length - len(tokens)
            start_position = end_position = 0
            if answer is not None and start <= answer[0] and answer[1] < start + length:
                start_position, end_position = answer[0] - start + offset, answer[1] - start + offset
            features.append(
                SquadFeature(
                    example_index=example_index,
                    qid=example.qid,
                    window_index=window_index,
                    input_ids=tokens + [pad_id] * padding,
                    token_type_ids=type_ids + [0] * padding,
                    attention_mask=[1] * len(tokens) + [0] * padding,
                    context_offset=offset,
                    token_to_word=context.token_to_word[start : start + length],
                    token_is_max_context=[
                        _is_max_context(windows, window_index, t) for t in range(start, start + length)
                    ],
                    token_char_spans=context.char_spans[start : start + length],
                    start_position=start_position,
                    end_position=end_position,
                )
            )
    if skipped:
        log.warning("make_features: skipped %d training example(s) whose answer is not at its answer_start", skipped)
    return features


def _top_indexes(logits: np.ndarray, n: int) -> np.ndarray:
    return np.argsort(-logits, kind="stable")[:n]


def decode_predictions(
    examples: Sequence[SquadExample],
    features: Sequence[SquadFeature],
    start_logits: Sequence[Sequence[float]] | np.ndarray,
    end_logits: Sequence[Sequence[float]] | np.ndarray,
    *,
    version_2: bool,
    n_best: int = 20,
    max_answer_length: int = 30,
    null_threshold: float = 0.0,
) -> tuple[dict[str, str], dict[str, float]]:
    """(qid → answer text, qid → null odds) from per-window logits (start_logits[i] belongs to features[i]).

    Null odds (v2.0 only; {} for v1.1) = null score − best span score; the answer is "" when they exceed
    `null_threshold`, or when no valid span exists (odds +inf).
    """
    if not (len(features) == len(start_logits) == len(end_logits)):
        raise ValueError(
            f"features ({len(features)}), start_logits ({len(start_logits)}) and end_logits ({len(end_logits)}) "
            "must be parallel"
        )
    by_example: dict[int, list[int]] = {}
    for i, feature in enumerate(features):
        by_example.setdefault(feature.example_index, []).append(i)

    predictions: dict[str, str] = {}
    null_odds: dict[str, float] = {}
    for example_index, example in enumerate(examples):
        candidates: list[tuple[float, int, int, int]] = []  # (score, feature index, start, end)
        null_score = math.inf
        for i in by_example.get(example_index, []):
            feature = features[i]
            starts, ends = np.asarray(start_logits[i], dtype=np.float64), np.asarray(end_logits[i], dtype=np.float64)
            null_score = min(null_score, float(starts[0] + ends[0]))
            first, stop = feature.context_offset, feature.context_offset + feature.num_context_tokens
            for s in _top_indexes(starts, n_best).tolist():
                if not first <= s < stop or not feature.token_is_max_context[s - first]:
                    continue
                for e in _top_indexes(ends, n_best).tolist():
                    if first <= e < stop and s <= e < s + max_answer_length:
                        candidates.append((float(starts[s] + ends[e]), i, s, e))
        candidates.sort(key=lambda c: c[0], reverse=True)
        best_text, best_score = "", None
        for score, i, s, e in candidates:
            feature = features[i]
            char_start = feature.token_char_spans[s - feature.context_offset][0]
            char_end = feature.token_char_spans[e - feature.context_offset][1]
            if char_end > char_start:
                best_text, best_score = example.context[char_start:char_end], score
                break
        if not version_2:
            predictions[example.qid] = best_text
            continue
        odds = math.inf if best_score is None else null_score - best_score
        null_odds[example.qid] = odds
        predictions[example.qid] = "" if odds > null_threshold else best_text
    return predictions, null_odds


def write_squad_predictions(predictions: Mapping[str, str] | Mapping[str, float], path: str | Path) -> Path:
    """The official predictions file ({qid: answer text}); also writes null odds ({qid: float}, the na_prob file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, dict(predictions), ensure_ascii=False)
    return path


# --- fine-tuning: the task adapter ----------------------------------------------------------------------------


class SquadData:
    """SQuAD v1.1 / v2.0 from the official file names in data_dir: train-v1.1.json + dev-v1.1.json (or -v2.0)."""

    def __init__(self, task: str, data_dir: str | Path, tokenizer: Tokenizer, h: TaskHyperparams, cfg: FinetuneConfig):
        self.task = task
        self.version_2 = task == "squad2"
        self.data_dir = Path(data_dir)
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.max_seq_length = h.max_seq_length
        self.metric = "f1"
        self.dev_splits = ["dev"]
        self._examples: dict[str, list[SquadExample]] = {}
        self._features: dict[str, list[SquadFeature]] = {}

    @functools.cached_property
    def train(self) -> dict[str, Tensor]:
        features = self.features("train")
        if not features:
            raise ValueError(f"{self.path('train')}: no training features (every answer was off its answer_start)")
        train = {
            "input_ids": torch.tensor([f.input_ids for f in features]),
            "token_type_ids": torch.tensor([f.token_type_ids for f in features]),
            "attention_mask": torch.tensor([f.attention_mask for f in features]),
            "start_positions": torch.tensor([f.start_position for f in features]),
            "end_positions": torch.tensor([f.end_position for f in features]),
        }
        if self.version_2:  # a window that does not hold the answer is "impossible" for the answerability head
            train["is_impossible"] = (train["start_positions"] == 0).float()
        return train

    def row_ids(self, split: str) -> list[str]:
        return [f"{f.qid}#{f.window_index}" for f in self.features(split)]

    def path(self, split: str) -> Path:
        path = self.data_dir / f"{split}-{SQUAD_TASKS[self.task]}.json"
        if not path.is_file():
            raise FileNotFoundError(f"SQuAD {SQUAD_TASKS[self.task]} {split}: {path} not found (official file names)")
        return path

    def examples(self, split: str) -> list[SquadExample]:
        if split not in self._examples:
            self._examples[split] = read_squad(self.path(split))
        return self._examples[split]

    def features(self, split: str) -> list[SquadFeature]:
        if split not in self._features:
            self._features[split] = make_features(
                self.examples(split),
                self.tokenizer.encode,
                cls_id=self.tokenizer.cls_id,
                sep_id=self.tokenizer.sep_id,
                pad_id=self.tokenizer.pad_id,
                id_to_piece=self.tokenizer.id_to_piece,
                max_seq_length=self.max_seq_length,
                doc_stride=self.cfg.doc_stride,
                max_query_length=self.cfg.max_query_length,
                is_training=split == "train",
            )
        return self._features[split]

    def model(self, config: AlbertConfig) -> nn.Module:
        return AlbertForQuestionAnswering(config)

    @property
    def num_train(self) -> int:
        return len(self.train["input_ids"])

    def train_batch(self, index: np.ndarray) -> dict[str, Tensor]:
        index_t = torch.as_tensor(index)
        width = padded_length(int(self.train["attention_mask"][index_t].sum(1).max()))
        return {k: v[index_t, :width] if v.dim() == 2 else v[index_t] for k, v in self.train.items()}

    def predict(self, model: nn.Module, split: str, batch_size: int, device: torch.device) -> TaskOutputs:
        features = self.features(split)
        n, T = len(features), self.max_seq_length
        start = np.full((n, T), -1e4, dtype=np.float32)
        end = np.full((n, T), -1e4, dtype=np.float32)
        answerable = np.zeros(n, dtype=np.float32)
        lengths = [sum(f.attention_mask) for f in features]
        for index in by_length(lengths, batch_size):
            width = padded_length(max(lengths[i] for i in index))
            batch = {
                "input_ids": torch.tensor([features[i].input_ids[:width] for i in index]),
                "token_type_ids": torch.tensor([features[i].token_type_ids[:width] for i in index]),
                "attention_mask": torch.tensor([features[i].attention_mask[:width] for i in index]),
            }
            out = model(**to_device(batch, device))
            start[index, :width] = out.start_logits.float().cpu().numpy()
            end[index, :width] = out.end_logits.float().cpu().numpy()
            answerable[index] = out.answerable_logits.float().cpu().numpy()
        arrays = {"start_logits": start, "end_logits": end, "answerable_logits": answerable}
        return TaskOutputs(self.task, split, self.row_ids(split), arrays)

    def decode(self, outputs: TaskOutputs) -> tuple[dict[str, str], dict[str, float], dict[str, float]]:
        """(qid -> answer, qid -> null odds (v2.0; {} for v1.1), metrics)."""
        examples, features = self.examples(outputs.split), self.features(outputs.split)
        a = outputs.arrays
        options = dict(n_best=self.cfg.n_best, max_answer_length=self.cfg.max_answer_length)
        golds = [e.answers for e in examples]
        if not self.version_2:
            answers, _ = decode_predictions(
                examples, features, a["start_logits"], a["end_logits"], version_2=False, **options
            )
            return answers, {}, squad_scores(golds, [answers[e.qid] for e in examples])
        spans, span_odds = decode_predictions(
            examples, features, a["start_logits"], a["end_logits"], version_2=True, null_threshold=math.inf, **options
        )
        most_answerable: dict[str, float] = {}
        for feature, logit in zip(features, a["answerable_logits"].tolist(), strict=True):
            most_answerable[feature.qid] = max(most_answerable.get(feature.qid, -math.inf), logit)
        odds = {e.qid: span_odds[e.qid] - most_answerable[e.qid] for e in examples}
        texts = [spans[e.qid] for e in examples]
        threshold = best_null_threshold(golds, texts, [odds[e.qid] for e in examples])["best_f1_thresh"]
        answers = {e.qid: "" if odds[e.qid] > threshold else spans[e.qid] for e in examples}
        metrics = squad_v2_scores(golds, [answers[e.qid] for e in examples])
        metrics["null_threshold"] = threshold
        return answers, odds, metrics

    def score(self, outputs: TaskOutputs) -> dict[str, float]:
        return self.decode(outputs)[2]

    def write_predictions(self, outputs: TaskOutputs, out_dir: Path) -> Path:
        """predictions_<split>.json ({qid: answer}, the official format); v2.0 also null_odds_<split>.json."""
        answers, odds, _ = self.decode(outputs)
        if self.version_2:
            finite = {q: float(np.clip(v, -1e9, 1e9)) for q, v in odds.items()}
            write_squad_predictions(finite, out_dir / f"null_odds_{outputs.split}.json")
        return write_squad_predictions(answers, out_dir / f"predictions_{outputs.split}.json")

    def available_test_splits(self) -> list[str]:
        return []  # SQuAD's test set is not public: the dev predictions file is the submission format

    def test_metrics(self, outputs: TaskOutputs) -> dict[str, float]:
        return {}
