"""Training health: the checks behind the `plateau`, `divergence` and `stalled` run events, each with a message
that says what was seen and what to do about it. Pure functions; the ledger (plateau, stall) and the worker loop
(divergence) apply them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MIN_HISTORY = 3  # logged losses needed before a spike can be told from noise


@dataclass(frozen=True)
class Finding:
    event: str  # plateau | divergence | stalled
    message: str
    remedy: str

    def fields(self) -> dict[str, str]:
        return {"message": self.message, "remedy": self.remedy}


def plateau(
    evals: Sequence[tuple[int, float, float]], *, warmup_steps: int, margin: float, count: int
) -> Finding | None:
    """`evals`: (step, mlm_acc, unigram_acc) of the finished held-out evaluations, by step. A plateau is the last
    `count` of them past warmup all within `margin` of the unigram baseline on the same positions."""
    after = [e for e in evals if e[0] > warmup_steps]
    if count <= 0 or len(after) < count:
        return None
    last = after[-count:]
    if any(acc - floor > margin for _, acc, floor in last):
        return None
    step, acc, floor = last[-1]
    return Finding(
        "plateau",
        f"held-out MLM accuracy {acc:.4f} has been no more than {margin} above the unigram baseline ({floor:.4f}) "
        f"for {count} evaluations up to step {step}: the model has learned piece frequencies at most, not context",
        "give it more updates (more steps or a smaller train.global_batch_size), a larger optim.lr or optim.name = "
        '"adamw", no dropout at small scale; configs/tiny.toml is a recipe that leaves this stage on 2 CPU cores',
    )


def divergence(step: int, loss: float, grad_norm: float, recent: Sequence[float], factor: float) -> Finding | None:
    """A logged step that diverged: a non-finite loss or gradient norm, or (factor > 0) a loss above factor x the
    median of the recent logged losses."""
    remedy = (
        "lower optim.lr, lengthen optim.warmup_steps, keep optim.grad_clip on; or set train.on_divergence = "
        '"rollback" to continue from the last good checkpoint at a reduced learning rate'
    )
    if not math.isfinite(loss) or not math.isfinite(grad_norm):
        return Finding("divergence", f"step {step}: loss {loss}, gradient norm {grad_norm}: training diverged", remedy)
    if factor > 0 and len(recent) >= MIN_HISTORY:
        median = statistics.median(recent)
        if loss > factor * median:
            return Finding(
                "divergence",
                f"step {step}: loss {loss:.4g} is {loss / median:.1f}x the median {median:.4g} of the last "
                f"{len(recent)} logged steps: training diverged",
                remedy,
            )
    return None


def stalled(seconds: float, last_step: int, *, limit: float, workers: int, resources: dict[str, float]) -> Finding:
    wanted = ", ".join(f"{amount:g} {name}" for name, amount in resources.items())
    return Finding(
        "stalled",
        f"no training step reported for {seconds:.0f} s (last step {last_step})",
        f"the {workers} workers may be waiting for resources they cannot get ({wanted} each): check `ray status` "
        f"for free CPUs (an evaluation or another job may hold them); or raise train.stall_seconds ({limit:g})",
    )
