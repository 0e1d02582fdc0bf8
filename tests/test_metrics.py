"""Metrics against hand-computed cases (the spec); SciPy / scikit-learn only as a cross-check."""

import math

import numpy as np
import pytest

from albert_core.evaluation import metrics as M

# ----------------------------------------------------------------------------- GLUE


def test_accuracy_is_fraction_of_equal_pairs():
    # positions 0 and 2 agree out of 4 -> 0.5
    assert M.accuracy([1, 0, 1, 1], [1, 1, 1, 0]) == 0.5


def test_accuracy_rejects_length_mismatch():
    with pytest.raises(ValueError, match="differ in length"):
        M.accuracy([1, 0], [1])


def test_f1_binary_hand_case():
    # preds [1,1,0,0,1] labels [1,0,1,0,1]: tp=2 (0,4), fp=1 (1), fn=1 (2) -> 2*2/(4+1+1) = 2/3
    assert M.f1_binary([1, 1, 0, 0, 1], [1, 0, 1, 0, 1]) == pytest.approx(2 / 3)


def test_f1_binary_is_zero_without_any_positive():
    # tp = fp = fn = 0: denominator 0 -> 0 (scikit-learn's zero_division default)
    assert M.f1_binary([0, 0, 0], [0, 0, 0]) == 0.0


def test_f1_binary_rejects_non_binary_labels():
    with pytest.raises(ValueError, match="binary"):
        M.f1_binary([0, 1, 2], [0, 1, 1])


def test_mcc_hand_case():
    # tp=2 fp=1 fn=1 tn=1: (2*1 - 1*1) / sqrt((2+1)(2+1)(1+1)(1+1)) = 1/6
    assert M.matthews_corrcoef([1, 1, 0, 0, 1], [1, 0, 1, 0, 1]) == pytest.approx(1 / 6)


def test_mcc_is_minus_one_for_inverted_predictions():
    # tp=tn=0, fp=fn=2: (0 - 4) / sqrt(2*2*2*2) = -1
    assert M.matthews_corrcoef([1, 0, 1, 0], [0, 1, 0, 1]) == pytest.approx(-1.0)


def test_mcc_is_zero_when_all_labels_are_one_class():
    # tp=2 fp=0 fn=1 tn=0: tn+fp = 0 (no label 0) -> a zero factor in the denominator -> 0
    # (multi-class form: t = [0, 3], s = 3 -> s^2 - t.t = 0)
    assert M.matthews_corrcoef([1, 0, 1], [1, 1, 1]) == 0.0


def test_mcc_is_zero_when_all_predictions_are_one_class():
    # constant predictions (the majority-class baseline) -> tp+fp = 0 -> 0
    assert M.matthews_corrcoef([0, 0, 0, 0], [1, 0, 1, 0]) == 0.0


def test_mcc_multiclass_hand_case():
    # labels [0,1,2,0,1,2] preds [0,1,2,0,2,1]: c = 4 correct, s = 6, t = p = [2,2,2] -> t.p = p.p = t.t = 12
    # (4*6 - 12) / sqrt((36 - 12) * (36 - 12)) = 12 / 24 = 0.5
    assert M.matthews_corrcoef([0, 1, 2, 0, 2, 1], [0, 1, 2, 0, 1, 2]) == pytest.approx(0.5)


def test_pearson_hand_case():
    # x=[1,2,3] y=[2,4,7]: dx=[-1,0,1], dy=[-7/3,-1/3,8/3]; sum dx*dy = 5, sum dx^2 = 2, sum dy^2 = 114/9
    # r = 5 / sqrt(2 * 114/9) = 15 / sqrt(228)
    assert M.pearson([1, 2, 3], [2, 4, 7]) == pytest.approx(15 / math.sqrt(228))


def test_pearson_of_constant_input_is_nan():
    assert math.isnan(M.pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))


def test_average_ranks_share_the_mean_rank_on_ties():
    # [10,20,20,30]: the two 20s span ranks 2 and 3 -> 2.5 each
    assert M.average_ranks([10, 20, 20, 30]).tolist() == [1.0, 2.5, 2.5, 4.0]
    # [3,1,3,3]: 1 is rank 1; the three 3s span ranks 2,3,4 -> 3
    assert M.average_ranks([3, 1, 3, 3]).tolist() == [3.0, 1.0, 3.0, 3.0]


