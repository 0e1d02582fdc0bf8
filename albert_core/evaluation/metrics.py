"""Downstream metrics as the official scripts define them (GLUE, SQuAD v1.1/v2.0, RACE), numpy only.

GLUE values are fractions in [0, 1] (as the GLUE/BERT evaluation code returns them); SQuAD values are
percentages (as the official SQuAD evaluation scripts print them).

- GLUE: accuracy, binary F1 (positive class 1), Matthews correlation (CoLA; multi-class for AX), Pearson and
  Spearman (STS-B).
  Degenerate cases follow scikit-learn / SciPy, which the GLUE evaluation uses: MCC is 0 when a row or column of
  the confusion matrix is empty, F1 is 0 when there is neither a true nor a predicted positive, and Pearson /
  Spearman are NaN when either input is constant.
- The user's own data (task "custom"): accuracy, macro-F1 and multi-class MCC for any number of classes;
  Pearson and Spearman for regression.
- SQuAD: the official v2.0 script (`evaluate-v2.0.py`), which on answerable questions agrees with v1.1:
  answers normalized (lower case, punctuation removed, articles a/an/the removed, whitespace collapsed), exact
  match and bag-of-tokens F1, each the maximum over the gold answers. Gold answers that normalize to "" are
  dropped and a question left with none is unanswerable (gold [""]): only an empty prediction scores on it.
  (One edge differs from v1.1's script: there, a gold answer that normalizes to "" scores F1 0 against any
  prediction.)
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Sequence

import numpy as np

# ----------------------------------------------------------------------------- GLUE


def _as_1d(name: str, values) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence, got shape {array.shape}")
    return array


def _pair(predictions, labels) -> tuple[np.ndarray, np.ndarray]:
    predictions = _as_1d("predictions", predictions)
    labels = _as_1d("labels", labels)
    if len(predictions) != len(labels):
        raise ValueError(f"predictions ({len(predictions)}) and labels ({len(labels)}) differ in length")
    if len(labels) == 0:
        raise ValueError("cannot score an empty set of predictions")
    return predictions, labels


def accuracy(predictions, labels) -> float:
    predictions, labels = _pair(predictions, labels)
    return float(np.mean(predictions == labels))


def _binary_counts(predictions, labels) -> tuple[int, int, int, int]:
    """(tp, fp, fn, tn) with class 1 positive; both inputs must hold only 0 and 1."""
    predictions, labels = _pair(predictions, labels)
    for name, values in (("predictions", predictions), ("labels", labels)):
        bad = set(np.unique(values).tolist()) - {0, 1}
        if bad:
            raise ValueError(f"{name} must be binary (0/1), found {sorted(bad)!r}")
    p, y = predictions == 1, labels == 1
    return int(np.sum(p & y)), int(np.sum(p & ~y)), int(np.sum(~p & y)), int(np.sum(~p & ~y))


def f1_binary(predictions, labels) -> float:
    """F1 of the positive class (1): 2·tp / (2·tp + fp + fn), 0 when that denominator is 0."""
    tp, fp, fn, _ = _binary_counts(predictions, labels)
    denominator = 2 * tp + fp + fn
    return 2 * tp / denominator if denominator else 0.0


def matthews_corrcoef(predictions, labels) -> float:
    """Matthews correlation, the multi-class form (Gorodkin's R_K, as scikit-learn computes it):
    (c·s − t·p) / √((s² − p·p)(s² − t·t)) with c correct, s total, t / p the per-class label / prediction counts.
    Binary: (tp·tn − fp·fn) / √((tp+fp)(tp+fn)(tn+fp)(tn+fn)). 0 when the denominator is 0 (e.g. one class only).
    """
    predictions, labels = _pair(predictions, labels)
    classes, indices = np.unique(np.concatenate([labels, predictions]), return_inverse=True)
    true_counts = np.bincount(indices[: len(labels)], minlength=len(classes)).astype(np.float64)
    pred_counts = np.bincount(indices[len(labels) :], minlength=len(classes)).astype(np.float64)
    correct, total = float(np.sum(predictions == labels)), float(len(labels))
    denominator = (total**2 - pred_counts @ pred_counts) * (total**2 - true_counts @ true_counts)
    if denominator == 0:
        return 0.0
    return float((correct * total - true_counts @ pred_counts) / np.sqrt(denominator))


def pearson(x, y) -> float:
    x, y = _pair(x, y)
    x = x.astype(np.float64) - np.mean(x, dtype=np.float64)
    y = y.astype(np.float64) - np.mean(y, dtype=np.float64)
    norm = np.sqrt(np.sum(x * x)) * np.sqrt(np.sum(y * y))
    if norm == 0:
        return float("nan")
    return float(np.clip(np.sum(x * y) / norm, -1.0, 1.0))


def average_ranks(values) -> np.ndarray:
    """1-based ranks; tied values share the mean of the ranks they span ([10, 20, 20, 30] → [1, 2.5, 2.5, 4])."""
    values = _as_1d("values", values)
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    ranks = np.empty(len(values), dtype=np.float64)
    start = 0
    while start < len(values):
        end = start + 1
        while end < len(values) and sorted_values[end] == sorted_values[start]:
            end += 1
        ranks[order[start:end]] = (start + 1 + end) / 2  # mean of ranks start+1 .. end
        start = end
    return ranks


def spearman(x, y) -> float:
    """Pearson correlation of the average ranks (SciPy's spearmanr)."""
    x, y = _pair(x, y)
    return pearson(average_ranks(x), average_ranks(y))


GLUE_TASK_METRICS: dict[str, str] = {
    "cola": "mcc",
    "ax": "mcc",
    "sst2": "acc",
    "qnli": "acc",
    "rte": "acc",
    "wnli": "acc",
    "mnli": "acc",
    "mnli-m": "acc",
    "mnli-mm": "acc",
    "mrpc": "acc_and_f1",
    "qqp": "acc_and_f1",
    "stsb": "corr",
}

_GLUE_ALIASES = {"sst-2": "sst2", "sts-b": "stsb", "mnli_matched": "mnli-m", "mnli_mismatched": "mnli-mm"}


def canonical_glue_task(task: str) -> str:
    name = task.strip().lower()
    name = _GLUE_ALIASES.get(name, name)
    if name not in GLUE_TASK_METRICS:
        raise ValueError(f"unknown GLUE task {task!r}; expected one of {sorted(GLUE_TASK_METRICS)}")
    return name


def glue_metrics(task: str, predictions, labels) -> dict[str, float]:
    """The GLUE metric set of `task`.

    cola/ax: {"mcc"}; sst2/qnli/rte/wnli/mnli(-m/-mm): {"acc"}; mrpc/qqp: {"acc", "f1", "acc_and_f1"};
    stsb: {"pearson", "spearman", "corr"} where the last is the mean of the two.
    """
    kind = GLUE_TASK_METRICS[canonical_glue_task(task)]
    if kind == "mcc":
        return {"mcc": matthews_corrcoef(predictions, labels)}
    if kind == "acc":
        return {"acc": accuracy(predictions, labels)}
    if kind == "acc_and_f1":
        acc, f1 = accuracy(predictions, labels), f1_binary(predictions, labels)
        return {"acc": acc, "f1": f1, "acc_and_f1": (acc + f1) / 2}
    r, rho = pearson(predictions, labels), spearman(predictions, labels)
    return {"pearson": r, "spearman": rho, "corr": (r + rho) / 2}


# ----------------------------------------------------------------------------- the user's own data


def f1_macro(predictions, labels) -> float:
    """The unweighted mean of each class's F1, 2·tp / (2·tp + fp + fn), over the classes that occur in the labels
    or the predictions (scikit-learn's f1_score(average="macro"))."""
    predictions, labels = _pair(predictions, labels)
    classes, indices = np.unique(np.concatenate([labels, predictions]), return_inverse=True)  # counted, not scanned
    y, p = indices[: len(labels)], indices[len(labels) :]
    tp = np.bincount(y[p == y], minlength=len(classes))
    fp, fn = np.bincount(p, minlength=len(classes)) - tp, np.bincount(y, minlength=len(classes)) - tp
    return float(np.mean(2 * tp / (2 * tp + fp + fn)))


def classification_metrics(predictions, labels) -> dict[str, float]:
    """Any number of classes: {"acc", "macro_f1", "mcc"} (MCC in its multi-class form)."""
    return {
        "acc": accuracy(predictions, labels),
        "macro_f1": f1_macro(predictions, labels),
        "mcc": matthews_corrcoef(predictions, labels),
    }


def regression_metrics(predictions, labels) -> dict[str, float]:
    """{"pearson", "spearman"} (NaN when either side is constant)."""
    return {"pearson": pearson(predictions, labels), "spearman": spearman(predictions, labels)}


# ----------------------------------------------------------------------------- SQuAD

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, drop ASCII punctuation, replace the articles a/an/the by a space, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _answer_tokens(text: str) -> list[str]:
    return normalize_answer(text).split() if text else []


def exact_match(prediction: str, gold: str) -> int:
    return int(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    """Bag-of-tokens F1 of the normalized answers; 1/0 by equality when either side has no tokens."""
    gold_tokens, pred_tokens = _answer_tokens(gold), _answer_tokens(prediction)
    if not gold_tokens or not pred_tokens:
        return float(gold_tokens == pred_tokens)
    common = collections.Counter(gold_tokens) & collections.Counter(pred_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _gold_or_unanswerable(gold: Sequence[str]) -> list[str]:
    kept = [answer for answer in gold if normalize_answer(answer)]
    return kept or [""]


def squad_raw_scores(
    gold_answers: Sequence[Sequence[str]], predictions: Sequence[str]
) -> tuple[list[int], list[float], list[bool]]:
    """Per question (exact, f1, has_answer), each the maximum over that question's gold answers."""
    if isinstance(predictions, str) or len(gold_answers) != len(predictions):
        raise ValueError(
            f"gold_answers ({len(gold_answers)}) and predictions "
            f"({'a str' if isinstance(predictions, str) else len(predictions)}) must be parallel lists"
        )
    if not gold_answers:
        raise ValueError("cannot score an empty set of questions")
    exact, f1, has_answer = [], [], []
    for i, (gold, prediction) in enumerate(zip(gold_answers, predictions, strict=True)):
        if isinstance(gold, str):
            raise ValueError(f"gold_answers[{i}] must be a list of answer strings, got the str {gold!r}")
        golds = _gold_or_unanswerable(gold)
        exact.append(max(exact_match(prediction, g) for g in golds))
        f1.append(max(token_f1(prediction, g) for g in golds))
        has_answer.append(golds != [""])
    return exact, f1, has_answer


def _percent(values: Sequence[float]) -> float:
    return 100.0 * sum(values) / len(values)


def squad_scores(gold_answers: Sequence[Sequence[str]], predictions: Sequence[str]) -> dict[str, float]:
    """{"exact": %, "f1": %} over all questions; gold [] or [""] means unanswerable."""
    exact, f1, _ = squad_raw_scores(gold_answers, predictions)
    return {"exact": _percent(exact), "f1": _percent(f1)}


def squad_v2_scores(
    gold_answers: Sequence[Sequence[str]],
    predictions: Sequence[str],
    null_odds: Sequence[float] | None = None,
    null_threshold: float = 1.0,
) -> dict[str, float]:
    """The official v2.0 evaluation dict: exact, f1, total, HasAns_*/NoAns_* (when present).

    With `null_odds` (the official script's na_probs), questions whose odds exceed `null_threshold` are scored
    as if predicted unanswerable, and best_exact/best_exact_thresh/best_f1/best_f1_thresh are added.
    """
    exact, f1, has_answer = squad_raw_scores(gold_answers, predictions)
    if null_odds is not None:
        if len(null_odds) != len(predictions):
            raise ValueError(f"null_odds ({len(null_odds)}) and predictions ({len(predictions)}) differ in length")
        # predicted unanswerable: right (1) exactly when the question has no answer
        as_null = [odds > null_threshold for odds in null_odds]
        exact_t = [float(not h) if n else e for e, h, n in zip(exact, has_answer, as_null, strict=True)]
        f1_t = [float(not h) if n else f for f, h, n in zip(f1, has_answer, as_null, strict=True)]
    else:
        exact_t, f1_t = exact, f1
    result: dict[str, float] = {"exact": _percent(exact_t), "f1": _percent(f1_t), "total": len(exact_t)}
    for prefix, wanted in (("HasAns", True), ("NoAns", False)):
        idx = [i for i, h in enumerate(has_answer) if h == wanted]
        if idx:
            result[f"{prefix}_exact"] = _percent([exact_t[i] for i in idx])
            result[f"{prefix}_f1"] = _percent([f1_t[i] for i in idx])
            result[f"{prefix}_total"] = len(idx)
    if null_odds is not None:
        result.update(_best_thresholds(exact, f1, has_answer, predictions, null_odds))
    return result


def _find_best_thresh(
    scores: Sequence[float], has_answer: Sequence[bool], predictions: Sequence[str], null_odds: Sequence[float]
) -> tuple[float, float]:
    # Start from "every question answered with no answer" (right on the unanswerable ones), then switch questions
    # to their span prediction in increasing order of null odds, keeping the best running total.
    current = best = sum(1 for h in has_answer if not h)
    best_thresh = 0.0
    for i in sorted(range(len(scores)), key=lambda k: null_odds[k]):
        if has_answer[i]:
            current += scores[i]
        elif predictions[i]:
            current -= 1
        if current > best:
            best, best_thresh = current, float(null_odds[i])
    return 100.0 * best / len(scores), best_thresh


def _best_thresholds(exact, f1, has_answer, predictions, null_odds) -> dict[str, float]:
    best_exact, exact_thresh = _find_best_thresh(exact, has_answer, predictions, null_odds)
    best_f1, f1_thresh = _find_best_thresh(f1, has_answer, predictions, null_odds)
    return {
        "best_exact": best_exact,
        "best_exact_thresh": exact_thresh,
        "best_f1": best_f1,
        "best_f1_thresh": f1_thresh,
    }


def best_null_threshold(
    gold_answers: Sequence[Sequence[str]], predictions: Sequence[str], null_odds: Sequence[float]
) -> dict[str, float]:
    """The official script's find_best_thresh for EM and F1.

    `predictions` are the best non-null span texts, `null_odds` the null score minus the best non-null score.
    Predicting "" where null_odds > threshold gives best_exact (resp. best_f1) at best_exact_thresh (best_f1_thresh).
    """
    exact, f1, has_answer = squad_raw_scores(gold_answers, predictions)
    if len(null_odds) != len(predictions):
        raise ValueError(f"null_odds ({len(null_odds)}) and predictions ({len(predictions)}) differ in length")
    return _best_thresholds(exact, f1, has_answer, predictions, null_odds)


# ----------------------------------------------------------------------------- RACE

RACE_LEVELS = ("middle", "high")


def race_accuracy(predictions, labels, levels: Sequence[str]) -> dict[str, float]:
    """Accuracy on RACE-M ("middle"), RACE-H ("high") and overall ("all"); NaN for a level with no questions."""
    predictions, labels = _pair(predictions, labels)
    levels = np.asarray(levels)
    if levels.shape != labels.shape:
        raise ValueError(f"levels ({levels.shape[0] if levels.ndim else 0}) and labels ({len(labels)}) differ")
    unknown = set(levels.tolist()) - set(RACE_LEVELS)
    if unknown:
        raise ValueError(f"unknown RACE level(s) {sorted(unknown)!r}; expected 'middle' or 'high'")
    correct = predictions == labels
    result = {}
    for level in RACE_LEVELS:
        mask = levels == level
        result[level] = float(np.mean(correct[mask])) if mask.any() else float("nan")
    result["all"] = float(np.mean(correct))
    return result
