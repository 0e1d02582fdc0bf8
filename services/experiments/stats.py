"""Seed statistics of an experiment's finished cells: each group's mean and standard error over its seeds, the
difference to the reference group with a 95% interval (Welch), and the verdict on each of the spec's claims.

A group is a cell without its seed (`Cell.group`); its seeds' results are independent runs (initialization, data
order and masks all follow run.seed), so the standard error is the seeds' sample standard deviation over sqrt(n).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from services.experiments.spec import Claim, ExperimentSpec

CONFIDENCE = 0.95
REPRODUCED = "reproduced"
REVERSED = "not reproduced (the opposite holds)"
UNRESOLVED = "not resolved at this scale"
TOO_FEW = "not resolvable (fewer than 2 seeds)"


@dataclass(frozen=True)
class Estimate:
    """A mean over n seeds and its standard error (None with one seed)."""

    mean: float
    se: float | None
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Estimate:
        if not values:
            raise ValueError("Estimate.of: no values")
        n = len(values)
        mean = sum(values) / n
        if n < 2:
            return cls(mean, None, n)
        variance = sum((v - mean) ** 2 for v in values) / (n - 1)
        return cls(mean, math.sqrt(variance / n), n)


@dataclass(frozen=True)
class Difference:
    """a - b with its 95% interval (None when either side has one seed)."""

    delta: float
    low: float | None
    high: float | None

    @property
    def verdict(self) -> str:
        """Whether a > b: the interval above 0, below it, or straddling it."""
        if self.low is None or self.high is None:
            return TOO_FEW
        if self.low > 0:
            return REPRODUCED
        if self.high < 0:
            return REVERSED
        return UNRESOLVED


def difference(a: Estimate, b: Estimate | float) -> Difference:
    """Welch's interval for mean(a) - mean(b); b may be a constant (then a one-sample t interval)."""
    from scipy.stats import t

    if isinstance(b, int | float):
        b = Estimate(float(b), 0.0, math.inf)
    delta = a.mean - b.mean
    if a.se is None or b.se is None:
        return Difference(delta, None, None)
    parts = [(a.se**2, a.n)] + ([(b.se**2, b.n)] if b.se > 0 else [])
    se = math.sqrt(sum(v for v, _ in parts))
    if se == 0:
        return Difference(delta, delta, delta)
    df = se**4 / sum(v**2 / (n - 1) for v, n in parts)  # Welch-Satterthwaite
    half = float(t.ppf(0.5 + CONFIDENCE / 2, df)) * se
    return Difference(delta, delta - half, delta + half)


def group_results(spec: ExperimentSpec, results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The finished cells' results by group, in the spec's group order (groups with no finished cell left out)."""
    by_cell = {r["cell"]: r for r in results}
    groups: dict[str, list[dict[str, Any]]] = {}
    for cell in spec.expand():
        if cell.name in by_cell:
            groups.setdefault(cell.group, []).append(by_cell[cell.name])
    return {g.name: groups[g.name] for g in spec.groups() if g.name in groups}


def estimate(results: list[dict[str, Any]], metric: str) -> Estimate | None:
    values = [float(r[metric]) for r in results if r.get(metric) is not None]
    return Estimate.of(values) if values else None


def reference_group(spec: ExperimentSpec) -> str:
    return spec.reference or spec.groups()[0].name


@dataclass(frozen=True)
class Verdict:
    claim: Claim
    higher: Estimate | None
    lower: Estimate | float | None
    difference: Difference | None

    @property
    def text(self) -> str:
        return self.difference.verdict if self.difference is not None else "pending (cells not finished)"


def judge(spec: ExperimentSpec, groups: dict[str, list[dict[str, Any]]]) -> list[Verdict]:
    """Each claim of the spec decided on the finished cells."""
    verdicts = []
    for claim in spec.claims:
        higher = estimate(groups.get(claim.higher, []), claim.metric)
        lower = claim.lower if not isinstance(claim.lower, str) else estimate(groups.get(claim.lower, []), claim.metric)
        both = higher is not None and lower is not None
        verdicts.append(Verdict(claim, higher, lower, difference(higher, lower) if both else None))
    return verdicts


# ============================================================================================================
# markdown


def percent(metric: str) -> bool:
    return metric.endswith(("_acc", "_probe"))


def _scale(metric: str) -> tuple[int, int]:
    """How a metric is shown: x100 with 1 digit (accuracies), whole numbers (steps), else 3 digits."""
    return (100, 1) if percent(metric) else (1, 0) if metric == "steps" else (1, 3)


def format_estimate(metric: str, value: Estimate | float | None) -> str:
    if value is None:
        return ""
    scale, digits = _scale(metric)
    if not isinstance(value, Estimate):
        return f"{scale * value:.{digits}f}"
    mean = f"{scale * value.mean:.{digits}f}"
    return mean if value.se is None else f"{mean} ± {scale * value.se:.{digits}f}"


def format_difference(metric: str, diff: Difference | None) -> str:
    if diff is None:
        return ""
    scale, digits = _scale(metric)
    text = f"{scale * diff.delta:+.{digits}f}"
    if diff.low is None:
        return text
    return f"{text} [{scale * diff.low:+.{digits}f}, {scale * diff.high:+.{digits}f}]"


def summary_markdown(spec: ExperimentSpec, results: list[dict[str, Any]], metrics: tuple[str, ...]) -> str:
    """Per group: the seeds' mean ± standard error of each metric (and of the steps trained, when cells differ in
    them), and the difference of the claims' metrics (mlm_acc when the spec has no claims) to the reference group
    with a 95% interval."""
    groups = group_results(spec, results)
    if not groups:
        return ""
    shown = [m for m in metrics if any(r.get(m) is not None for rs in groups.values() for r in rs)]
    if len({r.get("steps") for rs in groups.values() for r in rs}) > 1:  # a budget, or cells of other lengths
        shown = ["steps", *shown]
    compared = list(dict.fromkeys(c.metric for c in spec.claims)) or ["mlm_acc"]
    reference = reference_group(spec)
    head = ["group", "seeds", *shown, *[f"Δ {m} vs {reference}" for m in compared]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rows in groups.items():
        cells = [name, str(len(rows)), *[format_estimate(m, estimate(rows, m)) for m in shown]]
        for m in compared:
            mine, ref = estimate(rows, m), estimate(groups.get(reference, []), m)
            same = name == reference or mine is None or ref is None
            cells.append("" if same else format_difference(m, difference(mine, ref)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def claims_markdown(spec: ExperimentSpec, results: list[dict[str, Any]]) -> str:
    """One row per claim: the paper's statement and numbers, ours (both sides and the difference, 95%), verdict."""
    if not spec.claims:
        return ""
    head = ["claim (paper)", "metric", "higher", "lower", "difference [95%]", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in judge(spec, group_results(spec, results)):
        c = v.claim
        paper = f"{c.text} ({c.paper})" if c.paper else c.text
        lower_name = c.lower if isinstance(c.lower, str) else "chance"
        cells = [
            paper,
            c.metric,
            f"{c.higher}: {format_estimate(c.metric, v.higher)}",
            f"{lower_name}: {format_estimate(c.metric, v.lower)}",
            format_difference(c.metric, v.difference),
            v.text,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
