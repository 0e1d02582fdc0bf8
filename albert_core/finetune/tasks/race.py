"""RACE: reading the official release, building the four multiple-choice inputs of a question, and RaceData (the
fine-tuning loop's adapter).

Layout: <data_dir>/{train,dev,test}/{middle,high}/*.txt, each file one JSON object
{"answers": ["A", ...], "options": [[4 strings], ...], "questions": [...], "article": str, "id": "high1.txt"}
(one question per entry of answers/options/questions). The original ALBERT code reads a single
{middle,high}/all.txt holding one such object per line; when all.txt exists, only it is read.

As the original (ALBERT race_utils): middle before high; a question containing "_" is a cloze, the option
replaces every "_"; otherwise the choice text is question + " " + option. Each choice becomes
`[CLS] article [SEP] choice [SEP]` (segment 0 up to the first [SEP], then 1): the choice keeps its last
max_qa_length tokens, then the article is cut to fit max_seq_length.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from albert_core.evaluation.metrics import race_accuracy
from albert_core.files import atomic_write_json
from albert_core.finetune.config import FinetuneConfig, TaskHyperparams
from albert_core.finetune.tasks import DataFormatError
from albert_core.finetune.tasks.batching import by_length, text_batch, to_device
from albert_core.finetune.tasks.outputs import TaskOutputs
from albert_core.model.config import AlbertConfig
from albert_core.model.modeling import AlbertForMultipleChoice
from albert_core.text.tokenization import Tokenizer

RACE_LEVELS = ("middle", "high")
RACE_SPLITS = ("train", "dev", "test")
ANSWER_LETTERS = ("A", "B", "C", "D")


@dataclass(frozen=True)
class RaceExample:
    example_id: str  # "<file id>-<question index>", e.g. "high1.txt-0"
    level: str  # "middle" | "high"
    article: str
    question: str
    options: list[str]  # 4
    label: int  # 0..3 for A..D


def race_choices(example: RaceExample) -> list[str]:
    """The four question+option texts (cloze questions get the option in place of each "_")."""
    if "_" in example.question:
        return [example.question.replace("_", option) for option in example.options]
    return [f"{example.question} {option}" for option in example.options]


def _field(record: dict, key: str, kind: type, path: Path, where: str):
    if key not in record:
        raise DataFormatError(path, where, f"expected a {key!r} field")
    if not isinstance(record[key], kind):
        raise DataFormatError(
            path, where, f"expected {key!r} to be a {kind.__name__}, found {type(record[key]).__name__}"
        )
    return record[key]


def _examples_of(record: object, level: str, path: Path, where: str) -> list[RaceExample]:
    if not isinstance(record, dict):
        raise DataFormatError(path, where, f"expected a JSON object, found {type(record).__name__}")
    answers = _field(record, "answers", list, path, where)
    options = _field(record, "options", list, path, where)
    questions = _field(record, "questions", list, path, where)
    article = _field(record, "article", str, path, where)
    file_id = _field(record, "id", str, path, where)
    if not len(answers) == len(options) == len(questions):
        raise DataFormatError(
            path,
            where,
            f"expected as many answers, options and questions, found {len(answers)}, {len(options)}, {len(questions)}",
        )
    examples = []
    for i, (answer, choice_list, question) in enumerate(zip(answers, options, questions, strict=True)):
        at = f"{where + ', ' if where else ''}question {i}"
        if answer not in ANSWER_LETTERS:
            raise DataFormatError(path, at, f"expected an answer in {list(ANSWER_LETTERS)}, found {answer!r}")
        if not isinstance(question, str):
            raise DataFormatError(path, at, f"expected the question to be a string, found {type(question).__name__}")
        if not (
            isinstance(choice_list, list) and len(choice_list) == 4 and all(isinstance(o, str) for o in choice_list)
        ):
            raise DataFormatError(path, at, f"expected 4 option strings, found {choice_list!r}")
        examples.append(
            RaceExample(f"{file_id}-{i}", level, article, question, list(choice_list), ANSWER_LETTERS.index(answer))
        )
    return examples


def read_race_file(path: str | Path, level: str) -> list[RaceExample]:
    """The questions of one RACE file: one JSON object, or one object per line (ALBERT's all.txt)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        return _examples_of(json.loads(text), level, path, "")
    except RecursionError:
        raise DataFormatError(path, "", "expected JSON (nested too deeply)") from None
    except json.JSONDecodeError as whole_error:
        if whole_error.msg != "Extra data":  # not several objects, one per line: a broken file
            raise DataFormatError(path, f"line {whole_error.lineno}", f"expected JSON ({whole_error.msg})") from None
        lines = [(n, line) for n, line in enumerate(text.split("\n"), start=1) if line.strip()]
    examples = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataFormatError(path, f"line {n}", f"expected one JSON object per line ({e.msg})") from None
        except RecursionError:
            raise DataFormatError(path, f"line {n}", "expected one JSON object per line (nested too deeply)") from None
        examples += _examples_of(record, level, path, f"line {n}")
    return examples


def read_race(data_dir: str | Path, split: str, levels: Sequence[str] = RACE_LEVELS) -> list[RaceExample]:
    """All questions of `split` ("train", "dev", "test") of the RACE release at `data_dir` (the folder holding
    train/dev/test, or the folder holding RACE/), middle before high, files in name order."""
    if split not in RACE_SPLITS:
        raise ValueError(f"unknown RACE split {split!r}; expected one of {list(RACE_SPLITS)}")
    root = Path(data_dir)
    if not (root / split).is_dir() and (root / "RACE" / split).is_dir():
        root = root / "RACE"
    examples = []
    for level in levels:
        if level not in RACE_LEVELS:
            raise ValueError(f"unknown RACE level {level!r}; expected one of {list(RACE_LEVELS)}")
        folder = root / split / level
        if not folder.is_dir():
            raise FileNotFoundError(f"RACE {split}/{level}: {folder} is not a directory")
        files = [folder / "all.txt"] if (folder / "all.txt").is_file() else sorted(folder.glob("*.txt"))
        if not files:
            raise FileNotFoundError(f"RACE {split}/{level}: no .txt files in {folder}")
        for path in files:
            examples += read_race_file(path, level)
    return examples


def race_inputs(
    example: RaceExample,
    encode: Callable[[str], list[int]],
    *,
    cls_id: int,
    sep_id: int,
    max_seq_length: int = 512,
    max_qa_length: int = 128,
) -> list[tuple[list[int], list[int]]]:
    """(input_ids, token_type_ids) for each of the four choices, unpadded (at most max_seq_length long)."""
    if max_qa_length <= 0 or max_seq_length - 3 - max_qa_length < 0:
        raise ValueError(f"max_qa_length {max_qa_length} leaves no room in max_seq_length {max_seq_length}")
    article = list(encode(example.article))
    inputs = []
    for choice in race_choices(example):
        choice_ids = list(encode(choice))[-max_qa_length:]
        article_ids = article[: max_seq_length - 3 - len(choice_ids)]
        input_ids = [cls_id, *article_ids, sep_id, *choice_ids, sep_id]
        token_type_ids = [0] * (len(article_ids) + 2) + [1] * (len(choice_ids) + 1)
        inputs.append((input_ids, token_type_ids))
    return inputs


# --- fine-tuning: the task adapter ----------------------------------------------------------------------------


class RaceData:
    """RACE: four choices per question, accuracy on middle / high / all."""

    def __init__(self, task: str, data_dir: str | Path, tokenizer: Tokenizer, h: TaskHyperparams, cfg: FinetuneConfig):
        self.task = task
        self.data_dir = Path(data_dir)
        self.tokenizer = tokenizer
        self.max_seq_length = h.max_seq_length
        self.max_qa_length = cfg.max_qa_length
        if not 0 < cfg.max_qa_length <= h.max_seq_length - 3:
            raise ValueError(
                f"FinetuneConfig.max_qa_length: {cfg.max_qa_length} leaves no room for the article in "
                f"max_seq_length {h.max_seq_length}; expected 1..{h.max_seq_length - 3}"
            )
        self.metric = "acc"
        self.dev_splits = ["dev"]
        self._examples: dict[str, list[RaceExample]] = {}
        self._encoded: dict[str, list[list[tuple[list[int], list[int]]]]] = {}

    @functools.cached_property
    def train_rows(self) -> list[list[tuple[list[int], list[int]]]]:
        return self._rows("train")

    @functools.cached_property
    def train_labels(self) -> list[int]:
        return [e.label for e in self.examples("train")]

    def row_ids(self, split: str) -> list[str]:
        return [e.example_id for e in self.examples(split)]

    def examples(self, split: str) -> list[RaceExample]:
        if split not in self._examples:
            self._examples[split] = read_race(self.data_dir, split)
        return self._examples[split]

    def _rows(self, split: str) -> list[list[tuple[list[int], list[int]]]]:
        """Encoded once per split (dev is predicted at every evaluation)."""
        if split in self._encoded:
            return self._encoded[split]
        t = self.tokenizer
        self._encoded[split] = [
            race_inputs(
                e,
                t.encode,
                cls_id=t.cls_id,
                sep_id=t.sep_id,
                max_seq_length=self.max_seq_length,
                max_qa_length=self.max_qa_length,
            )
            for e in self.examples(split)
        ]
        return self._encoded[split]

    def model(self, config: AlbertConfig) -> nn.Module:
        return AlbertForMultipleChoice(config)

    @property
    def num_train(self) -> int:
        return len(self.train_rows)

    def _batch(self, rows: Sequence[list[tuple[list[int], list[int]]]]) -> dict[str, Tensor]:
        flat = text_batch([choice for row in rows for choice in row], self.tokenizer.pad_id)
        return {k: v.view(len(rows), len(ANSWER_LETTERS), -1) for k, v in flat.items()}

    def train_batch(self, index: np.ndarray) -> dict[str, Tensor]:
        batch = self._batch([self.train_rows[i] for i in index])
        batch["labels"] = torch.tensor([self.train_labels[i] for i in index])
        return batch

    def predict(self, model: nn.Module, split: str, batch_size: int, device: torch.device) -> TaskOutputs:
        rows = self._rows(split)
        logits = np.zeros((len(rows), len(ANSWER_LETTERS)), dtype=np.float32)
        # batch_size counts sequences: a question is four of them
        for index in by_length([max(len(ids) for ids, _ in row) for row in rows], max(1, batch_size // 4)):
            batch = to_device(self._batch([rows[i] for i in index]), device)
            logits[index] = model(**batch).logits.float().cpu().numpy()
        return TaskOutputs(self.task, split, [e.example_id for e in self.examples(split)], {"logits": logits})

    def score(self, outputs: TaskOutputs) -> dict[str, float]:
        examples = self.examples(outputs.split)
        by_level = race_accuracy(
            outputs.arrays["logits"].argmax(axis=1), [e.label for e in examples], [e.level for e in examples]
        )
        return {"acc": by_level["all"], "acc_middle": by_level["middle"], "acc_high": by_level["high"]}

    def write_predictions(self, outputs: TaskOutputs, out_dir: Path) -> Path:
        """predictions_<split>.json: {example id: answer letter}."""
        letters = [ANSWER_LETTERS[i] for i in outputs.arrays["logits"].argmax(axis=1).tolist()]
        path = out_dir / f"predictions_{outputs.split}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, dict(zip(outputs.ids, letters, strict=True)))
        return path

    def available_test_splits(self) -> list[str]:
        root = self.data_dir if (self.data_dir / "test").is_dir() else self.data_dir / "RACE"
        return ["test"] if (root / "test").is_dir() else []

    def test_metrics(self, outputs: TaskOutputs) -> dict[str, float]:
        return self.score(outputs)  # RACE's test answers are public
