"""SQuAD reading, windowed features and span decoding.

Real data: tests/fixtures/squad_v1_allennlp.json (5 real SQuAD v1.1 questions, see tests/fixtures/README.md) with a
SentencePiece model trained here on that text; hand-checkable cases use a whitespace/punctuation tokenizer.
"""

import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from albert_core.evaluation.metrics import squad_scores
from albert_core.finetune.tasks import DataFormatError
from albert_core.finetune.tasks.squad import (
    SquadExample,
    decode_predictions,
    make_features,
    read_squad,
    whitespace_words,
    write_squad_predictions,
)

FIXTURE = Path(__file__).parent / "fixtures" / "squad_v1_allennlp.json"
PAD, CLS, SEP = 0, 2, 3
IDS = {"cls_id": CLS, "sep_id": SEP, "pad_id": PAD}


class PieceTokenizer:
    """Words split into runs of letters/digits and single punctuation marks; the first piece carries "▁"."""

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.pieces: list[str] = []

    def _id(self, piece: str) -> int:
        if piece not in self.vocab:
            self.vocab[piece] = len(self.pieces) + 10
            self.pieces.append(piece)
        return self.vocab[piece]

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            parts = re.findall(r"\w+|[^\w\s]", word)
            ids += [self._id(("\u2581" if k == 0 else "") + p) for k, p in enumerate(parts)]
        return ids

    def id_to_piece(self, i: int) -> str:
        return self.pieces[i - 10]


def example(context: str, answer: str | None, question: str = "q", qid: str = "x") -> SquadExample:
    if answer is None:
        return SquadExample(qid, question, context, [], [], is_impossible=True)
    return SquadExample(qid, question, context, [answer], [context.index(answer)])


@pytest.fixture(scope="module")
def sentencepiece_model() -> spm.SentencePieceProcessor:
    document = json.loads(FIXTURE.read_text())
    texts = []
    for paragraph in document["data"][0]["paragraphs"]:
        texts += paragraph["context"].split(". ") + [qa["question"] for qa in paragraph["qas"]]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        vocab_size=150,
        model_type="unigram",
        pad_id=PAD,
        unk_id=1,
        bos_id=-1,
        eos_id=-1,
        control_symbols=["[CLS]", "[SEP]"],
        hard_vocab_limit=False,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    assert (sp.piece_to_id("[CLS]"), sp.piece_to_id("[SEP]")) == (CLS, SEP)
    return sp


