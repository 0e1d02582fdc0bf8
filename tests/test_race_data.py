"""RACE reader and multiple-choice inputs on small files written in the official release's layout."""

import json
from pathlib import Path

import pytest

from albert_core.finetune.tasks import DataFormatError
from albert_core.finetune.tasks.race import RaceExample, race_choices, race_inputs, read_race

CLS, SEP = 2, 3

MIDDLE = {
    "answers": ["B", "D"],
    "options": [
        ["in the morning", "after school", "at noon", "at night"],
        ["happy", "angry", "tired", "surprised"],
    ],
    "questions": ["When does Tom play football?", "Tom felt _ when he saw the new ball."],
    "article": "Tom plays football after school. One day his father gave him a new ball. He could not believe it.",
    "id": "middle1.txt",
}
HIGH = {
    "answers": ["A"],
    "options": [["a scientist", "a farmer", "a teacher", "a writer"]],
    "questions": ["What was Marie Curie?"],
    "article": "Marie Curie was a physicist and chemist who did pioneering research on radioactivity.",
    "id": "high7.txt",
}


def write_race(root: Path, split: str, level: str, name: str, record: dict) -> Path:
    path = root / "RACE" / split / level / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return path


def encode_words(text: str) -> list[int]:
    """One id per whitespace word: its length + 10 (ids 0..9 stay free for specials)."""
    return [len(word) + 10 for word in text.split()]


def test_read_race_reads_middle_before_high_one_example_per_question(tmp_path):
    write_race(tmp_path, "dev", "high", "7.txt", HIGH)
    write_race(tmp_path, "dev", "middle", "1.txt", MIDDLE)
    examples = read_race(tmp_path / "RACE", "dev")
    assert [(e.example_id, e.level, e.label) for e in examples] == [
        ("middle1.txt-0", "middle", 1),
        ("middle1.txt-1", "middle", 3),
        ("high7.txt-0", "high", 0),
    ]
    assert examples[2] == RaceExample(
        "high7.txt-0", "high", HIGH["article"], "What was Marie Curie?", HIGH["options"][0], 0
    )


def test_read_race_accepts_the_folder_holding_race_and_one_level(tmp_path):
    write_race(tmp_path, "train", "high", "7.txt", HIGH)
    write_race(tmp_path, "train", "middle", "1.txt", MIDDLE)
    assert [e.level for e in read_race(tmp_path, "train", levels=["high"])] == ["high"]


def test_read_race_reads_only_albert_all_txt_when_present(tmp_path):
    # all.txt holds one object per line; the per-article file beside it is not read again
    write_race(tmp_path, "test", "middle", "1.txt", MIDDLE)
    (tmp_path / "RACE" / "test" / "middle" / "all.txt").write_text(json.dumps(MIDDLE) + "\n" + json.dumps(HIGH) + "\n")
    write_race(tmp_path, "test", "high", "7.txt", HIGH)
    examples = read_race(tmp_path, "test", levels=["middle"])
    assert [e.example_id for e in examples] == ["middle1.txt-0", "middle1.txt-1", "high7.txt-0"]


def test_cloze_question_gets_the_option_in_the_blank():
    example = RaceExample("m-1", "middle", "a", MIDDLE["questions"][1], MIDDLE["options"][1], 3)
    assert race_choices(example)[0] == "Tom felt happy when he saw the new ball."


def test_plain_question_is_followed_by_the_option():
    example = RaceExample("m-0", "middle", "a", "When does Tom play football?", MIDDLE["options"][0], 1)
    assert race_choices(example)[1] == "When does Tom play football? after school"


def test_unknown_answer_letter_names_file_and_question(tmp_path):
    bad = dict(MIDDLE, answers=["B", "E"])
    write_race(tmp_path, "dev", "middle", "1.txt", bad)
    write_race(tmp_path, "dev", "high", "7.txt", HIGH)
    with pytest.raises(
        DataFormatError, match=r"middle/1\.txt: question 1: expected an answer in \['A', 'B', 'C', 'D'\]"
    ):
        read_race(tmp_path, "dev")


def test_three_options_name_file_and_question(tmp_path):
    bad = dict(HIGH, options=[["a", "b", "c"]])
    write_race(tmp_path, "dev", "high", "7.txt", bad)
    with pytest.raises(DataFormatError, match=r"7\.txt: question 0: expected 4 option strings"):
        read_race(tmp_path, "dev", levels=["high"])


def test_mismatched_question_and_answer_counts_are_reported(tmp_path):
    write_race(tmp_path, "dev", "high", "7.txt", dict(HIGH, answers=["A", "B"]))
    with pytest.raises(DataFormatError, match=r"expected as many answers, options and questions, found 2, 1, 1"):
        read_race(tmp_path, "dev", levels=["high"])


def test_broken_json_names_the_file_and_line(tmp_path):
    path = tmp_path / "RACE" / "dev" / "high" / "7.txt"
    path.parent.mkdir(parents=True)
    path.write_text('{"answers": ["A"],\n "options": [[')
    with pytest.raises(DataFormatError, match=r"7\.txt: line 2: expected JSON"):
        read_race(tmp_path, "dev", levels=["high"])


def test_race_inputs_are_cls_article_sep_choice_sep_for_each_option():
    example = RaceExample("x", "high", "aa bbb", "Who?", ["c", "dddd", "e", "ff"], 0)
    inputs = race_inputs(example, encode_words, cls_id=CLS, sep_id=SEP)
    assert len(inputs) == 4
    # article ids [12, 13]; choice "Who? dddd" -> [14, 14]
    assert inputs[1] == ([CLS, 12, 13, SEP, 14, 14, SEP], [0, 0, 0, 0, 1, 1, 1])


def test_race_inputs_cut_the_article_and_keep_the_end_of_long_choices():
    # article: 10 one-letter words -> ten 11s; choice "bb bb bb bb ccc" (plain question + option)
    example = RaceExample("x", "high", " ".join("a" * 10), "bb bb bb bb", ["ccc", "ccc", "ccc", "ccc"], 0)
    input_ids, type_ids = race_inputs(
        example, encode_words, cls_id=CLS, sep_id=SEP, max_seq_length=10, max_qa_length=3
    )[0]
    # choice "bb bb bb bb ccc" -> [12,12,12,12,13], keep the last 3 -> [12,12,13]
    # article keeps 10 - 3 - 3 = 4 tokens
    assert input_ids == [CLS, 11, 11, 11, 11, SEP, 12, 12, 13, SEP]
    assert type_ids == [0] * 6 + [1] * 4


def test_race_inputs_reject_a_qa_budget_larger_than_the_sequence():
    example = RaceExample("x", "high", "a", "b", ["c"] * 4, 0)
    with pytest.raises(ValueError, match="max_qa_length 128 leaves no room in max_seq_length 64"):
        race_inputs(example, encode_words, cls_id=CLS, sep_id=SEP, max_seq_length=64)
