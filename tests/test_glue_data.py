"""GLUE readers on small files written in each task's official format (headers copied from the GLUE download)."""

from pathlib import Path

import pytest

from albert_core.finetune.tasks import DataFormatError
from albert_core.finetune.tasks.glue import (
    GLUE_TASKS,
    GlueExample,
    glue_task,
    read_glue,
    read_polarity,
    write_glue_predictions,
)


def write_tsv(path: Path, rows: list[list[str]], *, bom: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join("\t".join(row) for row in rows) + "\n"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8"))
    return path


MNLI_DEV_HEADER = (
    "index promptID pairID genre sentence1_binary_parse sentence2_binary_parse sentence1_parse "
    "sentence2_parse sentence1 sentence2 label1 label2 label3 label4 label5 gold_label"
).split()
MNLI_TRAIN_HEADER = (
    "index promptID pairID genre sentence1_binary_parse sentence2_binary_parse sentence1_parse "
    "sentence2_parse sentence1 sentence2 label1 gold_label"
).split()
MNLI_TEST_HEADER = MNLI_TRAIN_HEADER[:10]
STSB_HEADER = "index genre filename year old_index source1 source2 sentence1 sentence2 score".split()


def mnli_row(i: int, s1: str, s2: str) -> list[str]:
    """The first ten columns of an MNLI row (the whole row of a test file); callers append the labels."""
    return [str(i), "31193", f"31193{i}", "government", "( ( x ) )", "( y )", "(ROOT x)", "(ROOT y)", s1, s2]


def test_cola_train_has_no_header_and_four_columns(tmp_path):
    write_tsv(
        tmp_path / "train.tsv",
        [
            ["gj04", "1", "", "Our friends won't buy this analysis, let alone the next one we propose."],
            ["gj04", "0", "*", "They drank the pub."],
        ],
    )
    examples = read_glue("cola", tmp_path, "train")
    assert examples == [
        GlueExample("train-0", "Our friends won't buy this analysis, let alone the next one we propose.", None, 1),
        GlueExample("train-1", "They drank the pub.", None, 0),
    ]


def test_cola_test_has_index_sentence_header_and_no_labels(tmp_path):
    write_tsv(tmp_path / "test.tsv", [["index", "sentence"], ["0", "Bill whistled past the house."]])
    assert read_glue("cola", tmp_path, "test") == [GlueExample("0", "Bill whistled past the house.", None, None)]


def test_sst2_reads_sentence_label_header(tmp_path):
    write_tsv(tmp_path / "dev.tsv", [["sentence", "label"], ["it 's a charming and often affecting journey . ", "1"]])
    (example,) = read_glue("SST-2", tmp_path, "dev")
    assert (example.text_a, example.label) == ("it 's a charming and often affecting journey . ", 1)


def test_mrpc_reads_quality_and_string_columns_behind_a_bom(tmp_path):
    # the Microsoft source file starts with a UTF-8 byte-order mark, which the header keeps
    write_tsv(
        tmp_path / "MRPC" / "train.tsv",
        [
            ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
            [
                "1",
                "702876",
                "702977",
                "Amrozi accused his brother .",
                "Referring to him , Amrozi accused his brother .",
            ],
        ],
        bom=True,
    )
    # data_dir may also be the folder that holds MRPC/
    (example,) = read_glue("mrpc", tmp_path, "train")
    assert example == GlueExample(
        "train-0", "Amrozi accused his brother .", "Referring to him , Amrozi accused his brother .", 1
    )


def test_stsb_score_is_the_last_of_ten_columns_as_a_float(tmp_path):
    row = ["0", "main-captions", "MSRvid", "2012test", "0001", "none", "none"]
    write_tsv(
        tmp_path / "dev.tsv", [STSB_HEADER, row + ["A man with a hard hat is dancing.", "A man is dancing.", "3.800"]]
    )
    (example,) = read_glue("sts-b", tmp_path, "dev")
    assert example.label == pytest.approx(3.8) and example.text_b == "A man is dancing."


def test_stsb_non_numeric_score_names_file_and_line(tmp_path):
    row = ["0", "main-captions", "MSRvid", "2012test", "0001", "none", "none", "A plane.", "A jet."]
    path = write_tsv(tmp_path / "train.tsv", [STSB_HEADER, row + ["5.000"], row + ["high"]])
    with pytest.raises(DataFormatError, match=r"train\.tsv: line 3: expected a numeric score, found 'high'"):
        read_glue("stsb", tmp_path, "train")
    assert path.exists()


def test_qqp_reads_question_pair_and_is_duplicate(tmp_path):
    write_tsv(
        tmp_path / "train.tsv",
        [
            ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
            ["133273", "213221", "213222", "How is the life of a math student?", "Which level of prepration?", "0"],
        ],
    )
    (example,) = read_glue("qqp", tmp_path, "train")
    assert (example.text_a, example.text_b, example.label) == (
        "How is the life of a math student?",
        "Which level of prepration?",
        0,
    )


def test_qqp_test_uses_id_column_as_guid(tmp_path):
    write_tsv(tmp_path / "test.tsv", [["id", "question1", "question2"], ["7", "Why?", "Why not?"]])
    assert read_glue("qqp", tmp_path, "test") == [GlueExample("7", "Why?", "Why not?", None)]


def test_mnli_dev_matched_takes_sentences_at_columns_8_9_and_gold_label_last(tmp_path):
    row = mnli_row(0, "The new rights are nice enough", "Everyone really likes the newest benefits ")
    write_tsv(
        tmp_path / "dev_matched.tsv",
        [MNLI_DEV_HEADER, row + ["neutral", "entailment", "neutral", "neutral", "neutral", "neutral"]],
    )
    (example,) = read_glue("mnli", tmp_path, "dev_matched")
    assert example.text_a == "The new rights are nice enough"
    assert example.text_b == "Everyone really likes the newest benefits "
    assert example.label == GLUE_TASKS["mnli"].labels.index("neutral") == 2


def test_mnli_mm_dev_reads_the_mismatched_file(tmp_path):
    labels5 = ["contradiction"] * 6
    write_tsv(tmp_path / "dev_matched.tsv", [MNLI_DEV_HEADER, mnli_row(0, "matched", "m") + labels5])
    write_tsv(tmp_path / "dev_mismatched.tsv", [MNLI_DEV_HEADER, mnli_row(0, "mismatched", "mm") + labels5])
    assert read_glue("mnli-mm", tmp_path, "dev")[0].text_a == "mismatched"
    assert read_glue("mnli-m", tmp_path, "dev")[0].text_a == "matched"


def test_mnli_train_and_test_headers_have_12_and_10_columns(tmp_path):
    write_tsv(tmp_path / "train.tsv", [MNLI_TRAIN_HEADER, mnli_row(0, "p", "h") + ["entailment", "entailment"]])
    write_tsv(tmp_path / "test_mismatched.tsv", [MNLI_TEST_HEADER, mnli_row(9, "p2", "h2")])
    assert read_glue("mnli", tmp_path, "train")[0].label == 1
    assert read_glue("mnli", tmp_path, "test_mismatched") == [GlueExample("9", "p2", "h2", None)]


@pytest.mark.parametrize(
    ("task", "header", "label", "label_id"),
    [
        ("qnli", ["index", "question", "sentence", "label"], "not_entailment", 1),
        ("rte", ["index", "sentence1", "sentence2", "label"], "entailment", 0),
        ("wnli", ["index", "sentence1", "sentence2", "label"], "1", 1),
    ],
)
def test_index_text_text_label_tasks(tmp_path, task, header, label, label_id):
    write_tsv(tmp_path / "dev.tsv", [header, ["0", "first text", "second text", label]])
    assert read_glue(task, tmp_path, "dev") == [GlueExample("dev-0", "first text", "second text", label_id)]


def test_quotes_are_ordinary_characters(tmp_path):
    # GLUE files are unquoted: a field may start with a quote and hold an unbalanced one
    write_tsv(
        tmp_path / "dev.tsv",
        [["index", "sentence1", "sentence2", "label"], ["0", '"Yes, he said.', 'a "b', "entailment"]],
    )
    (example,) = read_glue("rte", tmp_path, "dev")
    assert (example.text_a, example.text_b) == ('"Yes, he said.', 'a "b')


def test_wrong_column_count_names_file_line_and_expected_columns(tmp_path):
    write_tsv(
        tmp_path / "train.tsv",
        [["index", "sentence1", "sentence2", "label"], ["0", "a", "b", "entailment"], ["1", "a b", "entailment"]],
    )
    with pytest.raises(DataFormatError, match=r"train\.tsv: line 3: expected 4 tab-separated columns .*found 3"):
        read_glue("rte", tmp_path, "train")


def test_unknown_label_names_file_line_and_label_set(tmp_path):
    write_tsv(tmp_path / "dev.tsv", [["sentence", "label"], ["good", "1"], ["bad", "negative"]])
    with pytest.raises(DataFormatError, match=r"dev\.tsv: line 3: expected a label in \['0', '1'\], found 'negative'"):
        read_glue("sst2", tmp_path, "dev")


def test_missing_header_column_is_reported(tmp_path):
    write_tsv(tmp_path / "dev.tsv", [["text", "label"], ["good", "1"]])
    with pytest.raises(DataFormatError, match=r"line 1: expected a header with a 'sentence' column"):
        read_glue("sst2", tmp_path, "dev")


def test_unknown_split_lists_available_splits(tmp_path):
    with pytest.raises(ValueError, match=r"no split 'dev'; expected one of \['dev_matched'"):
        read_glue("mnli", tmp_path, "dev")


def test_missing_file_names_the_paths_tried(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"RTE/dev\.tsv"):
        read_glue("rte", tmp_path, "dev")


def test_task_table_marks_stsb_as_regression_and_mnli_as_three_way():
    assert glue_task("STS-B").is_regression and glue_task("stsb").num_labels == 1
    assert glue_task("mnli-mm").labels == ("contradiction", "entailment", "neutral")
    assert glue_task("cola").metric == "mcc" and glue_task("qqp").metric == "acc_and_f1"


# ----------------------------------------------------------------------------- Pang & Lee polarity (gensim)


def write_polarity(path: Path) -> Path:
    # gensim's pang_lee_polarity.cor: fastText labels, lower-cased tokenized text with a trailing space,
    # cp1252 bytes (0x97 is an em dash, 0xe9 an é)
    lines = [
        b"__label__neg simplistic , silly and tedious . ",
        b"__label__neg the action clich\xe9s just pile up . ",
        b"__label__pos  . . . a roller-coaster ride of a movie",
        b"__label__pos a few potential hits \x97 but the whole is fun . ",
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_read_polarity_maps_labels_and_strips_text(tmp_path):
    examples = read_polarity(write_polarity(tmp_path / "pang_lee_polarity.cor"))
    assert [e.label for e in examples] == [0, 0, 1, 1]
    assert examples[0] == GlueExample("polarity-0", "simplistic , silly and tedious .", None, 0)
    assert examples[2].text_a == ". . . a roller-coaster ride of a movie"


def test_read_polarity_decodes_cp1252_bytes(tmp_path):
    examples = read_polarity(write_polarity(tmp_path / "p.cor"))
    assert examples[1].text_a == "the action clichés just pile up ."
    assert "\u2014" in examples[3].text_a


def test_read_polarity_rejects_unlabelled_line(tmp_path):
    path = tmp_path / "p.cor"
    path.write_text("__label__pos good .\nno label here\n")
    with pytest.raises(DataFormatError, match=r"p\.cor: line 2: expected the line to start with __label__neg"):
        read_polarity(path)


# ----------------------------------------------------------------------------- submission files


def test_write_glue_predictions_uses_label_names(tmp_path):
    path = write_glue_predictions("rte", [1, 0, 1], tmp_path / "RTE.tsv")
    assert path.read_text() == "index\tprediction\n0\tnot_entailment\n1\tentailment\n2\tnot_entailment\n"


def test_write_glue_predictions_writes_stsb_scores_and_given_indices(tmp_path):
    path = write_glue_predictions("stsb", [4.12345, 0.5], tmp_path / "STS-B.tsv", indices=["10", "11"])
    assert path.read_text().splitlines() == ["index\tprediction", "10\t4.123", "11\t0.500"]


def test_write_glue_predictions_rejects_out_of_range_label_id(tmp_path):
    with pytest.raises(ValueError, match=r"predictions\[1\] = 3 is not a label id of mnli"):
        write_glue_predictions("mnli", [0, 3], tmp_path / "MNLI-m.tsv")


def test_test_split_guids_round_trip_into_submission(tmp_path):
    write_tsv(tmp_path / "test.tsv", [["index", "sentence"], ["0", "a"], ["1", "b"]])
    examples = read_glue("sst2", tmp_path, "test")
    path = write_glue_predictions("sst2", [1, 0], tmp_path / "SST-2.tsv", indices=[e.guid for e in examples])
    assert path.read_text().splitlines()[1:] == ["0\t1", "1\t0"]