def test_spearman_with_ties_uses_average_ranks():
    # ranks x=[1,2.5,2.5,4], y=[1,3,2,4]; both means 2.5; dx=[-1.5,0,0,1.5], dy=[-1.5,.5,-.5,1.5]
    # sum dx*dy = 4.5, sum dx^2 = 4.5, sum dy^2 = 5 -> rho = 4.5 / sqrt(22.5) = sqrt(0.9)
    assert M.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(math.sqrt(0.9))


def test_spearman_is_one_for_any_increasing_relation():
    x = [0.1, 0.5, 2.0, 9.0]
    assert M.spearman(x, np.exp(x)) == pytest.approx(1.0)


def test_glue_metrics_keys_per_task():
    binary = ([1, 0, 1, 1], [1, 0, 0, 1])
    assert set(M.glue_metrics("cola", *binary)) == {"mcc"}
    for task in ("sst2", "SST-2", "qnli", "rte", "wnli", "mnli-m", "mnli-mm"):
        assert set(M.glue_metrics(task, *binary)) == {"acc"}
    assert set(M.glue_metrics("stsb", [1.0, 2.0, 3.5], [1.5, 2.0, 3.0])) == {"pearson", "spearman", "corr"}


def test_glue_metrics_mrpc_reports_mean_of_acc_and_f1():
    # preds [1,1,0,0,1] labels [1,0,1,0,1]: acc = 3/5, f1 = 2/3 -> mean = (0.6 + 2/3) / 2
    result = M.glue_metrics("mrpc", [1, 1, 0, 0, 1], [1, 0, 1, 0, 1])
    assert result["acc"] == pytest.approx(0.6)
    assert result["f1"] == pytest.approx(2 / 3)
    assert result["acc_and_f1"] == pytest.approx((0.6 + 2 / 3) / 2)


def test_glue_metrics_stsb_corr_is_mean_of_pearson_and_spearman():
    # pearson 15/sqrt(228) (hand case above); ranks of both are [1,2,3] -> spearman 1
    result = M.glue_metrics("sts-b", [1, 2, 3], [2, 4, 7])
    assert result["corr"] == pytest.approx((15 / math.sqrt(228) + 1.0) / 2)


def test_glue_metrics_rejects_unknown_task():
    with pytest.raises(ValueError, match="unknown GLUE task 'imdb'"):
        M.glue_metrics("imdb", [1], [1])


def test_glue_metrics_agree_with_scipy_and_sklearn():
    from scipy import stats
    from sklearn import metrics as sklearn_metrics

    rng = np.random.default_rng(0)
    preds, labels = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
    assert M.matthews_corrcoef(preds, labels) == pytest.approx(sklearn_metrics.matthews_corrcoef(labels, preds))
    three_way_preds, three_way_labels = rng.integers(0, 3, 200), rng.integers(0, 3, 200)
    assert M.matthews_corrcoef(three_way_preds, three_way_labels) == pytest.approx(
        sklearn_metrics.matthews_corrcoef(three_way_labels, three_way_preds)
    )
    assert M.f1_binary(preds, labels) == pytest.approx(sklearn_metrics.f1_score(labels, preds))
    x = rng.integers(0, 6, 300).astype(float)  # many ties
    y = x + rng.normal(0, 2, 300)
    assert M.pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0])
    assert M.spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0])


# ----------------------------------------------------------------------------- SQuAD


def test_normalize_answer_lowercases_strips_punctuation_articles_and_spaces():
    # lower -> "the  quick, brown fox!" ; punct -> "the  quick brown fox" ; articles -> "  quick brown fox"
    assert M.normalize_answer("The  Quick, Brown fox!") == "quick brown fox"


def test_normalize_answer_removes_articles_only_as_whole_words():
    # "theater", "another", "and" contain a/an/the but are not articles
    assert M.normalize_answer("A theater and another") == "theater and another"


def test_normalize_answer_removes_punctuation_before_articles():
    # "an-ode" -> "anode" (hyphen dropped first, so no article is left); "the." -> "the" -> removed
    assert M.normalize_answer("an-ode to the.") == "anode to"


def test_normalize_answer_keeps_non_ascii_punctuation():
    # only string.punctuation is removed: curly quotes stay, and "the" after "“" is still a whole word
    assert M.normalize_answer("“The End”") == "“ end”"