def gold_logits(examples, features, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits 10 at the tokens where each window shows the first gold answer start / end (0 elsewhere)."""
    starts, ends = np.zeros((len(features), seq_len)), np.zeros((len(features), seq_len))
    for i, f in enumerate(features):
        ex = examples[f.example_index]
        answer_start = ex.answer_starts[0]
        answer_end = answer_start + len(ex.answers[0])
        for t, (a, b) in enumerate(f.token_char_spans):
            if a <= answer_start < b:
                starts[i, f.context_offset + t] = 10.0
            if a < answer_end <= b:
                ends[i, f.context_offset + t] = 10.0
    return starts, ends


# ----------------------------------------------------------------------------- reading


def test_read_squad_v1_reads_every_question_of_the_real_fixture():
    examples = read_squad(FIXTURE)
    assert [e.qid for e in examples] == [
        "5733be284776f41900661182",
        "5733be284776f4190066117e",
        "5733b1da4776f41900661068",
        "5733b1da4776f4190066106b",
        "5733b1da4776f41900661067",
    ]
    assert examples[0].answers == ["Saint Bernadette Soubirous"] and examples[0].answer_starts == [515]
    assert len(examples[1].answers) == 3 and not any(e.is_impossible for e in examples)
    for e in examples:
        for text, start in zip(e.answers, e.answer_starts, strict=True):
            assert e.context[start : start + len(text)] == text


def test_whitespace_words_map_characters_to_words_as_the_original():
    # "  ab\tc\u202fd " : chars 0,1 precede any word (-1); "ab" = word 0 (2-4); tab -> word 0; "c" word 1; U+202F
    # -> word 1; "d" word 2; trailing space -> word 2
    words, char_to_word, spans = whitespace_words("  ab\tc\u202fd ")
    assert words == ["ab", "c", "d"]
    assert char_to_word == [-1, -1, 0, 0, 0, 1, 1, 2, 2]
    assert spans == [(2, 4), (5, 6), (7, 8)]


def write_v2(tmp_path: Path, qas: list[dict], context: str = "Paris is the capital of France.") -> Path:
    path = tmp_path / "dev-v2.0.json"
    data = {"version": "v2.0", "data": [{"title": "France", "paragraphs": [{"context": context, "qas": qas}]}]}
    path.write_text(json.dumps(data))
    return path


def test_read_squad_v2_marks_unanswerable_questions_with_plausible_answers(tmp_path):
    path = write_v2(
        tmp_path,
        [
            {
                "question": "Capital?",
                "id": "a1",
                "answers": [{"text": "Paris", "answer_start": 0}],
                "is_impossible": False,
            },
            {
                "plausible_answers": [{"text": "France", "answer_start": 24}],
                "question": "Capital of Spain?",
                "id": "a2",
                "answers": [],
                "is_impossible": True,
            },
        ],
    )
    answerable, unanswerable = read_squad(path)
    assert (answerable.answers, answerable.is_impossible, answerable.title) == (["Paris"], False, "France")
    assert (unanswerable.answers, unanswerable.is_impossible) == ([], True)
    assert unanswerable.plausible_answers == ["France"]


def test_read_squad_names_the_question_missing_a_field(tmp_path):
    path = write_v2(tmp_path, [{"id": "a1", "answers": [{"text": "Paris", "answer_start": 0}]}])
    where = r"dev-v2\.0\.json: data\[0\]\.paragraphs\[0\]\.qas\[0\] \(id a1\)"
    with pytest.raises(DataFormatError, match=where + ": expected a 'question' field"):
        read_squad(path)


def test_read_squad_rejects_answer_outside_the_context(tmp_path):
    path = write_v2(tmp_path, [{"id": "a1", "question": "?", "answers": [{"text": "France.", "answer_start": 40}]}])
    with pytest.raises(DataFormatError, match=r"answers\[0\]: expected a non-empty answer inside the context"):
        read_squad(path)


def test_read_squad_rejects_answerable_question_without_answers(tmp_path):
    path = write_v2(tmp_path, [{"id": "a1", "question": "?", "answers": []}])
    with pytest.raises(DataFormatError, match=r"expected at least one answer \(or is_impossible: true\)"):
        read_squad(path)


# ----------------------------------------------------------------------------- features


def test_feature_layout_is_cls_question_sep_context_sep_then_padding():
    tok = PieceTokenizer()
    ex = example("Paris is big", "big", question="Where now")
    (f,) = make_features([ex], tok.encode, **IDS, max_seq_length=10)
    where, now, paris, is_, big = (tok.vocab[p] for p in ["▁Where", "▁now", "▁Paris", "▁is", "▁big"])
    assert f.input_ids == [CLS, where, now, SEP, paris, is_, big, SEP, PAD, PAD]
    assert f.token_type_ids == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]
    assert f.attention_mask == [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]
    # context starts after [CLS] + 2 question tokens + [SEP]; "big" is context token 2 -> position 6
    assert (f.context_offset, f.start_position, f.end_position) == (4, 6, 6)
    assert f.token_to_word == [0, 1, 2] and f.token_is_max_context == [True, True, True]


def test_question_is_truncated_to_max_query_length():
    tok = PieceTokenizer()
    (f,) = make_features(
        [example("a b", "b", question="one two three")],
        tok.encode,
        cls_id=CLS,
        sep_id=SEP,
        pad_id=PAD,
        max_seq_length=8,
        max_query_length=2,
    )
    assert f.input_ids[:4] == [CLS, tok.vocab["▁one"], tok.vocab["▁two"], SEP]


# 20 one-token words; question 1 token -> context offset 3; max_seq_length 12 -> 12 - 1 - 3 = 8 context tokens per
# window; stride 4 -> windows start at 0, 4, 8, 12 (12 + 8 = 20 ends the loop)
WORDS = " ".join(f"w{i}" for i in range(20))


def stride_features(answer: str | None):
    return make_features([example(WORDS, answer)], PieceTokenizer().encode, **IDS, max_seq_length=12, doc_stride=4)


def test_windows_slide_by_doc_stride_until_the_context_is_covered():
    features = stride_features("w9 w10")
    assert [f.token_to_word for f in features] == [list(range(s, s + 8)) for s in (0, 4, 8, 12)]
    assert [f.window_index for f in features] == [0, 1, 2, 3]


def test_max_context_window_maximizes_min_side_context():
    features = stride_features("w9 w10")
    # token 6: window 0 (0-7) min(6,1)+.08 = 1.08, window 1 (4-11) min(2,5)+.08 = 2.08 -> window 1
    # token 5: window 0 min(5,2) = 2 beats window 1 min(1,6) = 1 -> window 0
    # token 10: window 1 min(6,1) = 1, window 2 (8-15) min(2,5) = 2 -> window 2
    assert features[1].token_is_max_context[6 - 4] and not features[0].token_is_max_context[6]
    assert features[0].token_is_max_context[5] and not features[1].token_is_max_context[5 - 4]
    assert features[2].token_is_max_context[10 - 8] and not features[1].token_is_max_context[10 - 4]


def test_answer_positions_are_set_only_in_windows_holding_the_whole_answer():
    # "w6 .. w9" (tokens 6-9): only window 1 (4-11) holds all four -> 6-4+3 = 5 .. 9-4+3 = 8; others 0/0
    features = stride_features("w6 w7 w8 w9")
    assert [(f.start_position, f.end_position) for f in features] == [(0, 0), (5, 8), (0, 0), (0, 0)]


def test_unanswerable_question_points_every_window_at_cls():
    assert {(f.start_position, f.end_position) for f in stride_features(None)} == {(0, 0)}


def test_answer_inside_a_word_is_narrowed_to_its_pieces():
    tok = PieceTokenizer()
    ctx = "built in (1895), by him"
    ex = SquadExample("x", "when", ctx, ["1895"], [ctx.index("1895")])
    (f,) = make_features([ex], tok.encode, **IDS, id_to_piece=tok.id_to_piece, max_seq_length=20)
    # context tokens: ▁built ▁in ▁( 1895 ) , ▁by ▁him -> "1895" is context token 3 -> position 3 + offset 3
    assert (f.start_position, f.end_position) == (6, 6)
    assert f.token_char_spans[3] == (10, 14) and ctx[10:14] == "1895"


def test_without_piece_strings_tokens_cover_their_whole_word():
    # "▁1895" (the answer encoded alone) never equals the context's "1895" piece, and without id_to_piece the
    # tokens of "(1895)," all span the whole word: the answer becomes that word, as in the original
    tok = PieceTokenizer()
    ctx = "built in (1895), by him"
    ex = SquadExample("x", "when", ctx, ["1895"], [ctx.index("1895")])
    (f,) = make_features([ex], tok.encode, **IDS, max_seq_length=20)
    assert f.token_char_spans[2:6] == [(9, 16)] * 4 and ctx[9:16] == "(1895),"
    assert (f.start_position, f.end_position) == (3 + 2, 3 + 5)


def test_training_skips_examples_whose_answer_is_not_at_its_offset(caplog):
    tok = PieceTokenizer()
    wrong = SquadExample("x", "q", "alpha beta gamma", ["delta"], [0])
    right = example("alpha beta gamma", "beta", qid="y")
    features = make_features([wrong, right], tok.encode, **IDS, max_seq_length=16, is_training=True)
    assert [f.qid for f in features] == ["y"] and "skipped 1 training example" in caplog.text
    evaluation = make_features([wrong, right], tok.encode, **IDS, max_seq_length=16)
    assert [f.qid for f in evaluation] == ["x", "y"]


def test_sentencepiece_features_hold_the_gold_answer_on_the_real_fixture(sentencepiece_model):
    sp = sentencepiece_model
    examples = read_squad(FIXTURE)
    features = make_features(examples, sp.encode, **IDS, id_to_piece=sp.id_to_piece)
    assert {f.example_index for f in features} == set(range(5))
    assert max(f.window_index for f in features) >= 1  # ~380-piece contexts need two 384-token windows
    assert all(len(f.input_ids) == len(f.token_type_ids) == len(f.attention_mask) == 384 for f in features)
    for ex_index, ex in enumerate(examples):
        spans = [
            ex.context[
                f.token_char_spans[f.start_position - f.context_offset][0] : f.token_char_spans[
                    f.end_position - f.context_offset
                ][1]
            ]
            for f in features
            if f.example_index == ex_index and f.start_position > 0
        ]
        assert spans and all(ex.answers[0] in s for s in spans)


# ----------------------------------------------------------------------------- decoding


def test_decoding_gold_logits_recovers_the_gold_answers_on_the_real_fixture(sentencepiece_model):
    sp = sentencepiece_model
    examples = read_squad(FIXTURE)
    for max_seq_length, stride in ((384, 128), (128, 32)):
        window = {"max_seq_length": max_seq_length, "doc_stride": stride, "max_query_length": 24}
        features = make_features(examples, sp.encode, **IDS, id_to_piece=sp.id_to_piece, **window)
        predictions, null_odds = decode_predictions(
            examples, features, *gold_logits(examples, features, max_seq_length), version_2=False
        )
        assert null_odds == {}
        # every gold answer comes back character for character, even "Father Julius Nieuwl", which the dataset
        # cut inside the word "Nieuwland" (this tiny model spells that word letter by letter)
        assert predictions == {e.qid: e.answers[0] for e in examples}
        assert squad_scores([e.answers for e in examples], [predictions[e.qid] for e in examples])["exact"] == 100.0


def test_decoding_only_starts_spans_at_max_context_tokens():
    examples = [example(WORDS, "w9 w10")]
    features = stride_features("w9 w10")
    starts, ends = np.full((4, 12), -10.0), np.full((4, 12), -10.0)
    # window 1 (4-11): w9..w10 = positions 8..9, score 2 ; token 9's max-context window is window 1
    starts[1, 8], ends[1, 9] = 1.0, 1.0
    # window 2 (8-15): w9..w11 = positions 4..6 scores 10 but starts at token 9, not max context there
    starts[2, 4], ends[2, 6] = 5.0, 5.0
    predictions, _ = decode_predictions(examples, features, starts, ends, version_2=False)
    assert predictions == {"x": "w9 w10"}


def test_decoding_skips_reversed_question_and_too_long_spans():
    tok = PieceTokenizer()
    examples = [example("a b c d e", "d", question="who")]
    (f,) = make_features(examples, tok.encode, **IDS, max_seq_length=12)
    # positions: 0 [CLS], 1 who, 2 [SEP], 3..7 = a b c d e ; baseline -10
    starts, ends = np.full((1, 12), -10.0), np.full((1, 12), -10.0)
    starts[0, 1], ends[0, 1] = 9.0, 9.0  # who .. who: in the question, invalid
    starts[0, 7], ends[0, 6] = 8.0, 8.0  # e .. d: reversed, invalid
    starts[0, 3] = 7.0  # a .. d: 4 tokens, longer than max_answer_length 2, invalid
    starts[0, 4], ends[0, 5] = 5.0, 5.0  # b .. c: 10, the best valid span (next: e..e, d..d, c..d at -2)
    predictions, _ = decode_predictions(examples, [f], starts, ends, version_2=False, max_answer_length=2)
    assert predictions == {"x": "b c"}


def v2_case(null: float, span: float):
    tok = PieceTokenizer()
    examples = [example("the red car", "red car")]
    (f,) = make_features(examples, tok.encode, **IDS, max_seq_length=8)
    starts, ends = np.zeros((1, 8)), np.zeros((1, 8))
    starts[0, 0] = ends[0, 0] = null / 2  # null score = starts[0] + ends[0]
    starts[0, 4], ends[0, 5] = span / 2, span / 2  # positions 3..5 = the red car -> span "red car"
    return examples, [f], starts, ends


def test_v2_predicts_empty_when_null_odds_exceed_threshold():
    # null 6, best span 4 -> odds 6 - 4 = 2 > 0 -> ""
    predictions, odds = decode_predictions(*v2_case(null=6.0, span=4.0), version_2=True)
    assert predictions == {"x": ""} and odds["x"] == pytest.approx(2.0)


def test_v2_predicts_the_span_when_null_odds_are_below_threshold():
    # odds 2 <= threshold 2.5 -> span kept
    predictions, odds = decode_predictions(*v2_case(null=6.0, span=4.0), version_2=True, null_threshold=2.5)
    assert predictions == {"x": "red car"} and odds["x"] == pytest.approx(2.0)


def test_v2_null_score_is_the_smallest_over_windows():
    examples = [example(WORDS, None)]
    features = stride_features(None)
    starts, ends = np.zeros((4, 12)), np.zeros((4, 12))
    starts[:, 0] = [3.0, 1.0, 4.0, 2.0]  # null scores per window: 3, 1, 4, 2 -> min 1
    starts[0, 3], ends[0, 3] = 0.25, 0.25  # best span (w0) scores 0.5
    _, odds = decode_predictions(examples, features, starts, ends, version_2=True)
    assert odds["x"] == pytest.approx(1.0 - 0.5)


def test_v2_without_any_valid_span_predicts_empty_with_infinite_odds():
    tok = PieceTokenizer()
    examples = [example("", None)]
    features = make_features(examples, tok.encode, **IDS, max_seq_length=8)
    predictions, odds = decode_predictions(examples, features, np.zeros((1, 8)), np.zeros((1, 8)), version_2=True)
    assert predictions == {"x": ""} and math.isinf(odds["x"])


def test_write_squad_predictions_writes_the_official_json(tmp_path):
    path = write_squad_predictions(
        {"5733be284776f41900661182": "Saint Bernadette Soubirous", "q2": ""}, tmp_path / "p.json"
    )
    assert json.loads(path.read_text()) == {"5733be284776f41900661182": "Saint Bernadette Soubirous", "q2": ""}
