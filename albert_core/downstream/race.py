"""RACE: reading the official release and building the four multiple-choice inputs of a question.

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

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from albert_core.downstream import DataFormatError

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