def test_token_f1_hand_case():
    # pred tokens [cat, sat, on, mat] (4), gold [cat, on, mat] (3), common 3 -> P=3/4 R=1 F1=6/7
    assert M.token_f1("the cat sat on a mat", "a cat on the mat") == pytest.approx(6 / 7)


def test_token_f1_counts_repeated_tokens_by_multiplicity():
    # pred [x,x,y], gold [x,y,y]: common = min counts = x:1 + y:1 = 2 -> P=R=2/3 -> F1 = 2/3
    assert M.token_f1("x x y", "x y y") == pytest.approx(2 / 3)


def test_squad_scores_take_max_over_gold_answers():
    # q1: "broncos" matches gold 2 exactly -> EM 1, F1 1
    # q2: pred [in, 1882] vs gold [1882]: P=1/2 R=1 F1=2/3, EM 0
    # exact = 100 * (1+0)/2 = 50 ; f1 = 100 * (1 + 2/3)/2 = 83.33
    result = M.squad_scores([["Denver Broncos", "Broncos"], ["1882"]], ["broncos", "in 1882"])
    assert result["exact"] == pytest.approx(50.0)
    assert result["f1"] == pytest.approx(100 * (1 + 2 / 3) / 2)


def test_unanswerable_question_scores_only_an_empty_prediction():
    # gold [] and [""] both mean unanswerable: "" scores 1/1, anything else 0/0
    assert M.squad_scores([[], [""]], ["", ""]) == {"exact": 100.0, "f1": 100.0}
    assert M.squad_scores([[], [""]], ["x", "the answer"]) == {"exact": 0.0, "f1": 0.0}


def test_gold_answer_normalizing_to_empty_counts_as_unanswerable():
    # "The" normalizes to "" and is dropped, leaving [""] (official v2.0 behaviour)
    assert M.squad_scores([["The"]], [""]) == {"exact": 100.0, "f1": 100.0}


def test_squad_scores_reject_a_bare_string_as_gold_list():
    with pytest.raises(ValueError, match=r"gold_answers\[0\] must be a list"):
        M.squad_scores(["Broncos"], ["Broncos"])


def test_squad_v2_scores_split_has_answer_and_no_answer():
    # q0 has-ans right (1/1), q1 has-ans partial: pred [red,car] gold [car] P=1/2 R=1 F1=2/3, EM 0
    # q2 no-ans predicted "" (1/1), q3 no-ans predicted "blue" (0/0)
    gold = [["car"], ["car"], [], [""]]
    preds = ["the car", "red car", "", "blue"]
    result = M.squad_v2_scores(gold, preds)
    assert result["total"] == 4
    assert result["exact"] == pytest.approx(100 * 2 / 4)
    assert result["f1"] == pytest.approx(100 * (1 + 2 / 3 + 1 + 0) / 4)
    assert result["HasAns_exact"] == pytest.approx(50.0)
    assert result["HasAns_f1"] == pytest.approx(100 * (1 + 2 / 3) / 2)
    assert result["NoAns_exact"] == pytest.approx(50.0) and result["NoAns_f1"] == pytest.approx(50.0)
    assert (result["HasAns_total"], result["NoAns_total"]) == (2, 2)


def test_squad_v2_scores_omit_no_answer_keys_without_unanswerable_questions():
    result = M.squad_v2_scores([["car"]], ["car"])
    assert "NoAns_exact" not in result and result["HasAns_total"] == 1


# q0 has-ans, right, odds -2 ; q1 no-ans, pred "foo", odds 1 ; q2 has-ans, wrong, odds 3 ; q3 no-ans, "bar", odds -1
_THRESH_GOLD = [["paris"], [], ["london"], []]
_THRESH_PREDS = ["Paris", "foo", "rome", "bar"]
_THRESH_ODDS = [-2.0, 1.0, 3.0, -1.0]


def test_best_null_threshold_hand_case():
    # start: all predicted "" -> right on the 2 unanswerable = 2 (thresh 0.0)
    # by odds: q0 (-2) +1 -> 3 (best, thresh -2); q3 (-1) -1 -> 2; q1 (1) -1 -> 1; q2 (3) +0 -> 1
    # best exact = 100 * 3/4 = 75 at threshold -2 ; F1 is identical here (scores are 0/1)
    result = M.best_null_threshold(_THRESH_GOLD, _THRESH_PREDS, _THRESH_ODDS)
    assert result["best_exact"] == pytest.approx(75.0) and result["best_exact_thresh"] == -2.0
    assert result["best_f1"] == pytest.approx(75.0) and result["best_f1_thresh"] == -2.0


def test_squad_v2_scores_at_best_threshold_reach_best_exact():
    # applying threshold -2: q1, q2, q3 become "" -> q1 right, q2 wrong, q3 right, q0 right -> 75
    result = M.squad_v2_scores(_THRESH_GOLD, _THRESH_PREDS, null_odds=_THRESH_ODDS, null_threshold=-2.0)
    assert result["exact"] == pytest.approx(75.0)
    assert result["best_exact"] == pytest.approx(75.0)


def test_best_null_threshold_keeps_zero_when_answering_never_helps():
    # the only answerable question is wrong, the unanswerable one is right only when "": best = 50 at 0.0
    result = M.best_null_threshold([["a dog"], []], ["cat", "cat"], [0.5, -0.5])
    assert result["best_exact"] == pytest.approx(50.0) and result["best_exact_thresh"] == 0.0


# ----------------------------------------------------------------------------- RACE


def test_race_accuracy_per_level_and_overall():
    # middle: idx 0,1 both right -> 1.0 ; high: idx 2 wrong, 3 right, 4 wrong -> 1/3 ; all 3/5
    result = M.race_accuracy([0, 1, 2, 3, 0], [0, 1, 0, 3, 1], ["middle", "middle", "high", "high", "high"])
    assert result == pytest.approx({"middle": 1.0, "high": 1 / 3, "all": 0.6})


def test_race_accuracy_is_nan_for_an_absent_level():
    result = M.race_accuracy([1], [1], ["high"])
    assert math.isnan(result["middle"]) and result["high"] == 1.0


def test_race_accuracy_rejects_unknown_level():
    with pytest.raises(ValueError, match="unknown RACE level"):
        M.race_accuracy([1], [1], ["college"])


# ----------------------------------------------------------------------------- the user's own data


def test_f1_macro_hand_case_averages_each_class_f1():
    # labels [0,0,1,2,2] preds [0,1,1,2,0]: class 0 tp1 fp1 fn1 -> 1/2; class 1 tp1 fp1 fn0 -> 2/3;
    # class 2 tp1 fp0 fn1 -> 2/3; mean (1/2 + 2/3 + 2/3) / 3 = 11/18
    assert M.f1_macro([0, 1, 1, 2, 0], [0, 0, 1, 2, 2]) == pytest.approx(11 / 18)


def test_f1_macro_counts_a_class_that_is_only_predicted():
    # class 1 never in the labels but predicted once: its F1 is 0 and it is averaged in (scikit-learn's rule)
    # class 0: tp 2, fn 1 -> 4/5; class 1: fp 1 -> 0; mean 0.4
    assert M.f1_macro([0, 0, 1], [0, 0, 0]) == pytest.approx(0.4)


def test_classification_metrics_agree_with_sklearn_on_five_classes():
    from sklearn import metrics as sklearn_metrics

    rng = np.random.default_rng(3)
    labels = rng.integers(0, 5, 300)
    preds = np.where(rng.random(300) < 0.6, labels, rng.integers(0, 5, 300))
    ours = M.classification_metrics(preds, labels)
    assert ours["acc"] == pytest.approx(sklearn_metrics.accuracy_score(labels, preds))
    assert ours["macro_f1"] == pytest.approx(sklearn_metrics.f1_score(labels, preds, average="macro"))
    assert ours["mcc"] == pytest.approx(sklearn_metrics.matthews_corrcoef(labels, preds))


def test_regression_metrics_agree_with_scipy_with_ties():
    from scipy import stats

    rng = np.random.default_rng(4)
    labels = rng.integers(0, 6, 200).astype(float)  # many ties
    preds = labels * 0.5 + rng.normal(0, 1, 200)
    ours = M.regression_metrics(preds, labels)
    assert ours["pearson"] == pytest.approx(stats.pearsonr(preds, labels)[0])
    assert ours["spearman"] == pytest.approx(stats.spearmanr(preds, labels)[0])
